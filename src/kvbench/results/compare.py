"""Compare two bench run folders: did the candidate get slower than the baseline, row by row?

Rows of the two summary.csv files are matched on `KEY` (engine, cache, model, weights kind, dtype, device, prompt
length, new tokens, batch); rows without a partner, or that ran out of memory, are listed with the reason, never
dropped silently. For each matched row the decode-step latencies of every timed repeat (steps.csv) are pooled on
each side, and:

- the TPOT ratio is median(candidate steps) / median(baseline steps), with a percentile bootstrap confidence
  interval at level 1 - alpha (each side resampled with replacement, `n_boot` times, seeded, so the output is
  reproducible);
- the verdict comes from scipy's two-sided Mann-Whitney U test on the two samples plus a minimum effect:
  `slower` when p < alpha and the ratio is at least 1 + threshold, `faster` when p < alpha and the ratio is at most
  1 - threshold, otherwise `no significant change`. Mann-Whitney needs no normality, which timing samples (skewed,
  with a long tail of slow steps) never have; the threshold keeps a real but tiny shift, which thousands of steps
  make "significant", from failing a build.

Decode steps of one run are treated as independent draws. They are not quite: a run that was slowed as a whole
(a busy machine) shifts all its steps together, which no test on the steps can tell from a slower build. The
threshold absorbs small shifts of that kind, and runs of a different identity (environment.IDENTITY: device,
dtype, library versions, threads, what was asked for) are refused; what was measured about the machine at run time
(environment.CONTEXT: huge pages actually given, read bandwidth) is shown side by side and warned about when it
differs. Beyond that, compare runs made on the same, otherwise idle machine.

TTFT is compared the same way on its repeats (ttft.csv, one TTFT per timed repeat; results/stats.py), with its
own verdict; a run without ttft.csv gets the ratio of the summary medians and the verdict `no ttft.csv`. Tokens/s,
peak memory, KV bytes and (when both runs have the column) token agreement come from summary.csv. The statistics
are in results/stats.py, the environment checks and the load warning in results/environment.py, what every
comparison carries (a bench --endpoint one too) in results/comparison.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.comparison import Compared, check_alpha, compared_fields, comparison_doc, number
from kvbench.results.environment import (
    check_environment,
    context_fields,
    load_warning,
    tp_warning,
)
from kvbench.results.runs import KEY, Run, load_run, row_label, run_level
from kvbench.results.stats import (
    RunTTFTs,
    TTFTComparison,
    compare_ttft,
    mann_whitney_p,
    median_ratio_ci,
    repeat_spread,
    smallest_p,
    verdict,
)

VERDICTS = ("slower", "faster", "no significant change")  # what a test can conclude (TPOT and TTFT alike)
# Keys that --allow-env-change stops matching on when the two runs differ in them.
RELAXABLE = ("dtype", "device")

# What `--fail-on` can gate on: name -> what counts as a regression of a row.
FAIL_ON = {
    "slower": "the row's verdict is slower",
    "memory": "the KV cache holds more bytes, or (CUDA) peak allocated memory grew by more than the threshold",
    "slower-ttft": "the row's TTFT verdict is slower (Mann-Whitney U on the TTFT repeats, ttft.csv)",
}


@dataclass
class RowComparison:
    """One configuration in both runs. Ratios are candidate / baseline; deltas are candidate - baseline."""

    engine: str
    cache: str
    model: str
    weights: str
    dtype: str
    device: str
    prompt_len: int
    new_tokens: int
    batch: int
    n_baseline: int  # decode steps pooled over the timed repeats
    n_candidate: int
    tpot_ms_baseline: float  # median decode step (from steps.csv)
    tpot_ms_candidate: float
    tpot_ratio: float  # > 1: the candidate is slower
    ci_low: float  # bootstrap interval of tpot_ratio at the comparison's confidence level
    ci_high: float
    p_value: float  # two-sided Mann-Whitney U on the two step samples
    verdict: str  # faster | slower | no significant change
    ttft_ratio: float  # median TTFT ratio (ttft.csv; without it summary.csv's ttft_ms), NaN where a run lacks both
    tokens_per_s_ratio: float  # > 1: the candidate is faster end to end
    peak_mem_delta_mib: float
    kv_cache_delta_mib: float
    token_agreement_baseline: float  # NaN unless both runs have the column
    token_agreement_candidate: float
    memory_regressed: bool
    repeat_spread_baseline: float = 0.0  # slowest / fastest repeat's median step - 1, within the run
    repeat_spread_candidate: float = 0.0
    # False: a run's repeats are further apart than the threshold (p understates uncertainty)
    steady: bool = True
    notes: list[str] = field(default_factory=list)
    ttft: TTFTComparison | None = None  # the TTFT repeats compared (stats.compare_ttft)

    @property
    def label(self) -> str:
        return row_label(self)


@dataclass
class Unmatched:
    """A row that was not compared, and why."""

    engine: str
    cache: str
    prompt_len: int
    detail: str  # the rest of its key, e.g. "gpt2-tiny random fp32 cpu, 41 new tokens, batch 1"
    reason: str  # e.g. "only in the baseline", "out of memory in the candidate"
    batch: int = 1


@dataclass(kw_only=True)
class Comparison(Compared):
    """Two bench sweeps compared row by row (the fields every comparison has: results/comparison.py)."""

    rows: list[RowComparison]
    unmatched: list[Unmatched]

    def gate_warnings(self, fail_on: list[str]) -> list[str]:
        """A gate asked for that some rows cannot trip: slower-ttft where a row's TTFTs give no verdict."""
        if "slower-ttft" not in fail_on:
            return []
        unjudged = [r for r in self.rows if r.ttft is None or r.ttft.ttft_verdict not in VERDICTS]
        if not unjudged:
            return []
        why = "; ".join(sorted({r.ttft.ttft_verdict if r.ttft else "no ttft.csv" for r in unjudged}))
        return [f"--fail-on slower-ttft cannot fail {len(unjudged)} of {len(self.rows)} row(s) ({why})"]

    def regressions(self, fail_on: list[str]) -> list[str]:
        """One line per regressed row, for the gates named in `fail_on` (keys of FAIL_ON)."""
        out = []
        for r in self.rows:
            if "slower" in fail_on and r.verdict == "slower":
                unsteady = "" if r.steady else "; a run's repeats disagree: rerun before trusting this"
                out.append(f"{r.label}: slower, TPOT ×{r.tpot_ratio:.3f} (p = {r.p_value:.2g}{unsteady})")
            if "slower-ttft" in fail_on and r.ttft is not None and r.ttft.ttft_verdict == "slower":
                out.append(f"{r.label}: slower TTFT ×{r.ttft_ratio:.3f} (p = {r.ttft.ttft_p_value:.2g})")
            if "memory" in fail_on and r.memory_regressed:
                out.append(f"{r.label}: memory, {'; '.join(n for n in r.notes if n.startswith('memory'))}")
        return out


