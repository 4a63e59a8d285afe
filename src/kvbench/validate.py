"""Every range and consistency rule of kvbench's options, checked once at the boundary, before any work.

The command line and a bench TOML file both pass through here; the library then asserts what it was promised instead
of checking again. Each bound is defined once, for one meaning, with its reason beside it. A rule that fails is one
KVBenchError naming the option, the value and the fix, so a typo (`--prompt-len 200000`, `--batch 100000`) fails in
milliseconds instead of growing until the kernel kills the process.

    bounds               SEED_MAX, MAX_RUN_BATCH, MAX_PLAN_BATCH, REPEATS, ...
    values               integer, real, seed, new_tokens, run_batch, names
    the model's context  past_context, context_error, fits_context
    per command          sampling_rules, tp_rules, tp_shape_rules, verify_rules, break_rules
    the environment      probe_bytes_setting

This module imports nothing of kvbench but errors.py, so every layer can use it. A rule that needs a registry's facts
lives beside that registry or the settings it checks, above both: compile_mode, draft_rules, padding_rule and
generate_rules in decode/rules.py, bench_rules in bench/settings.py, bench --hf's in bench/hf_sweep.py, memory_rules in
memory/request.py. What a value names (a cache, an engine, a fault, a model) is looked up in its registry, which
refuses an unknown name; files are read through files.py, which refuses what cannot be read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from kvbench.errors import KVBenchError, listed, shown

# --- bounds, one per meaning -----------------------------------------------------------------------------------------
SEED_MAX = 2**64 - 1  # what torch.Generator.manual_seed takes (a 64-bit unsigned seed)
# Sequences one run decodes together (generate's prompts, verify's and break's batches, a bench batch): a million
# sequences of even one token of gpt2's K/V are 36 GiB in fp16, beyond which nothing runs anywhere. A bench batch that
# does not fit the device is an `oom` row, judged against its memory, not refused here.
MAX_RUN_BATCH = 1 << 20
# Sequences in a memory plan: arithmetic only, nothing allocated; far above any deployment, low enough to stay exact.
MAX_PLAN_BATCH = 2**31
REPEATS = (1, 10_000)  # bench --repeats: timed runs per configuration
WARMUP = (0, 10_000)  # bench --warmup: untimed runs before them
THREADS = (1, 4096)  # bench --threads: torch intra-op threads
MAX_DRAFT_TOKENS = 64  # --draft-tokens: one forward verifies at most this many
MAX_NGRAM = 16  # --ngram: the longest suffix looked up
TEMPERATURE_MAX = 1e6  # --temperature: beyond it sampling is uniform to float precision
MAX_TP = 1024  # --tp: ranks of one tensor-parallel group (the largest NVLink domains hold 72 GPUs)


# --- values ----------------------------------------------------------------------------------------------------------
def integer(name: str, value: object, lo: int | None = None, hi: int | None = None, why: str = "") -> int:
    """`value` as an int within [lo, hi]; bools and floats (even 3.0 from a TOML file) are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVBenchError(f"{name} must be an integer, got {shown(value)}")
    if lo is not None and value < lo:
        raise KVBenchError(f"{name} must be >= {lo}, got {value}" + (f" ({why})" if why else ""))
    if hi is not None and value > hi:
        raise KVBenchError(f"{name} must be <= {hi:,}, got {value:,}" + (f" ({why})" if why else ""))
    return value


