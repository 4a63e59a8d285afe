"""`kvbench memory`'s decode floor, --bandwidth, --batch lists and --model as a directory, a config.json or a hub
id. The floor is checked against bytes worked out here from the model's shape and the bandwidth read from gpus.toml
by hand, and against what `kvbench bench` calls a step's bytes (bench/floor.py)."""

from __future__ import annotations

import json

import pytest
import tomllib
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.memory.presets import GPUS_TOML, MODELS_TOML
from kvbench.memory.spec import parse_bandwidth

runner = CliRunner()


def run_json(*args):
    r = runner.invoke(app, ["memory", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_floor_llama3_8b_h100_by_hand():
    gpus, models = tomllib.loads(GPUS_TOML.read_text()), tomllib.loads(MODELS_TOML.read_text())
    text = gpus["h100-80gb"]["bandwidth"]
    assert text == "3.35TB/s"
    bw = 3.35e12  # decimal terabytes per second, as the datasheet prints it
    m = models["llama-3-8b"]
    per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2  # K and V, fp16
    assert per_token == 131_072
    weights = m["params"] * 2  # bf16
    doc = run_json("-m", "llama-3-8b", "--gpu", "h100", "--ctx", "8k,32k", "--batch", "1,16")
    assert doc["batches"] == [1, 16] and doc["bandwidth"]["bytes_per_s"] == 3_350_000_000_000
    rows = doc["plans"][0]["rows"]
    assert [(r["ctx"], r["batch"]) for r in rows] == [(8192, 1), (32768, 1), (8192, 16), (32768, 16)]
    for r in rows:
        b, ctx, f = r["batch"], r["ctx"], r["decode_floor"]
        step = weights + b * ctx * per_token + b * per_token  # weights, K/V read at ctx, this token's K/V write
        assert f["step_bytes"] == step
        assert f["floor_ms"] == pytest.approx(1e3 * step / bw, rel=1e-12)
        assert f["tokens_per_s"] == pytest.approx(b * bw / step, rel=1e-12)
        assert f["tokens_per_s_per_sequence"] == pytest.approx(bw / step, rel=1e-12)
        assert f"= {step:,} B" in f["working"] and f"{1e3 * step / bw:.4g} ms per step" in f["working"]


def test_floor_terms_are_bench_step_bytes_for_gpt2():
    """The planner's step for gpt2 (fp16) against bench's StepBytes for the same model, batch and context: K/V read
    and write agree to the byte; the weights differ by exactly the embedding rows: the planner counts every parameter
    once (all of wpe), bench the rows of wte and wpe this step's tokens use (wte is read whole as the tied lm_head)."""
    import torch

    from kvbench.bench.floor import step_bytes
    from kvbench.model.gpt2 import PRESETS

    cfg, batch, ctx = PRESETS["gpt2"], 4, 1000
    bench = step_bytes(cfg, torch.float16, batch, ctx, ctx, None)
    doc = run_json("-m", "gpt2", "--ctx", ctx, "--batch", batch, "--weights-dtype", "fp16", "--bandwidth", "1TB/s")
    f = doc["plans"][0]["rows"][0]["decode_floor"]
    assert f["kv_read_bytes"] == bench.kv and f["kv_write_bytes"] == bench.kv_write
    # the planner reads all of wpe; bench reads the batch's rows of wte and wpe on top of the tied wte/lm_head
    assert f["weights_bytes"] - bench.weights == 2 * (cfg.block_size - 2 * batch) * cfg.n_embd
    assert f["floor_ms"] == pytest.approx(1e3 * f["step_bytes"] / 1e12)


@pytest.mark.parametrize(
    "text, value",
    [
        ("3.35TB/s", 3_350_000_000_000),
        ("3350GB/s", 3_350_000_000_000),
        ("900 GB/s", 900 * 10**9),
        ("2TiB/s", 2 * 2**40),
        ("0.5 tb/s", 5 * 10**11),
    ],
)
def test_parse_bandwidth(text, value):
    assert parse_bandwidth(text) == value


@pytest.mark.parametrize(
    "value, message",
    [
        ("fast", "cannot read --bandwidth 'fast'"),
        ("0TB/s", "must be positive"),
        ("-1TB/s", "must be positive"),
        ("nan", "cannot read --bandwidth 'nan'"),
        ("nanTB/s", "cannot read"),
        ("3.35", "cannot read"),
        ("2PB/s", "more than 1 PB/s"),
    ],
)
def test_bad_bandwidth_is_one_line_exit_2(value, message):
    r = runner.invoke(app, ["memory", "-m", "llama-3-8b", "--ctx", "8k", "--bandwidth", value])
    assert r.exit_code == 2, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_bandwidth_alone_and_over_a_gpu():
    alone = run_json("-m", "llama-3-8b", "--ctx", "8k", "--bandwidth", "2TB/s")
    assert alone["bandwidth"]["name"] == "custom" and alone["plans"][0]["gpu"] is None
    over = run_json("-m", "llama-3-8b", "--ctx", "8k", "--gpu", "h100", "--bandwidth", "2TB/s")
    assert over["bandwidth"]["bytes_per_s"] == 2 * 10**12 and over["plans"][0]["gpu"]["name"] == "h100-80gb"
    assert over["plans"][0]["rows"][0]["decode_floor"] == alone["plans"][0]["rows"][0]["decode_floor"]
    none = run_json("-m", "llama-3-8b", "--ctx", "8k")
    assert "bandwidth" not in none and none["plans"][0]["rows"][0]["decode_floor"] is None
    assert none["batch"] == 1 and none["batches"] == [1]  # the old key keeps its value


def test_table_shows_floor_and_working():
    r = runner.invoke(
        app, ["memory", "-m", "llama-3-8b", "--gpu", "h100", "--ctx", "8k", "--batch", "1,16"], env={"COLUMNS": "250"}
    )
    assert r.exit_code == 0, r.output
    assert "floor/step" in r.stdout and "tok/s/seq" in r.stdout  # the table's floor columns, and what they mean:
    assert "floor/step: the decode floor of one step; tok/s/seq: tokens/s per sequence" in r.stdout
    assert "decode floor at 8k x 16: (weights 16,060,522,496 B + K/V read 17,179,869,184 B" in r.stdout


def test_json_working_is_the_text_the_table_prints():
    """--json carries the working under `working` (the plan's, its GPU budget's, each row's and each row's decode
    floor's): the same lines the terminal prints under the table, from the same numbers."""
    args = "-m llama-3-8b --gpu h100 --ctx 8k,1m --batch 1,16 --tp 2 --overhead 5%".split()
    r = runner.invoke(app, ["memory", *args], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    p = run_json(*args)["plans"][0]
    lines = [*p["working"], p["gpu"]["working"]]
    for row in p["rows"]:
        lines += [*row["working"], row["decode_floor"]["working"]]
    # the plan: per token, per GPU, weights, GPU budget, floor; a row: per sequence, (batch), per GPU, fits, floor
    assert len(p["working"]) == 5 and [len(row["working"]) for row in p["rows"]] == [4, 4, 5, 5]
    for line in lines:
        assert line.strip() in r.stdout, line


def test_model_as_directory_config_path_and_offline_hub_id(tmp_path, monkeypatch):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        vocab_size=1000,
    )
    cfg.save_pretrained(tmp_path)
    per_token = 2 * 3 * 2 * 32 * 2
    for target in (tmp_path, tmp_path / "config.json"):
        doc = run_json("-m", target, "--ctx", "1k")
        assert doc["plans"][0]["bytes_per_token"] == per_token
        assert doc["plans"][0]["rows"][0]["bytes_per_seq"] == per_token * 1024
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = runner.invoke(app, ["memory", "-m", "kvbench-test-nobody/no-such-model", "--ctx", "1k"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "kvbench-test-nobody/no-such-model" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_batch_list_errors():
    for args, message in [
        (["--batch", "1,x"], "cannot read --batch '1,x'"),
        (["--batch", "1,0"], "--batch 0 must be from 1"),
        (["--all", "--batch", "1,2"], "take one --batch"),
    ]:
        argv = ["memory", *(["-m", "llama-3-8b"] if "--all" not in args else []), *args]
        r = runner.invoke(app, argv)
        assert r.exit_code == 2 and message in r.stderr, r.stderr
