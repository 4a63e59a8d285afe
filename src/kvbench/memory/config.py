"""A config.json for the planner: found from --model, read and checked field by field, resolved as transformers does.

`kvbench memory --model NAME` names a preset, a local model directory or config.json, or a hub id. As hf-mem and
accelerate's estimate-memory do, a name that is neither a preset nor a local path is a Hugging Face hub id, and only
its config.json is fetched (huggingface_hub, into the usual cache). With HF_HUB_OFFLINE set, a config.json already
in the cache is used and anything else is one line naming the id and HF_HUB_OFFLINE.

Every field the planner uses is checked before any other work: a wrong type, a zero, a negative, a float where a
whole number is needed, or a size beyond any real model is one line naming the file and the field. The arithmetic
never sees it, and transformers never gets to guess.

A published config.json leaves out whatever its model class defaults: Gemma 3 omits its 5-local-to-1-global layer
pattern and (in a multimodal `text_config`) even its head count, Qwen2 omits `use_sliding_window`, Falcon-7B omits
`max_position_embeddings`. Reading the file by hand means guessing those. So the file goes through transformers' own
config class (`AutoConfig`, from the local file, no network), and the planner reads the resolved fields of its
language model (`get_text_config(decoder=True)`). A model type transformers lacks falls back to kvbench's own
reader, and the plan says so. transformers (and with it torch) is imported here only, on the --config path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench import files
from kvbench.errors import KVBenchError
from kvbench.memory.hf_fields import PER_LAYER_KEYS, Source, estimate_vision_params, spec_from_fields
from kvbench.memory.spec import ModelSpec
from kvbench.memory.units import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    fmt_int,
    fmt_params,
)

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
    ),
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "seq_length",
            "max_sequence_length",
            "attention_chunk_size",
        ),
        (1, MAX_TOKENS),
    ),
    # 0: no window (Qwen2-MoE's default config writes sliding_window 0 beside use_sliding_window false)
    "sliding_window": (0, MAX_TOKENS),
    "vocab_size": (1, MAX_VOCAB),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok"), (1, MAX_EXPERTS)),
    **dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "max_window_layers"), (0, MAX_LAYERS)),
    **dict.fromkeys(("decoder_sparse_step", "sliding_window_pattern", "interleave_moe_layer_step"), (1, MAX_LAYERS)),
}
_BOOL_FIELDS = (
    "use_sliding_window",
    "tie_word_embeddings",
    "multi_query",
    "new_decoder_architecture",
    "is_encoder_decoder",
)
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
    if isinstance(value, list) and "[" not in key and field in _PER_LAYER_FIELDS and 0 < len(value) <= MAX_LAYERS:
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


# Attributes read through the config object (attribute_map aliases, properties, values set in __post_init__) on
# top of its to_dict(), so the field dict holds what the model class itself would use.
_RESOLVED_ATTRS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "intermediate_size",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
    "attention_chunk_size",
    "kv_sharing_modes",
    # recurrent layers (state.py): which layers they are, and their state's shape
    "layers_block_type",
    "num_heads",
    "expand",
    "state_size",
    "conv_kernel",
    "n_groups",
    "qk_head_dim",
    "v_head_dim",
    "attention_head_dim",
)


@dataclass
class Resolved:
    """A config.json read for planning: the spec, and transformers' config object when it could resolve it."""

    spec: ModelSpec  # what the planner uses
    config: Any | None  # transformers' PreTrainedConfig (the whole model), None on the fallback path
    text_config: Any | None  # its language model's config (the config itself for a text-only model)
    why_not: str = ""  # why transformers could not resolve it (fallback path), for notes and --check


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' log messages below ERROR, its progress bars, huggingface_hub's download bars and Python
    warnings off the terminal while it resolves, builds or loads a model; everything restored afterwards."""
    # transformers (and torch) only on the --config path: the planner runs on the standard library
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    hub_bars = are_progress_bars_disabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()
        if not hub_bars:
            enable_progress_bars()


def _auto_config(raw: dict[str, Any], path: Path) -> tuple[Any | None, str]:
    """transformers' config object for this file, or (None, why not) when transformers does not know the type."""
    try:  # only on the --config path, and a transformers that cannot be imported is a reason to fall back
        import transformers
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError as e:
        return None, f"transformers cannot be imported ({e})"
    model_type = raw.get("model_type")
    if not model_type:
        return None, "the config.json has no model_type"
    if model_type not in CONFIG_MAPPING:
        return None, f"transformers {transformers.__version__} has no model_type {model_type!r}"
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False), ""
    except Exception as e:  # the config class is transformers' code: whatever it raises, it rejects the file
        why = f"{type(e).__name__}: {' '.join(str(e).split())}" if str(e).strip() else type(e).__name__
        raise KVBenchError(f"{path}: transformers' {model_type} config class rejects it: {why}") from None


def _fields(config: Any) -> dict[str, Any]:
    """The config's fields and the attributes its class derives from them; a sub-config transformers kept as a plain
    dict is read as it is. A derived attribute the class cannot compute is the file's error, in one line."""
    if isinstance(config, dict):
        return dict(config)
    fields = config.to_dict()
    # transformers 5.x heterogeneous configs: every attribute a layer may override, read layer by layer
    per_layer = sorted(getattr(config, "per_layer_attributes", None) or ())
    for attr in per_layer:
        _per_layer_values(config, attr, fields)
    for attr in _RESOLVED_ATTRS:
        if attr in per_layer:
            continue
        try:
            fields[attr] = getattr(config, attr)
        except AttributeError:
            continue
        except Exception as e:  # a property of transformers' class, computed from the file's values
            raise KVBenchError(
                f"transformers' {type(config).__name__} cannot derive {attr} from this config: "
                f"{type(e).__name__}: {' '.join(str(e).split())}"
            ) from None
    return fields


