"""The benchmark's statistics (mtl/tools/bench/stats.py): known values, and by simulation the size and power of the
marks against equal (paired t-test, Holm across a table's methods) at the seed counts the presets use."""

import math

import numpy as np
import pytest
from scipy import stats

from mtl.tools.bench.stats import holm, mark, mean_ci, min_detectable, paired_test, pooled_sd, power, slope_per_100

REPS = 4000  # simulated tables per case: the Monte-Carlo error of a 5% rate is sqrt(.05 * .95 / 4000) = 0.0034


def _mc_bound(rate: float = 0.05, reps: int = REPS) -> float:
    """The rate plus 3 Monte-Carlo standard errors: a true rate at or below ``rate`` stays under it (p > 0.998)."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / reps)


def test_t_interval_and_paired_test_on_known_inputs():
    m, ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0 and abs(ci - 2.776445 * math.sqrt(2.5) / math.sqrt(5)) < 1e-5  # t_{0.975,4} = 2.776445
    assert mean_ci([2.0])[0] == 2.0 and mean_ci([2.0])[1] != mean_ci([2.0])[1]
    assert all(v != v for v in mean_ci([]))
    d = [0.3, 0.5, 0.1, 0.4, 0.2]
    t = paired_test(d)
    assert abs(t["p"] - stats.ttest_rel(np.array(d) + 1.0, np.ones(5)).pvalue) < 1e-12  # the paired t-test
    assert abs(t["p"] - 0.01324) < 1e-4  # t = 0.3 / (0.1581 / sqrt 5) = 4.243, df 4
    assert t["lo"] > 0 and abs(t["mean"] - 0.3) < 1e-12
    assert abs((t["hi"] - t["lo"]) / 2 - mean_ci(d)[1]) < 1e-12
    two = paired_test([0.5, 0.7])  # two seeds: a mean, no test
    assert abs(two["mean"] - 0.6) < 1e-12 and two["p"] != two["p"] and two["lo"] != two["lo"]
    assert paired_test([0.5] * 4)["p"] == 0.0 and paired_test([0.0] * 4)["p"] == 1.0


def test_holm_step_down_on_known_inputs():
    # m = 4: sorted 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (monotone), 0.5; nan untouched and not counted
    adj = holm([0.03, 0.01, float("nan"), 0.5, 0.02])
    assert adj[2] != adj[2]
    assert np.allclose([adj[1], adj[4], adj[0], adj[3]], [0.04, 0.06, 0.06, 0.5])
    assert holm([0.9, 0.8]) == [1.0, 1.0] and np.allclose(holm([0.04, 0.3]), [0.08, 0.3]) and holm([]) == []
    assert mark(1.0, 0.01, 0.05) == 1 and mark(-1.0, 0.01, 0.05) == -1 and mark(1.0, 0.06, 0.05) == 0
    assert mark(1.0, float("nan"), 0.05) == 0


def test_min_detectable_difference_against_the_noncentral_t():
    # n = 5, sd = 1, alpha = 0.05: the effect with 80% power is 1.68 sd (the normal approximation gives 1.25;
    # the t-test at 4 degrees of freedom needs more; the simulation below checks the 80%)
    e = min_detectable(1.0, 5, 0.05)
    assert abs(power(e, 1.0, 5, 0.05) - 0.8) < 1e-6 and abs(e - 1.68) < 0.01
    assert min_detectable(2.0, 5, 0.05) == pytest.approx(2 * e, rel=1e-5)  # linear in the spread
    assert min_detectable(1.0, 10, 0.05) < e < min_detectable(1.0, 5, 0.01)
    assert min_detectable(1.0, 2, 0.05) != min_detectable(1.0, 2, 0.05)  # fewer than 3 seeds: not said
    sd, n = pooled_sd([[1.0, 2.0, 3.0], [0.0, 2.0, 4.0], [5.0]])
    assert n == 3 and abs(sd - math.sqrt((1.0 + 4.0) / 2)) < 1e-12


@pytest.mark.parametrize("n", [3, 5, 10])
def test_size_and_power_by_simulation(n):
    """No method differs from equal: a mark on at most 5% of the methods (paired t-test) and on at most 5% of the
    tables of 10 methods (Holm), within 3 Monte-Carlo errors; a true difference of the design's detectable size is
    marked about 80% of the time (75-85%); the per-seed noise is shared by the methods of a seed (as equal's run is)."""
    rng = np.random.default_rng(n)
    m = 10
    eq = rng.normal(0, 1, (REPS, n))
    null = rng.normal(0, 1, (REPS, m, n)) - eq[:, None, :]  # each method's Δm minus equal's, seed by seed
    p = stats.ttest_1samp(null, 0.0, axis=2).pvalue
    per_method = float((p < 0.05).mean())
    assert per_method <= _mc_bound(), per_method
    # the library function on a subsample gives the same p-values as the vectorised call
    assert all(abs(paired_test(null[i, 0])["p"] - p[i, 0]) < 1e-12 for i in range(20))
    family = float(np.mean([any(a < 0.05 for a in holm(list(row))) for row in p]))
    assert family <= _mc_bound(), family
    assert per_method > 0.03  # not a test that never marks (the Monte-Carlo error is 0.0034)
    sd = math.sqrt(2)  # the spread of a difference of two unit-variance runs
    mde = min_detectable(sd, n, 0.05)
    shifted = rng.normal(0, 1, (REPS, n)) - rng.normal(0, 1, (REPS, n)) + mde
    hit = float((stats.ttest_1samp(shifted, 0.0, axis=1).pvalue < 0.05).mean())
    assert 0.75 < hit < 0.85, (n, mde, hit)


def test_the_bootstrap_this_tool_used_was_anti_conservative():
    """Why the test changed: the 95% percentile bootstrap of the mean over 5 paired seeds marks about 16% of true
    nulls (the issue's measurement), where the t-test keeps 5%."""
    rng = np.random.default_rng(0)
    reps, n, boots = 1500, 5, 1000
    d = rng.normal(0, 1, (reps, n))
    idx = rng.integers(0, n, (boots, n))
    means = d[:, idx].mean(axis=2)  # reps x boots resampled means
    lo, hi = np.quantile(means, [0.025, 0.975], axis=1)
    rate = float(((lo > 0) | (hi < 0)).mean())
    assert rate > 0.10, rate


def test_slope_of_the_last_evaluations():
    pts = [(100, 0.5), (200, 0.6), (300, 0.7), (400, 0.7), (500, 0.7)]
    assert abs(slope_per_100(pts, 3)) < 1e-12 and abs(slope_per_100(pts, 5) - 0.05) < 1e-12
    assert slope_per_100(pts[:1], 3) != slope_per_100(pts[:1], 3)  # nan: one point has no slope
    line = [(s, 0.5 + 0.002 * s) for s in range(0, 600, 50)]
    assert abs(slope_per_100(line, 3) - 0.2) < 1e-12  # 0.002 per step = 0.2 per 100 steps
    assert abs(slope_per_100(list(reversed(line)), 4) - 0.2) < 1e-12  # ordered by step, whatever the input order


def test_ratio_test_on_known_inputs_and_by_simulation():
    """Ratios read on the log scale: the geometric mean and its t-interval; "lower" and "within 5%" as one-sided
    paired t-tests. Known inputs, then simulated rounds: at a true ratio of exactly 1 + margin the non-inferiority
    claim is made at most 5% of the time (its size, within 3 Monte-Carlo errors), and at a true 0.9 with 8 rounds of
    5% noise almost always (its power)."""
    from mtl.tools.bench.stats import ratio_test

    r = ratio_test([0.5, 2.0, 1.0])
    assert r["ratio"] == pytest.approx(1.0) and r["lo"] < 1 < r["hi"] and r["p_lower"] == pytest.approx(0.5)
    logs = [math.log(x) for x in (0.8, 0.85, 0.9, 0.82)]
    r = ratio_test([0.8, 0.85, 0.9, 0.82])
    assert r["ratio"] == pytest.approx(math.exp(sum(logs) / 4))
    assert r["p_lower"] == pytest.approx(stats.ttest_1samp(logs, 0.0, alternative="less").pvalue) and r["p_lower"] < 0.01
    assert r["p_within"] < r["p_lower"] and r["hi"] < 1
    assert ratio_test([0.9, 0.9, 0.9])["p_within"] == 0.0 and ratio_test([1.2, 1.2, 1.2])["p_within"] == 1.0
    assert math.isnan(ratio_test([0.9, 1.1])["p_within"]) and ratio_test([0.9, 1.1])["n"] == 2
    with pytest.raises(ValueError, match="ratios must be > 0"):  # never silently dropped
        ratio_test([0.9, 1.1, -0.2, 1.0])
    rng = np.random.default_rng(7)
    at_margin = rng.normal(math.log(1.05), 0.05, (REPS, 8))  # log ratios of 8 rounds, true ratio 1 + margin
    p = stats.ttest_1samp(at_margin, math.log(1.05), axis=1, alternative="less").pvalue
    assert all(abs(ratio_test(np.exp(at_margin[i]))["p_within"] - p[i]) < 1e-12 for i in range(20))  # the same test
    assert 0.03 < float((p < 0.05).mean()) <= _mc_bound()
    better = rng.normal(math.log(0.9), 0.05, (REPS, 8))
    assert float((stats.ttest_1samp(better, math.log(1.05), axis=1, alternative="less").pvalue < 0.05).mean()) > 0.99
