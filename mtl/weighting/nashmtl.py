"""Nash-MTL (Navon et al. 2022, "Multi-Task Learning as a Bargaining Game").

The update is the Nash bargaining solution ``d = sum_t alpha_t g_t`` with alpha > 0 solving::

    (G G^T alpha)_t = 1 / alpha_t         for every task t            (i.e. d . g_t = 1 / alpha_t)

We solve it exactly (the paper's Algorithm 1, "solve G^T G alpha = 1/alpha"), not by the authors'
sequence of cvxpy problems. It is the stationarity condition of the strictly convex
``f(alpha) = 1/2 alpha^T GG^T alpha - sum_t log alpha_t`` over alpha > 0, which is self-concordant:
damped Newton (step 1/(1 + lambda), lambda the Newton decrement) stays inside alpha > 0 and converges
quadratically. It runs in float64 on the CPU on the K x K Gram matrix, rescaled to unit diagonal
(``alpha_t = beta_t / ||g_t||`` with ``C beta = 1/beta``, C the cosine matrix), so the iteration does
not depend on the gradients' scale. For K = 2 this is a 2 x 2 Newton solve (a handful of steps).

Scale: d is invariant to rescaling any g_t (d . g_t = 1/alpha_t; for orthogonal gradients d is the
sum of the unit gradients). The authors' code divides GG^T by its Frobenius norm before solving, which
multiplies d by sqrt(||GG^T||_F); we keep the paper's equation (with Adam and gradient clipping the
overall scale matters little). No cvxpy.

Degenerate input:
- a zero row (||g_t||^2 <= 1e-12 max_s ||g_s||^2) gets alpha_t = 0 and is left out of the system
  (the equation has no solution for it); all-zero input gives d = 0.
- when no direction improves every task (0 in the convex hull, e.g. exactly opposed gradients) the
  equation has no solution; a ridge ``NASH_RIDGE`` * I on the cosine matrix keeps it solvable, alpha
  becomes large (~1/sqrt(ridge)) and d ~ 0 (0 up to rounding for opposed gradients of any norms).
  The ridge perturbs the equation by ridge * beta_t^2 (relative), negligible unless d is nearly 0.
- non-finite input gives alpha = 1 (a non-finite update: the trainer skips the step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram

NASH_RIDGE = 1e-8  # added to the unit diagonal of the cosine matrix (relative error ~1e-8 in alpha)
NASH_MAX_ITER = 500  # damped Newton steps
NASH_TOL = 1e-20  # stop when the squared Newton decrement is below this


def solve_nash(c: np.ndarray, max_iter: int = NASH_MAX_ITER, tol: float = NASH_TOL) -> np.ndarray:
    """beta > 0 with c @ beta = 1 / beta, for a positive definite float64 matrix c (damped Newton)."""
    beta = np.ones(c.shape[0])
    for _ in range(max_iter):
        grad = c @ beta - 1.0 / beta
        hess = c + np.diag(1.0 / beta**2)
        step = np.linalg.solve(hess, grad)
        lam2 = float(grad @ step)
        if lam2 < tol:
            break
        lam = np.sqrt(max(lam2, 0.0))
        beta = beta - (step if lam < 0.25 else step / (1.0 + lam))
        beta = np.maximum(beta, 1e-300)  # in exact arithmetic the step never leaves beta > 0
    return beta


@torch.no_grad()
def nashmtl_weights(gram: Tensor, ridge: float = NASH_RIDGE, max_iter: int = NASH_MAX_ITER) -> Tensor:
    """(K,) alpha solving (GG^T alpha)_t = 1/alpha_t for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.ones(k), gram)
    sq = np.diag(m).copy()
    alpha = np.zeros(k)
    active = sq > 1e-12 * max(float(sq.max()), 0.0)
    if active.any():
        norms = np.sqrt(sq[active])
        cos = m[np.ix_(active, active)] / np.outer(norms, norms)
        cos = (cos + cos.T) / 2 + ridge * np.eye(len(norms))
        alpha[active] = solve_nash(cos, max_iter) / norms
    return like_gram(alpha, gram)


@torch.no_grad()
def nashmtl(grads: Tensor, losses: Tensor | None = None, *, ridge: float = NASH_RIDGE) -> Tensor:
    """(K, P) task gradients -> (P,) Nash bargaining update sum_t alpha_t g_t."""
    return apply_weights(nashmtl_weights(gram_matrix(grads), ridge), grads)


class NashMTL(GramWeighting):
    name = "nashmtl"

    def weights_from_gram(self, gram, losses, dtype):
        return nashmtl_weights(gram)
