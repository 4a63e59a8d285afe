"""`kvbench bench --tp N` (bench/tp.py): what cannot run split is refused before any rank starts; a valid command
launches its ranks with its own command line; real launches of two ranks (slow tier) write rank 0's run folder with
tp.csv, each rank's cache bytes equal to the planner's to the byte, for our GPT-2 and a Hugging Face model split by
transformers' own plan."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.cli import app
from tiny import SHAPE

TINY = ["-m", "gpt2-tiny", "-w", "random"]
RUN = ["-d", "cpu", "--prompt-len", "12", "-n", "8"]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Tiny Llama checkpoints saved with save_pretrained: 2 key/value heads (splits over 2 ranks) and 1 (does not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bench-tp")
    common = dict(SHAPE, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    for name, kv in (("llama", 2), ("llama-kv1", 1)):
        LlamaForCausalLM(LlamaConfig(num_key_value_heads=kv, **common)).save_pretrained(root / name)
    return root


def _toml(text: str):
    def write(tmp):
        (tmp / "sweep.toml").write_text(text)
        return str(tmp / "sweep.toml")

    return write


REFUSED = [
    ("heads", ["--tp", "3"], "4 attention heads do not divide over 3 ranks"),
    ("zero", ["--tp", "0"], "--tp must be >= 1"),
    ("timeout", ["--tp", "2", "--tp-timeout", "0"], "--tp-timeout must be >= 1"),
    ("engine-hf", ["--tp", "2", "--engine", "kvbench,hf"], "--engine hf with --tp 2: transformers' engines cannot"),
    ("engine-peer", ["--tp", "2", "--engine", "kvbench,ct2-fp32"], "--engine ct2-fp32 with --tp 2: a peer engine"),
    ("fill-random", ["--tp", "2", "--fill", "random"], "--fill random with --tp 2"),
    ("interleaved", ["--tp", "2", "--order", "interleaved"], "--order interleaved with --tp 2"),
    ("profile", ["--tp", "2", "--profile"], "--profile with --tp 2"),
    ("compile", ["--tp", "2", "--compile", "default", "--caches", "static-graph"], "--compile default with --tp 2"),
    ("config-tp", ["--config", _toml("tp = 2.5\n")], "tp must be an integer, got 2.5"),
    ("config-timeout", ["--config", _toml('tp_timeout = "soon"\n')], "tp_timeout must be a number"),
    ("config-engine", ["--config", _toml('tp = 2\nengine = ["hf"]\n')], "transformers' engines cannot split"),
    ("hf-kv-heads", ["--hf", "llama-kv1", "--tp", "2"], "1 key/value heads do not divide over 2 ranks"),
    ("hf-compiled", ["--hf", "llama", "--tp", "2", "--caches", "static,static-compiled"], "static-compiled with --tp"),
]


@pytest.mark.parametrize("args, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_cannot_run_split_is_refused_before_any_rank_starts(llamas, tmp_path, monkeypatch, args, message):
    from kvbench import launcher

    monkeypatch.setattr(launcher, "launch", lambda *a: pytest.fail("ranks were launched"))
    monkeypatch.chdir(tmp_path)
    args = [a(tmp_path) if callable(a) else str(llamas / a) if a.startswith("llama") else a for a in args]
    model = [] if "--hf" in args else TINY  # --hf takes no --model, --weights
    r = CliRunner().invoke(app, ["bench", *model, *RUN, *args])
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "results").exists()


def test_a_valid_command_launches_its_ranks_with_its_own_command_line(tmp_path, monkeypatch):
    from kvbench import launcher

    launched = []
    monkeypatch.setattr(launcher, "launch", lambda world, argv: launched.append((world, argv)) or 0)
    monkeypatch.setattr(sys, "argv", ["kvbench", "bench", "--tp", "2", *TINY, *RUN, "--out", str(tmp_path / "run")])
    r = CliRunner().invoke(app, sys.argv[1:])
    assert r.exit_code == 0, r.output
    assert launched == [(2, sys.argv[1:])]
    assert not (tmp_path / "run").exists()  # rank 0 makes the run folder, not the launcher


def test_under_tp_the_defaults_leave_out_what_cannot_split(llamas):
    from kvbench.bench.hf_sweep import hf_bench_settings
    from kvbench.bench.settings import load_settings

    assert load_settings(None, {"tp": 2}).engine == ["kvbench"]  # transformers cannot split GPT-2
    assert load_settings(None, {}).engine == ["kvbench", "hf"]
    assert "static-compiled" not in hf_bench_settings(None, {"tp": 2}).caches


# --- real launches: the slow tier --------------------------------------------------------------------------------------
def kvbench(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVBENCH_PROBE_BYTES": str(16 << 20)}
    cmd = [sys.executable, "-m", "kvbench", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _rows(run, doc: dict, caches: list[str]) -> pd.DataFrame:
    """tp.csv, checked against the --json document's `tp`: a row per configuration and rank, rank 0's first; the
    document and meta.json follow the bench schema."""
    import jsonschema

    from kvbench.jsonio import load_schema

    for checked in (doc, json.loads((run / "meta.json").read_text())):
        jsonschema.Draft202012Validator(load_schema("bench")).validate(checked)
    tp = pd.read_csv(run / "tp.csv")
    assert list(zip(tp["cache"], tp["rank"], strict=True)) == [(c, r) for c in caches for r in (0, 1)]
    numbers = ["rank", "kv_slots", "kv_cache_bytes", "planned_kv_cache_bytes", "collective_calls"]
    pd.testing.assert_frame_equal(pd.DataFrame(doc["tp"])[numbers], tp[numbers], check_dtype=False)
    assert (tp["ranks"] == 2).all() and (tp["backend"] == "gloo").all()
    assert tp["timing"].str.startswith("not a speed measurement").all()  # gloo on a CPU says so in every row
    assert ((tp["collective_share"] > 0) & (tp["collective_share"] < 1)).all(), tp["collective_share"]
    return tp


@pytest.mark.slow
def test_bench_tp2_writes_rank_0s_run_with_each_ranks_bytes_equal_to_the_planners(tmp_path):
    run = tmp_path / "run"
    once = ["--repeats", 1, "--warmup", 0, "--out", run, "--json"]
    r = kvbench("bench", "--tp", 2, *TINY, *RUN, "--caches", "dynamic,static", *once)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # rank 0 alone prints: one document
    assert doc["meta"]["tp"]["ranks"] == 2 and doc["meta"]["tp"]["backend"] == "gloo"
    assert doc["meta"]["settings"]["tp"] == 2 and doc["meta"]["settings"]["engine"] == ["kvbench"]
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["summary.csv", "steps.csv", "ttft.csv", "meta.json", "tp.csv", "latency.png", "speedup.png"]
    )
    summary = pd.read_csv(run / "summary.csv")
    assert list(summary["cache"]) == ["dynamic", "static"] and (summary["status"] == "ok").all()
    assert summary["floor_ms"].isna().all()  # no floor under tensor parallelism
    tp = _rows(run, doc, ["dynamic", "static"])
    # 2 layers x K and V x 2 of 4 heads x 32 x 4 B per slot: 19 slots grown (12 + 8 - 1), 20 preallocated
    assert list(tp["kv_slots"]) == [19, 19, 20, 20]
    assert (tp["kv_cache_bytes"] == tp["planned_kv_cache_bytes"]).all() and tp["planned_equal"].all()
    assert list(tp["kv_cache_bytes"]) == [2 * 2 * 2 * 32 * 4 * n for n in (19, 19, 20, 20)]
    assert (tp["collective_calls"] == 8 * 2 * 2).all()  # 8 forwards x 2 layers x 2 row-parallel all-reduces
    compared = kvbench("compare", run, run)  # two tensor-parallel runs compare, warned that gloo measures no speed
    assert compared.returncode == 0, compared.stderr
    assert "not a speed measurement" in compared.stderr


@pytest.mark.slow
def test_bench_hf_tp2_splits_by_transformers_plan(llamas, tmp_path):
    run = tmp_path / "run"
    once = ["--repeats", 1, "--warmup", 0, "--out", run, "--json"]
    r = kvbench("bench", "--hf", llamas / "llama", "--tp", 2, *RUN, "--caches", "none,dynamic,static", *once)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["meta"]["tp"]["split"].startswith("transformers' tensor-parallel plan")
    assert [s["token_agreement"] for s in doc["summary"]] == [1.0, 1.0, 1.0]
    tp = _rows(run, doc, ["none", "dynamic", "static"])
    cached = tp[tp["cache"] != "none"]
    # 2 layers x K and V x 1 of 2 key/value heads x 16 x 4 B per slot
    assert (cached["kv_cache_bytes"] == 2 * 2 * 1 * 16 * 4 * cached["kv_slots"]).all()
    assert (cached["kv_cache_bytes"] == cached["planned_kv_cache_bytes"]).all()
    assert tp.loc[tp["cache"] == "none", "kv_cache_bytes"].isna().all()
    # the row-parallel layers' all-reduces (2 per layer) and the embedding's and lm_head's collectives, per forward
    assert (tp["collective_calls"] > 8 * 2 * 2).all()
