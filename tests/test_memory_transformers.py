"""The planner against transformers itself: every preset and every config.json below is held against the bytes of
transformers' own StaticCache (allocated on the meta device, one decode step) and the numel() of transformers'
meta-device model, both computed here from the same config.json.

The config.json files are written from the public Hugging Face configs, with the fields as published: what a
model's config class defaults (Gemma 3's layer pattern and head counts, Qwen2's use_sliding_window, Falcon's
max_position_embeddings, a text_config's layers and widths) is left out, as it is on the hub, so the planner has
to resolve it the way transformers does.
"""

import atexit
import functools
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # a test never reaches the network

import pytest
import torch
from typer.testing import CliRunner

from facts import holds, since
from kvbench.cli import app
from kvbench.cli.memory_working import plan_lines
from kvbench.memory.config import resolve_config
from kvbench.memory.formulas import layer_bytes_per_token
from kvbench.memory.planner import plan
from kvbench.memory.presets import get_model, load_presets
from kvbench.memory.spec import KV_FORMATS

CONTEXTS = (4096, 131072)
pytestmark = pytest.mark.slow  # builds ~30 models on the meta device: about a minute on two cores
runner = CliRunner()

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_positions": 1024, "vocab_size": 50257}

# mistralai/Mistral-7B-v0.1's config.json; v0.3 is its shapes without the window, with a larger vocabulary
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# The vision tower both LLaVA configs below carry (openai/clip-vit-large-patch14-336's): the planner reads past it.
CLIP_VIT_L_336 = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "image_size": 336,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "patch_size": 14,
    "projection_dim": 768,
    "vocab_size": 32000,
}
# One config.json per preset in configs/models.toml, as published on the hub (the repo is the preset's source).
PUBLIC = {
    "gpt2": {**GPT2, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "gpt2-medium": {**GPT2, "n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-large": {**GPT2, "n_layer": 36, "n_head": 20, "n_embd": 1280},
    "gpt2-xl": {**GPT2, "n_layer": 48, "n_head": 25, "n_embd": 1600},
    "llama-2-7b": {
        **LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
    "llama-2-13b": {
        **LLAMA,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
    "llama-2-70b": {
        **LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
    "llama-3-8b": {
        **LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "vocab_size": 128256,
    },
    "llama-3-70b": {
        **LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "vocab_size": 128256,
    },
    "llama-3.1-405b": {
        **LLAMA,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
    },
    "mistral-7b-v0.1": MISTRAL_7B_V01,
    "mistral-7b-v0.3": {**MISTRAL_7B_V01, "sliding_window": None, "vocab_size": 32768},
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen2.5-72b": {
        "model_type": "qwen2",
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 80,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "gemma-2-9b": {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma-2-27b": {
        "model_type": "gemma2",
        "hidden_size": 4608,
        "intermediate_size": 36864,
        "num_hidden_layers": 46,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 144,
        "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "phi-3-mini": {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "sliding_window": 2047,
        "vocab_size": 32064,
        "tie_word_embeddings": False,
    },
    # Falcon's published configs have no max_position_embeddings: FalconConfig's default (2048) applies.
    "falcon-7b": {
        "model_type": "falcon",
        "hidden_size": 4544,
        "num_attention_heads": 71,
        "num_hidden_layers": 32,
        "multi_query": True,
        "new_decoder_architecture": False,
        "parallel_attn": True,
        "bias": False,
        "alibi": False,
        "vocab_size": 65024,
    },
    "falcon-40b": {
        "model_type": "falcon",
        "hidden_size": 8192,
        "num_attention_heads": 128,
        "num_hidden_layers": 60,
        "num_kv_heads": 8,
        "new_decoder_architecture": True,
        "parallel_attn": True,
        "bias": False,
        "alibi": False,
        "vocab_size": 65024,
    },
    "deepseek-v2": {
        "model_type": "deepseek_v2",
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 160,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "vocab_size": 102400,
        "tie_word_embeddings": False,
        "topk_method": "group_limited_greedy",
        "n_group": 8,
        "topk_group": 3,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "n_group": 8,
        "topk_group": 4,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 48,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # Multimodal: a minimal text_config (no heads, no layer pattern: Gemma3TextConfig's defaults) and a vision tower.
    "gemma-3-4b": {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    },
    # The text_config gives vocab_size and max_position_embeddings only: layers and widths are LlamaConfig's.
    "llava-1.5-7b": {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5",
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "vocab_size": 32064,
        },
        "vision_config": CLIP_VIT_L_336,
    },
    # Chunked local attention on 3 of every 4 layers (Llama4TextConfig builds layer_types from no_rope_layers).
    "llama-4-scout-17b-16e": {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {
            "model_type": "llama4_text",
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8192,
            "use_qk_norm": True,
            "max_position_embeddings": 10485760,
            "vocab_size": 202048,
        },
        "vision_config": {
            "model_type": "llama4_vision_model",
            "hidden_size": 1408,
            "image_size": 336,
            "intermediate_size": 5632,
            "num_attention_heads": 16,
            "num_hidden_layers": 34,
            "patch_size": 14,
            "vision_output_dim": 4096,
            "projector_input_dim": 4096,
            "projector_output_dim": 4096,
        },
    },
}

# Configs for the remaining ways a hand reader goes wrong, beyond the presets.
EXTRA = {
    # Qwen2 with sliding_window set and use_sliding_window left out (false by default): no layer is windowed.
    "qwen2-window-unset": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # LLaVA-NeXT around Mistral (llava-hf/llava-v1.6-mistral-7b-hf): tie_word_embeddings and hidden_act left out,
    # so MistralConfig's untied embeddings and SiLU-gated MLP apply.
    "llava-next-mistral-7b": {
        "model_type": "llava_next",
        "architectures": ["LlavaNextForConditionalGeneration"],
        "text_config": {
            "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
            "architectures": ["MistralForCausalLM"],
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mistral",
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "vocab_size": 32064,
        },
        "vision_config": CLIP_VIT_L_336,
    },
}
CONFIGS = {**PUBLIC, **EXTRA}


@functools.cache
def _configs_dir() -> Path:
    """Where config_file writes: made when a test first asks for a file, not when the module is collected (every
    test run collects this module, the default tier too), and removed when the process ends."""
    path = Path(tempfile.mkdtemp(prefix="kvbench-hf-configs-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def config_file(name: str) -> Path:
    path = _configs_dir() / f"{name}.json"
    if not path.exists():
        path.write_text(json.dumps(CONFIGS[name]))
    return path


@functools.cache
def reference(name: str) -> dict:
    """transformers on its own: the config class, the meta-device language model's numel(), and the bytes of every
    layer's keys and values in its StaticCache after one decode step (2 B per element, fp16), per context."""
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(str(config_file(name)))
        text = config.get_text_config(decoder=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
        cache_bytes = {}
        for ctx in CONTEXTS:
            cache = StaticCache(config=text, max_cache_len=ctx)
            ids = torch.zeros((1, 1), dtype=torch.long, device="meta")
            with torch.no_grad():
                model(input_ids=ids, cache=cache, use_cache=True)
            cache_bytes[ctx] = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 2
    return {
        "numel": sum(p.numel() for p in model.parameters()),
        "bytes": cache_bytes,
        "max_position_embeddings": text.max_position_embeddings,
    }


@pytest.fixture(scope="module")
def presets():
    return load_presets()


def planned(spec, ctx: int) -> int:
    return plan(spec, [ctx]).rows[0].bytes_per_seq


def broadcast(name: str) -> int:
    """How many times the planner's figure transformers' own cache holds: Falcon-40B's attention broadcast its 8 KV
    groups to all 128 query heads before caching until transformers 5.25, which caches the 8."""
    return since({"4.40": 16, "5.25": 1}) if name == "falcon-40b" else 1


# --- every preset -------------------------------------------------------------------------------------------------
def test_every_preset_has_its_public_config(presets):
    assert set(PUBLIC) == set(presets)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_against_transformers(presets, name):
    """The preset's cache bytes equal transformers' StaticCache; its parameters are within 2% of numel(); and
    `--check --model` (transformers' config class filled with the preset's fields) finds the same bytes."""
    from kvbench.memory.check import check_preset

    ref, spec = reference(name), presets[name]
    for ctx in CONTEXTS:
        holds(ref["bytes"][ctx] // planned(spec, ctx), broadcast(name), f"{name}: transformers' cache / the plan")
        assert ref["bytes"][ctx] == broadcast(name) * planned(spec, ctx), ctx
    assert abs(spec.params / ref["numel"] - 1) < 0.02, (spec.params, ref["numel"])
    for c in check_preset(spec, list(CONTEXTS)):
        assert c.checkable and c.transformers_bytes == ref["bytes"][c.ctx], c.how
        assert c.planner_bytes == planned(spec, c.ctx) and c.agrees == (broadcast(name) == 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_json_against_transformers(presets, name):
    """The config.json as published, resolved by the planner: same bytes as transformers' StaticCache (and as the
    preset), parameters within 2% of the meta model's numel(), the context transformers would use."""
    ref, spec = reference(name), resolve_config(config_file(name)).spec
    assert spec.resolved_by.startswith("transformers")
    for ctx in CONTEXTS:
        holds(ref["bytes"][ctx] // planned(spec, ctx), broadcast(name), f"{name}: transformers' cache / the plan")
        assert planned(spec, ctx) * broadcast(name) == ref["bytes"][ctx], ctx
        if name in presets:
            assert planned(spec, ctx) == planned(presets[name], ctx)
    assert abs(spec.params / ref["numel"] - 1) < 0.02, (spec.params, ref["numel"])
    assert spec.max_context == ref["max_position_embeddings"]


# --- the ways a hand reader went wrong, one by one ----------------------------------------------------------------
def test_sliding_window_without_pattern_is_not_every_layer():
    """Gemma 3 leaves its 5:1 pattern out, Qwen2 its use_sliding_window: treating every layer as windowed would
    undercount 20x and 32x at 128k."""
    for name, window in (("gemma-3-4b", 1024), ("qwen2-window-unset", 4096)):
        spec = resolve_config(config_file(name)).spec
        every_layer_windowed = layer_bytes_per_token(spec, KV_FORMATS["fp16"]) * spec.n_layers * window
        assert planned(spec, 131072) == reference(name)["bytes"][131072] > 15 * every_layer_windowed


def test_minimal_text_config_gets_class_defaults():
    """gemma-3-4b's text_config has no heads, llava-1.5's no layers: the class defaults fill them in."""
    g = resolve_config(config_file("gemma-3-4b")).spec
    assert (g.n_heads, g.n_kv_heads, g.head_dim, g.wrapper) == (8, 4, 256, "gemma3")
    llava = resolve_config(config_file("llava-1.5-7b")).spec
    assert (llava.n_layers, llava.hidden_size, llava.wrapper, llava.source) == (
        32,
        4096,
        "llava",
        str(config_file("llava-1.5-7b")),
    )


def test_vision_tower_is_stated_not_counted():
    """Multimodal: params are the language model's; the ViT tower's size is stated beside it, within 2%."""
    from transformers import AutoConfig, AutoModel

    for name in ("gemma-3-4b", "llava-1.5-7b"):
        spec = resolve_config(config_file(name)).spec
        with torch.device("meta"):
            tower = AutoModel.from_config(AutoConfig.from_pretrained(str(config_file(name))).vision_config)
        numel = sum(p.numel() for p in tower.parameters())
        assert abs(spec.vision_params / numel - 1) < 0.02
        assert "vision tower" in plan_lines(plan(spec, [4096]))[-1]


def test_llama4_chunked_layers():
    """Llama 4's local layers attend within 8,192-token chunks: full attention everywhere would be 3.4x."""
    spec = resolve_config(config_file("llama-4-scout-17b-16e")).spec
    assert spec.window_kind == "chunked" and spec.n_windowed == 36 and spec.sliding_window == 8192
    full = layer_bytes_per_token(spec, KV_FORMATS["fp16"]) * spec.n_layers * 131072
    assert 3.3 < full / reference("llama-4-scout-17b-16e")["bytes"][131072] < 3.5


def test_falcon_7b_context_from_the_class_default():
    r = runner.invoke(app, ["memory", "--config", str(config_file("falcon-7b")), "--ctx", "4k"])
    assert r.exit_code == 0, r.output
    assert "beyond the 2,048 it was trained for" in r.stderr
    assert reference("falcon-7b")["max_position_embeddings"] == 2048


def test_mla_note_says_transformers_caches_the_latent(presets):
    notes = " ".join(plan(presets["deepseek-v3"], [4096]).notes)
    assert "transformers 5.x" in notes and "eager attention caches it" not in notes
    spec = resolve_config(config_file("deepseek-v3")).spec
    assert planned(spec, 4096) == reference("deepseek-v3")["bytes"][4096] == (512 + 64) * 61 * 2 * 4096


def test_missing_tie_and_activation_take_the_class_defaults():
    """LLaVA-NeXT + Mistral: untied embeddings and a gated MLP, not tied and two matrices (5.2B against 7.2B)."""
    spec = resolve_config(config_file("llava-next-mistral-7b")).spec
    assert abs(spec.params / reference("llava-next-mistral-7b")["numel"] - 1) < 0.02


def test_model_type_transformers_lacks_falls_back_with_a_note(tmp_path):
    cfg = {**PUBLIC["llama-3-8b"], "model_type": "not_in_transformers"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_config(path).spec
    assert spec.resolved_by == "kvbench's own reader" and "no model_type 'not_in_transformers'" in spec.note
    assert planned(spec, 4096) == reference("llama-3-8b")["bytes"][4096]  # the fields it gives are read all the same
    r = runner.invoke(app, ["memory", "--config", str(path), "--ctx", "4k", "--check", "--json"])
    assert r.exit_code == 0, r.output
    check = json.loads(r.stdout)["check"][0]
    assert check["checkable"] is False and "not_in_transformers" in check["how"]


# --- kvbench memory --check ---------------------------------------------------------------------------------------
def test_check_config_falcon_40b_explains_the_broadcast():
    path = config_file("falcon-40b")
    r = runner.invoke(app, ["memory", "--config", str(path), "--ctx", "4k", "--check", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    (check,) = doc["check"]
    (kind,) = check["kinds"]
    assert kind["planner_bytes"] == doc["plans"][0]["rows"][0]["bytes_per_seq"]
    assert kind["transformers_bytes"] == reference("falcon-40b")["bytes"][4096]
    holds(kind["transformers_bytes"] // kind["planner_bytes"], broadcast("falcon-40b"), "falcon-40b: cache / plan")
    if broadcast("falcon-40b") == 1:
        assert kind["agrees"] and kind["explanation"] == "agrees to the byte", kind
    else:
        assert not kind["agrees"] and "broadcasts" in kind["explanation"] and "16x" in kind["explanation"]
    assert check["transformers_params"] == reference("falcon-40b")["numel"]


def test_check_preset_agrees_per_layer_kind():
    name = "gemma-3-4b"
    r = runner.invoke(app, ["memory", "--model", name, "--ctx", "4k,128k", "--check", "--json"])
    assert r.exit_code == 0, r.output
    checks = json.loads(r.stdout)["check"]
    assert [c["ctx"] for c in checks] == list(CONTEXTS)
    for c in checks:
        assert c["agrees"] and c["transformers_bytes"] == reference(name)["bytes"][c["ctx"]]
        assert sum(k["planner_layers"] for k in c["kinds"]) == get_model(name).n_layers


def test_check_human_output_one_line_per_difference():
    r = runner.invoke(app, ["memory", "--model", "falcon-40b", "--ctx", "2k", "--check"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "check: falcon-40b against transformers' own cache" in r.stdout
    if broadcast("falcon-40b") == 1:  # transformers 5.25+ caches the 8 KV groups: nothing differs
        assert "the plan agrees with transformers to the byte" in r.stdout, r.stdout
        return
    assert "broadcasts" in r.stdout and "16x what the model needs" in " ".join(r.stdout.split())
    assert "the plan and transformers differ" in r.stdout
