"""The statistics a summary row gives of a timing sample (decode steps pooled over the timed repeats, or one TTFT
per timed repeat): mean, standard deviation and percentiles, numbers the way numpy computes them.

Percentiles are numpy's default ("linear", type 7 of Hyndman and Fan: the order statistics interpolated at
(n - 1) q); the standard deviation is the sample's (ddof=1), empty (NaN) below two samples.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvbench.errors import KVBenchError

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)  # bench --percentiles: tpot_ms_median, tpot_ms_p90, tpot_ms_p99
TTFT_PERCENTILES = (10.0, 50.0, 90.0, 99.0)  # ttft_ms_p10 .. ttft_ms_p99, always written
ALWAYS = {50.0: "median", 90.0: "p90"}  # TPOT columns every summary.csv has: tpot_ms_median, tpot_ms_p90


def percentile_name(q: float) -> str:
    """50 -> `p50`, 99.9 -> `p99.9`."""
    return f"p{q:g}"


def check_percentiles(values: list[float], where: str = "--percentiles") -> list[float]:
    """Each percentile strictly between 0 and 100, each once, in the order given; KVBenchError otherwise."""
    if not values:
        raise KVBenchError(f"{where} is empty; give percentiles between 0 and 100, e.g. 50,90,99")
    for q in values:
        if not (isinstance(q, int | float) and not isinstance(q, bool)) or not 0 < q < 100:
            raise KVBenchError(f"{where}: {q!r} is not a percentile strictly between 0 and 100 (e.g. 50,90,99)")
    return list(dict.fromkeys(float(q) for q in values))


def parse_percentiles(value: Any, where: str) -> list[float]:
    """`50,90,99` (command line) or [50, 90, 99] (TOML) -> [50.0, 90.0, 99.0], checked."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        items = [items]
    out = []
    for v in items:
        try:
            q = float(v) if isinstance(v, str) else v
        except ValueError:
            raise KVBenchError(f"{where}: {v!r} is not a number; give percentiles such as 50,90,99") from None
        if isinstance(q, float) and not math.isfinite(q):
            raise KVBenchError(f"{where}: {v!r} is not a percentile strictly between 0 and 100")
        out.append(q)
    return check_percentiles(out, where)


def describe_ms(seconds: list[float], percentiles: tuple[float, ...] | list[float]) -> dict[str, float]:
    """{"mean", "std", "p50", ...} of a sample given in seconds, in milliseconds; NaN for an empty sample."""
    x = 1e3 * np.asarray(seconds, dtype=float)
    names = ["mean", "std", *map(percentile_name, percentiles)]
    if x.size == 0:
        return dict.fromkeys(names, math.nan)
    qs = np.percentile(x, list(percentiles)) if percentiles else np.array([])
    out = {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if x.size > 1 else math.nan}
    out.update({percentile_name(q): float(v) for q, v in zip(percentiles, qs, strict=True)})
    return out


def tpot_extra_columns(percentiles: list[float]) -> list[str]:
    """The tpot_ms_pNN columns --percentiles adds beyond the ones every summary.csv has (median, p90)."""
    return [f"tpot_ms_{percentile_name(q)}" for q in percentiles if q not in ALWAYS]
