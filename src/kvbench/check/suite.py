"""The checks behind `kvbench verify`, written once against a subject (check/subject.py): each returns rows.

    logits       every cached decode step against one no-cache forward over exactly the same prefix
    greedy       N greedy tokens through the cache against the no-cache path
    reference    logits against an independent implementation of the same weights (where the model has one)
    batched      prompts of different lengths, left-padded and decoded together, against each prompt alone
    cache_state  a cache prepared for reuse and run on a new prompt, against a fresh cache

Cached decode steps are teacher-forced on the tokens the cached run produced, so a bug that appears only after a
few steps (a write pointer that stops advancing) shows at the step it starts. The no-cache path runs only `batched`
(and `reference`). A subject that cannot run here is one skipped row saying why; a run that raises is a failed row
with the exception, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

from kvbench.check.judge import (
    CACHED,
    MODEL_ITSELF,
    NO_CACHE,
    CheckRow,
    allclose_err,
    bounded,
    compare_tokens,
    first_off,
    not_finite,
    skipped,
)
from kvbench.check.lifecycle import LIFECYCLE, lifecycle_rows
from kvbench.check.locate import EVERY_RANK, located
from kvbench.check.subject import ReferencedModel, Run, Subject
from kvbench.errors import CheckRaised, KVBenchError, is_out_of_memory, one_line

CHECKS = ("logits", "greedy", "reference", "batched", "cache_state", *LIFECYCLE)
RANK_CACHE = "rank_cache"  # tensor-parallel runs add it: each rank's cache against its slice (check/tp.py)
TP_CHECKS = (*CHECKS, RANK_CACHE)
SHORT_TOKENS = 16  # new tokens in the batched and cache_state checks (each runs several generations)


# --- the checks ------------------------------------------------------------------------------------------------
def check_logits(s: Subject, prompt: list[int], res: Run) -> CheckRow:
    """Decode steps 1..N-1 of `res` against one no-cache forward over prompt + the tokens it chose."""
    T = len(prompt)
    got, want = res.logits[0, 1:], s.model.full_logits(prompt, res.tokens[0])[T:]  # (N - 1, V) each
    bad = not_finite([(NO_CACHE, want), (CACHED, got)])
    if bad:
        return CheckRow(name="logits", cache=s.cache, passed=False, tolerance=s.tol.words, detail=bad)
    ok, err = allclose_err(got, want, s.tol.rtol, s.tol.atol)
    first = None if ok else first_off(got, want, s.tol) + 1
    what = f"decode steps 1..{got.size(0)} vs a full forward over the same prefix"
    return CheckRow(
        name="logits",
        cache=s.cache,
        passed=ok,
        max_abs_diff=err,
        tolerance=s.tol.words,
        detail=what + (f"; first off at step {first}" if first else ""),
    )


def check_greedy(s: Subject, prompt: list[int], res: Run) -> CheckRow:
    """Every cached greedy token against the no-cache path's (a lossy cache without a token rule: its logit bound
    on every step, teacher-forced)."""
    got, n = res.tokens[0], len(res.tokens[0])
    ref = s.model.no_cache(prompt, n, got)
    if s.tol.lossy and s.tol.min_agreement is None:
        forced = s.model.full_logits(prompt, got)[len(prompt) - 1 :]  # (N, V): no cache, on its own tokens
        agree = sum(a == b for a, b in zip(ref.tokens, got, strict=True))
        what = f"{n} steps vs no cache on the same tokens; {agree} of {n} tokens as {ref.source}"
        return bounded(name="greedy", cache=s.cache, tol=s.tol, got_rows=res.logits[0], want_rows=forced, what=what)[0]
    return compare_tokens(
        name="greedy",
        cache=s.cache,
        dtype=s.model.dtype,
        want=ref.tokens,
        got=got,
        want_rows=ref.rows,
        got_rows=res.logits[0],
        what=ref.words,
        tol=s.tol,
    )


def check_reference(s: Subject, prompt: list[int], res: Run | None, new: int = 0) -> CheckRow:
    """Our logits against the independent implementation over the same tokens (teacher-forced). The no-cache path
    (`res` None): every position of one forward over a continuation; a cache: the logits of each generated step."""
    tol, T, model = s.reference_tol, len(prompt), s.model
    assert isinstance(model, ReferencedModel), f"{type(model).__name__} has no reference (plan() asks for none)"
    tokens = res.tokens[0] if res is not None else model.continuation(prompt, new)
    ours_full = model.full_logits(prompt, tokens)
    theirs = model.reference_logits(prompt, tokens)
    ours = ours_full if res is None else res.logits[0]
    where = f"{model.reference_name}'s reference (ours are finite)"
    bad = not_finite([(NO_CACHE, ours_full), (CACHED, ours), (where, theirs)])
    if bad:
        return CheckRow(name="reference", cache=s.cache, passed=False, tolerance=tol.words, detail=bad)
    if res is None:
        ok, err = allclose_err(ours_full, theirs, tol.rtol, tol.atol)
        what = f"no-cache logits at all {ours_full.size(0)} positions vs HF"
    else:
        ok, err = allclose_err(ours, theirs[T - 1 :], tol.rtol, tol.atol)
        what = f"prefill + {ours.size(0) - 1} decode steps vs HF"
    return CheckRow(name="reference", cache=s.cache, passed=ok, max_abs_diff=err, tolerance=tol.words, detail=what)


def _failed(name: str, cache: str, tolerance: str, detail: str) -> CheckRow:
    """A check's failed row that ran no comparison."""
    return CheckRow(name=name, cache=cache, passed=False, tolerance=tolerance, detail=detail)


