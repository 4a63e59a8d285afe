"""The per-layer KV-cache contract every cache implements, and `CacheSpec`, how a design is registered.

The contract (one object per layer):
    update(k, v, positions) -> (k, v)   store this call's keys/values (B, H, T, Dh); return what attention reads,
                                         (B, H, S, Dh) with the filled slots first (S >= length)
    length        tokens (columns) filled so far
    capacity      slots available, or None when the cache grows without bound
    key_positions optional: a cache that evicts sets it after each update to the positions of the slots it returned,
                  (B, S) long, -1 for an unused slot; attention then masks by position (model/gpt2.py AttentionMask)
    visible       which of the positions it holds a query may read, on top of the causal rule: a method
                  (q_pos (B, T), k_pos (B, S)) -> (B, T, S) bool, or None (the default: causal only); the model's
                  mask asks each layer cache, so a design states its own policy (an eviction window, sinks)
    reset()       forget everything, keep the allocation for reuse
    nbytes        bytes of tensor storage held or reserved right now
    bytes_copied  bytes of already-cached history copied by updates (the price of torch.cat)

The lifecycle (every built-in design; optional for a plugin, see `missing_lifecycle` in plugins.py):
    crop(n)         keep columns 0..n-1 (B, H, n, Dh), forget the rest; the next update writes at column n. (A cache
                    that evicts keeps the first n tokens written: every position < n it still holds.)
                    crop(0) empties it and it stays usable; n outside 0..length is a KVBenchError, never a clamp.
                    Attention never reads a forgotten column again.
    fork() -> cache an independent cache with the same contents (and counters): a write to either never shows in
                    the other. paged shares its blocks and copies a block on its first write (copy-on-write).
    reorder(index)  index: 1-D integer tensor of batch rows (any device; rows may repeat or be dropped, as beam
                    search does). Afterwards row i holds old row index[i]: (len(index), H, length, Dh). Rows that
                    came from the same old row never alias: a write to one does not show in the other.
The lifecycle moves no `bytes_copied`: that counter stays the price of updates (paged's copy-on-write copy happens in
the update that writes the shared block, and is counted there).

Attention's only cache code is the one `update` call. Columns are the caller's: with left padding a column is not a
position, so `positions` (B, T) is passed for caches that need it and the slot index is the write pointer.
Implementations import this module (never the registry); plugins from outside the repository too, through
`from kvbench.caches import CacheSpec, LayerCache`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import torch

from kvbench.errors import CacheOverflowError, KVBenchError
from kvbench.model.gpt2 import GPTConfig, Visible

LIFECYCLE = ("crop", "fork", "reorder")  # the lifecycle members of the contract (optional for a plugin)


class LayerCache:
    """Base of the per-layer caches: the counters every implementation shares.

    `crop`, `fork` and `reorder` raise NotImplementedError here: a design that does not override them lacks them
    (plugins.missing_lifecycle). `check_crop` and `check_index` validate their arguments for every design.
    """

    capacity: int | None = None
    # which held positions a query may read beyond the causal rule (see the module docstring): None, causal only; a
    # design that evicts or masks defines it as a method (q_pos (B, T), k_pos (B, S)) -> (B, T, S) bool
    visible: Visible | None = None

    def __init__(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def in_place_slot(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Where a fused one-row decode step (model/gpt2.py) may write the next token's K/V itself: (k, v, slot), the
        (B, H, L, Dh) buffers and the column to write, every column before it holding the tokens so far; the step
        then reads columns [0, slot] and calls `wrote_in_place`. None (the default): the step calls `update`. Asking
        changes nothing."""
        return None

    def wrote_in_place(self, end: int) -> None:
        """The fused step wrote column `end - 1` of `in_place_slot`'s buffers."""
        self.length = end

    def reset(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def crop(self, length: int) -> None:
        """Keep the first `length` columns, forget the rest; the next update writes at column `length`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement crop")

    def fork(self) -> LayerCache:
        """An independent cache with the same contents: a write to either never shows in the other."""
        raise NotImplementedError(f"{type(self).__name__} does not implement fork")

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (1-D, may repeat and drop rows) in that order: batch size becomes len(index)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement reorder")

    def check_crop(self, length: int, written: int | None = None) -> int:
        """`length` for crop as an int in 0..self.length (0..written for a cache that evicts: the tokens written so
        far); anything else is an error naming both numbers."""
        try:
            n = operator.index(length)
        except TypeError:
            raise KVBenchError(f"crop({length!r}): the length must be an integer") from None
        top = self.length if written is None else written
        if isinstance(length, bool) or not 0 <= n <= top:
            held = f"the cache holds {top} tokens" if written is None else f"{top} tokens were written"
            raise KVBenchError(f"crop({length!r}) outside 0..{top}: {held}")
        return n

    def check_index(self, index: torch.Tensor, batch: int | None, device: torch.device | None) -> torch.Tensor:
        """`index` for reorder over `batch` rows: a non-empty 1-D integer tensor of values in 0..batch-1, on any
        device; returned as a long tensor on `device`. batch None (rows not known here): only negative rows are refused."""
        if not isinstance(index, torch.Tensor):
            raise KVBenchError(f"reorder: index must be a 1-D integer tensor, got {type(index).__name__}")
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise KVBenchError(f"reorder: index must be a 1-D integer tensor, got dtype {index.dtype}")
        if index.dim() != 1 or index.numel() == 0:
            raise KVBenchError(
                f"reorder: index must be a non-empty 1-D tensor of batch rows, got shape {tuple(index.shape)}"
            )
        lo, hi = int(index.min()), int(index.max())
        if batch is None and lo < 0:
            raise KVBenchError(f"reorder: row {lo} is negative")
        if batch is not None and (lo < 0 or hi >= batch):
            bad = lo if lo < 0 else hi
            raise KVBenchError(f"reorder: row {bad} outside 0..{batch - 1}: the cache holds {batch} rows")
        return index.to(device=device, dtype=torch.long)

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
    attention reads `slot` bytes for each of L slots (each of the buffer's `capacity` slots when `whole_buffer`,
    `slots(L)` of them when the design evicts),
    this token's write is `write(slot, q8)`, and the design moves `extra(L, slot, q8)` on top (copies, gathers,
    dequantisation). The design's own minimum: temporaries an implementation allocates on the way are overhead.
    """

    note: str  # what the design moves on top, in words
    whole_buffer: bool = False  # attention reads every slot of its buffer (masked), not only the filled ones
    extra: Callable[[int, int, int], int] = _no_extra  # (L, slot, q8) -> bytes
    write: Callable[[int, int], int] = _one_slot  # (slot, q8) -> bytes of this token's K/V write
    slots: Callable[[int], int] | None = None  # L -> the slots attention reads at context L (None: L)


UNKNOWN_TRAFFIC = Traffic("design traffic unknown (a plugin): weights and K/V of L slots only")


@dataclass(frozen=True)
class CacheSpec:
    """How a cache design is registered: its facts in three groups, each field once.

    - the design: what it is and how its layers are built and run (name, summary, factory, fixed_step, padding,
      storage_dtype, by_default);
    - its policy: what `verify` holds it to (exact, logit_atol, logit_rtol, min_greedy_agreement; a lossy design's
      declared roundtrip and visible, check/policy.py; what it holds, holds);
    - its costs: what a decode step moves (traffic, the floor) and what its footprint means (memory_note).
    Every field after `factory` is passed by keyword (a plugin's spelling: `CacheSpec(name, summary, factory,
    exact=False, roundtrip=...)`, docs/caches.md).
    """

    # --- the design -------------------------------------------------------------------------------------------------
    name: str
    summary: str
    # Builds one layer's cache: (config, batch, max_len, dtype, device) -> LayerCache. None: no cache at all.
    factory: Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache] | None
    _: KW_ONLY
    # Its decode step runs as one fixed-shape function over StaticGraphCache buffers (decode/fixed_step.py), which can
    # be compiled (--compile) and, on CUDA, captured as a CUDA graph; the layer caches must be StaticGraphCache.
    fixed_step: bool = False
    # It takes a left-padded batch (False: a design that evicts by position, whose slots are not columns).
    padding: bool = True
    # The element type it stores K and V in (a kvbench.dtypes name: int8), when it is not the model's dtype.
    storage_dtype: str | None = None
    # In the default set of caches (no --caches given). False: run when named or with --caches all (an eviction
    # design: how far it strays from full attention is the policy's choice, not a verdict; its policy rows judge it).
    by_default: bool = True

    # --- its policy: what verify holds it to ------------------------------------------------------------------------
    # exact: cached logits equal full recomputation up to kernel rounding (False for lossy caches). How `verify`
    # judges a lossy cache is documented with it: the largest |logit error| against full recomputation in fp32,
    # logit_atol + logit_rtol x (the row's largest |logit|), and the least fraction of greedy tokens (teacher-forced)
    # that must agree with the `none` path.
    exact: bool = True
    logit_atol: float = 1e-5
    logit_rtol: float = 1e-5
    min_greedy_agreement: float = 1.0
    # A lossy design's policy, declared so `verify` holds it to an exact reference (check/policy.py): the reference
    # applies these to every token and nothing else, and the design must match it at the exact tolerance.
    # roundtrip: what it stores for each token's K or V, (B, H, T, Dh) -> the same shape (quantise, then dequantise).
    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None = None
    # visible: which cached positions a query may still read (an eviction policy), (q_pos (B, T), k_pos (B, S)) ->
    # (B, T, S) bool on top of the causal rule; the design's layer caches state it (LayerCache.visible), and the
    # model's mask asks them.
    visible: Visible | None = None
    # The tokens a sequence holds between steps at a context of L, for a design that evicts (the planner's figure
    # for it, memory --measure); None: all L.
    holds: Callable[[int], int] | None = None

    # --- its costs --------------------------------------------------------------------------------------------------
    # What a decode step moves (the floor); None: unknown (a plugin that does not say), counted as weights and
    # the K/V of the filled slots only, and labelled so.
    traffic: Traffic | None = None
    # What the memory measurement says of its footprint beyond the bytes (kvbench memory --measure).
    memory_note: str = ""

    @property
    def held_to_policy(self) -> bool:
        """verify holds it exactly to a reference of its declared policy (the `=policy` rows, check/policy.py): a
        cached design that declares `roundtrip` or `visible` and runs through the model's own step (not a fixed-step
        design). Its distance from full precision is then its policy's cost (distortion), not a verdict."""
        declared = self.roundtrip is not None or self.visible is not None
        return self.factory is not None and not self.fixed_step and declared


def cache_nbytes(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.nbytes for c in caches)


def cache_bytes_copied(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.bytes_copied for c in caches)
