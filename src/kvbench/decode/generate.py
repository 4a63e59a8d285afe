"""Prefill and decode loops: the no-cache loop and the cached loop, sampling, batched left-padded decoding, timing.

The loop owns the positions and passes them in; the model never guesses them. A batch of prompts of different
lengths is left-padded so every sequence's last token shares the last column (the logits we sample), with a
padding mask over every column and positions that start at 0 at each sequence's first real token:

    prompt lengths 3 and 5, T = 5       ids        padding     positions
                                        _ _ a b c  0 0 1 1 1   0 0 0 1 2
                                        d e f g h  1 1 1 1 1   0 1 2 3 4
Each decode step appends one column: ids (B, 1), positions last + 1, padding mask extended by a column of ones.

The loop is written once and knows no bug. What varies is passed in as `DecodeRules`, the correct rules by default:
how prompts are laid out (`padding`), how positions start and advance (`positions`), what attention hands SDPA
(`mask`, model.MaskRule) and how passed-in caches are prepared for a new prompt (`reuse`). `kvbench break` runs this
same loop with a buggy rule in one of those places (check/faults.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.caches import get_cache_spec, make_caches
from kvbench.caches.base import cache_bytes_copied, cache_nbytes
from kvbench.decode import fixed_step
from kvbench.devices import synchronize
from kvbench.model.gpt2 import EXACT_MASK, GPT, MaskRule

PAD_ID = 0  # the id written into padding slots: never attended to, so any id in every vocabulary works


@dataclass
class Sampler:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int | None = None  # keep the k most likely tokens before sampling; None = all
    seed: int = 0  # seeds the sampling generator (per generate call, so runs are reproducible)

    def __post_init__(self) -> None:
        assert self.temperature >= 0 and (self.top_k is None or self.top_k >= 1), (
            self.temperature,
            self.top_k,
        )

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logits (B, V) -> next ids (B, 1)."""
        if self.temperature == 0:
            # the first maximum, as argmax gives it; max's indices take a third of argmax's time over a gpt2 row on the
            # CPU (torch 2.13: 23 us against 65, warm)
            return logits.max(-1, keepdim=True).indices
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)


@dataclass
class Batch:
    """Left-padded prompts. ids, positions, padding: (B, T); padding is None when no sequence is padded."""

    ids: torch.Tensor
    positions: torch.Tensor
    padding: torch.Tensor | None
    prompt_lens: list[int]


def left_pad(prompts: list[list[int]], device: torch.device | str) -> Batch:
    assert prompts and all(prompts), "left_pad needs one or more non-empty prompts"
    lens = [len(p) for p in prompts]
    B, T = len(prompts), max(lens)
    ids = torch.full((B, T), PAD_ID, dtype=torch.long)
    real = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        real[b, T - len(p) :] = 1
    positions = (real.cumsum(-1) - 1).clamp(min=0)  # 0 at each sequence's first real token
    padding = None if min(lens) == T else real.to(device)
    return Batch(ids.to(device), positions.to(device), padding, lens)


# --- the rules the loop takes (the correct ones; check/faults.py holds the buggy ones) ----------------------------------
class Padding:
    """How a batch of prompts is laid out: left-padded, so every sequence's last token shares the last column."""

    def __call__(self, prompts: list[list[int]], device: torch.device | str) -> Batch:
        return left_pad(prompts, device)


class Positions:
    """How positions start (the batch's own, 0 at each first real token) and advance (each sequence's last + 1)."""

    def start(self, batch: Batch) -> torch.Tensor:
        return batch.positions  # (B, T)

    def advance(self, positions: torch.Tensor, cached: bool) -> torch.Tensor:
        """The next forward call's positions: (B, 1) with a cache, else every column so far plus the new one."""
        nxt = positions[:, -1:] + 1  # (B, 1)
        return nxt if cached else torch.cat([positions, nxt], dim=1)


class CacheReuse:
    """How caches passed in for a new prompt are prepared: every layer's cache is reset."""

    def __call__(self, caches: list) -> None:
        for c in caches:
            c.reset()


@dataclass(frozen=True)
class DecodeRules:
    padding: Padding = field(default_factory=Padding)
    positions: Positions = field(default_factory=Positions)
    mask: MaskRule = EXACT_MASK
    reuse: CacheReuse = field(default_factory=CacheReuse)


EXACT = DecodeRules()  # the rules of every normal run


@dataclass
class GenerationResult:
    cache: str  # registry name of the cache used
    prompt_lens: list[int]  # real (unpadded) prompt length of each sequence
    tokens: list[list[int]]  # generated ids per sequence (trimmed after the stop token, if any)
    ttft_s: float  # time to first token: prefill forward + first sample, device synchronised
    step_s: list[float] = field(default_factory=list)  # each decode step (forward + sample), synchronised
    cache_bytes: int = 0  # bytes the caches hold/reserve at the end
    bytes_copied: int = 0  # history bytes copied by cache updates (torch.cat traffic)
    logits: list[torch.Tensor] | None = None  # (B, V) fp32 on the CPU for each generated token, if recorded

    @property
    def new_tokens(self) -> int:
        return 1 + len(self.step_s)

    @property
    def total_s(self) -> float:
        return self.ttft_s + sum(self.step_s)