def check_batched(s: Subject, prompts: list[list[int]], batch: Run, solo: list[Run]) -> CheckRow:
    """Each row of the left-padded batch against the same prompt alone through the same cache; a lossy cache
    without a token rule (whose quantisation scales may span the batch) against the no-cache forward of that
    prompt alone on the batch's tokens."""
    lens = [len(p) for p in prompts]
    n = len(batch.tokens[0])
    what = f"lengths {', '.join(map(str, lens))} left-padded together vs alone, {n} tokens"
    by_bound = s.tol.lossy and s.tol.min_agreement is None
    runs = (
        [] if by_bound else [(f"the prompt of length {m} alone", r.logits[0]) for m, r in zip(lens, solo, strict=True)]
    )
    broken = not_finite([*runs, ("the padded batch", batch.logits)])
    if broken:
        return _failed("batched", s.cache, "finite logits", f"{what}; {broken}{'' if s.cached else MODEL_ITSELF}")
    if by_bound:
        return _batched_by_bound(s, prompts, batch, what)
    rows = [
        compare_tokens(
            name="batched",
            cache=s.cache,
            dtype=s.model.dtype,
            want=r.tokens[0],
            got=batch.tokens[b],
            want_rows=r.logits[0],
            got_rows=batch.logits[b],
            what="",
            tol=s.tol,
        )
        for b, r in enumerate(solo)
    ]
    bad = [b for b, r in enumerate(rows) if not r.passed]
    firsts = [r.first_divergence for r in rows if r.first_divergence is not None]
    if bad:
        what += "; differs for length " + ", ".join(f"{lens[b]} (from step {rows[b].first_divergence})" for b in bad)
        if 0 not in bad:  # the longest prompt has no padding
            what += "; only padded rows differ: " + (
                "suspect position ids or the padding mask" if s.cached else s.model.left_padding_note()
            )
    else:
        what += "".join(f"; length {lens[b]}{r.detail}" for b, r in enumerate(rows) if "near-tie" in r.detail)
        if s.tol.lossy:
            agree = min(
                sum(x == y for x, y in zip(r.tokens[0], batch.tokens[b], strict=True)) / n for b, r in enumerate(solo)
            )
            what += f"; worst row: {agree:.0%} of {n} tokens agree"
    err = max(r.max_abs_diff for r in rows if r.max_abs_diff is not None)  # all of them: the logits are finite
    return CheckRow(
        name="batched",
        cache=s.cache,
        passed=not bad,
        max_abs_diff=err,
        first_divergence=min(firsts, default=None),
        tolerance=rows[0].tolerance,
        detail=what,
    )


