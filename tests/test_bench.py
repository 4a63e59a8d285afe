"""kvbench bench: the sweep through the CLI writes every file with sane values; interrupts, OOM, bad input;
the dynamic cache's copy traffic against its closed form; transformers' engine on the same weights."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.bench import sweep as B
from kvbench.bench.engines import ENGINES, KVBenchEngine
from kvbench.bench.settings import BenchSettings, check_sizes, load_settings, sweep_model_config
from kvbench.caches import CACHES
from kvbench.caches.dynamic import DynamicCache
from kvbench.cli import app
from kvbench.decode.generate import generate
from kvbench.model.gpt2 import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
ISSUE_COLUMNS = (
    "engine cache prompt_len new_tokens batch dtype device ttft_ms tpot_ms_median tpot_ms_p90 total_s tokens_per_s "
    "speedup_vs_none peak_mem_mib kv_cache_mib bytes_copied repeats"
).split()

# A small model whose full-sequence forward at a long prompt outweighs one cached step (about 5x end to end at prompt
# 256 on a quiet 2-core machine). No test asserts that speed-up: it is a benchmark's figure, and a busy machine may
# not show it; the tests assert what the rows must hold whatever the timings.
SWEEP_MODEL = dict(n_layer=2, n_head=4, n_embd=256, n_positions=512, vocab_size=2000)


def hf_config_json(path: Path, **cfg) -> Path:
    doc = {"model_type": "gpt2", "n_ctx": cfg["n_positions"], "layer_norm_epsilon": 1e-5, **cfg}
    path.write_text(json.dumps(doc))
    return path


def invoke(*args: str):
    result = CliRunner().invoke(app, ["bench", *args])
    return result, result.output + (repr(result.exception) if result.exception else "")


@pytest.fixture
def sweep_model(tmp_path) -> Path:
    return hf_config_json(tmp_path / "config.json", **SWEEP_MODEL)


# --- the copy traffic of torch.cat ---------------------------------------------------------------------------------
def test_dynamic_cache_copy_traffic_matches_closed_form_exactly():
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=128, vocab_size=500)
    model = GPT(cfg).init_weights(seed=0, std=0.1).eval()
    B_, n0, new = 2, 11, 9  # a batch, so the per-token bytes scale with it
    prompts = torch.randint(0, 500, (B_, n0)).tolist()
    r = generate(model, prompts, new, cache="dynamic")
    n1 = n0 + new - 1  # the last token is sampled, never fed back, so the cache ends one short
    bpt = cfg.kv_bytes_per_token(4) * B_
    expected = sum(bpt * L for L in range(n0, n1))  # each append re-copies the L tokens already cached
    assert r.bytes_copied == expected
    assert r.cache_bytes == bpt * n1
    # The seed's (n1^2 - n0^2)/2 overestimates by exactly bytes/token x (n1 - n0)/2.
    assert B.seed_copy_estimate(bpt, n0, n1) - expected == bpt * (n1 - n0) / 2


def test_copy_traffic_on_raw_tensors():
    c = DynamicCache()
    k = torch.zeros(1, 2, 5, 4)
    c.update(k, k, None)  # first write copies nothing
    for _ in range(3):
        c.update(k[:, :, :1], k[:, :, :1], None)
    per_token = 2 * 2 * 4 * 4  # K and V, 2 heads x 4 dims x 4 bytes
    assert c.bytes_copied == per_token * (5 + 6 + 7)


# --- the whole sweep through the CLI ------------------------------------------------------------------------------
def test_cli_sweep_writes_all_files_with_sane_values(tmp_path, sweep_model):
    cfg_file = tmp_path / "sweep.toml"
    cfg_file.write_text('prompt_len = [8, 256]\nnew_tokens = 99\nrepeats = 5\ncaches = "none"\n')
    out = tmp_path / "run"
    new, repeats = 6, 2  # the command line overrides the file's 99 and 5
    result, text = invoke(
        "--config",
        str(cfg_file),
        "--model",
        str(sweep_model),
        "--weights",
        "random",
        "--device",
        "cpu",
        "--new-tokens",
        str(new),
        "--repeats",
        str(repeats),
        *"--warmup 1 --caches none,dynamic,static --engine kvbench,hf,hf-compiled --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    for name in ("summary.csv", "steps.csv", "meta.json", "latency.png", "speedup.png"):
        assert (out / name).is_file(), f"{name} missing: {text}"
    for png in ("latency.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    s = pd.read_csv(out / "summary.csv")
    assert set(ISSUE_COLUMNS) <= set(s.columns)
    # prompt lengths x (kvbench none/dynamic/static + hf the same + hf-compiled static)
    assert len(s) == 2 * (3 + 3 + 1)
    assert (s.status == "ok").all()
    assert set(s[s.engine == "hf-compiled"].cache) == {"static"}
    assert (s.new_tokens == new).all() and (s.repeats == repeats).all() and (s.dtype == "fp32").all()
    assert (s.ttft_ms > 0).all() and (s.tpot_ms_median > 0).all()
    assert (s.tpot_ms_p90 >= s.tpot_ms_median).all()
    assert (s.total_s >= s.ttft_ms / 1e3).all()
    assert ((s.tokens_per_s - new / s.total_s).abs() < 1e-3 * s.tokens_per_s).all()
    assert (s[s.cache == "none"].speedup_vs_none == 1.0).all()
    hfc = s[s.engine == "hf-compiled"].set_index("prompt_len")
    hf_none = s[(s.engine == "hf") & (s.cache == "none")].set_index("prompt_len")
    # hf-compiled's speedup is against transformers' own `none`; `vs hf` against the fastest transformers row
    assert ((hfc.speedup_vs_none / (hf_none.total_s / hfc.total_s) - 1).abs() < 1e-5).all()
    for _, grp in s.groupby("prompt_len"):
        fastest = grp[grp.engine.isin(["hf", "hf-compiled"])].tpot_ms_median.min()
        assert ((grp.speedup_vs_fastest_hf / (fastest / grp.tpot_ms_median) - 1).abs() < 1e-5).all()
    assert (s.token_agreement == 1.0).all() and (s.flips == 0).all() and (s.tokens_note == "identical").all()
    assert s.sdpa_prefill.notna().all() and s.sdpa_decode.notna().all()
    assert (s.peak_mem_mib >= s.weights_mib).all()

    ours = s[s.engine == "kvbench"].set_index(["cache", "prompt_len"])
    bpt = 2 * SWEEP_MODEL["n_layer"] * SWEEP_MODEL["n_embd"] * 4
    for p in (8, 256):
        n1 = p + new - 1
        assert ours.loc[("none", p), "kv_cache_mib"] == 0
        assert ours.loc[("dynamic", p), "kv_cache_mib"] == pytest.approx(bpt * n1 / 2**20, rel=1e-5)
        assert ours.loc[("static", p), "kv_cache_mib"] == pytest.approx(bpt * (p + new) / 2**20, rel=1e-5)
        assert ours.loc[("dynamic", p), "bytes_copied"] == sum(bpt * L for L in range(p, n1))  # each append re-copies
        assert ours.loc[("static", p), "bytes_copied"] == 0
        assert ours.loc[("dynamic", p), "bytes_copied_seed_estimate"] == B.seed_copy_estimate(bpt, p, p + new)
    assert s[s.engine == "hf"].bytes_copied.isna().all()  # not counted for transformers' caches
    assert s.cold_tpot_ms_median.notna().all() and (s.cold_total_s > 0).all()

    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == len(s) * repeats * (new - 1)
    assert sorted(steps.step.unique()) == list(range(1, new))
    assert (steps.latency_ms > 0).all()

    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["seed"] == 0 and meta["weights"].startswith("random")
    for key in ("command", "git", "versions", "device_name", "settings", "cold_warm", "token_reference"):
        assert key in meta, key
    assert "cudnn_version" in meta["sdpa"] and set(meta["sdpa"]["enabled"]) == {
        "flash",
        "efficient",
        "cudnn",
        "math",
    }
    assert meta["sdpa"]["observed"]["kvbench static"]["decode"]
    assert "did not compile" in meta["engines"]["hf-compiled"]  # transformers compiles on its own only on GPUs
    assert meta["settings"]["new_tokens"] == new and meta["config_file"] == str(cfg_file)


def test_floor_columns_are_present_and_consistent(tmp_path):
    """Every cached row carries its floor: step_bytes / the bandwidth measured in the run, x_floor = TPOT / floor,
    the bytes of its own design; `none` has none. transformers' static cache is floored on the buffer it really
    attended over: its generate keeps the largest max_cache_len of earlier calls on the same model, so at prompt 8
    after prompt 16 it attends over 16 + new - 1 slots."""
    from kvbench.bench import floor
    from kvbench.model.gpt2 import PRESETS

    out, new = tmp_path / "run", 6
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 16,8 --new-tokens".split(),
        str(new),
        *"--repeats 1 --warmup 0 --caches none,dynamic,static,static-graph,paged --engine kvbench,hf --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    assert "floor ms" in result.stdout and "x floor" in result.stdout
    s = pd.read_csv(out / "summary.csv")
    meta = json.loads((out / "meta.json").read_text())
    bw = meta["floor"]["bandwidth"]
    assert bw["used"] == "read" and bw["gbps"] == bw["read_gbps"] > 0 and bw["copy_gbps"] > 0
    none, cached = s[s.cache == "none"], s[s.cache != "none"]
    assert none.floor_ms.isna().all() and none.x_floor.isna().all() and none.step_bytes.isna().all()
    assert (cached.floor_ms > 0).all() and len(cached) == 2 * (4 + 2)
    assert ((cached.floor_ms - 1e3 * cached.step_bytes / (bw["gbps"] * 1e9)).abs() < 1e-6 * cached.floor_ms).all()
    assert ((cached.x_floor - cached.tpot_ms_median / cached.floor_ms).abs() < 1e-6 * cached.x_floor).all()
    cfg, slot = PRESETS["gpt2-tiny"], 2 * 2 * 128 * 4  # one token's K + V, 2 layers, fp32
    steps = meta["floor"]["steps"]
    for p in (16, 8):
        row = s[(s.engine == "kvbench") & (s.prompt_len == p)].set_index("cache")
        ms, b = floor.decode_floor_ms(
            cfg,
            torch.float32,
            1,
            p,
            new,
            CACHES["static"].traffic,
            floor.Bandwidth(**{k: bw[k] for k in ("read_gbps", "copy_gbps", "nbytes", "device")}),
        )
        assert row.loc["static", "step_bytes"] == b.total and row.loc["static", "floor_ms"] == pytest.approx(ms)
        assert steps[f"kvbench static prompt {p} batch 1"]["slots"] == p + new // 2
        assert steps[f"kvbench static-graph prompt {p} batch 1"]["slots"] == p + new  # its whole buffer
        # torch.cat re-reads and rewrites the history; the paged gather copies whole 16-token blocks
        assert row.loc["dynamic", "step_bytes"] - row.loc["static", "step_bytes"] == 2 * (p + new // 2 - 1) * slot
        assert row.loc["paged", "step_bytes"] > row.loc["static", "step_bytes"]
        assert (
            steps[f"hf dynamic prompt {p} batch 1"]["design"] == steps[f"kvbench dynamic prompt {p} batch 1"]["design"]
        )
    assert steps["hf static prompt 16 batch 1"]["slots"] == 16 + new - 1  # max_cache_len = max_length - 1
    assert steps["hf static prompt 8 batch 1"]["slots"] == 16 + new - 1  # kept from the earlier, longer call


def test_json_output_is_one_document(tmp_path):
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 4 --new-tokens 3 --repeats 1 --warmup 0".split(),
        *"--caches none,dynamic --engine kvbench --out".split(),
        str(tmp_path / "j"),
        "--json",
    )
    assert result.exit_code == 0, text
    doc = json.loads(result.stdout)
    assert [r["cache"] for r in doc["summary"]] == ["none", "dynamic"]
    assert doc["summary"][0]["bytes_copied_seed_estimate"] is None  # NaN becomes null
    # one prompt length: speedup.png is drawn as bars per cache (lines would be single points)
    assert (tmp_path / "j" / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- reliability --------------------------------------------------------------------------------------------------
def test_ctrl_c_keeps_completed_rows_and_exits_130(tmp_path, monkeypatch):
    from kvbench.cli import bench as cli_bench

    calls = {"n": 0}
    real_update = cli_bench._BenchProgress.update

    def interrupting_update(self, done, total, label):
        calls["n"] += 1
        if calls["n"] == 3:  # the third configuration's run has just finished; its row is not written yet
            raise KeyboardInterrupt
        real_update(self, done, total, label)

    monkeypatch.setattr(cli_bench._BenchProgress, "update", interrupting_update)
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 4,8 --new-tokens 3 --repeats 1".split(),
        *"--warmup 0 --caches none,dynamic,static --engine kvbench --out".split(),
        str(out),
    )
    assert result.exit_code == 130, text
    s = pd.read_csv(out / "summary.csv")
    assert list(s.cache) == ["none", "dynamic"] and (s.status == "ok").all()
    assert len(pd.read_csv(out / "steps.csv")) == 2 * 1 * 2
    assert json.loads((out / "meta.json").read_text())["status"] == "interrupted"
    assert not list(out.glob(".*tmp*")), "a temporary file was left behind"


@pytest.mark.parametrize("stop, code, line", [("ctrl-c", 130, "interrupted"), ("sigterm", 143, "terminated")])
def test_an_interrupted_bench_json_prints_its_error_document(tmp_path, monkeypatch, stop, code, line):
    """bench --json stopped mid-sweep (Ctrl-C, SIGTERM) keeps its rows and prints one JSON document, the error
    document with the line said on stderr and the exit status."""
    import signal

    from kvbench.cli import bench as cli_bench

    def interrupting_update(self, done, total, label):
        if done == 2:
            raise KeyboardInterrupt if stop == "ctrl-c" else cli_bench.Terminated(signal.SIGTERM)

    monkeypatch.setattr(cli_bench._BenchProgress, "update", interrupting_update)
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 4,8 --new-tokens 3 --repeats 1".split(),
        *"--warmup 0 --caches none,static --engine kvbench --json --out".split(),
        str(out),
    )
    assert result.exit_code == code, text
    assert json.loads(result.stdout) == {"schema_version": 1, "error": line, "exit_code": code}
    assert f"error: {line}" in result.stderr and json.loads((out / "meta.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize(
    "error",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
        ),
        MemoryError(),
    ],
    ids=["cuda", "cpu-allocator", "memory-error"],
)
def test_out_of_memory_marks_the_row_and_the_sweep_goes_on(tiny_model, error):
    """CUDA OOM and a CPU allocation failure are both an `oom` row, raised while allocating the caches or mid-run."""

    class OOMOnDynamic(KVBenchEngine):
        def configure(self, cache, batch, max_len):
            if cache == "dynamic":
                raise error
            conf = super().configure(cache, batch, max_len)
            if cache == "static":  # the allocation succeeds, the second run fails
                real_run, calls = conf.run, []

                def run(ids, new_tokens, record_logits=False):
                    calls.append(1)
                    if len(calls) == 2:
                        raise error
                    return real_run(ids, new_tokens, record_logits)

                conf.run = run
            return conf

    s = BenchSettings(prompt_len=[4, 6], new_tokens=3, caches=["none", "dynamic", "static"], engine=["kvbench"])
    s.repeats, s.warmup = 1, 1
    seen = []
    rows = B.run_sweep(
        tiny_model, s, "fp32", "cpu", on_result=seen.append, engines={"kvbench": OOMOnDynamic(tiny_model)}
    )
    status = {(r.summary.cache, r.summary.prompt_len): r.summary.status for r in rows}
    assert status == {(c, p): ("ok" if c == "none" else "oom") for c in s.caches for p in (4, 6)}
    assert len(seen) == 6
    oom = next(r.summary for r in rows if r.summary.status == "oom")
    assert math.isnan(oom.total_s) and oom.repeats == 0


def test_unwritable_out_is_an_error_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result, text = invoke("--model", "gpt2-tiny", "--weights", "random", "--out", str(blocker / "run"))
    assert result.exit_code == 2, text
    assert "--out" in text and "writable" in text


def test_impossible_sweep_is_rejected_naming_the_values(tmp_path):
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 16,700,1000 --new-tokens 400 --out".split(),
        str(out),
    )
    assert result.exit_code == 2, text
    assert "700 + 400 = 1100" in text and "1000 + 400 = 1400" in text and "16 +" not in text
    assert not (out / "summary.csv").exists()


def test_unknown_config_key_names_key_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("prompt_lens = [16]\n")
    result, text = invoke("--config", str(f))
    assert result.exit_code == 2, text
    assert "prompt_lens" in text and "bad.toml" in text


@pytest.mark.parametrize("name", ["seed.toml", "quick.toml"])
def test_shipped_configs_load(name):
    s = load_settings(ROOT / "configs" / "bench" / name, {})
    assert s.caches == list(CACHES)  # every registered cache
    assert s.engine == ["kvbench", "hf"]
    if name == "seed.toml":
        assert (s.prompt_len, s.new_tokens, s.dtype, s.device) == ([16, 128, 512], 400, "auto", "auto")


@pytest.mark.parametrize("name", ["seed", "quick"])
def test_bench_config_by_name(name):
    """`--config seed` finds the sweep shipped in the package, the same file as configs/bench/seed.toml."""
    assert load_settings(name, {}) == load_settings(ROOT / "configs" / "bench" / f"{name}.toml", {})


# --- transformers' engine ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_hf_engine_runs_the_same_weights_for_exactly_n_tokens(tiny_model, cache):
    from kvbench.hf.engine import build_hf_model, hf_generate

    hf = build_hf_model(tiny_model)
    prompts = [torch.randint(0, 500, (1, 10)), torch.randint(0, 500, (1, 10))]
    outs = []
    for ids in prompts:
        r = hf_generate(hf, ids, 7, cache)
        assert r.tokens == generate(tiny_model, ids.tolist(), 7, cache=cache).tokens
        assert len(r.tokens[0]) == 7 and len(r.step_s) == 6
        assert r.ttft_s > 0 and r.total_s >= r.ttft_s + sum(r.step_s) * 0.999
        outs.append(r.tokens)
    assert outs[0] != outs[1], "output does not depend on the prompt"


# --- caches allocated once, static-graph captured once -------------------------------------------------------------
class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: `replay` runs the runner's eager fixed-shape step, so the
    capture-once bookkeeping is exercised with exact numerics."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def replay(self) -> None:
        self.runner.out = self.runner._run()


def test_static_graph_captures_once_per_configuration_and_reuses_its_caches(tiny_model, monkeypatch):
    from kvbench.decode import fixed_step as static_graph
    from kvbench.model.gpt2 import EXACT_MASK

    built = []
    real_init = static_graph.FixedShapeDecoder.__init__

    def init(self, model, caches, graph=None, compile="off", mask_rule=EXACT_MASK):
        real_init(self, model, caches, graph=False, compile=compile, mask_rule=mask_rule)
        self.use_graph = graph is None  # the sweep's runners "capture"; the SDPA probe's eager one does not
        if self.use_graph:
            built.append(self)

    def capture(self):
        self.graph = _FakeGraph(self)
        self.captures += 1
        self.capture_s += 0.004

    monkeypatch.setattr(static_graph.FixedShapeDecoder, "__init__", init)
    monkeypatch.setattr(static_graph.FixedShapeDecoder, "_capture", capture)
    s = BenchSettings(prompt_len=[5, 9], new_tokens=7, caches=["none", "static-graph"], engine=["kvbench"])
    s.warmup, s.repeats = 2, 3
    rows = [r.summary for r in B.run_sweep(tiny_model, s, "fp32", "cpu")]
    assert len(built) == 2, "one runner (one capture) per static-graph configuration"
    for runner in built:
        assert runner.captures == 1
        assert runner.fixed_steps == (2 + 3) * (7 - 1), "every run of the configuration replayed the same graph"
    graph_rows = [r for r in rows if r.cache == "static-graph"]
    assert [r.capture_ms for r in graph_rows] == [pytest.approx(4.0), pytest.approx(4.0)]
    assert all(r.token_agreement == 1.0 and r.tokens_note == "identical" for r in rows)
    assert all(math.isnan(r.capture_ms) for r in rows if r.cache == "none")


def test_caches_are_allocated_once_per_configuration(tiny_model, monkeypatch):
    from kvbench.bench import engines

    allocations = []
    real = engines.make_caches

    def counting(name, *args, **kw):
        caches = real(name, *args, **kw)
        allocations.append((name, None if caches is None else id(caches[0])))
        return caches

    monkeypatch.setattr(engines, "make_caches", counting)
    s = BenchSettings(prompt_len=[6], new_tokens=5, caches=["dynamic", "static", "paged"], engine=["kvbench"])
    s.warmup, s.repeats = 1, 4
    B.run_sweep(tiny_model, s, "fp32", "cpu")
    # per cache: one allocation for its five runs, one small one for the SDPA probe
    assert [n for n, _ in allocations] == ["dynamic", "dynamic", "static", "static", "paged", "paged"]


def test_interleaved_order_runs_the_timed_repeats_in_rounds(tiny_model):
    """--order interleaved: per prompt length, each configuration's cold and warm-up runs back to back, then one timed
    run of each configuration per round; the rows are those of a sequential sweep (same tokens, every column)."""
    s = BenchSettings(prompt_len=[5, 9], new_tokens=4, caches=["none", "static", "paged"], engine=["kvbench"])
    s.warmup, s.repeats, s.order = 2, 3, "interleaved"
    labels = []
    rows = B.run_sweep(tiny_model, s, "fp32", "cpu", on_progress=lambda done, total, label: labels.append(label))
    for i, p in enumerate((5, 9)):
        own = labels[i * 15 : (i + 1) * 15]  # 3 configurations x 5 runs
        names = [f"kvbench {c} prompt {p}" for c in ("none", "static", "paged")]
        warm = [n for n in names for _ in range(2)]  # cold + warm-up, back to back
        assert own == warm + names * 3, own
    summary = [r.summary for r in rows]
    assert [(r.prompt_len, r.cache) for r in summary] == [(p, c) for p in (5, 9) for c in ("none", "static", "paged")]
    for r in summary:
        assert r.status == "ok" and r.repeats == 3 and r.tokens_note == "identical"
        assert r.run_peak_mib >= 0 and not math.isnan(r.tpot_ms_median) and not math.isnan(r.cold_ttft_ms)
    assert len([x for x in rows if x.summary.cache == "static"][0].steps) == 3 * (4 - 1)
    # the floor moves with the drift: the first probe and one per round (warmup + repeats - 2 = 3), pooled
    for x in rows:
        if x.summary.cache != "none":
            assert x.bandwidth.repeats == 7 + 3 * 3
            assert x.summary.floor_ms == pytest.approx(x.summary.step_bytes / (x.bandwidth.gbps * 1e9) * 1e3)
    s.order = "sequential"
    labels.clear()
    again = [
        r.summary
        for r in B.run_sweep(tiny_model, s, "fp32", "cpu", on_progress=lambda d, t, label: labels.append(label))
    ]
    assert labels[:5] == ["kvbench none prompt 5"] * 5, "sequential: each configuration's runs back to back"
    assert [(r.cache, r.token_agreement) for r in again] == [(r.cache, r.token_agreement) for r in summary]


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_paired_floor_holds_each_timed_run_to_the_reads_beside_it(tiny_model, monkeypatch, order):
    """x_floor_paired: every timed run of a row with a floor gets the mean of the read taken just before it and the
    one just after it; a read after one timed run is the next one's read before when nothing ran in between (a cold
    or warm-up run, a `none` run, a round's probe), and the row reports the median run's x floor and the extremes.
    The reads here are a known sequence (10, 20, 30, ... GB/s) so the pairing can be followed; the arithmetic is
    checked against floor_ms, computed apart."""
    from kvbench.bench import floor

    reads = iter(range(10, 10_000, 10))
    monkeypatch.setattr(floor, "read_now", lambda bw, repeats=3: float(next(reads)))
    s = BenchSettings(prompt_len=[6], new_tokens=5, caches=["none", "static", "dynamic"], engine=["kvbench"])
    s.warmup, s.repeats, s.order = 1, 2, order
    rows = {x.summary.cache: x for x in B.run_sweep(tiny_model, s, "fp32", "cpu")}
    assert rows["none"].run_gbps is None and math.isnan(rows["none"].summary.x_floor_paired)
    if order == "sequential":  # static: 10 | run | 20 | run | 30; dynamic's warm-up drops 30: 40 | run | 50 | run | 60
        want = {"static": [15, 25], "dynamic": [45, 55]}
    else:  # a round's probe, then static: 10 | run | 20, dynamic: run | 30; next round: 40 | 50 | 60
        want = {"static": [15, 45], "dynamic": [25, 55]}
    for cache, gbps in want.items():
        x = rows[cache]
        assert x.run_gbps == gbps
        held = {}  # run -> each of its steps over the floor at its run's bandwidth
        for i, g in enumerate(gbps):
            bw = floor.Bandwidth(read_gbps=g, copy_gbps=math.nan, nbytes=1, device="cpu")
            ms = floor.floor_ms(x.floor_bytes, bw)
            held[i] = [st.latency_ms / ms for st in x.steps if st.repeat == i + 1]
        r, medians = x.summary, [statistics.median(v) for v in held.values()]
        assert r.x_floor_paired == pytest.approx(statistics.median(sum(held.values(), [])), rel=1e-9)
        assert (r.x_floor_paired_min, r.x_floor_paired_max) == pytest.approx((min(medians), max(medians)), rel=1e-9)
        assert r.paired_read_gbps == statistics.median(gbps)


def test_paired_floor_takes_a_fresh_read_after_a_finished_row(tiny_model, monkeypatch):
    """With --warmup 0 a row's first timed run follows the previous row's checks (tokens, SDPA probe, distortion)
    directly: its read before is taken then, not kept from before that work."""
    from kvbench.bench import floor

    reads = iter(range(10, 10_000, 10))
    monkeypatch.setattr(floor, "read_now", lambda bw, repeats=3: float(next(reads)))
    s = BenchSettings(prompt_len=[6], new_tokens=4, caches=["static", "int8"], engine=["kvbench"])
    s.warmup, s.repeats = 0, 2
    rows = {x.summary.cache: x.run_gbps for x in B.run_sweep(tiny_model, s, "fp32", "cpu")}
    assert rows == {"static": [15, 25], "int8": [45, 55]}  # int8: 40 | run | 50 | run | 60, not 30 kept


def test_paired_floor_pools_the_steps_as_x_floor_does():
    """A timed run whose first step compiled (seconds) is one outlier among the steps, as in x floor, not the median
    of a two-step run; the extremes are the runs' own medians."""
    from kvbench.bench import floor

    b = floor.StepBytes(weights=10**9, kv=0, kv_write=0, design=0, note="", context=1, slots=1)  # 1 GB a step
    steps = [[11_383.0, 1.45], [1.44, 1.46]]  # ms; at 100 GB/s the floor is 10 ms
    p = floor.paired(b, steps, [100.0, 100.0])
    assert p.x_floor == pytest.approx(statistics.median([1138.3, 0.145, 0.144, 0.146]))  # 0.1455
    assert (p.x_floor_min, p.x_floor_max) == pytest.approx((0.145, (1138.3 + 0.145) / 2))
    assert p.read_gbps == 100.0


