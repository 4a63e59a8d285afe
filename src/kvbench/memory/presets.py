"""The shipped presets: model shapes from configs/models.toml, GPUs from configs/gpus.toml, looked up by name.

stdlib only (tomllib, through kvbench.files), so listing and planning presets never imports torch or transformers.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from kvbench import files
from kvbench.errors import KVBenchError
from kvbench.memory.spec import WINDOW_KINDS, GPUSpec, ModelSpec, parse_bandwidth
from kvbench.memory.units import MAX_LAYERS, MAX_TOKENS, MAX_WIDTH, parse_bytes
from kvbench.resources import config_file

MODELS_TOML = config_file("models.toml")
GPUS_TOML = config_file("gpus.toml")

_MODEL_REQUIRED = (
    "source",
    "family",
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "hidden",
    "max_context",
    "params",
)
_MODEL_OPTIONAL = (
    "sliding_window",
    "sliding_layers",
    "window_kind",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "wrapper",
    "vision_params",
    "note",
)
_LIMITS = {"layers": MAX_LAYERS, "max_context": MAX_TOKENS, "sliding_window": MAX_TOKENS, "params": 10**15}


def read_toml(path: Path, what: str = "preset file") -> dict[str, Any]:
    """A TOML file as a dict, or one line saying why it cannot be read."""
    return files.load_toml(path, f"{what} {path}", files.CONFIG_BYTES, f"a {what}")


def _check_keys(table: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...], where: str) -> None:
    unknown = [k for k in table if k not in required and k not in optional]
    if unknown:
        raise KVBenchError(f"unknown key {unknown[0]!r} in {where}; known keys: {', '.join(required + optional)}")
    missing = [k for k in required if k not in table]
    if missing:
        raise KVBenchError(f"missing key {missing[0]!r} in {where}")


def _positive_int(t: dict[str, Any], key: str, where: str) -> int:
    value, limit = t[key], _LIMITS.get(key, MAX_WIDTH)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise KVBenchError(f"{key} = {value!r} in {where} must be a whole number from 1 to {limit:,}")
    return value


def _sliding_layers(value: Any, n_layers: int, where: str) -> tuple[int, ...]:
    """'all', 'even' (0, 2, 4, ... as Gemma 2), or an explicit list of layer indices."""
    if value == "all":
        return tuple(range(n_layers))
    if value == "even":
        return tuple(range(0, n_layers, 2))
    if isinstance(value, list) and all(isinstance(i, int) and 0 <= i < n_layers for i in value):
        return tuple(sorted(set(value)))
    raise KVBenchError(f"sliding_layers = {value!r} in {where}: use 'all', 'even' or a list of layer indices")


def _window(t: dict[str, Any], n_layers: int, where: str) -> dict[str, Any]:
    """sliding_window, sliding_layers and window_kind of one preset (all absent: no windowed layer)."""
    if ("sliding_window" in t) != ("sliding_layers" in t):
        raise KVBenchError(f"{where}: sliding_window and sliding_layers go together")
    kind = t.get("window_kind", "sliding")
    if kind not in WINDOW_KINDS:
        raise KVBenchError(f"window_kind = {kind!r} in {where}: use one of {', '.join(WINDOW_KINDS)}")
    if "sliding_window" not in t:
        return {}
    window = _positive_int(t, "sliding_window", where)
    layers = _sliding_layers(t["sliding_layers"], n_layers, where)
    return {"sliding_window": window, "sliding_layers": layers, "window_kind": kind}


def _model(name: str, t: Any, path: Path) -> ModelSpec:
    where = f"[{name}] of {path}"
    if not isinstance(t, dict):
        raise KVBenchError(f"top-level key {name!r} in {path} must be a [table] describing one model")
    _check_keys(t, _MODEL_REQUIRED, _MODEL_OPTIONAL, where)
    ints = {k: _positive_int(t, k, where) for k in _MODEL_REQUIRED[2:]}
    mla: dict[str, Any] = {k: _positive_int(t, k, where) for k in _MODEL_OPTIONAL[3:7] if k in t}
    if ("kv_lora_rank" in mla) != ("qk_rope_head_dim" in mla):
        raise KVBenchError(f"{where}: an MLA model needs both kv_lora_rank and qk_rope_head_dim")
    vision = t.get("vision_params")
    if vision is not None and (not isinstance(vision, int) or isinstance(vision, bool) or vision < 1):
        raise KVBenchError(f"vision_params = {vision!r} in {where} must be a positive whole number")
    return ModelSpec(
        name=name,
        source=str(t["source"]),
        family=str(t["family"]),
        n_layers=ints["layers"],
        n_heads=ints["heads"],
        n_kv_heads=ints["kv_heads"],
        head_dim=ints["head_dim"],
        hidden_size=ints["hidden"],
        max_context=ints["max_context"],
        params=ints["params"],
        **_window(t, ints["layers"], where),
        **mla,
        wrapper=str(t["wrapper"]) if "wrapper" in t else None,
        vision_params=vision,
        resolved_by="preset",
        note=str(t.get("note", "")),
    )


def load_presets(path: Path | None = None) -> dict[str, ModelSpec]:
    """Every model in configs/models.toml, by name. Unknown or missing keys are errors naming the key and file."""
    path = Path(path) if path else MODELS_TOML
    return {name: _model(name, t, path) for name, t in read_toml(path).items()}


def load_gpus(path: Path | None = None) -> dict[str, GPUSpec]:
    """Every GPU in configs/gpus.toml, by name."""
    path = Path(path) if path else GPUS_TOML
    gpus: dict[str, GPUSpec] = {}
    for name, t in read_toml(path).items():
        where = f"[{name}] of {path}"
        if not isinstance(t, dict):
            raise KVBenchError(f"top-level key {name!r} in {path} must be a [table] describing one GPU")
        _check_keys(t, ("label", "memory", "nominal"), ("aliases", "bandwidth", "bandwidth_source"), where)
        if ("bandwidth" in t) != ("bandwidth_source" in t):
            raise KVBenchError(f"{where}: bandwidth and bandwidth_source go together (cite the figure)")
        aliases = t.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise KVBenchError(f"aliases in {where} must be a list of strings")
        gpus[name] = GPUSpec(
            name=name,
            label=str(t["label"]),
            memory=parse_bytes(t["memory"], f"memory in {where}"),
            nominal=str(t["nominal"]),
            aliases=tuple(a.lower() for a in aliases),
            bandwidth=parse_bandwidth(t["bandwidth"], f"bandwidth in {where}") if "bandwidth" in t else None,
            bandwidth_text=str(t.get("bandwidth", "")),
            bandwidth_source=str(t.get("bandwidth_source", "")),
        )
    return gpus


def _close(name: str, choices: list[str]) -> list[str]:
    key = name.lower()
    close = [c for c in choices if key and (c.startswith(key) or key.startswith(c))]  # mistral-7b -> both
    close += [c for c in difflib.get_close_matches(key, choices, n=4, cutoff=0.5) if c not in close]
    return close[:4]


def get_model(name: str, presets: dict[str, ModelSpec] | None = None) -> ModelSpec:
    presets = load_presets() if presets is None else presets
    key = name.strip().lower()
    if not key:
        raise KVBenchError("--model is empty; name a preset such as llama-3-8b (`kvbench memory --all` lists them)")
    if key in presets:
        return presets[key]
    close = _close(key, list(presets))
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KVBenchError(
        f"unknown model {name!r}{hint} (`kvbench memory --all` lists every preset; --config PATH reads any config.json)"
    )


def get_gpu(name: str, gpus: dict[str, GPUSpec] | None = None) -> GPUSpec:
    gpus = load_gpus() if gpus is None else gpus
    key = name.strip().lower().removeprefix("nvidia").strip(" -")
    if not key:
        raise KVBenchError(f"--gpu is empty; name one of {', '.join(gpus)}, or give --gpu-mem 80GiB")
    for g in gpus.values():
        if key == g.name or key in g.aliases:
            return g
    canonical = {n: n for n in gpus} | {a: g.name for g in gpus.values() for a in g.aliases}
    close = list(dict.fromkeys(canonical[c] for c in _close(key, list(canonical))))  # aliases by their preset
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KVBenchError(f"unknown GPU {name!r}{hint} (known: {', '.join(gpus)}; or give --gpu-mem 80GiB)")
