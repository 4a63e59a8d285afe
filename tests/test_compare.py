"""kvbench compare: real gpt2-tiny bench runs and copies whose decode steps are scaled by known factors. Verdicts
and exit codes follow the factors, the threshold and alpha; environment drift is refused; bad input is one line."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.results import stats as S
from kvbench.results.runs import load_run

runner = CliRunner()
CACHES = ("dynamic", "static")
PROMPTS = (8, 32)
# 80 decode steps x 3 repeats = 240 samples per row. The verdicts are statistics of the step times, so the
# baseline's times are redrawn from a known spread (each row's measured median times a lognormal, sigma 0.15)
# after the real run wrote its files: a busy machine (step times spread over a factor of 6 and more) would
# otherwise decide whether a 20% shift is significant, not compare's rules.
BENCH = [
    *"--model gpt2-tiny --weights random --device cpu --threads 1 --engine kvbench --caches".split(),
    ",".join(CACHES),
    "--prompt-len",
    ",".join(map(str, PROMPTS)),
    *"--new-tokens 81 --repeats 3 --warmup 1".split(),
]


@pytest.fixture(autouse=True)
def _restore_threads():
    """bench --threads sets torch's thread count for the whole process; put it back after each test."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    return r, r.output + (repr(r.exception) if r.exception and not isinstance(r.exception, SystemExit) else "")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """One real bench run, made once for the module: the baseline of every comparison (never modified)."""
    n = torch.get_num_threads()
    out = tmp_path_factory.mktemp("runs") / "baseline"
    r, text = invoke("bench", *BENCH, "--out", out)
    torch.set_num_threads(n)
    assert r.exit_code == 0, text
    steps = pd.read_csv(out / "steps.csv")
    rng = np.random.default_rng(0)
    keys = ["cache", "prompt_len"]
    median = steps.groupby(keys).latency_ms.transform("median")
    steps["latency_ms"] = median * rng.lognormal(0.0, 0.15, len(steps))
    steps.to_csv(out / "steps.csv", index=False)
    return out


