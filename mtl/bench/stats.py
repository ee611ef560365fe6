"""The statistics of the weighting benchmark, on scipy.stats: t-intervals over seeds, the paired t-test against a
reference, Holm's correction across the methods of one table, the smallest difference a table can detect, and the
slope of a curve.

The rank correlation of our order of methods with a published one is Spearman's rho with a Fisher-z interval
(``rank_correlation``).

The test is the two-sided **paired t-test** (``scipy.stats.ttest_1samp`` on the per-seed differences, which is
``ttest_rel``): at the n = 3-10 seeds a sweep affords it has its nominal size when the differences are about normal,
and it has power. It does not keep its size for skewed differences: a method with a skewed, wider spread against a
normal ``equal`` gets false marks more often than alpha (tests/test_bench_stats.py measures how often). The offered
alternative (``bench.test: signflip``) is the exact sign-flip permutation test (``scipy.stats.permutation_test``):
exact for differences symmetric about 0 whatever their shape, but it cannot reject at level a below n seeds with
2 / 2^n > a (at 5%: n < 6; at Holm's 0.05 / 8: n < 9). A percentile bootstrap of the mean (this tool's former
test) is anti-conservative at such n: it rejected 16% of true nulls at 5 seeds.

The design of a table (``power_holm``, ``seeds_needed``): the power of each of m comparisons is read at Holm's
strictest level alpha / m, a lower bound of its power under Holm's step-down (a comparison tested later in the
order gets a larger level).

Convergence (``convergence_verdict``): per run the change of a metric over its last evaluations (the least-squares
slope times the window's span), and over seeds two one-sided t bounds of the mean improvement over the window
(``window_bounds``), each at 95%: **improving** when the lower bound exceeds a tolerance, **converged** when the
upper bound is below it (a one-sided test of "the improvement is at least the tolerance", as in the two one-sided
tests of equivalence), **undetermined** when neither (too few seeds or too much noise to say). The seeds' spread
carries the evaluation noise. Each error is at most 5%: an improvement of at least the tolerance is called converged
at most 5% of the time, none called improving at most 5% (tests/test_bench_stats.py simulates both).

Pure functions of lists of floats (no torch, no files), tested on known inputs and by simulation.
"""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np
from scipy import optimize, stats

TESTS = ("t", "signflip")  # bench.test: the paired t-test, or the exact sign-flip permutation test
VERDICTS = ("converged", "improving", "undetermined")  # the convergence verdicts (``convergence_verdict``)


def _finite(values) -> list[float]:
    return [float(x) for x in values if x is not None and math.isfinite(x)]


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (``scipy.stats.t.ppf``); df >= 1."""
    if df < 1:
        raise ValueError("a t quantile needs at least 1 degree of freedom (2 values)")
    return float(stats.t.ppf(q, df))


def mean_ci(values, level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the ``level`` t-interval of the mean) of the finite values; the half-width is nan for
    fewer than two values, both are nan for none."""
    v = _finite(values)
    if not v:
        return float("nan"), float("nan")
    if len(v) == 1:
        return v[0], float("nan")
    return statistics.mean(v), t_quantile(0.5 + level / 2, len(v) - 1) * statistics.stdev(v) / math.sqrt(len(v))


def signflip_p(diffs) -> float:
    """The two-sided p-value of the exact sign-flip permutation test of the mean of paired differences against 0
    (``scipy.stats.permutation_test``, every one of the 2^n sign patterns): exact when the differences are
    symmetric about 0 under the null, whatever their distribution. Its smallest value is 2 / 2^n."""
    d = np.asarray(_finite(diffs), dtype=float)
    return float(stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf,
                                        alternative="two-sided").pvalue)