def test_paired_reads_leave_the_rows_memory_alone(tiny_model, monkeypatch):
    """A small probe (8 MiB, under the C allocator's mmap threshold) read beside every run: its pages are unmapped
    after each read, so no row's peak resident set counts them."""
    monkeypatch.setenv("KVBENCH_PROBE_BYTES", str(8 << 20))
    s = BenchSettings(prompt_len=[16], new_tokens=3, caches=["none", "static", "paged"], engine=["kvbench"])
    s.warmup, s.repeats = 1, 2
    for x in B.run_sweep(tiny_model, s, "fp32", "cpu"):
        assert x.summary.run_peak_mib < 4, (x.summary.cache, x.summary.run_peak_mib)


def test_paired_floor_reads_the_real_device_and_is_recorded(tmp_path):
    """From the command line, unpatched: each row with a floor has a paired x floor inside its run range, one real
    read per timed run in meta.json, and the table shows the column."""
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 8 --new-tokens 4".split(),
        *"--caches none,static,static-graph --engine kvbench --repeats 3 --warmup 1 --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    assert "x paired" in result.stdout
    s = pd.read_csv(out / "summary.csv").set_index("cache")
    paired = json.loads((out / "meta.json").read_text())["floor"]["paired_read_gbps"]
    assert set(paired) == {"kvbench static prompt 8 batch 1", "kvbench static-graph prompt 8 batch 1"}
    for key, gbps in paired.items():
        r = s.loc[key.split()[1]]
        assert len(gbps) == 3 and all(g > 0 for g in gbps)
        assert r.x_floor_paired_min <= r.x_floor_paired <= r.x_floor_paired_max
        assert r.paired_read_gbps == pytest.approx(statistics.median(gbps), rel=1e-2)
    assert math.isnan(s.loc["none"].x_floor_paired)


