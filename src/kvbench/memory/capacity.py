"""The numbers behind `kvbench memory --plot`: each model's cache against context on one GPU, where it stops fitting,
and the most sequences that fit at each context. Computed from the plans' own shapes with the planner's formulas,
and the longest context that fits with the planner's own search, so the chart shows what the table says."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbench.memory.formats import get_kv_format
from kvbench.memory.formulas import bytes_per_sequence, state_bytes
from kvbench.memory.planner import max_context
from kvbench.memory.units import MAX_TOKENS, GiB

POINTS = 64  # contexts drawn per curve, evenly spaced on the log axis


@dataclass
class CapacitySeries:
    """One model at one batch on one GPU."""

    model: str
    batch: int
    weights_gib: float  # weights on one GPU
    contexts: list[int]  # the x of every point
    kv_gib: list[float]  # the cache of `batch` sequences on one GPU at each context
    max_batch: list[int]  # the most sequences of that context that fit beside the weights
    max_ctx: (
        int | None
    )  # the longest context at `batch` that fits (None: it never stops: windowed, or at the limit)


@dataclass
class CapacityChart:
    """What --plot drew, and where."""

    path: str
    gpu: str  # the GPU's label
    memory_gib: float  # the GPU's memory
    usable_gib: float  # after the allowance for activations, CUDA context and allocator slack
    series: list[CapacitySeries] = field(default_factory=list)


def seq_bytes_fn(plan):
    """ctx -> bytes one sequence of `plan`'s model holds on one GPU (cache + any recurrent state)."""
    spec, fmt = plan.model, get_kv_format(plan.kv_dtype)
    state = state_bytes(spec, fmt, plan.tp)
    return lambda ctx: bytes_per_sequence(spec, fmt, ctx, plan.kv_heads_per_gpu) + state


def longest_fitting(plan, batch: int, available: int) -> int | None:
    """The longest context whose cache for `batch` sequences fits in `available` bytes, as the planner finds it
    (planner.max_context): 0 when none does, None when the curve never crosses the line (MAX_TOKENS still fits)."""
    spec, fmt = plan.model, get_kv_format(plan.kv_dtype)
    ctx, how = max_context(
        spec, fmt, plan.kv_heads_per_gpu, batch, available, state_bytes(spec, fmt, plan.tp)
    )
    return ctx if how == "found" else None


def context_grid(plans: list, batches: list[int]) -> list[int]:
    """From 1k (or the shortest --ctx) to twice the longest of --ctx and every finite max context."""
    given = [r.ctx for p in plans for r in p.rows]
    ends = [r.max_ctx for p in plans for r in p.rows if r.max_ctx and not r.max_ctx_at_limit]
    lo = min([1024, *given])
    hi = min(MAX_TOKENS, 2 * max([*given, *ends, 2 * lo]))
    step = (math.log(hi) - math.log(lo)) / (POINTS - 1)
    return sorted({round(math.exp(math.log(lo) + i * step)) for i in range(POINTS)})


def capacity_series(plans: list) -> list[CapacitySeries]:
    """A series per model and batch of the plans (each with a GPU budget)."""
    batches = list(dict.fromkeys(r.batch for p in plans for r in p.rows))
    grid = context_grid(plans, batches)
    series = []
    for p in plans:
        assert p.gpu is not None, f"{p.model.name}: a capacity chart needs a GPU budget"
        per_seq, available = seq_bytes_fn(p), p.gpu.available
        max_batch = [max(0, available) // per_seq(c) if per_seq(c) else 0 for c in grid]
        for b in dict.fromkeys(r.batch for r in p.rows):
            series.append(
                CapacitySeries(
                    model=p.model.name, batch=b, weights_gib=p.gpu.weights_per_gpu / GiB, contexts=grid,
                    kv_gib=[b * per_seq(c) / GiB for c in grid], max_batch=max_batch,
                    max_ctx=longest_fitting(p, b, available),
                )
            )  # fmt: skip
    return series
