"""Models without a KV cache in every layer: recurrent (Mamba, Mamba2, RWKV, xLSTM) and hybrid (Jamba, Qwen3-Next,
Zamba2, Bamba, Nemotron-H). memory plans their state, not an attention cache they do not have, and counts a hybrid's attention
layers only; the numbers are held to what transformers' own cache allocates for the same tiny config. verify --hf
skips the cache rows of a model with no KV cache, saying why, and checks a hybrid's caches as usual."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from facts import holds, since
from kvbench.cli import app

# Tiny configs, one per family: (fields, attention layers, what one layer's state holds per sequence, by hand)
TINY = {
    "mamba": (
        dict(hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2),
        0,
        64 * (8 + 4),
    ),
    "falcon_mamba": (
        dict(hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=3, expand=2),
        0,
        64 * 11,
    ),
    "mamba2": (
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=16,
            state_size=8,
            n_groups=2,
            conv_kernel=4,
            expand=2,
        ),
        0,
        (64 + 2 * 2 * 8) * 4 + 4 * 16 * 8,
    ),
    "rwkv": (dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64), 0, 5 * 32),
    # xLSTMConfig rounds its qk and v widths up to a multiple of 64: 2 heads of 32 x 32 here
    "xlstm": (dict(hidden_size=32, num_hidden_layers=2, num_heads=2), 0, 2 * (32 * 32 + 32 + 1)),
    "jamba": (
        dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            intermediate_size=64,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
        2,
        64 * (8 + 4),
    ),
    "qwen3_next": (
        dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=2,
            num_experts_per_tok=1,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        1,
        (2 * 2 * 8 + 4 * 8) * 4 + 4 * 8 * 8,
    ),
    "zamba2": (
        dict(
            hidden_size=32,
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            hybrid_layer_ids=[1, 3],
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_head_dim=16,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            n_mamba_heads=4,
            mamba_headdim=16,
            mamba_ngroups=1,
            intermediate_size=64,
            num_mem_blocks=1,
        ),
        2,
        (64 + 2 * 8) * 4 + 4 * 16 * 8,
    ),
    "bamba": (
        dict(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_n_groups=1,
            intermediate_size=64,
        ),
        2,
        (64 + 2 * 8) * 4 + 4 * 16 * 8,
    ),
    "nemotron_h": (  # Mamba, attention, MLP only, Mamba
        dict(
            hidden_size=32,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            intermediate_size=64,
        ),
        1,
        (64 + 2 * 8) * 4 + 4 * 16 * 8,
    ),
}
RECURRENT = [f for f, (_, attn, _) in TINY.items() if attn == 0]
HYBRID = [f for f, (_, attn, _) in TINY.items() if attn]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig

    base = tmp_path_factory.mktemp("recurrent")
    out = {}
    for family, (fields, _, _) in TINY.items():
        AutoConfig.for_model(family, vocab_size=64, initializer_range=0.1, **fields).save_pretrained(base / family)
        out[family] = base / family / "config.json"
    return out


def memory(*args: str):
    r = CliRunner().invoke(app, ["memory", *args])
    return r, r.output


def _plan(path: Path, *extra: str) -> dict:
    r, out = memory("--config", str(path), "--ctx", "1000,100k", "--kv-dtype", "fp16", "--json", *extra)
    assert r.exit_code == 0, out
    return json.loads(r.stdout)["plans"][0]


def _transformers_cache(path: Path) -> tuple[int, int]:
    """(state elements, K/V elements per token) that transformers' own cache holds for one sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path.parent)

    def numel(o) -> int:
        if isinstance(o, torch.Tensor):
            return o.numel()
        if isinstance(o, dict):
            o = list(o.values())
        return sum(numel(x) for x in o) if isinstance(o, list | tuple) else 0

    if cfg.model_type == "xlstm":  # its tiny forward does not run in every transformers release: the cache alone
        from transformers.models.xlstm.modeling_xlstm import xLSTMCache

        return numel(xLSTMCache(cfg, max_batch_size=1, dtype=torch.float32).rnn_state), 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    T = 5
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, T, dtype=torch.long), use_cache=True)
    fields = ("cache", "past_key_values", "cache_params", "state")
    cache = next(getattr(out, k) for k in fields if getattr(out, k, None) is not None)
    if isinstance(cache, list):  # RWKV: its state as a list of tensors
        return numel(cache), 0
    if not hasattr(cache, "layers"):  # up to transformers 5.23, Mamba's own MambaCache (the `cache_params` field)
        return sum(numel(getattr(cache, n, None)) for n in ("conv_states", "ssm_states", "recurrent_states")), 0
    state = sum(numel(getattr(layer, n, None)) for layer in cache.layers for n in ("conv_states", "recurrent_states"))
    kv = sum(
        layer.keys.numel() + layer.values.numel()
        for layer in cache.layers
        if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
    )
    return state, kv // T


