"""A rank's cache against its slice of the whole model's (verify --tp's rank_cache, check/tp.py): a cache that
records what every update returned, the (B, H, S, Dh) slices compared head by head, and which heads a transformers
cache layer on this rank holds of the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvbench.caches import LayerCache
from kvbench.check.judge import CheckRow
from kvbench.check.suite import RANK_CACHE

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPT, MaskRule


class Recording(LayerCache):
    """A layer cache that remembers what each update returned: the K and V attention read at every step, (B, H, S,
    Dh) each, copied (a design may return views of buffers a later step writes)."""

    def __init__(self, inner: LayerCache) -> None:  # noqa: D107  (no LayerCache counters of its own)
        self.inner = inner
        self.visible = getattr(inner, "visible", None)  # the design's own policy: the model's mask asks it
        self.steps: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (K, V, length after the update)
        self.given: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # what each update was given
        self.slot_positions: list[torch.Tensor | None] = []  # an evicting design's slot positions after each

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.given.append((k.detach().clone(), v.detach().clone(), positions.detach().clone()))
        k, v = self.inner.update(k, v, positions)
        self.steps.append((k.detach().clone(), v.detach().clone(), self.inner.length))
        held = getattr(self.inner, "key_positions", None)  # (B, S): an evicting design's slots
        self.slot_positions.append(None if held is None else held[0].detach().clone())
        return k, v

    @classmethod
    def replayed(cls, steps: list[tuple[torch.Tensor, torch.Tensor, int]]) -> Recording:
        """A recording of another process's steps (what compare_steps reads)."""
        out = cls.__new__(cls)
        out.steps = steps
        return out

    @property
    def k(self) -> torch.Tensor | None:
        return self.steps[-1][0] if self.steps else None

    @property
    def v(self) -> torch.Tensor | None:
        return self.steps[-1][1] if self.steps else None

    @property
    def key_positions(self) -> torch.Tensor | None:
        """An evicting design's slot positions (the model masks by them), passed through."""
        return getattr(self.inner, "key_positions", None)

    @property
    def length(self) -> int:  # type: ignore[override]
        return self.inner.length

    @property
    def capacity(self) -> int | None:  # type: ignore[override]
        return self.inner.capacity

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def bytes_copied(self) -> int:  # type: ignore[override]
        return self.inner.bytes_copied

    def reset(self) -> None:
        self.inner.reset()


@torch.inference_mode()
def filled(
    gpt: GPT,
    make_caches: Callable[[int], list | None],
    tokens: list[int],
    prompt_len: int,
    mask_rule: MaskRule,
) -> list[Recording]:
    """Caches of one design filled by `gpt` over `tokens`: the first `prompt_len` in one prefill, then one decode
    step per token, positions explicit, read through the design's own `visible` (an evicting design's); what every
    layer's update returned at every step recorded."""
    device = gpt.lm_head.weight.device
    made = make_caches(len(tokens))
    assert made is not None, "a cached design (rank_cache runs only for caches)"
    caches = [Recording(c) for c in made]
    steps = [tokens[:prompt_len], *([t] for t in tokens[prompt_len:])]
    past = 0
    for step in steps:
        ids = torch.tensor([step], device=device)  # (1, T)
        pos = past + torch.arange(len(step), device=device)[None]  # (1, T)
        gpt(ids, pos, caches, mask_rule=mask_rule)
        past += len(step)
    return caches


class Held(Protocol):
    """What compare_slices reads of one layer's cache: the K and V attention last read, (B, H, slots, Dh), and
    how many of those slots hold tokens."""

    @property
    def k(self) -> torch.Tensor | None: ...
    @property
    def v(self) -> torch.Tensor | None: ...
    @property
    def length(self) -> int: ...


def compare_slices(
    cache: str,
    got: Sequence[Held],
    want: Sequence[Held],
    heads: range | list[range],
    rtol: float,
    atol: float,
    rank: int,
    every_slot: bool = False,
    when: str = "",
    against: str = "the one-process cache's slice",
    mine: str = "",
) -> CheckRow:
    """Each layer's K and V on this rank against `heads` of the whole model's (one range for every layer, or one
    per layer): the first layer, tensor, head and slot outside (rtol, atol) of that head's scale, or a pass with the
    largest difference. The slots holding tokens are compared; `every_slot`: every slot attention was given, the
    count included (slots past the length are masked, so a stale one there is invisible to the logits). `when`:
    the step, for the detail."""
    by_layer = heads if isinstance(heads, list) else [heads] * len(want)
    mine = mine or f"rank {rank}'s cache"
    what = f"{mine} ({_heads_text(by_layer)}) vs {against}"
    tolerance = f"rtol {rtol:g}, atol {atol:g}"

    def failed(detail: str, diff: float | None = None) -> CheckRow:
        return CheckRow(
            name=RANK_CACHE,
            cache=cache,
            passed=False,
            max_abs_diff=diff,
            tolerance=tolerance,
            detail=f"{what}: {detail}",
        )

    worst = 0.0
    for i, (g, w, heads) in enumerate(zip(got, want, by_layer, strict=True)):
        L = w.length
        if g.length != L:
            return failed(f"{when}layer {i} holds {g.length} tokens, the one-process cache {L}")
        for name, a, b in (("K", g.k, w.k), ("V", g.v, w.v)):
            assert a is not None and b is not None, f"layer {i} was never written"
            if every_slot and a.size(2) != b.size(2):
                return failed(
                    f"{when}layer {i} {name} gives attention {a.size(2)} slots, the one-process cache {b.size(2)}"
                )
            diff, bad = _outside(a, b, heads, a.size(2) if every_slot else L, rtol, atol)
            if bad is not None:
                h, t = bad
                past = f", past its {L} tokens" if t >= L else ""
                return failed(
                    f"{when}layer {i} {name} differs first at head {heads.start + h} (this rank's {h}), slot {t}"
                    f"{past}: |delta| {float(diff[0, h, t].max()):.3g}",
                    float(diff.max()),
                )
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return CheckRow(
        name=RANK_CACHE, cache=cache, passed=True, max_abs_diff=worst, tolerance=tolerance, detail=f"{what}: equal"
    )


