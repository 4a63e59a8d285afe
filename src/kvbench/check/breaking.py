"""`kvbench break`'s harness: each fault (check/faults.py) run against the correct path, its signature measured,
every verify check run with it injected, and the bug shown dormant where it cannot fire."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvbench.caches import get_cache_spec
from kvbench.check.faults import get_fault
from kvbench.check.gpt2_subject import full_logits, run
from kvbench.check.judge import CheckRow, first_diff, not_finite
from kvbench.check.suite import TP_CHECKS
from kvbench.check.verify import random_prompts, run_verify
from kvbench.distributed import Rank
from kvbench.errors import KVBenchError
from kvbench.model.gpt2 import GPT
from kvbench.model.tp import shard

if TYPE_CHECKING:
    from kvbench.model.tokenizer import Tokenizer

BREAK_PROMPTS = (
    "The key to fast inference is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is Paris, and the capital of Italy is",
)


@dataclass
class BreakResult:
    name: str
    summary: str
    cache: str
    detected: bool  # at least one verify check failed with the fault in
    caught_by: list[str]  # the checks that failed
    first_divergence: int | None  # first generated step where faulty and correct tokens differ
    correct_tokens: list[int]
    faulty_tokens: list[int]
    signature: str  # the documented signature plus what was measured here
    fix: str
    where: str
    dormant_where: str
    dormant_shown: str  # the dormant run, done: what it produced
    checks: list[CheckRow] = field(default_factory=list)
    correct_text: str | None = None  # decoded, when a tokenizer is available
    faulty_text: str | None = None
    location: str = ""  # where the first check that caught it went wrong, "<check>: <location>" (check/locate.py)


def require_finite(model: GPT, prompts: list[list[int]], new_tokens: int, cache: str) -> None:
    """The correct path's logits on these prompts must be finite: with NaN or inf logits every verify check fails
    for that reason alone, so a fault would look caught when nothing was shown. One line saying which is not finite:
    the model itself (no cache), or only the cache carrying the faults."""
    res = run(model, prompts, new_tokens, cache)
    assert res.logits is not None, "run records the logits"
    broken = not_finite([(f"the correct run through the {cache} cache", torch.stack(res.logits))])
    if broken is None:
        return
    itself = not_finite([("its no-cache forward", full_logits(model, prompts[0], res.tokens[0]))])
    if itself or cache == "none":
        raise KVBenchError(
            f"the clean model is not finite: with no fault injected, {itself or broken}; every verify check would "
            "fail for that reason alone, so no fault can be shown caught (check the weights)"
        )
    raise KVBenchError(
        f"with no fault injected, {broken}, while the model's no-cache forward is finite: that cache itself is "
        f"broken, so no fault can be shown caught on it (kvbench verify --caches {cache} shows where)"
    )


def _label(row: CheckRow) -> str:
    """A row's check as `caught_by` names it: `logits`, or `logits =policy` for a row held to the declared policy."""
    return row.name + (" =policy" if row.policy else "")


def break_fault(
    model: GPT,
    name: str,
    prompts: list[list[int]],
    new_tokens: int,
    reference: str = "hf",
    hf_dir: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    cache: str | None = None,
    tp: Rank | None = None,
) -> BreakResult:
    """Run fault `name` against the correct path (its `demo`), run every verify check with the fault in, and show
    it dormant where it cannot fire. `cache`: the cache to carry the fault (default: the fault's own; any cache,
    plugins included, for faults that live outside the cache). `tp`: this process is one rank of a tensor-parallel
    group: the demo runs on its shard and verify's rows hold every rank's (rank 0's result is the verdict); a fault
    that fires only across ranks is also run through every check in one process, where it is dormant."""
    f = get_fault(name)
    cache = cache or f.cache
    # the caller's promise (faults.select_faults, validate.break_rules, break_prompts)
    assert f.applies_to(cache) and (tp is not None or not f.tp), (name, cache)
    assert not f.batched or len({len(p) for p in prompts}) >= 2, [len(p) for p in prompts]
    runner = model if tp is None else shard(model, tp.rank, tp.world)
    require_finite(runner, prompts if get_cache_spec(cache).padding else prompts[:1], new_tokens, cache)
    assert f.demo is not None, f"the {name} fault has no demo"
    correct, faulty, shown, signature = f.demo(runner, f, prompts, new_tokens, cache)
    report = run_verify(model, [cache], prompts, new_tokens, reference, hf_dir, fault=f, tp=tp)
    if f.tp and tp is not None and tp.rank == 0:  # dormant in one process: every check passes there
        alone = run_verify(model, [cache], prompts, new_tokens, reference, hf_dir, fault=f)
        judged = [r for r in alone.checks if not r.skipped]
        passed = sum(r.passed for r in judged)
        shown = f"in one process (tp 1) the faulty code passes {passed} of {len(judged)} verify checks"
    caught = [_label(r) for r in report.checks if not r.passed]
    caught_by = [c for c in TP_CHECKS if c in caught] + [f"{c} =policy" for c in TP_CHECKS if f"{c} =policy" in caught]
    first = next((r for c in caught_by for r in report.checks if _label(r) == c and r.location), None)
    return BreakResult(
        name=name,
        summary=f.summary,
        cache=cache,
        detected=bool(caught_by),
        caught_by=caught_by,
        first_divergence=first_diff(correct, faulty),
        correct_tokens=correct,
        faulty_tokens=faulty,
        signature=signature,
        fix=f.fix,
        where=f.where,
        dormant_where=f.dormant_where,
        dormant_shown=shown,
        checks=report.checks,
        correct_text=decode(correct) if decode else None,
        faulty_text=decode(faulty) if decode else None,
        location=f"{_label(first)}: {first.location}" if first is not None else "",
    )


def break_prompts(tok: Tokenizer | None, vocab: int, prompt: str | None, batch: int, seed: int) -> list[list[int]]:
    """`batch` prompts of at least two lengths, prompts[0] the one shown: the built-in texts (the first replaced by
    `prompt`) through `tok` when it covers the model's vocabulary, else seeded random ids, shortest first."""
    if tok is None or vocab < tok.eot_id + 1:
        return random_prompts(vocab, 24, batch, seed)[::-1]
    texts = ([prompt or BREAK_PROMPTS[0], *BREAK_PROMPTS[1:]] * batch)[:batch]
    prompts = [tok.encode(t) for t in texts]
    if not prompts[0]:
        raise KVBenchError("--prompt encodes to zero tokens")
    if len({len(p) for p in prompts}) < 2:
        prompts[1] = prompts[1] + prompts[0]  # the batch needs two different lengths
    return prompts
