"""Lossy caches held to an exact reference: the design's own declared policy, applied to every token, nothing else.

A lossy design declares on its CacheSpec what it stores for each token (`roundtrip`: quantise, then dequantise) and
which positions a query may still read (`visible`: an eviction policy). The reference is that policy and nothing
else: `PolicyCache`, which keeps every token it is given, passed through the roundtrip, in order (no scale buffers,
no slots, no eviction), while the model masks attention by the design's visibility. It is driven through exactly the
runs the design is (the same loop, the same session operations: prefill, decode steps, drafts and crops, forks,
reorders, chunks), so each token's K and V come from the same floats on both sides and land on the same side of every
rounding boundary: the design must match it at the exact tolerance (check/judge.py), on every check:

    logits, greedy                             N greedy tokens of the first prompt: every step's logits, every token
    batched                                    the left-padded batch (a design that takes one)
    cache_state                                the cache reused after another prompt, against a fresh reference
    rollback, fork, reorder, chunked_prefill   the lifecycle scenarios (check/lifecycle.py): every logit row

Every row also holds the design's stored K and V to the policy at every layer update (`Shadow`): each layer of the
design runs beside a PolicyCache twin fed a copy of the same inputs, and what the design returns must be the twin's
at the same positions as a copy is (the dtype's epsilon), holding every position the call's queries may read; a
value off its policy too little to move a logit fails the row there.

Those rows (`policy=True`) stand beside the loose rows against the full-precision model, which show what the policy
costs. A failing row names where the stored K or V first differs (layer, head, slot and position) or says the K and V
are the policy's and the model reads them otherwise.

Why step-matched and not one no-cache forward with the policy applied inside: that forward computes each token's K
and V from floats that differ in the last bit from a decode step's (other GEMM shapes), so a quantised value can land
one step away, on the other side of a rounding boundary, and everything downstream drifts by that step's effect. The
logits row measures it (`flips`: stored values of the one-forward reference one quantisation step away from the
step-matched one's, among all compared): rounding, not a cache bug, and never judged by widening a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.caches import CacheSpec, LayerCache, get_cache_spec
from kvbench.caches.dynamic import DynamicCache
from kvbench.check.judge import CheckRow, allclose_err, compare_tokens, first_diff, first_off, skipped, tolerance
from kvbench.check.lifecycle import LIFECYCLE, NEEDS, SCENARIOS, Trace
from kvbench.check.probe import first_bad
from kvbench.check.subject import Unsupported
from kvbench.decode.generate import EXACT, DecodeRules
from kvbench.errors import KVBenchError, one_line
from kvbench.model.gpt2 import Visible

POLICY_CHECKS = ("logits", "greedy", "batched", "cache_state", *LIFECYCLE)


class PolicyCache(DynamicCache):
    """The reference: every token's K and V passed through the design's roundtrip, kept in order, forgotten only when
    a rollback crops them; nothing evicted (it states the design's visibility, and the model's mask asks it)."""

    def __init__(
        self, roundtrip: Callable[[torch.Tensor], torch.Tensor] | None, visible: Visible | None = None
    ) -> None:
        super().__init__()
        self.roundtrip, self.visible = roundtrip, visible

    def update(self, k, v, positions):
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


def _stored_off(design: Recorded, twin, positions: torch.Tensor, visible, rtol: float, atol: float) -> str:
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

    def update(self, k, v, positions):
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
    def key_positions(self):
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

    def layer_cache(self, config, batch: int, max_len: int, dtype, device) -> LayerCache:
        return Recorded(PolicyCache(self.roundtrip, self.visible), self.log)


@dataclass(frozen=True)
class Recording:
    """The design as it runs (its fault too, when one is injected), each layer recorded and held, update by update,
    to its twin (`shadow`)."""

    design: Callable | None  # the design's own layer factory, or the fault's
    rules: DecodeRules
    roundtrip: Callable[[torch.Tensor], torch.Tensor] | None
    shadow: Shadow
    log: Log = field(default_factory=Log)

    def layer_cache(self, config, batch: int, max_len: int, dtype, device) -> LayerCache:
        assert self.design is not None, "a cached design"
        self.shadow.n_layer = config.n_layer
        design = self.design(config, batch, max_len, dtype, device)
        return Recorded(design, self.log, PolicyCache(self.roundtrip, self.shadow.visible), self.shadow)


# --- where the K and V first differ ---------------------------------------------------------------------------------
def locate(got: list, want: list, rtol: float, atol: float, visible=None, when: str = "") -> str:
    """Where the design first holds its K or V otherwise than the reference does, in words, after `when` (the step
    or the moment whose caches these are): a position the last query may still read (the design's `visible`) that
    it no longer holds, or the first layer, tensor, head and slot whose value differs (slots matched by position: the
    reference keeps every position). Else: the K and V are the policy's and attention reads them otherwise."""
    return when + _where(got, want, rtol, atol, visible)


EQUAL = "K/V equal to the policy's; attention reads them otherwise (its mask or positions)"


def _where(got: list, want: list, rtol: float, atol: float, visible, first_layer: int = 0) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True), start=first_layer):
        if g.k is None or w.k is None:
            continue
        held = [int(p) for p in g.positions[0].tolist()]
        kept = [int(p) for p in w.positions[0].tolist()]
        if visible is not None and held:
            q = torch.tensor([[max(held)]])
            readable = [p for p in kept if p <= q and bool(visible(q, torch.tensor([[p]]))[0, 0, 0])]
            lost = [p for p in readable if p not in held]
            if lost:
                return f"layer {i} no longer holds position {lost[0]}, which the query at {max(held)} may still read"
        index = {p: j for j, p in enumerate(w.positions[0].tolist())}
        for name, a, b in (("K", g.k, w.k), ("V", g.v, w.v)):
            for slot, p in enumerate(held):
                if p < 0 or p not in index:
                    continue
                x, y = a[:, :, slot].float(), b[:, :, index[p]].float()  # (B, H, Dh)
                bad = ((x - y).abs() > atol + rtol * y.abs().amax(-1, keepdim=True)).any(-1)  # (B, H)
                if bool(bad.any()):
                    row, head = (int(t) for t in bad.nonzero()[0])
                    err = float((x - y).abs()[row, head].max())
                    return (
                        f"layer {i} {name} differs first at head {head}, slot {slot} (position {p}): |delta| {err:.3g}"
                    )
    return EQUAL


