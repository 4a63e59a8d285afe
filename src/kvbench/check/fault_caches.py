"""The injected bugs themselves, each a buggy rule or a buggy cache subclass passed into the loop from outside
(check/faults.py registers them for `kvbench break`), and the layer-cache factories that build the buggy caches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.caches import sink
from kvbench.caches.base import LayerCache
from kvbench.caches.dynamic import DynamicCache
from kvbench.caches.int8 import Int8Cache, dequantize, quantize
from kvbench.caches.sink import SinkCache
from kvbench.caches.static import StaticCache
from kvbench.decode.generate import PAD_ID, Batch, CacheReuse, Padding, Positions, left_pad
from kvbench.model.gpt2 import GPTConfig, MaskRule
from kvbench.model.tp import config_place

# a layer cache's factory, as a design's (CacheSpec.factory): (config, batch, max_len, dtype, device)
LayerFactory = Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache]


# --- the buggy rules and the buggy cache ------------------------------------------------------------------------
class RestartingPositions(Positions):
    """BUG on purpose: every forward call's positions are arange(T) of that call, so a cached decode step (T = 1)
    embeds its token at position 0."""

    def start(self, batch: Batch) -> torch.Tensor:
        B, T = batch.ids.shape
        return torch.arange(T, device=batch.ids.device).expand(B, T)

    def advance(self, positions: torch.Tensor, cached: bool) -> torch.Tensor:
        B, n = positions.size(0), 1 if cached else positions.size(1) + 1
        return torch.arange(n, device=positions.device).expand(B, n)


class CausalFlagInDecode(MaskRule):
    """BUG on purpose: SDPA's causal flag for a query block shorter than its keys (a cached decode step). SDPA aligns
    that mask top-left, so the one decode query attends only to key 0."""

    def adjust(
        self, T: int, S: int, attn_mask: torch.Tensor | None, is_causal: bool
    ) -> tuple[torch.Tensor | None, bool]:
        return (None, True) if T < S else (attn_mask, is_causal)


class RightPadding(Padding):
    """BUG on purpose: right padding, positions 0..T-1, no padding mask; short rows end in pads, so the logits at
    [:, -1] are a pad's."""

    def __call__(self, prompts: list[list[int]], device: torch.device | str) -> Batch:
        lens = left_pad(prompts, device).prompt_lens  # the same checks on the prompts
        B, T = len(prompts), max(lens)
        ids = torch.full((B, T), PAD_ID, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Batch(ids.to(device), torch.arange(T).expand(B, T).to(device), None, lens)


class NoReset(CacheReuse):
    """BUG on purpose: caches passed in for a new prompt keep the previous prompt's K/V."""

    def __call__(self, caches: list) -> None:
        pass


class PointerOneShort(StaticCache):
    """BUG on purpose: the write pointer is left on the last written slot instead of one past it, so the next
    token's K/V overwrite this one's."""

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_view, v_view = super().update(k, v, positions)
        self.length -= 1
        return k_view, v_view


def pointer_one_short(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> StaticCache:
    return PointerOneShort(batch, c.n_head, max_len, c.head_dim, dtype, device)


class StaleCrop(DynamicCache):
    """BUG on purpose: crop lowers the count but keeps the rejected columns, so attention still reads them."""

    def crop(self, length: int) -> None:
        self.length = length


class AliasedFork(StaticCache):
    """BUG on purpose: fork returns a cache over the same storage, so one continuation writes into the other."""

    def fork(self) -> StaticCache:
        twin = StaticCache.__new__(StaticCache)
        twin.__dict__.update(self.__dict__)  # the same k and v tensors: views, not copies
        return twin


class KeysOnlyReorder(StaticCache):
    """BUG on purpose: reorder moves the rows of K but not those of V."""

    def reorder(self, index: torch.Tensor) -> None:
        self.k = self.k.index_select(0, index)


class NeighbourSlice(DynamicCache):
    """BUG on purpose: a hand-off of K/V between tensor-parallel ranks (all-gather every rank's heads, keep this
    rank's slice) that keeps the next rank's slice, an off-by-one rank offset: each rank caches, and attends with,
    another rank's heads. In one process the next rank is itself, so nothing changes."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.size > 1:
            k, v = self._next_rank(k), self._next_rank(v)
        return super().update(k, v, positions)

    def _next_rank(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous())
        return parts[(self.rank + 1) % self.size]  # the correct hand-off keeps parts[self.rank]


class RankZeroCrop(DynamicCache):
    """BUG on purpose: a rollback applied on rank 0 only (the rank that decided it); the other ranks keep the rejected
    draft columns and attend to them. In one process rank 0 is every rank, so nothing changes."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def crop(self, length: int) -> None:
        if self.rank == 0:
            super().crop(length)


class HalfScalesReorder(Int8Cache):
    """BUG on purpose: reorder moves the scales through an fp16 copy, rounding every scale to 11 bits: each value
    of a reordered row moves by up to 1 part in 2,048, inside the loose bound, off the declared roundtrip."""

    def reorder(self, index: torch.Tensor) -> None:
        idx = self.check_index(index, self.k_q.size(0), self.k_q.device)
        self.k_q, self.v_q = self.k_q.index_select(0, idx), self.v_q.index_select(0, idx)
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            setattr(self, name, scale.half().index_select(0, idx).to(scale.dtype))


class RequantisedFork(Int8Cache):
    """BUG on purpose: fork copies through the dequantised values and quantises them again with fp16 scales (a
    serialisation path), so the copy's values round twice: a small error, inside the loose bound, off the policy."""

    def fork(self) -> Int8Cache:
        other = super().fork()
        n = self.length
        for q, sc in (("k_q", "k_scale"), ("v_q", "v_scale")):
            x = dequantize(getattr(self, q)[:, :, :n], getattr(self, sc)[:, :, :n], torch.float16)
            requant, scale = quantize(x, torch.float16)
            getattr(other, q)[:, :, :n] = requant
            getattr(other, sc)[:, :, :n] = scale.to(getattr(other, sc).dtype)
        return other


class EvictsOneMore(SinkCache):
    """BUG on purpose: eviction keeps a window one token short (an off-by-one in `k > q - W`), so every query loses the
    oldest position it should still read: inside the loose bound of an eviction policy, off its declaration."""

    def _evict(self, first_query: torch.Tensor) -> None:
        super()._evict(first_query + 1)


class ChunkCausal(MaskRule):
    """BUG on purpose: SDPA's causal flag for a block of T > 1 queries over past + T keys (a chunk after the first,
    a block of draft tokens). SDPA aligns it top-left, so the block attends to the first keys, not its own past."""

    def adjust(
        self, T: int, S: int, attn_mask: torch.Tensor | None, is_causal: bool
    ) -> tuple[torch.Tensor | None, bool]:
        return (None, True) if 1 < T < S else (attn_mask, is_causal)


def layer_factory(cls: type[DynamicCache | StaticCache]) -> LayerFactory:
    """The layer-cache factory (config, batch, max_len, dtype, device) of a buggy subclass."""

    def make(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        if issubclass(cls, DynamicCache):
            return cls()
        return cls(batch, c.n_head, max_len, c.head_dim, dtype, device)

    return make


def half_scales_reorder(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> Int8Cache:
    return HalfScalesReorder(batch, c.n_head, max_len, c.head_dim, dtype, device)


def requantised_fork(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> Int8Cache:
    return RequantisedFork(batch, c.n_head, max_len, c.head_dim, dtype, device)


def evicts_one_more(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> SinkCache:
    return EvictsOneMore(sink.DEFAULT_SINK, sink.DEFAULT_WINDOW)


def neighbour_slice(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> NeighbourSlice:
    at = config_place(c)
    return NeighbourSlice(at.rank, at.world)


def rank_zero_crop(c: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> RankZeroCrop:
    return RankZeroCrop(config_place(c).rank)
