"""Compare two `bench --endpoint` runs: did the server get slower, phase by phase?

Rows of the two summary.csv files are matched on KEY (phase, concurrency, prompt length, shared prefix, new
tokens); rows without a partner, or that ended in an error, are listed with the reason. For each matched row the
requests of that phase (requests.csv, status ok) are pooled on each side and TTFT and TPOT are compared as
results/compare.py compares a sweep's: the median ratio candidate / baseline with a percentile bootstrap interval,
a two-sided Mann-Whitney U test, and a verdict that needs p < alpha and a change of at least the threshold
(`inconclusive (n=...)` where so few requests could never reach alpha; results/stats.py). Output tokens/s and the
cached tokens come from summary.csv.

The runs must have served the same model (/v1/models' id) unless changes are allowed; a different reset, prompt
form or client machine is warned about. What the server ran on is not visible from outside: compare runs of one
server build on one otherwise idle machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.comparison import Compared, check_alpha, compared_fields, comparison_doc, number
from kvbench.results.endpoint_runs import KEY, EndpointRun, load_endpoint_run
from kvbench.results.environment import EnvChange, dig, load_warning
from kvbench.results.stats import TTFTComparison, compare_ttft

VERDICTS = ("slower", "faster", "no significant change")


@dataclass
class PhaseComparison:
    """One phase of one workload in both runs; ratios are candidate / baseline."""

    phase: str
    concurrency: int
    prompt_len: int
    prefix_len: int
    new_tokens: int
    ttft: TTFTComparison  # requests' TTFTs (the n_ttft_* fields: requests a side)
    ttft_ratio: float
    tpot: TTFTComparison  # requests' TPOTs, compared the same way
    tpot_ratio: float
    output_tok_s_ratio: float  # > 1: the candidate is faster
    cached_tokens_baseline: float
    cached_tokens_candidate: float

    @property
    def label(self) -> str:
        return f"{self.phase} concurrency {self.concurrency}"


@dataclass
class UnmatchedPhase:
    phase: str
    concurrency: int
    reason: str  # only in the baseline, only in the candidate, an error in ...

    def __str__(self) -> str:
        return f"{self.phase} concurrency {self.concurrency}: {self.reason}"


@dataclass(kw_only=True)
class EndpointComparison(Compared):
    """Two bench --endpoint runs compared phase by phase (the fields every comparison has: results/comparison.py;
    relaxed_keys and context stay empty here)."""

    rows: list[PhaseComparison]
    unmatched: list[UnmatchedPhase]

    def gate_warnings(self, fail_on: list[str]) -> list[str]:
        out = []
        if "memory" in fail_on:
            out.append("--fail-on memory cannot fail a bench --endpoint comparison (the server's memory is not read)")
        for gate, metric in (("slower", "tpot"), ("slower-ttft", "ttft")):
            unjudged = [r for r in self.rows if getattr(r, metric).ttft_verdict not in VERDICTS]
            if gate in fail_on and unjudged:
                why = "; ".join(sorted({getattr(r, metric).ttft_verdict for r in unjudged}))
                out.append(f"--fail-on {gate} cannot fail {len(unjudged)} of {len(self.rows)} row(s) ({why})")
        return out

    def regressions(self, fail_on: list[str]) -> list[str]:
        out = []
        for r in self.rows:
            if "slower" in fail_on and r.tpot.ttft_verdict == "slower":
                out.append(f"{r.label}: slower, TPOT ×{r.tpot_ratio:.3f} (p = {r.tpot.ttft_p_value:.2g})")
            if "slower-ttft" in fail_on and r.ttft.ttft_verdict == "slower":
                out.append(f"{r.label}: slower TTFT ×{r.ttft_ratio:.3f} (p = {r.ttft.ttft_p_value:.2g})")
        return out


def compare_endpoint_runs(
    baseline: str | Path,
    candidate: str | Path,
    alpha: float = 0.01,
    threshold: float = 0.05,
    allow_env_change: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
) -> EndpointComparison:
    """Match the two runs' phases and compare each pair (module docstring)."""
    check_alpha(alpha)
    base, cand = load_endpoint_run(baseline, "baseline"), load_endpoint_run(candidate, "candidate")
    changes = _changes(base, cand, allow_env_change)
    rows, unmatched = _pair(base, cand, alpha, threshold, n_boot, seed)
    if not rows:
        why = "; ".join(map(str, unmatched)) or "no phases"
        raise KVBenchError(f"the runs have no phase in common ({why}); phases are matched on {', '.join(KEY)}")
    return EndpointComparison(
        **compared_fields(base, cand, alpha, threshold, changes, allow_env_change),
        rows=rows,
        unmatched=unmatched,
        unfinished=[u for u in (_unfinished(base, "baseline"), _unfinished(cand, "candidate")) if u],
        warnings=_warnings(base, cand),
    )


def _changes(base: EndpointRun, cand: EndpointRun, allow: bool) -> list[EnvChange]:
    """A different served model: refused unless allowed (then listed)."""
    if base.model == cand.model:
        return []
    change = EnvChange("served model", base.model, cand.model)
    if not allow:
        raise KVBenchError(
            f"the runs measured different models ({base.model} -> {cand.model}); timings are not comparable. "
            "Compare anyway with --allow-env-change"
        )
    return [change]


