"""What other requests do to a prompt's cached prefix: flooding the pool past it (evicted), and running beside it
(batch-invariance). Each warm answer is compared with the same prompt's cold one, as in warm-cold (checks.py).

- evicted:repeat, evicted:shared-prefix: P and S+A cached, distractor prompts flood the device pool (its size from
  /metrics, or --evict-tokens) by a quarter more than it holds, then P and S+B again: what comes back comes from a
  lower tier (a host tier, an offload connector) or is recomputed, and must equal the cold runs
- evicted:reset: R cached before the flood (so it sits in a lower tier, or nowhere), then the reset, then R: 0
  cached tokens, since a reset that empties the device alone leaves a lower tier answering
- batch-invariance:distinct: a prompt alone, then among concurrent neighbours of other lengths, repeated
- batch-invariance:shared-prefix: S cached, then S+B among neighbours that share S and finish first (started with
  it, or joining it a quarter into its time alone); an engine that frees a shared block when one holder finishes
  hands it out while S+B still reads it
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from kvbench.check.judge import CheckRow, skipped
from kvbench.endpoint.checks import Run, cached, join
from kvbench.endpoint.client import parallel
from kvbench.endpoint.compare import Comparison, compare
from kvbench.endpoint.completion import Completion, Prompt, length
from kvbench.endpoint.engine import LOWER_TIER_HITS, Engine

REPEATS = 3  # batch-invariance: bursts of the prompt among its neighbours
JOIN_LATE_S = 0.05  # batch-invariance:distinct: every other burst, the prompt starts this long after its neighbours
# batch-invariance:shared-prefix: every other burst, the neighbours start this share of the prompt's time alone after
# it: it holds S by then, and still decodes (and takes new blocks) after they finish, however fast the engine is
NEIGHBOURS_LATE = 0.25
# The flood is bounded before it starts, whatever pool size /metrics or --evict-tokens states: at most this many
# requests of at most MAX_FLOOD_PROMPT tokens, and no longer than MAX_FLOOD_S at the pace of its first requests.
MAX_FLOOD_PROMPT = 2048
MAX_FLOOD_REQUESTS = 10_000
MAX_FLOOD_S = 900.0
NO_POOL = (
    "the engine reports no KV pool size in /metrics (kvbench_kv_blocks_total, vllm:cache_config_info, "
    "sglang:max_total_num_tokens); give --evict-tokens N"
)


def evicted(r: Run, pool: tuple[int, str] | None) -> Iterator[CheckRow]:
    """P, S+A and R cached, the pool flooded, then P and S+B (sharing S) against their cold runs, then R after the
    reset."""
    if pool is None:
        yield skipped(r.column, NO_POOL, "evicted")
        return
    size, planned = flood_plan(r.engine, r.prompt_len, r.neighbours, pool[0])
    if planned > MAX_FLOOD_REQUESTS:
        yield skipped(r.column, too_many(pool, size, planned), "evicted")
        return
    quarter = max(4, r.prompt_len // 4)
    p, s, rr, (a, b) = (
        r.prompts.fresh(r.prompt_len),
        r.prompts.fresh(r.prompt_len),
        r.prompts.fresh(r.prompt_len),
        r.prompts.fork(quarter),
    )
    cold_sb, cold_p = r.cold(join(s, b)), r.cold(p)
    r.warm(join(s, a))
    before = [r.warm(p), r.warm(rr)]
    tier0 = _lower_tier_hits(r.engine)
    try:
        tokens, requests = flood(r, pool[0])
    except FloodTooLong as e:
        yield skipped(r.column, str(e), "evicted")
        return
    back_p, back_sb = r.warm(p), r.warm(join(s, b))
    tier1 = _lower_tier_hits(r.engine)
    lower = f"; lower-tier hits {tier1 - tier0:,.0f} tokens" if tier0 is not None and tier1 is not None else ""
    flooded = f"{tokens:,} tokens of distractors in {requests} requests (pool {pool[0]:,} tokens: {pool[1]})"
    r.evidence["evicted"] = {
        "pool_tokens": pool[0],
        "pool_from": pool[1],
        "flood_tokens": tokens,
        "flood_requests": requests,
        "cached_before": before[0].cached_tokens,
        "cached_after": [back_p.cached_tokens, back_sb.cached_tokens],
    }
    what = f"P cached{cached(before[0])}, then {flooded}, then P again{cached(back_p)}{lower}"
    yield r.row("evicted:repeat", what, [compare("P after the flood vs cold", cold_p, back_p, r.tol)])
    what = f"S+A cached, then the flood, then S+B{cached(back_sb)}"
    yield r.row("evicted:shared-prefix", what, [compare("S+B after the flood vs cold", cold_sb, back_sb, r.tol)])
    yield _reset_after_flood(r, rr, before[1])


def _reset_after_flood(r: Run, rr: Prompt, before: Completion) -> CheckRow:
    e = r.engine
    if not e.reset.available:
        return r.no_reset("evicted:reset", "no reset to check after the flood")
    if not e.cached_field:
        why = "the engine's answers have no usage.prompt_tokens_details.cached_tokens to check after the reset"
        return skipped(r.column, why, "evicted:reset")
    after = r.cold(rr)
    row = r.row(
        "evicted:reset",
        f"R cached{cached(before)} before the flood, then {e.reset.how}, then R{cached(after)}",
        [compare("R after the flood and the reset vs R before", before, after, r.tol)],
    )
    row.tolerance = "cached_tokens 0 after the reset; " + row.tolerance
    if after.cached_tokens:
        row.passed = False
        row.detail += f"; but {after.cached_tokens} tokens reported cached after the reset: a lower tier still answers"
    return row


def _lower_tier_hits(e: Engine) -> float | None:
    m = e.metrics() if e.has_metrics else None
    total = m.total(LOWER_TIER_HITS) if m is not None else None
    return total[0] if total is not None else None


class FloodTooLong(Exception):
    """The flood would take past MAX_FLOOD_S at the pace of its first requests."""


class Late(NamedTuple):
    """Who joins a burst late, and by how much."""

    target: bool  # the prompt checked (else its neighbours)
    seconds: float
    words: str  # "joining them late"


def flood_plan(e: Engine, prompt_len: int, neighbours: int, pool: int) -> tuple[int, int]:
    """(prompt size, requests) of a flood past `pool` tokens: a prompt as long as the context allows (up to
    MAX_FLOOD_PROMPT, and at most half the pool's share of one of the `neighbours` requests run at a time; in words
    for text, each at least a token)."""
    per = max(1, neighbours)
    room = (e.max_len - 2) if e.max_len else 4 * prompt_len
    # `per` prompts run at once and each must fit the pool beside the others (a small pool refuses a long prompt)
    room = max(1, min(room, MAX_FLOOD_PROMPT, pool // (2 * per)))
    size = room if e.token_prompts else max(8, room // 8)
    batches = -(-(pool + pool // 4) // (size * per))
    return size, batches * per


def too_many(pool: tuple[int, str], size: int, planned: int) -> str:
    return (
        f"flooding a pool of {pool[0]:,} tokens ({pool[1]}) takes {planned:,} requests of {size:,} prompt tokens, "
        f"past the {MAX_FLOOD_REQUESTS:,} kvbench sends; give --evict-tokens N for the part of the pool to flood"
    )


def flood(r: Run, pool: int) -> tuple[int, int]:
    """Distractor prompts, `--batch` at a time, until their prompt tokens pass 1.25 x `pool`: (tokens, requests).
    Never more requests than the plan (each prompt holds at least `size` tokens, whatever the engine reports), and
    FloodTooLong where the first batch says the plan would take past MAX_FLOOD_S."""
    e, target = r.engine, pool + pool // 4
    size, planned = flood_plan(e, r.prompt_len, r.neighbours, pool)
    tokens = requests = 0
    t0 = time.monotonic()
    while tokens < target and requests < planned:
        batch = [r.prompts.fresh(size) for _ in range(max(1, r.neighbours))]
        for q, c in zip(batch, parallel([_call(e, q, 1) for q in batch]), strict=True):
            tokens += c.prompt_tokens if c.prompt_tokens and c.prompt_tokens > 0 else length(q)
        requests += len(batch)
        pace = (time.monotonic() - t0) / requests
        if requests == len(batch) and pace * planned > MAX_FLOOD_S:
            raise FloodTooLong(
                f"the flood of {planned:,} requests would take about {pace * planned / 60:,.0f} min at this "
                f"engine's pace ({pace:.2f} s a request), past {MAX_FLOOD_S / 60:.0f} min; give --evict-tokens N "
                "for the part of the pool to flood"
            )
    return tokens, requests


def _call(e: Engine, prompt: Prompt, n: int, cold: bool = False) -> Callable[[], Completion]:
    def call() -> Completion:
        return e.complete(prompt, n, cold=cold, clear=False)

    return call


def _late(call: Callable[[], Completion], wait: float) -> Callable[[], Completion]:
    def later() -> Completion:
        time.sleep(wait)
        return call()

    return later


def batch_invariance(r: Run) -> Iterator[CheckRow]:
    yield _distinct(r)
    yield _shared(r)


def _bursts(
    r: Run,
    target: Prompt,
    alone: Completion,
    neighbours: Callable[[], list[Prompt]],
    n: int,
    prime: Prompt | None,
    late: Callable[[], Late],
) -> list[Comparison]:
    """REPEATS bursts of `target` (cold where `prime` is None, else after `prime` cached what they share) among
    `neighbours()` run with `n` new tokens; every other burst, one side joins late (`late()`: which, how late)."""
    e, comps = r.engine, []
    for rep in range(REPEATS):
        others = neighbours()
        if e.reset.clears_all:
            e.clear()
        if prime is not None:
            e.complete(prime, 1, cold=not e.reset.clears_all)
        first = _call(e, target, r.new_tokens, cold=prime is None)
        rest = [_call(e, q, n) for q in others]
        when = "started together"
        if rep % 2 == 1:
            who = late()
            when = who.words
            if who.target:
                first = _late(first, who.seconds)
            else:
                rest = [_late(c, who.seconds) for c in rest]
        among = parallel([first, *rest])[0]
        comps.append(compare(f"burst {rep + 1} ({when}) vs alone", alone, among, r.tol))
    return comps


def _distinct(r: Run) -> CheckRow:
    p = r.prompts.fresh(r.prompt_len)
    alone = r.cold(p)
    lens = [r.prompt_len + 4 * (i + 1) for i in range(r.neighbours)]
    late = Late(True, JOIN_LATE_S, "joining them late")
    comps = _bursts(r, p, alone, lambda: [r.prompts.fresh(n) for n in lens], 2 * r.new_tokens, None, lambda: late)
    warm = "" if r.engine.reset.available else "; no reset, so the bursts also reuse the alone run's prefix"
    what = (
        f"a {r.prompt_len}-{r.unit()} prompt alone, then {REPEATS} times among {r.neighbours} concurrent neighbours "
        f"of {', '.join(map(str, lens))} {r.unit()}s{warm}"
    )
    return r.row("batch-invariance:distinct", what, comps)


def _shared(r: Run) -> CheckRow:
    """S+B's prompt ends a token short of a block boundary, so its second decode step takes a new block: after the
    neighbours (S+A_i, one token each) have finished and released what they shared, when they start together. Where
    they join late, S+B already holds S and takes a new block every block's worth of tokens after they finish."""
    k, tail = r.whole_blocks(), r.block() - 1
    s = r.prompts.fresh(k)
    target = join(s, r.prompts.fresh(tail))
    alone = r.cold(target)
    wait = NEIGHBOURS_LATE * alone.seconds
    comps = _bursts(
        r,
        target,
        alone,
        lambda: [join(s, r.prompts.fresh(tail)) for _ in range(r.neighbours)],
        1,
        join(s, r.prompts.fresh(tail)),
        lambda: Late(False, wait, f"they join {wait * 1e3:.0f} ms into it"),
    )
    what = (
        f"S of {k} {r.unit()}s cached, then S+B ({tail} more) {REPEATS} times among {r.neighbours} concurrent "
        f"neighbours S+A_i that finish first"
    )
    return r.row("batch-invariance:shared-prefix", what, comps)