def test_bench_order_interleaved_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 8,12 --new-tokens 3".split(),
        *"--caches none,static --engine kvbench --repeats 2 --warmup 1 --order interleaved --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["order"] == "interleaved" and meta["status"] == "complete"
    assert set(meta["floor"]["by_prompt_len"]) == {"8", "12"}  # each prompt length's pooled probe
    assert "Interleaved: the floor divides by" in text
    s = pd.read_csv(out / "summary.csv")
    assert list(s.prompt_len) == [8, 8, 12, 12] and (s.status == "ok").all() and (s.repeats == 2).all()


def test_pooled_bandwidth_is_the_median_probe_with_the_widest_range():
    from kvbench.bench.floor import Bandwidth, pooled

    probes = [
        Bandwidth(
            g,
            g / 2,
            1 << 20,
            "cpu",
            read_range=(g - 1, g + 1),
            copy_range=(1, 2),
            repeats=3,
            read_kernel="mv",
            read_by_kernel={"sum": g - 5, "mv": g},
        )
        for g in (20.0, 30.0, 22.0)
    ]
    p = pooled(probes)
    assert (p.read_gbps, p.copy_gbps, p.gbps) == (22.0, 11.0, 22.0)
    assert p.read_range == (19.0, 31.0) and p.repeats == 9 and p.read_by_kernel == {"sum": 17.0, "mv": 22.0}


