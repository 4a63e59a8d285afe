"""`verify --endpoint URL`: the checks asked for, run on one engine, as verify's report.

The rows are check/judge.py's CheckRow (the check's name and scenario, `warm-cold:repeat`; the engine's model as the
column), so verify's table, --json and --junit-xml show them as they show the caches'. An engine the checks cannot
read (unreachable, not OpenAI-compatible, an HTTP error, no answer within --timeout, gone mid-run) ends the run with
one line: exit 2, or 1 when a check had already failed (`FailedThenStopped`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from kvbench.check.judge import CheckRow, VerifyReport, verdict
from kvbench.endpoint.accounting import accounting
from kvbench.endpoint.checks import Run, warm_cold
from kvbench.endpoint.client import Client, EndpointError
from kvbench.endpoint.completion import Prompts
from kvbench.endpoint.engine import TOP_N, Engine, probe
from kvbench.endpoint.pressure import (
    MAX_FLOOD_PROMPT,
    MAX_FLOOD_REQUESTS,
    batch_invariance,
    evicted,
    flood_plan,
    too_many,
)
from kvbench.endpoint.resets import RESETS, get_reset
from kvbench.errors import FailedThenStopped, KVBenchError, listed

CHECKS = {
    "warm-cold": "repeats, shared prefixes, multi-turn extensions and interleavings against cold runs",
    "evicted": "the same after distractors flood the device pool",
    "batch-invariance": "a prompt alone against itself among concurrent neighbours",
    "accounting": "cached_tokens and /metrics hit counters against the reusable prefix; zero after a reset",
}
MAX_TIMEOUT_S = 24 * 3600.0
MAX_CONTEXT = 1 << 20  # the longest request a run may send, in tokens: past any engine's context
MAX_NEIGHBOURS = 64  # --batch with --endpoint: concurrent requests, each on a thread of its own


class EndpointChoices(Protocol):
    """What `endpoint_rules` reads of verify's options."""

    endpoint: str | None
    prompt_len: int
    new_tokens: int
    batch: int
    checks: str | None
    reset: str
    evict_tokens: int | None
    timeout: float
    logprob_tol: float | None


@dataclass
class EndpointSettings:
    url: str
    checks: list[str]
    reset: str
    prompt_len: int
    new_tokens: int
    neighbours: int
    seed: int
    tol: float | None  # None: by the precision the engine states (logprob_tolerance)
    evict_tokens: int | None
    timeout: float


