"""`kvbench memory --plot FILE.png`: the capacity chart, its numbers and its drawing.

The numbers: each model's cache against context on one GPU, where it stops fitting, and the most sequences that fit
at each context, computed from the plans' own shapes with the planner's formulas, and the longest context that fits
with the planner's own search, so the chart shows what the table says.

The drawing: left, each model's memory on one GPU against context (log axis): its weights stacked below its KV
cache, the GPU's memory and what is left after the allowance as lines, and a mark where each model stops fitting at
each batch. Right, the most sequences that fit against context. matplotlib is imported when drawing, only.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.memory.formulas import bytes_per_sequence, state_bytes
from kvbench.memory.planner import max_context
from kvbench.memory.spec import get_kv_format
from kvbench.memory.units import MAX_TOKENS, GiB, fmt_tokens
from kvbench.outputs import write_output

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
    max_ctx: int | None  # the longest context at `batch` that fits (None: it never stops: windowed, or at the limit)


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
    ctx, how = max_context(spec, fmt, plan.kv_heads_per_gpu, batch, available, state_bytes(spec, fmt, plan.tp))
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
                    model=p.model.name,
                    batch=b,
                    weights_gib=p.gpu.weights_per_gpu / GiB,
                    contexts=grid,
                    kv_gib=[b * per_seq(c) / GiB for c in grid],
                    max_batch=max_batch,
                    max_ctx=longest_fitting(p, b, available),
                )
            )
    return series


STYLES = ["-", "--", ":", "-."]  # one per batch


def _short(n: int) -> str:
    """131072 -> '128k', 29043 -> '28.4k', 464692 -> '454k' (k = 1024 tokens, as --ctx reads them)."""
    if n < 1024:
        return str(n)
    if n < 1024**2:
        v = n / 1024
        return f"{v:.3g}k" if v < 100 else f"{v:.0f}k"
    return f"{n / 1024**2:.3g}m"


def _why(model: str, chart: CapacityChart) -> str:
    """A legend note for a model the chart shows no mark for."""
    mine = [s for s in chart.series if s.model == model]
    if mine[0].weights_gib >= chart.usable_gib:
        return f" (weights {mine[0].weights_gib:.0f} GiB: no room)"
    if all(s.max_ctx is None for s in mine):
        return " (fits at any context)"
    return ""


def _log_context_axis(ax, grid: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks, t = [], 1024
    while t < grid[0]:
        t *= 2
    while t <= grid[-1]:
        ticks.append(t)
        t *= 2
    ticks = ticks[:: max(1, -(-len(ticks) // 9))]  # at most 9 labels
    ax.set_xticks(ticks, [fmt_tokens(t) for t in ticks])
    ax.set_xticks([], minor=True)
    ax.set_xlim(grid[0], grid[-1])
    ax.set_xlabel("context (tokens, log scale; k = 1024)")
    ax.grid(True, which="major", alpha=0.3)


def _memory_panel(ax, chart: CapacityChart, colors: dict, styles: dict) -> None:
    shaded = set()
    for s in chart.series:
        color, total = colors[s.model], [s.weights_gib + k for k in s.kv_gib]
        if s.weights_gib >= chart.usable_gib:  # weights alone leave no room: the legend says so
            continue
        if s.model not in shaded:
            shaded.add(s.model)
            ax.fill_between(s.contexts, 0, s.weights_gib, color=color, alpha=0.18, lw=0)
            ax.axhline(s.weights_gib, color=color, lw=0.8, alpha=0.6)
        ax.plot(s.contexts, total, color=color, ls=styles[s.batch], lw=1.8)
    ax.axhline(chart.memory_gib, color="black", lw=1.5)
    ax.axhline(chart.usable_gib, color="black", lw=1, ls="--")
    top = chart.memory_gib * 1.18
    ax.text(
        chart.series[0].contexts[0],
        chart.memory_gib + top * 0.01,
        f" {chart.gpu}: {chart.memory_gib:.1f} GiB",
        va="bottom",
        fontsize=8,
    )
    ax.text(
        chart.series[0].contexts[0],
        chart.usable_gib - top * 0.01,
        f" after allowance: {chart.usable_gib:.1f} GiB",
        va="top",
        fontsize=8,
    )
    for i, s in enumerate(x for x in chart.series if x.max_ctx):
        assert s.max_ctx is not None
        ax.plot([s.max_ctx], [chart.usable_gib], "o", color=colors[s.model], ms=6, mec="black", mew=0.6)
        ax.axvline(s.max_ctx, color=colors[s.model], lw=0.7, ls=":", alpha=0.8)
        right = s.max_ctx > s.contexts[-1] ** 0.8 * s.contexts[0] ** 0.2  # the last fifth: label to the left
        ax.annotate(
            f"{_short(s.max_ctx)} (batch {s.batch})",
            (s.max_ctx, chart.usable_gib),
            xytext=(-4 if right else 4, -14 - 11 * (i % 4)),
            ha="right" if right else "left",
            textcoords="offset points",
            fontsize=8,
            color=colors[s.model],
            bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_ylim(0, top)
    ax.set_ylabel("GiB on one GPU: weights (shaded) + KV cache")
    ax.set_title("memory against context: o = longest context that fits", fontsize=10)


def _batch_panel(ax, chart: CapacityChart, colors: dict, styles: dict) -> None:
    drawn = set()
    for s in chart.series:
        if s.model in drawn:
            continue
        drawn.add(s.model)
        pts = [(c, b) for c, b in zip(s.contexts, s.max_batch, strict=True) if b > 0]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=colors[s.model], lw=1.8)
    for b, ls in styles.items():
        ax.axhline(b, color="gray", lw=0.9, ls=ls)
    for s in (x for x in chart.series if x.max_ctx):
        ax.plot([s.max_ctx], [s.batch], "o", color=colors[s.model], ms=6, mec="black", mew=0.6)
    ax.set_yscale("log", base=2)
    ax.set_ylim(bottom=0.8)
    ax.set_ylabel("max batch (sequences that fit beside the weights)")
    ax.set_title("max batch against context (gray: the batch planned)", fontsize=10)


def write_capacity_plot(plans: list, path: Path) -> CapacityChart:
    """Draw the plans (each with a GPU budget) into `path` (a PNG) and return the numbers drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    gpu = plans[0].gpu
    chart = CapacityChart(
        str(path), gpu.label, gpu.memory / GiB, (gpu.memory - gpu.overhead) / GiB, capacity_series(plans)
    )
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {p.model.name: palette[i % len(palette)] for i, p in enumerate(plans)}
    styles = {b: STYLES[i % len(STYLES)] for i, b in enumerate(dict.fromkeys(s.batch for s in chart.series))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.6))
    _memory_panel(left, chart, colors, styles)
    _batch_panel(right, chart, colors, styles)
    for ax in (left, right):
        _log_context_axis(ax, chart.series[0].contexts)
    handles = [Line2D([], [], color=c, lw=2, label=m + _why(m, chart)) for m, c in colors.items()]
    handles += [Line2D([], [], color="gray", ls=ls, label=f"batch {b}") for b, ls in styles.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), frameon=False, fontsize=9)
    kv = plans[0].kv_dtype
    fig.suptitle(f"KV cache ({kv}) and weights ({plans[0].weights_dtype}) on {gpu.label}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    png = io.BytesIO()  # drawn in memory, then written as every output is (a FIFO streamed, a file atomically)
    fig.savefig(png, dpi=120, format="png")
    plt.close(fig)
    write_output(Path(path), png.getvalue(), "--plot")
    return chart