def scaled_copy(src: Path, dst: Path, factor: float, only: dict | None = None) -> Path:
    """A copy of a run whose decode steps (and the summary's times) are multiplied by `factor`, in every row or only
    in the rows matching `only` (e.g. {"cache": "dynamic", "prompt_len": 8})."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("compare.*"))
    steps, summary = pd.read_csv(dst / "steps.csv"), pd.read_csv(dst / "summary.csv")
    ms, mu = pd.Series(True, index=steps.index), pd.Series(True, index=summary.index)
    for k, v in (only or {}).items():
        ms &= steps[k] == v
        mu &= summary[k] == v
    steps.loc[ms, "latency_ms"] *= factor
    for col in ("ttft_ms", "tpot_ms_median", "tpot_ms_p90", "total_s"):
        summary.loc[mu, col] *= factor
    summary.loc[mu, "tokens_per_s"] /= factor
    if (dst / "ttft.csv").is_file():  # the TTFT repeats, as the summary's ttft_ms
        ttft = pd.read_csv(dst / "ttft.csv")
        mt = pd.Series(True, index=ttft.index)
        for k, v in (only or {}).items():
            mt &= ttft[k] == v
        ttft.loc[mt, "ttft_ms"] *= factor
        ttft.to_csv(dst / "ttft.csv", index=False)
    steps.to_csv(dst / "steps.csv", index=False)
    summary.to_csv(dst / "summary.csv", index=False)
    return dst


def compare_json(base: Path, cand: Path, *opts) -> tuple[int, dict, str]:
    r, text = invoke("compare", base, cand, "--format", "json", *opts)
    doc = json.loads(r.stdout) if r.exit_code in (0, 1) else None
    return r.exit_code, doc, text


def verdicts(doc: dict) -> dict:
    return {(row["cache"], row["prompt_len"]): row["verdict"] for row in doc["rows"]}


# --- verdicts follow the factors -------------------------------------------------------------------------------------
def test_a_run_against_itself_is_no_significant_change(base_run, tmp_path):
    code, doc, text = compare_json(base_run, base_run, "--fail-on", "slower,memory", "--out", tmp_path)
    assert code == 0, text
    assert len(doc["rows"]) == len(CACHES) * len(PROMPTS) and not doc["unmatched"]
    for row in doc["rows"]:
        assert row["verdict"] == "no significant change"
        assert row["tpot_ratio"] == 1.0 and row["p_value"] == 1.0
        assert row["ci_low"] <= 1.0 <= row["ci_high"]
        assert row["n_baseline"] == row["n_candidate"] == 3 * 80
        assert row["ttft_ratio"] == 1.0 and row["kv_cache_delta_mib"] == 0 and not row["memory_regressed"]
    assert doc["confidence"] == pytest.approx(0.99) and doc["regressed"] is False


@pytest.mark.parametrize(
    "factor, threshold, expected, exit_code",
    [
        (1.00, "5%", "no significant change", 0),
        (1.03, "5%", "no significant change", 0),  # maybe significant, but under the minimum effect
        (1.20, "5%", "slower", 1),
        (1.20, "25%", "no significant change", 0),  # the same change, below a larger threshold
        (1.30, "5%", "slower", 1),
        (1.30, "0.35", "no significant change", 0),
        (0.80, "5%", "faster", 0),  # faster never fails the gate
    ],
)
def test_verdicts_and_exit_codes_follow_factor_and_threshold(
    base_run, tmp_path, factor, threshold, expected, exit_code
):
    cand = scaled_copy(base_run, tmp_path / "cand", factor)
    code, doc, text = compare_json(base_run, cand, "--threshold", threshold, "--fail-on", "slower")
    assert code == exit_code, text
    assert set(verdicts(doc).values()) == {expected}, doc["rows"]
    for row in doc["rows"]:
        assert row["tpot_ratio"] == pytest.approx(factor, rel=1e-6)  # the median scales exactly
        assert row["ci_low"] <= row["tpot_ratio"] <= row["ci_high"]
        assert row["tokens_per_s_ratio"] == pytest.approx(1 / factor, rel=1e-5)
    assert (cand / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # default: into the candidate folder


def test_one_row_slower_is_the_only_regression(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.30, only={"cache": "dynamic", "prompt_len": 8})
    r, text = invoke("compare", base_run, cand, "--fail-on", "slower")
    assert r.exit_code == 1, text
    assert "FAIL (slower): 1 regression(s)" in r.stdout and "kvbench dynamic prompt 8: slower" in r.stdout
    code, doc, _ = compare_json(base_run, cand)
    assert code == 0  # no gate, no failure
    expected = {(c, p): "no significant change" for c in CACHES for p in PROMPTS}
    expected[("dynamic", 8)] = "slower"
    assert verdicts(doc) == expected
    assert len(doc["regressions"]) == 0 and doc["fail_on"] == []


def test_alpha_decides_significance(base_run, tmp_path):
    """The same 20% change is slower at an alpha above its p-value and no significant change below it."""
    cand = scaled_copy(base_run, tmp_path / "cand", 1.20, only={"cache": "static", "prompt_len": 32})
    base, scaled = load_run(base_run, "baseline"), load_run(cand, "candidate")

    def pick(run):
        return run.steps[(run.steps.cache == "static") & (run.steps.prompt_len == 32)].latency_ms.to_numpy()

    p = S.mann_whitney_p(pick(base), pick(scaled))
    assert 0 < p < 0.01
    for alpha, expected in ((p * 2, "slower"), (p / 2, "no significant change")):
        code, doc, text = compare_json(base_run, cand, "--alpha", alpha, "--fail-on", "slower")
        assert verdicts(doc)[("static", 32)] == expected, text
        assert code == (1 if expected == "slower" else 0)


def test_bootstrap_interval_covers_the_true_ratio_and_narrows_with_samples():
    rng = np.random.default_rng(1)
    small, large = rng.lognormal(0, 0.3, 50), rng.lognormal(0, 0.3, 2000)
    r_small, lo_s, hi_s = S.median_ratio_ci(small, small * 1.2, 0.99, 2000, seed=0)
    r_large, lo_l, hi_l = S.median_ratio_ci(large, large * 1.2, 0.99, 2000, seed=0)
    assert r_small == pytest.approx(1.2) and r_large == pytest.approx(1.2)
    assert lo_s < 1.2 < hi_s and lo_l < 1.2 < hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 3  # 40x the samples: an interval about 6x narrower
    assert S.median_ratio_ci(small, small, 0.99, 500, seed=3) == S.median_ratio_ci(small, small, 0.99, 500, seed=3)


def test_too_few_steps_are_flagged():
    assert S.smallest_p(3, 3) == pytest.approx(0.1)  # 2 / C(6, 3): no pair of 3-step runs can reach alpha 0.01
    assert S.smallest_p(120, 120) < 1e-60


# --- memory, optional and extra columns ------------------------------------------------------------------------------
def test_memory_gate_on_kv_bytes(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    s = pd.read_csv(cand / "summary.csv")
    s.loc[s.cache == "static", "kv_cache_mib"] *= 2  # e.g. a cache that now preallocates twice the slots
    s.to_csv(cand / "summary.csv", index=False)
    code, doc, text = compare_json(base_run, cand, "--fail-on", "memory")
    assert code == 1, text
    assert {row["cache"] for row in doc["rows"] if row["memory_regressed"]} == {"static"}
    assert all(row["kv_cache_delta_mib"] > 0 for row in doc["rows"] if row["cache"] == "static")
    assert compare_json(base_run, cand, "--fail-on", "slower")[0] == 0  # not slower: only the memory gate fails


def test_token_agreement_only_when_both_runs_have_it_and_extra_columns_are_ignored(base_run, tmp_path):
    a = scaled_copy(base_run, tmp_path / "a", 1.0)
    b = scaled_copy(base_run, tmp_path / "b", 1.0)
    for run, agreement in ((a, 1.0), (b, 0.75)):
        s = pd.read_csv(run / "summary.csv")
        s["token_agreement"] = agreement
        s["a_future_column"] = "x"
        s.to_csv(run / "summary.csv", index=False)
        st = pd.read_csv(run / "steps.csv")
        st.insert(0, "another_column", 7)
        st.to_csv(run / "steps.csv", index=False)
    code, doc, text = compare_json(a, b)
    assert code == 0, text
    assert {(row["token_agreement_baseline"], row["token_agreement_candidate"]) for row in doc["rows"]} == {(1.0, 0.75)}
    r, text = invoke("compare", a, b)
    assert "agreement" in r.stdout and "1.000 → 0.750" in r.stdout, text

    # only the candidate has the column: not shown (a second baseline for b: its files go elsewhere)
    code, doc, text = compare_json(base_run, b, "--out", tmp_path / "second")
    assert code == 0, text
    assert all(row["token_agreement_baseline"] is None for row in doc["rows"])
    assert "0.750" not in invoke("compare", base_run, b, "--out", tmp_path / "second")[0].stdout


def test_missing_optional_columns_read_as_unknown(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    s = pd.read_csv(cand / "summary.csv").drop(columns=["ttft_ms", "tokens_per_s", "peak_mem_mib", "kv_cache_mib"])
    s.to_csv(cand / "summary.csv", index=False)
    (cand / "ttft.csv").unlink()  # a run from before ttft.csv: TTFT is unknown
    code, doc, text = compare_json(base_run, cand, "--fail-on", "slower,memory")
    assert code == 0, text
    row = doc["rows"][0]
    assert row["ttft_ratio"] is None and row["peak_mem_delta_mib"] is None and row["kv_cache_delta_mib"] is None
    assert row["ttft_verdict"] == "no ttft.csv in the candidate" and row["ttft_p_value"] is None


def test_unmatched_rows_are_listed_not_dropped(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    for name in ("summary.csv", "steps.csv"):
        df = pd.read_csv(cand / name)
        df = df[~((df.cache == "static") & (df.prompt_len == 32))]  # a row the candidate did not run
        moved = (df.cache == "dynamic") & (df.prompt_len == 32)
        df.loc[moved, "prompt_len"] = 64  # and one the baseline lacks
        if name == "summary.csv":
            df.loc[(df.cache == "static") & (df.prompt_len == 8), "status"] = "oom"  # one that ran out of memory
        df.to_csv(cand / name, index=False)
    code, doc, text = compare_json(base_run, cand)
    assert code == 0, text
    assert len(doc["rows"]) == 1
    assert {(u["cache"], u["prompt_len"], u["reason"]) for u in doc["unmatched"]} == {
        ("static", 8, "status oom in the candidate: no timings"),
        ("static", 32, "only in the baseline"),
        ("dynamic", 32, "only in the baseline"),
        ("dynamic", 64, "only in the candidate"),
    }
    r, _ = invoke("compare", base_run, cand)
    assert "not compared: kvbench dynamic prompt 64" in r.stdout and "4 not compared" in r.stdout


# --- environment drift -------------------------------------------------------------------------------------------------
def _edit_meta(run: Path, **changes) -> None:
    meta = json.loads((run / "meta.json").read_text())
    for path, value in changes.items():
        doc = meta
        *parents, leaf = path.split("__")
        for k in parents:
            doc = doc[k]
        doc[leaf] = value
    (run / "meta.json").write_text(json.dumps(meta))


def test_library_version_drift_is_refused_unless_allowed(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    _edit_meta(cand, versions__torch="9.9.9")
    r, text = invoke("compare", base_run, cand)
    assert r.exit_code == 2, text
    torch_version = json.loads((base_run / "meta.json").read_text())["versions"]["torch"]
    assert f"torch {torch_version} -> 9.9.9" in r.stderr and "--allow-env-change" in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.output

    r, text = invoke("compare", base_run, cand, "--allow-env-change")
    assert r.exit_code == 0, text
    assert f"torch {torch_version} -> 9.9.9" in r.stderr  # printed either way
    assert "environment changed (allowed)" in r.stdout


def test_dtype_drift_is_refused_and_allowed_runs_are_matched_without_it(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    _edit_meta(cand, dtype="bf16")
    s = pd.read_csv(cand / "summary.csv")
    s["dtype"] = "bf16"
    s.to_csv(cand / "summary.csv", index=False)
    r, text = invoke("compare", base_run, cand)
    assert r.exit_code == 2 and "dtype fp32 -> bf16" in r.stderr, text
    code, doc, text = compare_json(base_run, cand, "--allow-env-change")
    assert code == 0, text
    assert doc["environment"]["not_matched_on"] == ["dtype"]
    assert len(doc["rows"]) == len(CACHES) * len(PROMPTS)
    assert {row["dtype"] for row in doc["rows"]} == {"fp32->bf16"}


# --- bad input: one line on stderr, exit 2, no traceback -------------------------------------------------------------
def _not_a_run(tmp: Path, base: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _a_file(tmp: Path, base: Path) -> Path:
    (tmp / "summary.csv").write_text("engine,cache\n")
    return tmp / "summary.csv"


def _with(name: str, content: bytes):
    def make(tmp: Path, base: Path) -> Path:
        run = scaled_copy(base, tmp / "run", 1.0)
        (run / name).write_bytes(content)
        return run

    return make


def _no_common_rows(tmp: Path, base: Path) -> Path:
    run = scaled_copy(base, tmp / "run", 1.0)
    for name in ("summary.csv", "steps.csv"):
        df = pd.read_csv(run / name)
        df["prompt_len"] += 1000
        df.to_csv(run / name, index=False)
    return run


def _markup_name(tmp: Path, base: Path) -> Path:
    return tmp / "runs[bold red]x[/]" / "[/oops]"


BAD_INPUT = {
    "no such folder": (lambda tmp, base: tmp / "nowhere", "no such folder"),
    "a file, not a folder": (_a_file, "is a file, not a run folder"),
    "not a kvbench run": (_not_a_run, "is not a kvbench run folder (no meta.json, summary.csv, steps.csv)"),
    "corrupt summary.csv": (
        _with("summary.csv", b"engine,cache,prompt_len\nkvbench,static,8,1,2,3\n"),
        "line 2 has 6 fields, the header 3",
    ),
    "bad quoting": (
        _with("summary.csv", b'engine,cache,prompt_len\n"kvbench"x,static,8\n'),
        "is not a valid CSV (line 2",
    ),
    "truncated steps.csv": (
        _with("steps.csv", b"engine,cache,prompt_len,batch,repeat,step,latency_ms\nkvbench,static,8,1\n"),
        "line 2 has 4 fields, the header 7",
    ),
    "empty latency": (
        _with("steps.csv", b"engine,cache,prompt_len,latency_ms\nkvbench,static,8,\n"),
        "line 2 has no latency_ms",
    ),
    "text in a number column": (
        _with("steps.csv", b"engine,cache,prompt_len,latency_ms\nkvbench,static,8,fast\n"),
        "'fast', not a number",
    ),
    "summary.csv not UTF-8": (
        _with("summary.csv", "engine,cache,prompt_len\nkvbench,caché,8\n".encode("latin-1")),
        "is not UTF-8 text",
    ),
    "meta.json not UTF-8": (_with("meta.json", b'{"model": "\xff\xfe"}'), "is not UTF-8 text"),
    "meta.json not JSON": (_with("meta.json", b'{"model": '), "is not valid JSON"),
    "empty summary.csv": (_with("summary.csv", b""), "is empty"),
    "no rows in common": (
        _no_common_rows,
        "the runs have no rows in common (baseline vs candidate: prompt_len 32,8 vs 1008,1032)",
    ),
    "a path that looks like markup": (_markup_name, "runs[bold red]x[/]/[/oops]: no such folder"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(base_run, tmp_path, case):
    make, message = BAD_INPUT[case]
    cand = make(tmp_path, base_run)
    r, text = invoke("compare", base_run, cand)
    assert r.exit_code == 2, text
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


@pytest.mark.parametrize(
    "opts, message",
    [
        (["--format", "html"], "--format 'html': choose table, md or json"),
        (["--fail-on", "slow"], "--fail-on 'slow' is not a gate; choose from slower, memory"),
        (["--threshold", "5"], "did you mean 5%?"),
        (["--threshold", "abc"], "--threshold 'abc' is not a number"),
        (["--alpha", "1.5"], "--alpha must be between 0 and 1"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(base_run, opts, message):
    r, text = invoke("compare", base_run, base_run, *opts)
    assert r.exit_code == 2, text
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_bad_baseline_fails_before_the_bench_sweep(tmp_path):
    r, text = invoke("bench", *BENCH, "--out", tmp_path / "run", "--baseline", tmp_path / "missing")
    assert r.exit_code == 2, text
    assert "--baseline" in r.stderr and "no such folder" in r.stderr
    assert not (tmp_path / "run" / "summary.csv").exists()


def test_baseline_that_the_run_would_overwrite_is_refused(base_run, tmp_path):
    """--baseline X --out X --force would replace the baseline with the new run and compare it with itself."""
    before = (base_run / "summary.csv").read_bytes()
    r, text = invoke("bench", *BENCH, "--out", base_run, "--force", "--baseline", base_run)
    assert r.exit_code == 2, text
    assert r.stderr.strip().splitlines() == [
        f"error: --baseline and --out are the same folder ({base_run}): the run would overwrite the baseline it is "
        "compared against; write the new run elsewhere"
    ]
    assert (base_run / "summary.csv").read_bytes() == before and r.stdout == ""


# --- outputs ---------------------------------------------------------------------------------------------------------
def test_markdown_and_table_formats(base_run, tmp_path):
    cand = scaled_copy(base_run, tmp_path / "cand", 1.30, only={"cache": "dynamic", "prompt_len": 8})
    r, text = invoke("compare", base_run, cand, "--format", "md", "--fail-on", "slower")
    assert r.exit_code == 1, text
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| engine |"))
    rows = lines[header + 2 : header + 2 + len(CACHES) * len(PROMPTS)]
    assert all(row.count("|") == lines[header].count("|") for row in rows)
    assert any("| dynamic | 8 |" in row and "**slower**" in row for row in rows)
    assert "- **FAIL** (slower): kvbench dynamic prompt 8" in r.stdout
    assert "wrote compare.png, compare.json" in r.stderr  # stdout stays pasteable

    r, text = invoke("compare", base_run, cand)
    assert r.exit_code == 0, text
    assert "99% CI" in r.stdout and "slower" in r.stdout and "1 slower, 0 faster, 3 no significant change" in r.stdout
    saved = json.loads((cand / "compare.json").read_text())
    assert saved["candidate"] == str(cand) and len(saved["rows"]) == len(CACHES) * len(PROMPTS)


def test_bench_with_baseline_runs_the_comparison(base_run, tmp_path):
    out = tmp_path / "run"
    # one prompt length: the baseline's other rows are listed as not compared
    small = replaced(BENCH, prompt_len="8", **ONCE)
    r, text = invoke("bench", *small, "--out", out, "--baseline", base_run)
    assert r.exit_code == 0, text
    assert (out / "compare.png").is_file() and (out / "summary.csv").is_file()
    assert f"compare: {out} against baseline {base_run}" in r.stdout
    assert "not compared: kvbench dynamic prompt 32" in r.stdout
    doc = json.loads((out / "compare.json").read_text())
    assert {(row["cache"], row["prompt_len"]) for row in doc["rows"]} == {(c, 8) for c in CACHES}


def test_repeats_that_disagree_are_flagged(base_run, tmp_path):
    """One repeat of the candidate 30% slower than another (a burst of load): the row says the machine was not
    steady. Repeat 2 becomes repeat 1's steps x 1.3, so the spread is at least 30% whatever the run measured."""
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    steps = pd.read_csv(cand / "steps.csv")
    row_steps = (steps.cache == "static") & (steps.prompt_len == 8)
    first = steps[row_steps & (steps.repeat == 1)].latency_ms.to_numpy()
    steps.loc[row_steps & (steps.repeat == 2), "latency_ms"] = first * 1.3
    steps.to_csv(cand / "steps.csv", index=False)
    code, doc, text = compare_json(base_run, cand)
    assert code == 0, text
    flagged = {(row["cache"], row["prompt_len"]) for row in doc["rows"] if not row["steady"]}
    assert ("static", 8) in flagged, doc["rows"]
    row = next(row for row in doc["rows"] if (row["cache"], row["prompt_len"]) == ("static", 8))
    assert row["repeat_spread_candidate"] >= 0.3 - 1e-9
    r, text = invoke("compare", base_run, cand)
    # one engine: the header says it once, and each row starts at its cache
    assert "new tokens, engine kvbench, batch 1; git" in r.stdout, text
    marked = [ln for ln in r.stdout.splitlines() if ln.split()[:2] == ["static", "8"] and " * " in ln]
    assert len(marked) == 1, text
    assert "the repeats of one run disagree by more than 5%" in r.stdout


