"""The figures of a `bench --endpoint` run:

    latency.png     per --concurrency level: TTFT p50 and p99, TPOT p50 and p99 (ITL p50 beside it), and output
                    tokens/s with requests/s, one panel each, the levels evenly spaced on x
    cold_warm.png   the TTFT of every cold and every warm request, their medians and the cached tokens each found

A figure without data (no level finished, no cold/warm rounds) is not drawn; `notes` says why.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvbench.bench.endpoint_rows import EndpointRow, RequestRow  # noqa: E402

P50 = dict(marker="o", linewidth=1.6, markersize=6)
P99 = dict(marker="s", linewidth=1.2, markersize=5, linestyle="--")
COLOURS = {"ttft": "tab:blue", "tpot": "tab:orange", "itl": "tab:green", "tok": "tab:purple", "req": "tab:gray"}
PHASE_COLOUR = {"cold": "tab:blue", "warm": "tab:orange"}


def title(meta: dict[str, Any], sep: str = " · ") -> str:
    """'MODEL at URL · prompt N tokens, shared prefix P, M new' (`sep` between the server and the workload)."""
    s = meta.get("settings", {})
    prefix = s.get("prefix_len", 0)
    shared = f", shared prefix {prefix}" if prefix else ", unique prompts"
    return (
        f"{meta.get('model') or 'the served model'} at {meta.get('endpoint', {}).get('url', '?')}{sep}prompt "
        f"{s.get('prompt_len', '?')} tokens{shared}, {s.get('new_tokens', '?')} new"
    )


def ms(v: float) -> str:
    """About three significant digits, trailing zeros kept: 2.20, 14.5, 312."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def write_endpoint_plots(
    run_dir: Path, summary: list[EndpointRow], requests: list[RequestRow], meta: dict[str, Any], notes: list[str]
) -> list[Path]:
    out = []
    levels = [r for r in summary if r.phase == "load" and r.requests]
    if levels:
        out.append(latency_figure(levels, meta, run_dir / "latency.png"))
    else:
        notes.append("latency.png not drawn: no concurrency level finished a request")
    rounds = [r for r in requests if r.phase in ("cold", "warm") and r.status == "ok"]
    if {r.phase for r in rounds} == {"cold", "warm"}:
        out.append(cold_warm_figure(rounds, summary, meta, run_dir / "cold_warm.png"))
    elif meta.get("settings", {}).get("cold_warm"):
        notes.append("cold_warm.png not drawn: no cold and warm request finished")
    return out


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if v == v and not math.isinf(v)]


