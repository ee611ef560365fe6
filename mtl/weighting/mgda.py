"""MGDA (Sener & Koltun 2018, "Multi-Task Learning as Multi-Objective Optimization"): min-norm point.

The update is the point of minimum norm in the convex hull of the task gradients::

    alpha* = argmin_{alpha in simplex} || sum_t alpha_t g_t ||^2,      d = sum_t alpha*_t g_t

It is a common descent direction: the optimality conditions give ``d . g_t >= ||d||^2 >= 0`` for every
task, and ``d = 0`` exactly when the point is Pareto-stationary (some convex combination of the
gradients vanishes). The scale is that of a convex combination (like the mean gradient, not the sum).

K = 2, closed form (weight on g_1)::

    alpha = clip( ((g_2 - g_1) . g_2) / ||g_1 - g_2||^2, 0, 1 )     (0.5 when g_1 = g_2)

computed with tensor ops on the device. K > 2, exactly, in float64 on the CPU (a K x K problem): the
min-norm point of the hull is a non-negative least-squares problem (Wolfe's; the same as Nash-MTL's
``solution_exists``), with M = G G^T / max_t ||g_t||^2::

    u* = argmin_{u >= 0} u^T (M + 1 1^T) u - 2 1^T u  ( = ||G^T u||^2 + (sum u - 1)^2 scaled),   alpha* = u* / sum u*

(its optimality conditions (M u)_t >= 1 - sum u, with equality where u_t > 0, are those of the simplex
problem for alpha = u / sum u), solved by ``nonneg_qp`` (mtl/weighting/qp.py: an active-set NNLS, ending
with the conditions met to round-off). The answer is certified: the KKT gap ``max_{alpha_t > 0} (G G^T
alpha)_t - min_t (G G^T alpha)_t`` (0 exactly at the optimum; it bounds the Frank-Wolfe duality gap) must
be below ``MGDA_TOL`` * max_t ||g_t||^2 (float32 rows: their Gram matrix's round-off, ``default_tol``); if
round-off leaves it above, Frank-Wolfe with away steps (the paper's Algorithm 2 with exact line search, linearly
convergent) continues from it until it is.
(Frank-Wolfe from 1/K, which this replaced, needed hundreds of steps where the min-norm point is near 0,
and at K = 40 stopped at its iteration cap with ||d||^2 7x the minimum: python -m mtl.tools.bench.solve_cost.)

Normalisation (``weighting.options.normalization``, the authors' code's ``normalization_type``):
``none`` (the default: plain gradients, the paper's definition), ``l2`` (each g_t divided by ||g_t||),
``loss`` (by L_t) or ``loss+`` (by L_t ||g_t||). The min-norm point is found for the normalised rows
g_t / n_t and the update is that combination of them, ``d = sum_t alpha*_t g_t / n_t``: the weights on
the raw rows are ``alpha*_t / n_t``. The losses are the rank-averaged ones handed to ``combine``. A zero
norm or loss divides by 1 (the row stays as it is). The paper's "MGDA-UB" (the bound on the shared
representation) is not used.

Degenerate input: a zero row makes the min-norm point the origin, so d = 0 (the zero task is already
stationary; nothing improves every task); all-zero input gives d = 0; identical rows give d = g.
Non-finite input gives the mean of the rows (non-finite, so the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, gram_round_off, like_gram
from mtl.weighting.checks import one_of
from mtl.weighting.qp import nonneg_qp

MGDA_MAX_ITER = 1000  # Frank-Wolfe iterations (K > 2), only where the NNLS answer is not certified
MGDA_TOL = 1e-12  # the optimum: the KKT gap is below this fraction of max_t ||g_t||^2 (float64 rows)
MGDA_NORMALIZATIONS = ("none", "l2", "loss", "loss+")


def default_tol(dtype: torch.dtype) -> float:
    """``MGDA_TOL``, or the Gram matrix's own relative round-off where that is larger (rows of float32 and below:
    1.2e-7, ``gram_round_off``): a KKT gap below 1e-12 is not a property such a matrix can be asked for."""
    return max(MGDA_TOL, gram_round_off(dtype))


def min_norm_2(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Weight on x of the min-norm point of the segment [x, y], given a=x.x, b=y.y, c=x.y (tensors)."""
    denom = a + b - 2 * c  # ||x - y||^2
    ok = denom > 1e-12 * (a + b)
    return torch.where(ok, ((b - c) / torch.where(ok, denom, 1.0)).clamp(0.0, 1.0), 0.5)


def kkt_gap(m: np.ndarray, alpha: np.ndarray) -> float:
    """``max_{alpha_t > 0} (m alpha)_t - min_t (m alpha)_t`` for a simplex point alpha: >= 0, and 0 exactly at the
    min-norm point (it bounds the Frank-Wolfe duality gap alpha^T m alpha - min_t (m alpha)_t)."""
    grad = m @ alpha
    return float(grad[alpha > 0].max() - grad.min())


def nnls_min_norm(m: np.ndarray) -> np.ndarray:
    """argmin over the simplex of alpha^T m alpha from the NNLS problem in the module docstring (m PSD, K x K)."""
    k = m.shape[0]
    ones = np.ones(k)
    u = nonneg_qp(m / max(float(np.max(np.diag(m))), 1e-300) + np.outer(ones, ones), -ones)
    total = float(u.sum())
    return u / total if total > 0 else np.full(k, 1.0 / k)


