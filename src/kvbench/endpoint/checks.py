"""warm-cold: a prompt run cold (the engine's reset, --reset) and again where the engine can reuse what it cached,
each warm answer compared with its cold one (compare.py); a row per scenario. `Run` is what every check reads
(pressure.py: evicted and batch-invariance; accounting.py: the cached-token counts).

- warm-cold:repeat: a prompt cold, then twice warm (and cold again: is the engine reproducible at all?)
- warm-cold:shared-prefix: S+A and S+B cold, then each after the other (their shared S comes from the cache)
- warm-cold:multi-turn: a prompt, then prompt + its completion + more, against that extension cold
- warm-cold:interleaved: two prefixes and their extensions, alternated, each against its cold run
- warm-cold:moved-block: C+B cached, then B+D: B's tokens again, but at the start, after no prefix, so nothing of
  C+B may be reused (an engine whose block hash leaves out the blocks before it reuses B)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvbench.check.judge import CheckRow, skipped
from kvbench.endpoint.compare import Comparison, compare, comparison_row
from kvbench.endpoint.completion import Completion, Prompt, Prompts, length
from kvbench.endpoint.engine import Engine

BLOCK_GUESS = 16  # the block size prompts are laid out by where /metrics states none (vLLM's and kvbench's default)


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
    block_size: int | None = None  # as /metrics states it
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

    def block(self) -> int:
        return self.block_size or BLOCK_GUESS

    def whole_blocks(self) -> int:
        """--prompt-len rounded up to whole blocks: a prefix an engine caches all of."""
        return -(-self.prompt_len // self.block()) * self.block()


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
    yield moved_block(r)


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


def moved_block(r: Run) -> CheckRow:
    if not r.engine.reset.available:
        return r.no_reset("warm-cold:moved-block", "B+D cannot run cold again once it was sent")
    k = r.whole_blocks()
    c, b, d = r.prompts.fresh(k), r.prompts.fresh(k), r.prompts.fresh(max(4, r.prompt_len // 4))
    cold = r.cold(join(b, d))
    r.cold(join(c, b))  # the cache holds C+B alone: B after C, at positions k.. 2k-1
    warm = r.warm(join(b, d))
    what = (
        f"C+B of {k} {r.unit()}s each cached, then B+D: B's tokens at the start, so nothing cached is its "
        f"prefix{cached(warm)}"
    )
    return r.row("warm-cold:moved-block", what, [compare("B+D after C+B vs cold", cold, warm, r.tol)])
