"""The one registry of transformers' caches: what selects each in `generate`, how to build one directly, whether it
is exact, where it cannot run, and what a decode step of it moves. `verify --hf`, `bench --hf` and the transformers
engine on our GPT-2 all read it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import transformers
from packaging.version import InvalidVersion, Version
from transformers import CompileConfig, DynamicCache, QuantizedCache, StaticCache, cache_utils

from kvbench.caches.base import Traffic
from kvbench.errors import KVBenchError, listed, shown
from kvbench.hf.known import (
    PAGED_EAGER_SINKS,
    PAGED_UNSUPPORTED,
    QUANTO_DEEPCOPY,
    STATIC_PROMPT_LOOKUP_OVERRUN,
    STATIC_ROLLBACK_ON_RECURRENT,
    KnownDefect,
)


@dataclass(frozen=True)
class HFCache:
    name: str
    summary: str  # what transformers builds, in one line
    generate_kwargs: dict  # what selects it in generate
    build: Callable | None = None  # (model, max_len) -> a Cache object; None: no cache
    lossy: tuple[float, float] | None = None  # (rtol, atol) of the logit bound; None: exact
    unavailable: Callable | None = None  # (info, device) -> why it cannot run here, or None
    default_on_cpu: bool = True  # False: only when named in --caches on the CPU (too slow to run by default)
    timed: bool = False  # bench --hf times it
    traffic: Traffic | None = None  # what a decode step moves (the floor); None: unknown or no cache
    known: tuple[KnownDefect, ...] = ()  # the libraries' defects a failing row of it may be (hf/known.py)
    # continuous batching (generate_batch): checked by check/hf_paged.py, where it cannot run read by hf/paged.py
    batching: bool = False


def text_config(model):
    return model.config.get_text_config(decoder=True)


def _dynamic(model, max_len, offloading=False):
    return DynamicCache(config=text_config(model), offloading=offloading)


def _static(model, max_len, offloading=False):
    return StaticCache(config=text_config(model), max_cache_len=max_len, offloading=offloading)


def compile_config() -> CompileConfig:
    """generate's default compile of the decode step (CompileConfig()), allowed on every device: transformers
    compiles automatically only on CUDA, XPU, TPU and Neuron."""
    cfg = CompileConfig()
    cfg._compile_all_devices = True  # type: ignore[assignment]  # transformers declares it `= None`, unannotated
    return cfg


def _needs_cuda(info, device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA (offloading moves each layer's cache between the GPU and the CPU)"
    return None


def _backend_missing(backend: str) -> str | None:
    """Why the backend cannot run here, or None. A package must import and be installed with a version: a package
    uninstalled with files left behind (optimum-quanto keeps the extension it built under optimum/quanto/) imports
    as an empty namespace package, which transformers takes for installed with version 'N/A' and then fails on."""
    if backend == "fp8" and not hasattr(cache_utils, "Fp8QuantizedLayer"):
        return f"transformers {transformers.__version__} has no fp8 cache backend (later versions have it)"
    packages = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
    if backend not in packages:
        return None
    module, pip = packages[backend]
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # the parent package (optimum) is absent
        spec = None
    if spec is None:
        return f"its backend is not installed: pip install {pip}"
    try:
        found = importlib.metadata.version(pip)
    except importlib.metadata.PackageNotFoundError:
        where = [*(spec.submodule_search_locations or []), spec.origin]  # a namespace package has no origin
        return (
            f"its backend is not installed: {module} imports (from {where[0]}) but no {pip} package is installed, "
            f"files left behind by an uninstall; pip install {pip}"
        )
    try:
        Version(found)
    except InvalidVersion:
        return (
            f"its backend is unusable: {pip} is installed with version {found!r}; pip install --force-reinstall {pip}"
        )
    return None


QUANTO_GROUP = 64  # transformers' QuantoQuantizedLayer q_group_size default


def _quantized(backend: str) -> HFCache:
    def build(model, max_len):
        return QuantizedCache(backend=backend, config=text_config(model))

    def unavailable(info, device) -> str | None:
        if info.windowed:
            return "QuantizedCache holds full-attention layers only; this model has sliding-window layers"
        if info.recurrent:
            return "QuantizedCache holds full-attention layers only; this model has recurrent layers"
        if others := sorted(set(info.config_layer_types) - {"full_attention"}):
            return f"QuantizedCache holds full-attention layers only; this model has {', '.join(others)} layers"
        width = info.n_kv_heads * info.head_dim
        if backend == "quanto" and width % QUANTO_GROUP:
            # quanto quantises a (B, H, T, Dh) tensor in groups of 64 over H x T x Dh: with fewer values per token
            # than a group, a call of an odd token count raises "Group size (64) must be a divisor of ..."
            return (
                f"quanto quantises groups of {QUANTO_GROUP} values and this model stores {width} per token and layer "
                f"({info.n_kv_heads} key/value heads x {info.head_dim}): transformers' QuantizedCache raises on "
                "calls of an odd token count"
            )
        return _backend_missing(backend)

    # Sanity bounds, not quality measures: a wrong position, a stale or a missing token moves logits by about the
    # row's scale, far beyond these. Measured worst steps on random Llama, Qwen2 and GPT-2 models (2-4 layers,
    # width 128, 40 new tokens), init std 0.02 / 0.05 / 0.1: fp8 (e4m3, one scale per tensor) 2.7% / 19.5% / 18.1%
    # of the row scale; quanto and hqq (4 bits, transformers' defaults) 5.9% / 13.9% / 56.7%.
    rtol = 0.3 if backend == "fp8" else 0.6
    return HFCache(
        f"quantized-{backend}",
        f"QuantizedCache, {backend} backend (transformers' defaults)",
        {"cache_implementation": "quantized", "cache_config": {"backend": backend}},
        build,
        lossy=(rtol, 0.1),
        unavailable=unavailable,
        known=(QUANTO_DEEPCOPY,) if backend == "quanto" else (),
    )


# What a decode step moves, read in transformers' cache_utils: DynamicLayer.update concatenates; StaticLayer.update
# writes with index_copy_ and returns the whole max_cache_len buffer, masked.
DYNAMIC_TRAFFIC = Traffic(
    "transformers' DynamicCache: torch.cat, reads and writes L-1 slots",
    extra=lambda L, slot, q8: 2 * (L - 1) * slot,
)
STATIC_TRAFFIC = Traffic(
    "transformers' StaticCache: attends over its whole max_cache_len buffer (masked)", whole_buffer=True
)

STATIC = HFCache(
    "static",
    "StaticCache, eager (preallocated; sliding-window layers where the model has them)",
    {"cache_implementation": "static", "disable_compile": True},
    _static,
    timed=True,
    traffic=STATIC_TRAFFIC,
    known=(STATIC_ROLLBACK_ON_RECURRENT, STATIC_PROMPT_LOOKUP_OVERRUN),
)
HF_CACHES: dict[str, HFCache] = {
    c.name: c
    for c in (
        HFCache(
            "none",
            "use_cache=False: the whole sequence every step (batched check only)",
            {"use_cache": False},
            timed=True,
        ),
        HFCache(
            "dynamic",
            "DynamicCache (torch.cat growth; sliding-window layers where the model has them)",
            {"cache_implementation": "dynamic"},
            _dynamic,
            timed=True,
            traffic=DYNAMIC_TRAFFIC,
        ),
        STATIC,
        # the same cache, its decode step compiled by generate: compile_config is made per run (generate_kwargs)
        replace(
            STATIC,
            name="static-compiled",
            summary="StaticCache with generate's torch.compile of the decode step (CompileConfig(), any device)",
            generate_kwargs={"cache_implementation": "static", "compile_config": None},
            default_on_cpu=False,
        ),
        HFCache(
            "offloaded",
            "DynamicCache with offloading (each layer's cache kept on the CPU between uses)",
            {"cache_implementation": "offloaded"},
            lambda m, n: _dynamic(m, n, offloading=True),
            unavailable=_needs_cuda,
        ),
        HFCache(
            "offloaded_static",
            "StaticCache with offloading",
            {"cache_implementation": "offloaded_static", "disable_compile": True},
            lambda m, n: _static(m, n, offloading=True),
            unavailable=_needs_cuda,
        ),
        _quantized("quanto"),
        _quantized("hqq"),
        _quantized("fp8"),
        HFCache(
            "paged",
            "PagedAttentionCache through continuous batching (generate_batch): pages of 16 and 256 tokens, prefix "
            "sharing on, two calls on one persistent manager",
            {"cache_implementation": "paged"},  # generate switches to generate_batch, which the check calls itself
            batching=True,
            known=(*PAGED_UNSUPPORTED, PAGED_EAGER_SINKS),
        ),
    )
}
TIMED = [n for n, c in HF_CACHES.items() if c.timed]


def generate_kwargs(name: str) -> dict:
    """The `generate` arguments that select cache `name`, fresh for each call (a CompileConfig per run)."""
    kw = dict(HF_CACHES[name].generate_kwargs)
    if "compile_config" in kw:
        kw["compile_config"] = compile_config()
    if "cache_config" in kw:
        kw["cache_config"] = dict(kw["cache_config"])
    return kw


def reuse_kwargs(name: str) -> dict:
    """How `generate` runs with a Cache object of `name` passed in: compiled if the cache is, otherwise eager."""
    if "compile_config" in HF_CACHES[name].generate_kwargs:
        return {"compile_config": compile_config()}
    return {"disable_compile": True}


def parse_verify_caches(text: str | None, device: torch.device) -> list[str]:
    """--caches for verify --hf: comma-separated names from HF_CACHES, or all / None for the default set (every
    cache, but static-compiled only on CUDA unless named)."""
    if text is None or text.strip() == "all":
        return [n for n, c in HF_CACHES.items() if device.type == "cuda" or c.default_on_cpu]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in HF_CACHES]
    if bad or not names:
        raise KVBenchError(
            f"unknown cache {listed(map(repr, bad)) or shown(text)} for --hf; caches: {', '.join(HF_CACHES)}"
        )
    return list(dict.fromkeys(names))


def compiles(name: str) -> bool:
    """Whether generate compiles the decode step of this cache (its arguments carry a compile config)."""
    return "compile_config" in HF_CACHES[name].generate_kwargs


def parse_bench_caches(names: list[str] | None) -> list[str]:
    """--caches for bench --hf: names of the timed caches, each once, or `all` / not given for all of them."""
    if names is None or names == ["all"]:
        return list(TIMED)
    if not names:
        raise KVBenchError(f"--caches is empty; name one or more of {', '.join(TIMED)}, or 'all'")
    bad = [n for n in names if n not in TIMED]
    if bad:
        raise KVBenchError(f"unknown cache {listed(map(repr, bad))} for bench --hf; caches: {', '.join(TIMED)}")
    return list(dict.fromkeys(names))
