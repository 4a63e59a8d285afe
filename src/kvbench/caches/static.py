"""The `static` cache: preallocated (B, H, max_len, Dh) buffers and a write pointer, Hugging Face's StaticCache in
miniature."""

from __future__ import annotations

import copy

import torch

from kvbench.caches.base import CacheSpec, LayerCache, Traffic


class StaticCache(LayerCache):
    """Preallocated (B, H, max_len, Dh) buffers and a write pointer; returns views of the filled prefix.

    Nothing is copied after the write: the views share the buffers' storage, and the shape grows but the allocation
    never moves. This is Hugging Face's StaticCache in miniature.
    """

    def __init__(self, batch, n_head, max_len, head_dim, dtype, device) -> None:
        super().__init__()
        self.k = torch.zeros(batch, n_head, max_len, head_dim, dtype=dtype, device=device)  # (B, H, L, Dh)
        self.v = torch.zeros_like(self.k)
        self.capacity = max_len

    def update(self, k, v, positions):
        start, end = self.check_capacity(k.size(2), "static")
        self.k[:, :, start:end].copy_(k)
        self.v[:, :, start:end].copy_(v)
        self.length = end  # one past the last written slot
        return self.k[:, :, :end], self.v[:, :, :end]  # views: (B, H, end, Dh)

    def in_place_slot(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The buffers and the write pointer, for one token (an overflow refused as `update` refuses it); a subclass,
        whose `update` is its own, gets None."""
        if type(self) is not StaticCache:
            return None
        start, _ = self.check_capacity(1, "static")
        return self.k, self.v, start

    def crop(self, length: int) -> None:
        self.length = self.check_crop(length)  # update returns views of the first `length` columns only

    def fork(self) -> StaticCache:
        other = copy.copy(self)  # counters and capacity
        other.k, other.v = self.k.clone(), self.v.clone()  # its own buffers (B, H, max_len, Dh)
        return other

    def reorder(self, index: torch.Tensor) -> None:
        idx = self.check_index(index, self.k.size(0), self.k.device)
        self.k, self.v = self.k.index_select(0, idx), self.v.index_select(0, idx)  # new (len(idx), H, L, Dh)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


SPEC = CacheSpec(
    "static",
    "preallocated (B, H, max_len, Dh) buffers + write pointer: no copies",
    lambda c, b, n, dt, dev: StaticCache(b, c.n_head, n, c.head_dim, dt, dev),
    traffic=Traffic("reads the filled prefix in place (views of its buffer)"),
    memory_note="preallocates (B, H, max_len, Dh) K and V per layer up front: reserved whether or not the tokens "
    "arrive",
)