@pytest.mark.parametrize("family", list(TINY))
def test_state_and_kv_match_transformers_own_cache(configs, family):
    """The state the planner sizes, and the K/V bytes per token of a hybrid's attention layers, are exactly what
    transformers' own cache holds for the same config (and what the formula gives by hand)."""
    _, attn, per_layer = TINY[family]
    plan = _plan(configs[family])
    m = plan["model"]
    state, kv = _transformers_cache(configs[family])
    assert m["state_elements"] == state == m["state_layers"] * per_layer, m
    assert plan["state_bytes_per_sequence"] == 2 * state  # fp16
    assert m["n_layers"] == attn and plan["bytes_per_token"] == 2 * kv, plan
    assert plan["kv_cache"] == bool(attn)


@pytest.mark.parametrize("family", RECURRENT)
def test_recurrent_model_has_no_kv_cache(configs, family):
    """No KV cache: 0 B per token, the same bytes per sequence at every context (its state), an unbounded context
    on a GPU, said in words; --check says it does not apply instead of crashing."""
    plan = _plan(configs[family], "--gpu-mem", "1GiB")
    state = plan["state_bytes_per_sequence"]
    assert plan["bytes_per_token"] == 0 and plan["model"]["attention"] == "none" and state > 0, plan
    assert [r["bytes_per_seq"] for r in plan["rows"]] == [state, state], plan["rows"]
    assert all(r["max_ctx_unbounded"] and r["fits"] for r in plan["rows"]), plan["rows"]
    assert any("keeps a fixed-size recurrent state and no KV cache" in n for n in plan["notes"]), plan["notes"]
    r, out = memory("--config", str(configs[family]), "--ctx", "1000")
    assert r.exit_code == 0, out
    assert "KV cache: none; recurrent state:" in out and "per sequence at any context" in out, out
    r, out = memory("--config", str(configs[family]), "--ctx", "1000", "--check")
    assert r.exit_code == 0 and "Traceback" not in out, out
    assert f"not checkable: {family} keeps a recurrent state (it has no KV cache)" in out, out


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_caches_its_attention_layers_only(configs, family):
    fields, attn, _ = TINY[family]
    plan = _plan(configs[family])
    m = plan["model"]
    assert (m["n_layers"], m["model_layers"]) == (attn, fields.get("num_hidden_layers", 4)), m
    per_token = 2 * attn * m["n_kv_heads"] * m["head_dim"] * 2
    state = plan["state_bytes_per_sequence"]
    assert plan["bytes_per_token"] == per_token and state > 0, plan
    assert [r["bytes_per_seq"] for r in plan["rows"]] == [
        per_token * 1000 + state,
        per_token * 102400 + state,
    ]
    assert any(f"only its attention layers ({attn}) cache K/V" in n for n in plan["notes"]), plan["notes"]


@pytest.mark.parametrize(
    "fields, attention, state_layers",
    [
        ({"hybrid_override_pattern": "M*M-"}, 1, 2),  # Mamba, attention, Mamba, MLP
        ({"attn_layer_period": 2, "attn_layer_offset": 1}, 2, 2),
        ({"layers_block_type": ["mamba", "attention", "mamba", "mlp"]}, 1, 2),
        ({"attn_layer_indices": [3]}, 1, 3),
        ({"layer_types": ["linear_attention", "full_attention", "conv", "moe"]}, 1, 2),
    ],
)
def test_hybrid_fields_as_written(tmp_path, fields, attention, state_layers):
    """A hybrid transformers does not know is read from the file as written: its attention layers are planned, its
    other layers said to keep a state (not sized: the reader does not know its family)."""
    cfg = {
        "model_type": "mystery",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "vocab_size": 100,
        **fields,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    plan = _plan(path)
    m = plan["model"]
    assert (m["n_layers"], m["state_layers"], m["state_elements"]) == (attention, state_layers, None), m
    assert plan["bytes_per_token"] == 2 * attention * 2 * 16 * 2 and plan["state_bytes_per_sequence"] == 0
    assert "not computed for mystery" in m["state_working"], m


# --- verify --hf and bench --hf --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(configs, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for family in ("mamba", "jamba"):
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(f"{family}-model")
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(configs[family].parent)).save_pretrained(d)
        out[family] = d
    return out


