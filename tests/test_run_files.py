"""Run folders written by hand (no bench runs): what compare trusts in them and what it refuses.

Every number compare reads is checked (one line naming file, line and column, exit 2, nothing written); identity
and measured context are told apart; the outputs (JSON, Markdown, compare.png) hold whatever a valid run holds;
a run that did not finish is named with what it lacks; a closed stdout ends quietly; compare scales to 10^5 steps.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.results import compare as C
from kvbench.results import stats as S

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60  # decode steps per repeat
REPEATS = 3
ROWS = (("kvbench", "dynamic", 8), ("kvbench", "static", 8), ("kvbench", "static", 32))


def meta_doc(**changes) -> dict:
    """A meta.json as bench writes it, reduced to what compare reads."""
    meta = {
        "schema_version": 1,
        "status": "complete",
        "model": "gpt2-tiny",
        "weights": "random(seed=0, std=0.02)",
        "device": "cpu",
        "device_name": "CPU (x86_64, 1 threads)",
        "dtype": "fp32",
        "settings": {"new_tokens": STEPS + 1, "batch": 1},
        "versions": {
            "python": "3.11.7",
            "torch": "2.5.0",
            "transformers": "4.46.0",
            "numpy": "2.1.0",
            "cuda": None,
            "torch_threads": "1",
        },
        "host": {"huge_pages": {"THP_MEM_ALLOC_ENABLE": "1", "system": "madvise", "in_use": True}},
        "floor": {"bandwidth": {"gbps": 20.0}},
        "git": {"commit": "0" * 40, "dirty": False},
        "configurations_planned": [{"engine": e, "cache": c, "prompt_len": p} for e, c, p in ROWS],
    }
    for path, value in changes.items():
        doc = meta
        *parents, leaf = path.split("__")
        for k in parents:
            doc = doc[k]
        doc[leaf] = value
    return meta


def make_run(path: Path, factor: float = 1.0, rows=ROWS, steps: int = STEPS, seed: int = 0, **meta) -> Path:
    """A run folder: lognormal decode steps around 5 ms (the same draws for every factor), scaled by `factor`."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    summary, parts = [], []
    for engine, cache, prompt_len in rows:
        x = 5.0 * rng.lognormal(0, 0.05, (REPEATS, steps)) * factor  # (repeats, steps)
        summary.append(
            dict(
                engine=engine,
                cache=cache,
                prompt_len=prompt_len,
                new_tokens=steps + 1,
                batch=1,
                dtype="fp32",
                device="cpu",
                status="ok",
                ttft_ms=12.0 * factor,
                tpot_ms_median=float(np.median(x)),
                tokens_per_s=100.0 / factor,
                peak_mem_mib=300.0,
                kv_cache_mib=0.5,
            )
        )
        parts.append(
            pd.DataFrame(
                dict(
                    engine=engine,
                    cache=cache,
                    prompt_len=prompt_len,
                    batch=1,
                    repeat=np.repeat(np.arange(1, REPEATS + 1), steps),
                    step=np.tile(np.arange(1, steps + 1), REPEATS),
                    latency_ms=x.ravel(),
                )
            )
        )
    pd.DataFrame(summary).to_csv(path / "summary.csv", index=False)
    pd.concat(parts).to_csv(path / "steps.csv", index=False)
    (path / "meta.json").write_text(json.dumps(meta_doc(**meta)))
    return path


def invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r, f"exit {r.exit_code}\nstdout: {r.stdout}\nstderr: {r.stderr}"


