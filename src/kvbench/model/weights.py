"""Resolve and load weights into our GPT-2: Hugging Face hub, a local Hugging Face directory, a checkpoint shipped
with kvbench, or seeded random init.

`--weights auto|hub|random|PATH`:
- hub:    openai-community/gpt2 (-medium, -large, -xl) through huggingface_hub's cache and download (respects
          HF_HUB_OFFLINE and HF_HOME), then the same loader as PATH;
- PATH:   a directory with config.json + model.safetensors (or pytorch_model.bin), as `save_pretrained` writes it;
- random: GPT-2's initialisation, seeded;
- auto:   a preset shipped with its weights (gpt2-shakespeare: resources.BUNDLED_MODELS) loads them, never the hub
          and never random; a hub preset takes the local cache, else the hub if it answers within seconds, else
          random with a visible warning.
The port from Hugging Face is a plain copy: our four projections are Conv1D with (in, out) weights, as GPT-2's own
checkpoint stores them (model/gpt2.py says why), and lm_head is tied to wte.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import hf_hub_download
from safetensors.torch import load_file

from kvbench import files, validate
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT, PRESETS, GPTConfig
from kvbench.resources import BUNDLED_MODELS

HUB_REPOS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
RANDOM_WARNING = (
    "no GPT-2 weights available offline: using random weights (GPT-2's init scheme at std {std}, seed {seed}). "
    "Timings are those of the "
    "real {name} architecture, but generated text will be meaningless. Use --weights hub online, or --weights PATH, "
    "or --model gpt2-shakespeare (a small GPT-2 shipped with kvbench)."
)
DEMO_FALLBACK = "gpt2-shakespeare"  # the demo's model when GPT-2's weights are neither cached nor reachable


@dataclass
class LoadedModel:
    model: GPT
    config: GPTConfig
    weights: str  # what was loaded, for every output: "hub:openai-community/gpt2", "random(seed=0, std=0.02)", a path
    random: bool  # True when the weights are random (text is meaningless)
    warning: str | None = None  # shown by the CLI, recorded in outputs


# --- configs ---------------------------------------------------------------------------------------------------------
def resolve_config(model: str) -> GPTConfig:
    """A preset name, or a path to a GPT-2 config.json (or a directory holding one)."""
    if model in PRESETS:
        return PRESETS[model]
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" or p.exists():
        return config_from_hf(p)
    close = difflib.get_close_matches(model, PRESETS, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise KVBenchError(f"unknown model {model!r}{hint}; known models: {', '.join(PRESETS)}, or a GPT-2 config.json")


def config_from_hf(path: Path) -> GPTConfig:
    """GPTConfig from a Hugging Face GPT-2 config.json; anything that is not plain GPT-2 is refused by name."""
    cfg = files.load_json(path, str(path), files.CONFIG_BYTES, "a config.json")
    if not isinstance(cfg, dict) or cfg.get("model_type") != "gpt2":
        got = cfg.get("model_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise KVBenchError(f"{path} is not a GPT-2 config (model_type={got!r}, expected 'gpt2')")
    unsupported = {
        "activation_function": ("gelu_new", cfg.get("activation_function", "gelu_new")),
        "scale_attn_weights": (True, cfg.get("scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (False, cfg.get("scale_attn_by_inverse_layer_idx", False)),
        "reorder_and_upcast_attn": (False, cfg.get("reorder_and_upcast_attn", False)),
    }
    for key, (want, got) in unsupported.items():
        if got != want:
            raise KVBenchError(f"{path}: {key}={got!r} is not supported (kvbench's GPT-2 uses {key}={want!r})")
    for key in ("vocab_size", "n_layer", "n_head", "n_embd"):
        if key not in cfg:
            raise KVBenchError(f"{path}: missing field {key!r}")
    pos_key = "n_positions" if "n_positions" in cfg else "n_ctx" if "n_ctx" in cfg else None
    sizes = {
        key: validate.integer(f"{path}: {key}", cfg[key], 1, hi)
        for key, hi in (("vocab_size", 10_000_000), ("n_layer", 1_000), ("n_head", 1_024), ("n_embd", 65_536))
    }
    block = validate.integer(f"{path}: {pos_key}", cfg[pos_key], 1, 1_048_576) if pos_key else 1024
    if sizes["n_embd"] % sizes["n_head"]:
        raise KVBenchError(
            f"{path}: n_embd {sizes['n_embd']} is not divisible by n_head {sizes['n_head']} (head_dim = n_embd / n_head)"
        )
    eps = validate.real(f"{path}: layer_norm_epsilon", cfg.get("layer_norm_epsilon", 1e-5), 0.0, 1.0)
    name = cfg.get("_name_or_path")
    return GPTConfig(
        block_size=block,
        **sizes,
        layer_norm_epsilon=eps,
        name=name if isinstance(name, str) and name else str(path.parent),
    )


# --- Hugging Face checkpoints --------------------------------------------------------------------------------------
def read_hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    st, binf = directory / "model.safetensors", directory / "pytorch_model.bin"
    for f in (st, binf):  # a device or a pipe under either name is refused, not read or skipped
        if f.exists():
            files.check_file(f, str(f), "a checkpoint's weights are a regular file")
    try:
        if st.is_file():
            return load_file(str(st))
        if binf.is_file():
            with warnings.catch_warnings():  # torch warns about pickle protocols before failing on a bad file
                warnings.simplefilter("ignore")
                return torch.load(binf, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated files come in many exception types
        # Not torch's own message: for a pickle it suggests weights_only=False, which would run code from the file.
        raise KVBenchError(
            f"cannot read weights from {st if st.is_file() else binf}: corrupt, truncated, or not a tensors-only "
            f"checkpoint ({type(e).__name__}); kvbench loads tensors only, never pickled code"
        ) from None
    raise KVBenchError(f"no model.safetensors or pytorch_model.bin in {directory}")


def port_hf_state_dict(model: GPT, hf: dict[str, torch.Tensor], source: str) -> None:
    """Copy a Hugging Face GPT2LMHeadModel / GPT2Model state dict into `model` (same names and layouts; the
    causal-mask buffers skipped, lm_head tied to wte). Missing or mis-shaped tensors are errors naming them."""
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    sd = model.state_dict()
    with torch.no_grad():
        for key, dst in sd.items():
            if key == "lm_head.weight":
                continue  # tied to transformer.wte.weight
            hf_key = key.removeprefix("transformer.")
            if hf_key not in hf:
                raise KVBenchError(f"{source}: tensor {hf_key!r} missing; not a GPT-2 checkpoint?")
            w = hf[hf_key]
            if w.shape != dst.shape:
                raise KVBenchError(f"{source}: {hf_key} has shape {tuple(w.shape)}, config expects {tuple(dst.shape)}")
            dst.copy_(w)


def to_hf_model(model: GPT, attn_implementation: str = "sdpa", dtype: torch.dtype | None = None, share: bool = False):
    """The inverse port: a transformers GPT2LMHeadModel holding `model`'s weights (a plain copy, lm_head tied), on
    the model's device, in `dtype` (default: the model's), eval mode.
    Used as the independent reference (`verify`) and as the `hf` engine (`bench`). `share`: the same tensors as
    `model` instead of a copy (in the model's own dtype and device), for a reader that only reads them once (a
    conversion): one copy of the weights less in memory."""
    from transformers import GPT2LMHeadModel

    from kvbench.model.hf_config import hf_gpt2_config

    weight = model.lm_head.weight
    cfg = hf_gpt2_config(model.config, attn_implementation)
    with torch.device("meta") if share else contextlib.nullcontext():  # shared: no weights of its own drawn first
        hf = GPT2LMHeadModel(cfg)
    # lm_head.weight is tied to wte in both models
    sd = {k: t for k, t in model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=share)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    assert not missing and not unexpected, f"inverse port mismatch: missing {missing}, unexpected {unexpected}"
    hf.tie_weights()
    if share:
        return hf.eval()
    # transformers wraps `to` with functools.wraps(nn.Module.to), which its types leave unbound (self unfilled)
    return hf.to(device=weight.device, dtype=dtype or weight.dtype).eval()  # type: ignore[call-arg]


def load_from_dir(directory: Path) -> tuple[GPT, GPTConfig]:
    if not directory.exists():
        raise KVBenchError(f"weights path not found: {directory}")
    if not directory.is_dir():
        raise KVBenchError(f"weights path {directory} is not a directory (want config.json + model.safetensors)")
    config = config_from_hf(directory / "config.json")
    config.name = str(directory)
    model = GPT(config)
    port_hf_state_dict(model, read_hf_state_dict(directory), str(directory))
    return model, config


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub, so deciding we are offline takes seconds, not the half minute of retries that
    a plain from_pretrained spends."""
    if _hub_offline():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def demo_model() -> str:
    """The model `make demo` runs: gpt2 when its weights are in the local cache or the hub answers, else the
    bundled gpt2-shakespeare (real text offline, never random weights)."""
    return "gpt2" if hub_snapshot("gpt2", allow_download=False) or hub_reachable() else DEMO_FALLBACK


