"""The figures of bench and compare, drawn with matplotlib (Agg): latency.png (the seed's two panels), speedup.png,
batch.png for a batch sweep, context.png for a random-fill context sweep, and compare.png.

Every figure shares one look: a colour per cache (registry order, so a cache keeps its colour across figures and
runs), a line style per engine (solid: kvbench, dashed: transformers, dash-dot: transformers compiled), plain-number
log ticks, one legend under the panels, and the run's title.

batch.png shows what a batch sweep's decode speed means, per prompt length, one line per engine x cache:

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
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

from kvbench.caches import CACHES  # noqa: E402

ENGINE_STYLE = {"kvbench": "-", "hf": "--", "hf-compiled": "-."}
ENGINE_LABEL = {"kvbench": "kvbench", "hf": "transformers", "hf-compiled": "transformers compiled"}
ENGINE_ORDER = list(ENGINE_STYLE)


def _colour(cache: str) -> tuple[float, float, float, float]:
    names = list(CACHES)
    i = names.index(cache) if cache in names else len(names)
    return plt.get_cmap("tab10")(i % 10)


def _label(engine: str, cache: str) -> str:
    return f"{ENGINE_LABEL.get(engine, engine)}: {cache}"


def _series(df: pd.DataFrame):
    """(engine, cache) groups in a stable, readable order: engines as given, caches in registry order."""
    names = list(CACHES)
    keys = df[["engine", "cache"]].drop_duplicates().itertuples(index=False)
    order = sorted(
        keys,
        key=lambda k: (
            ENGINE_ORDER.index(k.engine) if k.engine in ENGINE_ORDER else 99,
            names.index(k.cache) if k.cache in names else 99,
        ),
    )
    return [(k.engine, k.cache) for k in order]


_PLAIN = FuncFormatter(lambda x, _: f"{x:g}")


def _maybe_log(ax, values, ratio: float = 20.0) -> None:
    """Log y when the values span more than `ratio`, with plain numbers (not 10^k) on the ticks."""
    v = [x for x in values if x > 0]
    if v and max(v) / min(v) > ratio:
        ax.set_yscale("log")
        if max(v) / min(v) < 300:  # under 2.5 decades: label 1-2-5 steps, not only the powers of ten
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))


def _shared_legend(fig, axes) -> None:
    """One legend under the panels (every panel draws the same engine x cache lines), so none hides data."""
    handles: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=False):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=9)


def _title(meta: dict) -> str:
    return f"{meta.get('model', '?')} ({meta.get('weights', '?')}) · {meta.get('device_name', '?')} · {meta.get('dtype', '?')}"


# latency.png draws two panels per prompt length (about 0.4 s each on a small CPU); past this many prompt lengths
# it is not drawn (speedup.png still shows every one), so a long sweep, or one stopped by a signal, ends promptly.
MAX_LATENCY_PANELS = 12
# At most this many labelled ticks on a prompt-length or context axis; more are left to matplotlib's locator.
MAX_TICKS = 16


def _prompt_lens(summary: pd.DataFrame) -> list:
    ok = summary[summary["status"] == "ok"]
    return sorted(ok["prompt_len"].unique()) or sorted(summary["prompt_len"].unique())


def latency_figure(summary: pd.DataFrame, steps: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Per prompt length, two panels: decode latency by step (median over repeats) and cumulative time including
    the prefill (the first token at TTFT), one line per engine x cache."""
    ok = summary[summary["status"] == "ok"]
    prompt_lens = _prompt_lens(summary)
    n = max(len(prompt_lens), 1)
    # every series' median step curve at once: (engine, cache, prompt_len, step) -> median latency
    medians = steps.groupby(["engine", "cache", "prompt_len", "step"])["latency_ms"].median()
    curves = {k: g.droplevel([0, 1, 2]) for k, g in medians.groupby(level=[0, 1, 2])}
    fig, axes = plt.subplots(n, 2, figsize=(13, 3.9 * n + 0.6), squeeze=False)  # a row per prompt length
    for row, plen in enumerate(prompt_lens):
        ax_step, ax_cum = axes[row]
        sub = ok[ok["prompt_len"] == plen]
        all_ms = []
        for engine, cache in _series(sub):
            per_step = curves.get((engine, cache, plen))  # (decode steps,)
            if per_step is None or per_step.empty:
                continue
            ttft_ms = float(sub[(sub.engine == engine) & (sub.cache == cache)]["ttft_ms"].iloc[0])
            kw = dict(color=_colour(cache), linestyle=ENGINE_STYLE.get(engine, ":"), linewidth=1.4)
            # decode step j produces token j + 1; token 1 comes from the prefill
            ax_step.plot(per_step.index + 1, per_step.values, label=_label(engine, cache), **kw)
            cum = (ttft_ms + per_step.cumsum()) / 1e3
            ax_cum.plot([1, *(per_step.index + 1)], [ttft_ms / 1e3, *cum.values], **kw)
            all_ms += list(per_step.values)
        _maybe_log(ax_step, all_ms, ratio=8.0)
        ax_step.set(
            xlabel="generated token (decode step; token 1 is the prefill's)",
            ylabel="latency per token (ms)",
            title=f"Per-token decode latency · prompt {plen}",
        )
        ax_cum.set(
            xlabel="generated token",
            ylabel="cumulative time (s, prefill included)",
            title=f"Total generation time · prompt {plen}",
        )
        for ax in (ax_step, ax_cum):
            ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"KV cache latency — {_title(meta)} — median of repeats", fontsize=12)
    _shared_legend(fig, axes.ravel())
    fig.tight_layout(rect=(0, 0.75 / (3.9 * n + 0.6), 1, 1))  # leave 0.75 inch for the legend
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _single_prompt_bars(ok: pd.DataFrame, meta: dict, path: Path) -> Path:
    """One prompt length: lines against prompt length would be single points, so draw one bar per engine x cache."""
    rows = [ok[(ok.engine == e) & (ok.cache == c)].iloc[0] for e, c in _series(ok)]
    labels = [_label(r.engine, r.cache) for r in rows]
    colours = [_colour(r.cache) for r in rows]
    hatches = [{"kvbench": "", "hf": "//"}.get(r.engine, "..") for r in rows]
    fig, (ax_sp, ax_tp) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2))
    y = range(len(rows))
    panels = (
        (ax_sp, [r.speedup_vs_none for r in rows], "speedup vs no cache (×, end to end)", "{:.1f}×"),
        (ax_tp, [r.tpot_ms_median for r in rows], "TPOT, median decode step (ms)", "{:.1f} ms"),
    )
    for ax, values, xlabel, fmt in panels:
        bars = ax.barh(list(y), values, color=colours, hatch=hatches, edgecolor="white")
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                fmt.format(v),
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(list(y), labels)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.margins(x=0.15)
        ax.grid(True, axis="x", alpha=0.3)
    ax_sp.axvline(1.0, color="grey", linewidth=1, linestyle=":")
    plen, new = int(ok.prompt_len.iloc[0]), int(ok.new_tokens.max())
    ax_sp.set_title(f"End-to-end speedup over no cache · prompt {plen}, {new} new tokens")
    ax_tp.set_title("Time per output token (decode only)")
    ax_tp.set_yticks(list(y), [""] * len(rows))
    fig.suptitle(f"KV cache speedup — {_title(meta)}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def speedup_figure(summary: pd.DataFrame, meta: dict, path: Path) -> Path:
    """Speedup over the same engine's no-cache run, and decode TPOT, against prompt length, per engine x cache."""
    ok = summary[summary["status"] == "ok"]
    if ok.prompt_len.nunique() == 1:
        return _single_prompt_bars(ok, meta, path)
    fig, (ax_sp, ax_tp) = plt.subplots(1, 2, figsize=(13, 4.8))
    speedups, tpots = [], []
    for engine, cache in _series(ok):
        sub = ok[(ok.engine == engine) & (ok.cache == cache)].sort_values("prompt_len")
        kw = dict(
            color=_colour(cache),
            linestyle=ENGINE_STYLE.get(engine, ":"),
            marker="o",
            linewidth=1.4,
            markersize=5,
        )
        if cache != "none":
            ax_sp.plot(sub.prompt_len, sub.speedup_vs_none, label=_label(engine, cache), **kw)
            speedups += list(sub.speedup_vs_none.dropna())
        ax_tp.plot(sub.prompt_len, sub.tpot_ms_median, label=_label(engine, cache), **kw)
        tpots += list(sub.tpot_ms_median.dropna())
    ax_sp.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    ax_sp.set(
        xlabel="prompt length (tokens)",
        ylabel="speedup vs no cache (×, end to end)",
        title=f"End-to-end speedup over no cache · {int(ok.new_tokens.max()) if len(ok) else '?'} new tokens",
    )
    _maybe_log(ax_sp, speedups + [1.0])
    ax_tp.set(
        xlabel="prompt length (tokens)",
        ylabel="TPOT, median decode step (ms)",
        title="Time per output token (decode only)",
    )
    _maybe_log(ax_tp, tpots)
    plens = sorted(ok.prompt_len.unique())
    for ax in (ax_sp, ax_tp):
        if len(plens) > 1 and plens[-1] / plens[0] >= 4:
            ax.set_xscale("log", base=2)
        if len(plens) <= MAX_TICKS:
            ax.set_xticks(plens)
        ax.xaxis.set_major_formatter(_PLAIN)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"KV cache speedup — {_title(meta)}", fontsize=12)
    _shared_legend(fig, (ax_tp,))
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_plots(
    run_dir: Path, summary: pd.DataFrame, steps: pd.DataFrame, meta: dict, not_drawn: list[str] | None = None
) -> list[Path]:
    """The figures into `run_dir`, or none when no configuration finished. latency.png is left out past
    MAX_LATENCY_PANELS prompt lengths; the reason is appended to `not_drawn`. A batch sweep adds batch.png and
    draws the other two at its smallest batch size that ran."""
    if summary.empty or (summary["status"] != "ok").all():
        return []
    out = []
    batches = sorted(summary.batch.unique()) if "batch" in summary.columns else []
    if len(batches) > 1:
        out.append(batch_figure(summary, meta, run_dir / "batch.png"))
        first = min(summary[summary.status == "ok"].batch)
        summary, steps = summary[summary.batch == first], steps[steps.batch == first]
        meta = {**meta, "model": f"{meta.get('model', '?')}, batch {first}"}
    n = len(_prompt_lens(summary))
    if n <= MAX_LATENCY_PANELS:
        out.insert(0, latency_figure(summary, steps, meta, run_dir / "latency.png"))
    elif not_drawn is not None:
        not_drawn.append(
            f"latency.png not drawn: {n} prompt lengths (it draws at most {MAX_LATENCY_PANELS}; speedup.png shows "
            "every one, and steps.csv holds every step)"
        )
    out.insert(1 if n <= MAX_LATENCY_PANELS else 0, speedup_figure(summary, meta, run_dir / "speedup.png"))
    return out