def _warnings(base: EndpointRun, cand: EndpointRun) -> list[str]:
    out = []
    for name, path in (("--reset", ("settings", "reset")), ("prompt form", ("endpoint", "prompt_form"))):
        b, c = (dig(run.meta, path) for run in (base, cand))
        if b != c:
            out.append(f"the runs differ in {name} ({b} -> {c}): the cold rows and the cached tokens may differ for it")
    load = load_warning(base.meta, cand.meta)
    return out + ([load] if load else [])


def _unfinished(run: EndpointRun, role: str) -> str | None:
    if run.status in (None, "complete"):
        return None
    done = len(run.summary)
    return f"the {role} run did not finish (meta.json status {run.status!r}): {done} phase row(s) in summary.csv"


def _samples(run: EndpointRun) -> dict[tuple[str, int], pd.DataFrame]:
    r = run.requests
    ok = r[r["status"] == "ok"]
    return {(str(k[0]), int(k[1])): g for k, g in ok.groupby(["phase", "concurrency"], sort=False)}


def _pair(
    base: EndpointRun, cand: EndpointRun, alpha: float, threshold: float, n_boot: int, seed: int
) -> tuple[list[PhaseComparison], list[UnmatchedPhase]]:
    def key(r: pd.Series) -> tuple:
        return tuple(str(r[k]) if k == "phase" else int(r[k]) for k in KEY)

    b_rows = {key(r): r for _, r in base.summary.iterrows()}
    c_rows = {key(r): r for _, r in cand.summary.iterrows()}
    b_req, c_req = _samples(base), _samples(cand)
    rows: list[PhaseComparison] = []
    unmatched: list[UnmatchedPhase] = []
    for i, (k, b) in enumerate(b_rows.items()):
        c = c_rows.get(k)
        if c is None:
            unmatched.append(UnmatchedPhase(k[0], k[1], "only in the baseline"))
            continue
        failed = [side for side, r in (("baseline", b), ("candidate", c)) if r["status"] != "ok"]
        if failed:
            unmatched.append(UnmatchedPhase(k[0], k[1], f"an error in the {' and '.join(failed)}"))
            continue
        rb, rc = b_req.get(k[:2], pd.DataFrame()), c_req.get(k[:2], pd.DataFrame())
        rows.append(_phase(k, b, c, rb, rc, alpha, threshold, n_boot, seed + i))
    unmatched += [UnmatchedPhase(k[0], k[1], "only in the candidate") for k in c_rows if k not in b_rows]
    return rows, unmatched


def _values(df: pd.DataFrame, col: str) -> np.ndarray:
    if col not in df.columns:
        return np.empty(0)
    x = df[col].to_numpy(dtype=float)
    return x[~np.isnan(x)]


def _phase(k: tuple, b: pd.Series, c: pd.Series, rb: pd.DataFrame, rc: pd.DataFrame, *stats: Any) -> PhaseComparison:
    ttft_ratio, ttft = compare_ttft(_values(rb, "ttft_ms"), _values(rc, "ttft_ms"), *stats)
    tpot_ratio, tpot = compare_ttft(_values(rb, "tpot_ms"), _values(rc, "tpot_ms"), *stats)
    return PhaseComparison(
        phase=k[0],
        concurrency=k[1],
        prompt_len=k[2],
        prefix_len=k[3],
        new_tokens=k[4],
        ttft=ttft,
        ttft_ratio=ttft_ratio,
        tpot=tpot,
        tpot_ratio=tpot_ratio,
        output_tok_s_ratio=number(c, "output_tok_s") / number(b, "output_tok_s"),
        cached_tokens_baseline=number(b, "cached_tokens_mean"),
        cached_tokens_candidate=number(c, "cached_tokens_mean"),
    )


def _metric(prefix: str, x: TTFTComparison, ratio: float) -> dict[str, Any]:
    return {
        f"{prefix}_n_baseline": x.n_ttft_baseline,
        f"{prefix}_n_candidate": x.n_ttft_candidate,
        f"{prefix}_ms_baseline": x.ttft_ms_baseline,
        f"{prefix}_ms_candidate": x.ttft_ms_candidate,
        f"{prefix}_ratio": ratio,
        f"{prefix}_ci_low": x.ttft_ci_low,
        f"{prefix}_ci_high": x.ttft_ci_high,
        f"{prefix}_p_value": x.ttft_p_value,
        f"{prefix}_verdict": x.ttft_verdict,
    }


def row_doc(r: PhaseComparison) -> dict[str, Any]:
    keys = {k: getattr(r, k) for k in KEY}
    rest = {k: v for k, v in asdict(r).items() if k not in (*KEY, "ttft", "tpot", "ttft_ratio", "tpot_ratio")}
    return {**keys, **_metric("ttft", r.ttft, r.ttft_ratio), **_metric("tpot", r.tpot, r.tpot_ratio), **rest}


def json_doc(c: EndpointComparison, fail_on: list[str], files: list[Path] | None = None) -> dict[str, Any]:
    """The comparison as one JSON-ready document (NaN becomes null when written with jsonio.json_text)."""
    return comparison_doc(c, fail_on, [row_doc(r) for r in c.rows], files, kind="endpoint")
