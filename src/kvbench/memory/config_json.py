"""Reading a Hugging Face config.json and checking every field the planner uses, before any other work.

A wrong type, a zero, a negative, a float where a whole number is needed, or a size beyond any real model is one
line naming the file and the field: the arithmetic never sees it, and transformers never gets to guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench import files
from kvbench.errors import KVBenchError
from kvbench.memory.units import MAX_EXPERTS, MAX_LAYERS, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH, fmt_int

MAX_CONFIG_BYTES = files.CONFIG_BYTES  # a config.json is a few KB; a file this large is something else

# field -> (smallest, largest) allowed value. Absent or null fields are fine (transformers fills them in).
_INT_FIELDS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "num_key_value_heads",
            "num_kv_heads",
            "multi_query_group_num",
            "hidden_size",
            "n_embd",
            "d_model",
            "head_dim",
            "intermediate_size",
            "n_inner",
            "ffn_hidden_size",
            "moe_intermediate_size",
            "intermediate_size_mlp",
            "shared_expert_intermediate_size",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "q_lora_rank",
        ),
        (1, MAX_WIDTH),
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "seq_length",
            "max_sequence_length",
            "sliding_window",
            "attention_chunk_size",
        ),
        (1, MAX_TOKENS),
    ),  # fmt: skip
    "vocab_size": (1, MAX_VOCAB),
    **dict.fromkeys(
        ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok"), (1, MAX_EXPERTS)
    ),
    **dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "max_window_layers"), (0, MAX_LAYERS)),
    **dict.fromkeys(
        ("decoder_sparse_step", "sliding_window_pattern", "interleave_moe_layer_step"), (1, MAX_LAYERS)
    ),
}
_BOOL_FIELDS = (
    "use_sliding_window", "tie_word_embeddings", "multi_query", "new_decoder_architecture", "is_encoder_decoder",
)  # fmt: skip
_STR_FIELDS = ("model_type", "hidden_act", "hidden_activation", "activation_function", "_name_or_path")


def read_config_json(path: Path, flag: str = "--config") -> dict[str, Any]:
    """The JSON object in `path`, or one line saying why it is not a config.json (naming the option, `flag`, that
    gave it)."""
    where = f"{flag} {path}"
    fix = "give the config.json file inside it" if path.is_dir() else "give a config.json file"
    cfg = files.load_json(path, where, MAX_CONFIG_BYTES, "a config.json", fix=fix)
    if not isinstance(cfg, dict):
        raise KVBenchError(f"{where}: expected a JSON object (a Hugging Face config.json)")
    check_fields(cfg, path)
    return cfg


# Sizes a config may give per layer, as a list of whole numbers (Gemma 3n's intermediate_size).
_PER_LAYER_FIELDS = ("intermediate_size",)


def _check_int(value: Any, key: str, path: Path) -> None:
    field = key.rpartition(".")[2].split("[")[0]
    lo, hi = _INT_FIELDS[field]
    if (
        isinstance(value, list)
        and "[" not in key
        and field in _PER_LAYER_FIELDS
        and 0 < len(value) <= MAX_LAYERS
    ):
        for i, v in enumerate(value):
            _check_int(v, f"{key}[{i}]", path)
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "true/false" if isinstance(value, bool) else type(value).__name__
        raise KVBenchError(f"{path}: {key} = {json.dumps(value)} must be a whole number ({kind} given)")
    if not lo <= value <= hi:
        raise KVBenchError(f"{path}: {key} = {value} must be from {lo} to {fmt_int(hi)}")


def check_fields(cfg: dict[str, Any], path: Path, prefix: str = "") -> None:
    """Type and range of every field the planner reads, in cfg and in a nested text_config."""
    for key, value in cfg.items():
        name = prefix + key
        if value is None:
            continue
        if key in _INT_FIELDS:
            _check_int(value, name, path)
        elif key in _BOOL_FIELDS and not isinstance(value, bool):
            raise KVBenchError(f"{path}: {name} = {json.dumps(value)} must be true or false")
        elif key in _STR_FIELDS and not isinstance(value, str):
            raise KVBenchError(f"{path}: {name} = {json.dumps(value)} must be a string")
    _check_lists(cfg, path, prefix)
    for sub in ("text_config", "vision_config"):
        if cfg.get(sub) is not None:
            if not isinstance(cfg[sub], dict):
                raise KVBenchError(f"{path}: {prefix}{sub} must be a JSON object")
            check_fields(cfg[sub], path, f"{prefix}{sub}.")


def _check_lists(cfg: dict[str, Any], path: Path, prefix: str) -> None:
    types = cfg.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or len(types) > MAX_LAYERS or not all(isinstance(t, str) for t in types)
    ):
        raise KVBenchError(f"{path}: {prefix}layer_types must be a list of layer type names")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise KVBenchError(f"{path}: {prefix}architectures must be a list of class names")
    for key in ("mlp_only_layers", "moe_layers", "no_rope_layers"):
        v = cfg.get(key)
        if v is not None and (
            not isinstance(v, list) or len(v) > MAX_LAYERS or not all(type(i) is int and i >= 0 for i in v)
        ):
            raise KVBenchError(f"{path}: {prefix}{key} must be a list of layer indices")
