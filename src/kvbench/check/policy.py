"""Lossy caches held to an exact reference: the design's own declared policy, applied to every token, nothing else.

A lossy design declares on its CacheSpec what it stores for each token (`roundtrip`: quantise, then dequantise) and
which positions a query may still read (`visible`: an eviction policy). The reference is that policy and nothing
else: `PolicyCache` (check/policy_cache.py), which keeps every token it is given, passed through the roundtrip, in
order (no scale buffers, no slots, no eviction), and states the design's visibility to the model's mask. It is driven through exactly the
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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvbench.caches import CacheSpec, get_cache_spec
from kvbench.check.judge import (
    CheckRow,
    Tolerance,
    allclose_err,
    compare_tokens,
    first_diff,
    first_off,
    skipped,
    tolerance,
)
from kvbench.check.lifecycle import LIFECYCLE, NEEDS, SCENARIOS, Trace
from kvbench.check.policy_cache import Call, Log, PolicyCache, Recorded, Recording, Reference, Shadow
from kvbench.check.subject import Run, Unsupported
from kvbench.decode.generate import EXACT
from kvbench.errors import KVBenchError, one_line
from kvbench.model.gpt2 import Visible

if TYPE_CHECKING:
    from kvbench.check.gpt2_subject import GPT2Model, GPT2Subject, Injection

POLICY_CHECKS = ("logits", "greedy", "batched", "cache_state", *LIFECYCLE)


# --- where the K and V first differ ---------------------------------------------------------------------------------
def locate(
    got: Sequence[Recorded | Call],
    want: Sequence[Recorded | Call],
    rtol: float,
    atol: float,
    visible: Visible | None = None,
    when: str = "",
) -> str:
    """Where the design first holds its K or V otherwise than the reference does, in words, after `when` (the step
    or the moment whose caches these are): a position the last query may still read (the design's `visible`) that
    it no longer holds, or the first layer, tensor, head and slot whose value differs (slots matched by position: the
    reference keeps every position). Else: the K and V are the policy's and attention reads them otherwise."""
    return when + _where(got, want, rtol, atol, visible)


EQUAL = "K/V equal to the policy's; attention reads them otherwise (its mask or positions)"


def _where(
    got: Sequence[Recorded | Call],
    want: Sequence[Recorded | Call],
    rtol: float,
    atol: float,
    visible: Visible | None,
    first_layer: int = 0,
) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True), start=first_layer):
        if g.k is None or w.k is None:
            continue
        assert g.v is not None and w.v is not None and g.positions is not None and w.positions is not None, "ran"
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
    target: GPT2Model,
    caches: list[str],
    prompts: list[list[int]],
    new: int,
    short: int,
    fault: Injection | None = None,
    compile: str = "off",
    on_row: Callable[[CheckRow], None] | None = None,
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


def _subjects(
    target: GPT2Model, name: str, spec: CacheSpec, fault: Injection | None, compile: str
) -> tuple[GPT2Subject, GPT2Subject]:
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


def _rows_of(
    target: GPT2Model,
    name: str,
    spec: CacheSpec,
    prompts: list[list[int]],
    new: int,
    short: int,
    fault: Injection | None,
    compile: str,
    wanted: tuple[str, ...],
) -> list[CheckRow]:
    d, r = _subjects(target, name, spec, fault, compile)
    tol = d.tol
    rows: list[CheckRow] = []

    def guarded(checks: tuple[str, ...], fn: Callable[[], list[CheckRow]]) -> None:
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

        def scenario(check: str = check) -> list[CheckRow]:
            return [_scenario(d, r, check, prompts, short, tol)]

        guarded((check,), scenario)
    return rows


