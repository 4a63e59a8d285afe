"""transformers' continuous batching as `verify --hf`'s `paged` entry runs it: `generate_batch` over its
PagedAttentionCache (what `generate(cache_implementation="paged")` switches to), greedy, exactly N tokens per request,
each request's logprobs returned, prefix sharing allowed, and one persistent manager for consecutive calls, so a call
finds the blocks the calls before it left. Read in transformers 5.25's generation/continuous_batching/.

The model keeps its own attention implementation (`auto_switch_to_flash=False`): the check is of the cache, so the
attention the no-cache reference runs is the one the paged run uses. Sized for the requests it is given: one forward
holds every prompt of a call (`max_batch_tokens`), and the blocks hold every request of every call without evicting.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from kvbench.errors import one_line

if TYPE_CHECKING:
    from kvbench.hf.models import CausalLM

PAGE_SIZES = (16, 256)  # tokens per page: a block boundary inside every prompt, and whole prompts inside one page
CB_LOGGER = "ContinuousBatchingLogger"  # transformers' continuous batching logs here, to a handler of its own
# the ContinuousBatchingConfig fields the entry needs (5.18 and 5.25 have each; 5.25 adds auto_switch_to_flash, set
# where there: 5.18 switches to flash attention only where a flash kernel is installed, never on the CPU)
CB_FIELDS = ("page_size", "num_blocks", "max_batch_tokens", "allow_block_sharing", "return_logprobs")
# attention implementations continuous batching runs (ContinuousBatchingManager.switch_to_cb_friendly_attn, 5.25)
CB_ATTENTION = ("eager", "sdpa", "paged|eager")


@dataclass
class Request:
    """One request of a `generate_batch` call, as transformers returned it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated
    logprobs: list[float] = field(default_factory=list)  # of each generated token; empty where not returned
    error: str | None = None  # the request failed, or never came back
    found: int | None = None  # prompt tokens in blocks already cached before the call (None: not readable)


def unavailable(model: CausalLM, device: torch.device) -> str | None:
    """Why transformers' continuous batching cannot run this model here, in one line, read from transformers' own
    code where it has a rule; None where it can."""
    if not hasattr(model, "generate_batch"):
        return f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    config = getattr(transformers, "ContinuousBatchingConfig", None)
    fields = getattr(config, "__dataclass_fields__", {})
    lacks = [f for f in CB_FIELDS if f not in fields]
    if config is None or lacks:
        return f"transformers {transformers.__version__}'s ContinuousBatchingConfig lacks {', '.join(lacks)} (5.25 has them)"
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    try:
        group_layers_by_attn_type(model.config.get_text_config())
    except ValueError as e:  # "Invalid layer type: ...": it pages full and sliding-window attention layers only
        return f"continuous batching pages full and sliding-window attention layers only ({one_line(e)})"
    except Exception as e:  # a config it cannot read its layers from (no num_hidden_layers, ...)
        return f"continuous batching cannot read this model's layers from its config ({one_line(e)})"
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    try:  # how it sizes a page: one head_dim and one count of key/value heads for every layer
        find_num_key_value_heads(model.config.get_text_config())
        find_head_dim(model.config.get_text_config())
    except Exception as e:  # Gemma 4's per-layer head_dim, read globally, raises
        return f"continuous batching cannot size its pages from this model's config ({one_line(e)})"
    attention = str(getattr(model.config, "_attn_implementation", None))
    if attention not in CB_ATTENTION and not attention.startswith("flash_attention"):
        return f"continuous batching runs eager, sdpa or flash attention, not {attention}"
    return None


def cb_config(page: int, blocks: int, batch_tokens: int, sharing: bool = True) -> Any:
    """The ContinuousBatchingConfig of one run: `blocks` of `page` tokens, `batch_tokens` per forward, greedy
    logprobs returned, block sharing as asked, the model's own attention kept."""
    config = transformers.ContinuousBatchingConfig
    keep: dict[str, Any] = {"auto_switch_to_flash": False} if switches_attention() else {}
    return config(
        page_size=page,
        num_blocks=blocks,
        max_batch_tokens=batch_tokens,
        allow_block_sharing=sharing,
        return_logprobs=True,
        **keep,
    )


def switches_attention() -> bool:
    """Whether this transformers' continuous batching may switch the model to flash attention, and so takes
    auto_switch_to_flash (5.25 does; 5.18 switches only where a flash kernel is installed, with no option)."""
    return "auto_switch_to_flash" in getattr(transformers.ContinuousBatchingConfig, "__dataclass_fields__", {})


