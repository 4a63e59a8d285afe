"""Every table kvbench prints reads in an 80- and a 100-column terminal: no line is longer than the terminal, no table
cell wraps into more than two lines, long prose sits beneath the tables. verify's grid says what failed where, with
the failing cell's tolerance and detail beneath it (in full with --verbose)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import io
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from rich.cells import cell_len
from rich.table import Table
from typer.testing import CliRunner

from kvbench import console
from kvbench.check.judge import CheckRow, VerifyReport, skipped
from kvbench.cli import app

WIDTHS = (80, 100)
TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]
META = {"model": "gpt2-tiny", "weights": "random(seed=0, std=0.05)", "device": "cpu", "dtype": "fp32"}
CHECKS = ("logits", "greedy", "reference", "batched", "cache_state", "rollback", "fork", "reorder", "chunked_prefill")


class Screen(console.SafeConsole):
    """A terminal `width` columns wide that records what it shows and keeps every table printed on it."""

    def __init__(self, width: int) -> None:
        super().__init__(width=width, record=True, file=io.StringIO(), highlight=False, color_system=None)
        self.tables: list[Table] = []

    def print(self, *objects, **kwargs) -> None:
        self.tables += [o for o in objects if isinstance(o, Table)]
        super().print(*objects, **kwargs)

    @property
    def text(self) -> str:
        return self.export_text(clear=False)


@pytest.fixture
def screen(monkeypatch):
    """`screen(width)`: a Screen put in place of kvbench's stdout console, for the renderers and the commands."""

    def make(width: int) -> Screen:
        s = Screen(width)
        monkeypatch.setattr(console, "out", s)
        for name, module in list(sys.modules.items()):
            if name.startswith("kvbench.cli") and isinstance(getattr(module, "out", None), console.Console):
                monkeypatch.setattr(module, "out", s)
        return s

    return make


def cell_lines(s: Screen, t: Table) -> list[tuple[str, str, int]]:
    """(column, cell, lines) for every header and cell of `t`, laid out as `s` lays it out."""
    widths = t._calculate_column_widths(s, s.options)
    found = []
    for i, (col, w) in enumerate(zip(t.columns, widths, strict=True)):
        inner = s.options.update(
            width=w - t._get_padding_width(i), no_wrap=col.no_wrap, overflow=col.overflow, height=None
        )
        for c in [col.header, *col._cells]:
            found.append((str(col.header), str(c), len(s.render_lines(c, inner, pad=False))))
    return found


def assert_reads(s: Screen, prose: bool = True) -> str:
    """No line wider than the screen (with `prose` False: no line of a table), no table cell taller than two lines;
    returns the screen's text."""
    text = s.text
    shown = text if prose else "\n".join(_alone(t, s.width) for t in s.tables)
    wide = [ln for ln in shown.splitlines() if cell_len(ln) > s.width]
    assert not wide, f"lines wider than {s.width}:\n" + "\n".join(wide) + "\n\n" + text
    assert s.tables, text
    for t in s.tables:
        tall = [c for c in cell_lines(s, t) if c[2] > 2]
        assert not tall, f"cells taller than two lines at {s.width}: {tall}\n\n{text}"
    return text


def _alone(t: Table, width: int) -> str:
    s = Screen(width)
    s.print(t)
    return s.text


def test_the_checks_see_a_wrapped_cell_and_a_long_line(screen):
    """The two assertions fail where they should: an old-style table with a long free-text column, a long line."""
    s = screen(80)
    s.print(console.table("t", ["check", "detail"], [["logits", "word " * 60]]))
    with pytest.raises(AssertionError, match="taller than two lines"):
        assert_reads(s)
    s = screen(80)
    s.print(console.table("t", ["a"], [["1"]]))
    s.print("x" * 81, soft_wrap=True)
    with pytest.raises(AssertionError, match="wider than 80"):
        assert_reads(s)


# --- verify ------------------------------------------------------------------------------------------------------
def _grid_row(text: str, check: str) -> str:
    """The check's row, from each grid the caches were split into."""
    return "  ".join(ln for ln in text.splitlines() if ln.startswith(f"{check} "))