def checkpoint_dir(model: str | None, weights: str) -> Path | None:
    """The Hugging Face directory `load_model(model, weights)` reads real weights from, without loading them: PATH,
    a bundled checkpoint, or the hub preset's local snapshot; None otherwise (random, or not cached)."""
    if weights not in ("auto", "hub", "random"):
        return Path(weights).expanduser()
    name = model or "gpt2"
    if weights == "random":
        return None
    if name in BUNDLED_MODELS and weights == "auto":
        return BUNDLED_MODELS[name]
    return hub_snapshot(name, allow_download=False) if name in HUB_REPOS else None


def hub_snapshot(name: str, allow_download: bool) -> Path | None:
    """Local directory with config.json + model.safetensors for a preset, from the cache or (if allowed) the hub."""
    repo = HUB_REPOS[name]
    for local_only in (True, False) if allow_download else (True,):
        try:
            for f in ("config.json", "model.safetensors"):
                path = hf_hub_download(repo, f, local_files_only=local_only)
            return Path(path).parent
        except Exception:  # huggingface_hub raises several types for "not cached" and network failures
            continue
    return None


def _check_model_name(model: str | None) -> None:
    if model is not None and not model.strip():
        raise KVBenchError("--model is empty; give a preset (gpt2, gpt2-medium, ...) or a GPT-2 config.json")


