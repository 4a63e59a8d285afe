"""How a check judges: tolerances, the near-tie rule, non-finite logits, and the row a verdict becomes.

Tolerances: exact caches in fp32 must match to rtol = atol = 1e-5 (rtol relative to the row's largest logit, see
`allclose_err`) and produce identical tokens. In fp16/bf16 the two paths round differently, so a token may flip at a
near-tie: a mismatch whose top-2 logit gap at the divergent step is within twice the logit error there (each of the
two logits may move by the error) is reported as a near-tie and passes, with the reason in the row. A lossy cache is
held to its own stated bound, and the row says so: our designs state a logit bound and a minimum token agreement
(`CacheSpec.logit_atol`, `logit_rtol`, `min_greedy_agreement`); transformers' quantized caches a logit bound on
every step against the no-cache forward over the same tokens (teacher-forced).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# (rtol, atol) for cached vs recomputed logits with an exact cache, by dtype. fp32 is 1e-5; the low precisions
# allow their rounding (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
# Against an independent implementation (transformers' eager attention, fp32) on the same weights: in fp32 only
# summation order differs, so 1e-5 holds; low-precision logits also carry their own rounding.
REFERENCE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-2, 5e-2),
    torch.bfloat16: (5e-2, 2e-1),
}

# Tensor parallelism (check/tp.py, the all-reduce rule): each row-parallel layer sums N ranks' partial products with
# an all-reduce, in another order than one matmul sums them. That is rounding of the size the fp32 tolerance already
# allows for summation order (measured: 5e-6 on gpt2's logits at 2 ranks, inside atol 1e-5 + rtol 1e-5 x row scale),
# so the logit tolerances above hold unchanged; the tokens are judged by the near-tie rule in fp32 too (at a step whose
# logits are within that tolerance), since two roundings of a tie may pick either token.
TP_NOTE = (
    "tensor parallel: the all-reduce sums partial products in another order, so logits agree to rounding (the dtype's "
    "tolerance) and a token may flip at a near-tie (top-2 gap <= 2 x logit error), reported, not failed"
)

# Where non-finite logits came from, for the row's detail: the reference is the model itself, not the cache.
NO_CACHE = "the no-cache forward: the model itself is not finite (check its weights), whatever the cache"
CACHED = "the cached run (the no-cache forward is finite)"
MODEL_ITSELF = ": the model itself is not finite (check its weights)"
LOW_PRECISION_NOTE = (
    "low precision: cached and recomputed paths round differently, so a token may flip at a near-tie; such a flip "
    "(top-2 gap <= 2 x logit error at that step) is reported, not failed"
)


@dataclass(kw_only=True)
class CheckRow:
    name: str  # the check
    cache: str  # the cache checked, as named on the command line
    passed: bool
    max_abs_diff: float | None = None  # largest |logit difference| compared (None when no logits were compared)
    first_divergence: int | None = None  # first generated step whose token differs (0 = the prefill's token)
    tolerance: str = ""  # the criterion applied, in words
    detail: str = ""  # what was compared, and why it passed or failed
    skipped: bool = False  # not run here (the detail says why); never fails the report
    # held to the design's declared policy at the exact tolerance (check/policy.py), not to the full-precision model
    policy: bool = False
    # a failing row: where its cache first holds the wrong K or V (step, layer, head, slot), or the first layer whose
    # attention output differs with K/V equal (check/locate.py; a policy row's: check/policy.py); "" otherwise
    location: str = ""


@dataclass
class VerifyReport:
    passed: bool  # every judged row passed, and some row was judged (`verdict`)
    checks: list[CheckRow]
    dtype: str
    new_tokens: int
    prompt_len: int
    batch_lens: list[int]
    reference: str  # what the reference was, or "none"
    notes: list[str] = field(default_factory=list)
    # under --tp: each rank's cache bytes per design beside the planner's figure (check/tp.py RankBytes)
    rank_cache_bytes: list[dict] = field(default_factory=list)
    # each lossy cache's cost against the full-precision path, by cache (check/distortion.py Distortion.as_dict)
    distortion: dict[str, dict] = field(default_factory=dict)
    # verify --text: the text teacher-forced through every cache, perplexity and KL by cache (check/text.py)
    text: dict = field(default_factory=dict)
    nothing_checked: bool = False  # every row was skipped: no verdict either way


def verdict(rows: list[CheckRow]) -> dict[str, bool]:
    """A report's `passed` and `nothing_checked` for `rows`: skipped rows never fail, and a run that skipped every
    row checked nothing, which is no pass."""
    judged = [r for r in rows if not r.skipped]
    return {"passed": bool(judged) and all(r.passed for r in judged), "nothing_checked": not judged}


def skipped(cache: str, why: str, name: str = "-") -> CheckRow:
    return CheckRow(name=name, cache=cache, passed=True, tolerance="skipped", detail=why, skipped=True)


@dataclass(frozen=True)
class Tolerance:
    """What a path is held to: (rtol, atol) on logits; `lossy` paths say so and are judged by `min_agreement` of
    tokens when they state one, otherwise by the logit bound on teacher-forced steps."""

    rtol: float
    atol: float
    lossy: bool = False
    min_agreement: float | None = None
    source: str = ""  # where a lossy bound comes from, e.g. "its logit_atol, logit_rtol"
    near_ties: bool = False  # a token flip the logit error explains passes in fp32 too (tensor parallelism)

    @property
    def words(self) -> str:
        if not self.lossy:
            return f"rtol {self.rtol:g}, atol {self.atol:g}"
        where = f" ({self.source})" if self.source else ""
        return f"lossy: atol {self.atol:g} + rtol {self.rtol:g} x row scale{where}"


def tolerance(
    dtype: torch.dtype,
    lossy: tuple[float, float] | None = None,
    min_agreement: float | None = None,
    reference: bool = False,
    source: str = "",
    tp: int = 1,
) -> Tolerance:
    """The dtype's tolerance (against an independent implementation with `reference`), widened to a lossy path's
    own (rtol, atol); across `tp` tensor-parallel ranks, the all-reduce rule (TP_NOTE)."""
    rtol, atol = (REFERENCE_TOLERANCES if reference else TOLERANCES)[dtype]
    if lossy is None:
        return Tolerance(rtol, atol, near_ties=tp > 1)
    return Tolerance(max(rtol, lossy[0]), max(atol, lossy[1]), True, min_agreement, source, near_ties=tp > 1)


def not_finite(runs: list[tuple[str, torch.Tensor]]) -> str | None:
    """'logits are not finite (3 NaN, 0 inf) in <where>' for the first run whose logits hold a NaN or an inf; None
    when all are finite. Comparing such logits means nothing (NaN is never within a tolerance, and an argmax over
    NaN still picks a token, so two NaN runs would agree), so a check fails with this reason instead."""
    for where, t in runs:
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            return f"logits are not finite ({nan:,} NaN, {inf:,} inf) in {where}"
    return None


def allclose_err(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """|a - b| <= atol + rtol * (the row's largest |logit|): rtol is relative to the logit scale, not to each
    element, since logits near zero would otherwise be held to atol alone, which the fp32 summation-order
    differences of a 12-layer model exceed (about 3e-5 on logits of magnitude 12)."""
    diff = (a - b).abs()
    scale = b.abs().amax(-1, keepdim=True)
    return bool((diff <= atol + rtol * scale).all()), float(diff.max()) if diff.numel() else 0.0


def first_off(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> int:
    """The first row (step) of (N, V) logits outside the tolerance, where allclose_err found one."""
    per_step = (got - want).abs() > tol.atol + tol.rtol * want.abs().amax(-1, keepdim=True)  # (N, V)
    off = per_step.any(-1).nonzero()
    assert off.numel(), "every row within the tolerance: allclose_err passed these logits"
    return int(off[0, 0])


def near_tie(ref_row: torch.Tensor, got_row: torch.Tensor) -> tuple[bool, float, float]:
    """Is a token flip at this step explained by rounding? (explained, top-2 gap, |logit error|)."""
    top2 = ref_row.topk(2).values
    gap, err = float(top2[0] - top2[1]), float((ref_row - got_row).abs().max())
    return gap <= 2 * err, gap, err


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)


def compare_tokens(
    *,
    name: str,
    cache: str,
    dtype: torch.dtype,
    want: list[int],
    got: list[int],
    want_rows: torch.Tensor,
    got_rows: torch.Tensor,
    what: str,
    tol: Tolerance | None = None,
    want_where: str = NO_CACHE,
    got_where: str = CACHED,
) -> CheckRow:
    """Tokens `got` against `want`, with the (N, V) logit rows each was chosen from: exact (near-ties allowed in
    low precision), or a lossy path's token agreement. `want_where` and `got_where` name the two runs when their
    logits are not finite."""
    bad = not_finite([(want_where, want_rows), (got_where, got_rows)])
    if bad:
        return CheckRow(
            name=name,
            cache=cache,
            passed=False,
            tolerance="finite logits",
            detail=f"{what}{'; ' if what else ''}{bad}",
        )
    n = min(len(want), len(got))
    first = first_diff(want, got)
    upto = n if first is None else first + 1  # inputs are identical up to and including the divergent step
    err = float((want_rows[:upto] - got_rows[:upto]).abs().max())
    if tol is not None and tol.lossy and tol.min_agreement is not None:
        agree = sum(w == g for w, g in zip(want, got, strict=False)) / max(n, 1)
        return CheckRow(
            name=name,
            cache=cache,
            passed=agree >= tol.min_agreement,
            max_abs_diff=err,
            first_divergence=first,
            tolerance=f"lossy: agree >= {tol.min_agreement:.0%} (its min_greedy_agreement)",
            detail=f"{what}; {agree:.0%} of {n} tokens agree",
        )
    row = CheckRow(name=name, cache=cache, passed=True, max_abs_diff=err, tolerance="identical tokens")
    if first is None:
        row.detail = f"{what}: all {n} identical"
        return row
    # a flip under tensor parallelism is rounding only where that step's logits are within the tolerance
    reordered = (
        tol is not None and tol.near_ties and allclose_err(got_rows[first], want_rows[first], tol.rtol, tol.atol)[0]
    )
    near_ties = dtype != torch.float32 or reordered
    return _token_flip(row, near_ties, want, got, want_rows[first], got_rows[first], first, what)


def _token_flip(
    row: CheckRow,
    near_ties: bool,
    want: list[int],
    got: list[int],
    want_row: torch.Tensor,
    got_row: torch.Tensor,
    first: int,
    what: str,
) -> CheckRow:
    """An exact path whose tokens differ from step `first`: where `near_ties` are allowed (fp16/bf16, tensor
    parallelism) a flip the logit error explains passes and says so; any other difference fails, naming the step,
    the tokens, the gap and the error."""
    row.first_divergence = first
    tie, gap, step_err = near_tie(want_row, got_row)
    if near_ties and tie:
        row.tolerance = "identical tokens (near-tie flips allowed)"
        row.detail = (
            f"{what}; step {first} flipped at a near-tie: top-2 gap {gap:.3g} <= 2 x logit error {step_err:.3g} "
            "(rounding, not a cache bug)"
        )
        return row
    row.passed = False
    row.detail = (
        f"{what}; token {first} differs ({want[first]} vs {got[first]}), top-2 gap {gap:.3g}, "
        f"logit error {step_err:.3g}"
    )
    return row


def bounded(
    *, name: str, cache: str, tol: Tolerance, got_rows: torch.Tensor, want_rows: torch.Tensor, what: str
) -> tuple[CheckRow, float]:
    """A lossy path: every step's logits within its bound of the no-cache forward over the same tokens.
    Returns the row and the worst step's error as a fraction of that step's largest logit."""
    row = CheckRow(name=name, cache=cache, passed=False, tolerance=tol.words)
    broken = not_finite([(NO_CACHE, want_rows), (CACHED, got_rows)])
    if broken:
        row.detail = f"{what}{'; ' if what else ''}{broken}"
        return row, 0.0
    row.passed, row.max_abs_diff = allclose_err(got_rows, want_rows, tol.rtol, tol.atol)
    rel = float(((got_rows - want_rows).abs().amax(-1) / want_rows.abs().amax(-1)).max())
    row.detail = f"{what}; worst step {rel:.1%} of its row scale"
    return row, rel