def test_interleaved_order_keeps_going_past_a_failing_configuration(tiny_model):
    """A configuration that fails in the rounds becomes its row's status; the others finish their rounds."""
    from kvbench.bench.engines import KVBenchEngine

    class FailsOnThirdPagedRun(KVBenchEngine):
        def configure(self, cache, batch, max_len):
            conf = super().configure(cache, batch, max_len)
            if cache == "paged":
                real_run, calls = conf.run, []

                def run(ids, new_tokens, record_logits=False):
                    calls.append(1)
                    if len(calls) == 3:
                        raise RuntimeError("plugin blew up")
                    return real_run(ids, new_tokens, record_logits)

                conf.run = run
            return conf

    s = BenchSettings(prompt_len=[6], new_tokens=3, caches=["none", "paged", "static"], engine=["kvbench"])
    s.warmup, s.repeats, s.order = 1, 4, "interleaved"
    rows = {
        r.summary.cache: r.summary
        for r in B.run_sweep(tiny_model, s, "fp32", "cpu", engines={"kvbench": FailsOnThirdPagedRun(tiny_model)})
    }
    assert rows["paged"].status.startswith("error:") and "plugin blew up" in rows["paged"].status
    assert rows["none"].status == rows["static"].status == "ok" and rows["static"].repeats == 4