def _per_layer_values(config: Any, attr: str, fields: dict[str, Any]) -> None:
    """An attribute the config sets per layer (transformers 5.x per_layer_config): one value where every layer has
    the same, else the list as `<attr>_per_layer` beside layer 0's value; one line for any other attribute that
    varies, which the planner holds once for every layer."""
    values = [getattr(layer, attr, None) for layer in config.per_layer_config]
    fields[attr] = values[0]
    if len(set(map(repr, values))) == 1:
        return
    if attr in PER_LAYER_KEYS:
        fields[f"{attr}_per_layer"] = values
        return
    shown = ", ".join(f"{v}" for v in dict.fromkeys(values))
    raise KVBenchError(
        f"{config.model_type} sets {attr} per layer ({shown} across its {len(values)} layers); the planner holds one "
        f"{attr} for every layer (it plans head_dim and key/value heads per layer) and cannot plan this model yet"
    )


def _vision(config: Any) -> tuple[int | None, str]:
    """The vision tower's parameters when it is a plain ViT, and a note stating it either way."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None, ""
    v = _fields(vision)
    n = estimate_vision_params(v)
    size = f", ~{fmt_params(n)} params (its projector not counted)" if n else " (not sized)"
    return (
        n,
        f"vision tower {v.get('model_type')}: {v.get('num_hidden_layers')} layers x {v.get('hidden_size')}{size}",
    )


def _transformers_spec(config: Any, path: Path, raw: dict[str, Any]) -> Resolved:
    # transformers (and torch) only on the --config path: the planner runs on the standard library
    import transformers

    text = config.get_text_config(decoder=True)
    wrapper = config.model_type if text is not config else None
    vision_params, vision_note = _vision(config)
    src = Source(
        path=path,
        resolved_by=f"transformers {transformers.__version__} ({type(text).__name__})",
        resolved=True,
        wrapper=wrapper,
        vision_params=vision_params,
        name_or_path=raw.get("_name_or_path") or None,
        note=vision_note,
    )
    spec = spec_from_fields(_fields(text), src)
    if (spec.state_layers or spec.layer_kv) and spec.params is None:
        spec = _counted_params(spec, text)
    return Resolved(spec, config, text)


def _counted_params(spec: ModelSpec, text: Any) -> ModelSpec:
    """A model with recurrent layers, or with layers of different shapes: its parameters counted on transformers'
    own model, built on the meta device (no memory), since the dense-transformer estimate does not describe them."""
    # transformers (and torch) only on the --config path: the planner runs on the standard library
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, NotImplementedError, ImportError):
        return spec  # no parameter count: the plan has no weights line, and says so
    n = sum(p.numel() for p in model.parameters())
    note = "; ".join(x for x in (spec.note, "parameters counted on transformers' model built on the meta device") if x)
    return dataclasses.replace(spec, params=n, params_estimated=False, note=note)


def _fallback_spec(raw: dict[str, Any], path: Path, why: str) -> Resolved:
    """kvbench's own reader over the file as written (no class defaults), with a note saying so."""
    fields, wrapper = raw, None
    if isinstance(raw.get("text_config"), dict) and "num_hidden_layers" not in raw:
        fields, wrapper = raw["text_config"], raw.get("model_type")
    note = f"{why}: read by kvbench's own reader, which cannot fill in class defaults; --check cannot verify it"
    src = Source(
        path=path,
        resolved_by="kvbench's own reader",
        resolved=False,
        wrapper=wrapper,
        name_or_path=raw.get("_name_or_path") or None,
        note=note,
    )
    return Resolved(spec_from_fields(fields, src), None, None, why_not=why)


def resolve_config(path: str | Path, flag: str = "--config") -> Resolved:
    """Read, check and resolve a config.json: transformers' config class when it knows the type, else our reader.
    flag: the option that named it, for the error lines."""
    path = Path(path)
    raw = read_config_json(path, flag)  # every field checked before transformers is imported
    config, why = _auto_config(raw, path)
    if config is None:
        return _fallback_spec(raw, path, why)
    return _transformers_spec(config, path, raw)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_local(name: str) -> bool:
    """A path on this machine: a model directory or a config.json file."""
    return bool(name.strip()) and Path(name).expanduser().exists()


def resolve_local(name: str) -> Resolved:
    """A model directory (its config.json) or a config.json path, resolved as --config resolves it."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise KVBenchError(f"--model {name}: a directory without a config.json; not a Hugging Face model")
    return resolve_config(path, "--model")


def _hub_config(repo_id: str) -> Path:
    """The hub id's config.json on this machine: from the cache, or fetched unless HF_HUB_OFFLINE is set."""
    # only for a hub id: presets and local files never import huggingface_hub
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if hub_offline():
        raise KVBenchError(
            f"--model {repo_id} is a hub id and HF_HUB_OFFLINE is set (its config.json is not in the local cache): "
            "unset HF_HUB_OFFLINE, or give a local model directory or config.json"
        )
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # huggingface_hub raises many types: not found, gated, no network
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise KVBenchError(f"--model {repo_id}: cannot fetch its config.json from the hub: {why}") from None


def resolve_hub(repo_id: str) -> Resolved:
    """A hub id's config.json, resolved, and named by the id."""
    r = resolve_config(_hub_config(repo_id))
    return dataclasses.replace(r, spec=dataclasses.replace(r.spec, name=repo_id, source=repo_id))


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name.strip())) and not name.startswith(".")
