"""The figures of bench and compare, drawn with matplotlib (Agg): latency.png (the seed's two panels), speedup.png,
batch.png for a batch sweep, context.png for a random-fill context sweep, and compare.png.

batch.png is drawn by batch_plot.py, context.png by context_plot.py, the shared look is plot_style.py's.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

from kvbench.results.batch_plot import batch_figure  # noqa: E402
from kvbench.results.plot_style import (  # noqa: E402
    MAX_TICKS,
    PLAIN,
    line_kw,
    maybe_log,
    run_title,
    series_colour,
    series_hatch,
    series_keys,
    series_label,
    series_style,
    shared_legend,
)

# latency.png draws two panels per prompt length (about 0.4 s each on a small CPU); past this many prompt lengths
# it is not drawn (speedup.png still shows every one), so a long sweep, or one stopped by a signal, ends promptly.
MAX_LATENCY_PANELS = 12


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
        for engine, cache in series_keys(sub):
            per_step = curves.get((engine, cache, plen))  # (decode steps,)
            if per_step is None or per_step.empty:
                continue
            ttft_ms = float(sub[(sub.engine == engine) & (sub.cache == cache)]["ttft_ms"].iloc[0])
            kw = dict(color=series_colour(engine, cache), linestyle=series_style(engine), linewidth=1.4)
            # decode step j produces token j + 1; token 1 comes from the prefill
            ax_step.plot(per_step.index + 1, per_step.values, label=series_label(engine, cache), **kw)
            cum = (ttft_ms + per_step.cumsum()) / 1e3
            ax_cum.plot([1, *(per_step.index + 1)], [ttft_ms / 1e3, *cum.values], **kw)
            all_ms += list(per_step.values)
        maybe_log(ax_step, all_ms, ratio=8.0)
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
    fig.suptitle(f"KV cache latency — {run_title(meta)} — median of repeats", fontsize=12)
    shared_legend(fig, axes.ravel())
    fig.tight_layout(rect=(0, 0.75 / (3.9 * n + 0.6), 1, 1))  # leave 0.75 inch for the legend
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _single_prompt_bars(ok: pd.DataFrame, meta: dict, path: Path) -> Path:
    """One prompt length: lines against prompt length would be single points, so draw one bar per engine x cache."""
    rows = [ok[(ok.engine == e) & (ok.cache == c)].iloc[0] for e, c in series_keys(ok)]
    labels = [series_label(r.engine, r.cache) for r in rows]
    colours = [series_colour(r.engine, r.cache) for r in rows]
    hatches = [series_hatch(r.engine) for r in rows]
    fig, (ax_sp, ax_tp) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2))
    y = range(len(rows))
    panels = (
        (ax_sp, [r.speedup_vs_none for r in rows], "speedup vs no cache (×, end to end)", "{:.1f}×"),
        (ax_tp, [r.tpot_ms_median for r in rows], "TPOT, median decode step (ms)", "{:.1f} ms"),
    )
    for ax, values, xlabel, fmt in panels:
        bars = ax.barh(list(y), values, color=colours, hatch=hatches, edgecolor="white")
        for bar, v in zip(bars, values, strict=True):
            missing = pd.isna(v)  # a peer has no uncached run, so no speedup over one
            ax.annotate(
                "no uncached run" if missing else fmt.format(v),
                (0 if missing else bar.get_width(), bar.get_y() + bar.get_height() / 2),
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
    fig.suptitle(f"KV cache speedup — {run_title(meta)}", fontsize=12)
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
    for engine, cache in series_keys(ok):
        sub = ok[(ok.engine == engine) & (ok.cache == cache)].sort_values("prompt_len")
        kw = line_kw(engine, cache)
        if cache != "none":
            ax_sp.plot(sub.prompt_len, sub.speedup_vs_none, label=series_label(engine, cache), **kw)
            speedups += list(sub.speedup_vs_none.dropna())
        ax_tp.plot(sub.prompt_len, sub.tpot_ms_median, label=series_label(engine, cache), **kw)
        tpots += list(sub.tpot_ms_median.dropna())
    ax_sp.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    ax_sp.set(
        xlabel="prompt length (tokens)",
        ylabel="speedup vs no cache (×, end to end)",
        title=f"End-to-end speedup over no cache · {int(ok.new_tokens.max()) if len(ok) else '?'} new tokens",
    )
    maybe_log(ax_sp, speedups + [1.0])
    ax_tp.set(
        xlabel="prompt length (tokens)",
        ylabel="TPOT, median decode step (ms)",
        title="Time per output token (decode only)",
    )
    maybe_log(ax_tp, tpots)
    plens = sorted(ok.prompt_len.unique())
    for ax in (ax_sp, ax_tp):
        if len(plens) > 1 and plens[-1] / plens[0] >= 4:
            ax.set_xscale("log", base=2)
        if len(plens) <= MAX_TICKS:
            ax.set_xticks(plens)
        ax.xaxis.set_major_formatter(PLAIN)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"KV cache speedup — {run_title(meta)}", fontsize=12)
    shared_legend(fig, (ax_tp,))
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
