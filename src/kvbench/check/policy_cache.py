"""The policy's reference and the design held to it update by update (check/policy.py's rows run them).

`PolicyCache` keeps every token it is given, passed through the design's roundtrip, and states the design's
visibility; `Recorded` wraps a layer cache to remember what each update returned (and, with a PolicyCache twin and
a `Shadow`, holds every update of the design to the policy applied to the very same inputs); `Reference` and
`Recording` are the two injected caches (check/gpt2_subject.py Injection) a policy row runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.caches import LayerCache
from kvbench.caches.dynamic import DynamicCache
from kvbench.check.probe import first_bad
from kvbench.decode.generate import EXACT, DecodeRules
from kvbench.model.gpt2 import GPTConfig, Visible


class PolicyCache(DynamicCache):
    """The reference: every token's K and V passed through the design's roundtrip, kept in order, forgotten only when
    a rollback crops them; nothing evicted (it states the design's visibility, and the model's mask asks it)."""

    def __init__(
        self, roundtrip: Callable[[torch.Tensor], torch.Tensor] | None, visible: Visible | None = None
    ) -> None:
        super().__init__()
        self.roundtrip, self.visible = roundtrip, visible

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.roundtrip is not None:
            k, v = self.roundtrip(k), self.roundtrip(v)
        return super().update(k, v, positions)

    def fork(self) -> PolicyCache:
        other = PolicyCache(self.roundtrip, self.visible)
        other.__dict__.update({**super().fork().__dict__, "roundtrip": self.roundtrip, "visible": self.visible})
        return other


@dataclass
class Call:
    """What one layer's update returned to attention: K and V (B, H, S, Dh) and each slot's position (B, S)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor


@dataclass
class Log:
    """Every layer update of a run in call order, while `on` (a lifecycle scenario: its forwards are located)."""

    on: bool = False
    calls: list[Call] = field(default_factory=list)


@dataclass
class Shadow:
    """The design's stored K and V held at every layer update to the policy applied to the very same inputs: each
    layer of the design has a PolicyCache twin fed a copy of what the design is fed (driven through the same crops,
    forks, reorders and resets), so the two must agree as a copy does, compared by locate's rule (a head's vector
    within atol + rtol x that head's largest value) at the dtype's epsilon. `first`: the first difference in words,
    after `when(forward)`; "" while none."""

    visible: Visible | None
    rtol: float
    atol: float = 0.0
    n_layer: int = 0
    calls: int = 0
    first: str = ""
    when: Callable[[int], str] = lambda forward: f"forward {forward + 1}, "

    def start(self, when: Callable[[int], str]) -> None:
        self.calls, self.first, self.when = 0, "", when

    def compare(self, design: Recorded, twin: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor) -> None:
        layer, forward = self.calls % self.n_layer, self.calls // self.n_layer
        self.calls += 1
        if self.first:
            return
        off = _stored_off(design, twin, positions, self.visible, self.rtol, self.atol)
        if off:
            self.first = f"{self.when(forward)}layer {layer} {off}"


def _stored_off(
    design: Recorded,
    twin: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    visible: Visible | None,
    rtol: float,
    atol: float,
) -> str:
    """How one update's returned K/V depart from the twin's (the policy on the same inputs), or "": a position some
    query of the call may read that the design no longer holds, a different number of tokens held, or the first
    row, head and slot whose K or V is not the policy's."""
    assert design.k is not None and design.v is not None and design.positions is not None, "an update ran"
    tk, tv = twin  # (B, H, n, Dh): slot c holds column c, position c of an unpadded sequence
    n = tk.size(2)
    device = tk.device
    if design.key_positions is not None:  # it evicts: its slots are positions, matched to the twin's columns
        pos = design.positions[0].to(device)  # (S,) every row holds the same positions
        cols = torch.arange(n, device=device)  # (n,)
        q = positions[0].to(device)  # (T,) this call's queries
        reads = cols[None, :] <= q[:, None]  # (T, n) causal by position
        if visible is not None:
            reads = reads & visible(q[None], cols[None])[0]
        kept = torch.isin(cols, pos)
        lost = (reads.any(0) & ~kept).nonzero()
        if lost.numel():
            p = int(lost[0, 0])
            reader = int(q[reads[:, p].nonzero()[0, 0]])
            return f"no longer holds position {p}, which the query at {reader} may still read"
        slots = ((pos >= 0) & (pos < n)).nonzero()[:, 0]  # (m,)
        want = pos.index_select(0, slots)  # the twin's column of each
    else:  # slot c holds column c
        held = design.inner.length
        if held != n:
            return f"holds {held} tokens, the policy's reference {n}"
        slots = want = torch.arange(n, device=device)
    for name, got, ref in (("K", design.k, tk), ("V", design.v, tv)):
        a = got.to(device).index_select(2, slots).float()  # (B, H, m, Dh)
        b = ref.index_select(2, want).float()
        for row in range(a.size(0)):
            bad = first_bad(a[row], b[row], rtol, atol)
            if bad is not None:
                i, head, err, _ = bad
                slot = int(slots[i])
                p = int(design.positions[row, slot])
                where = f"row {row}, " if a.size(0) > 1 else ""
                return f"{name} differs first at {where}head {head}, slot {slot} (position {p}): |delta| {err:.3g}"
    return ""