# --- bench --baseline checks the baseline before the sweep --------------------------------------------------------------
def replaced(args: list[str], **values: str) -> list[str]:
    """`args` with the values of some options replaced: replaced(BENCH, prompt_len="8") runs --prompt-len 8."""
    out = list(args)
    for name, value in values.items():
        i = out.index("--" + name.replace("_", "-"))
        out[i + 1] = value
    return out


# The bench --baseline tests time their candidate once: they read its comparison, never its timings.
ONCE = dict(repeats="1", warmup="0")
ONE_ROW = replaced(BENCH, prompt_len="8", caches="static", **ONCE)  # one row of the baseline's four


@pytest.mark.parametrize(
    "meta, needle",
    [
        ({"versions__torch": "9.9.9"}, "torch 9.9.9 -> {torch}"),  # baseline -> this run
        ({"host__huge_pages__THP_MEM_ALLOC_ENABLE": "0"}, "THP_MEM_ALLOC_ENABLE 0 -> "),
        ({"device_name": "CPU (arm64, 1 threads)"}, "device name CPU (arm64, 1 threads) -> CPU"),
    ],
)
def test_bench_baseline_of_another_environment_stops_before_the_sweep(base_run, tmp_path, meta, needle):
    base = scaled_copy(base_run, tmp_path / "base", 1.0)
    torch_version = json.loads((base / "meta.json").read_text())["versions"]["torch"]
    _edit_meta(base, **meta)
    r, text = invoke("bench", *ONE_ROW, "--out", tmp_path / "run", "--baseline", base)
    assert r.exit_code == 2, text
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle.format(torch=torch_version) in lines[0], text
    assert "kvbench bench --allow-env-change" in lines[0] and r.stdout == "", text
    assert not (tmp_path / "run").exists()  # stopped before any work