def paired_test(diffs, alpha: float = 0.05, test: str = "t") -> dict:
    """The paired t-test of per-seed differences (method minus reference on the same seed) against 0:
    ``{n, mean, lo, hi, p, sd}`` with ``[lo, hi]`` the (1 - alpha) t-interval of the mean difference and ``p`` the
    two-sided p-value. Fewer than 3 differences: no interval and no p (nan): two seeds say little about the spread. A
    spread of 0 (every seed the same difference): p = 0 for a non-zero mean, 1 for zero. ``test="signflip"``: ``p``
    from the exact sign-flip permutation test instead (``signflip_p``; the interval stays the t-interval)."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {', '.join(TESTS)} (got {test!r})")
    d = _finite(diffs)
    nan = float("nan")
    out = {"n": len(d), "mean": statistics.mean(d) if d else nan, "lo": nan, "hi": nan, "p": nan, "sd": nan}
    if len(d) < 3:
        return out
    sd = statistics.stdev(d)
    half = t_quantile(1 - alpha / 2, len(d) - 1) * sd / math.sqrt(len(d))
    if sd <= 1e-12 * max(1.0, abs(out["mean"])):  # the same difference on every seed (to rounding)
        sd, p = 0.0, (0.0 if abs(out["mean"]) > 1e-12 else 1.0)
    else:
        p = float(stats.ttest_1samp(d, 0.0).pvalue) if test == "t" else signflip_p(d)
    out.update(lo=out["mean"] - half, hi=out["mean"] + half, p=p, sd=sd)
    return out


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest of m p-values times (m - i + 1),
    made monotone and capped at 1. nan p-values (too few seeds) stay nan and do not count in m. A p-value is
    significant at family-wise level alpha when its adjusted value is below alpha. (scipy.stats offers
    Benjamini-Hochberg, ``false_discovery_control``, which controls the false discovery rate, not the family-wise
    error rate that a table of marks needs.)"""
    idx = sorted((i for i, p in enumerate(pvalues) if p == p), key=lambda i: pvalues[i])
    m, out, running = len(idx), [float("nan")] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def mark(mean: float, p_adjusted: float, alpha: float) -> int:
    """+1 / -1: the mean difference is above / below 0 at family-wise level alpha (its Holm-adjusted p < alpha);
    0 otherwise (or nan)."""
    if not p_adjusted < alpha:
        return 0
    return 1 if mean > 0 else -1 if mean < 0 else 0


def power(effect: float, sd: float, n: int, alpha: float) -> float:
    """The power of the two-sided paired t-test at level alpha with n pairs, for a true mean difference ``effect``
    whose per-seed differences have standard deviation ``sd`` (the noncentral t, ``scipy.stats.nct``)."""
    df, nc = n - 1, effect / sd * math.sqrt(n)
    crit = t_quantile(1 - alpha / 2, df)
    lower = float(stats.nct.cdf(-crit, df, nc))  # the wrong-sign tail: below 1e-20 where scipy returns nan
    return float(stats.nct.sf(crit, df, nc)) + (lower if math.isfinite(lower) else 0.0)


def min_detectable(sd: float, n: int, alpha: float, target: float = 0.8) -> float:
    """The smallest true mean difference that the paired t-test at level alpha detects with probability ``target``
    from n pairs whose differences have standard deviation ``sd``: ``power`` solved for the effect. nan when it
    cannot be said (fewer than 3 pairs, or no spread measured)."""
    if n < 3 or not sd > 0 or not math.isfinite(sd):
        return float("nan")
    hi = sd * 100.0
    return float(optimize.brentq(lambda e: power(e, sd, n, alpha) - target, 0.0, hi, xtol=sd * 1e-6))


def power_holm(effect: float, sd: float, n: int, alpha: float, m: int) -> float:
    """The power of one of ``m`` comparisons under Holm's correction at family-wise level alpha, read at Holm's
    strictest level alpha / m (``power``): a lower bound, since a comparison tested later in Holm's order gets a
    larger level."""
    return power(effect, sd, n, alpha / max(1, m))


def min_detectable_holm(sd: float, n: int, alpha: float, m: int, target: float = 0.8) -> float:
    """The smallest true difference detected with probability ``target`` at Holm's strictest level alpha / m."""
    return min_detectable(sd, n, alpha / max(1, m), target)