class Recorded(LayerCache):
    """A layer cache that remembers what its last update returned (the K and V attention read) and the positions of
    its slots; everything else reads through. With a `twin` (the policy's PolicyCache) and its `shadow`, every update
    is held to the twin fed the same inputs."""

    def __init__(
        self,
        inner: LayerCache,
        log: Log | None = None,
        twin: PolicyCache | None = None,
        shadow: Shadow | None = None,
    ) -> None:  # no counters of its own
        self.inner = inner
        self.visible = getattr(inner, "visible", None)  # the design's own policy: the model's mask asks it
        self.log = log
        self.twin, self.shadow = twin, shadow
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # (B, S): each returned slot's position

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the twin first, on copies: what the design does to its inputs cannot reach the policy's
        twin = None if self.twin is None else self.twin.update(k.clone(), v.clone(), positions.clone())
        self.k, self.v = self.inner.update(k, v, positions)
        held = getattr(self.inner, "key_positions", None)
        if held is None:  # slot c holds column c: this call's positions continue the earlier ones
            start = positions[:, :1] - (self.k.size(2) - positions.size(1))
            held = start + torch.arange(self.k.size(2), device=positions.device)[None]
        self.positions = held.clone()
        if self.log is not None and self.log.on:
            self.log.calls.append(Call(self.k.clone(), self.v.clone(), self.positions))
        if twin is not None and self.shadow is not None:
            self.shadow.compare(self, twin, positions)
        return self.k, self.v

    @property
    def key_positions(self) -> torch.Tensor | None:
        return getattr(self.inner, "key_positions", None)

    length = property(lambda self: self.inner.length)  # type: ignore[assignment]
    capacity = property(lambda self: self.inner.capacity)  # type: ignore[assignment]
    bytes_copied = property(lambda self: self.inner.bytes_copied)  # type: ignore[assignment]
    nbytes = property(lambda self: self.inner.nbytes)

    def reset(self) -> None:
        self.inner.reset()
        if self.twin is not None:
            self.twin.reset()

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        if self.twin is not None:
            self.twin.crop(length)

    def fork(self) -> Recorded:
        twin = None if self.twin is None else self.twin.fork()
        return Recorded(self.inner.fork(), self.log, twin, self.shadow)

    def reorder(self, index: torch.Tensor) -> None:
        self.inner.reorder(index)
        if self.twin is not None:
            self.twin.reorder(index)


@dataclass(frozen=True)
class Reference:
    """The policy as an injected cache (check/gpt2_subject.py Injection): the correct loop, PolicyCache layers."""

    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None
    visible: Visible | None
    rules: DecodeRules = EXACT
    log: Log = field(default_factory=Log)

    def layer_cache(
        self, config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> LayerCache:
        return Recorded(PolicyCache(self.roundtrip, self.visible), self.log)


@dataclass(frozen=True)
class Recording:
    """The design as it runs (its fault too, when one is injected), each layer recorded and held, update by update,
    to its twin (`shadow`)."""

    design: (
        Callable[[GPTConfig, int, int, torch.dtype, torch.device], LayerCache] | None
    )  # the design's own, or the fault's
    rules: DecodeRules
    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None
    shadow: Shadow
    log: Log = field(default_factory=Log)

    def layer_cache(
        self, config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> LayerCache:
        assert self.design is not None, "a cached design"
        self.shadow.n_layer = config.n_layer
        design = self.design(config, batch, max_len, dtype, device)
        return Recorded(design, self.log, PolicyCache(self.roundtrip, self.shadow.visible), self.shadow)
