"""Memory bandwidth: a published peak figure (configs/gpus.toml) or --bandwidth, read from text such as 3.35TB/s.

TB/s, GB/s, MB/s are powers of 10 (3.35TB/s = 3.35e12 bytes/s, as datasheets write them); TiB/s, GiB/s, MiB/s are
powers of 2. The value is held as whole bytes per second, computed exactly from the decimal text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbench.errors import KVBenchError
from kvbench.memory.units import fmt_int

_RATE_RE = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?i?b)\s*/\s*s$")
_RATE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip
MAX_RATE = 10**15  # 1 PB/s: far above any memory today, low enough to catch a unit typo


@dataclass(frozen=True)
class PeakBandwidth:
    """The bandwidth a decode floor divides by."""

    name: str  # GPU preset key, or "custom" for --bandwidth
    label: str  # product name, or "--bandwidth 3.35TB/s"
    bytes_per_s: int  # bytes per second
    text: str  # as written in gpus.toml or on the command line
    source: str  # where the figure comes from: the datasheet cited in gpus.toml, or "--bandwidth"


def parse_bandwidth(text: str, what: str = "--bandwidth") -> int:
    """'3.35TB/s' -> 3_350_000_000_000 bytes/s; '2TiB/s' -> 2 x 2^40. Zero, negative, nan or no unit: one line."""
    tok = str(text).strip().lower().replace("_", "")
    m = _RATE_RE.match(tok)
    if not m or m.group(3) not in _RATE_UNITS:
        raise KVBenchError(
            f"cannot read {what} {text!r}: use a rate such as 3.35TB/s, 3350GB/s or 2TiB/s "
            "(TB = 10^12 bytes, TiB = 2^40)"
        )
    sign, number, unit = m.groups()
    whole, _, frac = number.partition(".")
    value = int((whole or "0") + frac) * _RATE_UNITS[unit] // 10 ** len(frac)
    if sign == "-" or value < 1:
        raise KVBenchError(f"{what} {text!r} must be positive")
    if value > MAX_RATE:
        raise KVBenchError(f"{what} {text!r} is more than 1 PB/s; give the memory's real bandwidth")
    return value


def fmt_rate(bytes_per_s: float) -> str:
    """3.35e12 -> '3.35 TB/s' (decimal units, as datasheets print them)."""
    for unit, size in (("TB/s", 10**12), ("GB/s", 10**9), ("MB/s", 10**6), ("KB/s", 10**3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.4g} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def rate_working(bw: PeakBandwidth) -> str:
    """'3.35 TB/s (3,350,000,000,000 B/s, NVIDIA H100 80GB: <source>)'."""
    where = bw.label if bw.source == "--bandwidth" else f"{bw.label}, {bw.source}"
    return f"{fmt_rate(bw.bytes_per_s)} ({fmt_int(bw.bytes_per_s)} B/s; {where})"