def test_verify_hf_skips_a_model_without_a_kv_cache(model_dirs):
    args = [
        "verify",
        "--hf",
        str(model_dirs["mamba"]),
        *"--caches none,dynamic,static --prompt-len 6 --new-tokens 3".split(),
    ]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 5, r.output  # every row skipped: nothing checked, no pass
    doc = json.loads(r.stdout)
    assert doc["passed"] is False and doc["nothing_checked"] is True, doc
    assert [c["cache"] for c in doc["checks"]] == ["none", "dynamic", "static"], doc["checks"]
    for c in doc["checks"]:
        assert c["skipped"] and c["detail"] == "mamba keeps a recurrent state, no KV cache", c
    assert doc["hf"]["layers"] == ["recurrent", "recurrent"], doc["hf"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 5 and "NOTHING CHECKED: all 3 row(s) skipped" in r.stdout, r.output
    assert "full attention" not in r.stdout and "no attention, so no KV cache" in r.stdout, r.stdout


def test_verify_hf_checks_a_hybrid_through_its_attention_layers(model_dirs):
    r = CliRunner().invoke(
        app,
        [
            "verify",
            "--hf",
            str(model_dirs["jamba"]),
            *"--caches dynamic,static,quantized-fp8 --prompt-len 6 --new-tokens 3 --json".split(),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    ran = [c for c in doc["checks"] if not c["skipped"]]
    assert {c["cache"] for c in ran} == {"dynamic", "static"} and all(c["passed"] for c in ran), doc["checks"]
    fp8 = next(c for c in doc["checks"] if c["cache"] == "quantized-fp8")
    assert fp8["skipped"] and "recurrent layers" in fp8["detail"], fp8
    rollback = {c["cache"]: c for c in doc["checks"] if c["name"] == "rollback"}
    # transformers 5.25 declares its linear-attention layers croppable (recording the state after each drafted
    # token); before, a hybrid's cache was not croppable and rollback skipped
    croppable = since({"4.0": False, "5.25": True})
    holds(not rollback["dynamic"]["skipped"], croppable, "a hybrid's DynamicCache is croppable")
    if croppable:
        static = rollback["static"]
        assert static["passed"] and (not static["skipped"] or "a known defect of transformers" in static["detail"]), (
            static
        )  # transformers' one-token mask skip once recording turns compileability off (hf/known.py)
    else:
        assert all("not croppable" in c["detail"] for c in rollback.values()), rollback
    assert any("2 of 4 cache K/V" in n for n in doc["notes"]), doc["notes"]
    assert doc["hf"]["layers"] == ["recurrent", "full", "recurrent", "full"], doc["hf"]


def test_bench_hf_sizes_a_hybrid_cache_by_its_attention_layers(model_dirs):
    from kvbench.bench.hf_sweep import kv_bytes
    from kvbench.hf.models import load_hf

    def shape_of(family):  # what bench --hf's size check is given: the model built on the meta device
        shapes = []
        load_hf(str(model_dirs[family]), torch.device("cpu"), torch.float32, check=shapes.append)
        return shapes[0]

    shape = shape_of("jamba")
    per_token = 2 * shape.info.n_kv_heads * shape.info.head_dim * 4  # one attention layer, fp32
    assert kv_bytes(shape, 10, 4) == 2 * 10 * per_token
    assert kv_bytes(shape_of("mamba"), 10, 4) == 0


def test_a_cache_is_filled_when_any_layer_holds_tokens():
    """A hybrid whose layer 0 is recurrent (RecurrentGemma keeps its state in module buffers, so its cache's layer 0
    counts nothing from transformers 5.25) keeps a KV cache all the same: it is measured, and its rows run."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from kvbench.hf.introspect import cache_kwarg, held_tokens, measured_no_cache
    from kvbench.hf.tiny import model_types, tiny_config

    if "recurrent_gemma" not in model_types():
        pytest.skip("this transformers has no recurrent_gemma")
    c = tiny_config("recurrent_gemma")
    cfg = AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert measured_no_cache(model) is None
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True, **{cache_kwarg(): cache})
    layers = [int(x.get_seq_length()) for x in cache.layers]
    assert held_tokens(cache) == max(layers) == 5, layers