# --- token agreement ----------------------------------------------------------------------------------------------
def _rows(*pairs):
    """(B, V) logits rows with the given (index, value) entries set on a zero background."""
    out = torch.zeros(len(pairs), 8)
    for b, entries in enumerate(pairs):
        for i, v in entries:
            out[b, i] = v
    return out


def test_token_check_identical_near_tie_and_real_difference():
    from kvbench.bench.agreement import check_tokens

    fp16 = dict(rtol=1e-2, atol=1e-2)  # verify's tolerance for fp16
    ref = [[1, 2, 3, 4]]
    never = lambda: pytest.fail("identical runs need no re-run")  # noqa: E731
    same = check_tokens(ref, [[[1, 2, 3, 4]], [[1, 2, 3, 4]]], lambda d: None, never, **fp16)
    assert (same.agreement, same.first_divergence, same.flips, same.note) == (1.0, None, 0, "identical")

    # token 2: the reference prefers 3 over 5 by 0.01; the run's logits there differ by 0.01: a near-tie
    got = [[1, 2, 5, 6]]
    ref_at = {2: _rows([(3, 1.00), (5, 0.99)])}
    run_logits = [None, None, _rows([(3, 0.99), (5, 1.00)]), None]
    tie = check_tokens(ref, [[[1, 2, 3, 4]], got], ref_at.__getitem__, lambda: (got, run_logits), **fp16)
    assert tie.agreement == 0.5 and tie.first_divergence == 2 and (tie.flips, tie.near_tie_flips) == (1, 1)
    assert "near-tie" in tie.note and "token 2" in tie.note

    # the same flip, but the run's logits are off by 1.0: within 2 x its own error, yet far beyond rounding
    ref_at = {2: _rows([(3, 2.0), (5, 1.0)])}
    run_logits = [None, None, _rows([(3, 1.0), (5, 2.0)]), None]
    bug = check_tokens(ref, [got], ref_at.__getitem__, lambda: (got, run_logits), **fp16)
    assert (bug.flips, bug.near_tie_flips) == (1, 0) and "DIFFERS" in bug.note and "exceeds rounding" in bug.note

    # a clear winner flipped by a small error: not a near-tie either
    run_logits = [None, None, _rows([(3, 1.99), (5, 1.0)]), None]
    clear = check_tokens(ref, [got], ref_at.__getitem__, lambda: (got, run_logits), **fp16)
    assert clear.near_tie_flips == 0 and "top-2 gap 1 > 2 x logit error 0.01" in clear.note


