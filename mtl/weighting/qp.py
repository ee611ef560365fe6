"""Small exact solvers on K x K Gram matrices, shared by the gradient-level methods (no method here)."""

from __future__ import annotations

import numpy as np
from scipy.linalg import eigh, solve_triangular
from scipy.optimize import nnls


def small_eigh(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues ascending, eigenvectors) of a symmetric float64 K x K matrix, by scipy's LAPACK (divide and
    conquer). Not ``np.linalg.eigh``: numpy's OpenBLAS runs its thread pool from K = 26 on, so while another process
    holds a core each call waits for a time slice: 16 ms at K = 26 to 40 against 0.1 ms (2-core x86, a busy loop on
    the other core); scipy's stays on one thread there up to K = 64."""
    return eigh(m, driver="evd", check_finite=False)


def kept_eigh(m: np.ndarray, rtol: float) -> tuple[np.ndarray, np.ndarray]:
    """The eigenpairs of a symmetric float64 K x K matrix that a pseudo-inverse keeps (``small_eigh``'s, ascending):
    those whose eigenvalue exceeds ``rtol`` times the largest (0 where that is negative). Aligned-MTL's and ConFIG's
    rank rule."""
    lam, vec = small_eigh(m)
    keep = lam > rtol * max(float(lam.max()), 0.0)
    return lam[keep], vec[:, keep]


def qp_limit(q: np.ndarray, b: np.ndarray, u: np.ndarray, tol: float) -> float:
    """The round-off bar of ``nonneg_qp``'s optimality conditions at u: tol times the scale of q u + b."""
    scale = max(float(np.max(np.abs(np.diag(q)))), 1e-300)
    return tol * scale * max(1.0, float(np.abs(u).sum()) + float(np.abs(b).sum()) / scale)


def qp_optimal(q: np.ndarray, b: np.ndarray, u: np.ndarray, tol: float) -> bool:
    """Whether u >= 0 meets the optimality (KKT) conditions of ``nonneg_qp`` to its bar: ``h = q u + b >= 0``
    everywhere and ``h = 0`` where u > 0 (h within the bar of 0)."""
    if not np.isfinite(u).all() or (u < 0).any():
        return False
    h = q @ u + b
    limit = qp_limit(q, b, u, tol)
    return bool((h >= -limit).all() and (np.abs(h[u > 0]) <= limit).all())


def cholesky_nnls(q: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The fast path of ``nonneg_qp`` for a positive definite q: with q = L L^T, ``u^T q u + 2 b^T u`` is
    ``||L^T u + L^-1 b||^2`` up to a constant, a non-negative least-squares problem that scipy's compiled
    Lawson-Hanson NNLS solves. None where q is not positive definite (Cholesky fails) or NNLS does not end."""
    try:
        low = np.linalg.cholesky(q)
        return nnls(low.T, -solve_triangular(low, b, lower=True))[0]
    except (np.linalg.LinAlgError, RuntimeError, ValueError):
        return None


def nonneg_qp(q: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin_{u >= 0} u^T q u + 2 b^T u for a PSD float64 q (K x K), exactly.

    h = q u + b is half the gradient; the optimum is the u >= 0 with h >= 0 and h = 0 where u > 0 (KKT).
    First the fast path (``cholesky_nnls``: scipy's NNLS on the Cholesky factor), accepted only when its
    answer meets those conditions to the bar of ``qp_limit`` (``qp_optimal``); otherwise (q singular or
    so ill-conditioned that the factor's round-off shows) an active-set (NNLS) method on q itself. Each
    outer step frees the coordinate with the most negative h (the most violated optimality condition); the
    inner loop solves the unconstrained problem on the free coordinates (least squares, so a singular q is
    fine) and, where that leaves the feasible set, moves only as far as the first coordinate that reaches
    0 and fixes it there.
    """
    fast = cholesky_nnls(q, b)
    if fast is not None and qp_optimal(q, b, fast, tol):
        return fast
    k = len(b)
    u = np.zeros(k)
    free = np.zeros(k, dtype=bool)
    for _ in range(3 * k + 30):  # each outer step strictly lowers the objective; K steps typically
        h = q @ u + b
        violated = ~free & (h < -qp_limit(q, b, u, tol))
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
