"""The per-layer KV-cache contract every cache implements, and `CacheSpec`, how a design is registered.

The contract (one object per layer):
    update(k, v, positions) -> (k, v)   store this call's keys/values (B, H, T, Dh); return what attention reads,
                                         (B, H, S, Dh) with the filled slots first (S >= length)
    length        tokens (columns) filled so far
    capacity      slots available, or None when the cache grows without bound
    reset()       forget everything, keep the allocation for reuse
    nbytes        bytes of tensor storage held or reserved right now
    bytes_copied  bytes of already-cached history copied by updates (the price of torch.cat)

Attention's only cache code is the one `update` call. Columns are the caller's: with left padding a column is not a
position, so `positions` (B, T) is passed for caches that need it and the slot index is the write pointer.
Implementations import this module (never the registry); plugins from outside the repository too, through
`from kvbench.caches import CacheSpec, LayerCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.errors import CacheOverflowError
from kvbench.model.gpt2 import GPTConfig


class LayerCache:
    """Base of the per-layer caches: the counters every implementation shares."""

    capacity: int | None = None

    def __init__(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def check_capacity(self, n_new: int, kind: str) -> tuple[int, int]:
        """(start, end) slots for `n_new` more tokens; a fixed-capacity cache that cannot hold them is an error
        naming its capacity."""
        start, end = self.length, self.length + n_new
        if self.capacity is not None and end > self.capacity:
            raise CacheOverflowError(
                f"{kind} KV cache overflow: {start} cached + {n_new} new = {end} tokens, capacity {self.capacity} "
                f"(allocate max_len >= prompt length + new tokens)"
            )
        return start, end

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


def _no_extra(L: int, slot: int, q8: int) -> int:
    return 0


def _one_slot(slot: int, q8: int) -> int:
    return slot


@dataclass(frozen=True)
class Traffic:
    """What one decode step of a design moves besides the weights: the floor (bench/floor.py) counts it.

    At context L (slots holding tokens, this step's included), with `slot` the bytes of one token's K and V (all
    layers, the whole batch, the model's dtype) and `q8` the same in int8 plus one scale per head:
    attention reads `slot` bytes for each of L slots (each of the buffer's `capacity` slots when `whole_buffer`),
    this token's write is `write(slot, q8)`, and the design moves `extra(L, slot, q8)` on top (copies, gathers,
    dequantisation). The design's own minimum: temporaries an implementation allocates on the way are overhead.
    """

    note: str  # what the design moves on top, in words
    whole_buffer: bool = False  # attention reads every slot of its buffer (masked), not only the filled ones
    extra: Callable[[int, int, int], int] = _no_extra  # (L, slot, q8) -> bytes
    write: Callable[[int, int], int] = _one_slot  # (slot, q8) -> bytes of this token's K/V write


UNKNOWN_TRAFFIC = Traffic("design traffic unknown (a plugin): weights and K/V of L slots only")


@dataclass(frozen=True)
class CacheSpec:
    name: str
    summary: str
    # Builds one layer's cache: (config, batch, max_len, dtype, device) -> LayerCache. None: no cache at all.
    factory: Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache] | None
    # exact: cached logits equal full recomputation up to kernel rounding (False for lossy caches). How `verify`
    # judges a lossy cache is documented with it: the largest |logit error| against full recomputation in fp32,
    # logit_atol + logit_rtol x (the row's largest |logit|), and the least fraction of greedy tokens (teacher-forced)
    # that must agree with the `none` path.
    exact: bool = True
    logit_atol: float = 1e-5
    logit_rtol: float = 1e-5
    min_greedy_agreement: float = 1.0
    # What a decode step moves (the floor); None: unknown (a plugin that does not say), counted as weights and
    # the K/V of the filled slots only, and labelled so.
    traffic: Traffic | None = None
    # What the memory measurement says of its footprint beyond the bytes (kvbench memory --measure).
    memory_note: str = ""
    # The planner's storage format (memory.KV_FORMATS) that models it, when it is not the model's dtype.
    planner_format: str | None = None
    # Its decode step runs as one fixed-shape function over StaticGraphCache buffers (decode/fixed_step.py), which can be
    # compiled (--compile) and, on CUDA, captured as a CUDA graph; the layer caches must be StaticGraphCache.
    fixed_step: bool = False


def cache_nbytes(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.nbytes for c in caches)


def cache_bytes_copied(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.bytes_copied for c in caches)