def real(name: str, value: object, lo: float | None = None, hi: float | None = None) -> float:
    """A finite float within [lo, hi]: NaN and infinities are refused by name."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KVBenchError(f"{name} must be a number, got {shown(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise KVBenchError(f"{name} must be a finite number, got {value}")
    if lo is not None and value < lo:
        raise KVBenchError(f"{name} must be >= {lo:g}, got {value:g}")
    if hi is not None and value > hi:
        raise KVBenchError(f"{name} must be <= {hi:g}, got {value:g}")
    return value


def seed(value: object, name: str = "--seed") -> int:
    return integer(name, value, 0, SEED_MAX, "a seed is a non-negative 64-bit integer")


def new_tokens(value: object, least: int, why: str) -> int:
    """--new-tokens of a command that needs at least `least` of them (`why`: what needs them)."""
    return integer("--new-tokens", value, least, why=why)


def run_batch(value: object, name: str = "--batch", least: int = 1, why: str = "") -> int:
    return integer(name, value, least, MAX_RUN_BATCH, why)


def one_of(name: str, value: str, choices: Sequence[str], fix: str = "") -> str:
    if value not in choices:
        raise KVBenchError(f"{name} {shown(value)}: use {' or '.join(choices)}" + (f" ({fix})" if fix else ""))
    return value


def reference(value: str) -> str:
    if value not in ("hf", "none"):
        raise KVBenchError(f"--reference must be hf or none, got {shown(value)}")
    return value


def only_with_hf(hf: str | None, **given: bool) -> None:
    """Options that choose what --hf loads, given without it (`given`: flag -> whether it was given)."""
    for flag, on in given.items():
        if on and hf is None:
            raise KVBenchError(f"{flag} applies to --hf models only")


def not_with_hf(**given: bool) -> None:
    """Options that choose our GPT-2 have no meaning with --hf: name the first one given."""
    for flag, on in given.items():
        if on:
            raise KVBenchError(f"{flag} chooses kvbench's own GPT-2; with --hf the model is SOURCE, drop {flag}")


# --- the model's context ---------------------------------------------------------------------------------------------
def past_context(tokens: int, context: int | None) -> bool:
    """The rule every run is held to: its tokens (prompt + new tokens) may fill the model's context, never pass it
    (learned positions stop there). `context` None: the model has no configured maximum."""
    return context is not None and tokens > context


def context_error(
    subject: str,
    context: int,
    fix: str,
    whose: str = "the model's",
    why: str = "",
    detail: str = "",
    grouped: bool = True,
) -> KVBenchError:
    """The one line for a run past the model's context: '{subject} exceeds {whose} context of {context} tokens
    ({why}): {detail}; {fix}', the parenthesis only with a `why` and the colon only with a `detail`. `grouped`: the
    context written with thousands separators."""
    ctx = f"{context:,}" if grouped else str(context)
    why = f" ({why})" if why else ""
    detail = f": {detail}" if detail else ""
    return KVBenchError(f"{subject} exceeds {whose} context of {ctx} tokens{why}{detail}; {fix}")


def fits_context(
    what: str,
    prompt_len: int | Sequence[int],
    new_tokens: int,
    context: int | None,
    fix: str,
    whose: str = "the model's",
    grouped: bool = True,
) -> None:
    """Each prompt length + `new_tokens` within `context` (past_context); else one context_error naming the ones
    that are not (the first few and a count: errors.listed). One prompt: '{what} P + new tokens N = T exceeds ...';
    a sweep's list of prompt lengths: '{what} + new tokens exceeds ...: P + N = T, ...'."""
    if context is None:  # no configured maximum: nothing to pass
        return
    n = (lambda x: f"{x:,}") if grouped else str
    if isinstance(prompt_len, int):
        if past_context(prompt_len + new_tokens, context):
            subject = f"{what} {n(prompt_len)} + new tokens {n(new_tokens)} = {n(prompt_len + new_tokens)}"
            raise context_error(subject, context, fix, whose, grouped=grouped)
        return
    bad = [p for p in prompt_len if past_context(p + new_tokens, context)]
    if bad:
        sums = listed(f"{n(p)} + {n(new_tokens)} = {n(p + new_tokens)}" for p in bad)
        raise context_error(f"{what} + new tokens", context, fix, whose, detail=sums, grouped=grouped)


# --- the commands ----------------------------------------------------------------------------------------------------
def sampling_rules(temperature: float, top_k: int | None, seed_: int) -> None:
    real("--temperature", temperature, 0.0, TEMPERATURE_MAX)
    if top_k is not None:
        integer("--top-k", top_k, 1)
        if temperature == 0:
            raise KVBenchError(
                f"--top-k {top_k} has no effect at --temperature 0 (greedy decoding takes the argmax); "
                "give --temperature > 0 to sample, or drop --top-k"
            )
    seed(seed_)


CHECKED_NEW_TOKENS = 2  # verify and break: the logits check (and a fault) needs at least one decode step


def tp_rules(tp: int, timeout: float, compile: str = "off") -> None:
    """--tp and --tp-timeout, before the model's shape is known (tp_shape_rules then)."""
    integer("--tp", tp, 1, MAX_TP)
    real("--tp-timeout", timeout, 1.0, 7 * 24 * 3600.0)
    if tp > 1 and compile != "off":
        raise KVBenchError(
            f"--compile {compile} with --tp {tp}: the compiled decode step is not built for the all-reduce between "
            "ranks; drop --compile (static-graph still runs its eager fixed-shape step)"
        )


