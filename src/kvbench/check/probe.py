"""What a replay compares (check/locate.py): each forward call's K, V and attention outputs against the no-cache
reference, layer by layer, and the first difference in words.

`Reference` is the no-cache forward's values over the sequences a run held; `Probe` is handed what attention reads
and computes by a subject's taps (check/gpt2_replay.py, check/hf_replay.py) and stops the replay (`Found`) at the first
difference; `first_bad` is the per-head rule (|got - want| <= atol + rtol x that head's largest |want|).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class Found(Exception):
    """Raised from a recording hook at the first difference: the replay has shown what it had to."""


@dataclass
class Call:
    """One forward call of a replayed run, as a correct cache holds it afterwards."""

    label: str  # the call in words: "step 3", "forward 9 of the rollback scenario, the first after crop(27)"
    seqs: list[list[int]]  # per batch row: every token its cache holds after the call, in position order
    pads: list[int]  # per batch row: the columns before its position 0 (left padding)
    new: int  # tokens the call writes per row
    whose: str = ""  # whose sequences these are, where the location should name them: "the first prompt"

    @property
    def cols(self) -> int:
        """Columns every row's cache fills after the call (pads included)."""
        return self.pads[0] + len(self.seqs[0])


class Reference:
    """The no-cache forward's K, V and attention outputs over a set of sequences: one forward for each sequence that
    is not a prefix of another (causal attention: position p's values depend on tokens 0..p only).

    `forward(seq)` gives {layer: (K (H, n, Dh), V (H, n, Dh), Y)} fp32, Y each position's attention output per head
    (n, H, Dh), or (n, 1, C) where the heads are not separable, or None."""

    def __init__(self, calls: Sequence[Call | None], forward: Callable[[list[int]], dict]) -> None:
        seqs = {tuple(q) for c in calls if c is not None for q in c.seqs}
        self.longest: list[tuple[int, ...]] = []
        for seq in sorted(seqs, key=len, reverse=True):
            if not any(m[: len(seq)] == seq for m in self.longest):
                self.longest.append(seq)
        self.values = {m: forward(list(m)) for m in self.longest}
        self.whose = {self._longest(q): c.whose for c in calls if c is not None and c.whose for q in c.seqs}

    def _longest(self, seq: list[int]) -> tuple[int, ...]:
        t = tuple(seq)
        return next(m for m in self.longest if m[: len(t)] == t)

    def of(self, seq: list[int]) -> dict:
        return self.values[self._longest(seq)]