def parse_checks(text: str | None) -> list[str]:
    if text is None:
        return list(CHECKS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        what = f"unknown --checks {listed(unknown)}" if unknown else "--checks names no check"
        raise KVBenchError(f"{what}; choose from {', '.join(CHECKS)} (comma-separated)")
    return list(dict.fromkeys(names))


def endpoint_rules(o: EndpointChoices) -> None:
    """The --endpoint options: their values, and none of them without --endpoint."""
    if o.endpoint is None:
        given = {
            "--checks": o.checks is not None,
            "--reset": o.reset != "kvbench",
            "--evict-tokens": o.evict_tokens is not None,
            "--timeout": o.timeout != 60.0,
            "--logprob-tol": o.logprob_tol is not None,
        }
        for flag, on in given.items():
            if on:
                raise KVBenchError(f"{flag} applies to --endpoint only")
        return
    parse_checks(o.checks)
    if o.reset not in RESETS:
        raise KVBenchError(f"unknown --reset {o.reset!r}; use {', '.join(RESETS)}")
    if not 0 < o.timeout <= MAX_TIMEOUT_S:
        raise KVBenchError(f"--timeout {o.timeout:g} must be > 0 seconds and at most a day")
    if o.logprob_tol is not None and not 0 <= o.logprob_tol < float("inf"):
        raise KVBenchError(f"--logprob-tol {o.logprob_tol:g} must be a finite number >= 0")
    if o.evict_tokens is not None and o.evict_tokens < 1:
        raise KVBenchError(f"--evict-tokens {o.evict_tokens} must be >= 1 (the engine's KV pool in tokens)")
    most = MAX_FLOOD_REQUESTS * MAX_FLOOD_PROMPT * 4 // 5  # the flood sends 1.25 x the pool
    if o.evict_tokens is not None and o.evict_tokens > most:
        raise KVBenchError(
            f"--evict-tokens {o.evict_tokens:,}: flooding past it takes more than the {MAX_FLOOD_REQUESTS:,} requests of "
            f"{MAX_FLOOD_PROMPT:,} tokens kvbench sends; give at most {most:,}"
        )
    need = longest_request(o.prompt_len, o.new_tokens)
    if need > MAX_CONTEXT:
        raise KVBenchError(
            f"--prompt-len {o.prompt_len:,} and --new-tokens {o.new_tokens:,} need requests of {need:,} tokens, past "
            f"any engine's context ({MAX_CONTEXT:,}); lower them"
        )
    if o.batch > MAX_NEIGHBOURS:
        raise KVBenchError(f"--batch {o.batch:,}: with --endpoint at most {MAX_NEIGHBOURS} concurrent neighbours")


def longest_request(prompt_len: int, new_tokens: int) -> int:
    """The longest request a run sends, prompt and completion (accounting's extension: 2 x prompt + 5, a completion,
    a quarter prompt, then new tokens)."""
    return 2 * prompt_len + 5 + 2 * new_tokens + max(4, prompt_len // 4)


# |Δlogprob| of a sampled token still counted as drift, by the precision the engine computes in: fp32 reduction-order
# drift between a warm and a cold run is ~1e-6 (kvbench serve: <= 1e-6 over every check), 16-bit rounding moves a
# logprob by up to a few 1e-2 (bf16 keeps 8 bits of mantissa)
FP32_LOGPROB_TOL = 1e-4
LOW_PRECISION_LOGPROB_TOL = 0.05


def logprob_tolerance(dtype: str | None) -> tuple[float, str]:
    """The default --logprob-tol for an engine whose /v1/models states `dtype` (None: it does not), and why."""
    if dtype in ("float32", "float64"):
        return FP32_LOGPROB_TOL, f"the engine states {dtype}, where warm/cold drift is reduction order (~1e-6)"
    said = f"the engine states {dtype}" if dtype else "the engine does not state its precision"
    return LOW_PRECISION_LOGPROB_TOL, f"{said}: 16-bit rounding allowed (--logprob-tol to set it)"


def run_endpoint(s: EndpointSettings, on_row: Callable[[CheckRow], None]) -> tuple[VerifyReport, dict]:
    """Probe the engine, run `s.checks` on it, and return (report, meta) for verify's renderers."""
    engine = probe(Client(s.url, s.timeout), get_reset(s.reset), s.seed)
    _fits(engine, s)
    tol, why = (s.tol, "--logprob-tol") if s.tol is not None else logprob_tolerance(engine.dtype)
    run = Run(
        engine, Prompts(s.seed, engine.token_prompts), s.prompt_len, s.new_tokens, s.neighbours, tol, s.evict_tokens
    )
    run.notes.append(f"logprob tolerance {tol:g}: {why}")
    metrics = engine.metrics() if engine.has_metrics else None
    stated = metrics.block_size() if metrics is not None else None
    if stated is not None:  # the prompts are laid out in the engine's own blocks
        run.block_size = stated[0]
    run.notes.append(f"prompts laid out in blocks of {run.block()} tokens ({stated[1] if stated else 'a guess'})")
    rows: list[CheckRow] = []
    try:
        for row in _rows(run, s):
            rows.append(row)
            on_row(row)
    except EndpointError as e:
        failed = [f"{r.name}/{r.cache}" for r in rows if not r.passed and not r.skipped]
        if failed:
            raise FailedThenStopped(f"{e} (after {len(failed)} failed check(s): {listed(failed)})") from None
        raise
    judged = verdict(rows)
    report = VerifyReport(
        passed=judged["passed"],
        nothing_checked=judged["nothing_checked"],
        checks=rows,
        dtype="the engine's",
        new_tokens=s.new_tokens,
        prompt_len=s.prompt_len,
        batch_lens=[],
        reference=f"cold runs on the engine ({engine.reset.how})",
        notes=_notes(run) + run.notes,
    )
    return report, _meta(run, s)


def _rows(r: Run, s: EndpointSettings) -> Iterator[CheckRow]:
    if "warm-cold" in s.checks:
        yield from warm_cold(r)
    if "evicted" in s.checks:
        metrics = r.engine.metrics() if r.engine.has_metrics else None
        pool = (s.evict_tokens, "--evict-tokens") if s.evict_tokens is not None else None
        yield from evicted(r, pool or (metrics.pool_tokens() if metrics is not None else None))
    if "batch-invariance" in s.checks:
        yield from batch_invariance(r)
    if "accounting" in s.checks:
        yield from accounting(r)


def _fits(e: Engine, s: EndpointSettings) -> None:
    """The longest request within the engine's max_model_len, where it states one and prompts are token ids; the
    flood past --evict-tokens within what kvbench sends."""
    need = longest_request(s.prompt_len, s.new_tokens)
    if e.max_len is not None and e.token_prompts and need > e.max_len:
        raise KVBenchError(
            f"--prompt-len {s.prompt_len} and --new-tokens {s.new_tokens} need {need:,} tokens of context; "
            f"{e.model} takes {e.max_len:,} (max_model_len): lower --prompt-len or --new-tokens"
        )
    if s.evict_tokens is not None and "evicted" in s.checks:
        size, planned = flood_plan(e, s.prompt_len, s.neighbours, s.evict_tokens)
        if planned > MAX_FLOOD_REQUESTS:
            raise KVBenchError(too_many((s.evict_tokens, "--evict-tokens"), size, planned))


def _exposes(e: Engine) -> str:
    said = ["token-id prompts" if e.token_prompts else "text prompts (it refused token ids)"]
    said.append(f"logprobs{f' with the top {TOP_N}' if e.tops else ''}" if e.logprobs else "no logprobs")
    said.append("token ids" if e.token_ids else "no token ids")
    said.append("cached_tokens" if e.cached_field else "no cached_tokens")
    said.append("/metrics" if e.has_metrics else "no /metrics")
    return ", ".join(said)


def _notes(r: Run) -> list[str]:
    e = r.engine
    notes = [
        f"engine: {e.model} at {e.client.url}: {_exposes(e)}; cold runs: {e.reset.how}",
        f"every request greedy (temperature 0, seed {e.seed}), {r.new_tokens} new tokens; seeded prompts "
        f"({'token ids 3-255' if e.token_prompts else 'words'})",
    ]
    if not e.logprobs:
        notes.append("no logprobs: runs are compared as tokens or text, so a flip at a near-tie is not told from a bug")
    return notes


def _meta(r: Run, s: EndpointSettings) -> dict:
    e = r.engine
    return {
        "title": f"kvbench verify --endpoint: {e.model} at {e.client.url}",
        "model": e.model,
        "weights": "the engine's",
        "device": e.client.url,
        "dtype": "the engine's",
        "endpoint": {
            "url": e.client.url,
            "model": e.model,
            "max_model_len": e.max_len,
            "checks": s.checks,
            "reset": {"name": e.reset.name, "how": e.reset.how},
            "token_prompts": e.token_prompts,
            "logprobs": e.logprobs,
            "top_logprobs": e.tops,
            "token_ids": e.token_ids,
            "cached_tokens": e.cached_field,
            "metrics": e.has_metrics,
            "logprob_tol": r.tol,
            "evidence": r.evidence,
        },
    }
