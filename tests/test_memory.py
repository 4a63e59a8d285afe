"""`kvbench memory`: the planner's arithmetic against the seed's figures and hand-worked numbers, config.json files
written by transformers' own config classes, tensor parallelism, GPU fits, copy traffic, and --measure on the CPU.

Every expected value below is worked out in the test from the model's published shape, never read back from the
planner.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # a test never reaches the network

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.cli.memory_working import plan_lines, plan_warnings, row_lines
from kvbench.errors import KVBenchError
from kvbench.memory.config import resolve_config
from kvbench.memory.formulas import bytes_per_sequence, copy_traffic
from kvbench.memory.planner import max_context, plan
from kvbench.memory.presets import get_gpu, get_model, load_gpus, load_presets
from kvbench.memory.spec import KV_FORMATS, ModelSpec
from kvbench.memory.units import MAX_TOKENS, fmt_bytes, parse_bytes, parse_ctx

KiB, MiB, GiB = 2**10, 2**20, 2**30
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def presets():
    return load_presets()


def run(*args):
    return runner.invoke(app, ["memory", *[str(a) for a in args]])


def per_seq(presets, name, ctx, **kw):
    return plan(presets[name], [ctx], **kw).rows[0]


# --- the seed's table ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, layers, kv_heads, head_dim, kib",
    [
        ("gpt2", 12, 12, 64, 36),
        ("llama-2-7b", 32, 32, 128, 512),
        ("llama-3-8b", 32, 8, 128, 128),
        ("llama-3-70b", 80, 8, 128, 320),
    ],
)
def test_seed_bytes_per_token(presets, name, layers, kv_heads, head_dim, kib):
    p = plan(presets[name], [1])
    assert p.bytes_per_token == 2 * layers * kv_heads * head_dim * 2 == kib * KiB


def test_seed_llama3_8b_contexts_and_batch(presets):
    p = plan(presets["llama-3-8b"], [8 * 1024, 128 * 1024], batch=32)
    at8k, at128k = p.rows
    assert at8k.bytes_per_seq == 1 * GiB  # 128 KiB x 8192
    assert at128k.bytes_per_seq == 16 * GiB  # 128 KiB x 131072
    assert at128k.bytes_batch == 512 * GiB  # x 32 sequences
    assert fmt_bytes(at128k.bytes_per_seq) == "16 GiB" and fmt_bytes(p.bytes_per_token) == "128 KiB"
    assert "2 (K and V) x 32 layers x 8 kv_heads x 128 head_dim x 2 B (fp16) = 131,072 B = 128 KiB" in plan_lines(p)[0]


def test_seed_llama3_70b_contexts(presets):
    rows = plan(presets["llama-3-70b"], [8 * 1024, 128 * 1024]).rows
    assert [r.bytes_per_seq for r in rows] == [int(2.5 * GiB), 40 * GiB]


# --- the three ways public calculators go wrong -------------------------------------------------------------------
def test_gemma2_9b_head_dim_and_sliding_layers(presets):
    g = presets["gemma-2-9b"]
    assert g.head_dim == 256 and g.hidden_size // g.n_heads == 224  # the wrong guess a calculator makes
    assert len(g.sliding_layers) == 21 and g.sliding_layers == tuple(range(0, 42, 2)) and g.sliding_window == 4096
    per_layer_token = 2 * 8 * 256 * 2
    for ctx in (2048, 8192, 32768):
        expected = per_layer_token * (21 * ctx + 21 * min(ctx, 4096))
        row = per_seq(presets, "gemma-2-9b", ctx)
        assert row.bytes_per_seq == expected
        assert row.windowed == (ctx > 4096)


def test_llama3_8b_uses_kv_heads_not_query_heads(presets):
    wrong = 2 * 32 * 32 * 128 * 2  # what ignoring GQA would give: 512 KiB
    assert plan(presets["llama-3-8b"], [1]).bytes_per_token * 4 == wrong


def test_deepseek_v3_mla_latent(presets):
    p = plan(presets["deepseek-v3"], [1024])
    assert p.bytes_per_token == (512 + 64) * 61 * 2  # one latent per token per layer, no factor 2, no heads
    assert p.rows[0].bytes_per_seq == (512 + 64) * 61 * 2 * 1024
    assert plan(presets["deepseek-v2"], [1]).bytes_per_token == (512 + 64) * 60 * 2


def test_falcon_7b_multi_query(presets):
    assert presets["falcon-7b"].n_kv_heads == 1
    assert plan(presets["falcon-7b"], [1]).bytes_per_token == 2 * 32 * 1 * 64 * 2 == 8 * KiB


def test_mistral_versions_and_phi3_window(presets):
    v1, v3 = presets["mistral-7b-v0.1"], presets["mistral-7b-v0.3"]
    assert v1.sliding_window == 4096 and len(v1.sliding_layers) == 32 and not v3.sliding_layers
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_seq(presets, "mistral-7b-v0.1", 32768).bytes_per_seq == per_token * 4096
    assert per_seq(presets, "mistral-7b-v0.3", 32768).bytes_per_seq == per_token * 32768
    assert per_seq(presets, "phi-3-mini", 4096).bytes_per_seq == 2 * 32 * 32 * 96 * 2 * 2047


def test_every_preset_cites_a_source_and_is_positive(presets):
    assert len(presets) >= 21
    for name, s in presets.items():
        assert "/" in s.source, name  # a Hugging Face repo id
        assert s.n_heads % s.n_kv_heads == 0, name
        assert s.params and s.max_context, name


def test_gpt2_presets_match_the_model(presets):
    from kvbench.model.gpt2 import PRESETS

    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        c, s = PRESETS[name], presets[name]
        assert (s.n_layers, s.n_heads, s.head_dim, s.max_context) == (
            c.n_layer,
            c.n_head,
            c.head_dim,
            c.block_size,
        )
        assert plan(s, [1]).bytes_per_token == c.kv_bytes_per_token(2)


# --- quantized caches ---------------------------------------------------------------------------------------------
def test_quantized_cache_scale_overhead(presets):
    s = presets["llama-3-8b"]
    vectors = 2 * 32 * 8  # K and V, 32 layers, 8 KV heads: 128-element vectors
    assert plan(s, [1], kv_dtype="fp8").bytes_per_token == vectors * 128
    assert plan(s, [1], kv_dtype="int8").bytes_per_token == vectors * (128 + 2 * 2)  # 2 groups, fp16 scale
    assert plan(s, [1], kv_dtype="int4").bytes_per_token == vectors * (64 + 2 * 4)  # scale + zero point
    assert plan(s, [1], kv_dtype="fp32").bytes_per_token == vectors * 128 * 4


# --- tensor parallelism -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, heads_per_gpu", [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1), (32, 1)])
def test_tp_splits_then_replicates_kv_heads(presets, tp, heads_per_gpu):
    p = plan(presets["llama-3-8b"], [1024], tp=tp)
    assert p.kv_heads_per_gpu == heads_per_gpu
    assert p.rows[0].bytes_per_gpu == 2 * 32 * heads_per_gpu * 128 * 2 * 1024
    if tp > 8:
        assert any("replicated" in w for w in plan_lines(p))


def test_tp_errors_and_mla(presets):
    with pytest.raises(KVBenchError, match="not divisible by 3"):
        plan(presets["llama-3-8b"], [1], tp=3)
    with pytest.raises(KVBenchError, match="71 attention heads"):
        plan(presets["falcon-7b"], [1], tp=2)
    p = plan(presets["deepseek-v3"], [1000], tp=8)  # the latent is shared by all heads: every rank holds it
    assert p.rows[0].bytes_per_gpu == (512 + 64) * 61 * 2 * 1000
    assert any("cannot split" in w for w in plan_lines(p))


# --- GPU fits -----------------------------------------------------------------------------------------------------
def test_fit_on_h100(presets):
    gpu = get_gpu("h100")
    memory = 81559 * MiB
    assert gpu.memory == memory
    weights = 8_030_261_248 * 2
    available = memory - int(memory * 0.10) - weights
    p = plan(presets["llama-3-8b"], [8192, 131072], batch=4, gpu=gpu)
    at8k, at128k = p.rows
    assert p.gpu.available == available
    assert at8k.max_batch == available // GiB and at8k.fits
    assert at128k.max_batch == available // (16 * GiB) and not at128k.fits  # 4 x 16 GiB > ~57 GiB
    longest = available // (4 * 128 * KiB)  # 4 sequences x 128 KiB per token
    assert at8k.max_ctx == longest


def test_fit_with_gpu_mem_and_unbounded_window(presets):
    p = plan(presets["mistral-7b-v0.1"], [32768], gpu_mem=parse_bytes("80GiB"), overhead="0%")
    assert p.rows[0].max_ctx_unbounded  # every layer windowed: the cache stops at 4096 tokens
    p = plan(presets["llama-3-70b"], [8192], gpu_mem=parse_bytes("80GiB"))
    assert p.rows[0].max_batch == 0 and not p.rows[0].fits  # 131 GiB of weights
    assert any("no room" in w for w in plan_warnings(p))


def test_unknown_gpu_and_model_list_close_matches(presets):
    with pytest.raises(KVBenchError, match="h100"):
        get_gpu("h1000")
    with pytest.raises(KVBenchError, match="mistral-7b-v0.1"):
        get_model("mistral-7b", presets)


# --- parsing ------------------------------------------------------------------------------------------------------
def test_parse_ctx():
    assert parse_ctx("8k,32k,128k") == [8192, 32768, 131072]
    assert parse_ctx("4096, 1m") == [4096, 1024 * 1024]
    assert parse_ctx("1.5k") == [1536]
    for bad in ("0", "12q", "", "-5", "1.3k", "8k,,"):
        with pytest.raises(KVBenchError):
            parse_ctx(bad)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("15360MiB") == 15 * GiB
    for bad in ("80XB", "lots", "0GiB"):
        with pytest.raises(KVBenchError):
            parse_bytes(bad)


def test_beyond_trained_context_warns_and_computes(presets):
    p = plan(presets["llama-3-8b"], [8192, 8193])
    assert [r.beyond_max for r in p.rows] == [False, True]
    assert p.rows[1].bytes_per_seq == 128 * KiB * 8193
    assert len(p.warnings) == 1 and "beyond the 8,192" in p.warnings[0]


def test_toml_unknown_key_names_key_and_file(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text(
        '[m]\nsource = "a/b"\nfamily = "llama"\nlayers = 2\nheads = 2\nkv_heads = 2\nhead_dim = 8\n'
        "hidden = 16\nmax_context = 64\nparams = 10\nkv_head = 2\n"
    )
    with pytest.raises(KVBenchError, match=r"'kv_head'.*models\.toml"):
        load_presets(bad)
    bad.write_text('[t4]\nlabel = "T4"\nmemory = "16GiB"\nnominal = "16 GB"\nbandwidth = "320GB/s"\n')
    with pytest.raises(KVBenchError, match=r"bandwidth and bandwidth_source go together"):
        load_gpus(bad)
    bad.write_text('[t4]\nlabel = "T4"\nmemory = "16GiB"\nnominal = "16 GB"\nclock = 1\n')
    with pytest.raises(KVBenchError, match=r"'clock'.*models\.toml"):
        load_gpus(bad)


# --- config.json written by transformers ----------------------------------------------------------------------------
def save(tmp_path, cfg, name):
    d = tmp_path / name
    cfg.save_pretrained(d)
    return d / "config.json"


def test_a_window_of_zero_is_no_window(tmp_path):
    """Qwen2-MoE's default config writes sliding_window 0 beside use_sliding_window false: no window, not a refusal;
    layer_types naming sliding layers with a window of 0 is refused in one line."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        vocab_size=256,
        sliding_window=0,
        use_sliding_window=False,
    )
    s = resolve_config(save(tmp_path, cfg, "qwen2_moe")).spec
    assert not s.sliding_layers
    raw = {
        "model_type": "mistral-like",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "sliding_window": 0,
        "layer_types": ["sliding_attention"] * 2,
    }
    (tmp_path / "w.json").write_text(json.dumps(raw))
    with pytest.raises(KVBenchError, match="sliding_window (= 0 is not a positive|is missing or 0)"):
        resolve_config(tmp_path / "w.json")