def min_norm_weights(m: np.ndarray, max_iter: int = MGDA_MAX_ITER, tol: float = MGDA_TOL) -> np.ndarray:
    """argmin over the simplex of alpha^T m alpha, for a PSD float64 matrix m (K x K): NNLS, certified by its KKT
    gap, with Frank-Wolfe continuing from it where round-off left the gap above ``tol`` * max_t m_tt."""
    scale = float(np.max(np.diag(m)))
    if not scale > 0:  # all rows zero: every point is the origin
        return np.full(m.shape[0], 1.0 / m.shape[0])
    alpha = nnls_min_norm(m)
    if kkt_gap(m, alpha) <= tol * scale:
        return alpha
    return frank_wolfe_min_norm(m, max_iter, tol, alpha)


def frank_wolfe_min_norm(m: np.ndarray, max_iter: int = MGDA_MAX_ITER, tol: float = MGDA_TOL,
                         start: np.ndarray | None = None) -> np.ndarray:
    """argmin over the simplex of alpha^T m alpha, for a PSD float64 matrix m (K x K), from ``start`` (1/K).

    Frank-Wolfe with exact line search (Sener & Koltun's Algorithm 2), plus away steps (move weight
    off the worst vertex in use), which make it converge linearly instead of as O(1/iterations).
    """
    k = m.shape[0]
    alpha = np.full(k, 1.0 / k) if start is None else start.copy()
    scale = max(float(np.max(np.diag(m))), 1e-300)
    for _ in range(max_iter):
        grad = m @ alpha  # half the gradient of alpha^T m alpha
        s = int(np.argmin(grad))
        used = np.nonzero(alpha > 0)[0]
        v = int(used[np.argmax(grad[used])])
        gap_fw = float(grad @ alpha - grad[s])  # half the Frank-Wolfe duality gap
        gap_away = float(grad[v] - grad @ alpha)
        if gap_fw <= tol * scale:
            break
        if gap_fw >= gap_away:  # towards vertex s: alpha + gamma (e_s - alpha), gamma in [0, 1]
            direction = -alpha.copy()
            direction[s] += 1.0
            gamma_max = 1.0
        else:  # away from vertex v: alpha + gamma (alpha - e_v), gamma in [0, alpha_v / (1 - alpha_v)]
            direction = alpha.copy()
            direction[v] -= 1.0
            gamma_max = alpha[v] / (1.0 - alpha[v]) if alpha[v] < 1.0 else 1e300
        curvature = float(direction @ m @ direction)
        slope = float(grad @ direction)  # < 0
        gamma = gamma_max if curvature <= 0 else min(-slope / curvature, gamma_max)
        alpha = np.maximum(alpha + gamma * direction, 0.0)
        alpha /= alpha.sum()
    return alpha


@torch.no_grad()
def mgda_weights(gram: Tensor, max_iter: int = MGDA_MAX_ITER, tol: float = MGDA_TOL) -> Tensor:
    """(K,) min-norm convex weights for the Gram matrix ``grads @ grads.T`` (float64)."""
    k = gram.shape[0]
    if k == 1:
        return torch.ones(1, dtype=gram.dtype, device=gram.device)
    if k == 2:
        a1 = min_norm_2(gram[0, 0], gram[1, 1], gram[0, 1])
        return torch.stack([a1, 1 - a1])
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.full(k, 1.0 / k), gram)
    return like_gram(min_norm_weights(m, max_iter, tol), gram)


@torch.no_grad()
def mgda(grads: Tensor, losses: Tensor | None = None, *, max_iter: int = MGDA_MAX_ITER,
         tol: float | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) min-norm point of their convex hull (``tol``: ``default_tol`` of their dtype)."""
    tol = default_tol(grads.dtype) if tol is None else tol
    return apply_weights(mgda_weights(gram_matrix(grads), max_iter, tol), grads)


def mgda_normalizers(gram: Tensor, losses: Tensor | None, normalization: str) -> Tensor:
    """(K,) n_t, the divisor of each row: 1 (none), ||g_t|| (l2), L_t (loss), L_t ||g_t|| (loss+); 0 becomes 1."""
    ones = torch.ones(gram.shape[0], dtype=gram.dtype, device=gram.device)
    if normalization == "none":
        return ones
    if normalization in ("loss", "loss+") and losses is None:
        raise ValueError(f"MGDA with normalization={normalization} needs the task losses")
    norms = gram.diagonal().clamp_min(0.0).sqrt()
    loss = losses.to(gram) if losses is not None else ones
    n = {"l2": norms, "loss": loss, "loss+": loss * norms}[normalization]
    return torch.where(n > 0, n, 1.0)


@torch.no_grad()
def mgda_normalized_weights(gram: Tensor, losses: Tensor | None = None, normalization: str = "none",
                            tol: float = MGDA_TOL) -> Tensor:
    """(K,) weights on the raw rows: the min-norm point of the rows g_t / n_t, divided by n_t."""
    if normalization == "none":  # n = 1
        return mgda_weights(gram, tol=tol)
    n = mgda_normalizers(gram, losses, normalization)
    return mgda_weights(gram / (n[:, None] * n[None, :]), tol=tol) / n


@dataclass
class MGDAOptions:
    # none | l2 | loss | loss+: divide each gradient by 1, its norm, its loss or both first
    normalization: str = one_of("none", MGDA_NORMALIZATIONS)


class MGDA(GramWeighting):
    name = "mgda"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)
    Options = MGDAOptions

    def weights_from_gram(self, gram, losses, dtype):
        return mgda_normalized_weights(gram, losses, self.options.normalization, default_tol(dtype))
