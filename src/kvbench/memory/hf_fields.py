"""A config.json's fields -> ModelSpec: which layers are cached, how wide, how many, for how long, and the parameters.

The same code reads two kinds of field dicts: the fields transformers' own config class resolved (class defaults
filled in, `layer_types` built by the class), and, for a model type transformers lacks, the file as written. Only
the second needs the family rules below (Gemma 2's alternating layers, Gemma 3's pattern, Qwen2's switch); the
first follows transformers' own rule for the cache: `layer_types` when the class sets it, else every layer
windowed when `sliding_window` (or chunked when `attention_chunk_size`) is set.

The parameter count of a dense, mixture-of-experts or MLA decoder, and of a ViT vision tower, is an estimate, and
says so: embeddings, attention, MLP (every expert, shared experts and the router), norms; biases are left out
(under 0.1% of any model here). It reads the fields transformers resolved (class defaults filled in) when it
could, else the config.json as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from kvbench.errors import KVBenchError
from kvbench.memory.spec import ModelSpec
from kvbench.memory.state import State, read_state
from kvbench.memory.units import MAX_WIDTH

# model_types that are not decoder-only LLMs; their config.json has layers and heads too, so refuse them by name.
NOT_DECODERS = {
    "bert",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "xlm-roberta",
    "camembert",
    "mpnet",
    "longformer",
    "ernie",
    "modernbert",
    "t5",
    "mt5",
    "umt5",
    "bart",
    "mbart",
    "pegasus",
    "marian",
    "whisper",
    "vit",
    "clip",
    "siglip",
    "wav2vec2",
    "hubert",
    "beit",
    "swin",
    "convnext",
    "detr",
}
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


@dataclass(frozen=True)
class Source:
    """Where the fields came from, for the spec's name, source and notes."""

    path: Path  # the config.json
    resolved_by: str  # "transformers 5.x (LlamaConfig)" or "kvbench's own reader"
    resolved: bool  # True: transformers filled the class defaults in
    wrapper: str | None = None  # multimodal: the outer model_type
    vision_params: int | None = None  # multimodal: the vision tower, stated
    name_or_path: str | None = None  # the config's _name_or_path, shown as the source when present
    note: str = ""  # e.g. why transformers could not resolve it


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if cfg.get(k) is not None:
            return k, cfg[k]
    return None, None


@overload
def cfg_int(cfg: dict[str, Any], keys: tuple[str, ...], path: Path, required: Literal[True] = True) -> int: ...
@overload
def cfg_int(cfg: dict[str, Any], keys: tuple[str, ...], path: Path, required: bool) -> int | None: ...
def cfg_int(cfg: dict[str, Any], keys: tuple[str, ...], path: Path, required: bool = True) -> int | None:
    key, value = _first(cfg, keys)
    if key is None:
        if required:
            raise KVBenchError(f"{path}: no {' / '.join(keys)} field; cannot size the KV cache without it")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KVBenchError(f"{path}: {key} = {value!r} is not a positive whole number")
    return value


def refuse_non_decoders(cfg: dict[str, Any], model_type: str, path: Path) -> None:
    """Encoders and encoder-decoders, refused by name."""
    if cfg.get("is_encoder_decoder"):
        raise KVBenchError(f"{path}: is_encoder_decoder is true ({model_type}); this planner sizes decoder-only LLMs")
    if model_type in NOT_DECODERS:
        raise KVBenchError(f"{path}: model_type {model_type!r} is not a decoder-only LLM; nothing to plan")
    archs = cfg.get("architectures") or []
    if archs and not any(re.search(r"(CausalLM|LMHeadModel|ForConditionalGeneration)$", a) for a in archs):
        raise KVBenchError(f"{path}: architectures {archs} has no causal LM (…ForCausalLM / …LMHeadModel)")


def kv_heads(cfg: dict[str, Any], model_type: str, n_heads: int, path: Path) -> int:
    """KV heads: GQA configs say so; Falcon and StarCoder say multi_query; everything else is MHA."""
    if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
        n_kv = 1 if cfg.get("multi_query", True) else (cfg_int(cfg, ("num_kv_heads",), path, False) or n_heads)
    elif model_type == "gpt_bigcode" and cfg.get("multi_query", True):
        n_kv = 1
    else:
        keys = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
        n_kv = cfg_int(cfg, keys, path, required=False) or n_heads
    if n_heads % n_kv:
        raise KVBenchError(f"{path}: {n_heads} attention heads are not a multiple of {n_kv} key/value heads")
    return n_kv