@pytest.mark.parametrize(
    "change, needle",
    [
        (["--prompt-len", "16"], "(baseline vs sweep: prompt_len 32,8 vs 16)"),
        (["--new-tokens", "21"], "(baseline vs sweep: new_tokens 81 vs 21)"),
        (["--caches", "paged"], "(baseline vs sweep: cache dynamic,static vs paged)"),
    ],
)
def test_bench_baseline_without_a_configuration_in_common_stops_before_the_sweep(base_run, tmp_path, change, needle):
    args = [*ONE_ROW]
    i = args.index(change[0])
    args[i + 1] = change[1]
    r, text = invoke("bench", *args, "--out", tmp_path / "run", "--baseline", base_run)
    assert r.exit_code == 2, text
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the sweep has no configuration in common with the baseline" in lines[0], text
    assert needle in lines[0] and r.stdout == "", text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("in_use", [True, False])
def test_bench_baseline_measured_with_other_huge_pages_is_compared(base_run, tmp_path, in_use):
    """Whether the kernel gave huge pages to the probe buffer is measured, not chosen: never a refusal. With the
    baseline's value set both ways, at least one of the two runs differs from what this run measures. With --json
    stdout is one document holding the run and its comparison."""
    base = scaled_copy(base_run, tmp_path / "base", 1.0)
    _edit_meta(base, host__huge_pages__in_use=in_use)
    r, text = invoke("bench", *ONE_ROW, "--out", tmp_path / "run", "--baseline", base, "--json")
    assert r.exit_code == 0, text
    doc = json.loads(r.stdout)  # the whole of stdout: one document
    assert [row["cache"] for row in doc["summary"]] == ["static"]
    assert [(row["cache"], row["prompt_len"]) for row in doc["compare"]["rows"]] == [("static", 8)]
    assert len(doc["compare"]["unmatched"]) == 3
    field = next(f for f in doc["compare"]["environment"]["context"] if f["name"] == "huge pages in use")
    assert field["baseline"] is in_use and field["differs"] == (field["candidate"] != in_use)
    assert (f"huge pages in use {in_use} -> " in r.stderr) == field["differs"], text


