"""distortion.png: what each lossy cache of a bench run costs against the full-precision path, by context depth;
and verify --text's KL divergence by depth (text_figure).

Three panels over the depth a step reads (log2 axis, tokens): KL(p_full || p_lossy) in nats, top-1 agreement and
mean |Δp|. Each cache has its colour (as in every bench figure); a faint dot per token (averaged over the batch's
sequences) and a line through the means of the power-of-two depth bins (check/distortion.py), every prompt length
or context and batch size of the run pooled. The title says what the weights make of the figures.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator, PercentFormatter  # noqa: E402

from kvbench.caches import CACHES  # noqa: E402
from kvbench.check.distortion import depth_bin  # noqa: E402
from kvbench.outputs import write_output  # noqa: E402
from kvbench.results.plot_style import cache_colour, context_label, run_title  # noqa: E402

PANELS = (  # column, y label, panel title, log y
    ("kl", "KL(p_full || p_lossy), nats", "KL divergence", True),
    ("top1_agreement", "same top token", "Top-1 agreement", False),
    ("abs_dp", "|Δp| of the full-precision token", "Mean |Δp|", True),
)


def _bins(sub: pd.DataFrame) -> pd.DataFrame:
    """Each power-of-two depth bin's mean depth and mean figures."""
    lo = sub.depth.map(lambda d: depth_bin(int(d))[0]).rename("bin")
    return sub.groupby(lo)[["depth", "kl", "top1_agreement", "abs_dp"]].mean().sort_values("depth")


def _saved(meta: dict, cache: str) -> str:
    """What `cache` saves against the full-precision cache over the run's rows (meta.json's distortion rows)."""
    rows = meta.get("distortion", {}).get("rows", {}).values()
    saved = [r["bytes_saved_fraction"] for r in rows if r.get("cache") == cache and r.get("bytes_saved_fraction")]
    if not saved:
        return cache
    lo, hi = f"{min(saved):.0%}", f"{max(saved):.0%}"
    return f"{cache}: {lo if lo == hi else f'{lo}-{hi}'} fewer K/V bytes"


def distortion_figure(rows: pd.DataFrame, meta: dict, path: Path) -> Path:
    """The three panels from distortion.csv's rows (cache, depth, kl, top1_agreement, abs_dp), one colour per
    cache in registry order, each labelled with the bytes it saves. A zero (an eviction design before it evicts)
    has no place on a log axis: those points and bins are left off the KL and |Δp| panels, and the title says so."""
    caches = sorted(rows.cache.unique(), key=lambda c: list(CACHES).index(c) if c in CACHES else 99)
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    depths = sorted(rows.depth.unique())
    zeros, lowest = False, 1.0  # lowest: the lowest binned top-1 (a token's own is 0 or 1)
    for cache in caches:
        sub = rows[rows.cache == cache]
        binned, colour, label = _bins(sub), cache_colour(cache), _saved(meta, cache)
        lowest = min(lowest, float(binned.top1_agreement.min()))
        for ax, (col, _, _, log) in zip(axes, PANELS, strict=True):
            if col != "top1_agreement":  # per token, top-1 of one sequence is 0 or 1: only its bins say anything
                shown = sub[sub[col] > 0] if log else sub
                ax.scatter(shown.depth, shown[col], s=6, color=colour, alpha=0.25, linewidths=0)
            line = binned[binned[col] > 0] if log else binned
            zeros |= len(line) < len(binned)
            ax.plot(line.depth, line[col], color=colour, marker="o", markersize=5, linewidth=1.6, label=label)
    for ax, (col, ylabel, title, log) in zip(axes, PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(x)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(depths[0] / 1.2, depths[-1] * 1.2)
        if log and (rows[col] > 0).any():
            ax.set_yscale("log")
        if col == "top1_agreement":
            ax.set_ylim(min(0.9, lowest - 0.02), 1.01)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.grid(True, which="major", alpha=0.3)
        ax.set(xlabel="context depth (tokens the step reads)", ylabel=ylabel, title=title)
    axes[0].legend(fontsize=9, loc="best")
    dist = meta.get("distortion", {})
    filled = " · caches filled with RANDOM K/V" if meta.get("fill") == "random" else ""
    note = textwrap.fill(dist.get("note", ""), 150)
    fig.suptitle(
        f"Lossy caches vs the full-precision static cache, teacher-forced, by depth — {run_title(meta)}{filled}\n"
        f"dots: each token (mean over the batch's sequences); lines: power-of-two depth bins"
        + ("; a bin of KL or |Δp| 0 (identical distributions) is left off its log axis" if zeros else "")
        + f"\n{note}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def text_figure(lossy: dict[str, dict], text: dict, title: str, path: Path) -> Path:
    """verify --text: mean KL(p_ref || p_cache) by context depth (power-of-two bins, log2 axes), one line per lossy
    cache (`lossy`: its entries of the report's text section), in the cache's colour."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for cache, d in lossy.items():
        bins = [b for b in d["by_depth"] if b["kld"]["mean"] > 0]
        depth = [(b["depth_from"] + b["depth_to"]) / 2 for b in bins]
        label = f"{cache}: PPL {d['ppl']:.4g} (exact {text['ppl_transformers']:.4g})"
        ax.plot(depth, [b["kld"]["mean"] for b in bins], marker="o", color=cache_colour(cache), label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(x)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    ax.set(xlabel="context depth (tokens the prediction reads)", ylabel="mean KL(p_exact || p_cache), nats")
    ax.legend(fontsize=9, loc="best")
    ax.set_title(
        f"{textwrap.fill(title, 90)}\n{text['tokens']:,} tokens teacher-forced, windows of {text['window']:,} "
        f"every {text['stride']:,}; a bin with KL 0 is left off",
        fontsize=10,
    )
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=130)
    plt.close(fig)
    write_output(path, png.getvalue(), "--plot")
    return path