def first_bad(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[int, int, float, int] | None:
    """got, want (h, m, D): the first index along m where some head's vector is outside atol + rtol x that head's
    largest |want| (NaN is outside), as (index, first such head, its largest |delta|, heads outside there)."""
    if got.numel() == 0:
        return None
    diff = (got - want).abs()  # (h, m, D)
    bound = atol + rtol * want.abs().amax(dim=(1, 2), keepdim=True)  # (h, 1, 1)
    per = (~(diff <= bound)).any(-1)  # (h, m)
    where = per.any(0).nonzero()
    if not where.numel():
        return None
    i = int(where[0, 0])
    heads = per[:, i].nonzero()[:, 0]
    h = int(heads[0])
    return i, h, float(diff[h, i].max()), len(heads)


def _slots(n: int) -> str:
    return f"{n} slot" + ("" if n == 1 else "s")


def ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


class Probe:
    """Compares what a replayed run's attention reads and computes with the reference, call by call and layer by
    layer (in the order the model runs them), and keeps the first difference in words (`found`).

    `calls[i]` is what the i-th forward call must hold (None: not compared, e.g. the first prompt's run before a
    reused cache's); `heads`: the model's heads this process holds (a tensor-parallel rank's slice), None for all;
    `stop`: raise at the first difference instead of running on."""

    def __init__(
        self,
        calls: Sequence[Call | None],
        ref: Reference,
        rtol: float,
        atol: float,
        heads: range | None = None,
        rank: int | None = None,
        stop: bool = True,
    ) -> None:
        self.calls, self.ref, self.rtol, self.atol = calls, ref, rtol, atol
        self.heads, self.rank, self.stop = heads, rank, stop
        self.i = -1
        self.layers = 0  # layers of the current call whose cache returned to attention
        self.found: str | None = None

    def next_call(self) -> None:
        self.i += 1
        self.layers = 0

    def raised(self, n_layers: int) -> str:
        """Where the run raised, in words, when nothing differed before: the call and the layer it had reached."""
        i, at = self.i, f", layer {self.layers}"
        if self.i < 0 or self.layers >= n_layers:  # after a call's last layer: in the next call, before its first
            i, at = self.i + 1, ", before its first layer"
        call = self.calls[i] if 0 <= i < len(self.calls) else None
        if call is None:
            return ""
        return f"K/V and attention outputs equal the reference until the run raised in {call.label}{at}"

    def _call(self) -> Call | None:
        if self.found is not None or not 0 <= self.i < len(self.calls):
            return None
        return self.calls[self.i]

    def _stop(self, words: str) -> None:
        self.found = words
        if self.stop:
            raise Found

    def _head(self, h: int) -> str:
        if self.heads is None:
            return f"head {h}"
        return f"head {self.heads.start + h} (rank {self.rank}'s head {h})"

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        """This process's heads of a reference tensor whose dim 0 is every head."""
        return t if self.heads is None else t[self.heads.start : self.heads.stop]

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, read: int | None = None, windowed: bool = False) -> None:
        """What layer `layer`'s cache returned to attention, (B, h, S, Dh); `read`: the slots attention reads (the
        mask's count), where known; `windowed`: a sliding-window layer (fewer slots than columns hold the last)."""
        self.layers += 1
        call = self._call()
        if call is None:
            return
        cols, S = call.cols, k.size(2)
        off = cols - S if windowed and S < cols else 0  # columns before the layer's first slot
        firsts, short = [], None
        for b, (seq, pad) in enumerate(zip(call.seqs, call.pads, strict=True)):
            ref = self.ref.of(seq)[layer]
            n = len(seq)
            lo, hi = max(0, off - pad), min(n, S + off - pad)  # the positions the returned slots hold
            if hi < n:
                short = S
            for j, (name, got) in enumerate((("K", k), ("V", v))):
                g = got[b, :, pad + lo - off : pad + hi - off].float()  # (h, m, Dh)
                w = self._mine(ref[j])[:, lo:hi]  # (h, m, Dh)
                bad = first_bad(g, w, self.rtol, self.atol)
                if bad is not None:
                    p = lo + bad[0]
                    firsts.append((pad + p - off, b, j, name, p, bad, g[bad[1], bad[0]]))
        where = f"{call.label}, layer {layer}"
        reads = f"; attention reads {_slots(read)} where the sequence fills {cols}" if read not in (None, cols) else ""
        if firsts:
            slot, b, j, name, p, (_, h, err, nh), vec = min(firsts, key=lambda f: f[:3])
            row = f", row {b}" if len(call.seqs) > 1 else ""
            pad = call.pads[b]
            at = f"position {p}" + (f", after {pad} pad slots" if pad else "")
            more = f" (+{nh - 1} more)" if nh > 1 else ""
            hint = self._holds(layer, call, b, j, h, p, vec)
            self._stop(
                f"{call.label}{row}, layer {layer}, {self._head(h)}{more}, slot {slot} ({at}): {name} differs from "
                f"the reference by {err:.3g}{hint}{reads}"
            )
        elif short is not None:
            self._stop(f"{where}: the cache returns {_slots(short)} where the sequence fills {cols}")
        elif reads:
            self._stop(f"{where}: K/V equal, but{reads[1:]}")

    def _holds(self, layer: int, call: Call, b: int, j: int, h: int, p: int, vec: torch.Tensor) -> str:
        """'; it holds <what>' when the slot's vector is one the run computed elsewhere (or zeros), else ''."""
        name = "KV"[j]
        seq = call.seqs[b]
        ref = self.ref.of(seq)[layer][j]  # (H, n, Dh)
        gh = h if self.heads is None else self.heads.start + h
        scale = self._mine(ref)[h, : len(seq)].abs().max()
        bound = self.atol + self.rtol * float(scale)

        def near(x: torch.Tensor) -> torch.Tensor:  # (..., Dh) -> (...) bool
            return ((x - vec).abs() <= bound).all(-1)

        if bool((vec.abs() <= bound).all()):
            return "; it holds zeros"
        same = near(ref[gh, : len(seq)]).nonzero()
        if same.numel():
            return f"; it holds position {int(same[0, 0])}'s {name}"
        heads = near(ref[:, p]).nonzero()
        if heads.numel():
            return f"; it holds head {int(heads[0, 0])}'s {name}"
        for r, other in enumerate(call.seqs):
            if r != b and len(other) > p and bool(near(self.ref.of(other)[layer][j][gh, p])):
                return f"; it holds row {r}'s {name}"
        for m, values in self.ref.values.items():
            if len(m) > p and m[: len(seq)] != tuple(seq) and bool(near(values[layer][j][gh, p])):
                whose = self.ref.whose.get(m)
                if whose:
                    return f"; it holds the {name} {whose} has at that position"
                return f"; it holds the {name} another sequence of this run has at that position"
        return ""

    def attn(self, layer: int, y: torch.Tensor, per_head: bool = True) -> None:
        """Layer `layer`'s attention output for this call's queries: (B, T, h, Dh) per head, or (B, T, 1, C) with
        `per_head` False."""
        call = self._call()
        if call is None:
            return
        T = y.size(1)
        firsts = []
        for b, (seq, pad) in enumerate(zip(call.seqs, call.pads, strict=True)):
            want = self.ref.of(seq)[layer][2]
            if want is None:
                return
            q0 = call.cols - T - pad  # the position of query 0 (negative: a pad)
            i0 = max(0, -q0)
            g = y[b, i0:].float().transpose(0, 1)  # (h, m, D)
            w = want[q0 + i0 : q0 + T].transpose(0, 1)  # (H, m, D)
            bad = first_bad(g, self._mine(w) if per_head else w, self.rtol, self.atol)
            if bad is not None:
                firsts.append((q0 + i0 + bad[0], b, bad))
        if firsts:
            p, b, (_, h, err, nh) = min(firsts, key=lambda f: f[:2])
            row = f", row {b}" if len(call.seqs) > 1 else ""
            head = f", {self._head(h)}" + (f" (+{nh - 1} more)" if nh > 1 else "") if per_head else ""
            self._stop(
                f"K/V equal; attention output differs first at layer {layer} ({call.label}{row}{head}, "
                f"query at position {p}) by {err:.3g}"
            )
