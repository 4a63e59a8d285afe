"""bench --batch 1,4,16: a batch sweep. Rows per batch size, decode tokens/s against the steps it was made of, the
floor's K/V term growing with B by hand, one batch size out of memory (raised, or predicted) while the sweep goes
on, batch.png, settings, and compare matching rows by batch."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math
import struct
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.bench import floor
from kvbench.bench import sweep as B
from kvbench.bench.engines import KVBenchEngine
from kvbench.bench.settings import BenchSettings, load_settings
from kvbench.caches import CACHES
from kvbench.cli import app
from kvbench.errors import KVBenchError
from kvbench.results.batch_plot import crossover_batch

TINY = ["--model", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


def invoke(*args: str):
    result = CliRunner().invoke(app, [*args])
    return result, result.output + (repr(result.exception) if result.exception else "")


def _bench(out: Path, options: str):
    """bench of TINY's kvbench engine at prompt 8 and 4 new tokens, with `options`, into `out`."""
    return invoke(
        "bench", *TINY, *"--prompt-len 8 --new-tokens 4 --engine kvbench".split(), *options.split(), "--out", str(out)
    )


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _settings(**kw) -> BenchSettings:
    s = BenchSettings(prompt_len=[6], new_tokens=5, caches=["none", "dynamic", "static"], engine=["kvbench"])
    s.repeats, s.warmup = 2, 1
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# --- the sweep ------------------------------------------------------------------------------------------------------
def test_rows_per_batch_size_with_decode_throughput_from_their_own_steps(tiny_model):
    s = _settings(batch=[1, 3, 4])
    rows = B.run_sweep(tiny_model, s, "fp32", "cpu")
    assert [(r.summary.batch, r.summary.cache) for r in rows] == [
        (b, c) for b in (1, 3, 4) for c in ("none", "dynamic", "static")
    ]
    for r in rows:
        row = r.summary
        assert row.status == "ok" and row.repeats == 2
        assert {st.batch for st in r.steps} == {row.batch}
        # decode tokens/s: the batch's tokens over each timed repeat's decode time, median over the repeats
        per_repeat = pd.DataFrame([vars(st) for st in r.steps]).groupby("repeat").latency_ms.sum() / 1e3
        expected = sorted(row.batch * (s.new_tokens - 1) / per_repeat)
        assert row.decode_tokens_per_s == pytest.approx(sum(expected) / 2, rel=1e-9)
        assert row.tokens_per_s == pytest.approx(row.batch * s.new_tokens / row.total_s)
        # the token reference is the same batch size's `none`
        assert row.token_agreement == 1.0
    # the first sequence's prompt is the same at every batch size: a batch of b decodes the first b prompts
    none = {r.summary.batch: r for r in rows if r.summary.cache == "none"}
    assert none[1].summary.kv_cache_mib == none[3].summary.kv_cache_mib == 0


def test_the_floor_grows_with_batch_through_kv_only(tiny_model, tiny_config):
    """By hand: K/V of one token position is 2 x layers x C x 4 bytes per sequence; the weights are read once per
    step whatever B (but for each sequence's wte and wpe row)."""
    s = _settings(batch=[1, 4], caches=["dynamic"])
    rows = {r.summary.batch: r for r in B.run_sweep(tiny_model, s, "fp32", "cpu")}
    L, C, elt = tiny_config.n_layer, tiny_config.n_embd, 4
    context = 6 + 5 // 2  # the median decode step attends over prompt + new/2 slots
    slot = 2 * L * C * elt
    one, four = rows[1].floor_bytes, rows[4].floor_bytes
    assert one.kv == context * slot and four.kv == 4 * context * slot
    assert four.weights - one.weights == 2 * 3 * C * elt  # three more sequences' wte and wpe rows
    assert four.kv_write == 4 * one.kv_write == 4 * slot
    bw = rows[1].bandwidth.gbps * 1e9
    assert rows[4].summary.floor_ms == pytest.approx(1e3 * four.total / bw)


def test_a_batch_size_out_of_memory_is_a_row_and_the_sweep_goes_on(tiny_model):
    """torch's own OutOfMemoryError, raised when batch 3 allocates its cache: those rows are `oom`, batch 4 after
    them runs."""

    class OOMAtThree(KVBenchEngine):
        def configure(self, cache, batch, max_len):
            if batch == 3 and cache != "none":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return super().configure(cache, batch, max_len)

    s = _settings(batch=[1, 3, 4])
    rows = B.run_sweep(tiny_model, s, "fp32", "cpu", engines={"kvbench": OOMAtThree(tiny_model)})
    status = {(r.summary.batch, r.summary.cache): r.summary.status for r in rows}
    assert status == {
        (b, c): "oom" if (b, c) in ((3, "dynamic"), (3, "static")) else "ok"
        for b in (1, 3, 4)
        for c in ("none", "dynamic", "static")
    }
    oom = next(r.summary for r in rows if r.summary.status == "oom")
    assert math.isnan(oom.decode_tokens_per_s) and oom.repeats == 0