def test_verify_grid_of_a_real_run_with_a_failing_and_a_skipping_plugin(screen, tiny_model, lifecycle_plugins):
    from kvbench.check.verify import random_prompts, run_verify
    from kvbench.cli.verify_render import render_verify

    caches = ["dynamic", f"{lifecycle_plugins}:CropKeysOnly", f"{lifecycle_plugins}:AppendOnly"]
    report = run_verify(tiny_model, caches, random_prompts(500, 8, 3, seed=0), 4, reference="none")
    failing = [r for r in report.checks if not r.passed and not r.skipped]
    assert [(r.name, r.cache) for r in failing] == [("rollback", caches[1])], report.checks
    for width in WIDTHS:
        s = screen(width)
        render_verify(report, META)
        text = assert_reads(s)
        assert _grid_row(text, "rollback").count("FAIL") == 1, text
        assert _grid_row(text, "fork").count("skip") == 1, text
        assert "CropKeysOnly" in text and "lcplugins.caches:" in text  # a plugin heads its column on two lines
        # beneath the grid: the failing cell, its tolerance and detail; the skipped cells with their reason
        entry = f"rollback/{caches[1]} ({failing[0].tolerance}): "
        assert entry in " ".join(text.split()), text
        assert f"skip rollback/{caches[1].replace('CropKeysOnly', 'AppendOnly')}: AppendOnly has no crop" in text
        assert f"FAILED 1 of {len(report.checks) - 3} checks: rollback/{caches[1]}" in " ".join(text.split())


def _row(name, cache, passed=True, diff=1.9e-6, first=None, detail="decode steps 1..7 vs a full forward", **kw):
    return CheckRow(
        name=name,
        cache=cache,
        passed=passed,
        max_abs_diff=diff,
        first_divergence=first,
        tolerance=kw.pop("tolerance", "rtol 1e-05, atol 1e-05"),
        detail=detail,
        **kw,
    )


LONG = "the cached logits differ from the recomputed ones " + "at position 17 by a margin; " * 40 + "THE END"


def _report(caches: list[str]) -> VerifyReport:
    """Every check on every cache: passes, one logit failure with a long detail, one token failure, one skipped
    lifecycle check, and one cache unavailable as a whole."""
    rows = [_row("reference", "none"), _row("batched", "none")]
    for c in caches[1:-1]:
        rows += [_row(n, c) for n in CHECKS]
    rows[2] = _row("logits", caches[1], passed=False, diff=0.31, first=3, detail=LONG)
    rows[3] = _row("greedy", caches[1], passed=False, first=5, tolerance="identical tokens", detail="5 of 8")
    rows[-2] = skipped(caches[-2], "it has no reorder", "reorder")
    rows.append(skipped(caches[-1], "needs CUDA"))
    return VerifyReport(False, rows, "fp32", 8, 16, [16, 11, 6], "none", notes=["a note " * 30])


HF_CACHES = [
    "none",
    "dynamic",
    "static",
    "static-compiled",
    "offloaded",
    "offloaded_static",
    "quantized-quanto",
    "quantized-hqq",
    "quantized-fp8",
]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("caches", [["none", "dynamic", "static", "static-graph", "paged", "int8"], HF_CACHES])
def test_verify_grid_fits_every_cache_and_says_what_failed(screen, width, caches):
    from kvbench.cli.verify_render import DETAIL_LINES, render_verify

    report = _report(caches)
    s = screen(width)
    render_verify(report, META)
    text = assert_reads(s)
    lines = text.splitlines()
    for check in CHECKS:  # each check is one line of each grid it appears in
        assert sum(ln.startswith(f"{check} ") for ln in lines) == len([t for t in s.tables]), (check, text)
    assert "FAIL 3.1e-01" in _grid_row(text, "logits") and "FAIL step 5" in _grid_row(text, "greedy"), text
    assert "pass 1.9e-06" in _grid_row(text, "fork") and "skip" in _grid_row(text, "reorder"), text
    # beneath: each failing cell's tolerance and detail, clipped to a few lines, the skips in a line each
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"logits/{caches[1]} (rtol 1e-05, atol 1e-05):"))
    block = lines[at : at + DETAIL_LINES + 1]
    assert block[DETAIL_LINES - 1].endswith("... (--verbose: in full)") and "THE END" not in text, block
    assert block[DETAIL_LINES].startswith(f"greedy/{caches[1]} (identical tokens): 5 of 8"), block
    assert f"skip reorder/{caches[-2]}: it has no reorder" in text
    assert f"skip {caches[-1]} (every check): needs CUDA" in text
    flat = " ".join(text.split())
    assert f"FAILED 2 of {len(report.checks) - 2} checks: logits/{caches[1]}, greedy/{caches[1]}" in flat, text


