"""Parameters of a decoder LLM from its config.json fields: dense, mixture-of-experts, MLA, and a vision tower.

An estimate, and it says so: embeddings, attention, MLP (every expert, shared experts and the router), norms;
biases are left out (under 0.1% of any model here). It reads the fields transformers resolved (class defaults
filled in) when it could, else the config.json as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures whose MLP is up + down (2 matrices); every other family here is gated (gate, up, down: SwiGLU/GeGLU).
NOT_GATED = {
    "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "falcon", "phi", "opt", "bloom", "starcoder2", "mpt",
}  # fmt: skip
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


def _shared_expert(cfg: dict[str, Any], hidden: int, mats: int) -> int:
    """Always-on experts beside the routed ones (DeepSeek, Qwen2-MoE, Llama 4), per MoE layer."""
    moe_inter = _int(cfg, "moe_intermediate_size") or 0
    if _int(cfg, "n_shared_experts"):
        return mats * hidden * moe_inter * _int(cfg, "n_shared_experts")
    if _int(cfg, "shared_expert_intermediate_size"):
        return mats * hidden * _int(cfg, "shared_expert_intermediate_size") + hidden  # + its sigmoid gate
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
    if None in (h, inter, layers, patch, image):
        return None
    clip = vision["model_type"] == "clip_vision_model"  # a class token and a pre-norm besides SigLIP's layout
    positions = (image // patch) ** 2 + (1 if clip else 0)
    embed = (
        (_int(vision, "num_channels") or 3) * patch * patch * h + h + positions * h + (2 * h if clip else 0)
    )
    block = (
        4 * (h * h + h) + 2 * h * inter + inter + h + 4 * h
    )  # attention, MLP (with biases), two LayerNorms
    return embed + layers * block + 2 * h + (h if clip else 0)
