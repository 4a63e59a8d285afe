"""The statistics behind summary.csv's TTFT/TPOT columns and compare's intervals, against numpy and scipy computed
here: the bootstrap interval (scipy.stats.bootstrap) covers a known ratio and agrees with a plain numpy resampler;
the order-statistic path for large samples agrees with scipy; the TTFT verdict says when repeats are too few; the
load warning; --percentiles parsing."""

import math

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from kvbench.bench import timing_stats as T
from kvbench.errors import KVBenchError
from kvbench.results import stats as S
from kvbench.results.environment import load_warning
from kvbench.results.stats import compare_ttft


def numpy_resampled_ci(base, cand, level, n_boot, seed):
    """A plain percentile bootstrap of the ratio of medians: each side resampled with replacement."""
    rng = np.random.default_rng(seed)
    rb = np.median(base[rng.integers(0, len(base), (n_boot, len(base)))], axis=1)
    rc = np.median(cand[rng.integers(0, len(cand), (n_boot, len(cand)))], axis=1)
    return np.quantile(rc / rb, [(1 - level) / 2, (1 + level) / 2])


@pytest.mark.parametrize("n", [3, 64 * 3, 5000])
def test_interval_covers_the_true_ratio_and_agrees_with_a_numpy_resampler(n):
    rng = np.random.default_rng(n)
    base = rng.lognormal(0, 0.2, n)
    cand = rng.lognormal(0, 0.2, n) * 1.25  # independent draws, true ratio of medians 1.25
    ratio, lo, hi = S.median_ratio_ci(base, cand, 0.99, 2000, seed=0)
    assert ratio == pytest.approx(np.median(cand) / np.median(base))
    assert lo <= ratio <= hi
    if n > 3:  # three values a side: the interval spans the data, wide but not about the truth
        assert lo < 1.25 < hi
    ref_lo, ref_hi = numpy_resampled_ci(base, cand, 0.99, 2000, seed=1)
    width = ref_hi - ref_lo
    assert lo == pytest.approx(ref_lo, abs=0.25 * width) and hi == pytest.approx(ref_hi, abs=0.25 * width)


def test_large_samples_take_the_order_statistic_path_and_agree_with_scipy():
    from scipy.stats import bootstrap

    rng = np.random.default_rng(7)
    n = S.RESAMPLE_UP_TO + 1  # one past the threshold: the order-statistic draw
    base, cand = rng.lognormal(0, 0.2, n), rng.lognormal(0, 0.2, n) * 1.05
    _, lo, hi = S.median_ratio_ci(base, cand, 0.99, 1000, seed=0)
    ref = bootstrap(
        (cand, base),
        lambda c, b, axis: np.median(c, axis=axis) / np.median(b, axis=axis),
        n_resamples=1000,
        batch=20,
        confidence_level=0.99,
        method="percentile",
        paired=False,
        rng=np.random.default_rng(1),
    ).confidence_interval
    width = ref.high - ref.low
    assert lo == pytest.approx(ref.low, abs=0.2 * width) and hi == pytest.approx(ref.high, abs=0.2 * width)
    assert lo < 1.05 < hi


def test_one_sample_a_side_gives_its_own_ratio():
    assert S.median_ratio_ci(np.array([2.0]), np.array([3.0]), 0.99, 100, 0) == (1.5, 1.5, 1.5)


def test_describe_ms_is_numpys():
    rng = np.random.default_rng(0)
    x = rng.lognormal(-5, 0.5, 101)  # seconds
    d = T.describe_ms(list(x), (10, 50, 99, 99.9))
    ms = 1e3 * x
    assert d["mean"] == pytest.approx(ms.mean()) and d["std"] == pytest.approx(ms.std(ddof=1))
    for q in (10, 50, 99, 99.9):
        assert d[T.percentile_name(q)] == pytest.approx(np.percentile(ms, q))
    assert math.isnan(T.describe_ms([0.01], (50,))["std"])  # one repeat: no spread
    assert all(math.isnan(v) for v in T.describe_ms([], (50,)).values())


@pytest.mark.parametrize("text", ["0", "100", "50,abc", "", " , ", "-5", "nan", "inf"])
def test_bad_percentiles_are_one_line(text):
    with pytest.raises(KVBenchError) as e:
        T.parse_percentiles(text, "--percentiles")
    assert "\n" not in str(e.value) and "--percentiles" in str(e.value)


def test_percentiles_parse_and_name_their_columns():
    assert T.parse_percentiles("99, 50,99.9,50", "x") == [99.0, 50.0, 99.9]
    assert T.parse_percentiles([50, 95], "x") == [50.0, 95.0]
    assert T.tpot_extra_columns([50.0, 90.0, 99.0, 99.9]) == ["tpot_ms_p99", "tpot_ms_p99.9"]


def test_ttft_verdict_says_when_repeats_cannot_reach_alpha():
    b = np.array([10.0, 10.2, 10.1])
    _, three = compare_ttft(b, b * 2, 0.01, 0.05, 500, 0)
    assert three.ttft_verdict == "inconclusive (n=3)"  # 2 / C(6, 3) = 0.1 > 0.01 whatever the data
    assert three.ttft_p_value == pytest.approx(mannwhitneyu(b * 2, b, alternative="two-sided").pvalue)
    rng = np.random.default_rng(0)
    b12 = 10 + rng.random(12)
    ratio, twelve = compare_ttft(b12, b12 * 1.3, 0.01, 0.05, 500, 0)
    assert twelve.ttft_verdict == "slower" and ratio == pytest.approx(1.3)
    assert compare_ttft(b12, b12 * 0.7, 0.01, 0.05, 500, 0)[1].ttft_verdict == "faster"
    assert compare_ttft(b12, b12 * 1.02, 0.01, 0.05, 500, 0)[1].ttft_verdict == "no significant change"
    nan_ratio, none = compare_ttft(None, b12, 0.01, 0.05, 500, 0)
    assert none.ttft_verdict == "no ttft.csv in the baseline" and math.isnan(nan_ratio)
    assert compare_ttft(None, None, 0.01, 0.05, 500, 0)[1].ttft_verdict == "no ttft.csv"


def _meta(load):
    return {"host": {"load_average": {"start": {"1m": load, "5m": load, "15m": load}}}}


def test_load_warning_when_starts_differ_by_more_than_a_core():
    assert load_warning(_meta(0.5), _meta(1.4)) is None
    text = load_warning(_meta(0.5), _meta(1.6))
    assert text is not None and "0.50" in text and "1.60" in text
    assert load_warning(_meta(3.0), _meta(1.9)) is not None
    assert load_warning({}, _meta(9.0)) is None  # a run from before the field: no warning
    assert load_warning({"host": {"load_average": None}}, _meta(9.0)) is None