def _detail(r: pd.Series) -> str:
    # r["dtype"], not r.dtype: a Series' own .dtype attribute would win
    return f"{r['model']} {r['weights']} {r['dtype']} {r['device']}, {int(r['new_tokens'])} new tokens, batch {int(r['batch'])}"


class _Steps:
    """One run's decode steps grouped once by the key columns steps.csv has: a summary row's steps are a lookup."""

    def __init__(self, run: Run) -> None:
        st = run.steps
        self.cols = [c for c in KEY if c in st.columns]
        latency = st["latency_ms"].to_numpy(dtype=float)
        groups = st.groupby(self.cols, sort=False, dropna=False).indices
        self.steps = {self._key(k): latency[i] for k, i in groups.items()}
        self.repeats: dict[tuple, list[float]] = {}
        if "repeat" in st.columns:
            medians = st.groupby([*self.cols, "repeat"], sort=False, dropna=False)["latency_ms"].median()
            for k, m in medians.items():
                self.repeats.setdefault(self._key(k[:-1]), []).append(float(m))

    def _key(self, k) -> tuple:
        return k if isinstance(k, tuple) else (k,)

    def of(self, row: pd.Series) -> tuple[np.ndarray, list[float]]:
        """The pooled decode-step latencies of one summary row (steps.csv rows with the same key columns), and the
        median of each timed repeat where steps.csv says which repeat a step belongs to."""
        key = tuple(row[c] for c in self.cols)
        return self.steps.get(key, np.empty(0)), self.repeats.get(key, [])