def test_bench_baseline_across_an_allowed_change_prints_the_bench_table_then_the_comparison(base_run, tmp_path):
    base = scaled_copy(base_run, tmp_path / "base", 1.0)
    _edit_meta(base, versions__numpy="0.0.1")
    out = tmp_path / "run"
    r, text = invoke("bench", *ONE_ROW, "--out", out, "--baseline", base, "--allow-env-change")
    assert r.exit_code == 0, text
    assert 0 <= r.stdout.index("bench: gpt2-tiny") < r.stdout.index(f"compare: {out} against baseline {base}"), text
    assert "environment changed (allowed): numpy 0.0.1 -> " in r.stdout
    assert (out / "compare.json").is_file()


def test_a_comparison_against_another_baseline_is_never_replaced_silently(base_run, tmp_path):
    """compare writes into the candidate folder: a second baseline must not overwrite the first one's result, while
    the same comparison run again replaces its own files."""
    a, b = scaled_copy(base_run, tmp_path / "a", 1.0), scaled_copy(base_run, tmp_path / "b", 1.0)
    cand = scaled_copy(base_run, tmp_path / "cand", 1.0)
    r, text = invoke("compare", a, cand)
    assert r.exit_code == 0, text
    first = (cand / "compare.json").read_bytes()
    r, text = invoke("compare", b, cand)
    assert r.exit_code == 2 and r.stderr.strip().count("\n") == 0, text
    assert "holds the comparison against" in r.stderr and "--out" in r.stderr
    assert (cand / "compare.json").read_bytes() == first
    assert invoke("compare", a, cand)[0].exit_code == 0  # the same comparison again
    assert invoke("compare", b, cand, "--out", tmp_path / "elsewhere")[0].exit_code == 0
