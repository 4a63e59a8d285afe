"""A warm run judged against a cold one, kvbench's near-tie rule read from an engine's logprobs.

Each comparison is one of three: **bit-identical** (the same tokens, and where the engine gives them the same
sampled-token logprobs to the last bit); **drift bounded by near-ties** (the same tokens with logprobs within
`tol` of each other, or a token that flips at a step whose logprob error is within `tol` and where the cold run's
gap between the two tokens is within twice that error: rounding and not a cache bug, as verify judges a flip in
fp16); **diverged** (anything else), with its first divergent step and the evidence. After a flip the two runs continue from different tokens, so nothing past it
is compared.

What is compared is the best the engine gives: the completion's token ids, else its token strings, else its text;
the logprobs of the sampled tokens where both runs have them. Without logprobs a flip cannot be told from a bug and
diverges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.check.judge import CheckRow
from kvbench.endpoint.completion import Completion

IDENTICAL, DRIFT, DIVERGED = "bit-identical", "drift bounded by near-ties", "diverged"
NO_TIE = "the engine gives no logprobs, so a near-tie cannot be told from a bug"


@dataclass
class Comparison:
    label: str  # which runs: "warm run 1 vs cold"
    kind: str  # IDENTICAL, DRIFT or DIVERGED
    basis: str  # "logprobs", "token ids", "tokens" or "text"
    words: str  # what was seen
    max_diff: float | None = None  # largest |Δlogprob| of the sampled tokens compared
    first: int | None = None  # the first step whose token differs


def compare(label: str, cold: Completion, warm: Completion, tol: float) -> Comparison:
    a: list[int] | list[str]
    b: list[int] | list[str]
    if cold.token_ids is not None and warm.token_ids is not None:
        basis, a, b = "token ids", cold.token_ids, warm.token_ids
    elif cold.tokens is not None and warm.tokens is not None:
        basis, a, b = "tokens", cold.tokens, warm.tokens
    else:
        return _text(label, cold.text, warm.text)
    first = _first_diff(a, b)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    steps = len(a) if first is None else first
    if not (cold.has_logprobs and warm.has_logprobs and _aligned(cold, a) and _aligned(warm, b)):
        if first is None:
            return Comparison(label, IDENTICAL, basis, f"all {len(a)} tokens identical (no logprobs)")
        return Comparison(label, DIVERGED, basis, f"{_flip(cold, warm, first)}; {NO_TIE}", first=first)
    assert cold.logprobs is not None and warm.logprobs is not None
    diffs = [_diff(cold.logprobs[i], warm.logprobs[i]) for i in range(steps)]
    off = next((i for i, d in enumerate(diffs) if not d <= tol), None)  # NaN is past any tolerance
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    if off is not None:
        words = f"step {off}'s logprob differs by {diffs[off]:.3g} > {tol:g} with the same tokens up to it"
        return Comparison(label, DIVERGED, "logprobs", words, worst, first)
    if first is None:
        if worst == 0:
            return Comparison(label, IDENTICAL, "logprobs", f"all {len(a)} tokens and logprobs identical", 0.0)
        return Comparison(label, DRIFT, "logprobs", f"same {len(a)} tokens, |Δlogprob| <= {worst:.3g}", worst)
    return _flipped(label, cold, warm, first, worst, tol)


def _diff(a: float, b: float) -> float:
    """|a - b|, 0 where they are equal (the same infinity too); NaN where either is NaN: a logprob the engine could
    not compute is never drift."""
    return 0.0 if a == b else abs(a - b)


def _first_diff(a: Sequence[object], b: Sequence[object]) -> int | None:
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)


def _aligned(c: Completion, seq: Sequence[object]) -> bool:
    return c.logprobs is not None and len(c.logprobs) == len(seq)


def _text(label: str, a: str, b: str) -> Comparison:
    if a == b:
        return Comparison(label, IDENTICAL, "text", f"identical text ({len(a)} characters; no logprobs or tokens)")
    i = _first_diff(a, b)
    i = min(len(a), len(b)) if i is None else i
    words = f"text differs from character {i}: {a[i : i + 12]!r} vs {b[i : i + 12]!r}; {NO_TIE}"
    return Comparison(label, DIVERGED, "text", words)


def _flip(cold: Completion, warm: Completion, k: int) -> str:
    def token(c: Completion) -> str:
        ids, strs = c.token_ids, c.tokens
        if ids is not None and k >= len(ids) or ids is None and (strs is None or k >= len(strs)):
            return "(ended)"
        text = repr(strs[k]) if strs is not None and k < len(strs) else ""
        return f"{ids[k]} {text}".strip() if ids is not None else text

    return f"token {k} differs (cold {token(cold)} vs warm {token(warm)})"


def _flipped(label: str, cold: Completion, warm: Completion, k: int, before: float, tol: float) -> Comparison:
    """A token that differs at step `k` with logprobs within the tolerance before it: a near-tie where the logprob
    error at `k` is within the tolerance too and the cold run's gap between the two tokens within twice that error."""
    flip = _flip(cold, warm, k)
    if cold.tops is None or warm.tops is None or k >= min(len(cold.tops), len(warm.tops)):
        words = f"{flip}; no top logprobs at that step, so a near-tie cannot be told from a bug"
        return Comparison(label, DIVERGED, "logprobs", words, before, k)
    assert cold.tokens is not None and warm.tokens is not None and cold.logprobs is not None
    ctop, wtop = cold.tops[k], warm.tops[k]
    common = set(ctop) & set(wtop)
    err = max((abs(ctop[t] - wtop[t]) for t in common), default=before)
    runner_up = ctop.get(warm.tokens[k])
    if runner_up is None:
        words = f"{flip}; the warm token is not in the cold run's top {len(ctop)}, so the gap is unknown"
        return Comparison(label, DIVERGED, "logprobs", words, max(before, err), k)
    gap = cold.logprobs[k] - runner_up
    if err > tol:
        words = f"{flip}, where the logprobs differ by {err:.3g} > {tol:g}"
        return Comparison(label, DIVERGED, "logprobs", words, max(before, err), k)
    if gap <= 2 * err:
        words = f"{flip} at a near-tie: top-2 gap {gap:.3g} <= 2 x logprob error {err:.3g} (rounding, not a cache bug)"
        return Comparison(label, DRIFT, "logprobs", words, max(before, err), k)
    words = f"{flip}: top-2 gap {gap:.3g} > 2 x logprob error {err:.3g}"
    return Comparison(label, DIVERGED, "logprobs", words, max(before, err), k)


