"""The `static-graph` cache: static buffers whose decode step has one fixed shape (decode/fixed_step.py), captured once as
a CUDA graph on CUDA.

A `StaticGraphCache` used directly through `model(...)` (without the fixed-shape runner) behaves as a static cache
whose decode step returns the whole buffer, so the model's `AttentionMask` excludes the unfilled tail; that path is
exact too.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import CacheSpec, Traffic
from kvbench.caches.static import StaticCache


class StaticGraphCache(StaticCache):
    """A static cache for the fixed-shape decode step. Same (B, H, max_len, Dh) buffers as `StaticCache`.

    Prefill (T > 1) returns the filled prefix (SDPA's fast causal path); a decode step (T == 1) returns the whole
    buffer, unfilled tail included, which the attention mask excludes. `runner` holds the `FixedShapeDecoder`
    (and its CUDA graph) built for these buffers, so reusing the caches reuses the captured graph.
    """

    def __init__(self, batch, n_head, max_len, head_dim, dtype, device) -> None:
        super().__init__(batch, n_head, max_len, head_dim, dtype, device)
        # the decode/fixed_step.FixedShapeDecoder built for these buffers, if any (a cache knows no runner class)
        self.runner: object | None = None

    def update(self, k, v, positions):
        k_view, v_view = super().update(k, v, positions)
        if k.size(2) > 1:
            return k_view, v_view  # (B, H, length, Dh)
        return self.k, self.v  # (B, H, max_len, Dh): fixed shape; columns >= length are masked out

    def crop(self, length: int) -> None:
        """Lower the write pointer and zero the forgotten columns. The decode step reads the whole buffer under a
        mask built from `length` (the model's AttentionMask, the runner's device `column`, which it fills from
        `length` before every step), so the forgotten columns are masked anyway; zeroed, they cannot leak even
        through a wrong mask. The buffers stay, so a captured graph stays valid."""
        n, old = self.check_crop(length), self.length
        self.k[:, :, n:old].zero_()
        self.v[:, :, n:old].zero_()
        self.length = n

    def fork(self) -> StaticGraphCache:
        other = super().fork()
        assert isinstance(other, StaticGraphCache)  # StaticCache.fork copies the object, its class included
        other.runner = None  # the runner (and its graph) is built for this cache's buffers, not the fork's
        return other

    def reorder(self, index: torch.Tensor) -> None:
        """Same batch size: rows gathered into the same buffers, so a captured graph stays valid. Another batch
        size: new buffers, and the runner is dropped (runner_for builds a new one), never replayed on them."""
        idx = self.check_index(index, self.k.size(0), self.k.device)
        if idx.numel() == self.k.size(0):
            self.k.copy_(self.k.index_select(0, idx))  # index_select is a new tensor: no row reads a row written
            self.v.copy_(self.v.index_select(0, idx))
        else:
            super().reorder(idx)
            self.runner = None


def make_static_graph_cache(c, batch, max_len, dtype, device) -> StaticGraphCache:
    return StaticGraphCache(batch, c.n_head, max_len, c.head_dim, dtype, device)


SPEC = CacheSpec(
    "static-graph",
    "static buffers + fixed-shape decode step over the whole buffer, one CUDA graph replay per token",
    make_static_graph_cache,
    traffic=Traffic("attends over its whole buffer (capacity slots, masked)", whole_buffer=True),
    memory_note="the static cache's buffers; the CUDA graph's private memory pool is not part of nbytes",
    fixed_step=True,
)
