"""TTFT and TPOT statistics end to end: what a real gpt2-tiny bench run writes (ttft.csv, the mean/std/percentile
columns, meta.json's host facts), checked against numpy on the files themselves; compare's TTFT verdict and
`--fail-on slower-ttft` on copies with known TTFT factors; the load warning; bad --percentiles."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app

runner = CliRunner()
REPEATS = 3
BENCH = [
    *"--model gpt2-tiny --weights random --device cpu --threads 1 --engine kvbench --caches dynamic,static".split(),
    *"--prompt-len 8 --new-tokens 21 --repeats".split(),
    str(REPEATS),
    "--warmup",
    "1",
]


def invoke(*args):
    n = torch.get_num_threads()
    r = runner.invoke(app, [str(a) for a in args])
    torch.set_num_threads(n)  # bench --threads sets it for the whole process
    return r, r.output + (repr(r.exception) if r.exception and not isinstance(r.exception, SystemExit) else "")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One real bench run whose TPOT percentiles come from its TOML file (95 and 99.9, not the default 99)."""
    tmp = tmp_path_factory.mktemp("ttft")
    (tmp / "sweep.toml").write_text("percentiles = [50, 95, 99.9]\n")
    out = tmp / "run"
    r, text = invoke("bench", *BENCH, "--config", tmp / "sweep.toml", "--out", out)
    assert r.exit_code == 0, text
    return out


def test_ttft_csv_and_the_statistics_columns_match_numpy_on_the_files(run):
    summary, steps, ttft = (pd.read_csv(run / f) for f in ("summary.csv", "steps.csv", "ttft.csv"))
    assert list(ttft.columns) == ["engine", "cache", "prompt_len", "batch", "repeat", "ttft_ms"]
    assert {c for c in summary.columns if c.startswith("tpot_ms_p")} == {
        "tpot_ms_p90",
        "tpot_ms_p95",
        "tpot_ms_p99.9",
    }
    for _, row in summary.iterrows():
        t = ttft[(ttft.cache == row["cache"]) & (ttft.prompt_len == row["prompt_len"])]
        assert sorted(t.repeat) == list(range(1, REPEATS + 1))
        x = t.ttft_ms.to_numpy()
        assert row["ttft_ms"] == pytest.approx(np.median(x), rel=1e-5)  # the existing column: the median
        assert row["ttft_ms_mean"] == pytest.approx(x.mean(), rel=1e-5)
        assert row["ttft_ms_std"] == pytest.approx(x.std(ddof=1), rel=1e-4)
        for q in (10, 50, 90, 99):
            assert row[f"ttft_ms_p{q}"] == pytest.approx(np.percentile(x, q), rel=1e-5)
        s = steps[(steps.cache == row["cache"]) & (steps.prompt_len == row["prompt_len"])].latency_ms.to_numpy()
        assert len(s) == REPEATS * 20
        assert row["tpot_ms_mean"] == pytest.approx(s.mean(), rel=1e-5)
        assert row["tpot_ms_std"] == pytest.approx(s.std(ddof=1), rel=1e-4)
        for col, q in (
            ("tpot_ms_median", 50),
            ("tpot_ms_p90", 90),
            ("tpot_ms_p95", 95),
            ("tpot_ms_p99.9", 99.9),
        ):
            assert row[col] == pytest.approx(np.percentile(s, q), rel=1e-5)
    assert json.loads((run / "meta.json").read_text())["settings"]["percentiles"] == [50.0, 95.0, 99.9]


def test_meta_records_the_cpu_and_the_load_at_start_and_end(run):
    h = json.loads((run / "meta.json").read_text())["host"]
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        None,
    )
    if model is not None:
        assert h["cpu_model"] == model
    assert h["cpus"] == os.cpu_count() and h["cpus_usable"] == len(os.sched_getaffinity(0))
    for when in ("start", "end"):
        load = h["load_average"][when]
        assert set(load) == {"1m", "5m", "15m"} and all(v >= 0 for v in load.values())
    assert "cuda" not in h  # a CPU run has no device facts
    from kvbench.model import gemv

    kernel = gemv.library()  # the GEMV's tuned row group where it was built, why not where it was not
    assert h["cpu_gemv_rows"] == (None if kernel is None else kernel.rows)
    assert h["cpu_gemv_prefetch"] == (None if kernel is None else kernel.prefetch)
    assert (h["cpu_gemv_rows"] is None) == (h["cpu_gemv_unavailable"] is not None)
    assert "cpu_operators" not in h  # a run without `--compile max` calls no operator