def test_token_check_reports_the_worst_run_and_nondeterminism():
    from kvbench.bench.agreement import check_tokens

    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    runs = [ref, [[1, 2, 3, 4], [5, 9, 9, 9]]]  # the second run flips sequence 1 at token 1
    rerun = lambda: (ref, [None] * 4)  # noqa: E731 - the re-run does not reproduce the flip
    r = check_tokens(ref, runs, lambda d: pytest.fail("not reached"), rerun, rtol=1e-5, atol=1e-5)
    assert r.agreement == 5 / 8 and r.first_divergence == 1 and r.flips == 1 and r.near_tie_flips == 0
    assert "not deterministic" in r.note


def test_a_wrong_cache_is_caught_by_token_agreement(tiny_model, monkeypatch):
    """A cache that returns a corrupted history generates fast, wrong tokens: the row says so, not a speedup."""
    from kvbench.caches import CACHES, CacheSpec
    from kvbench.caches.static import StaticCache

    class ForgetsTheFirstToken(StaticCache):
        def update(self, k, v, positions):
            k, v = super().update(k, v, positions)
            if k.size(2) > 4:
                k = k.clone()
                k[:, :, 0] = 0  # (B, H, S, Dh): the first token's key lost
            return k, v

    spec = CacheSpec(
        "forgetful",
        "test",
        lambda c, b, n, dt, dev: ForgetsTheFirstToken(b, c.n_head, n, c.head_dim, dt, dev),
    )
    monkeypatch.setitem(CACHES, "forgetful", spec)
    s = BenchSettings(prompt_len=[6], new_tokens=24, caches=["none", "static", "forgetful"], engine=["kvbench", "hf"])
    s.warmup, s.repeats = 0, 1
    rows = {(r.summary.engine, r.summary.cache): r.summary for r in B.run_sweep(tiny_model, s, "fp32", "cpu")}
    for key in (("kvbench", "none"), ("kvbench", "static"), ("hf", "none"), ("hf", "static")):
        assert rows[key].token_agreement == 1.0 and rows[key].flips == 0, key
    bad = rows[("kvbench", "forgetful")]
    assert bad.token_agreement < 1.0 and bad.flips == 1 and bad.near_tie_flips == 0, bad
    assert bad.first_divergence >= 0 and "DIFFERS" in bad.tokens_note


# --- memory, engines, SDPA ---------------------------------------------------------------------------------------
def test_hf_engine_shares_our_weights(tiny_model):
    from kvbench.bench.engines import weight_bytes
    from kvbench.hf.engine import build_hf_model

    hf = build_hf_model(tiny_model)
    assert hf.transformer.h[1].mlp.c_fc.weight.data_ptr() == tiny_model.transformer.h[1].mlp.c_fc.weight.data_ptr()
    assert hf.lm_head.weight.data_ptr() == tiny_model.transformer.wte.weight.data_ptr()
    n = sum(p.numel() for p in tiny_model.parameters()) * 4  # fp32, wte and lm_head tied: counted once
    assert weight_bytes(hf) == weight_bytes(tiny_model) == n


def test_peak_memory_counts_the_engine_weights_once_and_the_run_above_its_baseline(tiny_model):
    from kvbench.devices import cpu_peak_resettable

    s = BenchSettings(prompt_len=[8], new_tokens=4, caches=["none", "static"], engine=["kvbench", "hf"])
    s.warmup, s.repeats = 0, 2
    rows = [r.summary for r in B.run_sweep(tiny_model, s, "fp32", "cpu")]
    weights = sum(p.numel() for p in tiny_model.parameters()) * 4 / 2**20
    for r in rows:
        assert r.weights_mib == pytest.approx(weights), r
        if cpu_peak_resettable():
            assert r.peak_mem_mib == pytest.approx(r.weights_mib + r.run_peak_mib)
            assert 0 <= r.run_peak_mib < 200, r  # a few MiB of activations, not another copy of everything
        assert r.sdpa_prefill and r.sdpa_decode, r  # the backend PyTorch picked, per phase


# --- the run folder, signals, failures ----------------------------------------------------------------------------
TINY_RUN = (
    "--model gpt2-tiny --weights random --device cpu --new-tokens 3 --repeats 1 --warmup 0 --engine kvbench".split()
)


def test_out_holding_a_run_is_refused_unless_forced(tmp_path):
    out = tmp_path / "run"
    result, text = invoke(*TINY_RUN, "--prompt-len", "4", "--caches", "none,dynamic", "--out", str(out))
    assert result.exit_code == 0, text
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result, text = invoke(*TINY_RUN, "--prompt-len", "4", "--caches", "none", "--out", str(out))
    assert result.exit_code == 2, text
    assert "--force" in result.stderr and "already holds" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a refused run changed the folder"
    (out / "notes.txt").write_text("mine")
    result, text = invoke(*TINY_RUN, "--prompt-len", "6", "--caches", "none", "--out", str(out), "--force")
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv")
    assert list(s.prompt_len) == [6] and list(s.cache) == ["none"]  # the new run only, nothing of the old one
    assert (out / "notes.txt").read_text() == "mine"  # --force replaces bench's own files, nothing else


def test_repeated_prompt_lengths_caches_and_engines_run_once(tmp_path):
    out = tmp_path / "run"
    result, text = invoke(
        *TINY_RUN, *"--prompt-len 4,8,4 --caches none,dynamic,none --engine kvbench,kvbench --out".split(), str(out)
    )
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv")
    assert list(zip(s.prompt_len, s.cache, strict=True)) == [(4, "none"), (4, "dynamic"), (8, "none"), (8, "dynamic")]


def test_weights_folder_without_model_takes_the_checkpoints_shape(tmp_path, hf_dir):
    out = tmp_path / "run"
    result, text = invoke(
        "--weights",
        str(hf_dir),
        *"--device cpu --prompt-len 5 --new-tokens 3 --repeats 1 --warmup 0 --caches none,static".split(),
        *"--engine kvbench --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model_config"]["n_layer"] == 3 and meta["model_config"]["n_embd"] == 64  # conftest's TINY
    assert meta["random_weights"] is False and meta["settings"]["model"] is None


def test_device_cpu_alone_with_the_seed_config_picks_fp32():
    from kvbench.devices import resolve_device, resolve_dtype

    s = load_settings("seed", {"device": "cpu"})
    dev = resolve_device(s.device)
    assert resolve_dtype(s.dtype, dev) == torch.float32
    check_sizes(s, sweep_model_config(s), torch.float32, dev)  # gpt2, 512 + 400 tokens: fits