def tolerance_words(basis: str, tol: float) -> str:
    if basis == "logprobs":
        return f"identical, or |Δlogprob| <= {tol:g} and flips at near-ties only"
    return f"identical {basis} (the engine gives no logprobs)"


def comparison_row(name: str, column: str, what: str, comparisons: list[Comparison], tol: float) -> CheckRow:
    """One check's row from its comparisons: failed by the first that diverged; the figure is the largest
    |Δlogprob|; the detail says the verdict with the worst comparison's evidence, then what was run."""
    assert comparisons, "a row compares something"
    bad = [c for c in comparisons if c.kind == DIVERGED]
    drift = [c for c in comparisons if c.kind == DRIFT]
    worst = bad[0] if bad else max(drift, key=lambda c: c.max_diff or 0.0) if drift else comparisons[0]
    if bad:
        verdict = f"{DIVERGED}: {worst.label}: {worst.words}"
    elif drift:
        verdict = f"{DRIFT}: {worst.label}: {worst.words}"
    else:
        verdict = f"{IDENTICAL}: {len(comparisons)} of {len(comparisons)} ({worst.words})"
    diffs = [c.max_diff for c in comparisons if c.max_diff is not None]
    return CheckRow(
        name=name,
        cache=column,
        passed=not bad,
        max_abs_diff=max(diffs) if diffs else None,
        first_divergence=worst.first,
        tolerance=tolerance_words(worst.basis if worst.basis == "logprobs" else comparisons[0].basis, tol),
        detail=f"{verdict}; runs: {what}",
    )
