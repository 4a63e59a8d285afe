"""Models that keep a fixed-size recurrent state instead of a KV cache, in some layers or in all of them.

State-space models (Mamba, Mamba2), RWKV, xLSTM and linear-attention layers carry a state per sequence whose size
does not depend on the context: nothing grows per token, so there is no KV cache to plan for them. A hybrid (Jamba,
Zamba, Zamba2, Bamba, Falcon-H1, Nemotron-H, Qwen3-Next, ...) caches K and V in its attention layers only. This
module reads, from a config's fields, which layers attend (and so cache K/V) and which keep a state, and how many
elements that state holds per sequence where the config says enough to compute it.

transformers 5 names every layer's kind in `layer_types` (full_attention, sliding_attention, linear_attention,
conv, hybrid, mlp, ...) for the hybrids it knows; older or unknown configs say it with `layers_block_type`,
`hybrid_override_pattern`, `attn_layer_period`/`attn_layer_offset` or `attn_layer_indices`, all read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.memory.units import fmt_int

# Families with no attention layer at all: every layer keeps a state.
RECURRENT_TYPES = {"mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm"}
# A layer kind -> (caches K/V, keeps a state). The window of an attention kind is read by hf_fields.
KINDS: dict[str, tuple[bool, bool]] = {
    **dict.fromkeys(("full_attention", "sliding_attention", "chunked_attention", "attention"), (True, False)),
    **dict.fromkeys(("linear_attention", "mamba", "mamba2", "conv", "recurrent", "ssm"), (False, True)),
    **dict.fromkeys(("hybrid", "hybrid_sliding"), (True, True)),  # a state block and an attention block
    **dict.fromkeys(("mlp", "moe", "dummy"), (False, False)),  # no sequence mixing: nothing held per token
}
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern's letters


@dataclass(frozen=True)
class Layers:
    """What each decoder layer holds per sequence, read from the config."""

    kinds: list[str]  # per layer, a key of KINDS
    field: str  # the config field they were read from, for notes

    @property
    def attention(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if KINDS[k][0]]

    @property
    def state(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if KINDS[k][1]]


def _indices(value: Any, key: str, n_layers: int, path: Path) -> set[int]:
    if not isinstance(value, list) or not all(type(i) is int and 0 <= i < n_layers for i in value):
        raise KVBenchError(f"{path}: {key} must be a list of layer indices below {n_layers}")
    return set(value)


def _kinds(cfg: dict[str, Any], model_type: str, n_layers: int, path: Path) -> tuple[list[str], str] | None:
    """(per-layer kinds, the field read), or None for an ordinary transformer (every layer attends)."""
    if model_type in RECURRENT_TYPES:
        return ["recurrent"] * n_layers, "model_type"
    types = cfg.get("layer_types")
    if isinstance(types, list) and any(
        t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types
    ):
        return list(types), "layer_types"
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, list):
        return [str(b) for b in blocks], "layers_block_type"
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise KVBenchError(f"{path}: hybrid_override_pattern has {unknown[0]!r}, which this planner cannot size")
        return [PATTERN[c] for c in pattern], "hybrid_override_pattern"
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset", 0)
    if period is not None:
        if type(period) is not int or period < 1 or type(offset) is not int or not 0 <= offset < period:
            raise KVBenchError(
                f"{path}: attn_layer_period {period!r} / attn_layer_offset {offset!r} are not a layer pattern"
            )
        return ["attention" if i % period == offset else "mamba" for i in range(n_layers)], "attn_layer_period"
    for key in ("attn_layer_indices", "hybrid_layer_ids", "full_attn_idxs"):
        if cfg.get(key) is not None:
            attn = _indices(cfg[key], key, n_layers, path)
            other = "hybrid" if key == "hybrid_layer_ids" else "mamba" if key != "full_attn_idxs" else "conv"
            return ["attention" if i in attn else other for i in range(n_layers)], key
    return None


def layers(cfg: dict[str, Any], model_type: str, n_layers: int, path: Path) -> Layers | None:
    """Which layers cache K/V and which keep a state; None when every layer is attention (no state anywhere)."""
    found = _kinds(cfg, model_type, n_layers, path)
    if found is None:
        return None
    kinds, field = found
    if len(kinds) != n_layers:
        raise KVBenchError(f"{path}: {field} lists {len(kinds)} layers, the model has {n_layers}")
    unknown = sorted({k for k in kinds if k not in KINDS})
    if unknown:
        raise KVBenchError(f"{path}: {field} contains {unknown[0]!r}, which this planner cannot size")
    if not any(KINDS[k][1] for k in kinds):
        return None
    return Layers(kinds, field)


# --- the state of one layer, per sequence ---------------------------------------------------------------------------
def _int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if type(v) is int and v > 0:
            return v
    return None


def _num(cfg: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = cfg.get(k)
        if (type(v) is int or type(v) is float) and v > 0:
            return v
    return None


def _mamba(cfg: dict[str, Any], model_type: str) -> tuple[int, str] | None:
    """Mamba (conv state d_inner x d_conv + SSM state d_inner x d_state) or Mamba2 (conv over d_inner plus the B
    and C groups, SSM state heads x head_dim x d_state), as transformers' Mamba caches allocate them."""
    hidden = _int(cfg, "hidden_size", "d_model")
    d_state = _int(cfg, "state_size", "mamba_d_state", "ssm_state_size")
    d_conv = _int(cfg, "conv_kernel", "mamba_d_conv")
    if hidden is None or d_state is None or d_conv is None:
        return None
    head_keys = ("mamba_d_head", "mamba_head_dim", "mamba_headdim") + (("head_dim",) if model_type == "mamba2" else ())
    heads = _int(
        cfg,
        "mamba_n_heads",
        "mamba_num_heads",
        "n_mamba_heads",
        *(("num_heads",) if model_type == "mamba2" else ()),
    )
    head_dim = _int(cfg, *head_keys)
    if heads is not None and head_dim is not None:  # Mamba2
        groups = _int(cfg, "n_groups", "mamba_n_groups", "mamba_ngroups") or 1
        inner = heads * head_dim
        n = (inner + 2 * groups * d_state) * d_conv + inner * d_state
        return n, (
            f"({fmt_int(inner)} d_inner + 2 x {groups} groups x {d_state} d_state) x {d_conv} conv_kernel + "
            f"{heads} heads x {head_dim} head_dim x {d_state} d_state"
        )
    expand = _num(cfg, "expand", "mamba_expand")
    given = _int(cfg, "intermediate_size") if model_type in ("mamba", "falcon_mamba") else None
    d_inner = given or (int(expand * hidden) if expand else None)
    if d_inner is None:
        return None
    return d_inner * (d_state + d_conv), (f"{fmt_int(d_inner)} d_inner x ({d_state} d_state + {d_conv} conv_kernel)")


