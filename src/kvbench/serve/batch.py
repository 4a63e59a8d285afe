"""One forward step of a running batch over the pool: where each row writes its new K/V and what it reads back.

Rows are requests at different lengths. Row b holds `starts[b]` tokens in its blocks (`tables[b]`, in token order)
and this step adds T more at positions starts[b] .. starts[b] + T - 1 (a decode step: T = 1 for every row; a
prefill: one row, T = its uncached suffix). Attention reads each row's blocks gathered into a padded
(B, H, S, Dh), S the longest row's length after the step, and `key_positions` (B, S) tells the model's mask which
slot holds which position, -1 for a shorter row's padding:

    row 0: 5 tokens + 1   key_positions  0 1 2 3 4 5 -1 -1
    row 1: 7 tokens + 1   key_positions  0 1 2 3 4 5  6  7

The plan is built once per step (block ids to device tensors) and read by every layer's cache.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import LayerCache
from kvbench.serve.pool import KVPool


class StepPlan:
    """The write slots, the gather table and the key positions of one step (module docstring)."""

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], T: int) -> None:
        bs, device = pool.block_size, pool.k.device
        ends = [s + T for s in starts]
        for table, end in zip(tables, ends, strict=True):
            assert len(table) * bs >= end, f"a row of {end} tokens holds {len(table)} blocks of {bs}"
        self.S = max(ends)
        self.past = max(starts)
        nb = -(-self.S // bs)
        padded = [t[:nb] + [0] * (nb - len(t[:nb])) for t in tables]  # block 0 fills a short row: never read
        self.table = torch.tensor(padded, dtype=torch.long, device=device)  # (B, nb)
        first = torch.tensor(starts, dtype=torch.long, device=device)[:, None]  # (B, 1)
        self.positions = first + torch.arange(T, device=device)[None]  # (B, T)
        blocks = self.table.gather(1, self.positions // bs)  # (B, T)
        self.write = (blocks * bs + self.positions % bs).reshape(-1)  # (B * T,) flat pool rows
        cols = torch.arange(self.S, device=device)[None].expand(len(tables), -1)  # (B, S)
        last = torch.tensor(ends, dtype=torch.long, device=device)[:, None]  # (B, 1)
        self.key_positions = torch.where(cols < last, cols, -1)  # (B, S), -1 past a row's end


class PoolLayerCache(LayerCache):
    """One layer's view of the pool for one step (StepPlan): `update` writes this step's K/V into the rows' blocks
    and returns every row's K/V gathered, padded to S, with `key_positions` set for the mask."""

    def __init__(self, pool: KVPool, layer: int, plan: StepPlan) -> None:
        super().__init__()
        self.pool, self.layer, self.plan = pool, layer, plan
        self.length = plan.past
        self.key_positions = plan.key_positions  # (B, S)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, T, Dh = k.shape
        plan = self.plan
        kp, vp = self.pool.k[self.layer], self.pool.v[self.layer]  # (N, block_size, H, Dh)
        kp.view(-1, H, Dh).index_copy_(0, plan.write, k.transpose(1, 2).reshape(B * T, H, Dh))
        vp.view(-1, H, Dh).index_copy_(0, plan.write, v.transpose(1, 2).reshape(B * T, H, Dh))
        nb = plan.table.size(1)
        k_all = kp[plan.table].view(B, nb * kp.size(1), H, Dh)[:, : plan.S].transpose(1, 2)  # (B, H, S, Dh)
        v_all = vp[plan.table].view(B, nb * vp.size(1), H, Dh)[:, : plan.S].transpose(1, 2)
        self.length = plan.S
        return k_all, v_all

    @property
    def nbytes(self) -> int:
        """This layer's share of the pool's device storage."""
        return self.pool.k[self.layer].nbytes + self.pool.v[self.layer].nbytes


def step_caches(pool: KVPool, tables: list[list[int]], starts: list[int], T: int) -> list[LayerCache]:
    """One PoolLayerCache per layer for a step of rows `tables` holding `starts` tokens, adding T each."""
    plan = StepPlan(pool, tables, starts, T)
    return [PoolLayerCache(pool, layer, plan) for layer in range(pool.k.size(0))]
