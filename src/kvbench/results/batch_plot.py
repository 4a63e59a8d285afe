"""batch.png shows what a batch sweep's decode speed means, per prompt length, one line per engine x cache:

    across the batch   decode tokens/s of all B sequences together, with the bandwidth ceiling B / floor dashed
    per sequence       decode tokens/s each sequence sees (1 / TPOT), with its ceiling 1 / floor dashed
    x floor            TPOT / floor: how far each step is from moving its bytes at the measured bandwidth

The floor's bytes grow with B through the K/V term only (the weights are read once per step for every sequence), so
the ceiling across the batch rises with B until the K/V of the batch outweighs the weights: the batch where they are
equal is marked (the batch-size counterpart of the context crossover, bench/floor.py). Read across the batch, tokens/s
rises with B; read per sequence it falls: the two panels side by side keep the figures from being confused.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.results import plot_style as style  # noqa: E402

MAX_ROWS = 6  # prompt lengths drawn (the longest ones past this), a row of three panels each
CEILING = dict(color="black", linestyle="--", linewidth=1.2, alpha=0.7, marker="_", markersize=14)


def crossover_batch(meta: dict, prompt_len: int) -> float | None:
    """The batch at which one decode step's K/V read equals its weight read, from the floor's byte counts of this
    prompt length's rows (meta.json floor.steps): weights / (K/V per sequence). None without a floor."""
    steps = (meta.get("floor") or {}).get("steps") or {}
    best = None
    for key, b in steps.items():
        parts = key.split()
        # "<engine> <cache> prompt <n> batch <b>"; only a step that reads exactly the slots holding tokens (not a
        # whole buffer) prices one sequence's K/V at its context
        if len(parts) != 6 or parts[3] != str(prompt_len) or b.get("slots") != b.get("context"):
            continue
        batch = int(parts[5])
        if b.get("kv", 0) > 0 and (best is None or batch < best[0]):
            # the weight read barely depends on B (each sequence's wte and wpe rows): the smallest batch's
            best = (batch, b["weights"] / (b["kv"] / batch))
    return None if best is None else best[1]


def batch_figure(summary: pd.DataFrame, meta: dict, path: Path) -> Path:
    ok = summary[summary["status"] == "ok"].copy()
    ok["per_seq"] = ok["decode_tokens_per_s"] / ok["batch"]  # the same statistic as across the batch, per sequence
    plens = sorted(ok.prompt_len.unique())[-MAX_ROWS:]
    batches = sorted(ok.batch.unique())  # the sizes that ran; those out of memory are named in the title
    n = max(len(plens), 1)
    fig, axes = plt.subplots(n, 3, figsize=(16, 4.2 * n + 0.8), squeeze=False)
    for row, plen in enumerate(plens):
        sub = ok[ok.prompt_len == plen]
        _batch_row(axes[row], sub, batches, crossover_batch(meta, int(plen)), int(plen))
    oom = sorted(summary[summary.status == "oom"].batch.unique())
    where = f" · out of memory at batch {', '.join(f'{b:,}' for b in oom)}" if oom else ""
    new = int(summary.new_tokens.max())
    fig.suptitle(f"Decode speed against batch size — {style.run_title(meta)} — {new} new tokens{where}", fontsize=12)
    style.shared_legend(fig, axes.ravel())
    fig.tight_layout(rect=(0, 0.7 / (4.2 * n + 0.8), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _batch_row(axes, sub: pd.DataFrame, batches: list, cross: float | None, plen: int) -> None:
    ax_all, ax_seq, ax_x = axes
    for engine, cache in style.series_keys(sub):
        s = sub[(sub.engine == engine) & (sub.cache == cache)].sort_values("batch")
        kw = style.line_kw(engine, cache, label=style.series_label(engine, cache))
        ax_all.plot(s.batch, s.decode_tokens_per_s, **kw)
        ax_seq.plot(s.batch, s.per_seq, **kw)
        if s.x_floor.notna().any():
            ax_x.plot(s.batch, s.x_floor, **kw)
    floor = sub[sub.floor_ms.notna()].groupby("batch").floor_ms.min()  # the lightest design's floor per batch
    ceiling_all, ceiling_seq = floor.index * 1e3 / floor.values, 1e3 / floor.values
    if not floor.empty:
        ax_all.plot(floor.index, ceiling_all, label="the floor: bandwidth ceiling, x floor = 1", **CEILING)
        ax_seq.plot(floor.index, ceiling_seq, **CEILING)
        ax_x.axhline(1.0, **{k: v for k, v in CEILING.items() if k not in ("marker", "markersize")})
    else:
        ax_x.text(
            0.5,
            0.5,
            "no floor for this model\n(bytes are counted for GPT-2)",
            ha="center",
            va="center",
            transform=ax_x.transAxes,
            color="grey",
        )
    ax_all.set(ylabel="decode tokens/s, all sequences together", title=f"Across the batch · prompt {plen}")
    ax_seq.set(ylabel="decode tokens/s per sequence (the left / batch)", title=f"Per sequence · prompt {plen}")
    ax_x.set(ylabel="x floor (TPOT / floor)", title=f"Distance from the floor · prompt {plen}")
    for ax in axes:
        _batch_axis(ax, batches, cross)
    style.maybe_log(ax_all, [*sub.decode_tokens_per_s.dropna(), *ceiling_all])
    style.maybe_log(ax_seq, [*sub.per_seq.dropna(), *ceiling_seq])
    style.maybe_log(ax_x, [*sub.x_floor.dropna(), 1.0])


def _batch_axis(ax, batches: list, cross: float | None) -> None:
    ax.set_xlabel("batch size (sequences decoded together)")
    if len(batches) > 1 and batches[-1] / batches[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([f"{b:,}" for b in batches], rotation=45 if len(batches) > 8 else 0)
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    if cross is None or not math.isfinite(cross):
        return
    lo, hi = batches[0], batches[-1]
    if lo <= cross <= hi:
        ax.axvline(cross, color="grey", linestyle=":", linewidth=1.2)
        right = math.log(cross / lo) > 0.5 * math.log(hi / lo) if hi > lo else False  # label on the roomier side
        ax.annotate(
            f"K/V = weights\nat batch {cross:,.0f}",
            xy=(cross, 0.97),
            xycoords=("data", "axes fraction"),
            ha="right" if right else "left",
            va="top",
            fontsize=8,
            color="dimgrey",
            xytext=(-4 if right else 4, 0),
            textcoords="offset points",
        )
    else:
        side = "beyond" if cross > hi else "below"
        ax.set_xlabel(f"batch size (sequences decoded together)\nK/V = weights at batch {cross:,.0f}, {side} the sweep")