# --- the rows -----------------------------------------------------------------------------------------------------------
def policy_rows(
    target,
    caches: list[str],
    prompts,
    new: int,
    short: int,
    fault=None,
    compile: str = "off",
    on_row=None,
    checks: tuple[str, ...] = POLICY_CHECKS,
) -> list[CheckRow]:
    """Each of `checks` in POLICY_CHECKS for each cache in `caches` that declares a policy, against the reference."""
    rows: list[CheckRow] = []
    for name in caches:
        spec = get_cache_spec(name)
        if not spec.held_to_policy:
            continue
        for row in _rows_of(target, name, spec, prompts, new, short, fault, compile, checks):
            row.policy = True
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _subjects(target, name: str, spec: CacheSpec, fault, compile: str):
    from kvbench.check.gpt2_subject import GPT2Subject

    rules = fault.rules if fault is not None else EXACT
    design = fault.layer_cache if fault is not None and fault.layer_cache is not None else spec.factory
    # a stored value is held as a copy is: to the dtype's epsilon of its head's scale
    shadow = Shadow(spec.visible, torch.finfo(target.dtype).eps)
    design_subject = GPT2Subject(target, name, Recording(design, rules, spec.roundtrip, shadow), compile)
    reference = GPT2Subject(target, name, Reference(spec.roundtrip, spec.visible), "off")
    exact = tolerance(target.dtype)
    for s in (design_subject, reference):
        s.tol = exact  # the policy is exact: the dtype's own tolerance, no lossy bound
    return design_subject, reference


def _rows_of(target, name, spec, prompts, new, short, fault, compile, wanted) -> list[CheckRow]:
    d, r = _subjects(target, name, spec, fault, compile)
    tol = d.tol
    rows: list[CheckRow] = []

    def guarded(checks: tuple[str, ...], fn) -> None:
        if not set(checks) & set(wanted):
            return
        try:
            rows.extend(fn())
        except Unsupported as e:
            rows.extend(skipped(name, str(e), c) for c in checks)
        except (KVBenchError, AssertionError, RuntimeError) as e:
            why = f"the run raised {one_line(e)}"
            rows.extend(
                CheckRow(name=c, cache=name, passed=False, tolerance="runs without error", detail=why) for c in checks
            )

    guarded(("logits", "greedy"), lambda: _generated(d, r, target, prompts[0], new, tol, spec))
    if spec.padding:
        guarded(("batched",), lambda: [_batch(d, r, prompts, short, tol)])
    elif "batched" in wanted:
        rows.append(skipped(name, "it evicts by position: it takes no left-padded batch", "batched"))
    guarded(("cache_state",), lambda: [_reused(d, r, prompts, short, tol)])
    for check in (c for c in LIFECYCLE if c in wanted):
        missing = d.missing_lifecycle(NEEDS[check])
        if missing:
            rows.append(skipped(name, missing, check))
            continue
        guarded((check,), lambda check=check: [_scenario(d, r, check, prompts, short, tol)])
    return rows


