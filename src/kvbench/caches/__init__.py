"""The registry of KV-cache designs: built-in ones by name, plugins by `pkg.module:ClassOrSpec` or entry point.

    none          no cache: full forward over the whole sequence every step
    dynamic       dynamic.py       torch.cat append
    static        static.py        preallocated buffers + write pointer
    static-graph  static_graph.py  static buffers + a fixed-shape decode step (one CUDA graph replay per token)
    paged         paged.py         a pool of 16-token blocks + block tables
    int8          int8.py          int8 K/V with per-token per-head scales (lossy; declares its roundtrip)
    sink          sink.py          the first S tokens and a window of the last W, the rest evicted (StreamingLLM;
                                   lossy; declares what a query may read); sink-S-W for another split

CLI choices, bench sweeps and test parametrisation all iterate `CACHES`. A cache from outside the repository joins
it with a `mod:obj` reference wherever a cache name is accepted, or through the `kvbench.caches` entry-point group of
an installed package (plugins.py; docs/caches.md).
"""

from __future__ import annotations

import torch

from kvbench.caches import dynamic, int8, paged, plugins, sink, static, static_graph
from kvbench.caches.base import CacheSpec, LayerCache, Traffic
from kvbench.caches.plugins import missing_lifecycle
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPTConfig

# The registry, and what a plugin imports from here (docs/caches.md): the contract, a design's facts, the lifecycle probe.
__all__ = [
    "CACHES",
    "CacheSpec",
    "LayerCache",
    "Traffic",
    "get_cache_spec",
    "make_caches",
    "missing_lifecycle",
    "parse_cache_names",
]

NONE = CacheSpec(
    "none",
    "no cache: full forward over the whole sequence every step",
    None,
    memory_note="caches nothing: every step recomputes K and V for the whole sequence (0 B held, all compute)",
)

# One registry of caches: the built-in designs. Plugins are loaded on first use into PLUGINS (get_cache_spec), so
# "every cache" stays what `parse_cache_names("all")` says: built-ins plus installed entry points.
CACHES: dict[str, CacheSpec] = {
    s.name: s for s in (NONE, dynamic.SPEC, static.SPEC, static_graph.SPEC, paged.SPEC, int8.SPEC, sink.SPEC)
}
BUILTIN = tuple(CACHES)
PLUGINS: dict[str, CacheSpec] = {}


def get_cache_spec(name: str) -> CacheSpec:
    """A registered cache, loading (and registering) a plugin named by `mod:obj` or an installed entry point."""
    name = name.strip()
    if name in CACHES:
        return CACHES[name]
    if name in PLUGINS:
        return PLUGINS[name]
    split = sink.variant(name)  # sink-S-W: the sink design with another split
    if split is not None:
        PLUGINS[name] = split
        return split
    if plugins.is_reference(name):
        spec = plugins.load_reference(name)
    else:
        eps = plugins.entry_point_names()
        if name not in eps:
            known = ", ".join([*CACHES, *(n for n in eps if n not in CACHES)])
            raise KVBenchError(
                f"unknown cache {name!r}; known caches: {known}, or a plugin as 'pkg.module:ClassOrSpec'"
            )
        spec = plugins.load_entry_point(eps[name])
    PLUGINS[name] = spec
    return spec


def parse_cache_names(text: str | None) -> list[str]:
    """'none,dynamic' -> ['none', 'dynamic']; 'all' -> every built-in cache plus installed plugins; None -> those
    of them in the default set (CacheSpec.by_default). Unknown names are errors; a name given twice runs once."""
    if text is None or text.strip() == "all":
        names = [*BUILTIN, *(n for n in plugins.entry_point_names() if n not in BUILTIN)]
        if text is None:
            names = [n for n in names if get_cache_spec(n).by_default]
    else:
        names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        if not names:
            raise KVBenchError(f"no cache named in {text!r}; name caches (e.g. none,dynamic) or use all")
    for n in names:
        get_cache_spec(n)
    return names


def make_caches(
    name: str, config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
) -> list[LayerCache] | None:
    """One cache per layer for `name`, or None for the no-cache path."""
    spec = get_cache_spec(name)
    if spec.factory is None:
        return None
    return [spec.factory(config, batch, max_len, dtype, torch.device(device)) for _ in range(config.n_layer)]