def test_verify_verbose_prints_every_row_in_full(screen):
    from kvbench.cli.verify_render import render_verify

    report = _report(["none", "dynamic", "static", "int8"])
    s = screen(100)
    render_verify(report, META, verbose=True)
    text = assert_reads(s)
    flat = " ".join(text.split())
    assert "THE END" in flat and "--verbose: in full" not in flat, text
    for r in report.checks:
        label = f"{r.name}/{r.cache}" if r.name != "-" else f"{r.cache} (every check)"
        assert label in flat and r.detail.split()[0] in flat, label


def test_verify_and_break_take_verbose():
    r = CliRunner().invoke(app, ["verify", "--caches", "dynamic", "-n", "2", "--reference", "none", "-v", *TINY])
    assert r.exit_code == 0, r.output
    assert "logits/dynamic pass (rtol 1e-05, atol 1e-05): decode steps 1..1" in " ".join(r.stdout.split())
    r = CliRunner().invoke(app, ["break", "reset", "-n", "8", "--reference", "none", "--verbose", *TINY])
    assert r.exit_code == 0, r.output
    assert "cache_state/dynamic FAIL (identical tokens):" in " ".join(r.stdout.split()), r.stdout


def test_verify_progress_lines_stay_short(monkeypatch):
    from kvbench.cli import verify_render

    s = Screen(80)
    monkeypatch.setattr(verify_render, "err", s)
    for r in _report(["none", "dynamic", "static"]).checks:
        verify_render.verify_row(r)
    assert all(cell_len(ln) <= 60 for ln in s.text.splitlines()), s.text


# --- break -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", WIDTHS)
def test_break_reads(screen, width):
    s = screen(width)
    r = CliRunner().invoke(app, ["break", "mask", "-n", "8", "--reference", "none", *TINY])
    assert r.exit_code == 0, r.output
    text = assert_reads(s)
    row = next(ln for ln in text.splitlines() if ln.startswith("mask "))
    assert "yes" in row and "all 8 but cache_state" in row, text  # most checks caught it: the one that did not