def _copy(src: Path, dst: Path, ttft_factor: float = 1.0, n: int | None = None) -> Path:
    """A copy of the run whose ttft.csv is scaled by `ttft_factor`; with `n`, it holds n seeded repeats per row
    instead (spread 10% around the run's median), so the TTFT test has the power 3 repeats lack."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("compare.*"))
    t = pd.read_csv(dst / "ttft.csv")
    if n is not None:
        rng = np.random.default_rng(0)
        t = pd.concat(
            [
                g.iloc[[0] * n].assign(repeat=range(1, n + 1), ttft_ms=g.ttft_ms.median() * (1 + 0.1 * rng.random(n)))
                for _, g in t.groupby(["cache", "prompt_len"])
            ],
            ignore_index=True,
        )
    t["ttft_ms"] *= ttft_factor
    t.to_csv(dst / "ttft.csv", index=False)
    return dst


def compare_json(base: Path, cand: Path, *opts):
    r, text = invoke("compare", base, cand, "--format", "json", *opts)
    return r, (json.loads(r.stdout) if r.exit_code in (0, 1) else None), text


def test_three_repeats_are_inconclusive_and_the_gate_says_it_cannot_fail(run, tmp_path):
    r, doc, text = compare_json(run, run, "--fail-on", "slower-ttft", "--out", tmp_path)
    assert r.exit_code == 0, text
    assert {row["ttft_verdict"] for row in doc["rows"]} == {"inconclusive (n=3)"}
    for row in doc["rows"]:
        assert row["ttft_ratio"] == 1.0 and row["ttft_ci_low"] <= 1.0 <= row["ttft_ci_high"]
        assert row["n_ttft_baseline"] == row["n_ttft_candidate"] == REPEATS
    assert doc["warnings"] == ["--fail-on slower-ttft cannot fail 2 of 2 row(s) (inconclusive (n=3))"]
    assert "warning: --fail-on slower-ttft cannot fail 2 of 2 row(s)" in r.stderr


@pytest.mark.parametrize(
    "factor, verdict, gate_exit", [(1.3, "slower", 1), (1.0, "no significant change", 0), (0.7, "faster", 0)]
)
def test_ttft_verdict_follows_the_factor_and_fails_its_own_gate(run, tmp_path, factor, verdict, gate_exit):
    base = _copy(run, tmp_path / "base", n=12)
    cand = _copy(base, tmp_path / "cand", factor)
    r, doc, text = compare_json(base, cand, "--fail-on", "slower-ttft")
    assert r.exit_code == gate_exit, text
    assert {row["ttft_verdict"] for row in doc["rows"]} == {verdict}
    assert {row["verdict"] for row in doc["rows"]} == {"no significant change"}  # TPOT untouched
    for row in doc["rows"]:
        assert row["ttft_ratio"] == pytest.approx(factor, rel=1e-6)
        assert row["ttft_ci_low"] <= row["ttft_ratio"] <= row["ttft_ci_high"]
    assert doc["regressed"] == (gate_exit == 1) and doc["warnings"] == []
    assert compare_json(base, cand, "--fail-on", "slower")[0].exit_code == 0  # the TPOT gate ignores TTFT
    if gate_exit:
        md, _ = invoke("compare", base, cand, "--format", "md", "--fail-on", "slower-ttft")
        assert "- **FAIL** (slower-ttft): kvbench dynamic prompt 8: slower TTFT ×1.300" in md.stdout


def test_a_run_without_ttft_csv_says_so(run, tmp_path):
    old = _copy(run, tmp_path / "old")
    (old / "ttft.csv").unlink()
    r, doc, text = compare_json(old, run)
    assert r.exit_code == 0, text
    assert {row["ttft_verdict"] for row in doc["rows"]} == {"no ttft.csv in the baseline"}
    assert all(row["ttft_ratio"] == pytest.approx(1.0) for row in doc["rows"])  # summary.csv's medians


def _set_load(run_dir: Path, load) -> None:
    meta = json.loads((run_dir / "meta.json").read_text())
    if load is None:
        meta["host"].pop("load_average")
    else:
        meta["host"]["load_average"]["start"]["1m"] = load
    (run_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("base_load, cand_load, warned", [(0.2, 1.5, True), (0.2, 1.1, False), (None, 9.0, False)])
def test_load_a_core_apart_is_warned_about(run, tmp_path, base_load, cand_load, warned):
    base, cand = _copy(run, tmp_path / "base"), _copy(run, tmp_path / "cand")
    _set_load(base, base_load)
    _set_load(cand, cand_load)
    r, doc, text = compare_json(base, cand)
    assert r.exit_code == 0, text
    lines = [w for w in doc["warnings"] if "load" in w]
    assert len(lines) == warned and ("warning: the machine's load differed" in r.stderr) == warned
    if warned:
        assert "0.20 in the baseline, 1.50 in the candidate" in lines[0]


def test_a_load_that_is_not_a_number_is_one_line(run, tmp_path):
    cand = _copy(run, tmp_path / "cand")
    _set_load(cand, "high")
    r, _, text = compare_json(run, cand)
    assert r.exit_code == 2, text
    assert r.stderr.strip().count("\n") == 0 and "host.load_average.start.1m is 'high', not a number" in r.stderr


@pytest.mark.parametrize("value", ["0", "100", "50,x", ",", "-1"])
def test_bad_percentiles_stop_bench_before_any_work(tmp_path, value):
    r, text = invoke("bench", *BENCH, "--percentiles", value, "--out", tmp_path / "run")
    assert r.exit_code == 2, text
    assert len(r.stderr.strip().splitlines()) == 1 and "percentiles" in r.stderr, text
    assert not (tmp_path / "run").exists()


def test_percentiles_are_refused_with_random_fill(tmp_path):
    r, text = invoke(
        *"bench --model gpt2-tiny --weights random --device cpu --fill random --prompt-len 64 --percentiles 95".split(),
        "--out",
        tmp_path / "run",
    )
    assert r.exit_code == 2, text
    assert r.stderr.strip() == (
        "error: --percentiles applies to prefill sweeps; --fill random writes its own tpot_ms_p10 and tpot_ms_p90"
    )


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed here")
def test_without_nvidia_ml_py_the_cuda_facts_are_null_with_the_reason():
    from kvbench.results.environment import cuda_facts

    assert cuda_facts(torch.device("cuda")) == {
        "processes": None,
        "clocks": None,
        "note": "nvidia-ml-py is not installed: not read",
    }