def head_dim(cfg: dict[str, Any], hidden: int, n_heads: int, path: Path) -> int:
    """The config's own head_dim when it has one (Gemma 2: 256, not hidden/heads = 224)."""
    hd = cfg_int(cfg, ("head_dim", "attention_head_dim"), path, required=False)
    if hd is None:
        if hidden % n_heads:
            raise KVBenchError(
                f"{path}: no head_dim field and hidden size {hidden} is not divisible by {n_heads} heads"
            )
        hd = hidden // n_heads
    return hd


def mla(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """MLA (DeepSeek-V2/V3): the cache holds the kv_lora_rank latent plus the shared RoPE key."""
    lora = cfg_int(cfg, ("kv_lora_rank",), path, required=False)
    if lora is None:
        return {}
    rope = cfg_int(cfg, ("qk_rope_head_dim",), path, required=False)
    if rope is None:
        raise KVBenchError(f"{path}: kv_lora_rank is set (MLA) but qk_rope_head_dim is missing")
    nope = cfg_int(cfg, ("qk_nope_head_dim",), path, required=False)
    v = cfg_int(cfg, ("v_head_dim",), path, required=False)
    return {"kv_lora_rank": lora, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v}


def _from_layer_types(cfg: dict[str, Any], n_layers: int, path: Path) -> dict[str, Any]:
    types = cfg["layer_types"]
    if len(types) != n_layers:
        raise KVBenchError(f"{path}: layer_types lists {len(types)} layers, the model has {n_layers}")
    unknown = sorted({t for t in types if t not in LAYER_KINDS})
    if unknown:
        raise KVBenchError(f"{path}: layer_types contains {unknown[0]!r}, which this planner cannot size")
    kinds = {LAYER_KINDS[t] for t in types} - {"full"}
    if len(kinds) > 1:
        raise KVBenchError(f"{path}: layer_types mixes sliding and chunked attention; not supported")
    if not kinds:
        return {}
    kind = kinds.pop()
    field_name = "attention_chunk_size" if kind == "chunked" else "sliding_window"
    size = cfg_int(cfg, (field_name,), path, required=False)
    if not size:
        raise KVBenchError(f"{path}: layer_types has {kind} layers but {field_name} is missing or 0")
    layers = tuple(i for i, t in enumerate(types) if LAYER_KINDS[t] == kind)
    return {"sliding_window": size, "sliding_layers": layers, "window_kind": kind}


def _family_rule(cfg: dict[str, Any], model_type: str, n_layers: int) -> tuple[int, ...]:
    """Windowed layers of a config.json as written, with no layer_types (kvbench's own reader only)."""
    if model_type == "gemma2":  # older Gemma 2 config.json: even layers slide, odd layers are global
        return tuple(range(0, n_layers, 2))
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # older Gemma 3: every pattern-th layer is global
        return tuple(i for i in range(n_layers) if (i + 1) % pattern)
    if cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:  # Qwen2 with the window on
        return tuple(range(int(cfg["max_window_layers"]), n_layers))
    return tuple(range(n_layers))  # Mistral v0.1, Phi-3: every layer slides


def windows(cfg: dict[str, Any], model_type: str, n_layers: int, path: Path, resolved: bool) -> dict[str, Any]:
    """sliding_window, sliding_layers and window_kind, as transformers builds its cache (empty: all full)."""
    sharing = cfg.get("kv_sharing_modes")
    if isinstance(sharing, list) and "reuse" in sharing:
        raise KVBenchError(f"{path}: some layers reuse another layer's cache (kv sharing); not supported")
    if cfg.get("layer_types") is not None:
        return _from_layer_types(cfg, n_layers, path)
    if not resolved and cfg.get("use_sliding_window") is False:  # Qwen2: sliding_window is set but off
        return {}
    window = cfg_int(cfg, ("sliding_window",), path, required=False)
    if window:  # 0: no window
        layers = tuple(range(n_layers)) if resolved else _family_rule(cfg, model_type, n_layers)
        return {"sliding_window": window, "sliding_layers": layers, "window_kind": "sliding"}
    chunk = cfg_int(cfg, ("attention_chunk_size",), path, required=False)
    if chunk is not None:
        return {"sliding_window": chunk, "sliding_layers": tuple(range(n_layers)), "window_kind": "chunked"}
    return {}


def _state_windows(cfg: dict[str, Any], state: State, path: Path) -> dict[str, Any]:
    """A hybrid's windowed attention layers, numbered among its attention layers (the ones the plan counts)."""
    kinds = [state.layers.kinds[i] for i in state.layers.attention]
    kind_of = {"sliding_attention": "sliding", "hybrid_sliding": "sliding", "chunked_attention": "chunked"}
    found = {kind_of[k] for k in kinds if k in kind_of}
    if not found:
        return {}
    if len(found) > 1:
        raise KVBenchError(f"{path}: {state.layers.field} mixes sliding and chunked attention; not supported")
    kind = found.pop()
    keys = ("attention_chunk_size",) if kind == "chunked" else ("sliding_window", "attention_window_size")
    size = cfg_int(cfg, keys, path, required=False)
    if size is None:
        raise KVBenchError(f"{path}: {state.layers.field} has {kind} layers but {keys[0]} is missing")
    layers = tuple(i for i, k in enumerate(kinds) if kind_of.get(k) == kind)
    return {"sliding_window": size, "sliding_layers": layers, "window_kind": kind}


def _state_fields(state: State | None, n_layers: int) -> dict[str, Any]:
    if state is None:
        return {}
    return {
        "model_layers": n_layers,
        "state_layers": len(state.layers.state),
        "state_elements": state.elements,
        "state_working": state.working,
    }


def spec_from_fields(cfg: dict[str, Any], src: Source) -> ModelSpec:
    """The ModelSpec of one language model's fields (the text_config of a multimodal model). A model with recurrent
    layers (state.py) counts its attention layers only as cached layers, and carries its state's size beside."""
    path = src.path
    model_type = str(cfg.get("model_type") or "unknown")
    refuse_non_decoders(cfg, model_type, path)
    n_layers = cfg_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"), path)
    hidden = cfg_int(cfg, ("hidden_size", "n_embd", "d_model"), path)
    state = read_state(cfg, model_type, n_layers, path)
    n_attn = n_layers if state is None else len(state.layers.attention)
    n_heads = n_kv = hd = 0
    if n_attn:
        n_heads = cfg_int(cfg, ("num_attention_heads", "n_head", "num_heads"), path)
        n_kv = kv_heads(cfg, model_type, n_heads, path)
        hd = head_dim(cfg, hidden, n_heads, path)
    max_keys = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length")
    max_ctx = cfg_int(cfg, max_keys, path, False)
    layer_kv = _layer_kv(cfg, n_layers, n_heads, n_kv, hd, state, path) if n_attn else ()
    # recurrent layers, and layers of different shapes, have parameters the dense estimate does not describe:
    # counted on the meta device where transformers can
    dense = state is None and not any(f"{a}_per_layer" in cfg for a in PER_LAYER_KEYS)
    params = estimate_params(cfg, Shape(n_layers, n_heads, n_kv, hd, hidden)) if dense else None
    routing = routed_experts(cfg, n_layers, hidden, model_type) if params is not None else (0, 0, 0)
    notes = [src.note] if src.note else []
    if not max_ctx and n_attn:
        notes.append("config.json gives no max_position_embeddings: beyond-context warnings are off")
    if state is None:
        win = windows(cfg, model_type, n_layers, path, src.resolved)
    else:
        win = _state_windows(cfg, state, path) if n_attn else {}
    return ModelSpec(
        name=str(path),
        source=src.name_or_path or str(path),
        family=model_type,
        n_layers=n_attn,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=hd,
        hidden_size=hidden,
        max_context=max_ctx,
        params=params,
        params_estimated=params is not None,
        **win,
        **(mla(cfg, path) if n_attn else {}),
        wrapper=src.wrapper,
        vision_params=src.vision_params,
        resolved_by=src.resolved_by,
        note="; ".join(notes),
        **_state_fields(state, n_layers),
        layer_kv=layer_kv,
        experts=routing[0],
        experts_per_token=routing[1],
        expert_params=routing[2],
    )


# Attributes a config may set per layer that the planner reads layer by layer (resolve.py passes each as
# `<attr>_per_layer`); the parameters of such a model are counted on transformers' meta-device model.
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads", "num_attention_heads")


def _layer_kv(cfg: dict[str, Any], n_layers: int, n_heads: int, n_kv: int, hd: int, state, path: Path) -> tuple:
    """(key/value heads, head_dim) per layer where the config sets them per layer (resolve.py reads
    per_layer_config into `<attr>_per_layer`); () when every layer has the same."""
    if not any(f"{a}_per_layer" in cfg for a in PER_LAYER_KEYS):
        return ()
    heads = cfg.get("num_attention_heads_per_layer") or [n_heads] * n_layers
    kvs = cfg.get("num_key_value_heads_per_layer") or [n_kv] * n_layers
    dims = cfg.get("head_dim_per_layer") or [hd] * n_layers
    if not (len(heads) == len(kvs) == len(dims) == n_layers):
        raise KVBenchError(f"{path}: per-layer values for {len(dims)} layers, the model has {n_layers}")
    for i, (h, k, d) in enumerate(zip(heads, kvs, dims, strict=True)):  # each layer held to the global bounds
        for name, v in (("num_attention_heads", h), ("num_key_value_heads", k), ("head_dim", d)):
            if type(v) is not int or not 1 <= v <= MAX_WIDTH:
                raise KVBenchError(f"{path}: layer {i}'s {name} = {v!r} must be a whole number from 1 to {MAX_WIDTH:,}")
        if h % k:
            raise KVBenchError(f"{path}: layer {i}'s {h} attention heads are not a multiple of its {k} key/value heads")
    shapes = list(zip(kvs, dims, strict=True))
    if len(set(shapes)) <= 1:
        return ()
    if state is not None or cfg.get("kv_lora_rank") is not None:
        raise KVBenchError(f"{path}: per-layer key/value shapes on a hybrid or MLA model are not planned yet")
    return tuple(shapes)


# Architectures whose MLP is up + down (2 matrices); every other family here is gated (gate, up, down: SwiGLU/GeGLU).
NOT_GATED = {
    "gpt2",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "falcon",
    "phi",
    "opt",
    "bloom",
    "starcoder2",
    "mpt",
}
# Architectures with learned absolute positions: one hidden-wide row per position.
LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "gpt_neo", "opt"}
# Vision towers that are plain ViTs (patch embedding, positions, pre-norm blocks), so their size is arithmetic.
VIT_TYPES = {"clip_vision_model", "siglip_vision_model"}