def test_predicted_out_of_memory_batch_is_an_oom_row_never_run(tmp_path):
    """A batch whose cache alone exceeds the device's memory (2^20 sequences of gpt2-tiny: 2 KiB per token each) is
    not attempted: its rows say why; the others run, batch.png is drawn, exit 0."""
    out = tmp_path / "run"
    result, text = _bench(out, "--batch 1,2,1048576 --caches none,static --repeats 1 --warmup 1")
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv")
    expected = [(1, "ok"), (1, "ok"), (2, "ok"), (2, "ok"), (1048576, "oom"), (1048576, "oom")]
    assert list(zip(s.batch, s.status, strict=True)) == expected
    need = 1048576 * (8 + 4) * 2 * 2 * 128 * 4 / 2**30  # sequences x tokens x K/V of 2 layers x 128 x fp32
    note = s[s.status == "oom"].tokens_note.iloc[0]
    assert note.startswith("not run: batch 1048576 x 12 tokens needs a") and f"{need:.1f} GiB KV cache" in note
    assert "oom (kvbench none, kvbench static): not run: batch 1048576" in " ".join(text.split())
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["batch"] == [1, 2, 1048576] and "batch.png" in meta["plots"]
    assert {r["batch"] for r in meta["configurations_planned"]} == {1, 2, 1048576}
    width, height = png_size(out / "batch.png")
    assert width > 1500 and height > 500
    steps = pd.read_csv(out / "steps.csv")
    assert set(steps.batch) == {1, 2}


def test_every_batch_size_out_of_memory_is_refused_before_any_work(tmp_path):
    out = tmp_path / "run"
    result, text = invoke(
        "bench",
        *TINY,
        *"--prompt-len 8 --new-tokens 4 --batch 1048576 --caches static --engine kvbench --out".split(),
        str(out),
    )
    assert result.exit_code == 3 and "--batch 1048576 x 12 tokens needs a" in text, text
    assert not out.exists()


# --- settings ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "batch"),
    [("4", [4]), ("1,4,4,16", [1, 4, 16]), (" 2 , 1 ", [2, 1]), ("1k", [1024])],
)
def test_batch_list_from_the_command_line(given, batch):
    assert load_settings(None, dict(batch=given)).batch == batch


def test_batch_list_from_toml(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("batch = [1, 4, 16]\n")
    assert load_settings(f, {}).batch == [1, 4, 16]
    f.write_text("batch = 8\n")
    assert load_settings(f, {}).batch == [8]
    f.write_text('batch = ["x"]\n')
    with pytest.raises(KVBenchError, match="batch must be whole numbers"):
        load_settings(f, {})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("0", "--batch values must be >= 1"),
        (",", "--batch is empty"),
        ("1,x", "batch must be whole numbers"),
        ("2000000", "--batch values must be at most 1,048,576"),
        ("1.5", "batch must be whole numbers"),
    ],
)
def test_bad_batch_lists_are_one_line(given, message):
    with pytest.raises(KVBenchError, match=message):
        load_settings(None, dict(batch=given))


def test_random_fill_takes_one_batch_size():
    with pytest.raises(KVBenchError, match="--fill random sweeps contexts at one batch size"):
        load_settings(None, dict(batch="1,4", fill="random"))


