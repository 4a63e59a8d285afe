"""accounting: what an engine says it reused, held to what it could reuse.

`usage.prompt_tokens_details.cached_tokens` is checked against the reusable prefix rounded down to whole blocks:
0 for a prompt nothing sent before began with; for a repeat, the prompt but its last token (whose logits must be
computed); for S+B after S+A, S; for B+D after C+B, 0 (B's tokens were cached after C, not at the start); for prompt + completion
+ more after the prompt, at least the prompt and at most the prompt and the completion but its last token (the
tokens whose K/V the engine computed). The block size is the one
/metrics states, else the one power of two from 1 to 256 every count fits (SGLang and llama.cpp reuse any number of
tokens: 1). After a reset nothing may be reported cached. Where /metrics counts prefix-cache hits, the hit tokens it
counted over those requests must equal the sum the answers reported. TTFT of a warm repeat beside an unseen prompt
of the same length is reported as evidence only: load moves it, so it is never a verdict.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvbench.check.judge import CheckRow, skipped
from kvbench.endpoint.checks import Run, join
from kvbench.endpoint.completion import Completion
from kvbench.endpoint.engine import HITS, QUERIES, Metrics

BLOCKS = tuple(2**i for i in range(9))  # the block sizes a count may be rounded to when /metrics states none
TTFT_RUNS = 3
SETTLE_S = (0.0, 0.5, 1.0, 2.0)  # waits before reading the counters again: some engines count a step late
NO_FIELD = (
    "the engine's answers have no usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details; "
    "SGLang: --enable-cache-report)"
)


@dataclass
class Seen:
    """One request: what it was, its prompt's tokens, the cached tokens it reported, and the reusable prefix in
    tokens before rounding to blocks (`low` to `high`: a range for the multi-turn extension)."""

    what: str
    prompt_tokens: int
    cached: int
    low: int
    high: int

    def bounds(self, b: int) -> tuple[int, int]:
        most = self.prompt_tokens - 1  # the last prompt token is always computed
        return min(self.low, most) // b * b, min(self.high, most) // b * b

    def fits(self, b: int) -> bool:
        lo, hi = self.bounds(b)
        return self.cached % b == 0 and lo <= self.cached <= hi

    def words(self, b: int | None) -> str:
        got = f"{self.what} {self.cached} of {self.prompt_tokens}"
        if b is None or self.fits(b):
            return got
        lo, hi = self.bounds(b)
        return f"{got} (expected {lo}{'' if lo == hi else f' to {hi}'})"


def accounting(r: Run) -> Iterator[CheckRow]:
    e = r.engine
    if not e.cached_field:
        yield skipped(r.column, NO_FIELD, "accounting")
        _ttft(r)
        return
    m0 = _counters(r)
    seen = _observe(r)
    m1 = _settled(r, m0, seen)
    yield _cached_row(r, seen, m0, m1)
    yield _reset_row(r)
    yield _counters_row(r, seen, m0, m1)
    _ttft(r)


def _request(r: Run, prompt: list[int] | str, what: str, low: int, high: int | None = None) -> tuple[Seen, Completion]:
    c = r.engine.complete(prompt, r.new_tokens)
    pt = c.prompt_tokens if c.prompt_tokens is not None else len(prompt)
    low = pt if low < 0 else low  # -1: the whole prompt (a text prompt's token count is the engine's)
    return Seen(what, pt, c.cached_tokens or 0, low, low if high is None else high), c


def _observe(r: Run) -> list[Seen]:
    """An unseen prompt and its repeat; with token-id prompts (a text prompt's token boundaries are the engine's)
    also S+A then S+B, prompt + completion + more, and C+B then B+D."""
    n = 2 * r.prompt_len + 5
    p = r.prompts.fresh(n)
    first, _ = _request(r, p, "unseen", 0)
    again, c = _request(r, p, "repeat", -1)
    seen = [first, again]
    if not r.engine.token_prompts:
        return seen
    assert isinstance(p, list)
    s, (a, b) = r.prompts.fresh(n), r.prompts.fork(max(4, r.prompt_len // 4))
    seen.append(_request(r, join(s, a), "unseen S+A", 0)[0])
    seen.append(_request(r, join(s, b), f"S+B after S+A (S {n})", n)[0])
    reply = r.prompts.completion_of(c)
    more = r.prompts.fresh(max(4, r.prompt_len // 4))
    if isinstance(reply, list):
        seen.append(_request(r, join(p, reply, more), "prompt + completion + more", n, n + len(reply) - 1)[0])
    k = r.whole_blocks()
    head, moved = r.prompts.fresh(k), r.prompts.fresh(k)
    seen.append(_request(r, join(head, moved), "unseen C+B", 0)[0])
    seen.append(_request(r, join(moved, r.prompts.fresh(k)), "B+D after C+B", 0)[0])
    return seen


def _block(r: Run, m: Metrics | None) -> tuple[list[int], str]:
    stated = m.block_size() if m is not None else None
    if stated is not None:
        return [stated[0]], f"blocks of {stated[0]} ({stated[1]})"
    return list(BLOCKS), "a block size inferred (/metrics states none)"


def _cached_row(r: Run, seen: list[Seen], m0: Metrics | None, m1: Metrics | None) -> CheckRow:
    row = CheckRow(name="accounting:cached-tokens", cache=r.column, passed=True)
    sizes, source = _block(r, m1)
    row.tolerance = f"cached_tokens = the reusable prefix rounded down to {source}"
    hits = _delta(m0, m1, HITS)
    if all(s.cached == 0 for s in seen):
        listed = "; ".join(s.words(None) for s in seen)
        if hits:
            row.passed, row.detail = False, f"{listed}: every count 0, but /metrics counted {hits:,.0f} hit tokens"
            return row
        why = (
            f"the engine reported no cached tokens on any request ({listed}): prefix caching off (vLLM: "
            "--enable-prefix-caching), or its blocks longer than these prompts (raise --prompt-len)"
        )
        return skipped(r.column, why, "accounting:cached-tokens")
    fits = [b for b in sizes if all(s.fits(b) for s in seen)]
    shown = fits[0] if fits else max(sizes, key=lambda b: (sum(s.fits(b) for s in seen), -b))
    listed = "; ".join(s.words(shown) for s in seen)
    if fits:
        sized = source if len(sizes) == 1 else f"blocks of {' or '.join(map(str, fits))} (inferred)"
        row.detail = f"{listed}: consistent with {sized}"
    else:
        row.passed = False
        sized = f"not consistent with {source}" if len(sizes) == 1 else "no block size from 1 to 256 fits every count"
        row.detail = f"{listed}: {sized}"
    return row


def _reset_row(r: Run) -> CheckRow:
    """Two prompts cached, the reset, then both again: each must report 0 (with a per-request reset, the cold
    request alone)."""
    e = r.engine
    if not e.reset.available:
        return skipped(r.column, "--reset none: no reset to check cached_tokens after", "accounting:reset")
    p, q = r.prompts.fresh(2 * r.prompt_len + 5), r.prompts.fresh(2 * r.prompt_len + 5)
    warm = [e.complete(x, 1) for x in (p, q, p, q)][2:]
    if not any(c.cached_tokens for c in warm):
        why = "nothing was reported cached on a repeat, so there is no reset to check (see accounting:cached-tokens)"
        return skipped(r.column, why, "accounting:reset")
    after = [e.complete(p, 1, cold=True)]
    if e.reset.clears_all:
        after.append(e.complete(q, 1))  # not the cold request: the reset emptied the whole cache
    counts = ", ".join(str(c.cached_tokens) for c in after)
    row = CheckRow(name="accounting:reset", cache=r.column, passed=all(c.cached_tokens == 0 for c in after))
    row.tolerance = "cached_tokens 0 after the reset"
    which = "P cold, then Q" if e.reset.clears_all else "P cold"
    warm_counts = ", ".join(str(c.cached_tokens) for c in warm)
    row.detail = f"P and Q cached ({warm_counts}), then {e.reset.how}: {which} reported {counts}"
    return row


def _counters(r: Run) -> Metrics | None:
    return r.engine.metrics() if r.engine.has_metrics else None


def _delta(m0: Metrics | None, m1: Metrics | None, names: tuple[str, ...]) -> float | None:
    a, b = (m.total(names) if m is not None else None for m in (m0, m1))
    return None if a is None or b is None else b[0] - a[0]


def _settled(r: Run, m0: Metrics | None, seen: list[Seen]) -> Metrics | None:
    """/metrics after the requests, read again a few times while its hit count disagrees (counted late)."""
    m1 = None
    for wait in SETTLE_S:
        time.sleep(wait)
        m1 = _counters(r)
        if _delta(m0, m1, HITS) in (None, sum(s.cached for s in seen)):
            break
    return m1


def _counters_row(r: Run, seen: list[Seen], m0: Metrics | None, m1: Metrics | None) -> CheckRow:
    hits = _delta(m0, m1, HITS)
    if hits is None:
        why = (
            "the engine counts no prefix-cache hits in /metrics (kvbench_prefix_cache_hits_total, "
            "vllm:prefix_cache_hits_total)" + ("" if r.engine.has_metrics else ": it answers no /metrics")
        )
        return skipped(r.column, why, "accounting:counters")
    assert m1 is not None
    name = m1.total(HITS)
    reported = sum(s.cached for s in seen)
    queries = _delta(m0, m1, QUERIES)
    asked = (
        f"; queries +{queries:,.0f} for {sum(s.prompt_tokens for s in seen):,} prompt tokens"
        if queries is not None
        else ""
    )
    row = CheckRow(name="accounting:counters", cache=r.column, passed=hits == reported)
    row.tolerance = "hit tokens counted = the cached_tokens the answers reported (no other client meanwhile)"
    row.detail = (
        f"{name[1] if name else 'hits'} +{hits:,.0f} over {len(seen)} requests reporting {reported:,} cached{asked}"
    )
    return row


def _ttft(r: Run) -> None:
    """Evidence: a 1-token request's time for an unseen prompt and for its repeat, median of TTFT_RUNS each."""
    e = r.engine
    room = (e.max_len - 2) if e.max_len else 8 * r.prompt_len
    n = max(r.prompt_len, min(8 * r.prompt_len, room if e.token_prompts else room // 8))
    unseen, warm, counts = [], [], []
    for _ in range(TTFT_RUNS):
        p = r.prompts.fresh(n)
        unseen.append(e.complete(p, 1).seconds)
        c = e.complete(p, 1)
        warm.append(c.seconds)
        counts.append(c.cached_tokens)
    u, w = statistics.median(unseen) * 1e3, statistics.median(warm) * 1e3
    cached = f", cached_tokens {counts[-1]}" if counts[-1] is not None else ""
    r.evidence["ttft_ms"] = {"unseen": u, "warm_repeat": w, "prompt": n, "cached_tokens": counts[-1]}
    r.notes.append(
        f"TTFT (a 1-token request, median of {TTFT_RUNS}) for {n} prompt {r.unit()}s: unseen {u:.1f} ms, warm repeat "
        f"{w:.1f} ms{cached}; evidence only, never a verdict (the server's load moves it)"
    )