def _outside(
    a: torch.Tensor, b: torch.Tensor, heads: range, n: int, rtol: float, atol: float
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """|a - b| over the first `n` slots of this rank's (B, h, S, Dh) `a` and the whole model's `heads` of `b`, and
    the first (head, slot) outside (rtol, atol) of that head's scale (None: every value within)."""
    a = a[:, :, :n].float().cpu()  # (B, h, n, Dh)
    b = b[:, heads.start : heads.stop, :n].float().cpu()  # (B, h, n, Dh)
    diff = (a - b).abs()
    bound = atol + rtol * b.abs().amax(dim=(-2, -1), keepdim=True)  # (B, h, 1, 1): each head's scale
    bad = (diff > bound).nonzero()
    if not bad.numel():
        return diff, None
    _, h, t, _ = (int(x) for x in bad[0])
    return diff, (h, t)


@dataclass
class _Step:
    """One step of a Recording as compare_slices reads it."""

    k: torch.Tensor
    v: torch.Tensor
    length: int


def compare_steps(
    cache: str,
    got: list[Recording],
    want: list[Recording],
    heads: range,
    rtol: float,
    atol: float,
    rank: int,
    **kw: Any,
) -> CheckRow:
    """compare_slices at every step both fills took (the prefill, then each decode step): a value wrong for a few
    steps and right again shows, as does one wrong only before the last step."""
    n = len(want[0].steps)
    if any(len(g.steps) != n for g in got):
        return CheckRow(
            name=RANK_CACHE,
            cache=cache,
            passed=False,
            detail=f"rank {rank}'s cache took {len(got[0].steps)} updates where the one-process cache took {n}",
        )
    worst = 0.0
    for j in range(n):
        when = "the prefill, " if j == 0 else f"decode step {j}, "
        row = compare_slices(
            cache,
            [_Step(*g.steps[j]) for g in got],
            [_Step(*w.steps[j]) for w in want],
            heads,
            rtol,
            atol,
            rank,
            when=when,
            **kw,
        )
        if not row.passed:
            return row
        worst = max(worst, row.max_abs_diff or 0.0)
    row.max_abs_diff = worst
    return row


def _heads_text(by_layer: list[range]) -> str:
    """'heads 0-1', or each layer's heads where layers differ."""
    spans = [f"{h.start}-{h.stop - 1}" for h in by_layer]
    return f"heads {spans[0]}" if len(set(spans)) <= 1 else f"heads by layer {', '.join(spans)}"


def plain_layer(layer: Any) -> bool:
    """Does a transformers cache layer keep its keys and values as plain (B, H, slots, Dh) tensors? (A quantized
    layer keeps its tokens elsewhere, in its own format: fp8's `keys` is an empty placeholder.)"""
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    return isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == v.dim() == 4


class HeldLayer:
    """One transformers cache layer's keys and values as compare_slices reads a Recording."""

    def __init__(self, layer: Any) -> None:
        self.k: torch.Tensor = layer.keys  # (B, H, slots, Dh)
        self.v: torch.Tensor = layer.values
        held = layer.get_seq_length() if hasattr(layer, "get_seq_length") else self.k.size(2)
        self.length = min(int(held), self.k.size(2))


def held_heads(mine: list[HeldLayer], whole: list[HeldLayer], rank: int, world: int) -> list[range] | str:
    """The heads of each of the whole model's cache layers that this rank's layer holds: its contiguous 1/world
    share where transformers' plan splits the layer's attention by head, every head where the plan keeps the
    attention whole on each rank; or, for the first layer that holds neither, why (a failed rank_cache)."""
    from kvbench.model.tp import rank_heads

    out = []
    for i, (g, w) in enumerate(zip(mine, whole, strict=True)):
        h, n = g.k.size(1), w.k.size(1)
        if h == n:
            out.append(range(n))
        elif h * world == n:
            out.append(rank_heads(n, rank, world))
        else:
            return (
                f"rank {rank}'s cache layer {i} holds {h} heads: neither its 1/{world} share of the one-process "
                f"cache's {n} nor all of them"
            )
    return out
