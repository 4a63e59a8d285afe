"""Resolving a config.json the way transformers does, before the planner's arithmetic sees it.

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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.memory.config_json import read_config_json
from kvbench.memory.hf_fields import PER_LAYER_KEYS, Source, spec_from_fields
from kvbench.memory.params import estimate_vision_params
from kvbench.memory.spec import ModelSpec
from kvbench.memory.units import fmt_params

# Attributes read through the config object (attribute_map aliases, properties, values set in __post_init__) on
# top of its to_dict(), so the field dict holds what the model class itself would use.
_RESOLVED_ATTRS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
    "max_position_embeddings", "vocab_size", "intermediate_size", "tie_word_embeddings", "layer_types",
    "sliding_window", "attention_chunk_size", "kv_sharing_modes",
    # recurrent layers (state.py): which layers they are, and their state's shape
    "layers_block_type", "num_heads", "expand", "state_size", "conv_kernel", "n_groups", "qk_head_dim", "v_head_dim",
    "attention_head_dim",
)  # fmt: skip


@dataclass
class Resolved:
    """A config.json read for planning: the spec, and transformers' config object when it could resolve it."""

    spec: ModelSpec  # what the planner uses
    config: Any | None  # transformers' PreTrainedConfig (the whole model), None on the fallback path
    text_config: Any | None  # its language model's config (the config itself for a text-only model)
    why_not: str = ""  # why transformers could not resolve it (fallback path), for notes and --check


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own warnings and log lines stay off the terminal while it resolves or builds a model."""
    # transformers (and torch) only on the --config path: the planner runs on the standard library
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


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
    note = "; ".join(
        x for x in (spec.note, "parameters counted on transformers' model built on the meta device") if x
    )
    return dataclasses.replace(spec, params=n, params_estimated=False, note=note)


def _fallback_spec(raw: dict[str, Any], path: Path, why: str) -> Resolved:
    """kvbench's own reader over the file as written (no class defaults), with a note saying so."""
    fields, wrapper = raw, None
    if isinstance(raw.get("text_config"), dict) and "num_hidden_layers" not in raw:
        fields, wrapper = raw["text_config"], raw.get("model_type")
    note = (
        f"{why}: read by kvbench's own reader, which cannot fill in class defaults; --check cannot verify it"
    )
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


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Any Hugging Face config.json as a ModelSpec, or one line naming the field it cannot interpret."""
    return resolve_config(path).spec
