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


def test_moe_floor_reads_the_experts_a_step_routes_to_deepseek_v3_by_hand():
    """DeepSeek-V3 (256 routed experts, top-8, 58 MoE layers of 3 x 7168 x 2048 per expert): at batch 1 a step
    reads about 37.5B of its 671B parameters, so the floor on an H200 at tp 8 is about 2 ms, not 35 ms; at batch
    32 (32 x 8 = 256) every expert is read. The working names the experts and the parameters."""
    m = tomllib.loads(MODELS_TOML.read_text())["deepseek-v3"]
    assert (m["experts"], m["experts_per_token"], m["moe_layers"], m["moe_intermediate"]) == (256, 8, 58, 2048)
    expert = 3 * 7168 * 2048 * 58
    active = 671_000_000_000 - 248 * expert
    assert active == 37_525_878_272  # the published "37B activated"
    doc = run_json("-m", "deepseek-v3", "--gpu", "h200", "--tp", 8, "--ctx", "8k", "--batch", "1,4,32,64")
    rows = doc["plans"][0]["rows"]
    for r, read in zip(rows, (8, 32, 256, 256), strict=True):
        f = r["decode_floor"]
        params = 671_000_000_000 - (256 - read) * expert
        assert f["experts_read"] == read and f["weights_bytes"] == -(-params * 2 // 8), (r["batch"], f)
        assert f"reads {read} of 256 routed experts per MoE layer" in f["working"], f["working"]
        assert f"= {params:,} params read" in f["working"]
    assert rows[0]["decode_floor"]["floor_ms"] == pytest.approx(2.074, abs=1e-3)
    assert (
        "every expert" in rows[2]["decode_floor"]["working"]
        and "every expert" not in rows[1]["decode_floor"]["working"]
    )
    assert "every expert from batch 32" in " ".join(doc["plans"][0]["working"])


def test_moe_floor_from_a_config_json_equals_the_preset_s_and_dense_models_read_every_weight(tmp_path):
    """Mixtral's config.json (num_local_experts 8, num_experts_per_tok 2) gives the preset's floor; a config
    whose tokens each take every expert, and a dense model, read every parameter each step."""
    cfg = {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = ("--gpu", "h200", "--ctx", "8k", "--batch", "1,2,4")
    floors = [r["decode_floor"] for r in run_json("--config", path, *args)["plans"][0]["rows"]]
    preset = [r["decode_floor"] for r in run_json("-m", "mixtral-8x7b", *args)["plans"][0]["rows"]]
    assert [f["weights_bytes"] for f in floors] == [f["weights_bytes"] for f in preset]
    assert [f["experts_read"] for f in floors] == [2, 4, 8]
    assert floors[0]["weights_bytes"] == 2 * (46_702_792_704 - 6 * 3 * 4096 * 14336 * 32)
    cfg["num_experts_per_tok"] = 8
    path.write_text(json.dumps(cfg))
    f = run_json("--config", path, *args)["plans"][0]["rows"][0]["decode_floor"]
    assert f["weights_bytes"] == 2 * 46_702_792_704 and f["experts_read"] is None
    f = run_json("-m", "llama-3-8b", *args)["plans"][0]["rows"][0]["decode_floor"]
    assert f["experts_read"] is None and "MoE" not in f["working"]


def test_a_moe_preset_needs_its_routing_whole(tmp_path):
    from kvbench.errors import KVBenchError
    from kvbench.memory.presets import load_presets

    text = MODELS_TOML.read_text()
    broken = text.replace("experts_per_token = 8\nmoe_layers = 58\n", "moe_layers = 58\n", 1)
    assert broken != text
    (tmp_path / "m.toml").write_text(broken)
    with pytest.raises(KVBenchError, match="needs all of experts, experts_per_token, moe_layers, moe_intermediate"):
        load_presets(tmp_path / "m.toml")
