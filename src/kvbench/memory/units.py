"""Sizes and token counts: reading them from the command line, bounding them, and printing them."""

from __future__ import annotations

import re

from kvbench.errors import KVBenchError

KiB, MiB, GiB, TiB, PiB, EiB = 2**10, 2**20, 2**30, 2**40, 2**50, 2**60

# Sane upper bounds, checked before any arithmetic: far above any real model or deployment, low enough that a typo
# (or a hostile config.json) is refused in one line instead of running for minutes.
MAX_TOKENS = 2**40  # context lengths, windows, max_position_embeddings: about 10^12 tokens
MAX_LAYERS = 4096  # decoder layers (the largest public models have ~130)
MAX_WIDTH = 2**20  # hidden size, heads, head_dim, MLP width, latent ranks
MAX_VOCAB = 2**24  # vocabulary entries
MAX_EXPERTS = 2**16  # experts of a mixture-of-experts layer

_CTX_RE = re.compile(r"^(\d+(?:\.\d+)?)([km]?)$")


def check_tokens(value: int, what: str) -> int:
    """A token count within 1 .. MAX_TOKENS, or a one-line error naming `what`."""
    if value < 1:
        raise KVBenchError(f"{what} must be at least 1 token")
    if value > MAX_TOKENS:
        raise KVBenchError(f"{what} is more than {fmt_int(MAX_TOKENS)} tokens (2^40); use a smaller value")
    return value


def parse_ctx(text: str | None, what: str = "--ctx", noun: str = "context length") -> list[int]:
    """'8k,32k,128k' -> [8192, 32768, 131072]. k = 1024 tokens, m = 1024k; plain integers too."""
    if text is None or not str(text).strip():
        raise KVBenchError(f"{what} is empty; give token counts such as 8k,32k,128k")
    out: list[int] = []
    for raw in str(text).split(","):
        tok, shown = raw.strip().lower().replace("_", ""), f"{noun} {raw.strip()!r}"
        m = _CTX_RE.match(tok)
        if not m:
            raise KVBenchError(
                f"cannot read {shown}: use whole tokens, optionally with k (x1024) or m (x1048576), "
                f"e.g. {what} 8k,32k,128k or {what} 4096"
            )
        number, unit = m.groups()
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[unit]
        whole, _, frac = number.partition(".")
        # Exact rational arithmetic: a float would round 99999999999999999999 and accept 1.3k as 1331.2.
        num, den = int(whole + frac) * scale, 10 ** len(frac)
        if num % den:
            raise KVBenchError(f"{shown} is not a whole number of tokens ({num / den:g})")
        out.append(check_tokens(num // den, shown))
    return out


_BYTES_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]*)$")
_BYTE_UNITS = {
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 10**3,
    "m": MiB,
    "mib": MiB,
    "mb": 10**6,
    "g": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": TiB,
    "tib": TiB,
    "tb": 10**12,
}
MAX_BYTES = 2**60  # an exbibyte: more than any machine, small enough to stay exact


def parse_bytes(text: str, what: str = "--gpu-mem") -> int:
    """'80GiB' -> 85899345920. GiB/MiB/KiB (and bare G/M/K) are powers of 2; GB/MB/KB are powers of 10.

    A bare number is refused: '80' could mean 80 GiB or 80 bytes, and guessing either is wrong half the time."""
    tok = str(text).strip().lower().replace("_", "")
    m = _BYTES_RE.match(tok)
    if not m or (m.group(2) and m.group(2) not in _BYTE_UNITS):
        raise KVBenchError(f"cannot read {what} {text!r}: use a size such as 80GiB, 81920MiB or 80GB (GB = 10^9 bytes)")
    number, unit = m.groups()
    if not unit:
        raise KVBenchError(
            f"{what} {text!r} has no unit: write {number}GiB (2^30 bytes), {number}GB (10^9 bytes) or {number}B (bytes)"
        )
    whole, _, frac = number.partition(".")
    value = int(whole + frac) * _BYTE_UNITS[unit] // 10 ** len(frac)
    if value < 1:
        raise KVBenchError(f"{what} {text!r} must be positive")
    if value > MAX_BYTES:
        raise KVBenchError(f"{what} {text!r} is more than 2^60 bytes; use a real memory size")
    return value


def parse_overhead(text: str, gpu_memory: int) -> tuple[int, str]:
    """'10%' of the GPU, or an absolute size ('4GiB'). Returns (bytes, how it was worked out)."""
    tok = str(text).strip()
    if tok.endswith("%"):
        try:
            pct = float(tok[:-1])
        except ValueError:
            raise KVBenchError(f"cannot read --overhead {text!r}: use a percentage (10%) or a size (4GiB)") from None
        if not 0 <= pct < 100:  # NaN fails both comparisons
            raise KVBenchError(f"--overhead {text!r} must be between 0% and 100%")
        n = int(gpu_memory * pct / 100)
        return n, f"{pct:g}% of {fmt_bytes(gpu_memory)} = {fmt_bytes(n)}"
    n = parse_bytes(tok, "--overhead")
    return n, fmt_bytes(n)


def fmt_bytes(n: float) -> str:
    """Binary units, exact when the value is whole in that unit: 131072 -> '128 KiB', 17179869184 -> '16 GiB'."""
    n = float(n)
    for unit, size in (("EiB", EiB), ("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}" if v < 100 else f"{v:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_tokens(n: int) -> str:
    """8192 -> '8k', 131072 -> '128k', 1000 -> '1000'."""
    if n >= 1024 * 1024 and n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}m"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)


def fmt_int(n: int) -> str:
    return f"{n:,}"


def fmt_params(n: int) -> str:
    """3_880_000_000 -> '3.88B', 417_000_000 -> '417M'."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
