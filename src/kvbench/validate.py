"""Range checks for numbers a user gives, run before any work: one message naming the option and the bound.

Every size is checked against a bound before anything is allocated, so a typo (`--prompt-len 200000`,
`--batch 100000`) fails in milliseconds with a clear line instead of growing until the kernel kills the process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvbench.errors import KVBenchError

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_BATCH = 4096  # sequences in one batch: far beyond what a GPT-2 decode benchmark or check needs


def integer(name: str, value: object, lo: int | None = None, hi: int | None = None, why: str = "") -> int:
    """`value` as an int within [lo, hi]; bools and floats (even 3.0 from a TOML file) are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVBenchError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise KVBenchError(f"{name} must be >= {lo}, got {value}" + (f" ({why})" if why else ""))
    if hi is not None and value > hi:
        raise KVBenchError(f"{name} must be <= {hi:,}, got {value:,}" + (f" ({why})" if why else ""))
    return value


def real(name: str, value: object, lo: float | None = None, hi: float | None = None) -> float:
    """A finite float within [lo, hi]: NaN and infinities are refused by name."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KVBenchError(f"{name} must be a number, got {value!r}")
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
    """Each prompt length + `new_tokens` within `context` (past_context); else one context_error naming every one
    that is not. One prompt: '{what} P + new tokens N = T exceeds ...'; a sweep's list of prompt lengths:
    '{what} + new tokens exceeds ...: P + N = T, ...'."""
    n = (lambda x: f"{x:,}") if grouped else str
    if isinstance(prompt_len, int):
        if past_context(prompt_len + new_tokens, context):
            subject = f"{what} {n(prompt_len)} + new tokens {n(new_tokens)} = {n(prompt_len + new_tokens)}"
            raise context_error(subject, context, fix, whose, grouped=grouped)
        return
    bad = [p for p in prompt_len if past_context(p + new_tokens, context)]
    if bad:
        sums = ", ".join(f"{n(p)} + {n(new_tokens)} = {n(p + new_tokens)}" for p in bad)
        raise context_error(f"{what} + new tokens", context, fix, whose, detail=sums, grouped=grouped)


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
