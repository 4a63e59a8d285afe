"""kvbench bench: the sweep through the CLI writes every file with sane values; interrupts, OOM, bad input;
the dynamic cache's copy traffic against its closed form; transformers' engine on the same weights."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench import bench as B
from kvbench.caches import CACHES
from kvbench.caches.dynamic import DynamicCache
from kvbench.cli import app
from kvbench.generation import generate
from kvbench.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
ISSUE_COLUMNS = (
    "engine cache prompt_len new_tokens batch dtype device ttft_ms tpot_ms_median tpot_ms_p90 total_s tokens_per_s "
    "speedup_vs_none peak_mem_mib kv_cache_mib bytes_copied repeats"
).split()

# A small model whose full-sequence forward at a long prompt clearly outweighs one cached step, so `none` is
# several times slower than any cache even on a loaded 2-core machine (about 5x end to end at prompt 256).
SWEEP_MODEL = dict(n_layer=2, n_head=4, n_embd=256, n_positions=512, vocab_size=2000)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared, oversubscribed 2-core machine torch's default of 2 spinning OpenMP threads
    makes a step 10-100x slower and the timings erratic; one thread keeps these timing-based checks fast and stable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    assert r.bytes_copied == expected == B.exact_copy_bytes(bpt, n0, n1)
    assert r.cache_bytes == bpt * n1
    # The seed's (n1^2 - n0^2)/2 overestimates by exactly bytes/token x (n1 - n0)/2.
    assert B.seed_copy_estimate(bpt, n0, n1) - B.exact_copy_bytes(bpt, n0, n1) == bpt * (n1 - n0) / 2


def test_copy_traffic_on_raw_tensors():
    c = DynamicCache()
    k = torch.zeros(1, 2, 5, 4)
    c.update(k, k, None)  # first write copies nothing
    for _ in range(3):
        c.update(k[:, :, :1], k[:, :, :1], None)
    per_token = 2 * 2 * 4 * 4  # K and V, 2 heads x 4 dims x 4 bytes
    assert c.bytes_copied == B.exact_copy_bytes(per_token, 5, 8) == per_token * (5 + 6 + 7)


# --- the whole sweep through the CLI ------------------------------------------------------------------------------
def test_cli_sweep_writes_all_files_with_sane_values(tmp_path, sweep_model):
    cfg_file = tmp_path / "sweep.toml"
    cfg_file.write_text('prompt_len = [8, 256]\nnew_tokens = 99\nrepeats = 5\ncaches = "none"\n')
    out = tmp_path / "run"
    new, repeats = 6, 2  # the command line overrides the file's 99 and 5
    result, text = invoke(
        "--config", str(cfg_file), "--model", str(sweep_model), "--weights", "random", "--device", "cpu",
        "--new-tokens", str(new), "--repeats", str(repeats), "--warmup", "1", "--caches", "none,dynamic,static",
        "--engine", "kvbench,hf", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, text
    for name in ("summary.csv", "steps.csv", "meta.json", "latency.png", "speedup.png"):
        assert (out / name).is_file(), f"{name} missing: {text}"
    for png in ("latency.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    s = pd.read_csv(out / "summary.csv")
    assert set(ISSUE_COLUMNS) <= set(s.columns)
    assert len(s) == 2 * (3 + 3)  # prompt lengths x (kvbench none/dynamic/static + hf none/dynamic/static)
    assert (s.status == "ok").all()
    assert (s.new_tokens == new).all() and (s.repeats == repeats).all() and (s.dtype == "fp32").all()
    assert (s.ttft_ms > 0).all() and (s.tpot_ms_median > 0).all()
    assert (s.tpot_ms_p90 >= s.tpot_ms_median).all()
    assert (s.total_s >= s.ttft_ms / 1e3).all()
    assert ((s.tokens_per_s - new / s.total_s).abs() < 1e-3 * s.tokens_per_s).all()
    assert (s[s.cache == "none"].speedup_vs_none == 1.0).all()
    long = s[(s.prompt_len == 256) & (s.cache != "none")]
    assert (long.speedup_vs_none > 1.0).all(), long[["engine", "cache", "total_s", "speedup_vs_none"]]

    ours = s[s.engine == "kvbench"].set_index(["cache", "prompt_len"])
    bpt = 2 * SWEEP_MODEL["n_layer"] * SWEEP_MODEL["n_embd"] * 4
    for p in (8, 256):
        n1 = p + new - 1
        assert ours.loc[("none", p), "kv_cache_mib"] == 0
        assert ours.loc[("dynamic", p), "kv_cache_mib"] == pytest.approx(bpt * n1 / 2**20, rel=1e-5)
        assert ours.loc[("static", p), "kv_cache_mib"] == pytest.approx(bpt * (p + new) / 2**20, rel=1e-5)
        assert ours.loc[("dynamic", p), "bytes_copied"] == B.exact_copy_bytes(bpt, p, n1)
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
    for key in ("command", "git", "versions", "device_name", "settings"):
        assert key in meta, key
    assert meta["settings"]["new_tokens"] == new and meta["config_file"] == str(cfg_file)


def test_json_output_is_one_document(tmp_path):
    result, text = invoke(
        "--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--prompt-len", "4",
        "--new-tokens", "3", "--repeats", "1", "--warmup", "0", "--caches", "none,dynamic", "--engine", "kvbench",
        "--out", str(tmp_path / "j"), "--json",
    )  # fmt: skip
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
        "--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--prompt-len", "4,8",
        "--new-tokens", "3", "--repeats", "1", "--warmup", "0", "--caches", "none,dynamic,static",
        "--engine", "kvbench", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 130, text
    s = pd.read_csv(out / "summary.csv")
    assert list(s.cache) == ["none", "dynamic"] and (s.status == "ok").all()
    assert len(pd.read_csv(out / "steps.csv")) == 2 * 1 * 2
    assert json.loads((out / "meta.json").read_text())["status"] == "interrupted"
    assert not list(out.glob(".*tmp*")), "a temporary file was left behind"


def test_cuda_oom_marks_the_row_and_the_sweep_goes_on(tiny_model):
    real_run = B.KVBenchEngine.run

    class OOMOnDynamic(B.KVBenchEngine):
        def run(self, ids, new_tokens, cache):
            if cache == "dynamic":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return real_run(self, ids, new_tokens, cache)

    s = B.BenchSettings(
        prompt_len=[4, 6], new_tokens=3, caches=["none", "dynamic", "static"], engine=["kvbench"]
    )
    s.repeats, s.warmup = 1, 1
    seen = []
    rows = B.run_sweep(
        tiny_model, s, "fp32", "cpu", on_result=seen.append, engines={"kvbench": OOMOnDynamic(tiny_model)}
    )
    status = {(r.summary.cache, r.summary.prompt_len): r.summary.status for r in rows}
    assert status == {(c, p): ("oom" if c == "dynamic" else "ok") for c in s.caches for p in (4, 6)}
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
        "--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--prompt-len", "16,700,1000",
        "--new-tokens", "400", "--out", str(out),
    )  # fmt: skip
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
    s = B.load_settings(ROOT / "configs" / "bench" / name, {})
    assert s.caches == list(CACHES)  # every registered cache
    assert s.engine == ["kvbench", "hf"]
    if name == "seed.toml":
        assert (s.prompt_len, s.new_tokens, s.dtype, s.device) == ([16, 128, 512], 400, "auto", "auto")


@pytest.mark.parametrize("name", ["seed", "quick"])
def test_bench_config_by_name(name):
    """`--config seed` finds the sweep shipped in the package, the same file as configs/bench/seed.toml."""
    assert B.load_settings(name, {}) == B.load_settings(ROOT / "configs" / "bench" / f"{name}.toml", {})


# --- transformers' engine ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_hf_engine_runs_the_same_weights_for_exactly_n_tokens(tiny_model, cache):
    from kvbench.hf_engine import build_hf_model, hf_generate

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