def _context_label(n: float) -> str:
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


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
        f"Decode cost vs context — {_title(meta)} — caches filled with RANDOM K/V (no prefill), decode only\n"
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
        colour = _colour(cache)
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
        a.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _context_label(x)))
        a.xaxis.set_minor_locator(NullLocator())
        a.grid(True, which="major", alpha=0.3)
        if cross is not None:
            a.axvline(cross, color="0.35", linestyle=":", linewidth=1.4)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(_PLAIN)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    if values:
        ax.set_ylim(min(values) / 1.5, max(values) * 1.5)


def _mark_crossover(ax, ax_x, cross: float | None, shown: bool, contexts: list) -> None:
    """The crossover context annotated on the left panel (both panels widened to hold it); a note in the corner
    when it falls outside the sweep."""
    if shown:
        ax.set_xlim(min(contexts[0], cross) / 1.4, max(contexts[-1], cross) * 1.4)
        ax_x.set_xlim(*ax.get_xlim())
        ax.annotate(
            f"K/V read = weight read\nat {cross:,} tokens",
            (cross, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -4),
            textcoords="offset points",
            va="top",
            fontsize=9,
            color="0.25",
        )
        ax.annotate(
            "← weights dominate",
            (cross, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(-4, 6),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="0.4",
        )
        ax.annotate(
            "K/V cache dominates →",
            (cross, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, 6),
            textcoords="offset points",
            ha="left",
            fontsize=8,
            color="0.4",
        )
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


# --- compare -------------------------------------------------------------------------------------------------------
VERDICT_COLOUR = {"slower": "tab:red", "faster": "tab:green", "no significant change": "tab:grey"}


def compare_figure(comparison, path: Path) -> Path:
    """compare.png: per row, the candidate / baseline TPOT median ratio with its bootstrap interval, sorted with
    the slowest at the top; a line at 1.0 (no change) and a band for the minimum effect (--threshold)."""
    rows = sorted(comparison.rows, key=lambda r: r.tpot_ratio, reverse=True)
    t = comparison.threshold
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 2.3))
    y = list(range(len(rows)))
    ax.axvspan(1 - t, 1 + t, color="0.92", zorder=0)  # changes smaller than the minimum effect
    ax.axvline(1.0, color="0.35", linewidth=1, zorder=1)
    for i, r in enumerate(rows):
        colour = VERDICT_COLOUR.get(r.verdict, "black")
        # The interval drawn as it is, from ci_low to ci_high: at a low confidence level (a large --alpha) it can
        # be narrower than the ratio's distance from its centre, and leave the ratio outside it.
        ax.plot([r.ci_low, r.ci_high], [i, i], color=colour, linewidth=2, zorder=2)
        ax.plot([r.ci_low, r.ci_high], [i, i], linestyle="none", marker="|", markersize=9, color=colour, zorder=2)
        ax.plot([r.tpot_ratio], [i], "o", color=colour, markersize=6, zorder=3)
        mark = "" if r.steady else " *"
        ax.annotate(
            f"×{r.tpot_ratio:.3f}  {r.verdict}{mark}",
            (max(r.ci_high, r.tpot_ratio), i),
            xytext=(7, 0),
            textcoords="offset points",
            va="center",
            fontsize=8.5,
            color=colour,
        )
    ax.set_yticks(y, [r.label for r in rows])
    ax.invert_yaxis()
    ax.set_ylim(len(rows) - 0.5, -0.5)
    lo = min([min(r.ci_low, r.tpot_ratio) for r in rows] + [1 - 1.5 * t, 0.9])
    hi = max([max(r.ci_high, r.tpot_ratio) for r in rows] + [1 + 1.5 * t, 1.1])
    pad = 0.05 * (hi - lo)
    ax.set_xlim(lo - pad, hi + 0.28 * (hi - lo))  # room on the right for the labels
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}×"))
    ax.set_xlabel("TPOT, candidate / baseline median decode step  (< 1: faster, > 1: slower)")
    ax.grid(True, axis="x", alpha=0.3)
    level = f"{comparison.confidence:.0%}"
    ax.set_title(
        f"bars: {level} bootstrap interval · shaded: ±{t:.0%}, the minimum effect · "
        f"test: Mann-Whitney U, alpha {comparison.alpha:g}"
        + (
            "\n*: a run's repeats disagree by more than the band (the machine changed speed)"
            if any(not r.steady for r in rows)
            else ""
        ),
        fontsize=9,
        color="0.3",
    )
    base, cand = Path(comparison.baseline).name, Path(comparison.candidate).name
    fig.suptitle(f"Decode speed: candidate '{cand}' against baseline '{base}'", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


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
    fig.suptitle(f"Decode speed against batch size — {_title(meta)} — {new} new tokens{where}", fontsize=12)
    _shared_legend(fig, axes.ravel())
    fig.tight_layout(rect=(0, 0.7 / (4.2 * n + 0.8), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _batch_row(axes, sub: pd.DataFrame, batches: list, cross: float | None, plen: int) -> None:
    ax_all, ax_seq, ax_x = axes
    for engine, cache in _series(sub):
        s = sub[(sub.engine == engine) & (sub.cache == cache)].sort_values("batch")
        kw = dict(
            color=_colour(cache),
            linestyle=ENGINE_STYLE.get(engine, ":"),
            marker="o",
            linewidth=1.4,
            markersize=5,
            label=_label(engine, cache),
        )
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
    _maybe_log(ax_all, [*sub.decode_tokens_per_s.dropna(), *ceiling_all])
    _maybe_log(ax_seq, [*sub.per_seq.dropna(), *ceiling_seq])
    _maybe_log(ax_x, [*sub.x_floor.dropna(), 1.0])


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
