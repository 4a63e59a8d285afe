"""The statistics of a comparison of two runs' timing samples, each side pooled over its repeats.

- the TPOT (or TTFT) ratio is median(candidate) / median(baseline), with a percentile bootstrap interval (each side
  resampled with replacement, seeded, so the result is reproducible) from `scipy.stats.bootstrap`, or above
  RESAMPLE_UP_TO samples a side from the medians' own distribution: `median_ratio_ci`;
- the two samples are told apart by scipy's two-sided Mann-Whitney U test, which needs no normality (timing
  samples, skewed and with a long tail of slow steps, never have it): `mann_whitney_p`, and the smallest p-value
  samples of given sizes can reach, `smallest_p`;
- the verdict takes a p-value below alpha and a ratio at least `threshold` from 1: `verdict`;
- how far apart one run's repeats are: `repeat_spread`.

TTFT is compared per configuration on its time to first token, one per timed repeat (ttft.csv), baseline against
candidate, as results/compare.py does the decode steps: `compare_ttft`. A run has one TTFT per timed repeat, so the
test has little power: with n repeats a side no difference can give a p-value below 2 / C(2n, n) (0.1 at 3
repeats, 0.0079 at 5, 1.1e-5 at 10). When that floor is not below alpha the verdict says `inconclusive (n=...)`
instead of a `no significant change` that no data could have changed; a run without ttft.csv (from before kvbench
wrote it) gives `no ttft.csv`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import binom, bootstrap, mannwhitneyu

from kvbench.results.runs import KEY, Run

# Up to this many samples a side, scipy.stats.bootstrap resamples them (2,000 resamples, one CPU thread, resamples
# taken BATCH_VALUES values at a time): 0.03 s for 192 steps a side, 0.64 s for 5,000, 1.7 s for 20,000, and 8.9 s
# for 100,000, where the order-statistic draw below takes 0.02 s for the same interval (it costs the same for 10^6
# steps as for 10^4). Without the batching scipy holds every resample at once: 4.7 GiB and 31 s at 100,000 steps.
RESAMPLE_UP_TO = 20_000
BATCH_VALUES = 500_000
# scipy 1.15 and later name bootstrap's generator `rng`; the older versions pyproject allows call it `random_state`
_RNG = "rng" if "rng" in inspect.signature(bootstrap).parameters else "random_state"


def bootstrap_medians(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """`n_boot` medians of resamples of `x` drawn with replacement, shape (n_boot,).

    Small samples are resampled. For large ones no resample is built: the k-th smallest of n draws from the sorted
    x is x_(J) with P(J <= j) = P(Binomial(n, j/n) >= k), so J is drawn by inverting that distribution (exact for
    an odd n; for an even n the two middle order statistics share one uniform draw, which at these sizes moves
    the interval by far less than its own width)."""
    n = len(x)
    if n <= RESAMPLE_UP_TO:
        out = np.empty(n_boot)
        chunk = max(1, 2_000_000 // n)  # bounded memory
        for i in range(0, n_boot, chunk):
            k = min(chunk, n_boot - i)
            out[i : i + k] = np.median(x[rng.integers(0, n, (k, n))], axis=1)  # (k,)
        return out
    s = np.sort(x)
    u = rng.random(n_boot)  # (n_boot,)
    half = int(8 * math.sqrt(n)) + 2  # 16 standard deviations of Binomial(n, 1/2): J never falls outside

    def order_statistic(k: int) -> np.ndarray:
        j = np.arange(max(1, k - half), min(n, k + half) + 1)  # (window,) candidate values of J
        cdf = binom.sf(k - 1, n, j / n)  # P(J <= j): at least k of the n draws are <= s[j - 1]
        return s[j[np.minimum(np.searchsorted(cdf, u), len(j) - 1)] - 1]

    if n % 2:
        return order_statistic((n + 1) // 2)
    return (order_statistic(n // 2) + order_statistic(n // 2 + 1)) / 2


def median_ratio_ci(
    base: np.ndarray, cand: np.ndarray, level: float, n_boot: int, seed: int
) -> tuple[float, float, float]:
    """median(cand) / median(base) and its percentile bootstrap interval at `level` (both sides resampled
    independently, seeded): scipy.stats.bootstrap up to RESAMPLE_UP_TO samples a side, bootstrap_medians above
    (and for a side of one sample, which scipy refuses: its interval is that sample)."""
    rng = np.random.default_rng(seed)
    if 2 <= min(len(base), len(cand)) and max(len(base), len(cand)) <= RESAMPLE_UP_TO:
        res = bootstrap(
            (cand, base),
            _median_ratio,
            n_resamples=n_boot,
            batch=max(1, BATCH_VALUES // max(len(base), len(cand))),
            confidence_level=level,
            method="percentile",
            vectorized=True,
            paired=False,
            **{_RNG: rng},
        )
        lo, hi = res.confidence_interval
        return float(np.median(cand) / np.median(base)), float(lo), float(hi)
    ratios = bootstrap_medians(cand, n_boot, rng) / bootstrap_medians(base, n_boot, rng)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(cand) / np.median(base)), float(lo), float(hi)


def _median_ratio(cand: np.ndarray, base: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(cand, axis=axis) / np.median(base, axis=axis)


def mann_whitney_p(base: np.ndarray, cand: np.ndarray) -> float:
    """Two-sided Mann-Whitney U p-value (scipy). Identical samples give exactly 1."""
    if np.array_equal(np.sort(base), np.sort(cand)):
        return 1.0
    return float(mannwhitneyu(cand, base, alternative="two-sided").pvalue)


def smallest_p(n1: int, n2: int) -> float:
    """The smallest two-sided p-value Mann-Whitney U can give for samples of these sizes (complete separation):
    2 / C(n1 + n2, n1), in logarithms (the binomial coefficient of two 10^5-step samples has 60,000 digits)."""
    log_comb = math.lgamma(n1 + n2 + 1) - math.lgamma(n1 + 1) - math.lgamma(n2 + 1)
    return min(1.0, math.exp(math.log(2) - log_comb))


def verdict(ratio: float, p: float, alpha: float, threshold: float) -> str:
    """`slower` when p < alpha and the ratio is at least 1 + threshold, `faster` when p < alpha and it is at most
    1 - threshold, otherwise `no significant change`."""
    if p < alpha and ratio >= 1 + threshold:
        return "slower"
    if p < alpha and ratio <= 1 - threshold:
        return "faster"
    return "no significant change"


def repeat_spread(medians: list[float]) -> float:
    """How far apart a run's repeats are: slowest repeat median / fastest - 1 (0 with fewer than two repeats)."""
    return max(medians) / min(medians) - 1 if len(medians) >= 2 and min(medians) > 0 else 0.0


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
    assert xb is not None and xc is not None  # `why` says when either is missing
    ratio, lo, hi = median_ratio_ci(xb, xc, 1 - alpha, n_boot, seed)
    p = mann_whitney_p(xb, xc)
    if smallest_p(len(xb), len(xc)) >= alpha:
        n = f"{len(xb)}" if len(xb) == len(xc) else f"{len(xb)} vs {len(xc)}"
        judged = f"inconclusive (n={n})"
    else:
        judged = verdict(ratio, p, alpha, threshold)
    return ratio, TTFTComparison(len(xb), len(xc), float(np.median(xb)), float(np.median(xc)), lo, hi, p, judged)