def _gated_delta(cfg: dict[str, Any]) -> tuple[int, str] | None:
    """Gated DeltaNet (Qwen3-Next and kin): a causal conv over q, k, v and one dk x dv matrix per value head."""
    kh, vh = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
    dk, dv = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
    conv = _int(cfg, "linear_conv_kernel_dim")
    if kh is None or vh is None or dk is None or dv is None or conv is None:
        return None
    n = (2 * kh * dk + vh * dv) * conv + vh * dk * dv
    return n, f"(2 x {kh} x {dk} + {vh} x {dv}) x {conv} conv_kernel + {vh} value heads x {dk} x {dv}"


def _rwkv(cfg: dict[str, Any]) -> tuple[int, str] | None:
    hidden = _int(cfg, "hidden_size")
    if hidden is None:
        return None
    att = _int(cfg, "attention_hidden_size") or hidden
    return 2 * hidden + 3 * att, f"2 x {hidden} hidden + 3 x {att} attention_hidden_size"


def _xlstm(cfg: dict[str, Any]) -> tuple[int, str] | None:
    """mLSTM: per head a qk x v memory matrix, a qk normaliser and a scalar stabiliser."""
    heads, hidden = _int(cfg, "num_heads"), _int(cfg, "hidden_size")
    if heads is None or hidden is None:
        return None
    qk = _int(cfg, "qk_head_dim") or int(hidden * (_num(cfg, "qk_dim_factor") or 0.5)) // heads
    v = _int(cfg, "v_head_dim") or int(hidden * (_num(cfg, "v_dim_factor") or 1.0)) // heads
    return heads * (qk * v + qk + 1), f"{heads} heads x ({qk} x {v} + {qk} + 1)"


def _conv(cfg: dict[str, Any]) -> tuple[int, str] | None:
    """A short convolution layer (LFM2): hidden x its cached window."""
    hidden, window = _int(cfg, "hidden_size"), _int(cfg, "conv_L_cache")
    if hidden is None or window is None:
        return None
    return hidden * window, f"{hidden} hidden x {window} conv_L_cache"


def state_per_layer(cfg: dict[str, Any], model_type: str) -> tuple[int, str] | None:
    """(elements of one recurrent layer's state for one sequence, the formula with this config's numbers), or None
    when the config does not say enough (or the family's state is not sized here)."""
    if model_type == "rwkv":
        return _rwkv(cfg)
    if model_type == "xlstm":
        return _xlstm(cfg)
    if model_type.startswith("lfm2"):
        return _conv(cfg)
    return _gated_delta(cfg) or _mamba(cfg, model_type)


@dataclass(frozen=True)
class State:
    """The recurrent side of a model, for ModelSpec."""

    layers: Layers
    elements: int | None  # per sequence, summed over the state layers (None: not sized from this config)
    working: str  # "2 layers x (...) = 3,072 elements", or why it is not sized


def read_state(cfg: dict[str, Any], model_type: str, n_layers: int, path: Path) -> State | None:
    """The model's state layers and their size per sequence; None for an ordinary transformer."""
    found = layers(cfg, model_type, n_layers, path)
    if found is None:
        return None
    n = len(found.state)
    per = state_per_layer(cfg, model_type)
    if per is None:
        return State(found, None, f"{n} layers keep a recurrent state; its size is not computed for {model_type}")
    elements, how = per
    return State(found, n * elements, f"{n} layers x {how} = {fmt_int(n * elements)} elements")