def tp_shape_rules(tp: int, what: str, heads: int, kv_heads: int, width: int | None = None) -> None:
    """A model `what` split over `tp` ranks: its attention heads, KV heads (and MLP width) must divide by tp, or a
    rank would hold part of a head; transformers' own tensor parallelism loads such a model without a word and fails
    in its first forward (transformers #48307)."""
    if tp == 1:
        return
    parts = [("attention heads", heads), ("key/value heads", kv_heads)] + ([("MLP width", width)] if width else [])
    for name, n in parts:
        if n % tp:
            raise KVBenchError(
                f"--tp {tp}: {what} has {heads} attention heads and {kv_heads} key/value heads, and {n} {name} do "
                f"not divide over {tp} ranks, so a rank would hold part of a head (transformers' TP loads such a "
                f"model without a warning and fails in its first forward, transformers #48307); use a --tp that "
                f"divides {n}"
            )


class CheckedRun(Protocol):
    """What verify_rules and break_rules read of a command that checks a cache (cli/verify.py VerifyOptions,
    cli/break_.py BreakOptions)."""

    new_tokens: int
    batch: int
    reference: str
    seed: int
    tp: int
    tp_timeout: float


class VerifyChoices(CheckedRun, Protocol):
    """What verify_rules reads of `kvbench verify`'s options beyond CheckedRun's."""

    prompt_len: int
    compile: str
    hf: str | None
    trust_remote_code: bool
    layers: int | None
    model: str | None
    weights: str


def verify_rules(o: VerifyChoices) -> None:
    """`kvbench verify` (cli/verify.py VerifyOptions), before any model is loaded."""
    new_tokens(o.new_tokens, CHECKED_NEW_TOKENS, "the logits check needs a decode step")
    run_batch(o.batch, least=2, why="the batched check needs prompts of different lengths")
    integer(
        "--prompt-len",
        o.prompt_len,
        o.batch,
        why=f"{o.batch} prompts of distinct lengths need that many tokens",
    )
    seed(o.seed)
    tp_rules(o.tp, o.tp_timeout, o.compile)
    if o.hf is None:
        only_with_hf(o.hf, **{"--trust-remote-code": o.trust_remote_code, "--layers": o.layers is not None})
        reference(o.reference)
    else:
        not_with_hf(
            **{
                "--model": o.model is not None,
                "--weights": o.weights != "auto",
                "--reference": o.reference != "hf",
                "--compile": o.compile != "off",
            }
        )


def break_rules(o: CheckedRun) -> None:
    """`kvbench break` (cli/break_.py BreakOptions), before any model is loaded."""
    new_tokens(o.new_tokens, CHECKED_NEW_TOKENS, "a fault shows from the first decode step")
    if o.batch < 2:
        why = "padding needs >= 2 prompts of different lengths: with one prompt nothing is padded, the bug is dormant"
        raise KVBenchError(f"--batch {o.batch}: {why}; use --batch 2 or more")
    run_batch(o.batch, least=2)
    reference(o.reference)
    seed(o.seed)
    tp_rules(o.tp, o.tp_timeout)


# --- the environment -------------------------------------------------------------------------------------------------
PROBE_ENV = "KVBENCH_PROBE_BYTES"  # the bandwidth probe's size in bytes; read by bench/floor.py
# 1 MiB (a smaller probe sits in a cache) to 1 TiB (more than any device's memory)
PROBE_MIN, PROBE_MAX = 1 << 20, 1 << 40


def probe_bytes_setting(text: str) -> int | None:
    """`$KVBENCH_PROBE_BYTES`: unset or empty -> None (the probe sizes itself); else a decimal byte count from 1 MiB
    to 1 TiB. Anything else is refused."""
    value = text.strip()
    if not value:
        return None
    n = int(value) if value.isascii() and value.isdigit() and len(value) <= 20 else None
    if n is None or not PROBE_MIN <= n <= PROBE_MAX:
        raise KVBenchError(
            f"{PROBE_ENV}={text[:40]!r}: give the probe's size in bytes, from {PROBE_MIN} (1 MiB) to {PROBE_MAX} "
            "(1 TiB), or leave it unset"
        )
    return n