def sizes(calls: list[list[int]], new: int, page: int) -> tuple[int, int]:
    """(blocks, max_batch_tokens) for calls of these prompt lengths: every request of every call in its own blocks
    (so nothing cached is evicted), every prompt of a call in one forward."""
    blocks = sum(math.ceil((n + new) / page) for lens in calls for n in lens) + 2
    return blocks, max(sum(lens) for lens in calls)


@dataclass
class Log:
    """What transformers' continuous batching logged at ERROR while it ran: the lines, and for each exception it
    logged with its traceback (a crash of the generation loop, which fails the requests with the message alone) the
    message in full: its type and where it was raised."""

    lines: list[str] = field(default_factory=list)
    raised: dict[str, str] = field(default_factory=dict)  # str(exception) -> "Type: message (in function, file:line)"

    def keep(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.lines.append(record.getMessage())
            if record.exc_info and record.exc_info[1] is not None:
                self.raised[str(record.exc_info[1])] = raised_where(record.exc_info[1])
        return False  # nothing reaches the terminal


def raised_where(e: BaseException) -> str:
    """'Type: message (in function, path:line)' with the innermost frame of its traceback, the path from the
    package down (transformers/models/mpt/modeling_mpt.py)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return f"{type(e).__name__}: {e}"
    code = tb.tb_frame.f_code
    path = Path(code.co_filename).parts
    where = "/".join(path[path.index("transformers") :] if "transformers" in path else path[-2:])
    return f"{type(e).__name__}: {e} (in {getattr(code, 'co_qualname', code.co_name)}, {where}:{tb.tb_lineno})"


@contextmanager
def cb_log() -> Iterator[Log]:
    """transformers' continuous-batching log kept off the terminal while it runs and its errors collected: a filter
    on the logger, since generate_batch swaps the logger's handlers for tqdm's while it runs."""
    log, kept = logging.getLogger(CB_LOGGER), Log()
    log.addFilter(kept.keep)
    try:
        yield kept
    finally:
        log.removeFilter(kept.keep)


class Manager:
    """One persistent continuous-batching manager on `model`: each `call` is a `generate_batch` of greedy requests
    of exactly `new` tokens; `close` destroys it (and so its cache)."""

    def __init__(self, model: CausalLM, new: int, config: Any) -> None:
        from transformers import GenerationConfig

        self.model, self.new, self.config = model, new, config
        # no end-of-sequence token (-1 disables it), no sampling: exactly `new` argmax tokens, no logits processor
        self.generation = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1)
        self.sharing: bool | None = None  # whether the cache shares blocks, once it exists
        self.errors: list[str] = []

    def cache(self) -> Any:
        manager = getattr(self.model, "_cached_continuous_batching_manager", None)
        return getattr(getattr(manager, "batch_processor", None), "cache", None)

    def found(self, prompt: list[int]) -> int | None:
        """Prompt tokens the cache would serve from blocks it holds: transformers' own prefix match (as
        `PagedAttentionCache.search_prefix_match` makes it, without acquiring the blocks); None where unreadable."""
        cache = self.cache()
        if cache is None:  # no call yet: nothing is cached
            return 0
        allocators = getattr(cache, "cache_allocators", None)
        if not allocators:
            return None
        if not cache.use_prefix_sharing:
            return 0
        return min(len(a.match_prefix_blocks(prompt)) * a.tokens_per_page for a in allocators.values())

    @torch.no_grad()
    def call(self, prompts: list[list[int]]) -> list[Request]:
        requests = [Request(p, found=self.found(p)) for p in prompts]
        with cb_log() as log:
            out = self.model.generate_batch(
                prompts,
                generation_config=self.generation,
                continuous_batching_config=self.config,
                persistent_manager=True,
                progress_bar=False,
            )
        cache = self.cache()
        self.sharing = None if cache is None else bool(getattr(cache, "use_prefix_sharing", False))
        self.errors += log.lines
        returned = list(out.values())
        for r in requests:  # by prompt: a request that never came back is missing, not misattributed
            o = next((o for o in returned if list(o.prompt_ids) == r.prompt), None)
            if o is None:
                r.error = "no result came back" + (f" (transformers logged: {log.lines[0]})" if log.lines else "")
                continue
            returned.remove(o)
            r.tokens, r.logprobs = list(o.generated_tokens), list(o.logprobs)
            r.error = None if o.error is None else log.raised.get(o.error, o.error)
        return requests

    def close(self) -> None:
        with cb_log():
            self.model.destroy_cached_continuous_batching_manager()
