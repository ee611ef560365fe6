"""UPGrad (Quinton & Rey 2024, "Jacobian Descent for Multi-Objective Optimization").

Each task gradient is projected onto the dual cone of the rows, ``{x : g_t . x >= 0 for all t}``, and the
projections are **averaged** (the paper's A_UPGrad with the uniform preference vector 1/K)::

    d = (1/K) sum_i pi(g_i),        pi(g_i) = G^T v_i,    v_i = argmin_{v >= e_i} v^T (G G^T) v

(the paper's Proposition: projecting g_i = G^T e_i onto the dual cone is this K-dim box-constrained
QP on the Gram matrix). So ``d = alpha @ G`` with ``alpha = mean_i v_i``. d lies in the dual cone,
hence ``d . g_t >= 0`` for every task: it never increases a task's loss to first order.

K = 2, exact (a = ||g_1||^2, b = ||g_2||^2, c = g_1 . g_2)::

    v_1 = (1, max(0, -c/b)),   v_2 = (max(0, -c/a), 1)

i.e. each gradient loses its component along the other when they conflict (the same projection as
PCGrad, so UPGrad = PCGrad / 2 for two tasks); computed with tensor ops on the device. K > 2: each QP,
written as ``v = e_i + u`` with ``u >= 0``, is a non-negative least-squares problem in Gram form, solved
exactly by an active-set method (Lawson & Hanson's NNLS, run on the K x K matrix: the active set grows
by the most violated constraint, with the least-squares solve on the free set and back-tracking to stay
feasible), in float64 on the CPU. It ends in a finite number of steps with the optimality (KKT)
conditions met to round-off: ``v >= e_i``, ``(G G^T v)_t >= 0`` for every t (the projection is in the
dual cone) and ``(v - e_i)_t (G G^T v)_t = 0``. (A fixed number of coordinate-descent sweeps, which
this replaced, could stop far from the answer for nearly opposed rows and return a direction that
increases a task's loss.)

Degenerate input: a zero row imposes no constraint and projects to 0 (b = 0 above gives no
correction); exactly opposed gradients both project to 0, so d = 0; identical gradients give d = g;
all-zero input gives d = 0. Non-finite input propagates (the trainer skips the step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.qp import nonneg_qp

UPGRAD_TOL = 1e-12  # a constraint counts as violated below -tol * max_t ||g_t||^2 * max(1, sum |v|)


def box_qp(q: np.ndarray, lower: np.ndarray, tol: float = UPGRAD_TOL) -> np.ndarray:
    """argmin_{v >= lower} v^T q v for a PSD float64 q: v = lower + the non-negative QP's solution."""
    lower = lower.astype(np.float64)
    return lower + nonneg_qp(q, q @ lower, tol)


@torch.no_grad()
def dual_cone_weights(gram: Tensor, lower: np.ndarray) -> Tensor:
    """The v >= ``lower`` with the least ``v^T M v`` (M: the Gram matrix ``grads @ grads.T``, symmetrised), for a (K,)
    ``lower`` or for each row of an (R, K) one: ``v @ grads`` is the projection of ``lower @ grads`` onto the dual cone
    of the rows (UPGrad's rows e_i, DualProj's mean 1/K). ``lower`` itself where the Gram matrix is not finite."""
    m = gram_numpy(gram)
    if m is None:
        return like_gram(lower, gram)
    m = (m + m.T) / 2
    v = np.stack([box_qp(m, row) for row in lower]) if lower.ndim == 2 else box_qp(m, lower)
    return like_gram(v, gram)


@torch.no_grad()
def upgrad_projections(gram: Tensor) -> Tensor:
    """(K, K) V with the projections of the rows onto the dual cone given by ``V @ grads``."""
    k = gram.shape[0]
    if k == 2:
        a, b, c = gram[0, 0], gram[1, 1], gram[0, 1]
        v12 = torch.where((c < 0) & (b > 0), -c / torch.where(b > 0, b, 1.0), 0.0)
        v21 = torch.where((c < 0) & (a > 0), -c / torch.where(a > 0, a, 1.0), 0.0)
        one = torch.ones((), dtype=gram.dtype, device=gram.device)
        return torch.stack([torch.stack([one, v12]), torch.stack([v21, one])])
    return dual_cone_weights(gram, np.eye(k))


def upgrad_weights(gram: Tensor) -> Tensor:
    """(K,) alpha with ``upgrad(grads) == alpha @ grads``: the mean of the projection weights."""
    return upgrad_projections(gram).mean(0)


@torch.no_grad()
def upgrad(grads: Tensor, losses: Tensor | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) mean of their projections onto the dual cone of the rows."""
    return apply_weights(upgrad_weights(gram_matrix(grads)), grads)


class UPGrad(GramWeighting):
    name = "upgrad"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)

    def weights_from_gram(self, gram, losses, dtype):
        return upgrad_weights(gram)