def unfinished(run: Run, role: str) -> str | None:
    """A line saying the run's sweep did not finish and which configurations it lacks; None when it finished (or
    its meta.json does not say)."""
    status = run.status
    if status is None or status == "complete":
        return None
    how = {
        "interrupted": "was interrupted",
        "running": "did not finish (meta.json says running: it is still running, or was stopped without a word)",
    }.get(status, f"did not finish (meta.json status {status!r})")
    planned = run.planned
    if planned is None:
        return f"the {role} run {how}: it may lack configurations ({len(run.summary)} in summary.csv)"
    sm = run.summary
    done = set(zip(sm["engine"], sm["cache"], sm["prompt_len"].astype(int), sm["batch"].astype(int), strict=True))
    missing = [p for p in planned if p not in done]
    if not missing:
        return f"the {role} run {how}, after its last configuration"
    shown = ", ".join(f"{e} {c} prompt {n}" + (f" batch {b}" if b != 1 else "") for e, c, n, b in missing[:6])
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    return f"the {role} run {how}: {len(missing)} of its {len(planned)} configurations are missing ({shown}{more})"


def _relaxed(base: pd.DataFrame, cand: pd.DataFrame, allow_env_change: bool) -> list[str]:
    """With --allow-env-change, runs made in different dtypes or on different devices are matched without them."""
    return [k for k in RELAXABLE if set(base[k]) != set(cand[k])] if allow_env_change else []


