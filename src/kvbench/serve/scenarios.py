"""The serving cache's checks, run in process on the engine: each scenario against cold runs of the same prompts.

A cold run is a fresh engine's (nothing cached); every scenario's request must give the cold tokens, logprobs within
the dtype's tolerance, and the cached-token count the scenario implies:
    warm            a repeat after the prompt ran once: a device-tier hit of every full prompt block
    host-hit        a repeat after flood requests evicted the prompt to the host tier: every block back from it
    shared-prefix   two requests on one cached prefix at once, the first finishing at its first token
    distinct-prefix a prompt whose blocks appeared in an earlier prompt after another block: nothing is cached
    reset           a repeat after POST /reset_prefix_cache (the prompt evicted to the host tier first): nothing cached
    batch           prompts of different lengths decoded together, each as it runs alone
`kvbench break NAME` runs them all with a server fault's pool (serve/faults.py) and shows the one that catches it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.check.breaking import BreakResult
from kvbench.check.judge import TOLERANCES, CheckRow, first_diff
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT
from kvbench.serve.engine import Done, Engine, Event, Failed, Submission, Token
from kvbench.serve.faults import get_server_fault
from kvbench.serve.pool import KVPool

BLOCK = 4  # the scenarios' block size: a short prompt still spans several blocks
NEW_TOKENS = 24  # the most tokens a scenario's request generates (break's --new-tokens, capped)
FLOODS = 3  # flood requests that evict a prompt from a device tier sized for it and two blocks more


@dataclass
class Outcome:
    """One request's result: its tokens, their logprobs and the prompt tokens it found cached."""

    tokens: list[int]
    logprobs: list[float]
    cached: int


class Driver:
    """An engine over a fresh pool of class `pool`, driven in process: requests submitted together run as one
    batch (the engine's own loop, stepped here)."""

    def __init__(self, model: GPT, pool: type[KVPool], blocks: int, host_blocks: int = 0) -> None:
        cfg = model.cache_config
        weight = model.lm_head.weight
        self.pool = pool(cfg.n_layer, cfg.n_head, cfg.head_dim, blocks, BLOCK, weight.dtype, weight.device, host_blocks)
        self.engine = Engine(model, self.pool, max_batch=16, stop_id=None)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> list[Outcome]:
        events: list[list[Event]] = [[] for _ in prompts]
        for prompt, n, sink in zip(prompts, max_tokens, events, strict=True):
            self.engine.submit(Submission(prompt, n, logprobs=0, emit=sink.append))
        while not all(e and isinstance(e[-1], Done | Failed) for e in events):
            self.engine.step()
        out = []
        for e in events:
            end = e[-1]
            assert isinstance(end, Done), f"an in-process request failed: {end}"
            toks = [t for t in e if isinstance(t, Token)]
            out.append(Outcome([t.id for t in toks], [t.logprob or 0.0 for t in toks], end.cached_tokens))
        return out

    def reset(self) -> None:
        done = self.engine.reset_prefix_cache()
        self.engine.step()
        done.result(timeout=0)


def scenario_fits(prompts: list[list[int]], new_tokens: int, context: int) -> None:
    """The checks' longest request (a block, the two first prompts and the new tokens) within the model's context."""
    need = BLOCK + len(prompts[0]) + len(prompts[1]) + min(new_tokens, NEW_TOKENS)
    if need > context:
        raise KVBenchError(
            f"the server faults' scenarios need {need} tokens of context (a {BLOCK}-token block, two prompts of "
            f"{len(prompts[1])} and {len(prompts[0])} tokens, {min(new_tokens, NEW_TOKENS)} new) and the model holds "
            f"{context}; use a shorter --prompt or fewer --new-tokens"
        )