def _batched_by_bound(s: Subject, prompts: list[list[int]], batch: Run, what: str) -> CheckRow:
    rows = [
        bounded(
            name="batched",
            cache=s.cache,
            tol=s.tol,
            got_rows=batch.logits[b],
            want_rows=s.model.full_logits(p, batch.tokens[b])[len(p) - 1 :],
            what="",
        )
        for b, p in enumerate(prompts)
    ]
    unjudged = next((r for r, _ in rows if r.max_abs_diff is None), None)  # a reference that is not finite
    if unjudged is not None:
        return CheckRow(
            name="batched",
            cache=s.cache,
            passed=False,
            tolerance=unjudged.tolerance,
            detail=what + unjudged.detail,
        )
    bad = [len(prompts[b]) for b, (r, _) in enumerate(rows) if not r.passed]
    what = what.replace("vs alone", "vs no cache alone on the same tokens")
    what += f"; beyond the bound for length {', '.join(map(str, bad))}" if bad else ""
    what += f"; worst step {max(rel for _, rel in rows):.1%} of its row scale"
    err = max(r.max_abs_diff for r, _ in rows if r.max_abs_diff is not None)  # all of them: `unjudged` is None
    return CheckRow(name="batched", cache=s.cache, passed=not bad, max_abs_diff=err, tolerance=s.tol.words, detail=what)


def check_cache_state(s: Subject, prev: list[int], prompt: list[int], fresh: Run, new: int) -> CheckRow:
    """`prev`, then `prompt` on the same cache objects (prepared for reuse as the design does), against a fresh
    cache for `prompt`: identical."""
    try:
        reused, words = s.reused(prev, prompt, new)
    except KVBenchError as e:  # e.g. a static cache that overflows because it was never reset
        return _failed("cache_state", s.cache, "identical tokens", f"reuse raised: {e}")
    return compare_tokens(
        name="cache_state",
        cache=s.cache,
        dtype=s.model.dtype,
        want=fresh.tokens[0],
        got=reused.tokens[0],
        want_rows=fresh.logits[0],
        got_rows=reused.logits[0],
        what=f"{words} vs fresh, {new} tokens",
        tol=s.tol,
        want_where="a fresh cache",
        got_where="the reused cache",
    )


# --- the driver ------------------------------------------------------------------------------------------------
def _guarded(s: Subject, names: list[str], fn: Callable[[], list[CheckRow]]) -> list[CheckRow]:
    try:
        return fn()
    except s.crashes as e:
        why = f"the run raised {one_line(e)}"
        return [
            CheckRow(name=n, cache=s.cache, passed=False, tolerance="runs without error", detail=why) for n in names
        ]
    except Exception as e:
        from kvbench.distributed import peer_lost, raised_together

        if s.crashes or isinstance(e, KVBenchError) or is_out_of_memory(e) or peer_lost(e):
            raise
        # a tensor-parallel rank catches nothing (kvbench.check.tp.IN_STEP): the step is a failed row only where
        # every rank raised in it (kvbench.distributed.raised_together); else what ends the run is named here
        rows = " ".join(f"{n}/{s.cache}" for n in names)
        if getattr(s, "together", False) and raised_together(rows):
            why = f"the run raised {one_line(e)}{EVERY_RANK}"
            return [
                CheckRow(name=n, cache=s.cache, passed=False, tolerance="runs without error", detail=why) for n in names
            ]
        raise CheckRaised(
            f"{rows} raised {one_line(e)}: under --tp a check that does not raise on every rank ends the run (this "
            "rank cannot go on to the collectives the other ranks wait in); verify without --tp reports it as a "
            "failed row"
        ) from e


def plan(s: Subject, checks: tuple[str, ...], prompts: list[list[int]], new: int, short: int) -> list[tuple]:
    """(check names, the function producing their rows) for one subject: the single-prompt checks share one run,
    `batched` and `cache_state` share the runs of each prompt alone; each group fails alone if it raises."""
    prompt, solo = prompts[0], {}

    def alone(i: int) -> Run:
        if i not in solo:
            solo[i] = s.generate([prompts[i]], short)
        return solo[i]

    def single() -> list[CheckRow]:
        if not s.cached:
            return [check_reference(s, prompt, None, new)]
        res = s.generate([prompt], new)
        checks_of = {"logits": check_logits, "greedy": check_greedy, "reference": check_reference}
        return [checks_of[c](s, prompt, res) for c in single_names]

    def batched() -> list[CheckRow]:
        if not getattr(s, "pads", True):
            return [skipped(s.cache, "it evicts by position: it takes no left-padded batch", "batched")]
        batch = s.generate(prompts, short)
        return [check_batched(s, prompts, batch, [alone(i) for i in range(len(prompts))])]

    def cache_state() -> list[CheckRow]:
        return [check_cache_state(s, prompts[0], prompts[1], alone(1), short)]

    has_ref = s.model.reference_name is not None
    wanted = [c for c in ("logits", "greedy") if s.cached] + (["reference"] if has_ref else [])
    single_names = [c for c in wanted if c in checks]
    groups: list[tuple[list[str], Callable[[], list[CheckRow]]]] = [(single_names, single), (["batched"], batched)]
    groups += [(["cache_state"], cache_state)] if s.cached else []
    groups += [([c], partial(lifecycle_rows, s, c, prompts, short)) for c in LIFECYCLE if s.cached]
    return [(names, fn) for names, fn in groups if names and all(n in checks for n in names)]