@dataclass(frozen=True)
class Shape:
    """The attention shape already read from the config."""

    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    hidden: int


def _int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _attention(cfg: dict[str, Any], s: Shape) -> int:
    """Q, K, V and O projections of one layer (MLA: its low-rank Q and KV projections)."""
    lora = _int(cfg, "kv_lora_rank")
    if lora is None:
        return 2 * s.hidden * s.n_heads * s.head_dim + 2 * s.hidden * s.n_kv * s.head_dim
    rope, nope = _int(cfg, "qk_rope_head_dim") or 0, _int(cfg, "qk_nope_head_dim") or 0
    v_dim = _int(cfg, "v_head_dim") or nope
    q_rank, q_width = _int(cfg, "q_lora_rank"), s.n_heads * (nope + rope)
    q = s.hidden * q_width if q_rank is None else s.hidden * q_rank + q_rank + q_rank * q_width
    kv = s.hidden * (lora + rope) + lora + lora * s.n_heads * (nope + v_dim)
    return q + kv + s.n_heads * v_dim * s.hidden


def _experts(cfg: dict[str, Any]) -> int:
    return _int(cfg, "num_local_experts", "num_experts", "n_routed_experts") or 0


def _moe_layers(cfg: dict[str, Any], n_layers: int) -> int:
    """How many layers have a mixture-of-experts MLP, following each family's own rule."""
    if _experts(cfg) <= 1:
        return 0
    if isinstance(cfg.get("moe_layers"), list):  # Llama 4 (resolved)
        return len(cfg["moe_layers"])
    if "first_k_dense_replace" in cfg:  # DeepSeek: the first k layers are dense
        return max(0, n_layers - (_int(cfg, "first_k_dense_replace") or 0))
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen2/3-MoE
        step, dense = _int(cfg, "decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
        return sum(1 for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    if "interleave_moe_layer_step" in cfg:  # Llama 4 as written: every step-th layer
        step = _int(cfg, "interleave_moe_layer_step") or 1
        return len(range(step - 1, n_layers, step))
    return n_layers  # Mixtral and the like: every layer


def routed_experts(cfg: dict[str, Any], n_layers: int, hidden: int, model_type: str) -> tuple[int, int, int]:
    """A mixture of experts' routing, for the decode floor (planner.step_params): routed experts per MoE layer,
    the top-k each token activates (num_experts_per_tok) and one routed expert's parameters over the MoE layers,
    as `_mlp` counts them. Zeros for a dense model, or where every token takes every expert."""
    experts, k, n_moe = _experts(cfg), _int(cfg, "num_experts_per_tok"), _moe_layers(cfg, n_layers)
    inter = _int(cfg, "moe_intermediate_size") or _int(cfg, "intermediate_size", "n_inner", "ffn_hidden_size")
    if not n_moe or not k or k >= experts or not inter:
        return 0, 0, 0
    mats = 2 if model_type in NOT_GATED else 3
    return experts, k, n_moe * mats * hidden * inter


def _shared_expert(cfg: dict[str, Any], hidden: int, mats: int) -> int:
    """Always-on experts beside the routed ones (DeepSeek, Qwen2-MoE, Llama 4), per MoE layer."""
    moe_inter = _int(cfg, "moe_intermediate_size") or 0
    shared, shared_inter = _int(cfg, "n_shared_experts"), _int(cfg, "shared_expert_intermediate_size")
    if shared:
        return mats * hidden * moe_inter * shared
    if shared_inter:
        return mats * hidden * shared_inter + hidden  # + its sigmoid gate
    if str(cfg.get("model_type", "")).startswith("llama4"):
        return mats * hidden * (_int(cfg, "intermediate_size") or 0)
    return 0


def _mlp(cfg: dict[str, Any], s: Shape, model_type: str) -> int | None:
    """MLP parameters over all layers: dense layers, routed experts, shared experts and routers."""
    inter = _int(cfg, "intermediate_size", "n_inner", "ffn_hidden_size")
    if inter is None and model_type in ("gpt2", "falcon", "gpt_bigcode"):
        inter = 4 * s.hidden
    if inter is None:
        return None
    mats = 2 if model_type in NOT_GATED else 3
    n_moe, experts = _moe_layers(cfg, s.n_layers), _experts(cfg)
    dense_inter = _int(cfg, "intermediate_size_mlp") or inter
    dense = (s.n_layers - n_moe) * mats * s.hidden * dense_inter
    if not n_moe:
        return dense
    expert_inter = _int(cfg, "moe_intermediate_size") or inter
    per_moe = experts * mats * s.hidden * expert_inter + s.hidden * experts  # experts + router
    return dense + n_moe * (per_moe + _shared_expert(cfg, s.hidden, mats))


def estimate_params(cfg: dict[str, Any], s: Shape) -> int | None:
    """Parameters of the language model (None when the vocabulary or the MLP width is not given)."""
    model_type = str(cfg.get("model_type", ""))
    vocab = _int(cfg, "vocab_size")
    mlp = _mlp(cfg, s, model_type)
    if vocab is None or mlp is None:
        return None
    tied = cfg.get("tie_word_embeddings", True) is not False  # transformers' base default is tied
    embeddings = vocab * s.hidden * (1 if tied else 2)
    if model_type in LEARNED_POSITIONS:
        embeddings += (_int(cfg, "max_position_embeddings", "n_positions") or 0) * s.hidden
    norms = 2 * s.hidden * s.n_layers + s.hidden
    return embeddings + s.n_layers * _attention(cfg, s) + mlp + norms


def estimate_vision_params(vision: dict[str, Any]) -> int | None:
    """A ViT vision tower (CLIP, SigLIP): patch embedding, positions, blocks, norms (None for other towers)."""
    if vision.get("model_type") not in VIT_TYPES:
        return None
    h, inter = _int(vision, "hidden_size"), _int(vision, "intermediate_size")
    layers = _int(vision, "num_hidden_layers")
    patch, image = _int(vision, "patch_size"), _int(vision, "image_size")
    if h is None or inter is None or layers is None or patch is None or image is None:
        return None
    clip = vision["model_type"] == "clip_vision_model"  # a class token and a pre-norm besides SigLIP's layout
    positions = (image // patch) ** 2 + (1 if clip else 0)
    embed = (_int(vision, "num_channels") or 3) * patch * patch * h + h + positions * h + (2 * h if clip else 0)
    block = 4 * (h * h + h) + 2 * h * inter + inter + h + 4 * h  # attention, MLP (with biases), two LayerNorms
    return embed + layers * block + 2 * h + (h if clip else 0)