# --- batch.png's crossover, compare -----------------------------------------------------------------------------------
def test_crossover_batch_is_weights_over_one_sequences_kv(tiny_config):
    """gpt2-tiny in fp32 at prompt 16 + 8 new tokens (median step: 20 slots): the batch at which K/V read = weights."""
    L, C, V = tiny_config.n_layer, tiny_config.n_embd, tiny_config.vocab_size
    per_block = 4 * C + 3 * C * C + 3 * C + C * C + C + 4 * C * C + 4 * C + 4 * C * C + C
    weights = 4 * (L * per_block + 2 * C + V * C + 2 * C)  # at batch 1: one wte row and one wpe row
    kv_one = 20 * 2 * L * C * 4
    b = floor.step_bytes(tiny_config, torch.float32, 1, 20, 24, None)
    meta = {"floor": {"steps": {"kvbench dynamic prompt 16 batch 1": b.as_dict()}}}
    assert crossover_batch(meta, 16) == pytest.approx(weights / kv_one)
    assert crossover_batch(meta, 32) is None and crossover_batch({}, 16) is None
    # a design that reads its whole buffer (static-graph's 64 slots) does not price one sequence's K/V at 20 tokens
    whole = floor.step_bytes(tiny_config, torch.float32, 1, 20, 64, CACHES["static-graph"].traffic)
    assert whole.slots == 64 and whole.context == 20
    steps = {"kvbench static-graph prompt 16 batch 1": whole.as_dict()}
    assert crossover_batch({"floor": {"steps": steps}}, 16) is None
    steps["kvbench dynamic prompt 16 batch 1"] = b.as_dict()
    assert crossover_batch({"floor": {"steps": steps}}, 16) == pytest.approx(weights / kv_one)


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory) -> list[Path]:
    """Two batch sweeps of the same configurations (batch 1 and 3), a baseline and a candidate."""
    runs = []
    for name in ("base", "cand"):
        out = tmp_path_factory.mktemp("sweeps") / name
        result, text = _bench(out, "--batch 1,3 --caches static --repeats 1 --warmup 0")
        assert result.exit_code == 0, text
        runs.append(out)
    return runs


def test_compare_matches_a_batch_sweep_row_by_row(two_sweeps):
    result, text = invoke("compare", str(two_sweeps[0]), str(two_sweeps[1]), "--format", "json")
    assert result.exit_code in (0, 1), text
    doc = json.loads(result.stdout)
    assert sorted((r["cache"], r["batch"]) for r in doc["rows"]) == [("static", 1), ("static", 3)]


def test_compare_names_the_batch_of_every_row(two_sweeps):
    """The table and the Markdown report have a batch column, labels say the batch, the header lists the sizes."""
    base, cand = map(str, two_sweeps)
    result, text = invoke("compare", base, cand, "--format", "md")
    assert result.exit_code == 0, text
    header = next(line for line in result.stdout.splitlines() if line.startswith("| engine"))
    assert header.split(" | ")[:4] == ["| engine", "cache", "prompt", "batch"]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| kvbench")]
    assert [r.split(" | ")[3] for r in rows] == ["1", "3"]
    result, text = invoke("compare", base, cand)
    assert result.exit_code == 0 and "batch 1,3;" in text, text
    assert "kvbench static prompt 8 batch 3: too few decode steps" in " ".join(text.split())


# A cache that asks the CPU allocator for 2^50 bytes once the batch reaches 3 (torch refuses at once, touching nothing)
HUNGRY = """
import torch
from kvbench.caches.dynamic import DynamicCache

class Hungry(DynamicCache):
    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__()
        if batch >= 3:
            self.spare = torch.empty(1 << 50, dtype=torch.uint8)
"""


def test_a_plugin_cache_out_of_memory_is_an_oom_row_not_a_broken_plugin(tmp_path, plugin_files):
    """A plugin whose cache asks the CPU allocator for 2^50 bytes once the batch reaches 3 (torch refuses at once,
    touching nothing): at batch 3 that is the machine running out, an `oom` row, and the sweep exits 0."""
    plugin_files({"hungry.py": HUNGRY})
    out = tmp_path / "run"
    result, text = _bench(out, "--batch 1,3 --caches hungry:Hungry --repeats 1 --warmup 0")
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv")
    assert list(zip(s.batch, s.status, strict=True)) == [(1, "ok"), (3, "oom")]


def test_json_oom_rows_carry_every_summary_column_null(tmp_path, plugin_files):
    """bench --json's rows are summary.csv's: an oom row has the same --percentiles keys as an ok row (null), in
    summary.csv's column order."""
    plugin_files({"hungry2.py": HUNGRY})
    out = tmp_path / "run"
    result, text = _bench(
        out, "--batch 1,3 --caches hungry2:Hungry --repeats 2 --warmup 0 --percentiles 95,99.9 --json"
    )
    assert result.exit_code == 0, text
    ok, oom = json.loads(result.stdout)["summary"]
    assert (ok["status"], oom["status"]) == ("ok", "oom")
    assert list(ok) == list(oom) == list(pd.read_csv(out / "summary.csv").columns)
    assert ok["tpot_ms_p95"] is not None and oom["tpot_ms_p95"] is None and oom["tpot_ms_p99.9"] is None, oom