def _decoder(
    model: GPT,
    cache: str,
    caches: list | None,
    batch: Batch,
    max_new_tokens: int,
    rules: DecodeRules,
    compile: str,
) -> tuple[list | None, Callable]:
    """What the loop runs: the caches it fills (None for `none`; the ones passed in, prepared by `rules.reuse`, or
    fresh ones for prompt + new tokens) and the forward it calls with `rules.mask`: the model itself, or a design's
    fixed-shape step function (static-graph: compiled, CUDA-graph captured)."""
    spec = get_cache_spec(cache)
    # the caller's promise (decode.rules.padding_rule): a design that evicts by position takes no left padding
    assert batch.padding is None or spec.padding, f"cache {cache} takes no left-padded batch"
    if spec.factory is None:
        caches = None
    elif caches is None:
        B, T = batch.ids.shape
        caches = make_caches(
            cache, model.cache_config, B, T + max_new_tokens, model.lm_head.weight.dtype, batch.ids.device
        )
    else:
        rules.reuse(caches)
    if caches is not None and spec.fixed_step:
        return caches, fixed_step.runner_for(model, caches, rules.mask, compile)
    return caches, functools.partial(model, mask_rule=rules.mask)


@torch.inference_mode()
def generate(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache: str = "dynamic",
    sampler: Sampler | None = None,
    stop_token: int | None = None,
    record_logits: bool = False,
    on_token: Callable[[list[int]], None] | None = None,
    caches: list | None = None,
    rules: DecodeRules = EXACT,
    compile: str = "off",
) -> GenerationResult:
    """Generate `max_new_tokens` for each prompt through the cache named `cache` ('none': recompute everything).

    Pass `caches` to reuse existing cache objects (they are prepared by `rules.reuse`, i.e. reset); otherwise fresh
    ones are allocated for prompt + new tokens. `on_token(ids)` is called with the B new ids after each token, for
    streaming. `rules`: the loop's rules (module docstring); the exact ones by default. `compile`: how a fixed-shape
    decode step runs (fixed_step.COMPILE_MODES; designs with `CacheSpec.fixed_step`).
    """
    sampler = sampler or Sampler()
    device = model.lm_head.weight.device
    batch = rules.padding(prompts, device)
    # the caller's promise (validate: new tokens, fits_context): learned positions stop at the context
    assert 1 <= max_new_tokens and batch.ids.size(1) + max_new_tokens <= model.config.block_size, (
        f"{batch.ids.size(1)} + {max_new_tokens} tokens past the context of {model.config.block_size}"
    )
    caches, forward = _decoder(model, cache, caches, batch, max_new_tokens, rules, compile)
    generator = torch.Generator(device=device).manual_seed(sampler.seed) if sampler.temperature > 0 else None
    # what the next forward sees
    ids, positions, padding = batch.ids, rules.positions.start(batch), batch.padding
    out: list[torch.Tensor] = []  # (B, 1) each
    seconds: list[float] = []  # per token: the prefill's first, then each decode step's
    logits_log: list[torch.Tensor] | None = [] if record_logits else None
    done = torch.zeros(batch.ids.size(0), 1, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        synchronize(device)
        t0 = time.perf_counter()
        # No cache: the whole sequence every step. Cached: the prompt once (prefill), then one token per step.
        logits = forward(ids, positions, caches, padding, last_only=True)[:, -1]  # (B, V)
        nxt = sampler(logits, generator)  # (B, 1)
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
        out.append(nxt)
        if logits_log is not None:
            logits_log.append(logits.float().cpu())
        if on_token is not None:
            on_token(nxt[:, 0].tolist())
        if stop_token is not None:
            done |= nxt == stop_token
            if bool(done.all()):
                break
        # The next column: the new token is real; with a cache the forward sees only it (B, 1).
        positions = rules.positions.advance(positions, cached=caches is not None)
        ids = nxt if caches is not None else torch.cat([ids, nxt], dim=1)  # (B, 1) or (B, columns so far + 1)
        if padding is not None:
            padding = torch.cat([padding, torch.ones_like(padding[:, :1])], dim=1)  # (B, columns so far + 1)
    return _result(cache, batch, out, seconds, stop_token, caches, logits_log)


def _result(cache, batch, out, seconds, stop_token, caches, logits_log) -> GenerationResult:
    """The generated ids (B, new), trimmed after the stop token, with the timings and what the caches hold."""
    tokens = torch.cat(out, dim=1).tolist()  # (B, new)
    if stop_token is not None:
        tokens = [seq[: seq.index(stop_token)] if stop_token in seq else seq for seq in tokens]
    return GenerationResult(
        cache=cache,
        prompt_lens=batch.prompt_lens,
        tokens=tokens,
        ttft_s=seconds[0],
        step_s=seconds[1:],
        cache_bytes=cache_nbytes(caches),
        bytes_copied=cache_bytes_copied(caches),
        logits=logits_log,
    )
