"""A Hugging Face causal LM with one of transformers' caches (hf/caches.py) as a check subject.

The model is its own reference: transformers' no-cache path on the same model object, `generate(use_cache=False)`
for greedy tokens and one forward with `use_cache=False` over a whole prefix for single steps, the inputs built as
`generate` builds them (`forward_inputs`: ids, an attention mask, and the position ids `generate` passes to a model
whose forward takes them; a model that does not derives its own). Every cached run goes through `generate` exactly
as a user calls it, with the cache selected by name.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, cast

import torch

from kvbench.check.hf_replay import HFReplay
from kvbench.check.judge import tolerance
from kvbench.check.subject import NoCache, Run, Unsupported
from kvbench.hf.caches import HF_CACHES, generate_kwargs, reuse_kwargs
from kvbench.hf.engine import fixed_length
from kvbench.hf.introspect import cache_kwarg, measured_no_cache, returned_cache
from kvbench.hf.known import known_defect
from kvbench.hf.models import LoadedHF

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from kvbench.hf.models import CausalLM

NO_CACHE_SOURCE = "generate(use_cache=False)"


@torch.no_grad()  # as generate itself runs: a cache it returns can be reset() and reused by the caller
def generate_run(loaded: LoadedHF, prompts: list[list[int]], new: int, **kwargs: Any) -> Run:
    """Greedy `generate` of exactly `new` tokens for `prompts`, left-padded with an attention mask."""
    model = loaded.model
    device = next(model.parameters()).device
    T = max(map(len, prompts))
    ids = torch.tensor([[loaded.pad_token_id] * (T - len(p)) + p for p in prompts], device=device)  # (B, T)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, T)
    out = model.generate(**fixed_length(ids, new, loaded.pad_token_id, mask, logits=True), **kwargs)
    logits = torch.stack([step.float().cpu() for step in out.logits], dim=1)  # (B, N, V)
    assert logits.shape[1] == new, f"generate returned {logits.shape[1]} logit steps, expected {new}"
    cache = returned_cache(out)
    layers = [type(x).__name__ for x in getattr(cache, "layers", [])] if cache is not None else []
    return Run(out.sequences[:, T:].tolist(), logits, layers, cache)


def forward_inputs(model: CausalLM, ids: torch.Tensor, start: int = 0) -> dict[str, torch.Tensor]:
    """The inputs `generate` gives the model's forward for unpadded `ids` (B, T) written after `start` tokens:
    position ids start..start+T-1 where the forward takes them (generate derives them from the attention mask; a
    model's own default may differ: RoBERTa-family decoders count from padding_idx + 1), otherwise none."""
    takes = "position_ids" in inspect.signature(model.forward).parameters
    if not takes or model.config.is_encoder_decoder:
        return {}
    pos = torch.arange(start, start + ids.size(1), device=ids.device)
    return {"position_ids": pos.unsqueeze(0).expand(ids.size(0), -1)}


@torch.no_grad()
def full_logits(loaded: LoadedHF, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over prompt + tokens[:-1]: (T + N - 1, V) fp32 on the CPU; row T-1+i predicts step i."""
    device = next(loaded.model.parameters()).device
    ids = torch.tensor([prompt + tokens[:-1]], device=device)  # (1, T + N - 1)
    kw = forward_inputs(loaded.model, ids)
    out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)
    return out.logits[0].float().cpu()


class HFModel:
    """A loaded Hugging Face model as the model under test; its no-cache runs memoised, shared by every cache."""

    reference_name: str | None = None  # the model is its own reference

    def __init__(self, loaded: LoadedHF) -> None:
        self.loaded = loaded
        self.dtype = next(loaded.model.parameters()).dtype
        self.device = next(loaded.model.parameters()).device
        self._full: dict[tuple, torch.Tensor] = {}
        self._nocache: dict[tuple, Run] = {}

    @cached_property
    def caches_unsupported(self) -> str | None:
        """`cache_unsupported` of the model, measured once."""
        return cache_unsupported(self.loaded)

    def full_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(tokens))
        if key not in self._full:
            self._full[key] = full_logits(self.loaded, prompt, tokens)
        return self._full[key]

    def unjudged(self, longest: int) -> str | None:
        """Why a difference in a run of `longest` tokens says nothing about the cache, or None."""
        k = self.loaded.info.sparse_topk
        if k is None or longest <= k:
            return None
        return (
            f"a sparse-attention indexer keeps the top {k} of up to {longest} keys per query, a discontinuous "
            "choice: where index scores tie or nearly tie, a cache and the recomputation may keep different keys; "
            f"runs of at most {k} tokens (--prompt-len + --new-tokens) are judged exactly"
        )

    def left_padding_note(self) -> str:
        """What lets the pads change a padded row with no cache at all, read from the model."""
        model, info = self.loaded.model, self.loaded.info
        if info.recurrent:
            lacks = "its recurrent state reads the pads (a state is not masked)"
        elif "position_ids" not in inspect.signature(model.forward).parameters:
            lacks = "its forward takes no position ids, so its positions count the pads"
        else:
            lacks = "it takes position ids and an attention mask, yet the pads change the real tokens' logits: suspect how it derives positions or applies the mask"
        return f"with no cache at all: {info.model_type} does not support left-padded batches ({lacks})"

    def no_cache(self, prompt: list[int], new: int, cached: list[int]) -> NoCache:
        key = (tuple(prompt), new)
        if key not in self._nocache:
            self._nocache[key] = generate_run(self.loaded, [prompt], new, use_cache=False)
        ref = self._nocache[key]
        return NoCache(ref.tokens[0], ref.logits[0], f"{new} tokens vs {NO_CACHE_SOURCE}", NO_CACHE_SOURCE)


class HFSubject:
    """The model with transformers' cache `cache` (a name in HF_CACHES). `runner`: the loaded model the cached runs
    go through when it is not the model under test itself (a tensor-parallel rank's shard, held to the whole model in
    this process)."""

    # transformers raises many types (ValueError, RuntimeError, IndexError, ...): each is a failed row
    crashes: tuple[type[BaseException], ...] = (Exception,)
    # under --tp (crashes then empty): a step that raised on every rank is a failed row (suite._guarded)
    together = False

    def __init__(self, model: HFModel, cache: str, runner: LoadedHF | None = None, tp: int = 1) -> None:
        self.model, self.cache, self.spec = model, cache, HF_CACHES[cache]
        self.loaded = runner if runner is not None else model.loaded
        self.cached = self.spec.build is not None
        self.tol = tolerance(model.dtype, lossy=self.spec.lossy, tp=tp)
        self.reference_tol = self.tol
        self.cache_layers: list[str] | None = None  # what the first cached run built

    def known(self, check: str, detail: str) -> str | None:
        """A known library defect (hf/known.py); or, for a lossy cache, any failure of its loose rows: its bound is
        a sanity heuristic, so a row past it (or a raise inside the cache) is the cache's own cost or defect, reported
        with its distortion, never a verdict on the model (its exact =policy rows, where it has them, are judged)."""
        defect = known_defect(self.spec.known, check, detail, self.model.loaded.info)
        if defect or self.spec.lossy is None:
            return defect
        return (
            f"{self.cache} is lossy and this row has no exact reference: its bound is a sanity heuristic, so a row "
            "past it is the cache's own cost or defect (its distortion is reported), not the model's"
        )

    def unavailable(self) -> str | None:
        why = self.model.caches_unsupported  # the no-cache path too: it is only the caches' baseline
        if why or not self.cached:
            return why
        info = self.model.loaded.info
        return self.spec.unavailable(info, self.model.device) if self.spec.unavailable else None

    def generate(self, prompts: list[list[int]], new: int) -> Run:
        res = generate_run(self.loaded, prompts, new, **generate_kwargs(self.cache))
        if self.cache_layers is None:
            self.cache_layers = res.cache_layers
        return res

    def _build(self, max_len: int) -> Cache:
        assert self.spec.build is not None, f"{self.cache} builds no cache object"
        return self.spec.build(self.loaded.model, max_len)

    def reused(self, prev: list[int], prompt: list[int], new: int) -> tuple[Run, str]:
        obj = self._build(max(len(prev), len(prompt)) + new)
        kw = {cache_kwarg(): obj, **reuse_kwargs(self.cache)}
        generate_run(self.loaded, [prev], new, **kw)
        obj.reset()
        return generate_run(self.loaded, [prompt], new, **kw), f"a {type(obj).__name__} reset() and reused"

    def open(self, batch: int, max_len: int) -> HFSession:
        return HFSession(self.loaded, self._build(max_len))

    def generation_features(self, check: str) -> list[tuple[str, Callable, Callable]]:
        return generation_features(self, check)

    def replay(self) -> HFReplay:
        """This subject as a replay of a failing row sees it (check/locate.py)."""
        return HFReplay(self, forward_inputs)

    def missing_lifecycle(self, members: tuple[str, ...]) -> str | None:
        obj = self._build(8)
        lacks = [m for m in members if m in HF_MEMBER and not hasattr(obj, HF_MEMBER[m])]
        return f"{type(obj).__name__} has no {', '.join(HF_MEMBER[m] for m in lacks)}" if lacks else None


def cache_unsupported(loaded: LoadedHF) -> str | None:
    """Why transformers' Cache classes do not apply to this model at all, read from the model (whether it keeps a
    KV cache is measured: introspect.measured_no_cache); None if they do."""
    model, info = loaded.model, loaded.info
    if info.recurrent and not info.kv_layers:
        return f"{info.model_type} keeps a recurrent state, no KV cache"
    # transformers types this classmethod's cls as its GenerativePreTrainedModel protocol, which mypy finds no model
    # class to satisfy
    if not type(model)._supports_default_dynamic_cache():  # type: ignore[misc]
        return (
            f"{info.architecture} keeps a cache of its own: transformers builds no DynamicCache or StaticCache for "
            "it and ignores cache_implementation (GenerationMixin._supports_default_dynamic_cache() is False)"
        )
    why = measured_no_cache(model)
    if why is not None:
        return f"{info.architecture} has no KV cache: {why}, so every step recomputes the prefix"
    return None


# What transformers users call for each lifecycle operation (a fork is `copy.deepcopy`, which every cache takes).
HF_MEMBER = {"crop": "crop", "reorder": "reorder_cache"}


def crop_to(cache: Cache, length: int, held: int) -> None:
    """`Cache.crop` to `length` tokens: transformers 5.2x takes the tokens to remove as a negative number, earlier
    releases the length to keep."""
    name = next(iter(inspect.signature(cache.crop).parameters))
    cache.crop(length - held if name == "tokens_to_remove" else length)


def _recording_state(layer: object) -> bool:
    """A linear-attention (recurrent) layer recording its past (transformers 5.25+): it can be cropped only by as
    many tokens as it recorded in the last forward."""
    return bool(getattr(layer, "record_past", False)) and hasattr(layer, "recurrent_states")


class HFSession:
    """A Hugging Face model driven one forward at a time over one transformers Cache object, no padding: the model
    places each call after what the cache holds and builds its own causal mask and positions (releases whose forward
    takes `cache_position` are given it)."""

    def __init__(self, loaded: LoadedHF, cache: Cache, held: int = 0) -> None:
        self.loaded, self.cache, self.held = loaded, cache, held
        self.device = next(loaded.model.parameters()).device

    def prepare_rollback(self, most: int) -> None:
        """What transformers' own speculative decoding does before drafting: layers that can record their past
        (sliding-window layers; from transformers 5.25 linear-attention layers too) keep what a rollback needs. A
        linear layer records the recurrent state after each of the last `recurrent_states_to_keep` tokens of a
        forward (5.25 added the argument; left at its default of None, every hybrid's first forward raises)."""
        for layer in getattr(self.cache, "layers", []):
            record = getattr(layer, "activate_past_recording", None)
            if record is None:
                continue
            if "recurrent_states_to_keep" in inspect.signature(record).parameters:
                record(recurrent_states_to_keep=most)
            else:
                record()

    @torch.no_grad()
    def forward(self, ids: list[list[int]]) -> torch.Tensor:
        model = self.loaded.model
        x = torch.tensor(ids, device=self.device)  # (B, T)
        pos = torch.arange(self.held, self.held + x.size(1), device=self.device)
        kw = {cache_kwarg(): self.cache, "use_cache": True, **forward_inputs(model, x, self.held)}
        if "cache_position" in inspect.signature(model.forward).parameters:
            kw["cache_position"] = pos
        out = model(input_ids=x, **kw)
        self.held += x.size(1)
        return out.logits.float().cpu()  # (B, T, V)

    def crop(self, length: int) -> None:
        if getattr(self.cache, "is_croppable", True) is False:
            layers = sorted({type(x).__name__ for x in getattr(self.cache, "layers", []) if not x.is_croppable})
            raise Unsupported(
                f"transformers declares this {type(self.cache).__name__} not croppable after {self.held} tokens "
                f"(Cache.is_croppable False: {', '.join(layers)} cannot restore what a rollback would need)"
            )
        if length == 0 and any(_recording_state(x) for x in getattr(self.cache, "layers", [])):
            # a recurrent layer restores a recorded state, and only within the last forward: starting over is reset()
            self.cache.reset()
        else:
            crop_to(self.cache, length, self.held)
        self.held = length

    def fork(self) -> HFSession:
        return HFSession(self.loaded, copy.deepcopy(self.cache), self.held)

    def reorder(self, index: list[int]) -> None:
        self.cache.reorder_cache(cast(torch.LongTensor, torch.tensor(index, device=self.device)))


def _greedy(loaded: LoadedHF, prompt: list[int], new: int, **kwargs: Any) -> list[int]:
    return generate_run(loaded, [prompt], new, **kwargs).tokens[0]


@torch.no_grad()
def _beams(loaded: LoadedHF, prompt: list[int], new: int, **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt], device=next(loaded.model.parameters()).device)
    out = loaded.model.generate(**fixed_length(ids, new, loaded.pad_token_id, beams=3), **kwargs)
    return out.sequences[0, len(prompt) :].tolist()


def generation_features(subject: HFSubject, check: str) -> list[tuple[str, Callable, Callable]]:
    """transformers' generation features built on a lifecycle operation, each (name, run, reference): greedy
    prompt-lookup and assisted decoding (drafts, then a crop) against plain greedy; beam search (reorder every
    step) against beam search without a cache."""
    loaded, kw = subject.loaded, generate_kwargs(subject.cache)
    plain = partial(_greedy, loaded, **kw)
    if check == "rollback":
        return [
            ("generate(prompt_lookup_num_tokens=3)", partial(_greedy, loaded, prompt_lookup_num_tokens=3, **kw), plain),
            (
                "generate(assistant_model=the model itself)",
                partial(_greedy, loaded, assistant_model=loaded.model, **kw),
                plain,
            ),
        ]
    if check == "reorder":
        return [("generate(num_beams=3)", partial(_beams, loaded, **kw), partial(_beams, loaded, use_cache=False))]
    return []