def seeds_needed(effect: float, sd: float, alpha: float, m: int = 1, target: float = 0.8, most: int = 200) -> int:
    """The fewest seeds (paired runs, at least 3) at which a true difference ``effect`` is detected with probability
    ``target`` at Holm's strictest level alpha / m (``power_holm``); 0 when even ``most`` seeds do not suffice."""
    if not sd > 0 or not effect:
        return 0
    return next((n for n in range(3, most + 1) if power_holm(abs(effect), sd, n, alpha, m) >= target), 0)


def sd_upper_bound(sd: float, df: int, level: float = 0.95) -> float:
    """The one-sided ``level`` upper confidence bound of a standard deviation estimated as ``sd`` with ``df`` degrees
    of freedom (normal data: df s^2 / sigma^2 is chi-square with df degrees of freedom, ``scipy.stats.chi2``)."""
    if df < 1 or not sd >= 0:
        return float("nan")
    return sd * math.sqrt(df / float(stats.chi2.ppf(1 - level, df)))


def pooled_sd(groups: list[list[float]]) -> tuple[float, int]:
    """(the pooled standard deviation of several groups of paired differences, the median group size): the paired
    spread of one table, each group (method) about its own mean. nan with no group of 2 or more."""
    groups = [_finite(g) for g in groups]
    groups = [g for g in groups if len(g) >= 2]
    if not groups:
        return float("nan"), 0
    ss = sum((len(g) - 1) * statistics.variance(g) for g in groups)
    df = sum(len(g) - 1 for g in groups)
    return math.sqrt(ss / df), int(statistics.median(len(g) for g in groups))


def slope_per_100(points, last_k: int) -> float:
    """The least-squares slope of ``[(step, value), ...]`` over the last ``last_k`` points, per 100 steps: how much
    the metric still moves at the end of a run (0 on a plateau). nan with fewer than two points."""
    pts = sorted(points)[-last_k:]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return float("nan")
    return 100 * float(stats.linregress([p[0] for p in pts], [p[1] for p in pts]).slope)


def window_change(points, last_k: int) -> tuple[float, int]:
    """(the change of a curve over its last ``last_k`` points: the least-squares slope times the window's span in
    steps, the span): how much the fitted line moves from the window's first evaluation to its last. nan with
    fewer than two points."""
    pts = sorted(points)[-last_k:]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return float("nan"), 0
    span = pts[-1][0] - pts[0][0]
    return slope_per_100(pts, last_k) * span / 100, span


def window_bounds(improvements, level: float = 0.95):
    """(lower, upper): the one-sided ``level`` t bounds over seeds of the mean improvement over the window
    (``scipy.stats.ttest_1samp(...).confidence_interval`` with ``alternative="greater"`` and ``"less"``), along the
    last axis of ``improvements`` (one value per seed, at least two, finite): floats for one metric, arrays for many
    (a simulation). A spread of 0 (every seed the same): both bounds are the mean."""
    x = np.asarray(improvements, dtype=float)
    with warnings.catch_warnings():  # a spread of 0 (or to rounding): scipy warns, and its bound is the mean
        warnings.simplefilter("ignore", RuntimeWarning)
        lo = stats.ttest_1samp(x, 0.0, axis=-1, alternative="greater").confidence_interval(level).low
        hi = stats.ttest_1samp(x, 0.0, axis=-1, alternative="less").confidence_interval(level).high
    return lo, hi


def verdicts(lo, hi, tol: float):
    """The verdict of each pair of bounds (``window_bounds``): "improving" where the lower bound exceeds ``tol``,
    "converged" where the upper bound is below it, "undetermined" where neither (the interval reaches across
    ``tol``). Both cannot hold: the lower bound is never above the upper."""
    return np.where(np.asarray(lo) > tol, VERDICTS[1], np.where(np.asarray(hi) < tol, VERDICTS[0], VERDICTS[2]))


