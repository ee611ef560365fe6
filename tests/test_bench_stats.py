"""The benchmark's statistics (mtl/bench/stats.py): known values, and by simulation the size and power of the
marks against equal (paired t-test, Holm across a table's methods) at the seed counts the presets use."""

import math

import numpy as np
import pytest
from scipy import stats

from mtl.bench.stats import holm, mark, mean_ci, min_detectable, paired_test, pooled_sd, power, slope_per_100

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
    from mtl.bench.stats import ratio_test

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


def _signflip_p(d: np.ndarray) -> np.ndarray:
    """The exact two-sided sign-flip p-values of the rows of d (every sign pattern), vectorised."""
    import itertools

    signs = np.array(list(itertools.product([-1.0, 1.0], repeat=d.shape[1])))
    means = np.abs(d @ signs.T) / d.shape[1]
    return (means >= np.abs(d.mean(axis=1))[:, None] - 1e-12).mean(axis=1)


def test_the_five_percent_needs_about_normal_differences():
    """A skewed, unequal-variance null: equal's Δm normal (sd 1), the method's exponential with the same mean and
    3x the spread. The paired t-test then marks ~9% of single comparisons at 5 and at 10 seeds (not <= 5%), and a
    table of 8 such methods under Holm more than 5%: the "at most 5%" holds for about normal differences only. The
    sign-flip test (bench.test: signflip) is exact when the differences are symmetric (a heavy-tailed symmetric
    null: <= 5%, where it can reject at all), but not for this skewed one, and it never marks at 5 seeds."""
    from mtl.bench.stats import signflip_p

    rng = np.random.default_rng(11)
    rates = {}
    for n in (5, 10):
        d = (rng.exponential(3.0, (REPS, n)) - 3.0) - rng.normal(0, 1, (REPS, n))
        rates[n] = float((stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean())
        assert rates[n] > _mc_bound(), (n, rates[n])  # more than 5% + 3 Monte-Carlo errors: the size is not kept
        flip = _signflip_p(d)
        assert all(abs(signflip_p(d[i]) - flip[i]) < 1e-12 for i in range(5))  # scipy's test, the same p
        if n == 5:
            assert flip.min() >= 0.0625 - 1e-12  # 2 / 2^5: never below 5%
    assert 0.07 < rates[5] < 0.11 and 0.07 < rates[10] < 0.11, rates
    table = (rng.exponential(3.0, (REPS // 4, 8, 5)) - 3.0) - rng.normal(0, 1, (REPS // 4, 8, 5))
    p = stats.ttest_1samp(table, 0.0, axis=2).pvalue
    family = float(np.mean([any(a < 0.05 for a in holm(list(row))) for row in p]))
    assert family > _mc_bound(0.05, REPS // 4), family
    heavy = rng.standard_t(2, (REPS, 10)) * 2.0  # symmetric, heavy-tailed differences
    rate = float((_signflip_p(heavy) < 0.05).mean())
    assert 0.03 < rate <= _mc_bound(), rate


def test_power_at_holms_level_against_a_simulation():
    """``power_holm`` (the noncentral t at alpha / m) against simulated tables: 8 comparisons at 10 seeds, one true
    difference of the Holm-level detectable size and 7 nulls; the true one is marked by Holm at least 80% of the
    time (the formula is a lower bound) and a single test at alpha / m marks it 80% (75-85%) of the time."""
    from mtl.bench.stats import min_detectable_holm, power_holm, seeds_needed

    n, m, sd = 10, 8, 4.75
    e = min_detectable_holm(sd, n, 0.05, m)
    assert power_holm(e, sd, n, 0.05, m) == pytest.approx(0.8, abs=1e-6) and e == pytest.approx(6.81, abs=0.01)
    rng = np.random.default_rng(5)
    d = rng.normal(0, sd, (REPS, m, n))
    d[:, 0, :] += e
    p = stats.ttest_1samp(d, 0.0, axis=2).pvalue
    alone = float((p[:, 0] < 0.05 / m).mean())
    assert 0.75 < alone < 0.85, alone
    marked = float(np.mean([holm(list(row))[0] < 0.05 for row in p]))
    assert marked >= 0.8 - 3 * math.sqrt(0.16 / REPS), marked
    # the qm9 preset's former design (8 comparisons): Nash-MTL vs IMTL-G (15.2 Δm points apart) at the CPU spread
    assert seeds_needed(15.2, sd, 0.05, m) == 5 and power_holm(15.2, sd, 5, 0.05, m) >= 0.8 > power_holm(15.2, sd, 4, 0.05, m)
    assert seeds_needed(15.2, 2 * sd, 0.05, m) == 9 and seeds_needed(0.1, sd, 0.05, m, most=20) == 0


PRESETS = {"quick": "bench_quick", "full": "bench", "qm9": "bench_qm9", "qm9_cpu": "bench_qm9_cpu"}
TRUE_GAINS = (0.0, 5.0, 10.0, 20.0, 30.0)  # the true improvement over the window, in % of the baseline
NOISES = (5.0, 10.0, 20.0)  # the evaluation noise (sd of each evaluation), in % of the baseline
CAL_REPS = 4000  # simulated sweeps per cell: the Monte-Carlo error of a 5% rate is 0.0034


def _preset_bench(name: str) -> dict:
    """A preset's ``bench`` section with its ``base:`` chain's (the keys the convergence verdict reads)."""
    import yaml

    from .conftest import ROOT

    out, path = {}, f"{ROOT}/configs/{PRESETS[name]}.yaml"
    while path:
        with open(path) as f:
            raw = yaml.safe_load(f)
        out = {**raw.get("bench", {}), **out}
        path = f"{ROOT}/configs/{raw['base']}" if raw.get("base") else ""
    return out


def _simulated_bounds(seeds: int, last_k: int, noise: float, gain: float, seed: int) -> tuple:
    """The one-sided 95% bounds (``stats.window_bounds``) of ``CAL_REPS`` simulated sweeps of ``seeds`` runs: each
    run's metric at ``last_k`` evaluations, at level 100 (% of its baseline) and falling by ``gain`` in all over the
    window (lower is better) with independent normal evaluation noise of sd ``noise``; each run's improvement is the
    fitted line's fall over the window, as ``window_change`` reads it (a least-squares fit is linear in the values,
    so its change over the window is the curve times ``window_change`` of each unit vector)."""
    from mtl.bench.stats import window_bounds, window_change

    rng = np.random.default_rng(seed)
    steps = np.arange(1, last_k + 1) * 100
    weights = np.array([window_change(list(zip(steps, unit)), last_k)[0] for unit in np.eye(last_k)])
    curves = 100.0 - gain * np.arange(last_k) / (last_k - 1) + noise * rng.normal(size=(CAL_REPS, seeds, last_k))
    return window_bounds(-curves @ weights)


def _calibration() -> dict:
    """(preset, noise, gain) -> (the new verdicts' rates of "converged" and "improving", the former rule's rate of
    "converged"); the tolerance in % of the baseline: the preset's own where it is relative (qm9, qm9_cpu), 100 x its
    absolute one on a metric in [0, 1] otherwise (quick, full: 0.005 -> 0.5%)."""
    from mtl.bench.stats import verdicts

    out = {}
    for p, name in enumerate(PRESETS):
        b = _preset_bench(name)
        tol = b["plateau_tol"] * (1 if b.get("plateau_relative") else 100)
        for q, noise in enumerate(NOISES):
            for r, gain in enumerate(TRUE_GAINS):
                lo, hi = _simulated_bounds(len(b["seeds"]), b["last_k"], noise, gain, seed=100 * p + 10 * q + r)
                v = verdicts(lo, hi, tol)
                # the former rule: improving when the lower bound is above tol, converged otherwise
                out[name, noise, gain] = (tol, float((v == "converged").mean()), float((v == "improving").mean()),
                                          float((lo <= tol).mean()))
    return out


def test_the_convergence_verdict_is_calibrated_at_the_presets_seeds():
    """Simulated sweeps at each preset's seeds and window, true improvements of 0-30% of the baseline over the window
    and evaluation noise of 5-20%: a metric improving by at least twice the tolerance is called converged at most 10%
    of the time; one not improving at all is called improving at most 5% of the time (plus 3 Monte-Carlo errors).
    The former rule (converged unless the lower bound exceeds the tolerance) fails the first: at qm9_cpu's 3 seeds and
    10% noise it called a curve improving by 10% converged 83% of the time, at the qm9 preset's 36 seeds 9%."""
    table = _calibration()
    for (name, noise, gain), (tol, conv, impr, _) in table.items():
        if gain >= 2 * tol:
            assert conv <= 0.10, (name, noise, gain, conv)
        if gain == 0:
            assert impr <= _mc_bound(0.05, CAL_REPS), (name, noise, impr)
    assert table["qm9_cpu", 10.0, 10.0][3] == pytest.approx(0.83, abs=0.03)
    assert table["qm9", 10.0, 10.0][3] == pytest.approx(0.09, abs=0.03)
    assert max(c[3] for (n, _, g), c in table.items() if g >= 2 * c[0]) > 0.5  # the former rule: far above 10%


def test_the_convergence_verdict_on_known_inputs():
    """Three verdicts from the two one-sided 95% t bounds; one seed decides nothing; a spread of 0: the mean."""
    from mtl.bench.stats import convergence_verdict, window_bounds

    lo, hi = window_bounds([1.0, 2.0, 3.0])  # mean 2, se 1/sqrt 3, t_{0.95,2} = 2.919986
    assert lo == pytest.approx(2 - 2.919986 / math.sqrt(3), abs=1e-5) and hi == pytest.approx(2 + 2.919986 / math.sqrt(3), abs=1e-5)
    assert convergence_verdict([1.0, 2.0, 3.0], 4.0) == "converged"  # hi = 3.69 < 4
    assert convergence_verdict([1.0, 2.0, 3.0], 0.2) == "improving"  # lo = 0.31 > 0.2
    assert convergence_verdict([1.0, 2.0, 3.0], 2.0) == "undetermined"
    assert convergence_verdict([1.0, 9.0, -8.0], 5.0) == "undetermined"  # wide: not converged (the former rule: yes)
    assert convergence_verdict([7.0], 5.0) is None and convergence_verdict([1.0, float("nan")], 5.0) is None
    assert convergence_verdict([6.0] * 3, 5.0) == "improving" and convergence_verdict([4.0] * 3, 5.0) == "converged"
