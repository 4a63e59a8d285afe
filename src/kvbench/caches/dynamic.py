"""The `dynamic` cache: torch.cat append, the baseline whose copying `bench` measures."""

from __future__ import annotations

import torch

from kvbench.caches.base import CacheSpec, LayerCache, Traffic


class DynamicCache(LayerCache):
    """Append with `torch.cat`, which allocates a new tensor and copies all history every step.

    Kept on purpose as the baseline whose copying cost `bench` measures: each update re-copies the `length` cached
    tokens of K and V, so growing from n0 to n1 tokens one at a time copies
    bytes_per_token_per_layer x (n0 + ... + n1-1) = bytes_per_token_per_layer x (n1 - n0)(n0 + n1 - 1) / 2.
    """

    def __init__(self) -> None:
        super().__init__()
        self.k: torch.Tensor | None = None  # (B, H, length, Dh)
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            K, V = k, v  # first write: nothing cached, nothing copied
        else:
            self.bytes_copied += self.k.nbytes + self.v.nbytes
            K = torch.cat([self.k, k], dim=2)  # (B, H, length + T, Dh): new tensor, history copied
            V = torch.cat([self.v, v], dim=2)
        self.k, self.v, self.length = K, V, K.size(2)
        return K, V

    def reset(self) -> None:
        super().reset()
        self.k = self.v = None

    # The lifecycle shares tensors freely: torch.cat never writes into its inputs, so a view or a shared tensor is
    # never changed by a later update of either holder.
    def crop(self, length: int) -> None:
        n = self.check_crop(length)
        if n == 0:
            self.k = self.v = None  # the next update is a first write again
        elif self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]  # views (B, H, n, Dh)
        self.length = n

    def fork(self) -> DynamicCache:
        other = DynamicCache()
        other.k, other.v = self.k, self.v  # shared: neither cache ever writes into them
        other.length, other.bytes_copied = self.length, self.bytes_copied
        return other

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is None or self.v is None:  # empty: no rows yet (the next update sets the batch); index checked
            self.check_index(index, None, None)
            return
        idx = self.check_index(index, self.k.size(0), self.k.device)
        self.k, self.v = self.k.index_select(0, idx), self.v.index_select(0, idx)  # new (len(idx), H, T, Dh)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes


SPEC = CacheSpec(
    "dynamic",
    "torch.cat append: copies all history every step",
    lambda c, b, n, dt, dev: DynamicCache(),
    traffic=Traffic(
        "torch.cat re-copies the history: reads and writes L-1 slots",
        extra=lambda L, slot, q8: 2 * (L - 1) * slot,
    ),
    memory_note="holds exactly the tokens it was given, but each step torch.cat allocates a new (B, H, t+1, Dh) "
    "tensor and copies the history, so for a moment a layer holds both copies (see --copy-traffic)",
)