def test_config_llama3_8b(tmp_path, presets):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    s = resolve_config(save(tmp_path, cfg, "llama")).spec
    assert (s.n_layers, s.n_kv_heads, s.head_dim, s.max_context) == (32, 8, 128, 8192)
    assert plan(s, [1]).bytes_per_token == 128 * KiB
    # embeddings + 32 x (q, k, v, o + SwiGLU MLP + 2 norms) + final norm: Llama-3-8B's 8,030,261,248 parameters
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert s.params == 32 * layer + 2 * 128256 * 4096 + 4096 == presets["llama-3-8b"].params


def test_config_gemma2(tmp_path):
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        hidden_size=3584,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=4096,
    )
    path = save(tmp_path, cfg, "gemma2")
    s = resolve_config(path).spec
    assert s.head_dim == 256 and s.sliding_window == 4096 and s.sliding_layers == tuple(range(0, 42, 2))
    # The hub's config.json for gemma-2-9b predates layer_types: even layers slide all the same.
    d = json.loads(path.read_text())
    del d["layer_types"]
    old = tmp_path / "gemma2-old.json"
    old.write_text(json.dumps(d))
    assert resolve_config(old).spec.sliding_layers == tuple(range(0, 42, 2))


def test_config_mistral_qwen_phi3(tmp_path):
    from transformers import MistralConfig, Phi3Config, Qwen2Config

    s = resolve_config(save(tmp_path, MistralConfig(sliding_window=4096), "mistral")).spec
    assert s.sliding_window == 4096 and len(s.sliding_layers) == s.n_layers == 32 and s.n_kv_heads == 8
    s = resolve_config(save(tmp_path, MistralConfig(sliding_window=None), "mistral3")).spec
    assert not s.sliding_layers
    q = Qwen2Config(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        use_sliding_window=False,
    )
    s = resolve_config(save(tmp_path, q, "qwen")).spec
    assert (s.n_kv_heads, s.head_dim, s.sliding_layers) == (4, 128, ())
    # Qwen's hub config.json: sliding_window set, use_sliding_window false, no layer_types -> no window.
    hub = tmp_path / "qwen-hub.json"
    hub.write_text(
        json.dumps(
            dict(
                model_type="qwen2",
                hidden_size=3584,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                sliding_window=131072,
                use_sliding_window=False,
                max_window_layers=28,
                max_position_embeddings=131072,
            )
        )
    )
    assert not resolve_config(hub).spec.sliding_layers
    s = resolve_config(save(tmp_path, Phi3Config(sliding_window=2047), "phi3")).spec
    assert (s.n_kv_heads, s.head_dim, s.sliding_window, len(s.sliding_layers)) == (32, 96, 2047, 32)


