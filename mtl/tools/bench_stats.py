"""The statistics of the weighting benchmark: t-intervals over seeds, a paired bootstrap, the slope of a curve.

Pure functions of lists of floats (no torch, no files), so that they are tested on known inputs
(tests/test_bench.py).
"""

from __future__ import annotations

import math
import random
import statistics

# Two-sided 95% quantiles of Student's t (t_{0.975, df}), df = 1..30, from the standard tables.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
_Z975 = 1.959963984540054


def t975(df: int) -> float:
    """t_{0.975, df}: the table up to 30 degrees of freedom, beyond it the Cornish-Fisher expansion around the
    normal quantile (within 1e-3 of the exact value from df = 30 on)."""
    if df < 1:
        raise ValueError("a t-interval needs at least 2 values (df >= 1)")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval of the mean) of the finite values; the half-width is nan for fewer
    than two values, both are nan for none."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    if len(v) == 1:
        return v[0], float("nan")
    return statistics.mean(v), t975(len(v) - 1) * statistics.stdev(v) / math.sqrt(len(v))


def paired_bootstrap(diffs, resamples: int = 10000, seed: int = 0, min_n: int = 3) -> tuple[float, float, float]:
    """(mean, low, high): the mean of the paired differences (one per seed: method minus reference on the same seed)
    and the 95% percentile interval of the mean over ``resamples`` resamplings of the seeds with replacement, drawn
    from ``random.Random(seed)`` so that a table is reproducible. nan for no differences; the interval is nan for
    fewer than ``min_n`` (resampling one or two seeds says nothing about the spread)."""
    d = [float(x) for x in diffs if x is not None and math.isfinite(x)]
    if not d:
        return float("nan"), float("nan"), float("nan")
    if len(d) < min_n:
        return statistics.mean(d), float("nan"), float("nan")
    rng, n = random.Random(seed), len(d)
    means = sorted(sum(rng.choice(d) for _ in range(n)) / n for _ in range(resamples))
    lo = means[int(math.floor(0.025 * (resamples - 1)))]
    hi = means[int(math.ceil(0.975 * (resamples - 1)))]
    return statistics.mean(d), lo, hi


def significance(lo: float, hi: float) -> int:
    """+1 if the interval lies above 0, -1 if below, 0 if it holds 0 (or is nan)."""
    if lo > 0:
        return 1
    if hi < 0:
        return -1
    return 0


def slope_per_100(points, last_k: int) -> float:
    """The least-squares slope of ``[(step, value), ...]`` over the last ``last_k`` points, per 100 steps: how much
    the metric still moves at the end of a run (0 on a plateau). nan with fewer than two points."""
    pts = sorted(points)[-last_k:]
    if len(pts) < 2:
        return float("nan")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