def _interrupt_on_call(monkeypatch, n: int, action):
    """Run `action` from the progress bar's n-th update (a run has just finished)."""
    from kvbench.cli import bench as cli_bench

    calls = {"n": 0}
    real_update = cli_bench._BenchProgress.update

    def update(self, done, total, label):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        real_update(self, done, total, label)

    monkeypatch.setattr(cli_bench._BenchProgress, "update", update)


def _assert_kept_as_interrupted(out: Path, caches: list[str]) -> None:
    s = pd.read_csv(out / "summary.csv")
    assert list(s.cache) == caches and (s.status == "ok").all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["configurations_completed"] == len(caches)
    for png in ("latency.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert not list(out.glob(".*tmp*")), "a temporary file was left behind"


SWEEP_ARGS = ["--prompt-len", "4,8", "--caches", "none,dynamic,static"]


def test_sigterm_leaves_what_ctrl_c_leaves(tmp_path, monkeypatch):
    import signal

    _interrupt_on_call(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "run"
    result, text = invoke(*TINY_RUN, *SWEEP_ARGS, "--out", str(out))
    assert result.exit_code == 128 + signal.SIGTERM, text
    _assert_kept_as_interrupted(out, ["none", "dynamic"])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the command


def test_a_second_ctrl_c_while_writing_does_not_lose_the_rows(tmp_path, monkeypatch):
    import signal

    from kvbench.results import plots

    def first_ctrl_c():
        raise KeyboardInterrupt

    real_write = plots.write_plots

    def impatient_write(*args, **kw):  # the user presses Ctrl-C again (and a SIGTERM arrives) while plots draw
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        return real_write(*args, **kw)

    _interrupt_on_call(monkeypatch, 3, first_ctrl_c)
    monkeypatch.setattr(plots, "write_plots", impatient_write)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN when started in the background
    out = tmp_path / "run"
    result, text = invoke(*TINY_RUN, *SWEEP_ARGS, "--out", str(out))
    assert result.exit_code == 130, text
    _assert_kept_as_interrupted(out, ["none", "dynamic"])
    assert signal.getsignal(signal.SIGINT) is before  # the handler the command found is back


PLUGIN = '''
from kvbench.caches import LayerCache
from kvbench.caches.static import StaticCache


class FailsLate(StaticCache):
    """A static cache that raises once it holds more than 6 tokens."""

    def __init__(self, config, batch, max_len, dtype, device):
        super().__init__(batch, config.n_head, max_len, config.head_dim, dtype, device)

    def update(self, k, v, positions):
        if self.length + k.size(2) > 6:
            raise RuntimeError("boom at token 7")
        return super().update(k, v, positions)
'''


def test_a_plugin_that_raises_mid_sweep_keeps_every_other_row(tmp_path, monkeypatch):
    (tmp_path / "late_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    result, text = invoke(
        *TINY_RUN, *"--prompt-len 2,4 --new-tokens 6 --caches none,late_plugin:FailsLate,static --out".split(), str(out)
    )
    assert result.exit_code == 1, text  # rows recorded, but the run says something failed
    s = pd.read_csv(out / "summary.csv")
    assert len(s) == 6
    failed = s[s.cache == "late_plugin:FailsLate"]
    assert all(st.startswith("error: ") and "boom at token 7" in st for st in failed.status), failed.status
    assert (s[s.cache != "late_plugin:FailsLate"].status == "ok").all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["configurations_failed"] == 2
    assert "failed" in result.stderr and "late_plugin:FailsLate" in result.stderr


def test_plan_runs_the_token_reference_first_then_the_order_given():
    s = BenchSettings(
        prompt_len=[64, 8], caches=["static-graph", "none", "static"], engine=["hf-compiled", "hf", "kvbench"]
    )
    engines = {name: ENGINES[name] for name in s.engine}  # supports() needs no instance
    assert B.plan(s, engines)[:7] == [
        (64, 1, "kvbench", "none"),  # every row's token reference
        (64, 1, "hf-compiled", "static"),
        (64, 1, "hf", "none"),
        (64, 1, "hf", "static"),
        (64, 1, "kvbench", "static-graph"),
        (64, 1, "kvbench", "static"),
        (8, 1, "kvbench", "none"),
    ]
    s.prompt_len, s.batch = [8], [1, 4]  # a batch sweep: each batch size's reference first, as each prompt's
    assert [(p, b, e, c) for p, b, e, c in B.plan(s, engines) if c != "static-graph"][:4] == [
        (8, 1, "kvbench", "none"),
        (8, 1, "hf-compiled", "static"),
        (8, 1, "hf", "none"),
        (8, 1, "hf", "static"),
    ]
    assert B.plan(s, engines)[6] == (8, 4, "kvbench", "none")


def test_token_check_that_cannot_explain_a_flip_says_so():
    from kvbench.bench.agreement import check_tokens

    def rerun():
        raise RuntimeError("CUDA out of memory\nwhile recording logits")

    r = check_tokens([[1, 2]], [[[1, 3]]], lambda d: None, rerun, rtol=1e-5, atol=1e-5)
    assert (r.agreement, r.first_divergence, r.flips, r.near_tie_flips) == (0.5, 1, 1, 0)
    assert r.note == "flips not explained: RuntimeError: CUDA out of memory while recording logits"


# --- --compile: an option, recorded with the run ---------------------------------------------------------------------
@pytest.mark.slow
def test_bench_compile_max_runs_on_the_cpu_and_is_recorded(tmp_path):
    """`--compile max` (frozen weights, kvbench's GEMV and attention as operators) through the whole bench: rows as
    exact as eager ones (token agreement with kvbench's none), the choice in meta.json's settings, and the compiled
    decode's attention named as what ran (the eager probe sees SDPA)."""
    from kvbench.model import gemv

    cfg = hf_config_json(tmp_path / "config.json", n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=512)
    out = tmp_path / "run"
    result, text = invoke(
        "--model",
        str(cfg),
        *"--weights random --device cpu --prompt-len 8 --new-tokens 6 --repeats 1 --warmup 1".split(),
        *"--caches none,static-graph --engine kvbench --compile max --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv")
    assert (s.status == "ok").all() and (s.token_agreement == 1.0).all(), s
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["compile"] == "max"
    # what answered the compiled step's operators: their C++ kernels where a C++ compiler built them, else why not
    from kvbench.model import operators

    built = gemv.library() is not None and operators.compiler() is not None
    assert meta["host"]["cpu_operators"] == ("c++" if built else "python"), meta["host"]
    assert (meta["host"]["cpu_operators_unavailable"] is None) == built
    way = (meta["host"]["cpu_operators_gemv_rows"], meta["host"]["cpu_operators_gemv_prefetch"])
    assert way == (gemv.library().between if gemv.library() is not None else (None, None))
    decode = dict(zip(s.cache, s.sdpa_decode, strict=True))
    assert decode["none"] == "flash (cpu)", decode
    assert decode["static-graph"] == ("kvbench C (cpu)" if gemv.library() is not None else "flash (cpu)"), decode


@pytest.mark.parametrize("mode, cxx", [("max", "false"), ("default", "/no/such/c++")])
def test_bench_compile_without_a_working_cpp_compiler_is_one_line(tmp_path, mode, cxx):
    """Inductor compiles the CPU step with $CXX (read when Inductor is imported: a process of its own here): a
    bench whose $CXX does not work stops before anything runs, in one line, exit 2, and leaves no run folder."""
    argv = [sys.executable, "-m", "kvbench", "bench", "--compile", mode, "--out", str(tmp_path / "r")]
    argv += "--model gpt2-tiny --weights random --device cpu --prompt-len 8 --new-tokens 4 --caches static-graph --engine kvbench".split()
    done = subprocess.run(argv, env={**os.environ, "CXX": cxx}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    said = f"--compile {mode}: Inductor compiles the CPU step with a C++ compiler, and $CXX={cxx!r} does not work"
    assert said in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["1", "fast", "MAX", ""])
def test_bench_compile_bad_values_are_one_line(value, tmp_path):
    result, _ = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 8 --new-tokens 4 --compile".split(),
        value,
        "--out",
        str(tmp_path / "r"),
    )
    assert result.exit_code == 2, result.output
    assert f"--compile {value!r}: use off" in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--caches", "none,dynamic"], "the caches run here (none, dynamic) have none"),
        (["--caches", "static-graph", "--engine", "hf"], "the caches run here (none of kvbench's) have none"),
        (["--fill", "random", "--caches", "dynamic"], "the caches run here (dynamic) have none"),
    ],
)
def test_bench_compile_where_nothing_would_be_compiled_is_refused(args, message, tmp_path):
    result, _ = invoke(
        *"--model gpt2-tiny --weights random --device cpu --prompt-len 8 --new-tokens 4 --compile max".split(),
        *args,
        "--out",
        str(tmp_path / "r"),
    )
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "r").exists()