def peek_config(model: str | None, weights: str) -> GPTConfig:
    """The architecture `load_model` would build, without building it: for checks that must run before any work
    (context limits). A checkpoint directory's own config.json decides; else the preset or config named by --model."""
    _check_model_name(model)
    if weights not in ("auto", "hub", "random"):
        directory = Path(weights).expanduser()
        if not directory.is_dir():
            raise KVBenchError(
                f"weights path {directory} "
                + ("is not a directory (want config.json + model.safetensors)" if directory.exists() else "not found")
            )
        return config_from_hf(directory / "config.json")
    return resolve_config(model or "gpt2")


def load_model(
    model: str | None,
    weights: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    init_std: float = 0.02,
) -> LoadedModel:
    """Build the model named by `model` and fill it from `weights`; see the module docstring for the sources. Its
    weights are laid out in memory for the device's kernels (GPT.lay_out)."""
    loaded = _load_model(model, weights, device, dtype, seed, init_std)
    loaded.model.lay_out()
    return loaded


def _load_model(
    model: str | None, weights: str, device: torch.device, dtype: torch.dtype, seed: int, init_std: float
) -> LoadedModel:
    _check_model_name(model)
    if weights not in ("auto", "hub", "random"):  # a path
        # The directory's config.json decides the architecture; an explicit --model must agree with it.
        net, config = load_from_dir(Path(weights).expanduser())
        if model is not None:
            want = resolve_config(model)
            got = (config.n_layer, config.n_head, config.n_embd)
            if (want.n_layer, want.n_head, want.n_embd) != got:
                raise KVBenchError(
                    f"--model {model} does not match the checkpoint in {weights} (layers, heads, width = {got})"
                )
        return LoadedModel(net.to(device=device, dtype=dtype).eval(), config, str(weights), random=False)

    name = model or "gpt2"
    config = resolve_config(name)
    warning = None
    if weights == "auto" and name in BUNDLED_MODELS:  # shipped with its weights: never the hub, never random
        net, _ = load_from_dir(BUNDLED_MODELS[name])
        config = net.config
        config.name = name
        return LoadedModel(net.to(device=device, dtype=dtype).eval(), config, f"bundled:{name}", False)
    if weights in ("auto", "hub"):
        if name not in HUB_REPOS:
            if weights == "hub":
                raise KVBenchError(f"no hub weights for {name!r}; hub models: {', '.join(HUB_REPOS)}")
        else:
            snap = hub_snapshot(name, allow_download=False) or (
                hub_snapshot(name, allow_download=True) if hub_reachable() else None
            )
            if snap is not None:
                net, _ = load_from_dir(snap)
                config = net.config
                config.name = name
                return LoadedModel(net.to(device=device, dtype=dtype).eval(), config, f"hub:{HUB_REPOS[name]}", False)
            if weights == "hub":
                why = "HF_HUB_OFFLINE is set" if _hub_offline() else "the hub is not reachable"
                raise KVBenchError(f"{HUB_REPOS[name]} is not in the local Hugging Face cache and {why}")
            warning = RANDOM_WARNING.format(seed=seed, name=name, std=init_std)
    net = GPT.empty(config, device, dtype).init_weights(seed=seed, std=init_std)  # drawn on the device
    desc = f"random(seed={seed}, std={init_std})"
    return LoadedModel(net.eval(), config, desc, random=True, warning=warning)
