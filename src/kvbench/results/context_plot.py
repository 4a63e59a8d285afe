"""context.png: decode cost against context for a random-fill context sweep (bench --fill random)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

from kvbench.caches import CACHES  # noqa: E402
from kvbench.results.plot_style import (  # noqa: E402
    MAX_TICKS,
    PLAIN,
    cache_colour,
    context_label,
    run_title,
)


def context_figure(summary: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Left: median decode step against context, one colour per cache (bars: 10th-90th percentile), each cache's
    bandwidth floor dashed in its colour, and the crossover context (K/V read = weight read) marked. Right: the same
    steps as multiples of their floor."""
    ok = summary[summary["status"] == "ok"]
    contexts = sorted(summary.context.unique())
    cross = meta.get("crossover_context")
    bw = meta.get("floor", {}).get("bandwidth", {})
    fig, (ax, ax_x) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [3, 2]})
    values = _context_lines(ax, ax_x, ok)
    if len(ok) and bw.get("gbps"):
        alone = 1e3 * float(ok.weight_bytes.iloc[0]) / (bw["gbps"] * 1e9)
        ax.axhline(alone, color="0.55", linestyle="-.", linewidth=1)
        values.append(alone)
    shown = cross is not None and contexts[0] / 4 <= cross <= contexts[-1] * 4
    _context_axes(ax, ax_x, contexts, cross if shown else None, values)
    _mark_crossover(ax, ax_x, cross, shown, contexts)
    ax.set(
        xlabel="context (tokens in the cache)",
        ylabel="decode step, median (ms)",
        title="Decode step vs context; dashed: each cache's bandwidth floor",
    )
    _context_legend(ax, shown)
    ax_x.axhline(1.0, color="0.35", linewidth=1, linestyle="--")
    ax_x.set_ylim(0, max([1.0, *ok.x_floor.dropna()]) * 1.15)
    ax_x.set(
        xlabel="context (tokens in the cache)",
        ylabel="median step / floor (x)",
        title="How far above the floor (1 = at the floor)",
    )
    n = int(ok.new_tokens.max()) if len(ok) else 0
    reps = int(ok.repeats.max()) if len(ok) else 0
    fig.suptitle(
        f"Decode cost vs context — {run_title(meta)} — caches filled with RANDOM K/V (no prefill), decode only\n"
        f"median of {n} steps x {reps} repeats, bars: 10th-90th percentile; read bandwidth "
        f"{bw.get('gbps', float('nan')):.1f} GB/s, measured in the run",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _context_lines(ax, ax_x, ok: pd.DataFrame) -> list[float]:
    """Each cache's median step (with its 10th-90th percentile bars) and floor on `ax`, its x_floor on `ax_x`;
    returns the values the y range must hold."""
    caches = sorted(ok.cache.unique(), key=lambda c: list(CACHES).index(c) if c in CACHES else 99)
    values = []
    for cache in caches:
        sub = ok[ok.cache == cache].sort_values("context")
        colour = cache_colour(cache)
        err = [sub.tpot_ms_median - sub.tpot_ms_p10, sub.tpot_ms_p90 - sub.tpot_ms_median]
        ax.errorbar(
            sub.context,
            sub.tpot_ms_median,
            yerr=err,
            color=colour,
            marker="o",
            markersize=5,
            linewidth=1.6,
            capsize=3,
            label=cache,
        )
        ax.plot(sub.context, sub.floor_ms, color=colour, linestyle="--", linewidth=1.2, alpha=0.9)
        ax_x.plot(sub.context, sub.x_floor, color=colour, marker="o", markersize=5, linewidth=1.6, label=cache)
        values += list(sub.tpot_ms_p90) + list(sub.floor_ms)
    return values


def _context_axes(ax, ax_x, contexts: list, cross: float | None, values: list[float]) -> None:
    """Both panels: log2 context axes labelled in tokens (the crossover, when given, as a dotted line); the left
    one's log y axis with plain numbers, sized to `values`."""
    for a in (ax, ax_x):
        a.set_xscale("log", base=2)
        if len(contexts) <= MAX_TICKS:
            a.set_xticks(contexts)
        a.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(x)))
        a.xaxis.set_minor_locator(NullLocator())
        a.grid(True, which="major", alpha=0.3)
        if cross is not None:
            a.axvline(cross, color="0.35", linestyle=":", linewidth=1.4)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(PLAIN)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    if values:
        ax.set_ylim(min(values) / 1.5, max(values) * 1.5)


def _mark_crossover(ax, ax_x, cross: float | None, shown: bool, contexts: list) -> None:
    """The crossover context annotated on the left panel (both panels widened to hold it); a note in the corner
    when it falls outside the sweep."""
    if shown:
        assert cross is not None, "a crossover is shown only when there is one"
        ax.set_xlim(min(contexts[0], cross) / 1.4, max(contexts[-1], cross) * 1.4)
        ax_x.set_xlim(*ax.get_xlim())
        _annotate(
            ax,
            f"K/V read = weight read\nat {cross:,} tokens",
            (cross, 1.0),
            (4, -4),
            va="top",
            fontsize=9,
            color="0.25",
        )
        _annotate(ax, "← weights dominate", (cross, 0.0), (-4, 6), ha="right", fontsize=8, color="0.4")
        _annotate(ax, "K/V cache dominates →", (cross, 0.0), (4, 6), ha="left", fontsize=8, color="0.4")
    elif cross is not None:
        ax.text(
            0.01,
            0.99,
            f"K/V read = weight read at {cross:,} tokens (outside this sweep)",
            transform=ax.transAxes,
            va="top",
            fontsize=9,
            color="0.25",
        )


def _context_legend(ax, shown: bool) -> None:
    """The caches, plus the line styles of the floors and (when shown) the crossover."""
    handles, labels = ax.get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="0.3", linestyle="--"))
    labels.append("floor: bytes / read bandwidth")
    handles.append(plt.Line2D([], [], color="0.55", linestyle="-."))
    labels.append("floor of the weights alone")
    if shown:
        handles.append(plt.Line2D([], [], color="0.35", linestyle=":"))
        labels.append("crossover: K/V read = weights")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.0, 0.9), fontsize=9, framealpha=0.9)


def write_context_plots(run_dir: Path, summary: pd.DataFrame, meta: dict) -> list[Path]:
    """context.png into `run_dir`, or nothing when no configuration finished."""
    if summary.empty or (summary["status"] != "ok").all():
        return []
    return [context_figure(summary, meta, run_dir / "context.png")]


def _annotate(ax, text: str, at: tuple[float, float], offset: tuple[int, int], **style) -> None:
    """A note at (context, axes fraction), offset by `offset` points."""
    ax.annotate(text, at, xycoords=("data", "axes fraction"), xytext=offset, textcoords="offset points", **style)