def compare_runs(
    baseline: str | Path,
    candidate: str | Path,
    alpha: float = 0.01,
    threshold: float = 0.05,
    allow_env_change: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Match the two runs' rows and compare each pair (see the module docstring for the statistics)."""
    check_alpha(alpha)
    if not 0 <= threshold < 1:
        raise KVBenchError(f"--threshold must be at least 0% and below 100%, got {threshold:.0%}")
    base, cand = load_run(baseline, "baseline"), load_run(candidate, "candidate")
    changes = check_environment(base.meta, cand.meta, allow_env_change)
    relaxed = _relaxed(base.summary, cand.summary, allow_env_change)
    match = [k for k in KEY if k not in relaxed]
    rows, unmatched = _pair_rows(base, cand, match, alpha, threshold, n_boot, seed)
    if not rows:
        raise KVBenchError(_nothing_in_common(base.summary, cand.summary, match, unmatched))
    return Comparison(
        **compared_fields(base, cand, alpha, threshold, changes, allow_env_change),
        rows=rows,
        unmatched=unmatched,
        relaxed_keys=relaxed,
        context=context_fields(base.meta, cand.meta, threshold),
        unfinished=[u for u in (unfinished(base, "baseline"), unfinished(cand, "candidate")) if u],
        warnings=[w for w in (load_warning(base.meta, cand.meta), tp_warning(base.meta, cand.meta)) if w],
    )


def _pair_rows(
    base: Run, cand: Run, match: list[str], alpha: float, threshold: float, n_boot: int, seed: int
) -> tuple[list[RowComparison], list[Unmatched]]:
    """Each baseline row with the candidate row of the same `match` key, compared (row i seeded with seed + i);
    the rows with no partner, or without timings on one side, listed as unmatched with the reason."""
    b_rows = {tuple(r[k] for k in match): r for _, r in base.summary.iterrows()}
    c_rows = {tuple(r[k] for k in match): r for _, r in cand.summary.iterrows()}
    b_steps, c_steps = _Steps(base), _Steps(cand)
    b_ttft, c_ttft = RunTTFTs(base), RunTTFTs(cand)
    rows: list[RowComparison] = []
    unmatched: list[Unmatched] = []

    def skip(r: pd.Series, reason: str) -> None:
        unmatched.append(Unmatched(r["engine"], r["cache"], int(r["prompt_len"]), _detail(r), reason, int(r["batch"])))

    for i, (key, b) in enumerate(b_rows.items()):
        c = c_rows.get(key)
        if c is None:
            skip(b, "only in the baseline")
            continue
        failed = [
            f"{r.get('status')} in the {side}"
            for side, r in (("baseline", b), ("candidate", c))
            if r.get("status", "ok") != "ok"
        ]
        if failed:
            skip(b, f"status {' and '.join(failed)}: no timings")  # e.g. oom: CUDA ran out of memory
            continue
        (xb, rb), (xc, rc) = b_steps.of(b), c_steps.of(c)
        empty = [side for side, x in (("baseline", xb), ("candidate", xc)) if len(x) == 0]
        if empty:
            skip(b, f"no decode steps in the {' and '.join(empty)} steps.csv")
            continue
        row = _compare_row(b, c, xb, xc, alpha, threshold, n_boot, seed + i)
        row.repeat_spread_baseline, row.repeat_spread_candidate = repeat_spread(rb), repeat_spread(rc)
        # Repeats of one run further apart than the effect we look for: the machine changed speed within the run.
        row.steady = max(row.repeat_spread_baseline, row.repeat_spread_candidate) <= threshold
        ratio, row.ttft = compare_ttft(b_ttft.of(b), c_ttft.of(c), alpha, threshold, n_boot, seed + i)
        if ratio == ratio:  # the TTFT repeats' ratio where both runs have them (NaN: keep summary.csv's)
            row.ttft_ratio = ratio
        rows.append(row)
    for key, c in c_rows.items():
        if key not in b_rows:
            skip(c, "only in the candidate")
    return rows, unmatched


def _differing(base: pd.DataFrame, cand: pd.DataFrame, match: list[str], other: str = "candidate") -> str:
    """' (baseline vs candidate: prompt_len 32,8 vs 1008,1032)': the key fields with no value in common."""
    differ = []
    for k in match:
        vb, vc = sorted(map(str, set(base[k]))), sorted(map(str, set(cand[k])))
        if not set(vb) & set(vc):
            differ.append(f"{k} {','.join(vb)} vs {','.join(vc)}")
    return f" (baseline vs {other}: {'; '.join(differ)})" if differ else ""


def _nothing_in_common(base: pd.DataFrame, cand: pd.DataFrame, match: list[str], unmatched: list[Unmatched]) -> str:
    if any(u.reason.startswith(("status", "no decode")) for u in unmatched):
        return f"no row could be compared: {'; '.join(f'{row_label(u)}: {u.reason}' for u in unmatched)}"
    return f"the runs have no rows in common{_differing(base, cand, match)}; rows are matched on {', '.join(match)}"


def check_baseline(base: Run, meta: dict, planned: list[tuple[str, str, int, int]], allow_env_change: bool) -> None:
    """`bench --baseline`, before the sweep: the run about to be made (its meta.json fields and the configurations
    it plans, (engine, cache, prompt_len, batch)) must be comparable with the baseline, or the command stops now rather
    than after the work: the same identity (unless allowed), and at least one configuration in common."""
    check_environment(base.meta, meta, allow_env_change, command="kvbench bench")
    level = run_level(meta)
    sweep = pd.DataFrame([{**level, "engine": e, "cache": c, "prompt_len": p, "batch": b} for e, c, p, b in planned])
    if sweep.empty:
        return
    sweep["weights"] = sweep["weights"].astype(str)
    match = [k for k in KEY if k not in _relaxed(base.summary, sweep, allow_env_change)]
    have = set(base.summary[match].itertuples(index=False, name=None))
    if not any(k in have for k in sweep[match].itertuples(index=False, name=None)):
        why = _differing(base.summary, sweep, match, "sweep")
        raise KVBenchError(
            f"the sweep has no configuration in common with the baseline{why}; "
            f"rows are matched on {', '.join(match)}: sweep what the baseline ran, or choose another --baseline"
        )


def _compare_row(b, c, xb, xc, alpha, threshold, n_boot, seed) -> RowComparison:
    ratio, lo, hi = median_ratio_ci(xb, xc, 1 - alpha, n_boot, seed)
    p = mann_whitney_p(xb, xc)
    notes = []
    if smallest_p(len(xb), len(xc)) >= alpha:
        notes.append(f"too few decode steps ({len(xb)} vs {len(xc)}) for any result to reach alpha {alpha:g}")

    kv_b, kv_c = number(b, "kv_cache_mib"), number(c, "kv_cache_mib")
    kv_delta = kv_c - kv_b
    peak_b, peak_c = number(b, "peak_mem_mib"), number(c, "peak_mem_mib")
    peak_delta = peak_c - peak_b
    memory = False
    if kv_delta > 1e-6 * max(abs(kv_b), 1e-9):  # KV bytes are exact counts: any growth is real
        memory = True
        notes.append(f"memory: the KV cache holds {kv_delta:.4g} MiB more")
    # On the CPU peak memory is the process's high-water mark (everything run before counts): not a gate there.
    on_cuda = str(b["device"]).startswith("cuda") and str(c["device"]).startswith("cuda")
    if on_cuda and peak_b > 0 and peak_delta > threshold * peak_b:
        memory = True
        notes.append(f"memory: peak allocated {peak_delta:+.1f} MiB ({peak_delta / peak_b:+.1%})")
    both_agree = "token_agreement" in b.index and "token_agreement" in c.index
    return RowComparison(
        engine=b["engine"],
        cache=b["cache"],
        model=b["model"],
        weights=b["weights"],
        dtype=b["dtype"] if b["dtype"] == c["dtype"] else f"{b['dtype']}->{c['dtype']}",
        device=b["device"] if b["device"] == c["device"] else f"{b['device']}->{c['device']}",
        prompt_len=int(b["prompt_len"]),
        new_tokens=int(b["new_tokens"]),
        batch=int(b["batch"]),
        n_baseline=len(xb),
        n_candidate=len(xc),
        tpot_ms_baseline=float(np.median(xb)),
        tpot_ms_candidate=float(np.median(xc)),
        tpot_ratio=ratio,
        ci_low=lo,
        ci_high=hi,
        p_value=p,
        verdict=verdict(ratio, p, alpha, threshold),
        ttft_ratio=number(c, "ttft_ms") / number(b, "ttft_ms"),
        tokens_per_s_ratio=number(c, "tokens_per_s") / number(b, "tokens_per_s"),
        peak_mem_delta_mib=peak_delta,
        kv_cache_delta_mib=kv_delta,
        token_agreement_baseline=number(b, "token_agreement") if both_agree else math.nan,
        token_agreement_candidate=number(c, "token_agreement") if both_agree else math.nan,
        memory_regressed=memory,
        notes=notes,
    )


# --- options and outputs ---------------------------------------------------------------------------------------------
def parse_fail_on(text: str | None) -> list[str]:
    """Comma-separated names of FAIL_ON (`slower`, `slower-ttft`, `memory`) -> the list of gates; None (not
    given) -> no gate. An empty value is refused: a gate that quietly gates nothing would pass every build."""
    if text is None:
        return []
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise KVBenchError(
            f"--fail-on {text!r} names no gate; give one or more of {', '.join(FAIL_ON)}, comma-separated (or leave "
            "--fail-on out)"
        )
    bad = [n for n in names if n not in FAIL_ON]
    if bad:
        raise KVBenchError(f"--fail-on {bad[0]!r} is not a gate; choose from {', '.join(FAIL_ON)} (comma-separated)")
    return names


def parse_threshold(text: str) -> float:
    """`5%` or `0.05` -> 0.05. A bare number of 1 or more is refused (5 would mean 500%)."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise KVBenchError(f"--threshold {s!r} is not a number; give e.g. 5% or 0.05") from None
    if not s.endswith("%") and value >= 1:
        raise KVBenchError(f"--threshold {s}: give a fraction (0.05) or a percentage (5%); did you mean {s}%?")
    if not 0 <= value < 1:
        raise KVBenchError(f"--threshold {s} must be at least 0% and below 100%")
    return value


def _row_doc(r: RowComparison) -> dict:
    """A row as the JSON document holds it: its TTFT comparison's fields (ttft_verdict, ...) beside the others."""
    doc = asdict(r)
    ttft = doc.pop("ttft") or asdict(compare_ttft(None, None, 0.5, 0.0, 0, 0)[1])
    return {**doc, **ttft}


def json_doc(c: Comparison, fail_on: list[str], files: list[Path] | None = None) -> dict:
    """The whole comparison as one JSON-ready document; written with jsonio.json_text, which turns NaN and
    infinities into null."""
    environment = {"not_matched_on": c.relaxed_keys, "context": [asdict(f) for f in c.context]}
    return comparison_doc(c, fail_on, [_row_doc(r) for r in c.rows], files, environment=environment)
