"""The checks of cross-request reuse on an engine: warm-cold, evicted and batch-invariance (accounting.py: the
cached-token counts). Each scenario runs prompts cold (the engine's reset, --reset) and again where the engine can
reuse what it cached, and compares every warm answer with its cold one (compare.py); a row per scenario.

- warm-cold:repeat: a prompt cold, then twice warm (and cold again: is the engine reproducible at all?)
- warm-cold:shared-prefix: S+A and S+B cold, then each after the other (their shared S comes from the cache)
- warm-cold:multi-turn: a prompt, then prompt + its completion + more, against that extension cold
- warm-cold:interleaved: two prefixes and their extensions, alternated, each against its cold run
- evicted:repeat, evicted:shared-prefix: the same after distractor prompts flood the device pool (its size from
  /metrics, or --evict-tokens), so what comes back comes from a lower tier or is recomputed
- batch-invariance: a prompt alone, then among concurrent neighbours of other lengths, repeated
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvbench.check.judge import CheckRow, skipped
from kvbench.endpoint.client import parallel
from kvbench.endpoint.compare import Comparison, compare, comparison_row
from kvbench.endpoint.completion import Completion, Prompt, Prompts, length
from kvbench.endpoint.engine import LOWER_TIER_HITS, Engine

REPEATS = 3  # batch-invariance: bursts of the prompt among its neighbours
JOIN_LATE_S = 0.05  # in every other burst the prompt starts this long after its neighbours (a running batch)
MAX_FLOOD_REQUESTS = 100_000


@dataclass
class Run:
    """One `verify --endpoint` run: the engine, the prompts and the settings every check reads."""

    engine: Engine
    prompts: Prompts
    prompt_len: int
    new_tokens: int
    neighbours: int  # --batch
    tol: float  # --logprob-tol
    evict_tokens: int | None  # --evict-tokens
    notes: list[str] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)  # for --json: what each check measured beyond its rows

    @property
    def column(self) -> str:
        return self.engine.model

    def unit(self) -> str:
        return "token" if self.engine.token_prompts else "word"

    def cold(self, prompt: Prompt) -> Completion:
        return self.engine.complete(prompt, self.new_tokens, cold=True)

    def warm(self, prompt: Prompt) -> Completion:
        return self.engine.complete(prompt, self.new_tokens)

    def row(self, name: str, what: str, comparisons: list[Comparison]) -> CheckRow:
        return comparison_row(name, self.column, what, comparisons, self.tol)

    def no_reset(self, name: str, why: str) -> CheckRow:
        return skipped(self.column, f"--reset none: {why}", name)


def join(*parts: Prompt) -> Prompt:
    if all(isinstance(p, list) for p in parts):
        return [t for p in parts if isinstance(p, list) for t in p]
    return "".join(p for p in parts if isinstance(p, str))


def cached(*runs: Completion) -> str:
    """' (cached_tokens 0, 32, 32)' for runs whose answers report it; '' where none does."""
    counts = [str(c.cached_tokens) for c in runs if c.cached_tokens is not None]
    return f" (cached_tokens {', '.join(counts)})" if counts else ""


def warm_cold(r: Run) -> Iterator[CheckRow]:
    yield repeat(r)
    yield shared_prefix(r)
    yield multi_turn(r)
    yield interleaved(r)


def repeat(r: Run) -> CheckRow:
    p = r.prompts.fresh(r.prompt_len)
    cold = r.cold(p)
    warm = [r.warm(p) for _ in range(2)]
    comps = [compare(f"warm run {i + 1} vs cold", cold, w, r.tol) for i, w in enumerate(warm)]
    runs = [cold, *warm]
    if r.engine.reset.available:
        again = r.cold(p)
        comps.append(compare("cold again vs cold", cold, again, r.tol))
        runs.append(again)
    what = f"a {r.prompt_len}-{r.unit()} prompt cold ({r.engine.reset.how}), twice warm, cold again{cached(*runs)}"
    return r.row("warm-cold:repeat", what, comps)


def shared_prefix(r: Run) -> CheckRow:
    if not r.engine.reset.available:
        return r.no_reset("warm-cold:shared-prefix", "S+B cannot run cold once S+A was sent; name the engine's reset")
    s, (a, b) = r.prompts.fresh(r.prompt_len), r.prompts.fork(max(4, r.prompt_len // 4))
    cold_a, cold_b = r.cold(join(s, a)), r.cold(join(s, b))
    warm_a = r.warm(join(s, a))  # S cached by S+B
    cold_a2 = r.cold(join(s, a))
    warm_b = r.warm(join(s, b))  # S cached by S+A
    comps = [
        compare("S+A after S+B vs cold", cold_a, warm_a, r.tol),
        compare("S+B after S+A vs cold", cold_b, warm_b, r.tol),
        compare("S+A cold again vs cold", cold_a, cold_a2, r.tol),
    ]
    what = (
        f"S of {r.prompt_len} {r.unit()}s with continuations A and B of {length(a)}, each cold, then after the "
        f"other{cached(warm_a, warm_b)}"
    )
    return r.row("warm-cold:shared-prefix", what, comps)


def multi_turn(r: Run) -> CheckRow:
    if not r.engine.reset.available:
        return r.no_reset("warm-cold:multi-turn", "prompt + completion cannot run cold once the prompt was sent")
    p = r.prompts.fresh(r.prompt_len)
    first = r.cold(p)
    reply = r.prompts.completion_of(first)
    said = "its completion"
    if reply is None:
        reply, said = r.prompts.fresh(r.new_tokens), "fresh tokens (the engine returns no token ids)"
    x = join(p, reply, r.prompts.fresh(max(4, r.prompt_len // 4)))
    warm = r.warm(x)
    cold = r.cold(x)
    what = f"a {r.prompt_len}-{r.unit()} prompt, then prompt + {said} + more, warm and cold{cached(warm, cold)}"
    return r.row("warm-cold:multi-turn", what, [compare("the second turn warm vs cold", cold, warm, r.tol)])


def interleaved(r: Run) -> CheckRow:
    p1, p2 = r.prompts.fresh(r.prompt_len), r.prompts.fresh(r.prompt_len)
    named: dict[str, Prompt] = {"P1": p1, "P2": p2}
    order = ["P1", "P2", "P1", "P2"]
    if r.engine.reset.available:
        m = max(4, r.prompt_len // 4)
        named |= {"P1+A": join(p1, r.prompts.fresh(m)), "P2+B": join(p2, r.prompts.fresh(m))}
        order = ["P1", "P2", "P1+A", "P2+B", "P1", "P2"]
    refs = {k: r.cold(v) for k, v in named.items()}
    comps, runs = [], []
    for i, k in enumerate(order):
        runs.append(r.warm(named[k]))
        comps.append(compare(f"{k} (request {i + 1}) vs cold", refs[k], runs[-1], r.tol))
    what = f"two {r.prompt_len}-{r.unit()} prefixes and their extensions, alternated: {', '.join(order)}{cached(*runs)}"
    return r.row("warm-cold:interleaved", what, comps)


def evicted(r: Run, pool: tuple[int, str] | None) -> Iterator[CheckRow]:
    """P and S+A cached, the pool flooded, then P and S+B (sharing S) against their cold runs."""
    if pool is None:
        why = (
            "the engine reports no KV pool size in /metrics (kvbench_kv_blocks_total, vllm:cache_config_info, "
            "sglang:max_total_num_tokens); give --evict-tokens N"
        )
        yield skipped(r.column, why, "evicted")
        return
    p, s, (a, b) = (
        r.prompts.fresh(r.prompt_len),
        r.prompts.fresh(r.prompt_len),
        r.prompts.fork(max(4, r.prompt_len // 4)),
    )
    cold_sb, cold_p = r.cold(join(s, b)), r.cold(p)
    r.warm(join(s, a))
    before = r.warm(p)
    tier0 = _lower_tier_hits(r.engine)
    tokens, requests = flood(r, pool[0])
    back_p, back_sb = r.warm(p), r.warm(join(s, b))
    tier1 = _lower_tier_hits(r.engine)
    lower = f"; lower-tier hits {tier1 - tier0:,.0f} tokens" if tier0 is not None and tier1 is not None else ""
    flooded = f"{tokens:,} tokens of distractors in {requests} requests (pool {pool[0]:,} tokens: {pool[1]})"
    r.evidence["evicted"] = {
        "pool_tokens": pool[0],
        "pool_from": pool[1],
        "flood_tokens": tokens,
        "flood_requests": requests,
        "cached_before": before.cached_tokens,
        "cached_after": [back_p.cached_tokens, back_sb.cached_tokens],
    }
    what = f"P cached{cached(before)}, then {flooded}, then P again{cached(back_p)}{lower}"
    yield r.row("evicted:repeat", what, [compare("P after the flood vs cold", cold_p, back_p, r.tol)])
    what = f"S+A cached, then the flood, then S+B{cached(back_sb)}"
    yield r.row("evicted:shared-prefix", what, [compare("S+B after the flood vs cold", cold_sb, back_sb, r.tol)])


def _lower_tier_hits(e: Engine) -> float | None:
    m = e.metrics() if e.has_metrics else None
    total = m.total(LOWER_TIER_HITS) if m is not None else None
    return total[0] if total is not None else None


def flood(r: Run, pool: int) -> tuple[int, int]:
    """Distractor prompts, `--batch` at a time, until their prompt tokens pass 1.25 x `pool`: (tokens, requests)."""
    e, target = r.engine, pool + pool // 4
    room = (e.max_len - 2) if e.max_len else 4 * r.prompt_len
    size = min(room, 2048) if e.token_prompts else max(8, min(room, 2048) // 8)  # a word may be several tokens
    tokens = requests = 0
    while tokens < target and requests < MAX_FLOOD_REQUESTS:
        batch = [r.prompts.fresh(size) for _ in range(max(1, r.neighbours))]
        for c in parallel([_call(e, q, 1) for q in batch]):
            tokens += c.prompt_tokens if c.prompt_tokens is not None else length(batch[0])
        requests += len(batch)
    return tokens, requests


def _call(e: Engine, prompt: Prompt, n: int) -> Callable[[], Completion]:
    return lambda: e.complete(prompt, n)


def batch_invariance(r: Run) -> CheckRow:
    e = r.engine
    p = r.prompts.fresh(r.prompt_len)
    alone = r.cold(p)
    comps, lens = [], [r.prompt_len + 4 * (i + 1) for i in range(r.neighbours)]
    for rep in range(REPEATS):
        others = [r.prompts.fresh(n) for n in lens]
        if e.reset.clears_all:
            e.clear()
        late = rep % 2 == 1

        def target(late: bool = late) -> Completion:
            if late:
                time.sleep(JOIN_LATE_S)
            return e.complete(p, r.new_tokens, cold=True, clear=False)

        among = parallel([target] + [_call(e, q, 2 * r.new_tokens) for q in others])[0]
        when = "joining them late" if late else "started together"
        comps.append(compare(f"burst {rep + 1} ({when}) vs alone", alone, among, r.tol))
    warm = "" if e.reset.available else "; no reset, so the bursts also reuse the alone run's prefix"
    what = (
        f"a {r.prompt_len}-{r.unit()} prompt alone, then {REPEATS} times among {r.neighbours} concurrent neighbours "
        f"of {', '.join(map(str, lens))} {r.unit()}s{warm}"
    )
    return r.row("batch-invariance", what, comps)