# --- bench and compare -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One real bench run (both engines, two prompt lengths) and what its renderer was handed."""
    from kvbench.bench import floor
    from kvbench.cli import bench

    seen = {}
    out = tmp_path_factory.mktemp("render") / "run"
    args = [
        "bench",
        *TINY,
        *"--engine kvbench,hf --caches none,dynamic,static-graph,int8 --prompt-len 8,16 -n 4 --repeats 2".split(),
        *"--warmup 0 --out".split(),
        str(out),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(floor.PROBE_ENV, str(16 << 20))
        mp.setattr(bench, "render_bench", lambda *a: seen.update(args=a))
        r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    return out, seen["args"]


@pytest.mark.parametrize("width", WIDTHS)
def test_bench_reads(screen, bench_run, width):
    from kvbench.cli.bench_render import render_bench

    s = screen(width)
    render_bench(*bench_run[1])
    text = assert_reads(s)
    heads = [str(c.header) for t in s.tables for c in t.columns]
    assert {"engine", "cache", "prompt", "TPOT ms", "cold TPOT", "vs hf"} <= set(heads), heads
    assert "capture ms" not in heads  # no configuration captured a graph: a column of dashes says nothing
    assert "batch 1," in " ".join(text.split("\n")[:2])  # one batch size: said in the title
    assert "x floor = TPOT / floor" in " ".join(text.split())  # the caption, beneath as prose
    assert "distortion int8 prompt 8: KL mean" in " ".join(text.split())  # the lossy row's cost, beneath


def test_bench_run_carries_the_lossy_rows_distortion(bench_run):
    """The columns filled for kvbench int8 only, its tokens in distortion.csv, distortion.png written, meta.json
    valid (test_distortion.py runs the same end to end in the slow tier)."""
    import json

    import jsonschema

    from kvbench.jsonio import load_schema

    out = bench_run[0]
    s = pd.read_csv(out / "summary.csv")
    lossy = (s.engine == "kvbench") & (s.cache == "int8")
    assert lossy.sum() == 2 and (s[lossy].kl_mean > 0).all() and (s[lossy].top1_agreement > 0.5).all()
    assert s[~lossy][["kl_mean", "top1_agreement", "mean_abs_dp"]].isna().all().all()
    steps = pd.read_csv(out / "distortion.csv")
    assert len(steps) == 2 * 4 and (steps.depth == steps.prompt_len + steps.token - 1).all()
    assert (out / "distortion.png").read_bytes()[:4] == b"\x89PNG"
    meta = json.loads((out / "meta.json").read_text())
    jsonschema.Draft202012Validator(load_schema("bench")).validate(meta)
    assert set(meta["distortion"]["rows"]) == {"kvbench int8 prompt 8 batch 1", "kvbench int8 prompt 16 batch 1"}


@pytest.mark.parametrize("width", WIDTHS)
def test_bench_tp_ranks_read_and_say_gloo_measures_no_speed(screen, width):
    from kvbench.bench.tp import GLOO_TIMING, RankRow
    from kvbench.caches import CACHES
    from kvbench.cli.bench_render import render_ranks

    s = screen(width)
    meta = {"tp": {"ranks": 2, "backend": "gloo", "timing": GLOO_TIMING}}
    same = dict(engine="kvbench", prompt_len=512, ranks=2, backend="gloo", device="cpu", timing=GLOO_TIMING)
    figures = dict(ttft_ms=123.4, tpot_ms_median=56.78, kv_slots=528, kv_cache_bytes=12_345_678, peak_mem_mib=1234.0)
    more = dict(weights_mib=300.0, collective_ms=98.7, collective_calls=384, run_ms=345.6, collective_share=0.29)
    rows = [  # a design that stores more than the planner models (paged) shows the planner's figure
        RankRow(
            **same,
            **figures,
            **more,
            cache=c,
            batch=b,
            rank=r,
            planned_kv_cache_bytes=12_345_678.0 + (c == "paged"),
            planned_equal=c != "paged",
        )
        for c in CACHES
        for b in (1, 64)
        for r in (0, 1)
    ]
    render_ranks(rows, meta)
    text = " ".join(assert_reads(s).split())
    heads = {str(c.header) for t in s.tables for c in t.columns}
    assert {"rank", "KV bytes", "planner", "collectives", "batch"} <= heads, heads
    assert "equal" in text and "12,345,679" in text
    assert "timings in both tables are not a speed measurement: gloo on a CPU" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_reads(screen, bench_run, tmp_path, width):
    from kvbench.cli.compare import render_compare, run_compare

    slower = tmp_path / "slower"
    shutil.copytree(bench_run[0], slower)
    steps = pd.read_csv(slower / "steps.csv")
    steps["latency_ms"] *= 1.5
    steps.to_csv(slower / "steps.csv", index=False)
    comparison, files = run_compare(bench_run[0], slower)
    s = screen(width)
    render_compare(comparison, ["slower"], files)
    text = assert_reads(s)
    assert "verdict" in text and "TTFT verdict" in text and "Δpeak MiB" in text, text
    assert "n.s.: no significant change" in " ".join(text.split()), text


# --- memory and generate -----------------------------------------------------------------------------------------
MEMORY = {
    "plan": ["--model", "llama-3-8b", "--ctx", "8k,128k", "--gpu", "h100", "--batch", "1,16"],
    "plan-tp": "--model llama-3-70b --ctx 8k,128k --gpu h100 --tp 4 --batch 1,16".split(),
    "all": ["--all"],
    "all-gpu": ["--all", "--gpu", "h100", "--batch", "8"],
    "copy-traffic": ["--copy-traffic", "-m", "gpt2", "--batch", "4"],
    "measure": ["--measure", "-m", "gpt2-tiny", "--ctx", "64", "--lengths", "10,40,64"],
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("what", MEMORY)
def test_memory_reads(screen, what, width):
    s = screen(width)
    r = CliRunner().invoke(app, ["memory", *MEMORY[what]])
    assert r.exit_code == 0, r.output
    text = assert_reads(s, prose=False)  # the plan's working lines are prose printed as they are built
    if what == "measure":
        assert "[1] caches nothing" in text, text


@pytest.mark.parametrize("width", WIDTHS)
def test_memory_check_reads(screen, width):
    """--check's table (built here: transformers' meta-device models take seconds): each difference's reason is a
    numbered note beneath it, shared by the rows it explains."""
    from kvbench.cli.memory_render import render_checks
    from kvbench.memory.check import CacheCheck, KindCheck

    why = "transformers caches 128 heads per layer where the model has 8 KV heads: " + "its attention broadcasts " * 5

    def kinds(ctx: int) -> list[KindCheck]:
        full = KindCheck(
            "full",
            "full attention",
            60,
            60,
            ctx * 2**17,
            ctx * 2**21,
            "8x64",
            f"K 1x128x{ctx}x64, V 1x128x{ctx}x64",
            False,
            why,
        )
        sliding = KindCheck(
            "sliding",
            "sliding window 4,096",
            20,
            21,
            2**30,
            2**31,
            "8x64",
            "K 1x8x4096x64, V 1x8x4096x128",
            False,
            "transformers counts 21 layers of this kind",
        )
        return [full, sliding]

    checks = [
        CacheCheck("falcon-40b", ctx, 1, "fp16", True, "transformers on the meta device " * 4, 1, 2, False, kinds(ctx))
        for ctx in (2048, 131072)
    ]
    s = screen(width)
    render_checks(checks)
    text = assert_reads(s)
    assert text.count("differs [1]") == 2 and text.count("differs [2]") == 2, text
    assert "[1] transformers caches 128 heads" in text and "[2] transformers counts 21 layers" in text, text
    assert "K,V 1x128x131072x64" in text and "20 vs 21" in text, text


@pytest.mark.parametrize("width", WIDTHS)
def test_generate_reads(screen, width):
    s = screen(width)
    prompt = "one two three one two three one two three one two"
    r = CliRunner().invoke(app, ["generate", *TINY, "-n", "12", "-p", prompt, "--draft", "prompt-lookup"])
    assert r.exit_code == 0, r.output
    text = assert_reads(s, prose=False)  # the completion streams as it is made: the terminal wraps it
    assert "median time per output token" in text and "draft (prompt-lookup)" in text, text


def test_piped_tables_stay_one_table():
    """Not a terminal (200 columns): the bench table is one table, its rows one line each, as before."""
    assert console.PIPE_WIDTH >= 200
    s = Screen(console.PIPE_WIDTH)
    cols = ["engine", "cache", "prompt", *(f"column {i}" for i in range(15))]
    parts = console.fitted("t", cols, [["kvbench", "static-graph", 8, *range(15)]], s.width, keys=3)
    assert sum(isinstance(p, Table) for p in parts) == 1


def test_fitted_splits_evenly_repeating_the_keys():
    s = Screen(80)
    cols = ["engine", "cache", *(f"column {i:02}" for i in range(9))]
    parts = [
        p for p in console.fitted(None, cols, [["kvbench", "dynamic", *range(9)]], 80, keys=2) if isinstance(p, Table)
    ]
    assert len(parts) == 2
    heads = [[str(c.header) for c in t.columns] for t in parts]
    assert all(h[:2] == ["engine", "cache"] for h in heads), heads
    assert abs(len(heads[0]) - len(heads[1])) <= 1, heads  # an even split, not one stray column
    for t in parts:
        s.print(t)
    assert_reads(s)


def test_a_result_file_is_unchanged_by_the_terminal(bench_run):
    """Only terminal text changes with the width: the run folder's summary holds every column."""
    summary = pd.read_csv(Path(bench_run[0]) / "summary.csv")
    assert {"decode_tokens_per_s", "capture_ms", "speedup_vs_fastest_hf"} <= set(summary.columns)
