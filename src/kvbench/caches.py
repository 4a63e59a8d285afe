"""The per-layer KV-cache contract, every implementation, and the registry of them by name.

The contract (one object per layer):
    update(k, v, positions) -> (k, v)   store this call's keys/values (B, H, T, Dh); return what attention reads,
                                         (B, H, S, Dh) with the filled slots first (S >= length)
    length        tokens (columns) filled so far
    capacity      slots available, or None when the cache grows without bound
    reset()       forget everything, keep the allocation for reuse
    nbytes        bytes of tensor storage held or reserved right now
    bytes_copied  bytes of already-cached history copied by updates (the price of torch.cat)

Attention's only cache code is the one `update` call. Columns are the caller's: with left padding a column is not a
position, so `positions` is passed for caches that need it (none of these do) and the slot index is the write
pointer. Add a cache by writing a class and one registry entry; generation, verify, break and bench pick it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.errors import CacheOverflowError, KVBenchError
from kvbench.model import GPTConfig


class LayerCache:
    """Base of the per-layer caches: the counters every implementation shares."""

    capacity: int | None = None

    def __init__(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def update(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        self.length = 0
        self.bytes_copied = 0

    def check_capacity(self, n_new: int, kind: str) -> tuple[int, int]:
        """(start, end) slots for `n_new` more tokens; a fixed-capacity cache that cannot hold them is an error
        naming its capacity."""
        start, end = self.length, self.length + n_new
        if self.capacity is not None and end > self.capacity:
            raise CacheOverflowError(
                f"{kind} KV cache overflow: {start} cached + {n_new} new = {end} tokens, capacity {self.capacity} "
                f"(allocate max_len >= prompt length + new tokens)"
            )
        return start, end

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class DynamicCache(LayerCache):
    """The seed's cache: append with `torch.cat`, which allocates a new tensor and copies all history every step.

    Kept on purpose as the baseline whose copying cost `bench` measures: each update re-copies the `length` cached
    tokens of K and V, so growing from n0 to n1 tokens one at a time copies
    bytes_per_token_per_layer x (n0 + ... + n1-1) = bytes_per_token_per_layer x (n1 - n0)(n0 + n1 - 1) / 2.
    """

    def __init__(self) -> None:
        super().__init__()
        self.k: torch.Tensor | None = None  # (B, H, length, Dh)
        self.v: torch.Tensor | None = None

    def update(self, k, v, positions):
        if self.k is None:
            self.k, self.v = k, v  # first write: nothing cached, nothing copied
        else:
            self.bytes_copied += self.k.nbytes + self.v.nbytes
            self.k = torch.cat([self.k, k], dim=2)  # (B, H, length + T, Dh): new tensor, history copied
            self.v = torch.cat([self.v, v], dim=2)
        self.length = self.k.size(2)
        return self.k, self.v

    def reset(self) -> None:
        super().reset()
        self.k = self.v = None

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class StaticCache(LayerCache):
    """Preallocated (B, H, max_len, Dh) buffers and a write pointer; returns views of the filled prefix.

    Nothing is copied after the write: the views share the buffers' storage, and the shape grows but the allocation
    never moves. This is Hugging Face's StaticCache in miniature.
    """

    def __init__(self, batch, n_head, max_len, head_dim, dtype, device, pointer_fault: bool = False) -> None:
        super().__init__()
        self.k = torch.zeros(batch, n_head, max_len, head_dim, dtype=dtype, device=device)  # (B, H, L, Dh)
        self.v = torch.zeros_like(self.k)
        self.capacity = max_len
        self.pointer_fault = (
            pointer_fault  # `kvbench break static-pointer` only (faults.py); False in every cache
        )

    def update(self, k, v, positions):
        start, end = self.check_capacity(k.size(2), "static")
        self.k[:, :, start:end].copy_(k)
        self.v[:, :, start:end].copy_(v)
        # BUG on purpose when pointer_fault: the pointer is left on the last written slot instead of one past it,
        # so the next token's K/V overwrite this one's.
        self.length = end - 1 if self.pointer_fault else end
        return self.k[:, :, :end], self.v[:, :, :end]  # views: (B, H, end, Dh)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass(frozen=True)
class CacheSpec:
    name: str
    summary: str
    # Builds one layer's cache: (config, batch, max_len, dtype, device) -> LayerCache. None: no cache at all.
    factory: Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache] | None
    # exact: cached logits equal full recomputation up to kernel rounding (False for lossy caches). How `verify`
    # judges a lossy cache is documented with it: the largest |logit error| against full recomputation in fp32,
    # logit_atol + logit_rtol x (the row's largest |logit|), and the least fraction of greedy tokens (teacher-forced)
    # that must agree with the `none` path.
    exact: bool = True
    logit_atol: float = 1e-5
    logit_rtol: float = 1e-5
    min_greedy_agreement: float = 1.0
    # Optional: (model, caches) -> a callable used by `generate` instead of `model` for forward calls; it receives
    # the same arguments (ids, positions, caches, padding). static-graph uses it for its CUDA-graph decode step.
    decode_runner: Callable | None = None


# The bigger designs live in their own modules, which import this one: their factories import them lazily.
def _static_graph(c, b, n, dt, dev):
    from kvbench.graphs import StaticGraphCache

    return StaticGraphCache(b, c.n_head, n, c.head_dim, dt, dev)


def _static_graph_runner(model, caches):
    from kvbench.graphs import decode_runner

    return decode_runner(model, caches)


def _paged(c, b, n, dt, dev):
    from kvbench.paged import make_paged_cache

    return make_paged_cache(c, b, n, dt, dev)


def _int8(c, b, n, dt, dev):
    from kvbench.quant import make_int8_cache

    return make_int8_cache(c, b, n, dt, dev)


# One registry of caches: CLI choices, bench sweeps and test parametrisation all iterate this dict.
CACHES: dict[str, CacheSpec] = {
    "none": CacheSpec("none", "no cache: full forward over the whole sequence every step", None),
    "dynamic": CacheSpec(
        "dynamic",
        "torch.cat append (the seed's cache): copies all history every step",
        lambda c, b, n, dt, dev: DynamicCache(),
    ),
    "static": CacheSpec(
        "static",
        "preallocated (B, H, max_len, Dh) buffers + write pointer: no copies",
        lambda c, b, n, dt, dev: StaticCache(b, c.n_head, n, c.head_dim, dt, dev),
    ),
    "static-graph": CacheSpec(
        "static-graph",
        "static buffers + fixed-shape decode step over the whole buffer, one CUDA graph replay per token",
        _static_graph,
        decode_runner=_static_graph_runner,
    ),
    "paged": CacheSpec(
        "paged",
        "vLLM-style pool of 16-token blocks + block table per sequence; reads gather through the table",
        _paged,
    ),
    "int8": CacheSpec(
        "int8",
        "int8 K/V with per-token, per-head absmax scales, dequantised for attention (lossy)",
        _int8,
        exact=False,
        # Measured in fp32 on random weights (docs/performance.md): max |logit error| 0.0017-0.09, at most 1.5% of
        # the logit scale, and greedy agreement >= 0.98 (every flip a near-tie) over gpt2 (std 0.02 and 0.05),
        # gpt2-tiny (std 0.02 and 0.1) and the test config. A real bug (wrong slot, lost scale) moves logits by O(1).
        logit_atol=0.1,
        logit_rtol=0.05,
        min_greedy_agreement=0.9,
    ),
}


def get_cache_spec(name: str) -> CacheSpec:
    if name not in CACHES:
        raise KVBenchError(f"unknown cache {name!r}; known caches: {', '.join(CACHES)}")
    return CACHES[name]


def parse_cache_names(text: str | None) -> list[str]:
    """'none,dynamic' -> ['none', 'dynamic']; None or 'all' -> every registered cache. Unknown names are errors."""
    if text is None or text.strip() in ("", "all"):
        return list(CACHES)
    names = [s.strip() for s in text.split(",") if s.strip()]
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


def cache_nbytes(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.nbytes for c in caches)


def cache_bytes_copied(caches: list[LayerCache] | None) -> int:
    return 0 if caches is None else sum(c.bytes_copied for c in caches)
