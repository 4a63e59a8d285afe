"""Tensor parallelism for our GPT-2, Megatron-style, over torch.distributed: each rank holds a slice of the heads.

GPT-2 has no tensor-parallel plan in transformers (its fused `c_attn` is a Conv1D, weights (in, out)), so the split
is written here, as Megatron-LM splits a transformer block over N ranks (rank r of N):

    attn.c_attn   column-parallel: the Q, K and V columns of heads [r*H/N, (r+1)*H/N)        (C, 3 * C/N)
    attention     over those H/N heads only, through this rank's cache            k, v: (B, H/N, S, Dh)
    attn.c_proj   row-parallel: the matching C/N rows, partial sums all-reduced, bias added once    (C/N, C)
    mlp.c_fc      column-parallel: columns [r*4C/N, (r+1)*4C/N)                                  (C, 4C/N)
    mlp.c_proj    row-parallel: the matching rows, all-reduced, bias added once                 (4C/N, C)
    wte, wpe, ln_*, ln_f, lm_head   replicated

Two all-reduces per layer; every rank ends each block with the same activations, and so the same logits and the same
greedy tokens. A rank's cache holds its H/N heads: the shard's `cache_config` (a `ShardConfig`) says so, and which
rank of how many it is, so every cache design (and plugin) is built for them unchanged; `place(model)` reads it
(a whole model is rank 0 of 1). The all-reduce adds N partial products in another order than one matmul sums them, so TP
is exact to rounding, not bit for bit (check/judge.py states the tolerance).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from kvbench.devices import synchronize
from kvbench.model.gpt2 import GPT, MLP, CausalSelfAttention, Conv1D, GPTConfig
from kvbench.model.matmul import linear


@dataclass(frozen=True)
class Place:
    """Which rank of how many a model's weights are: a shard's, or a whole model's (rank 0 of 1)."""

    rank: int = 0
    world: int = 1

    @property
    def heads_split(self) -> bool:
        return self.world > 1


WHOLE = Place()


@dataclass
class ShardConfig(GPTConfig):
    """A shard's cache config: the heads one rank holds, and which rank of how many it is (a cache design or plugin
    built for a shard reads `tp_rank` and `tp_size` here)."""

    tp_rank: int = field(default=0, compare=False)
    tp_size: int = field(default=1, compare=False)


def config_place(config: GPTConfig) -> Place:
    """The rank a cache config was built for: a shard's (`ShardConfig`), else rank 0 of 1."""
    return Place(config.tp_rank, config.tp_size) if isinstance(config, ShardConfig) else WHOLE


def place(model: GPT) -> Place:
    """Where `model`'s weights sit: the rank of the shard `shard` built, rank 0 of 1 for a whole model."""
    return config_place(model.cache_config)


class Collectives:
    """The all-reduce every row-parallel layer calls, timed when `timing` is on (bench: the share of a step spent
    in collectives, device synchronised around each call)."""

    def __init__(self) -> None:
        self.timing = False
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, y: torch.Tensor) -> None:
        if not self.timing:
            dist.all_reduce(y)
            return
        synchronize(y.device)
        t0 = time.perf_counter()
        dist.all_reduce(y)
        synchronize(y.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


COLLECTIVES = Collectives()


class RowParallel(nn.Module):
    """y = all_reduce(x @ W[rows]) + b: the second half of a column/row pair. `x` holds this rank's slice of the
    inner width; the bias, whole on every rank, is added once after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (in / N, out)
        self.bias = nn.Parameter(bias)  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, n_in = x.shape
        y = linear(x.reshape(-1, n_in), self.weight.t())  # (tokens, out): this rank's partial sum
        COLLECTIVES.all_reduce(y)
        return (y + self.bias).view(*lead, y.size(-1))


def _columns(layer: Conv1D, cols: torch.Tensor) -> Conv1D:
    out = Conv1D(layer.weight.size(0), cols.numel()).to(layer.weight.device, layer.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(layer.weight[:, cols])
        out.bias.copy_(layer.bias[cols])
    return out


def _rows(layer: Conv1D, lo: int, hi: int) -> RowParallel:
    with torch.no_grad():
        return RowParallel(layer.weight[lo:hi].clone(), layer.bias.clone())


def head_columns(C: int, Dh: int, heads: range) -> torch.Tensor:
    """c_attn's columns for Q, K and V of `heads`: its output is [Q | K | V], each C wide, head h at h*Dh."""
    lo, hi = heads.start * Dh, heads.stop * Dh
    return torch.cat([torch.arange(lo, hi) + j * C for j in range(3)])


def rank_heads(n_head: int, rank: int, world: int) -> range:
    """The heads rank `rank` of `world` holds: a contiguous slice, as transformers' and Megatron's plans split them."""
    h = n_head // world
    return range(rank * h, (rank + 1) * h)


def shard(model: GPT, rank: int, world: int) -> GPT:
    """Rank `rank`'s slice of `model` (module docstring); `model` itself is left whole. Heads and the MLP width
    must divide by `world` (validate.tp_shape_rules checks it before any rank starts); the shard's `cache_config`
    holds its heads and says which rank of how many it is (`place`)."""
    cfg = model.config
    H, C, Dh = cfg.n_head, cfg.n_embd, cfg.head_dim
    assert H % world == 0 and (4 * C) % world == 0, f"{H} heads, MLP {4 * C} over {world} ranks"
    part = copy.deepcopy(model)
    heads, width = rank_heads(H, rank, world), 4 * C // world
    for block in part.transformer.h:
        attn, mlp = cast(CausalSelfAttention, block.attn), cast(MLP, block.mlp)
        attn.c_attn = _columns(attn.c_attn, head_columns(C, Dh, heads))
        attn.c_proj = _rows(cast(Conv1D, attn.c_proj), heads.start * Dh, heads.stop * Dh)
        attn.n_head = len(heads)
        mlp.c_fc = _columns(mlp.c_fc, torch.arange(rank * width, (rank + 1) * width))
        mlp.c_proj = _rows(cast(Conv1D, mlp.c_proj), rank * width, (rank + 1) * width)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields.update(n_head=H // world, n_embd=C // world, tp_rank=rank, tp_size=world)
    part.cache_config = ShardConfig(**fields)
    return part.lay_out()  # the column-parallel Conv1Ds were built (in, out): as the device's kernels want them
