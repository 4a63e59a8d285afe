"""The statistics of a comparison of two timing samples (decode-step latencies), each side pooled over its repeats.

- the TPOT (or TTFT) ratio is median(candidate) / median(baseline), with a percentile bootstrap interval (each side
  resampled with replacement, seeded, so the result is reproducible) from `scipy.stats.bootstrap`, or above
  RESAMPLE_UP_TO samples a side from the medians' own distribution: `median_ratio_ci`;
- the two samples are told apart by scipy's two-sided Mann-Whitney U test, which needs no normality (timing
  samples, skewed and with a long tail of slow steps, never have it): `mann_whitney_p`, and the smallest p-value
  samples of given sizes can reach, `smallest_p`;
- the verdict takes a p-value below alpha and a ratio at least `threshold` from 1: `verdict`;
- how far apart one run's repeats are: `repeat_spread`.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
from scipy.stats import binom, bootstrap, mannwhitneyu

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
