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
PCGrad, so UPGrad = PCGrad / 2 for two tasks); computed with tensor ops on the device. K > 2: projected
coordinate descent (Gauss-Seidel with clipping at the bounds) on each QP, in float64 on the CPU; it is
exact after one sweep for K = 2 and converges linearly in general (stopped at ``UPGRAD_TOL``).

Degenerate input: a zero row imposes no constraint and projects to 0 (b = 0 above gives no
correction); exactly opposed gradients both project to 0, so d = 0; identical gradients give d = g;
all-zero input gives d = 0. Non-finite input propagates (the trainer skips the step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram

UPGRAD_MAX_SWEEPS = 2000  # coordinate-descent sweeps per QP (K > 2)
UPGRAD_TOL = 1e-14  # stop when no coordinate moves by more than this (relative to the largest)


def box_qp(q: np.ndarray, lower: np.ndarray, max_sweeps: int = UPGRAD_MAX_SWEEPS, tol: float = UPGRAD_TOL):
    """argmin_{v >= lower} v^T q v for a PSD float64 q, by projected coordinate descent from v = lower."""
    v = lower.astype(np.float64).copy()
    diag = np.diag(q)
    for _ in range(max_sweeps):
        moved = 0.0
        for j in range(len(v)):
            if diag[j] <= 0:
                continue  # a zero row: the objective does not depend on v_j; keep the bound
            new = max(lower[j], v[j] - float(q[j] @ v) / diag[j])
            moved = max(moved, abs(new - v[j]))
            v[j] = new
        if moved <= tol * max(1.0, float(np.abs(v).max())):
            break
    return v


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
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.eye(k), gram)
    m = (m + m.T) / 2
    rows = [box_qp(m, np.eye(k)[i]) for i in range(k)]
    return like_gram(np.stack(rows), gram)


def upgrad_weights(gram: Tensor) -> Tensor:
    """(K,) alpha with ``upgrad(grads) == alpha @ grads``: the mean of the projection weights."""
    return upgrad_projections(gram).mean(0)


@torch.no_grad()
def upgrad(grads: Tensor, losses: Tensor | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) mean of their projections onto the dual cone of the rows."""
    return apply_weights(upgrad_weights(gram_matrix(grads)), grads)


class UPGrad(GramWeighting):
    name = "upgrad"

    def weights_from_gram(self, gram, losses, dtype):
        return upgrad_weights(gram)
