"""FairGrad (Ban & Ji 2024, "Fair Resource Allocation in Multi-Task Learning").

alpha-fair utility maximisation: the update d = sum_t w_t g_t maximises ``sum_t U_alpha(g_t . d)`` over a
ball, ``U_alpha(x) = x^(1 - alpha) / (1 - alpha)`` (log x for alpha = 1), whose optimality condition
is the paper's equation for the weights w > 0::

    (G G^T w)_t = w_t^(-1/alpha)          for every task t          (i.e. g_t . d = w_t^(-1/alpha))

alpha = 1 is proportional fairness: Nash-MTL's equation ``G G^T w = 1/w`` (the same solution); alpha
-> infinity approaches max-min fairness (the worst task's improvement); small alpha favours the total
improvement. ``weighting.options.alpha`` = 1.0 (LibMTL's and the authors' default; the paper tunes it
per benchmark, e.g. 2.0).

Solved exactly, not by the authors' ``scipy.optimize.least_squares`` on the residual: the equation is
the stationarity condition of the strictly convex

    f(w) = 1/2 w^T M w - sum_t phi(w_t),     phi' (w) = w^(-1/alpha)     (phi = log for alpha = 1)

over w > 0 (M = G G^T is PSD and phi concave), so damped Newton with a backtracking line search that
keeps w > 0 converges to it (quadratically at the end; it stops at round-off). The line search
compares f's change computed from differences: for nearly opposed rows w ~ 1e5 and f itself carries
round-off far above the decrease it has to confirm. The Gram matrix is first
divided by its largest diagonal entry s (the iteration does not depend on the gradients' scale); the
solution for M follows as ``w = w_s * s^(-alpha / (alpha + 1))``. Newton starts from the best multiple
of the ones vector.

Existence: as for Nash-MTL, a solution exists iff 0 is not in the convex hull of the (non-zero) rows
(``mtl.weighting.nashmtl.simplex_min`` on the cosine matrix, with Nash-MTL's tolerances); where none
does (e.g. exactly opposed rows) a ridge ``FAIRGRAD_RIDGE`` * I on the scaled M keeps f bounded below:
w becomes large and d ~ 0.

Degenerate input: a zero row (||g_t||^2 <= 1e-12 max_s ||g_s||^2) gets w_t = 0 and is left out;
all-zero input gives d = 0. Non-finite input gives w = 1 (the trainer skips the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.checks import ranged
from mtl.weighting.nashmtl import default_exists_tol, simplex_min

FAIRGRAD_ALPHA = 1.0  # the fairness parameter alpha
FAIRGRAD_RIDGE = 1e-8  # added to the scaled Gram matrix's diagonal, only where no solution exists
FAIRGRAD_MAX_ITER = 500


def _phi_change(w: np.ndarray, d: np.ndarray, alpha: float) -> float:
    """sum_t phi(w_t + d_t) - phi(w_t), computed without cancellation (log1p / expm1)."""
    r = np.log1p(d / w)
    if alpha == 1.0:
        return float(r.sum())
    p = 1.0 - 1.0 / alpha
    return float((w**p * np.expm1(p * r) / p).sum())


def solve_fair(m: np.ndarray, alpha: float, max_iter: int = FAIRGRAD_MAX_ITER) -> np.ndarray:
    """w > 0 with m @ w = w^(-1/alpha), for a PSD float64 m (K x K) where a solution exists.

    Damped Newton on f; the line search compares f's *change*, computed from the differences (for
    nearly opposed rows w ~ 1e5 and f itself carries round-off far above the decrease to be checked)."""
    k = m.shape[0]
    total = max(float(m.sum()), 1e-300)
    w = np.full(k, (k / total) ** (alpha / (alpha + 1.0)))
    last = np.inf
    for _ in range(max_iter):
        mw = m @ w
        grad = mw - w ** (-1.0 / alpha)
        hess = m + np.diag(w ** (-1.0 / alpha - 1.0) / alpha)
        step = np.linalg.solve(hess, grad)
        lam2 = float(grad @ step)  # squared Newton decrement
        # stop at 0, or in the quadratic phase once it stops shrinking fast (round-off reached)
        if not lam2 > 1e-30 or (lam2 < 1e-10 and lam2 > 0.25 * last):
            break
        last = lam2
        t, curv, slope = 1.0, float(step @ m @ step), float(mw @ step)
        while t > 1e-12:
            if (w - t * step > 0).all():
                change = -t * slope + 0.5 * t * t * curv - _phi_change(w, -t * step, alpha)  # f(w - t step) - f(w)
                if change <= -0.25 * t * lam2 or lam2 < 1e-10:
                    break
            t *= 0.5
        w = w - t * step
    return w


@torch.no_grad()
def fairgrad_weights(gram: Tensor, alpha: float = FAIRGRAD_ALPHA, exists_tol: float | None = None) -> Tensor:
    """(K,) w > 0 solving (GG^T w)_t = w_t^(-1/alpha) for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.ones(k), gram)
    exists_tol = default_exists_tol(torch.float64) if exists_tol is None else exists_tol
    m = (m + m.T) / 2
    sq = np.diag(m).copy()
    w = np.zeros(k)
    active = sq > 1e-12 * max(float(sq.max()), 0.0)
    if active.any():
        sub = m[np.ix_(active, active)]
        s = float(np.diag(sub).max())
        scaled = sub / s
        n = np.sqrt(np.diag(sub))
        if not simplex_min(sub / np.outer(n, n)) > exists_tol:
            scaled = scaled + FAIRGRAD_RIDGE * np.eye(len(n))
        w[active] = solve_fair(scaled, alpha) * s ** (-alpha / (alpha + 1.0))
    return like_gram(w, gram)


@torch.no_grad()
def fairgrad(grads: Tensor, losses: Tensor | None = None, *, alpha: float = FAIRGRAD_ALPHA) -> Tensor:
    """(K, P) task gradients -> (P,) the alpha-fair update sum_t w_t g_t."""
    return apply_weights(fairgrad_weights(gram_matrix(grads), alpha, default_exists_tol(grads.dtype)), grads)


@dataclass
class FairGradOptions:
    # fairness: 1 proportional (Nash-MTL's equation), larger towards max-min, smaller towards the sum
    alpha: float = ranged(FAIRGRAD_ALPHA, lambda v: v > 0 and math.isfinite(v), "must be > 0")


class FairGrad(GramWeighting):
    name = "fairgrad"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)
    Options = FairGradOptions

    def weights_from_gram(self, gram, losses, dtype):
        return fairgrad_weights(gram, self.options.alpha, default_exists_tol(dtype))