def files_in(*folders: Path) -> dict:
    return {p: p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def assert_one_line(r, text: str, needle: str, document: bool = False) -> None:
    """Refused in one line, exit 2; stdout empty, or with `document` (--format json) the error document alone."""
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert needle in lines[0], text
    assert "Traceback" not in r.output, text
    if document:
        assert json.loads(r.stdout) == {"schema_version": 1, "error": lines[0].removeprefix("error: "), "exit_code": 2}
    else:
        assert r.stdout == "", text


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""

    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    return make_run(tmp_path / "base"), make_run(tmp_path / "cand")


# --- identity is refused, context is shown ----------------------------------------------------------------------
CONTEXT_CHANGES = {
    "huge pages given to the probe": ({"host__huge_pages__in_use": False}, "huge pages in use True -> False"),
    "kernel THP mode": ({"host__huge_pages__system": "always"}, "kernel THP mode madvise -> always"),
    "read bandwidth halved": ({"floor__bandwidth__gbps": 10.0}, "read bandwidth (GB/s) 20.0 -> 10.0"),
}


@pytest.mark.parametrize("case", list(CONTEXT_CHANGES))
def test_a_change_in_measured_context_is_compared_with_a_warning(tmp_path, case):
    changes, shown = CONTEXT_CHANGES[case]
    base, cand = make_run(tmp_path / "base"), make_run(tmp_path / "cand", **changes)
    r, text = invoke("compare", base, cand, "--format", "json")
    assert r.exit_code == 0, text
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and shown in warnings[0], text
    doc = strict_json(r.stdout)
    assert doc["environment"]["changes"] == []
    differs = [f["name"] for f in doc["environment"]["context"] if f["differs"]]
    assert len(differs) == 1 and shown.startswith(differs[0]), doc["environment"]
    r, text = invoke("compare", base, cand)
    assert "measured in the runs (baseline -> candidate):" in r.stdout and shown in r.stdout, text


def test_a_small_bandwidth_wobble_is_shown_without_a_warning(tmp_path):
    base, cand = make_run(tmp_path / "base"), make_run(tmp_path / "cand", floor__bandwidth__gbps=20.4)
    r, text = invoke("compare", base, cand)
    assert r.exit_code == 0 and "warning" not in r.stderr, text
    assert "read bandwidth (GB/s) 20.0 -> 20.4" in r.stdout


IDENTITY_CHANGES = {
    "torch version": ({"versions__torch": "9.9.9"}, "torch 2.5.0 -> 9.9.9"),
    "torch threads": ({"versions__torch_threads": "2"}, "torch threads 1 -> 2"),
    "device name": (
        {"device_name": "CPU (arm64, 1 threads)"},
        "device name CPU (x86_64, 1 threads) -> CPU (arm64",
    ),
    "huge pages asked for": ({"host__huge_pages__THP_MEM_ALLOC_ENABLE": "0"}, "THP_MEM_ALLOC_ENABLE 1 -> 0"),
    # a run from before bench --tp records no tp: one process
    "tensor-parallel ranks": ({"settings__tp": 2}, "tensor-parallel ranks 1 -> 2"),
}


@pytest.mark.parametrize("case", list(IDENTITY_CHANGES))
def test_a_change_in_identity_is_refused_unless_allowed(tmp_path, case):
    changes, shown = IDENTITY_CHANGES[case]
    base, cand = make_run(tmp_path / "base"), make_run(tmp_path / "cand", **changes)
    before = files_in(base, cand)
    r, text = invoke("compare", base, cand)
    assert_one_line(r, text, shown)
    assert "--allow-env-change" in r.stderr
    assert files_in(base, cand) == before  # nothing written
    r, text = invoke("compare", base, cand, "--allow-env-change")
    assert r.exit_code == 0 and shown in r.stderr, text


# --- every number read from a run folder is checked ------------------------------------------------------------------
def _cell(name: str, line: int, column: str, value: str):
    """Set one cell of a CSV (line 2 = the first data row) to `value`, written as text."""

    def edit(run: Path) -> None:
        df = pd.read_csv(run / name, dtype=str, keep_default_na=False)
        df.loc[line - 2, column] = value
        df.to_csv(run / name, index=False)

    return edit


def _meta(**changes):
    def edit(run: Path) -> None:
        (run / "meta.json").write_text(json.dumps(meta_doc(**changes)))

    return edit


def _raw_meta(text: str):
    return lambda run: (run / "meta.json").write_text(text)


def _header(name: str, header: str):
    def edit(run: Path) -> None:
        lines = (run / name).read_text().splitlines(keepends=True)
        (run / name).write_text(header + "\n" + "".join(lines[1:]))

    return edit


STEPS_HEADER = "engine,cache,prompt_len,batch,repeat,step,latency_ms"
SUMMARY_HEADER = (
    "engine,cache,prompt_len,new_tokens,batch,dtype,device,status,ttft_ms,tpot_ms_median,tokens_per_s,"
    "peak_mem_mib,kv_cache_mib"
)

BAD_NUMBERS = {
    "latency inf": (
        _cell("steps.csv", 2, "latency_ms", "inf"),
        "steps.csv line 2: latency_ms is 'inf', not a finite number",
    ),
    "latency -inf": (
        _cell("steps.csv", 5, "latency_ms", "-inf"),
        "steps.csv line 5: latency_ms is '-inf', not a finite",
    ),
    "latency Infinity": (
        _cell("steps.csv", 3, "latency_ms", "Infinity"),
        "latency_ms is 'Infinity', not a finite number",
    ),
    "latency nan": (_cell("steps.csv", 2, "latency_ms", "nan"), "latency_ms is 'nan', not a number"),
    "latency 1e308": (_cell("steps.csv", 2, "latency_ms", "1e308"), "latency_ms is '1e308', out of range"),
    "latency 1e400": (_cell("steps.csv", 2, "latency_ms", "1e400"), "latency_ms is '1e400', not a finite number"),
    "latency zero": (
        _cell("steps.csv", 4, "latency_ms", "0"),
        "steps.csv line 4: latency_ms is '0', out of range (it must be above 0",
    ),
    "latency negative": (_cell("steps.csv", 2, "latency_ms", "-0.2"), "latency_ms is '-0.2', out of range"),
    "repeat zero": (_cell("steps.csv", 2, "repeat", "0"), "steps.csv line 2: repeat is '0', out of range"),
    "steps prompt_len fractional": (
        _cell("steps.csv", 2, "prompt_len", "8.5"),
        "prompt_len is '8.5', not a whole number",
    ),
    "summary prompt_len zero": (
        _cell("summary.csv", 3, "prompt_len", "0"),
        "summary.csv line 3: prompt_len is '0', out of range",
    ),
    "summary prompt_len huge": (_cell("summary.csv", 2, "prompt_len", "1e12"), "prompt_len is '1e12', out of range"),
    "summary batch text": (_cell("summary.csv", 2, "batch", "two"), "batch is 'two', not a number"),
    "ttft inf": (
        _cell("summary.csv", 2, "ttft_ms", "inf"),
        "summary.csv line 2: ttft_ms is 'inf', not a finite number",
    ),
    "ttft zero": (_cell("summary.csv", 2, "ttft_ms", "0"), "ttft_ms is '0', out of range"),
    "tokens/s negative": (_cell("summary.csv", 2, "tokens_per_s", "-3"), "tokens_per_s is '-3', out of range"),
    "kv negative": (
        _cell("summary.csv", 4, "kv_cache_mib", "-1"),
        "summary.csv line 4: kv_cache_mib is '-1', out of range",
    ),
    "peak inf": (_cell("summary.csv", 2, "peak_mem_mib", "inf"), "peak_mem_mib is 'inf', not a finite number"),
    "steps column twice": (
        _header("steps.csv", "engine,cache,prompt_len,batch,repeat,latency_ms,latency_ms"),
        "steps.csv names the column 'latency_ms' more than once",
    ),
    "summary column twice": (
        _header("summary.csv", SUMMARY_HEADER.replace("batch", "cache")),
        "summary.csv names the column 'cache' more than once",
    ),
    "meta new_tokens text": (
        _meta(settings__new_tokens="many"),
        "meta.json: settings.new_tokens is 'many', not a number",
    ),
    "meta new_tokens bool": (_meta(settings__new_tokens=True), "settings.new_tokens is True, not a number"),
    "meta batch zero": (_meta(settings__batch=0), "settings.batch is 0, out of range"),
    "meta batch beyond floats": (_meta(settings__batch=10**400), "settings.batch is 1000"),
    "meta bandwidth negative": (_meta(floor__bandwidth__gbps=-5.0), "floor.bandwidth.gbps is -5.0, out of range"),
    "meta bandwidth text": (_meta(floor__bandwidth__gbps="fast"), "floor.bandwidth.gbps is 'fast', not a number"),
    "meta model a list": (_meta(model=["gpt2"]), "meta.json: model is ['gpt2'], not a name"),
    "meta settings a list": (_meta(settings=[1, 2]), "meta.json: settings is list, not an object"),
    "meta planned malformed": (_meta(configurations_planned=[{"engine": 1}]), "configurations_planned is not a list"),
    "meta nested deeply": (_raw_meta("[" * 100_000 + "]" * 100_000), "meta.json is nested too deeply"),
    "meta nested deeply in an object": (_raw_meta('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    "meta integer of 5000 digits": (
        _raw_meta('{"settings": {"batch": ' + "9" * 5000 + "}}"),
        "is not a kvbench meta.json",
    ),
}


@pytest.mark.parametrize("side", ["candidate", "baseline"])
@pytest.mark.parametrize("case", list(BAD_NUMBERS))
def test_a_number_out_of_its_range_is_one_line_naming_file_line_and_column(runs, case, side):
    edit, needle = BAD_NUMBERS[case]
    base, cand = runs
    edit(cand if side == "candidate" else base)
    before = files_in(base, cand)
    r, text = invoke("compare", base, cand, "--format", "json")
    assert_one_line(r, text, needle, document=True)
    assert r.stderr.startswith(f"error: {side}"), text
    assert files_in(base, cand) == before  # no compare.png or compare.json written


def test_a_baseline_with_a_bad_number_stops_bench_before_any_work(runs, tmp_path):
    base, _ = runs
    _cell("steps.csv", 2, "latency_ms", "inf")(base)
    r, text = invoke(
        *"bench --model gpt2-tiny --weights random --device cpu --engine kvbench --caches static".split(),
        *"--prompt-len 8 --new-tokens 4 --repeats 1 --out".split(),
        tmp_path / "new",
        "--baseline",
        base,
    )
    assert_one_line(r, text, "steps.csv line 2: latency_ms is 'inf', not a finite number")
    assert r.stderr.startswith("error: --baseline") and not (tmp_path / "new").exists()


# --- outputs hold what a valid run holds ---------------------------------------------------------------------------
def test_json_output_is_strict_json_with_nulls(tmp_path):
    base = make_run(tmp_path / "base")
    cand = make_run(tmp_path / "cand", factor=1.2)
    s = pd.read_csv(cand / "summary.csv").drop(columns=["ttft_ms", "kv_cache_mib"])
    s.to_csv(cand / "summary.csv", index=False)
    r, text = invoke("compare", base, cand, "--format", "json")
    assert r.exit_code == 0, text
    doc = strict_json(r.stdout)
    assert {row["ttft_ratio"] for row in doc["rows"]} == {None}
    assert {row["verdict"] for row in doc["rows"]} == {"slower"}
    strict_json((cand / "compare.json").read_text())


def test_report_json_text_maps_every_non_finite_value_to_null():
    from kvbench.jsonio import json_text

    doc = {
        "a": float("inf"),
        "b": [float("nan"), -float("inf"), np.float32("inf"), np.float64(2.5)],
        "c": np.int64(3),
        "d": (1.0, None),
        "e": Path("x"),
    }
    assert strict_json(json_text(doc)) == {"a": None, "b": [None, None, None, 2.5], "c": 3, "d": [1.0, None], "e": "x"}


def test_rows_not_compared_name_their_dtype(tmp_path):
    base = make_run(tmp_path / "base")
    cand = make_run(tmp_path / "cand", rows=ROWS[:2])
    r, text = invoke("compare", base, cand)
    assert r.exit_code == 0, text
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("not compared:"))
    assert "gpt2-tiny random fp32 cpu, 61 new tokens, batch 1" in line and "object" not in line, line


NAMES = ["a|b", "line\nbreak", "tab\there", "back`tick", "pipe at end|"]


def test_markdown_rows_stay_one_line_whatever_the_cache_names(tmp_path):
    rows = tuple(("kvbench", name, 8) for name in NAMES)
    base, cand = make_run(tmp_path / "base", rows=rows), make_run(tmp_path / "cand", rows=rows, factor=1.3)
    r, text = invoke("compare", base, cand, "--format", "md")
    assert r.exit_code == 0, text
    lines = r.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| engine |"))
    table = lines[header + 2 : header + 2 + len(NAMES)]
    unescaped = [ln.replace("\\|", "").count("|") for ln in table]
    assert unescaped == [lines[header].count("|")] * len(NAMES), table
    assert lines[header + 2 + len(NAMES)] == ""  # the table ends after exactly one line per row
    assert any("line\\nbreak" in ln for ln in table) and any("a\\|b" in ln for ln in table)


# --- compare.png draws any valid alpha ------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99])
def test_any_valid_alpha_draws_compare_png(tmp_path, alpha):
    base, cand = make_run(tmp_path / "base"), make_run(tmp_path / "cand", factor=1.02, seed=1)
    r, text = invoke("compare", base, cand, "--alpha", alpha)
    assert r.exit_code == 0, text
    assert (cand / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_png_draws_a_ratio_outside_its_interval(tmp_path):
    """At a low confidence level the bootstrap interval can leave the point estimate outside it."""
    from kvbench.results.plots import compare_figure

    c = C.compare_runs(make_run(tmp_path / "base"), make_run(tmp_path / "cand", factor=1.1), alpha=0.5)
    c.rows[0].ci_low, c.rows[0].ci_high = c.rows[0].tpot_ratio + 0.01, c.rows[0].tpot_ratio + 0.02
    c.rows[1].ci_low, c.rows[1].ci_high = c.rows[1].tpot_ratio - 0.02, c.rows[1].tpot_ratio - 0.01
    png = compare_figure(c, tmp_path / "compare.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- options that would quietly do something else ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts, needle",
    [
        (["--fail-on", ""], "--fail-on '' names no gate"),
        (["--fail-on", " , "], "--fail-on ' , ' names no gate"),
        (["--out", ""], "--out is empty"),
        (["--out", "  "], "--out is empty"),
    ],
)
def test_empty_options_are_refused(runs, tmp_path, monkeypatch, opts, needle):
    base, cand = runs
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = files_in(base, cand)
    r, text = invoke("compare", base, cand, *opts)
    assert_one_line(r, text, needle)
    assert not any(work.iterdir()) and files_in(base, cand) == before


# --- a run that did not finish ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "status, planned, needle",
    [
        (
            "interrupted",
            True,
            "the candidate run was interrupted: 1 of its 3 configurations are missing (kvbench static prompt 32)",
        ),
        ("running", True, "the candidate run did not finish (meta.json says running"),
        ("interrupted", False, "the candidate run was interrupted: it may lack configurations (2 in summary.csv)"),
    ],
)
def test_an_unfinished_run_is_named_with_what_it_lacks(tmp_path, status, planned, needle):
    base = make_run(tmp_path / "base")
    cand = make_run(tmp_path / "cand", rows=ROWS[:2], status=status)
    if not planned:
        meta = json.loads((cand / "meta.json").read_text())
        del meta["configurations_planned"]
        (cand / "meta.json").write_text(json.dumps(meta))
    r, text = invoke("compare", base, cand, "--format", "json")
    assert r.exit_code == 0, text
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and needle in warnings[0], text
    assert [needle in u for u in strict_json(r.stdout)["unfinished"]] == [True]
    r, _ = invoke("compare", base, cand)
    assert f"unfinished: {needle}" in r.stdout


def test_a_finished_run_says_nothing_about_it(runs):
    r, text = invoke("compare", *runs)
    assert r.exit_code == 0 and "unfinished" not in r.stdout and "warning" not in r.stderr, text


# --- scale -----------------------------------------------------------------------------------------------------------
def test_compare_on_100k_steps_a_row_is_correct(tmp_path):
    """Two rows of 100,000 decode steps each; one of them 20% slower in the candidate."""
    rows = ROWS[1:]
    base = make_run(tmp_path / "base", rows=rows, steps=100_000 // REPEATS + 1)
    cand = make_run(tmp_path / "cand", rows=rows, steps=100_000 // REPEATS + 1)
    steps = pd.read_csv(cand / "steps.csv")
    slower = steps.prompt_len == 32
    steps.loc[slower, "latency_ms"] *= 1.2
    steps.to_csv(cand / "steps.csv", index=False)
    doc = C.json_doc(C.compare_runs(base, cand), [])
    by_prompt = {row["prompt_len"]: row for row in doc["rows"]}
    n = REPEATS * (100_000 // REPEATS + 1)
    assert by_prompt[32]["n_baseline"] == by_prompt[32]["n_candidate"] == n
    assert by_prompt[32]["tpot_ratio"] == pytest.approx(1.2) and by_prompt[32]["verdict"] == "slower"
    assert by_prompt[32]["ci_low"] < 1.2 < by_prompt[32]["ci_high"] < 1.21
    assert by_prompt[8]["tpot_ratio"] == 1.0 and by_prompt[8]["verdict"] == "no significant change"


@pytest.mark.parametrize("n", [240, 241])
def test_bootstrap_medians_drawn_directly_match_resampling(monkeypatch, n):
    """The sampler used for large samples gives the bootstrap distribution that resampling gives."""
    x = np.random.default_rng(3).lognormal(0, 0.3, n)
    resampled = S.bootstrap_medians(x, 20_000, np.random.default_rng(0))
    monkeypatch.setattr(S, "RESAMPLE_UP_TO", 0)
    direct = S.bootstrap_medians(x, 20_000, np.random.default_rng(1))
    q = [0.01, 0.1, 0.5, 0.9, 0.99]
    spread = np.quantile(resampled, 0.99) - np.quantile(resampled, 0.01)
    assert np.abs(np.quantile(direct, q) - np.quantile(resampled, q)).max() < 0.05 * spread
    assert direct.mean() == pytest.approx(resampled.mean(), rel=2e-3)


# --- a reader that closes stdout early ------------------------------------------------------------------------------
def _closed_stdout_run(args: list[str]) -> subprocess.CompletedProcess:
    """Run kvbench with stdout a pipe whose reader has already gone (what `| head -1` leaves behind)."""
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvbench", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    finally:
        os.close(w)


@pytest.mark.parametrize(
    "args",
    [
        # compare in a fresh Python imports transformers' modelling (seconds): the slow tier; memory's table and
        # --help stand for the rest in the default one
        pytest.param(["compare", "{base}", "{base}", "--fail-on", "slower"], marks=pytest.mark.slow),
        pytest.param(["compare", "{base}", "{cand}", "--fail-on", "slower", "--format", "md"], marks=pytest.mark.slow),
        pytest.param(["compare", "{base}", "{cand}", "--format", "json"], marks=pytest.mark.slow),
        ["memory", "-m", "gpt2"],
        ["--help"],
    ],
    ids=["compare-table", "compare-md", "compare-json", "memory", "help"],
)
def test_a_closed_stdout_ends_quietly_with_141(tmp_path, args):
    base, cand = make_run(tmp_path / "base"), make_run(tmp_path / "cand", factor=1.3)
    proc = _closed_stdout_run([a.format(base=base, cand=cand) for a in args])
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == "", proc.stderr  # no traceback, no "Exception ignored", no verdict


# --- a stdout that takes no more (a full disk) -------------------------------------------------------------------------
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    ("args", "lost"),
    [
        (["memory", "-m", "gpt2"], "the output"),
        (["memory", "-m", "gpt2", "--json"], "the JSON document"),
        (["--help"], "the help"),
        (["verify", "--help"], "the help"),
    ],
    ids=["memory", "memory-json", "help", "verify-help"],
)
def test_a_full_stdout_is_one_line_and_exit_2(args, lost, unbuffered):
    """Before: Rich's table or Typer's help written to /dev/full raised a traceback (or 'unexpected OSError', exit
    70), and the text left in Python's buffer failed again at exit ("Exception ignored", exit 120)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "kvbench", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"error: stdout cannot be written (No space left on device): {lost} is lost"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


# --- plots that would take long are left out, saying so ---------------------------------------------------------------
def test_latency_png_is_left_out_past_its_panel_limit(tmp_path):
    from kvbench.results import plots

    n = plots.MAX_LATENCY_PANELS + 1
    summary = pd.DataFrame(
        [
            dict(
                engine="kvbench",
                cache=c,
                prompt_len=8 * p,
                new_tokens=5,
                status="ok",
                ttft_ms=5.0,
                tpot_ms_median=3.0,
                speedup_vs_none=1.5,
            )
            for p in range(1, n + 1)
            for c in ("none", "static")
        ]
    )
    steps = pd.DataFrame(
        [
            dict(engine=r.engine, cache=r.cache, prompt_len=r.prompt_len, step=s, latency_ms=3.0)
            for r in summary.itertuples()
            for s in range(1, 5)
        ]
    )
    not_drawn: list[str] = []
    pngs = plots.write_plots(tmp_path, summary, steps, {}, not_drawn)
    assert [p.name for p in pngs] == ["speedup.png"] and not (tmp_path / "latency.png").exists()
    assert not_drawn == [
        f"latency.png not drawn: {n} prompt lengths (it draws at most {n - 1}; speedup.png shows "
        "every one, and steps.csv holds every step)"
    ]


@pytest.mark.parametrize("quoted", [False, True], ids=["plain", "quoted"])
def test_a_row_of_the_wrong_width_after_blank_lines_is_named_by_its_line(runs, quoted):
    """Both readers (plain files, and files with a quoted field) count blank lines when naming a line."""
    base, cand = runs
    lines = (cand / "steps.csv").read_text().splitlines(keepends=True)
    if quoted:
        lines[1] = lines[1].replace("kvbench", '"kvbench"', 1)
    lines[4:4] = ["\n", "\n", "kvbench,static,8,1\n"]  # lines 5 and 6 blank, line 7 short
    (cand / "steps.csv").write_text("".join(lines))
    r, text = invoke("compare", base, cand)
    assert_one_line(r, text, "steps.csv line 7 has 4 fields, the header 7")


# --- a batch sweep's files without their batch column; meta.json's schema_version ------------------------------------
@pytest.mark.parametrize("name", ["steps.csv", "ttft.csv"])
def test_a_batch_sweep_whose_csv_lacks_batch_is_refused_naming_the_file(tmp_path, name):
    """meta.json lists several batch sizes: a steps.csv or ttft.csv without `batch` would pool every size into each
    row, so it is refused naming the file; with one batch size (runs older than batch sweeps) it is read as before."""
    base = make_run(tmp_path / "base", settings__batch=[1, 4])
    cand = make_run(tmp_path / "cand", settings__batch=[1, 4])
    steps = pd.read_csv(cand / "steps.csv")
    ttft = steps[steps.step == 1].rename(columns={"latency_ms": "ttft_ms"}).drop(columns=["step"])
    ttft.to_csv(cand / "ttft.csv", index=False)
    frame = steps if name == "steps.csv" else ttft
    frame.drop(columns=["batch"]).to_csv(cand / name, index=False)
    r, text = invoke("compare", base, cand)
    assert_one_line(r, text, f"candidate {cand}: {name} has no batch column, but meta.json lists several batch sizes")
    assert "[1, 4]" in r.stderr, text
    r, text = invoke("compare", base, cand, "--format", "json")
    assert r.exit_code == 2 and json.loads(r.stdout)["exit_code"] == 2, text
    single = make_run(tmp_path / "single", settings__batch=[1])
    pd.read_csv(single / "steps.csv").drop(columns=["batch"]).to_csv(single / "steps.csv", index=False)
    r, text = invoke("compare", make_run(tmp_path / "old"), single)
    assert r.exit_code == 0, text


@pytest.mark.parametrize(
    "version, needle",
    [
        (2, "schema_version 2 is newer than the 1 this kvbench reads"),
        (10**30, f"schema_version {10**30} is newer than the 1 this kvbench reads"),
        (0, "schema_version is 0, not a version kvbench writes"),
        (-1, "schema_version is -1, not a version"),
        ("1", "schema_version is '1', not a version"),
        (True, "schema_version is True, not a version"),
        (1.0, "schema_version is 1.0, not a version"),
        (1e30, "schema_version is 1e+30, not a version"),
        (None, "schema_version is None, not a version"),
        ([1], "schema_version is [1], not a version"),
    ],
)
@pytest.mark.parametrize("role", ["baseline", "candidate"])
def test_a_schema_version_this_kvbench_does_not_read_is_refused(runs, version, needle, role):
    """A version this kvbench does not know is refused in one line naming the file, either side, files untouched."""
    base, cand = runs
    folder = base if role == "baseline" else cand
    meta = json.loads((folder / "meta.json").read_text())
    meta["schema_version"] = version
    (folder / "meta.json").write_text(json.dumps(meta))
    before = files_in(base, cand)
    r, text = invoke("compare", base, cand)
    assert_one_line(r, text, f"{role} {folder / 'meta.json'}: {needle}")
    assert files_in(base, cand) == before


def test_a_run_without_schema_version_is_read_as_version_1_with_a_warning(runs):
    """Runs from before kvbench wrote schema_version (the committed results/ folders) still compare: one warning
    line naming the file."""
    base, cand = runs
    meta = json.loads((base / "meta.json").read_text())
    del meta["schema_version"]
    (base / "meta.json").write_text(json.dumps(meta))
    r, text = invoke("compare", base, cand)
    assert r.exit_code == 0, text
    warnings = [line for line in r.stderr.splitlines() if "schema_version" in line]
    assert warnings == [
        f"warning: baseline {base / 'meta.json'} has no schema_version (a run from before kvbench recorded it): "
        "read as version 1"
    ], text


def test_every_peer_series_reads_apart_from_every_other_series():
    """A peer's rows carry the cache name `dynamic` (its own cache), so the look must not come from the cache alone:
    two peers drawn alike, or a peer drawn like kvbench's dynamic cache, is a figure nobody can read."""
    from kvbench.peers import PEERS
    from kvbench.results import plot_style

    series = [(e, c) for e in ("kvbench", "hf") for c in ("none", "dynamic", "static")]
    series += [(p, "dynamic") for p in PEERS]
    looks = [
        (str(plot_style.series_colour(e, c)), str(plot_style.series_style(e)), plot_style.series_hatch(e))
        for e, c in series
    ]
    assert len(set(looks)) == len(looks)
    bars = {plot_style.series_hatch(p) for p in PEERS} | {plot_style.series_colour(p, "dynamic") for p in PEERS}
    assert len(bars) == 2 * len(PEERS)
