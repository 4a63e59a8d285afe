"""Decode timing at a filled context: the fill writes exactly the context, every cache decodes from it exactly, and
`bench --fill random` runs end to end, labelled, keeping its rows when interrupted."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.bench import floor
from kvbench.bench.context import fill_random, run_context_sweep, time_decode
from kvbench.bench.floor import Bandwidth
from kvbench.bench.settings import load_settings
from kvbench.caches import CACHES, CacheSpec, make_caches
from kvbench.caches.static import StaticCache
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.model.gpt2 import PRESETS

BW = Bandwidth(read_gbps=20.0, copy_gbps=15.0, nbytes=1, device="cpu")


def test_fill_then_decode_equals_the_same_cache_filled_by_a_prefill(tiny_model):
    """A cache filled through `update` with the K/V a prefill would write decodes the same logits as after that
    prefill: the decode path does not care how the cache was filled."""
    prompt = torch.randint(0, 500, (20,)).tolist()
    ref = generate(tiny_model, [prompt], 5, cache="static", record_logits=True)
    # capture the prefill's K/V by running it into a dynamic cache, then replay them through fill-style updates
    dyn = make_caches("dynamic", tiny_model.config, 1, 25, torch.float32, "cpu")
    tiny_model(torch.tensor([prompt]), torch.arange(20)[None], dyn)
    static = make_caches("static", tiny_model.config, 1, 25, torch.float32, "cpu")
    for s, d in zip(static, dyn, strict=True):
        s.update(d.k, d.v, torch.arange(20)[None])
    logits = tiny_model(torch.tensor([[ref.tokens[0][0]]]), torch.tensor([[20]]), static)[0, -1]
    torch.testing.assert_close(logits, ref.logits[1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["static", "static-graph", "paged", "int8", "dynamic"])
def test_fill_random_fills_exactly_the_context(tiny_model, cache, monkeypatch):
    monkeypatch.setattr("kvbench.bench.context.FILL_CHUNK", 24)  # several chunks, the last one partial
    layers = make_caches(cache, tiny_model.config, 2, 70, torch.float32, "cpu")
    fill_random(layers, tiny_model, 2, 64, torch.Generator().manual_seed(0))
    assert all(c.length == 64 for c in layers), cache
    steps = time_decode(tiny_model, cache, layers, 64, 3, 2)
    assert len(steps) == 3 and all(s > 0 for s in steps)
    assert all(c.length == 67 for c in layers), cache


def test_sweep_rows_carry_the_floor_and_the_label(tiny_model):
    seen = []
    results = run_context_sweep(
        tiny_model, ["static", "static-graph"], [16, 64], 4, 2, 1, 1, BW, "fp32", "cpu", on_result=seen.append
    )
    rows = [r.summary for r in results]
    slot = 2 * tiny_model.config.n_layer * tiny_model.config.n_embd * 4  # one token's K + V, all layers, fp32
    assert seen == results  # streamed as each configuration completes
    # contexts outermost: an interrupted sweep has every cache at the contexts it finished
    assert [(r.cache, r.context) for r in rows] == [
        ("static", 16),
        ("static-graph", 16),
        ("static", 64),
        ("static-graph", 64),
    ]
    for res in results:
        r = res.summary
        assert r.fill == "random" and r.status == "ok" and r.repeats == 2
        assert len(res.steps) == 2 * 4 and {s.repeat for s in res.steps} == {1, 2}
        assert r.tpot_ms_median == pytest.approx(pd.Series([s.latency_ms for s in res.steps]).median())
        assert math.isclose(r.x_floor, r.tpot_ms_median / r.floor_ms)
        assert r.floor_ms == pytest.approx(1e3 * r.step_bytes / 20e9)
        # weights + K/V read + this token's K/V written (one slot) + the design's copies (none for these two)
        assert r.step_bytes == r.weight_bytes + r.kv_read_bytes + slot and r.design_bytes == 0
    by = {(r.cache, r.context): r for r in rows}
    assert by[("static", 64)].kv_read_bytes > by[("static", 16)].kv_read_bytes  # more context, more to read
    # static-graph attends over its whole buffer (context + new tokens), static over the filled slots
    assert by[("static-graph", 16)].kv_read_bytes == (16 + 4) * slot
    assert by[("static", 16)].kv_read_bytes == (16 + 2) * slot  # the median step's context: 16 + (4 + 1) // 2


def test_a_cache_that_raises_is_a_row_and_the_sweep_goes_on(tiny_model, monkeypatch):
    class Breaks(StaticCache):
        def update(self, k, v, positions):
            if self.length >= 40:
                raise RuntimeError("boom past 40 tokens")
            return super().update(k, v, positions)

    spec = CacheSpec("breaks", "test", lambda c, b, n, dt, dev: Breaks(b, c.n_head, n, c.head_dim, dt, dev))
    monkeypatch.setitem(CACHES, "breaks", spec)
    rows = [
        r.summary for r in run_context_sweep(tiny_model, ["breaks", "static"], [16, 64], 3, 1, 0, 1, BW, "fp32", "cpu")
    ]
    status = {(r.cache, r.context): r.status for r in rows}
    assert status[("breaks", 16)] == "ok" and status[("static", 64)] == "ok"
    assert status[("breaks", 64)] == "error: RuntimeError: boom past 40 tokens"
    broken = next(r for r in rows if r.status != "ok")
    assert math.isnan(broken.tpot_ms_median) and broken.repeats == 0


def test_k_suffix_and_random_fill_defaults():
    s = load_settings(None, {"prompt_len": "256,1k,4k,16K", "fill": "random"})
    assert s.prompt_len == [256, 1024, 4096, 16384]
    assert "none" not in s.caches and s.engine == ["kvbench"] and s.new_tokens == 32
    s = load_settings(None, {"fill": "random", "caches": "static", "new_tokens": 8})
    assert s.caches == ["static"] and s.new_tokens == 8  # what was given is kept
    assert load_settings(None, {}).caches == list(CACHES)  # a prefill sweep keeps its own defaults


ARGS = [
    *"--model gpt2-tiny --device cpu --fill random --new-tokens 4 --repeats 2 --warmup 1 --threads 1".split(),
    *"--caches static,paged,int8".split(),
]


def test_cli_random_fill_sweep_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["bench", *ARGS, "--prompt-len", "64,256", "--out", str(out)])
    text = result.output + (repr(result.exception) if result.exception else "")
    assert result.exit_code == 0, text
    assert "RANDOM K/V" in result.stdout and "no prefill" in result.stdout  # the table's title says so
    s = pd.read_csv(out / "summary.csv")
    assert len(s) == 2 * 3 and (s.status == "ok").all() and (s.fill == "random").all()
    assert list(zip(s.context, s.cache, strict=True)) == [
        (c, k) for c in (64, 256) for k in ("static", "paged", "int8")
    ]
    assert ((s.x_floor - s.tpot_ms_median / s.floor_ms).abs() < 1e-6 * s.x_floor).all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["fill"] == "random" and "no prefill" in meta["fill_note"]
    assert meta["crossover_context"] == floor.crossover_context(PRESETS["gpt2-tiny"], 4)
    bw = meta["floor"]["bandwidth"]
    assert bw["used"] == "read" and bw["read_gbps"] > 0 and bw["copy_gbps"] > 0 and bw["nbytes"] == 16 << 20
    assert ((s.floor_ms - 1e3 * s.step_bytes / (bw["gbps"] * 1e9)).abs() < 1e-6 * s.floor_ms).all()
    assert (out / "context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert meta["plots"] == ["context.png", "distortion.png"]  # the second: int8, a lossy cache, ran
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 6 * 2 * 4 and set(steps.step) == {1, 2, 3, 4}
    lossy = s.cache == "int8"  # its cost against static at each context, both filled with the same K/V
    assert (s[lossy].kl_mean > 0).all() and s[~lossy][["kl_mean", "top1_agreement", "mean_abs_dp"]].isna().all().all()
    tokens = pd.read_csv(out / "distortion.csv")
    assert len(tokens) == 2 * 4 and (tokens.depth == tokens.context + tokens.token).all()
    assert set(meta["distortion"]["rows"]) == {"int8 context 64", "int8 context 256"}
    assert "distortion int8 context 256: KL mean" in result.stdout


def test_cli_random_fill_interrupted_keeps_rows(tmp_path, monkeypatch):
    from kvbench.cli import bench as cli_bench

    calls = {"n": 0}
    real_update = cli_bench._BenchProgress.update

    def update(self, done, total, label):
        calls["n"] += 1
        if calls["n"] == 7:  # 3 runs per configuration: the third configuration's first run has just finished
            raise KeyboardInterrupt
        real_update(self, done, total, label)

    monkeypatch.setattr(cli_bench._BenchProgress, "update", update)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["bench", *ARGS, "--prompt-len", "32,64", "--out", str(out)])
    assert result.exit_code == 130, result.output
    s = pd.read_csv(out / "summary.csv")
    assert list(s.cache) == ["static", "paged"] and (s.fill == "random").all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["configurations_completed"] == 2
    assert (out / "context.png").is_file()
