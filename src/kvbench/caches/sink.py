"""The `sink` cache (StreamingLLM): the first S tokens (attention sinks) and a window of the last W; every other token
is evicted.

    visible(q, k) = k < S  or  k > q - W        (on top of the causal rule k <= q)

A query at position q reads the sinks and the last W positions up to its own. The design declares it (`visible` on its
spec) and each SinkCache states it (`SinkCache.visible`): the model's mask asks the cache, position by position, and
`verify` holds the cache to it exactly against a reference that keeps every token and states the same rule
(check/policy.py). The cache keeps what a query may still read: before
each update it evicts every non-sink position the call's first query can no longer see (k <= q0 - W), appends the
call's K/V, and returns them all with their positions (`key_positions`, (B, S), slots in position order), so a call
holds at most S + W - 1 + T tokens and, between decode steps, S + W. It is lossy: attention reads fewer keys than
full recomputation does (memory: S + W tokens per sequence whatever the context).

`sink` is S = 4, W = 32; `sink-S-W` (e.g. sink-4-256) names another split. Rows of one batch must hold the same
positions: slots are positions, not columns, so the design takes no left-padded batch (`padding=False`).
"""

from __future__ import annotations

import functools
import re

import torch

from kvbench.caches.base import CacheSpec, LayerCache, Traffic
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPTConfig

DEFAULT_SINK, DEFAULT_WINDOW = 4, 32
NAME = re.compile(r"^sink-(\d{1,9})-(\d{1,9})$")  # sink-S-W


def visible(sink: int, window: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(q_pos (B, T), k_pos (B, S)) -> (B, T, S): the sinks, and the last `window` positions up to the query's."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    return (k < sink) | (k > q - window)


class SinkCache(LayerCache):
    """K/V of the sink positions and the window, in position order; `key_positions` says which position each slot
    holds."""

    def __init__(self, sink: int, window: int) -> None:
        super().__init__()
        self.sink, self.window = sink, window
        self.k: torch.Tensor | None = None  # (B, H, S, Dh)
        self.v: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None  # (B, S)
        # tokens written so far (the next query's position): counted, not read off the newest slot, since a crop can
        # leave no slot at all (no sinks, and a window the crop empties)
        self.written = 0

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """(q_pos (B, T), k_pos (B, S)) -> (B, T, S): what a query may read of what it holds (module docstring)."""
        return visible(self.sink, self.window, q_pos, k_pos)

    def update(self, k, v, positions):
        self._evict(positions[:, :1])  # what the call's first query can no longer read
        self.written = int(positions[0, -1]) + 1
        if self.k is None:
            self.k, self.v, self.key_positions = k, v, positions.clone()
        else:
            hk, hv, held = self._held()
            self.bytes_copied += hk.nbytes + hv.nbytes  # torch.cat re-copies what it holds
            self.k, self.v = torch.cat([hk, k], dim=2), torch.cat([hv, v], dim=2)  # (B, H, S + T, Dh)
            self.key_positions = torch.cat([held, positions], dim=1)  # (B, S + T)
        self.length = self.k.size(2)
        return self.k, self.v

    def _evict(self, first_query: torch.Tensor) -> None:
        """Drop the non-sink positions at or before first_query - window (every row holds the same positions)."""
        if self.key_positions is None:
            return
        pos = self.key_positions[0]  # (S,)
        keep = (pos < self.sink) | (pos > int(first_query[0, 0]) - self.window)
        if not bool(keep.all()):
            self._keep(keep)

    def _keep(self, keep: torch.Tensor) -> None:
        cols = keep.nonzero().squeeze(-1)  # (S',)
        if cols.numel() == keep.numel():
            return
        k, v, pos = self._held()
        self.k, self.v, self.key_positions = k.index_select(2, cols), v.index_select(2, cols), pos.index_select(1, cols)
        self.length = self.k.size(2)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K (B, H, S, Dh), V and the positions (B, S): a cache that holds something."""
        assert self.k is not None and self.v is not None and self.key_positions is not None, "an empty sink cache"
        return self.k, self.v, self.key_positions

    def reset(self) -> None:
        super().reset()
        self.k = self.v = self.key_positions = None
        self.written = 0

    def crop(self, length: int) -> None:
        """Forget every position >= length; refused when a position the next query (at `length`) may read was
        evicted already (a window cannot be restored)."""
        n = self.check_crop(length, self.written)
        if self.key_positions is None or n >= self.written:
            return
        if n == 0:
            self.reset()
            return
        pos = self.key_positions[0]
        needed = max(self.sink, n - self.window + 1)  # the oldest non-sink position query n may read
        if needed < n and not bool((pos == needed).any()):
            raise KVBenchError(
                f"crop({length}): position {needed}, which the next query may read, was evicted already "
                f"(the window keeps the last {self.window}); a sink cache rolls back within its window only"
            )
        self._keep(pos < n)
        self.written = n

    def fork(self) -> SinkCache:
        other = SinkCache(self.sink, self.window)
        if self.k is not None:
            k, v, pos = self._held()
            other.k, other.v, other.key_positions = k.clone(), v.clone(), pos.clone()
        other.length, other.bytes_copied, other.written = self.length, self.bytes_copied, self.written
        return other

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is None:
            self.check_index(index, None, None)
            return
        k, v, pos = self._held()
        idx = self.check_index(index, k.size(0), k.device)
        self.k, self.v, self.key_positions = k.index_select(0, idx), v.index_select(0, idx), pos.index_select(0, idx)

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        k, v, pos = self._held()
        return k.nbytes + v.nbytes + pos.nbytes  # the positions are part of what it holds


def spec(sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW) -> CacheSpec:
    """The design with S sinks and a window of W (name `sink`, or `sink-S-W` for another split)."""
    held = sink + window

    def factory(config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> SinkCache:
        return SinkCache(sink, window)

    name = "sink" if (sink, window) == (DEFAULT_SINK, DEFAULT_WINDOW) else f"sink-{sink}-{window}"
    return CacheSpec(
        name,
        f"StreamingLLM: the first {sink} tokens and the last {window}, the rest evicted (lossy)",
        factory,
        exact=False,
        # Against full recomputation (the loose rows): eviction changes what attention reads by design, so logits
        # move by as much as the evicted tokens mattered; measured in fp32 on random weights (docs/caches.md).
        logit_atol=2.0,
        logit_rtol=0.5,
        min_greedy_agreement=0.5,
        traffic=Traffic(
            f"attention reads at most {held} slots; torch.cat re-copies what it holds, eviction copies the rest",
            extra=lambda L, slot, q8: 4 * (min(L, held) - 1) * slot,
            slots=lambda L: min(L, held),
        ),
        memory_note=f"holds the {sink} sink tokens and the last {window} (S + W = {held} per sequence, whatever the "
        "context) with one int64 position per slot; a call's own tokens join them while it runs",
        visible=functools.partial(visible, sink, window),
        padding=False,
        holds=lambda L: min(L, held),
        by_default=False,
    )


SPEC = spec()


def variant(name: str) -> CacheSpec | None:
    """`sink-S-W` as a design (S >= 0 sinks, W >= 1 window), or None when `name` is not one."""
    m = NAME.match(name)
    if m is None:
        return None
    sink, window = int(m.group(1)), int(m.group(2))
    if window < 1:
        raise KVBenchError(f"cache {name!r}: the window must hold at least 1 token (sink-S-W, W >= 1)")
    return spec(sink, window)