def blocks_for(prompt: list[int], new: int) -> int:
    return -(-(len(prompt) + new - 1) // BLOCK)


def shifted(prompt: list[int], by: int, vocab: int) -> list[int]:
    """`prompt` with every id moved by `by` (mod the vocabulary): a prompt sharing no block with it."""
    return [(t + by) % vocab for t in prompt]


@dataclass
class Scenario:
    """What a check compares: the scenario's requests beside their cold runs, and the cached tokens expected."""

    got: list[Outcome]
    cold: list[Outcome]
    expected_cached: list[int]
    where: str  # which request of the scenario, in words


class Checks:
    """The checks over one model and prompt set, cold runs computed once."""

    def __init__(self, model: GPT, prompts: list[list[int]], new: int) -> None:
        self.model, self.new = model, new
        self.vocab = model.config.vocab_size
        self.prompt = prompts[1] + prompts[0]  # several blocks of BLOCK tokens
        self.batch = prompts
        self.atol = TOLERANCES.get(model.lm_head.weight.dtype, TOLERANCES[torch.float32])[1]
        self._cold: dict[tuple[int, ...], Outcome] = {}

    def cold(self, prompt: list[int], n: int) -> Outcome:
        key = (*prompt, -n)
        if key not in self._cold:
            self._cold[key] = Driver(self.model, KVPool, blocks_for(prompt, n)).run([prompt], [n])[0]
        return self._cold[key]

    @property
    def full_blocks(self) -> int:
        return (len(self.prompt) - 1) // BLOCK * BLOCK

    def _flood(self, d: Driver) -> None:
        for i in range(FLOODS):
            d.run([shifted(self.prompt, 101 * (i + 1), self.vocab)], [1])

    def _evicting_driver(self, pool: type[KVPool], host: bool) -> Driver:
        size = blocks_for(self.prompt, self.new) + 2
        return Driver(self.model, pool, size, host_blocks=(FLOODS + 2) * size if host else 0)

    # --- the scenarios -----------------------------------------------------------------------------------------------
    def warm(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = Driver(self.model, pool, 2 * blocks_for(self.prompt, self.new))
        d.run([self.prompt], [self.new])
        got = d.run([self.prompt], [self.new])
        return Scenario(got, [self.cold(self.prompt, self.new)], [self.full_blocks], "the repeated prompt")

    def host_hit(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = self._evicting_driver(pool, host)
        d.run([self.prompt], [self.new])
        self._flood(d)
        got = d.run([self.prompt], [self.new])
        expected = self.full_blocks if host else 0
        where = f"the prompt repeated after {FLOODS} flood requests evicted it" + (" to the host tier" if host else "")
        return Scenario(got, [self.cold(self.prompt, self.new)], [expected], where)

    def shared_prefix(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = Driver(self.model, pool, 3 * blocks_for(self.prompt, self.new))
        d.run([self.prompt], [self.new])
        got = d.run([self.prompt, self.prompt], [1, self.new])
        cold = self.cold(self.prompt, self.new)
        first = Outcome(cold.tokens[:1], cold.logprobs[:1], cold.cached)
        where = "two requests on the cached prompt at once, the first ending at its first token"
        return Scenario(got, [first, cold], [self.full_blocks] * 2, where)

    def distinct_prefix(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = Driver(self.model, pool, 2 * blocks_for(self.prompt, self.new) + 2)
        other = shifted(self.prompt[:BLOCK], 7, self.vocab) + self.prompt  # the prompt's blocks, one block later
        d.run([other], [self.new])
        got = d.run([self.prompt], [self.new])
        where = "the prompt after one holding its blocks behind another first block"
        return Scenario(got, [self.cold(self.prompt, self.new)], [0], where)

    def reset(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = self._evicting_driver(pool, host)
        d.run([self.prompt], [self.new])
        self._flood(d)
        d.reset()
        got = d.run([self.prompt], [self.new])
        where = (
            f"the prompt repeated after a reset ({'its blocks evicted to the host tier' if host else 'no host tier'})"
        )
        return Scenario(got, [self.cold(self.prompt, self.new)], [0], where)

    def batched(self, pool: type[KVPool], host: bool = True) -> Scenario:
        d = Driver(self.model, pool, sum(blocks_for(p, self.new) for p in self.batch))
        got = d.run(self.batch, [self.new] * len(self.batch))
        where = f"{len(self.batch)} prompts of lengths {', '.join(str(len(p)) for p in self.batch)} in one batch"
        return Scenario(got, [self.cold(p, self.new) for p in self.batch], [0] * len(self.batch), where)

    # --- judging -------------------------------------------------------------------------------------------------------
    def judge(self, name: str, s: Scenario) -> CheckRow:
        """Tokens equal the cold run's, logprobs within the dtype's tolerance, cached tokens as expected."""
        diffs = [
            max((abs(a - b) for a, b in zip(g.logprobs, c.logprobs, strict=False)), default=0.0)
            for g, c in zip(s.got, s.cold, strict=True)
        ]
        worst = max(diffs, default=0.0)
        firsts = [first_diff(g.tokens, c.tokens) for g, c in zip(s.got, s.cold, strict=True)]
        miscounted = [(g.cached, e) for g, e in zip(s.got, s.expected_cached, strict=True) if g.cached != e]
        wrong = next((i for i, f in enumerate(firsts) if f is not None), None)
        passed = wrong is None and worst <= self.atol and not miscounted
        location = ""
        if not passed:
            said = [f"{s.where}"]
            if wrong is not None:
                who = "its" if len(s.got) == 1 else f"request {wrong + 1}'s"
                said.append(f"{who} token {firsts[wrong]} differs from the cold run")
            if miscounted:
                said.append(f"cached_tokens {miscounted[0][0]} where {miscounted[0][1]} are cached")
            location = ": ".join(said[:1]) + (": " + "; ".join(said[1:]) if len(said) > 1 else "")
        return CheckRow(
            name=name,
            cache="serve",
            passed=passed,
            max_abs_diff=worst,
            first_divergence=firsts[wrong] if wrong is not None else None,
            tolerance=f"tokens equal the cold run's, logprobs within {self.atol:g}, cached_tokens as the cache holds",
            detail=f"{s.where}: cached_tokens {[g.cached for g in s.got]} (expected {s.expected_cached}), "
            f"largest logprob difference {worst:.2e}",
            location=location,
        )


CHECKS: dict[str, Callable[[Checks, type[KVPool], bool], Scenario]] = {
    "warm": Checks.warm,
    "host-hit": Checks.host_hit,
    "shared-prefix": Checks.shared_prefix,
    "distinct-prefix": Checks.distinct_prefix,
    "reset": Checks.reset,
    "batch": Checks.batched,
}


def run_checks(model: GPT, pool: type[KVPool], prompts: list[list[int]], new: int) -> tuple[list[CheckRow], Checks]:
    """Every check with `pool` as the serving pool."""
    c = Checks(model, prompts, new)
    return [c.judge(name, check(c, pool, True)) for name, check in CHECKS.items()], c


@torch.inference_mode()
def break_server_fault(
    model: GPT,
    name: str,
    prompts: list[list[int]],
    new_tokens: int,
    decode: Callable[[list[int]], str] | None = None,
) -> BreakResult:
    """A server fault as `kvbench break` shows one: every check run with its pool; the correct and faulty tokens
    of the check that shows it (the cold run beside the faulty server's); its dormant case run through it too."""
    f = get_server_fault(name)
    new = min(new_tokens, NEW_TOKENS)
    rows, c = run_checks(model, f.pool, prompts, new)
    home = CHECKS[f.check](c, f.pool, True)
    last = -1 if f.check != "shared-prefix" else 1
    correct, faulty = home.cold[last].tokens, home.got[last].tokens
    dormant_check = "reset" if f.host_tier and f.check == "reset" else "warm"
    quiet = c.judge(dormant_check, CHECKS[dormant_check](c, f.pool, not f.host_tier))
    caught = [r.name for r in rows if not r.passed]
    row = next((r for r in rows if r.name == f.check), rows[0])
    counts = f"cached_tokens {[g.cached for g in home.got]} (the cache holds {home.expected_cached})"
    return BreakResult(
        name=name,
        summary=f.summary,
        cache="serve",
        detected=bool(caught),
        caught_by=caught,
        first_divergence=first_diff(correct, faulty),
        correct_tokens=correct,
        faulty_tokens=faulty,
        signature=f"{f.signature}; shown ({f.check}, blocks of {BLOCK}): {home.where}: {counts}",
        fix=f.fix,
        where=f.where,
        dormant_where=f.dormant_where,
        dormant_shown=f"the {dormant_check} scenario{' without a host tier' if f.host_tier else ''} through the "
        f"faulty pool passes: {quiet.passed}",
        checks=rows,
        correct_text=decode(correct) if decode else None,
        faulty_text=decode(faulty) if decode else None,
        location=f"{row.name}: {row.location}" if not row.passed else "",
    )