def test_generate_and_verify_compile_without_a_fixed_step_cache_are_refused():
    for cmd in (["generate", "hi", "--cache", "dynamic"], ["verify", "--caches", "dynamic,static"]):
        r = CliRunner().invoke(app, [*cmd, "-m", "gpt2-tiny", "-w", "random", "-d", "cpu", "--compile", "default"])
        assert r.exit_code == 2 and "nothing would be compiled" in r.stderr, r.output


def test_bench_hf_refuses_compile(tmp_path):
    """--compile runs kvbench's own step; under --hf transformers runs the model, so it would be recorded and do
    nothing."""
    cfg = tmp_path / "llama.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 128,
                "max_position_embeddings": 64,
            }
        )
    )
    result, _ = invoke("--hf", str(cfg), "--device", "cpu", "--compile", "max", "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "--compile max: --compile runs kvbench's own" in result.stderr, result.output
    assert not (tmp_path / "r").exists()


def test_a_sweep_without_kvbench_says_only_token_agreement_stays_empty(tmp_path):
    """speedup_vs_none is each engine family's own `none`, so transformers' rows get it without kvbench; only
    token_agreement, against kvbench's `none`, stays empty, and the note says just that."""
    out = tmp_path / "run"
    result, text = invoke(
        *"--model gpt2-tiny --weights random --prompt-len 8 --new-tokens 3 --repeats 1 --warmup 0".split(),
        *"--engine hf --caches none,dynamic --out".split(),
        str(out),
    )
    assert result.exit_code == 0, text
    s = pd.read_csv(out / "summary.csv").set_index("cache")
    assert s.loc["none", "speedup_vs_none"] == 1 and s.loc["dynamic", "speedup_vs_none"] > 0
    assert s.token_agreement.isna().all()
    assert "token_agreement needs kvbench's `none`" in text and "speedup_vs_none and" not in text
    result, text = invoke(
        *"--model gpt2-tiny --weights random --prompt-len 8 --new-tokens 3 --repeats 1 --warmup 0".split(),
        *"--engine kvbench --caches dynamic --out".split(),
        str(tmp_path / "no-none"),
    )
    assert result.exit_code == 0 and "speedup_vs_none and token_agreement need `none`" in text, text
    assert pd.read_csv(tmp_path / "no-none" / "summary.csv").speedup_vs_none.isna().all()


def test_more_threads_than_cores_is_said(tmp_path):
    from kvbench.host import usable_cpus

    cores, before = usable_cpus() or 1, torch.get_num_threads()
    args = "--model gpt2-tiny --weights random --prompt-len 8 --new-tokens 2 --repeats 1 --warmup 0 --caches dynamic"
    try:
        result, text = invoke(*args.split(), "--threads", str(cores + 1), "--out", str(tmp_path / "over"))
        assert result.exit_code == 0 and f"--threads {cores + 1} is more than the {cores} core(s)" in text, text
        result, text = invoke(*args.split(), "--threads", "1", "--out", str(tmp_path / "one"))
        assert result.exit_code == 0 and "is more than the" not in text, text
    finally:
        torch.set_num_threads(before)  # bench sets the process's threads


def test_paired_reads_only_on_the_cpu(monkeypatch):
    """On CUDA a read's tensor would stay in the caching allocator's pool the rows' reserved memory measures: no
    paired read there (the run's probes stand), nor without a floor."""
    from kvbench.bench import floor

    def refuse(bw, repeats=3):
        raise AssertionError("read off the CPU")

    monkeypatch.setattr(floor, "read_now", refuse)
    for beside in (B._Beside(floor.Bandwidth(3000.0, 2500.0, 1 << 30, "cuda:0")), B._Beside(None)):
        assert math.isnan(beside.before()) and math.isnan(beside.after())


def test_the_floor_caption_explains_only_the_columns_shown():
    """x paired is explained where a row has it; no floor sentence at all where no row has a floor (--hf models)."""
    from types import SimpleNamespace

    from kvbench.cli.bench_render import floor_caption

    bw = {"read_gbps": 30.0, "copy_gbps": 20.0, "nbytes": 1 << 29, "llc_bytes": None}
    meta = {"floor": {"bandwidth": bw}}

    def row(x_floor: float, **more: float) -> SimpleNamespace:
        return SimpleNamespace(x_floor=x_floor, step_bytes=1e9, **more)

    assert "x paired" in floor_caption(meta, [row(1.2, x_floor_paired=1.1)])
    context_rows = [row(1.2)]  # --fill random's rows: no paired floor
    assert "x floor = TPOT / floor" in floor_caption(meta, context_rows)
    assert "x paired" not in floor_caption(meta, context_rows)
    assert floor_caption(meta, [row(math.nan, x_floor_paired=math.nan)]) == ""