def run_checks(
    subjects: Sequence[Subject],
    prompts: list[list[int]],
    new_tokens: int,
    checks: tuple[str, ...],
    short_tokens: int = SHORT_TOKENS,
    on_row: Callable[[CheckRow], None] | None = None,
    baseline: Subject | None = None,
) -> list[CheckRow]:
    """Every check in `checks` for every subject on `prompts` (prompts[0] is the single-prompt checks' prompt and
    cache_state's first; prompts[1] its second; all of them form the batch), rows passed to `on_row` as they come.

    The no-cache subjects run first. A check the no-cache path fails (a model that cannot take a left-padded batch
    fails `batched` with no cache at all) is not judged for the caches: their rows for it are skipped, naming
    the no-cache row. `baseline`, a no-cache subject not among `subjects`, runs for that purpose: only the rows it
    fails are returned (the model's own defect, and the reason for the skips)."""
    rows: list[CheckRow] = []
    model_fails: dict[str, str] = {}  # check -> the no-cache row's detail

    def add(row: CheckRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    lens = [len(p) for p in prompts]
    # the caller's promise (validate.verify_rules): a decode step, and prompts of different lengths for `batched`
    assert new_tokens >= 2 and len(set(lens)) >= 2, f"{new_tokens} new tokens, prompt lengths {lens}"
    short = min(short_tokens, new_tokens)
    if baseline is not None and not any(not s.cached for s in subjects):
        for row in _subject_rows(baseline, checks, prompts, new_tokens, short, {}):
            if _note_model_failure(row, model_fails):
                add(row)  # the model's own failure is reported, as the reason the caches' rows skip
    for s in sorted(subjects, key=lambda s: s.cached):  # stable: the no-cache path first
        for row in _subject_rows(s, checks, prompts, new_tokens, short, model_fails):
            if not s.cached:
                _note_model_failure(row, model_fails)
            add(row)
    return rows


def _subject_rows(
    s: Subject, checks: tuple[str, ...], prompts: list[list[int]], new: int, short: int, model_fails: dict[str, str]
) -> Iterator[CheckRow]:
    why = s.unavailable()
    if why:
        yield skipped(s.cache, why)
        return
    unjudged = s.model.unjudged(max(map(len, prompts)) + new)
    for names, fn in plan(s, checks, prompts, new, short):
        if s.cached and all(n in model_fails for n in names):
            for n in names:
                yield skipped(s.cache, f"not judged: the model fails it without a cache (see {n}/none)", n)
            continue
        for row in located(s, partial(_guarded, s, names, fn), prompts, new, short):
            measured = row.max_abs_diff is not None or row.first_divergence is not None
            err = f"max |dlogit| {row.max_abs_diff:.3g}; " if row.max_abs_diff is not None else ""
            if unjudged and not row.passed and measured:  # a difference, not a crash
                row = skipped(s.cache, f"not judged exact: {unjudged}; measured: {err}{row.detail}", row.name)
            elif not row.passed and not row.skipped and (defect := s.known(row.name, row.detail)):
                row = skipped(s.cache, f"not judged: {defect}; measured: {err}{row.detail}", row.name)
            yield row


def _note_model_failure(row: CheckRow, model_fails: dict[str, str]) -> bool:
    """Record a check the no-cache path fails (the caches' rows for it then skip); True if it failed."""
    failed = not row.passed and not row.skipped and row.name != "reference"
    if failed:
        model_fails[row.name] = row.detail
    return failed


def prompts_note(prompts: list[list[int]], new_tokens: int, short_tokens: int, has_ref: bool) -> str:
    """What each check ran on, in one line."""
    lens = ", ".join(str(len(p)) for p in prompts)
    single = ["logits", "greedy"] + (["reference"] if has_ref else [])
    named = " and ".join([", ".join(single[:-1]), single[-1]]) if len(single) > 1 else single[0]
    return (
        f"{len(prompts)} seeded prompts of lengths {lens}; {named} use the first with {new_tokens} new tokens; "
        f"batched and cache_state use {min(short_tokens, new_tokens)} new tokens"
    )