def latency_figure(levels: list[EndpointRow], meta: dict[str, Any], path: Path) -> Path:
    x = np.arange(len(levels))
    ticks = [str(r.concurrency) for r in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax_ttft, ax_tpot, ax_tok = axes
    ax_ttft.plot(x, [r.ttft_ms_p50 for r in levels], color=COLOURS["ttft"], label="p50", **P50)
    ax_ttft.plot(x, [r.ttft_ms_p99 for r in levels], color=COLOURS["ttft"], label="p99", **P99)
    ax_ttft.set_title("Time to first token")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_tpot.plot(x, [r.tpot_ms_p50 for r in levels], color=COLOURS["tpot"], label="TPOT p50", **P50)
    ax_tpot.plot(x, [r.tpot_ms_p99 for r in levels], color=COLOURS["tpot"], label="TPOT p99", **P99)
    ax_tpot.plot(x, [r.itl_ms_p50 for r in levels], color=COLOURS["itl"], label="ITL p50", marker="^", linewidth=1)
    ax_tpot.set_title("Time per output token")
    ax_tpot.set_ylabel("ms per token")
    ax_tok.plot(x, [r.output_tok_s for r in levels], color=COLOURS["tok"], label="output tokens/s", **P50)
    ax_tok.set_ylabel("output tokens/s", color=COLOURS["tok"])
    ax_tok.set_title("Throughput")
    ax_req = ax_tok.twinx()
    ax_req.plot(x, [r.requests_per_s for r in levels], color=COLOURS["req"], label="requests/s", **P99)
    ax_req.set_ylabel("requests/s", color=COLOURS["req"])
    for ax in axes:
        ax.set_xticks(x, ticks)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylim(bottom=0, top=max(_finite([*ax.get_ylim()]) or [1]) * 1.08)
        ax.grid(alpha=0.3)
    ax_req.set_ylim(bottom=0, top=max(_finite([r.requests_per_s for r in levels]) or [1]) * 1.15)
    ax_ttft.legend(fontsize=9, loc="upper left")
    ax_tpot.legend(fontsize=9, loc="upper left")
    handles = ax_tok.get_legend_handles_labels()[0] + ax_req.get_legend_handles_labels()[0]
    ax_tok.legend(handles, [h.get_label() for h in handles], fontsize=9, loc="upper left")
    fig.suptitle(f"Serving latency against concurrency — {title(meta)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cold_warm_figure(rounds: list[RequestRow], summary: list[EndpointRow], meta: dict[str, Any], path: Path) -> Path:
    rows = {r.phase: r for r in summary if r.phase in ("cold", "warm")}
    fig, ax = plt.subplots(figsize=(9, 5.6))
    rng = np.random.default_rng(0)  # jitter only: the points of one phase side by side
    for i, phase in enumerate(("cold", "warm")):
        ys = np.array([r.ttft_ms for r in rounds if r.phase == phase])
        xs = i + rng.uniform(-0.12, 0.12, len(ys))
        ax.scatter(xs, ys, s=28, alpha=0.7, color=PHASE_COLOUR[phase], label=f"{phase} ({len(ys)} requests)")
        med = float(np.median(ys))
        ax.hlines(med, i - 0.3, i + 0.3, color="black", linewidth=2)
        cached = rows[phase].cached_tokens_mean if phase in rows else math.nan
        said = f"median {ms(med)} ms" + (f"\ncached tokens {cached:.0f}" if cached == cached else "")
        ax.annotate(said, (i + 0.32, med), va="center", fontsize=9)
    ax.set_xticks([0, 1], ["cold\n(after the reset)", "warm\n(the prefix repeated)"])
    ax.set_xlim(-0.6, 1.9)
    ax.set_ylim(bottom=0, top=max(r.ttft_ms for r in rounds) * 1.15)
    ax.set_ylabel("TTFT (ms)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9, loc="upper right")
    cw = meta.get("cold_vs_warm") or {}
    ratio = cw.get("cold_over_warm")
    head = f"TTFT cold vs warm at a {cw.get('prefix_len', '?')}-token prefix"
    if isinstance(ratio, float) and ratio == ratio:
        head += f": cold / warm = {ratio:.2f}x"
    reset = meta.get("endpoint", {}).get("reset_how", "?")
    fig.suptitle(f"{head}\n{title(meta, sep=chr(10))} · reset: {reset}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


VERDICT_COLOUR = {"slower": "tab:red", "faster": "tab:green"}


def endpoint_compare_figure(comparison: Any, path: Path) -> Path:
    """compare.png of two bench --endpoint runs: per phase, the candidate / baseline median ratio of TTFT (left)
    and TPOT (right) with its bootstrap interval; a line at 1 (no change), a band for the minimum effect."""
    rows = comparison.rows
    t = comparison.threshold
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 2.4), sharey=True)
    y = list(range(len(rows)))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        ax.axvspan(1 - t, 1 + t, color="0.92", zorder=0)
        ax.axvline(1.0, color="0.35", linewidth=1, zorder=1)
        ratios = []
        for i, r in enumerate(rows):
            x, ratio = getattr(r, metric), getattr(r, f"{metric}_ratio")
            colour = VERDICT_COLOUR.get(x.ttft_verdict, "0.2")
            if x.ttft_ci_low == x.ttft_ci_low:
                ax.plot([x.ttft_ci_low, x.ttft_ci_high], [i, i], color=colour, linewidth=2, zorder=2)
                ratios += [x.ttft_ci_low, x.ttft_ci_high]
            if ratio == ratio:
                ax.plot([ratio], [i], "o", color=colour, markersize=6, zorder=3)
                ax.annotate(
                    f"×{ratio:.2f} {x.ttft_verdict}",
                    (ratio, i),
                    xytext=(0, 7),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                    color=colour,
                )
                ratios.append(ratio)
        lo, hi = min(ratios + [1 - 1.5 * t]), max(ratios + [1 + 1.5 * t])
        ax.set_xlim(lo - 0.18 * (hi - lo), hi + 0.18 * (hi - lo))
        ax.set_xlabel(f"{name}, candidate / baseline median  (> 1: slower)")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(y, [r.label for r in rows])
    axes[0].set_ylim(len(rows) - 0.4, -0.7)
    fig.suptitle(
        f"bench --endpoint: candidate against baseline · bars: {comparison.confidence:.0%} bootstrap interval · "
        f"shaded: ±{t:.0%} · Mann-Whitney U, alpha {comparison.alpha:g}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
