"""The lifecycle checks: what a real decoder does to its cache besides appending, written once against a subject's
live cache (`Session`, check/subject.py).

    rollback         prefill, decode, write a block of draft tokens in one forward, crop back to accept only some of
                     them (speculative decoding), continue; then crop to 0 and start over on another prompt
    fork             prefill a shared prefix once, fork it, continue two different suffixes in the two copies, their
                     steps interleaved (a copy that aliases its original shows at once)
    reorder          a batch of beams where each step keeps and repeats rows ([1, 1, 0], then [2, 0, 1])
    chunked_prefill  the prompt written in chunks (one token at a time, 7 at a time) against all at once

Every logit a session produces is compared with one no-cache forward over the sequence that row holds at that
point (teacher-forced: the tokens are those the cached run chose, so a wrong cache also shows as wrong tokens in the
detail). Exact caches: the suite's tolerance (fp32: 1e-5 of the row scale); lossy ones: their own bound. A cache that
lacks an operation is a skip row naming it.
"""

from __future__ import annotations

import torch

from kvbench.check.judge import CheckRow, allclose_err, first_diff, first_off, not_finite, skipped
from kvbench.check.subject import Session, Subject, Unsupported
from kvbench.errors import one_line

LIFECYCLE = ("rollback", "fork", "reorder", "chunked_prefill")
DRAFT = 6  # the draft rollback writes in one forward and then crops back by half
NEEDS = {"rollback": ("crop",), "fork": ("fork",), "reorder": ("reorder",), "chunked_prefill": ()}