def test_config_deepseek_v3_and_falcon(tmp_path):
    from transformers import DeepseekV3Config, FalconConfig

    s = resolve_config(save(tmp_path, DeepseekV3Config(), "dsv3")).spec
    assert s.is_mla and (s.kv_lora_rank, s.qk_rope_head_dim, s.n_layers) == (512, 64, 61)
    assert plan(s, [1]).bytes_per_token == (512 + 64) * 61 * 2
    s = resolve_config(save(tmp_path, FalconConfig(), "falcon")).spec  # multi_query, 71 heads of 64
    assert (s.n_heads, s.n_kv_heads, s.head_dim) == (71, 1, 64)
    assert plan(s, [1]).bytes_per_token == 8 * KiB


def test_config_rejects_what_it_cannot_interpret(tmp_path):
    from transformers import BertConfig, T5Config

    with pytest.raises(KVBenchError, match="bert"):
        resolve_config(save(tmp_path, BertConfig(), "bert"))
    with pytest.raises(KVBenchError, match="is_encoder_decoder"):
        resolve_config(save(tmp_path, T5Config(), "t5"))
    cases = {
        "no-layers.json": (
            {"model_type": "x", "num_attention_heads": 8, "hidden_size": 64},
            "num_hidden_layers",
        ),
        "hybrid.json": (
            {
                "model_type": "x",
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "hidden_size": 8,
                "layers_block_type": ["mamba", "teleport"],  # a layer kind with no known memory
            },
            "layers_block_type contains 'teleport'",
        ),
        "types.json": (
            {
                "model_type": "x",
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "hidden_size": 8,
                "layer_types": ["full_attention", "teleport_attention"],
            },
            "teleport_attention",
        ),
        "odd.json": (
            {"model_type": "x", "num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8},
            "head_dim",
        ),
    }
    for fname, (cfg, field) in cases.items():
        p = tmp_path / fname
        p.write_text(json.dumps(cfg))
        with pytest.raises(KVBenchError, match=field):
            resolve_config(p)
    bad = tmp_path / "not.json"
    bad.write_text("{nope")
    with pytest.raises(KVBenchError, match="is not valid JSON"):
        resolve_config(bad)


# --- torch.cat copy traffic ---------------------------------------------------------------------------------------
def test_copy_traffic_seed_example(presets):
    t = copy_traffic(presets["gpt2"], 128, 528)
    per_token = 2 * 12 * 12 * 64 * 2
    assert t.exact_bytes == per_token * sum(range(128, 528))
    assert t.seed_approx_bytes == per_token * (528**2 - 128**2) // 2
    assert round(t.exact_bytes / GiB, 1) == round(t.seed_approx_bytes / GiB, 1) == 4.5


def test_copy_traffic_counter_equals_closed_form():
    from kvbench.bench.measure_memory import count_copy_traffic
    from kvbench.caches.planned import spec_from_gpt_config
    from kvbench.model.gpt2 import PRESETS

    for name, n0, n1, batch in (("gpt2-tiny", 5, 40, 2), ("gpt2", 0, 24, 1)):
        counted, where = count_copy_traffic(name, n0, n1, batch, "fp32", "cpu")
        cfg = PRESETS[name]
        assert counted == 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * 4 * sum(range(n0, n1)) * batch
        assert counted == copy_traffic(spec_from_gpt_config(cfg), n0, n1, batch, "fp32").exact_bytes


# --- --measure on the CPU -----------------------------------------------------------------------------------------
def test_measure_static_equals_prediction_exactly():
    from kvbench.bench.measure_memory import measure_caches
    from kvbench.caches import CACHES

    batch, ctx = 2, 40
    r = measure_caches("gpt2", batch, ctx, "fp32", "cpu")
    by = {row.cache: row for row in r.rows}
    assert set(by) == set(CACHES)  # every registered cache is measured
    expected = 2 * 12 * batch * 12 * ctx * 64 * 4  # K and V, layers, batch, heads, tokens, head_dim, fp32
    assert r.predicted_bytes == expected
    assert by["static"].measured_bytes == expected and by["static"].exact
    assert by["dynamic"].measured_bytes == expected
    assert by["none"].measured_bytes == 0
    assert all(row.explanation for row in r.rows)


def test_measure_refuses_non_gpt2_and_quantized_dtype():
    from kvbench.bench.measure_memory import check_measure

    with pytest.raises(KVBenchError, match="gpt2-family"):
        check_measure("llama-3-8b", 1, [8], "fp16", "cpu")
    with pytest.raises(KVBenchError, match="kv-dtype"):
        check_measure("gpt2", 1, [8], "int4", "cpu")


# --- the CLI ------------------------------------------------------------------------------------------------------
def test_cli_llama3_8b_128k():
    r = run("--model", "llama-3-8b", "--ctx", "128k")
    assert r.exit_code == 0, r.output
    assert "128 KiB/token" in r.stdout and "16 GiB" in r.stdout
    assert "131,072 B/token x 131,072 tokens = 17,179,869,184 B = 16 GiB per sequence" in r.stdout
    assert "beyond the 8,192 it was trained for" in r.stderr


def test_cli_all_table(presets):
    r = runner.invoke(app, ["memory", "--all"], env={"COLUMNS": "220"})
    assert r.exit_code == 0, r.output
    for name in presets:
        assert name in r.stdout
    assert "layers capped at their window" in r.stdout


def test_cli_json(presets):
    r = run("--model", "llama-3-8b", "--model", "gemma-2-9b", "--ctx", "8k,128k", "--batch", 32, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    llama, gemma = doc["plans"]
    assert llama["bytes_per_token"] == 128 * KiB
    assert [row["bytes_batch"] for row in llama["rows"]] == [32 * GiB, 512 * GiB]
    assert gemma["model"]["head_dim"] == 256 and len(gemma["model"]["sliding_layers"]) == 21


def test_cli_gpu_and_tp():
    r = run("--model", "llama-3-70b", "--ctx", "8k", "--gpu", "h100", "--tp", 4, "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["plans"][0]
    assert p["kv_heads_per_gpu"] == 2 and p["rows"][0]["bytes_per_gpu"] == 2 * 80 * 2 * 128 * 2 * 8192
    assert p["rows"][0]["fits"] is True and p["gpu"]["memory"] == 81559 * MiB


def test_cli_config(tmp_path):
    from transformers import MistralConfig

    path = save(tmp_path, MistralConfig(sliding_window=4096), "mistral")
    r = run("--config", path, "--ctx", "32k", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plans"][0]["rows"][0]["bytes_per_seq"] == 2 * 32 * 8 * 128 * 2 * 4096


def test_cli_copy_traffic_and_measure():
    r = run("--model", "gpt2-tiny", "--copy-traffic", "--from", 4, "--to", 20, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["copy_traffic"][0]
    assert t["measured_bytes"] == t["exact_bytes"] == 2 * 2 * 4 * 32 * 2 * sum(range(4, 20))
    r = run("--model", "gpt2", "--measure", "--ctx", 16, "--device", "cpu", "--kv-dtype", "fp32", "--json")
    assert r.exit_code == 0, r.output
    static = next(row for row in json.loads(r.stdout)["measure"][0]["rows"] if row["cache"] == "static")
    assert static["measured_bytes"] == static["predicted_bytes"] == 2 * 12 * 12 * 16 * 64 * 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama-3-8b", "--ctx", "0"], "at least 1 token"),
        (["--model", "llama-3-8b", "--ctx", "12q"], "cannot read context length '12q'"),
        (["--model", "llama-3-8b", "--batch", "-1"], "--batch -1"),
        (["--model", "llama-3-8b", "--gpu", "z100"], "unknown GPU 'z100'"),
        (["--model", "llama3-8b"], "did you mean llama-3-8b"),
        (["--model", "llama-3-8b", "--tp", "3"], "not divisible by 3"),
        (["--model", "llama-3-8b", "--kv-dtype", "int3"], "unknown --kv-dtype"),
        (["--model", "llama-3-8b", "--gpu-mem", "lots"], "cannot read --gpu-mem"),
        (["--config", "/nonexistent/config.json"], "file not found"),
        (["--all", "--model", "gpt2"], "not both"),
        ([], "name a model"),
    ],
)
def test_cli_bad_input_one_line_error(args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_planner_imports_no_torch():
    """Every module of the planner imports, and presets, plans and command-line parsing run, on the standard
    library: torch and transformers are imported only to resolve a config.json or to --check, matplotlib only to
    draw --plot."""
    modules = sorted(p.stem for p in (ROOT / "src" / "kvbench" / "memory").glob("*.py") if p.stem != "__init__")
    code = (
        f"import sys, importlib; [importlib.import_module('kvbench.memory.' + m) for m in {modules!r}]; "
        "from kvbench.memory.presets import load_presets, load_gpus, get_model; "
        "from kvbench.memory.request import Options, parse_request, plan_request; "
        "from kvbench.memory.formulas import copy_traffic; load_presets(); load_gpus(); "
        "r = parse_request(Options(model=['llama-3-8b', 'gemma-3-4b'], ctx='8k,128k', gpu='h100')); "
        "plan_request(r); copy_traffic(get_model('gpt2'), 128, 528); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'matplotlib')]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_max_context_search_says_how_it_ended(presets):
    """Found by bisection; unbounded only when every layer is windowed; at the search limit otherwise."""
    fmt, llama = KV_FORMATS["fp16"], presets["llama-3-8b"]
    assert max_context(llama, fmt, 8, 1, 128 * KiB * 1000) == (1000, "found")
    assert max_context(llama, fmt, 8, 1, 128 * KiB * 2**41) == (MAX_TOKENS, "limit")
    assert max_context(presets["mistral-7b-v0.1"], fmt, 8, 1, 1 * GiB) == (None, "unbounded")
    assert max_context(llama, fmt, 8, 1, 0) == (0, "found")


def test_a_billion_layers_is_arithmetic_not_a_loop():
    """Per-sequence bytes count full and windowed layers; no loop over layers (a hostile config cannot stall it)."""
    spec = ModelSpec(
        name="x",
        source="x",
        family="x",
        n_layers=10**9,
        n_heads=8,
        n_kv_heads=8,
        head_dim=64,
        hidden_size=512,
        max_context=None,
        params=None,
    )
    assert bytes_per_sequence(spec, KV_FORMATS["fp16"], 2**40) == 2 * 8 * 64 * 2 * 10**9 * 2**40


def test_chunked_window_kind_in_presets(presets, tmp_path):
    scout = presets["llama-4-scout-17b-16e"]
    assert scout.window_kind == "chunked" and scout.n_windowed == 36 and scout.n_full == 12
    p = plan(scout, [131072])
    row = p.rows[0]
    assert row.bytes_per_seq == 2 * 8 * 128 * 2 * (12 * 131072 + 36 * 8192)
    assert "chunked" in row_lines(p, row)[0]
    bad = tmp_path / "models.toml"
    bad.write_text(
        '[m]\nsource = "a/b"\nfamily = "llama"\nlayers = 2\nheads = 2\nkv_heads = 2\nhead_dim = 8\n'
        'hidden = 16\nmax_context = 64\nparams = 10\nsliding_window = 4\nsliding_layers = "all"\n'
        'window_kind = "dilated"\n'
    )
    with pytest.raises(KVBenchError, match="window_kind = 'dilated'"):
        load_presets(bad)


def test_copy_traffic_counter_says_why_it_did_not_run(presets):
    from kvbench.bench.measure_memory import count_copy_traffic

    assert count_copy_traffic("llama-3-8b", 128, 528)[0] is None
    counted, why = count_copy_traffic("gpt2-xl", 128, 528, 1, "fp16", "cpu")  # 300 KiB x 131,000 tokens
    assert counted is None and "37.5 GiB" in why
    r = run("--model", "llama-3-8b", "--copy-traffic", "--json")
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["copy_traffic"][0]
    assert t["exact_bytes"] == 128 * KiB * sum(range(128, 528)) and t["measured_bytes"] is None


def test_measure_lengths_reports_paged_against_static():
    """--measure --lengths: a real paged cache filled with mixed lengths, against independent block arithmetic."""
    lengths = [37, 130, 260, 528, 75, 400, 12, 300]
    r = runner.invoke(
        app,
        [
            *"memory --model gpt2 --measure --batch 8 --ctx 528 --device cpu --json --lengths".split(),
            ",".join(map(str, lengths)),
        ],
    )
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["paged"]
    per_token = 2 * 12 * 12 * 64 * 2  # K and V, 12 layers, 12 heads of 64, fp16
    blocks = sum(-(-n // 16) for n in lengths)
    assert p["needed_bytes"] == sum(lengths) * per_token
    assert p["static_bytes"] == 8 * 528 * per_token
    assert p["blocks_used"] == blocks == 112
    assert p["paged_bytes"] == blocks * 16 * per_token
    r = runner.invoke(app, ["memory", "--model", "gpt2", "--lengths", "10,20"])
    assert r.exit_code == 2 and "--lengths goes with --measure" in r.output, r.output


def test_repeated_contexts_and_models_are_planned_once():
    r = run("--model", "llama-3-8b", "-m", "llama-3-8b", "--ctx", "8k,8192,128k", "--json")
    assert r.exit_code == 0, r.output
    (p,) = json.loads(r.stdout)["plans"]
    assert [row["ctx"] for row in p["rows"]] == [8192, 131072]


def test_window_notes_and_working_read_as_english(tmp_path):
    """'every layer uses an 8-token sliding window', 'a 4,096-token'; the max batch in the working has separators
    like the table beside it."""
    from kvbench.memory.planner import _a

    assert [_a(n) for n in ("8", "11", "18", "80", "800", "8,192", "11,000", "4,096", "1,024", "110")] == [
        "an",
        "an",
        "an",
        "an",
        "an",
        "an",
        "an",
        "a",
        "a",
        "a",
    ]
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 64,
        "sliding_window": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["memory", "--config", str(tmp_path / "config.json"), "--ctx", "32"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "every layer uses an 8-token sliding window: past that length each holds only the last 8 tokens" in text
    r = CliRunner().invoke(app, ["memory", "-m", "llama-3-8b", "--gpu", "h200", "--ctx", "16", "--json"])
    fit = next(line for line in json.loads(r.stdout)["plans"][0]["rows"][0]["working"] if "max batch" in line)
    assert re.search(r"max batch \d{1,3}(,\d{3})+ at", fit), fit


def test_export_extra_says_one_timed_repeat_in_the_singular():
    from types import SimpleNamespace

    from kvbench.results.rundir import github_action_benchmark

    row = SimpleNamespace(
        status="ok",
        engine="kvbench",
        cache="static",
        prompt_len=8,
        batch=1,
        device="cpu",
        dtype="fp32",
        tpot_ms_median=1.0,
        tpot_ms_p90=1.5,
        ttft_ms=2.0,
        ttft_ms_p90=2.5,
        repeats=1,
    )
    entries, _ = github_action_benchmark([row])
    assert entries[0]["extra"] == "cpu fp32; 1 timed repeat; TPOT p90 1.5 ms", entries
    entries, _ = github_action_benchmark([SimpleNamespace(**{**vars(row), "repeats": 3})])
    assert entries[0]["extra"].startswith("cpu fp32; 3 timed repeats;")
