"""Small exact solvers on K x K Gram matrices, shared by the gradient-level methods (no method here)."""

from __future__ import annotations

import numpy as np


def nonneg_qp(q: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin_{u >= 0} u^T q u + 2 b^T u for a PSD float64 q (K x K), by an active-set (NNLS) method.

    h = q u + b is half the gradient. Each outer step frees the coordinate with the most negative h
    (the most violated optimality condition); the inner loop solves the unconstrained problem on the
    free coordinates (least squares, so a singular q is fine) and, where that leaves the feasible
    set, moves only as far as the first coordinate that reaches 0 and fixes it there.
    """
    k = len(b)
    scale = max(float(np.max(np.abs(np.diag(q)))), 1e-300)
    u = np.zeros(k)
    free = np.zeros(k, dtype=bool)
    for _ in range(3 * k + 30):  # each outer step strictly lowers the objective; K steps typically
        h = q @ u + b
        limit = tol * scale * max(1.0, float(np.abs(u).sum()) + float(np.abs(b).sum()) / scale)
        violated = ~free & (h < -limit)
        if not violated.any():
            break
        free[int(np.argmin(np.where(violated, h, np.inf)))] = True
        for _ in range(k + 1):
            idx = np.flatnonzero(free)
            z = np.zeros(k)
            z[idx] = np.linalg.lstsq(q[np.ix_(idx, idx)], -b[idx], rcond=None)[0]
            if (z[idx] > 0).all():
                u = z
                break
            bad = idx[z[idx] <= 0]
            den = u[bad] - z[bad]
            t = float(np.min(np.where(den > 0, u[bad] / np.where(den > 0, den, 1.0), 0.0)))
            u = u + t * (z - u)
            free &= u > 0
            u[~free] = 0.0
            if not free.any():
                break
    return np.maximum(u, 0.0)