def _generated(d, r, target, prompt, new, tol, spec) -> list[CheckRow]:
    shadow = _watch(d, lambda f: f"step {f}{' (prefill)' if f == 0 else ''}, ")
    got, want = d.generate([prompt], new), r.generate([prompt], new)
    stored = shadow.first  # before any replay
    w_caches = r.last_caches  # the full run's, before any replay
    upto = first_diff(want.tokens[0], got.tokens[0])
    n = len(got.tokens[0]) if upto is None else upto + 1
    ok, err = allclose_err(got.logits[0, :n], want.logits[0, :n], tol.rtol, tol.atol)
    what = f"{len(got.tokens[0])} greedy steps vs the policy's reference, step for step"
    first = None if ok else first_off(got.logits[0, :n], want.logits[0, :n], tol)
    detail = what + (f"; first off at step {first}" if first is not None else "")
    detail += _stored_words(shadow, stored)
    detail += _flips(target, prompt, want.tokens[0], spec, w_caches, tol)
    where = stored
    if not stored and (not ok or upto is not None):  # replayed up to the step that went wrong: its caches
        step = first if first is not None else upto
        assert step is not None
        d.generate([prompt], step + 1), r.generate([prompt], step + 1)
        where = locate(d.last_caches, r.last_caches, tol.rtol, tol.atol, spec.visible, f"step {step}, ")
    logits = CheckRow(
        name="logits",
        cache=d.cache,
        passed=ok and not stored,
        max_abs_diff=err,
        tolerance=tol.words,
        detail=detail,
        location="" if ok and not stored else where,
    )
    greedy = compare_tokens(
        name="greedy",
        cache=d.cache,
        dtype=target.dtype,
        want=want.tokens[0],
        got=got.tokens[0],
        want_rows=want.logits[0],
        got_rows=got.logits[0],
        what=f"{len(got.tokens[0])} greedy tokens vs the policy's",
        tol=tol,
        want_where="the policy's reference",
        got_where="the design",
    )
    if not greedy.passed:
        greedy.location = where
    return [logits, greedy]


def _watch(d, when: Callable[[int], str]) -> Shadow:
    """The design's shadow (its Recording's), started for the run about to go: `when` names a forward."""
    shadow: Shadow = d.fault.shadow
    shadow.start(when)
    return shadow


def _stored_words(shadow: Shadow, stored: str) -> str:
    """What the stored-value comparison found, for a row's detail."""
    if stored:
        return "; a stored K or V is not the policy's"
    return f"; every stored K and V is the policy's ({shadow.calls} layer updates, to a copy's tolerance)"


@torch.inference_mode()
def _flips(target, prompt, tokens, spec, step_matched, tol) -> str:
    """The one-forward reference (every token's K and V from one forward over the whole sequence, the policy
    applied inside) against the step-matched one: how many stored values land a rounding step apart."""
    if spec.roundtrip is None:
        return ""
    gpt = target.gpt
    seq = prompt + tokens[:-1]
    caches = [Recorded(PolicyCache(spec.roundtrip, spec.visible)) for _ in range(gpt.config.n_layer)]
    device = gpt.lm_head.weight.device
    ids = torch.tensor([seq], device=device)
    gpt(ids, torch.arange(len(seq), device=device)[None], caches)
    apart = total = 0
    for one, step in zip(caches, step_matched, strict=True):
        for a, b in ((one.k, step.k), (one.v, step.v)):
            assert a is not None and b is not None, "every layer ran"
            b = b[:, :, : a.size(2)]
            noise = 1e-5 * b.abs().amax(-1, keepdim=True)
            apart += int(((a - b).abs() > noise).sum())
            total += a.numel()
    return f"; one no-cache forward with the policy inside: {apart:,} of {total:,} stored values differ (rounding flips and their drift)"