def convergence_verdict(improvements, tol: float, level: float = 0.95) -> str | None:
    """Whether a metric has converged at the end of its runs, from the per-seed improvements over the window
    (``window_change`` with the sign that makes an improvement positive): "converged" (the one-sided ``level``
    upper bound over seeds of the mean improvement is below ``tol``: shown to improve by less than the tolerance),
    "improving" (the lower bound is above ``tol``) or "undetermined" (neither: these seeds cannot tell; never read as
    converged). None with fewer than two seeds. A spread of 0: the mean against ``tol``."""
    v = _finite(improvements)
    if len(v) < 2:
        return None
    return str(verdicts(*window_bounds(v, level), tol))


def rank_correlation(x, y, level: float = 0.95) -> dict:
    """Spearman's rank correlation of paired values (``scipy.stats.spearmanr``; ties get mid-ranks): ``{n, rho, p,
    lo, hi}``, ``p`` two-sided against no association, ``[lo, hi]`` the ``level`` interval through Fisher's z with
    the standard error of Fieller, Hartley and Pearson (1957) for Spearman's rho, ``sqrt(1.06 / (n - 3))``:
    ``tanh(atanh(rho) -+ z_q * se)``. It treats both orders as fixed (the seed noise of our Δm is not in it). Pairs
    with a nan are left out. rho is nan below 3 pairs, the interval below 4 (and at rho = +-1, where z is
    infinite)."""
    pairs = [(float(a), float(b)) for a, b in zip(x, y) if a == a and b == b]
    nan = float("nan")
    out = {"n": len(pairs), "rho": nan, "p": nan, "lo": nan, "hi": nan}
    if len(pairs) < 3:
        return out
    res = stats.spearmanr([a for a, _ in pairs], [b for _, b in pairs])
    out["rho"], out["p"] = float(res.statistic), float(res.pvalue)
    if len(pairs) >= 4 and abs(out["rho"]) < 1:
        half = float(stats.norm.ppf(0.5 + level / 2)) * math.sqrt(1.06 / (len(pairs) - 3))
        z = math.atanh(out["rho"])
        out["lo"], out["hi"] = math.tanh(z - half), math.tanh(z + half)
    return out


def ratio_test(ratios, margin: float = 0.05, level: float = 0.95) -> dict:
    """Paired ratios (ours / theirs, one per round, each round's two measurements taken side by side) read on the
    log scale, where a ratio and its inverse are symmetric: ``{n, ratio, lo, hi, p_lower, p_within}`` with
    ``ratio`` the geometric mean, ``[lo, hi]`` its ``level`` t-interval, ``p_lower`` the one-sided p-value of the
    paired t-test against "ours is not lower" (H0: ratio >= 1) and ``p_within`` the one-sided non-inferiority
    p-value against "ours is more than ``margin`` higher" (H0: ratio >= 1 + margin): a small ``p_within`` shows
    ours <= theirs within the margin. Fewer than 3 finite ratios: only the geometric mean. A ratio <= 0 (a
    measurement that cannot be a ratio of two sizes or times) is refused, not dropped."""
    finite = _finite(ratios)
    bad = [r for r in finite if r <= 0]
    if bad:
        raise ValueError(f"ratio_test: ratios must be > 0 (got {bad}); check the measurements they come from")
    logs = [math.log(r) for r in finite]
    nan = float("nan")
    out = {"n": len(logs), "ratio": math.exp(statistics.mean(logs)) if logs else nan, "lo": nan, "hi": nan,
           "p_lower": nan, "p_within": nan}
    if len(logs) < 3:
        return out
    mean, half = mean_ci(logs, level)
    out["lo"], out["hi"] = math.exp(mean - half), math.exp(mean + half)
    if statistics.stdev(logs) <= 1e-12:  # the same ratio every round: the test has no spread to work with
        out["p_lower"] = 0.0 if mean < 0 else 1.0
        out["p_within"] = 0.0 if mean < math.log1p(margin) else 1.0
        return out
    out["p_lower"] = float(stats.ttest_1samp(logs, 0.0, alternative="less").pvalue)
    out["p_within"] = float(stats.ttest_1samp(logs, math.log1p(margin), alternative="less").pvalue)
    return out