class Trace:
    """What a scenario produced: per logit row, the sequence it predicts the next token of, and the row itself."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self.rows: list[torch.Tensor] = []

    @property
    def tokens(self) -> list[int]:
        """The greedy choice at every recorded row (break shows these beside the correct cache's)."""
        return [int(r.argmax()) for r in self.rows]

    def add(self, history: list[int], logits: torch.Tensor) -> None:
        """`logits` (T, V) of the last T tokens of `history` (each row predicts the token after its prefix)."""
        T = logits.size(0)
        for i in range(T):
            self.seqs.append(history[: len(history) - T + i + 1])
            self.rows.append(logits[i])


def _longest(prompts: list[list[int]], n: int) -> list[list[int]]:
    """The n longest prompts, longest first (a chunk after the first needs a prompt longer than the chunk)."""
    return sorted(prompts, key=len, reverse=True)[:n]


def _step(session: Session, trace: Trace, histories: list[list[int]], new: list[list[int]]) -> list[int]:
    """Write `new[b]` (the same count per row) after histories[b]; record each row's logits; return each row's
    greedy next token. Histories are extended in place."""
    logits = session.forward(new)  # (B, T, V)
    for b, h in enumerate(histories):
        h.extend(new[b])
        trace.add(h, logits[b])
    return logits[:, -1].argmax(-1).tolist()


def _decode(session: Session, trace: Trace, history: list[int], first: int, n: int) -> int:
    """n greedy steps of one row starting with token `first`; returns the next token."""
    tok = first
    for _ in range(n):
        tok = _step(session, trace, [history], [[tok]])[0]
    return tok


def rollback(s: Subject, prompts: list[list[int]], new: int) -> Trace:
    trace, (prompt, other) = Trace(), _longest(prompts, 2)
    session = s.open(1, len(prompt) + 3 * new + 8)
    session.prepare_rollback(DRAFT)
    hist: list[int] = []
    tok = _step(session, trace, [hist], [prompt])[0]
    tok = _decode(session, trace, hist, tok, max(2, new // 4))
    draft = [tok, *(prompt * DRAFT)[1:DRAFT]]  # one forward over the draft, as a prompt lookup proposes it
    _step(session, trace, [hist], [draft])
    keep = len(hist) - DRAFT // 2  # accept the first half of the draft, forget the rest
    session.crop(keep)
    del hist[keep:]
    _decode(session, trace, hist, draft[3], max(2, new // 2))
    session.crop(0)
    hist = []
    tok = _step(session, trace, [hist], [other])[0]
    _decode(session, trace, hist, tok, 3)
    return trace


def fork(s: Subject, prompts: list[list[int]], new: int) -> Trace:
    trace, (prompt, other) = Trace(), _longest(prompts, 2)
    original = s.open(1, len(prompt) + 2 * new + 2)
    base: list[int] = []
    tok = _step(original, trace, [base], [prompt])[0]
    copy = original.fork()
    a, b = list(base), list(base)
    ta, tb = tok, other[0]  # two different continuations
    for _ in range(max(2, new // 2)):  # interleaved: a write to either would show in the other at once
        tb = _step(copy, trace, [b], [[tb]])[0]
        ta = _step(original, trace, [a], [[ta]])[0]
    return trace


def reorder(s: Subject, prompts: list[list[int]], new: int) -> Trace:
    trace, T = Trace(), min(map(len, prompts))
    beams = [list(p[-T:]) for p in (prompts * 3)[:3]]  # three rows of one length: no padding
    beams[-1] = beams[-1][::-1]  # distinct rows even from two prompts
    session = s.open(3, T + 2 * new + 4)
    hists: list[list[int]] = [[], [], []]
    toks = _step(session, trace, hists, beams)
    for index in ([1, 1, 0], [2, 0, 1], [0, 0, 2]):
        session.reorder(index)
        hists = [list(hists[i]) for i in index]
        toks = [toks[i] for i in index]
        for _ in range(max(1, new // 6)):
            # row 0 follows its greedy token, the others a token of the prompt: rows of one history diverge
            toks = _step(session, trace, hists, [[t if r == 0 else beams[r][r % T]] for r, t in enumerate(toks)])
    return trace


def chunked_prefill(s: Subject, prompts: list[list[int]], new: int) -> Trace:
    trace, prompt = Trace(), _longest(prompts, 1)[0]
    for chunk in (1, 7, len(prompt)):
        session = s.open(1, len(prompt) + new + 2)
        hist: list[int] = []
        for i in range(0, len(prompt), chunk):
            tok = _step(session, trace, [hist], [prompt[i : i + chunk]])[0]
        _decode(session, trace, hist, tok, max(2, new // 4))
    return trace


SCENARIOS = {"rollback": rollback, "fork": fork, "reorder": reorder, "chunked_prefill": chunked_prefill}


def _no_cache_rows(s: Subject, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The no-cache logits after each sequence, one forward per sequence that is not a prefix of another."""
    longest: list[list[int]] = []
    for seq in sorted(seqs, key=len, reverse=True):
        if not any(m[: len(seq)] == seq for m in longest):
            longest.append(seq)
    full = {tuple(m): s.model.full_logits(m, [0]) for m in longest}  # (len(m), V) each
    rows = []
    for seq in seqs:
        m = next(m for m in longest if m[: len(seq)] == seq)
        rows.append(full[tuple(m)][len(seq) - 1])
    return rows


def judge(s: Subject, name: str, trace: Trace) -> CheckRow:
    """Every recorded row against the no-cache forward over the sequence it belongs to."""
    got = torch.stack(trace.rows)  # (R, V)
    want = torch.stack(_no_cache_rows(s, trace.seqs))  # (R, V)
    bad = not_finite([("the no-cache forward: the model itself is not finite", want), ("the cached run", got)])
    what = f"{len(trace.rows)} logit rows vs a no-cache forward over each row's sequence"
    if bad:
        return CheckRow(name=name, cache=s.cache, passed=False, tolerance=s.tol.words, detail=f"{what}; {bad}")
    ok, err = allclose_err(got, want, s.tol.rtol, s.tol.atol)
    if not ok:
        r = first_off(got, want, s.tol)
        what += f"; first off at row {r} (a sequence of {len(trace.seqs[r])} tokens)"
    flips = int((got.argmax(-1) != want.argmax(-1)).sum())
    what += f"; {flips} of {len(trace.rows)} greedy choices differ" if flips else ""
    return CheckRow(name=name, cache=s.cache, passed=ok, max_abs_diff=err, tolerance=s.tol.words, detail=what)


def lifecycle_rows(s: Subject, name: str, prompts: list[list[int]], new: int) -> list[CheckRow]:
    missing = s.missing_lifecycle(NEEDS[name])
    if missing:
        return [skipped(s.cache, missing, name)]
    try:
        trace = SCENARIOS[name](s, prompts, new)
    except Unsupported as e:
        return [skipped(s.cache, str(e), name)]
    return [with_features(s, name, judge(s, name, trace), _longest(prompts, 1)[0], new)]


# What a library raises to decline a feature it does not offer for a cache (a note in the row, not a failure).
DECLINED = (ValueError, NotImplementedError)


def with_features(s: Subject, name: str, row: CheckRow, prompt: list[int], new: int) -> CheckRow:
    """The row, with the subject's generation features built on this operation run and compared: equal tokens
    pass; a feature the library declines for this cache is noted with its reason; any other difference or error
    fails the row."""
    for feature, run, reference in s.generation_features(name):
        try:
            got, want = run(prompt, new), reference(prompt, new)
        except DECLINED as e:
            row.detail += f"; {feature}: declined by the library ({one_line(e)})"
            continue
        except Exception as e:  # a crash inside the feature is a failure of this row, never a traceback
            row.passed = False
            row.detail += f"; {feature} raised {one_line(e)}"
            continue
        first = first_diff(want, got)
        if first is None:
            row.detail += f"; {feature}: all {len(got)} tokens as without it"
        elif s.tol.lossy:  # a lossy cache may flip tokens: reported, not judged
            agree = sum(a == b for a, b in zip(want, got, strict=False))
            row.detail += f"; {feature}: {agree} of {len(got)} tokens as without it (lossy: reported, not judged)"
        else:
            row.passed = False
            row.detail += f"; {feature}: token {first} differs ({got[first]} vs {want[first]})"
    return row