def _batch(d, r, prompts, short, tol) -> CheckRow:
    shadow = _watch(d, lambda f: f"step {f} of the batch, ")
    got, want = d.generate(prompts, short), r.generate(prompts, short)
    ok, err = allclose_err(got.logits, want.logits, tol.rtol, tol.atol)
    same = got.tokens == want.tokens
    lens = ", ".join(str(len(p)) for p in prompts)
    detail = f"lengths {lens} left-padded together, {short} tokens, vs the policy's" + (
        "" if same else "; tokens differ"
    )
    detail += _stored_words(shadow, shadow.first)
    row = CheckRow(
        name="batched",
        cache=d.cache,
        passed=ok and same and not shadow.first,
        max_abs_diff=err,
        tolerance=tol.words,
        detail=detail,
        location=shadow.first,
    )
    if not row.passed and not row.location:
        when = f"the batch after its {short} tokens, "
        row.location = locate(d.last_caches, r.last_caches, tol.rtol, tol.atol, get_cache_spec(d.cache).visible, when)
    return row


def _reused(d, r, prompts, short, tol) -> CheckRow:
    shadow = _watch(d, lambda f: f"forward {f + 1} of the two runs (a prompt, then another on the same caches), ")
    (got, words), (want, _) = d.reused(prompts[0], prompts[1], short), r.reused(prompts[0], prompts[1], short)
    ok, err = allclose_err(got.logits, want.logits, tol.rtol, tol.atol)
    same = got.tokens == want.tokens
    row = CheckRow(
        name="cache_state",
        cache=d.cache,
        passed=ok and same and not shadow.first,
        max_abs_diff=err,
        tolerance=tol.words,
        detail=f"{words}, {short} tokens, vs the policy's reference reused the same way"
        + _stored_words(shadow, shadow.first),
        location=shadow.first,
    )
    if not row.passed and not row.location:
        when = f"the reused cache after its {short} tokens, "
        row.location = locate(d.last_caches, r.last_caches, tol.rtol, tol.atol, get_cache_spec(d.cache).visible, when)
    return row


def _scenario(d, r, check, prompts, short, tol) -> CheckRow:
    logs = d.fault.log, r.fault.log  # the Recording and the Reference (_subjects)
    shadow = _watch(d, lambda f: f"forward {f + 1} of the {check} scenario, ")
    for log in logs:
        log.on, log.calls = True, []
    try:
        got: Trace = SCENARIOS[check](d, prompts, short)
        want: Trace = SCENARIOS[check](r, prompts, short)
    finally:
        for log in logs:
            log.on = False
    n = next(
        (i for i, (a, b) in enumerate(zip(got.seqs, want.seqs, strict=False)) if a != b),
        min(len(got.seqs), len(want.seqs)),
    )
    a, b = torch.stack(got.rows[:n]), torch.stack(want.rows[:n])
    ok, err = allclose_err(a, b, tol.rtol, tol.atol)
    detail = f"{n} logit rows vs the policy's reference through the same scenario"
    if n < len(want.seqs):
        detail += f"; the runs part at row {n} (a different greedy choice)"
    detail += _stored_words(shadow, shadow.first)
    row = CheckRow(
        name=check,
        cache=d.cache,
        passed=ok and n == len(want.seqs) and not shadow.first,
        max_abs_diff=err,
        tolerance=tol.words,
        detail=detail,
        location=shadow.first,
    )
    if not row.passed:
        first = first_off(a, b, tol)
        row.detail += f"; first off at row {first}" if first is not None else ""
        if not row.location:
            row.location = _forward(logs, check, d.gpt.config.n_layer, tol, get_cache_spec(d.cache).visible)
    return row


def _forward(logs: tuple[Log, Log], check: str, n_layer: int, tol, visible) -> str:
    """The first forward of a scenario, and in it the first layer, whose K or V the design returned otherwise than
    the reference did (the two ran the same operations, so their layer updates pair in call order)."""
    got, want = logs[0].calls, logs[1].calls
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        where = _where([g], [w], tol.rtol, tol.atol, visible, first_layer=i % n_layer)
        if where != EQUAL:
            return f"forward {i // n_layer + 1} of the {check} scenario, {where}"
    if len(got) != len(want):
        return f"the design's {check} scenario made {len(got)} layer updates, the policy's {len(want)}"
    return f"{EQUAL}, at every forward of the {check} scenario"