def _generated(
    d: GPT2Subject,
    r: GPT2Subject,
    target: GPT2Model,
    prompt: list[int],
    new: int,
    tol: Tolerance,
    spec: CacheSpec,
) -> list[CheckRow]:
    shadow = _watch(d, lambda f: f"step {f}{' (prefill)' if f == 0 else ''}, ")
    got, want = d.generate([prompt], new), r.generate([prompt], new)
    stored = shadow.first  # before any replay
    w_caches = r.last_caches  # the full run's, before any replay
    assert w_caches is not None, "a cached run"
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
        assert d.last_caches is not None and r.last_caches is not None, "cached runs"
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


def _watch(d: GPT2Subject, when: Callable[[int], str]) -> Shadow:
    """The design's shadow (its Recording's), started for the run about to go: `when` names a forward."""
    assert isinstance(d.fault, Recording), "the design's subject (_subjects)"
    shadow = d.fault.shadow
    shadow.start(when)
    return shadow


def _stored_words(shadow: Shadow, stored: str) -> str:
    """What the stored-value comparison found, for a row's detail."""
    if stored:
        return "; a stored K or V is not the policy's"
    return f"; every stored K and V is the policy's ({shadow.calls} layer updates, to a copy's tolerance)"


@torch.inference_mode()
def _flips(
    target: GPT2Model,
    prompt: list[int],
    tokens: list[int],
    spec: CacheSpec,
    step_matched: Sequence[Recorded],
    tol: Tolerance,
) -> str:
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


def _batch(d: GPT2Subject, r: GPT2Subject, prompts: list[list[int]], short: int, tol: Tolerance) -> CheckRow:
    shadow = _watch(d, lambda f: f"step {f} of the batch, ")
    got, want = d.generate(prompts, short), r.generate(prompts, short)
    lens = ", ".join(str(len(p)) for p in prompts)
    words = f"lengths {lens} left-padded together, {short} tokens, vs the policy's"
    return _judged(d, r, "batched", (got, want), words, shadow, tol, f"the batch after its {short} tokens, ")


def _reused(d: GPT2Subject, r: GPT2Subject, prompts: list[list[int]], short: int, tol: Tolerance) -> CheckRow:
    shadow = _watch(d, lambda f: f"forward {f + 1} of the two runs (a prompt, then another on the same caches), ")
    (got, words), (want, _) = d.reused(prompts[0], prompts[1], short), r.reused(prompts[0], prompts[1], short)
    words = f"{words}, {short} tokens, vs the policy's reference reused the same way"
    return _judged(d, r, "cache_state", (got, want), words, shadow, tol, f"the reused cache after its {short} tokens, ")


def _judged(
    d: GPT2Subject,
    r: GPT2Subject,
    check: str,
    runs: tuple[Run, Run],
    words: str,
    shadow: Shadow,
    tol: Tolerance,
    when: str,
) -> CheckRow:
    """The row of one run of the design against the same run of the reference: logits and tokens equal at the
    exact tolerance, every stored K and V the policy's; located by the caches' last contents when it fails."""
    got, want = runs
    ok, err = allclose_err(got.logits, want.logits, tol.rtol, tol.atol)
    same = got.tokens == want.tokens
    if check == "batched" and not same:
        words += "; tokens differ"
    row = CheckRow(
        name=check,
        cache=d.cache,
        passed=ok and same and not shadow.first,
        max_abs_diff=err,
        tolerance=tol.words,
        detail=words + _stored_words(shadow, shadow.first),
        location=shadow.first,
    )
    if not row.passed and not row.location:
        assert d.last_caches is not None and r.last_caches is not None, "cached runs"
        row.location = locate(d.last_caches, r.last_caches, tol.rtol, tol.atol, get_cache_spec(d.cache).visible, when)
    return row


def _scenario(
    d: GPT2Subject, r: GPT2Subject, check: str, prompts: list[list[int]], short: int, tol: Tolerance
) -> CheckRow:
    assert isinstance(d.fault, Recording) and isinstance(r.fault, Reference), "the policy's subjects (_subjects)"
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


def _forward(logs: tuple[Log, Log], check: str, n_layer: int, tol: Tolerance, visible: Visible | None) -> str:
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
