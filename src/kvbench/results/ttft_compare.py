"""The TTFT side of a comparison: each configuration's time to first token, one per timed repeat (ttft.csv),
baseline against candidate, as results/compare.py does the decode steps.

The ratio is median(candidate TTFTs) / median(baseline TTFTs) with its percentile bootstrap interval, and the
verdict comes from the two-sided Mann-Whitney U test on the repeats with the same alpha and minimum change as TPOT.
A run has one TTFT per timed repeat, so the test has little power: with n repeats a side no difference can give a
p-value below 2 / C(2n, n) (0.1 at 3 repeats, 0.0079 at 5, 1.1e-5 at 10). When that floor is not below alpha the
verdict says `inconclusive (n=...)` instead of a `no significant change` that no data could have changed; a run
without ttft.csv (from before kvbench wrote it) gives `no ttft.csv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvbench.results.runs import KEY, Run
from kvbench.results.stats import mann_whitney_p, median_ratio_ci, smallest_p, verdict

NO_FILE = "no ttft.csv"


@dataclass
class TTFTComparison:
    """One row's TTFTs in both runs: medians in ms, ratio candidate / baseline and its interval, p, verdict."""

    n_ttft_baseline: int
    n_ttft_candidate: int
    ttft_ms_baseline: float
    ttft_ms_candidate: float
    ttft_ci_low: float
    ttft_ci_high: float
    ttft_p_value: float
    ttft_verdict: str  # faster | slower | no significant change | inconclusive (n=3) | no ttft.csv | ...


class RunTTFTs:
    """One run's ttft.csv grouped once by the key columns it has: a summary row's TTFTs are a lookup."""

    def __init__(self, run: Run) -> None:
        self.present = run.ttft is not None
        self.values: dict[tuple, np.ndarray] = {}
        if run.ttft is None:
            return
        t = run.ttft
        self.cols = [c for c in KEY if c in t.columns]
        ms = t["ttft_ms"].to_numpy(dtype=float)
        for k, i in t.groupby(self.cols, sort=False, dropna=False).indices.items():
            self.values[k if isinstance(k, tuple) else (k,)] = ms[i]

    def of(self, row: pd.Series) -> np.ndarray | None:
        """The TTFTs of a summary row; None when the run has no ttft.csv."""
        if not self.present:
            return None
        return self.values.get(tuple(row[c] for c in self.cols), np.empty(0))


def compare_ttft(
    xb: np.ndarray | None, xc: np.ndarray | None, alpha: float, threshold: float, n_boot: int, seed: int
) -> tuple[float, TTFTComparison]:
    """The TTFT ratio (NaN without TTFTs on both sides) and the rest of the comparison of one row's TTFTs."""
    why = None
    if xb is None or xc is None:
        sides = [side for side, x in (("baseline", xb), ("candidate", xc)) if x is None]
        why = NO_FILE if len(sides) == 2 else f"{NO_FILE} in the {sides[0]}"
    elif len(xb) == 0 or len(xc) == 0:
        sides = [side for side, x in (("baseline", xb), ("candidate", xc)) if len(x) == 0]
        why = f"no TTFTs in the {' and '.join(sides)} ttft.csv"
    if why is not None:
        nan = math.nan
        return nan, TTFTComparison(0, 0, nan, nan, nan, nan, nan, why)
    ratio, lo, hi = median_ratio_ci(xb, xc, 1 - alpha, n_boot, seed)
    p = mann_whitney_p(xb, xc)
    if smallest_p(len(xb), len(xc)) >= alpha:
        n = f"{len(xb)}" if len(xb) == len(xc) else f"{len(xb)} vs {len(xc)}"
        judged = f"inconclusive (n={n})"
    else:
        judged = verdict(ratio, p, alpha, threshold)
    return ratio, TTFTComparison(
        len(xb), len(xc), float(np.median(xb)), float(np.median(xc)), lo, hi, p, judged
    )
