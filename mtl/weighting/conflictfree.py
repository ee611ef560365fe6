"""ConFIG, conflict-free inverse gradients (Liu et al. 2024, "ConFIG: Towards Conflict-free Training of
Physics Informed Neural Networks", Eq. 2; TorchJD's ``ConFIG``).

The update has the same positive cosine with every task gradient, and its length is the sum of the
gradients' projections on it::

    u_t = g_t / ||g_t||                                  (unit gradients, the rows of U)
    x   = U^+ 1                                          (the least-norm x with u_t . x = 1 for every t)
    d   = (sum_t g_t . x^) x^,        x^ = x / ||x||

so ``cos(d, g_t) = 1 / (||x|| ... )`` is the same for every task (u_t . x^ = 1/||x||) and positive:
no task's loss rises to first order. When the equations ``u_t . x = 1`` have no exact solution (more
tasks than independent directions, e.g. opposed gradients) x is the least-squares one, as in the
authors' code (``torch.linalg.pinv``).

In the Gram matrix: ``U^+ 1 = U^T (U U^T)^+ 1 = U^T a`` with ``a = C^+ 1`` and C the cosine matrix
(``C_ij = M_ij / (||g_i|| ||g_j||)``), so ``x = sum_t (a_t / ||g_t||) g_t``, ``||x||^2 = a^T C a`` and
``sum_t g_t . x = 1^T M b`` with ``b = a / ||g||``: ``d = (1^T M b / ||x||^2) b^T G``. C's pseudo-inverse
drops eigenvalues at most ``rtol * lambda_max`` (rtol = K * the rows' machine epsilon, as in
``alignedmtl``); computed in float64 on the CPU.

Degenerate input: zero rows have no direction: they are left out of U (weight 0), as the authors'
``nan_to_num`` does; exactly opposed rows give x = 0 and d = 0; identical rows give d = K g (the sum);
all-zero input gives d = 0. Non-finite input gives w = 1 (the trainer skips the step). The authors'
preference weights (the right-hand side 1) are not an option here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.alignedmtl import default_rtol
from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.qp import kept_eigh


@torch.no_grad()
def config_weights(gram: Tensor, rtol: float | None = None) -> Tensor:
    """(K,) w with ``config(grads) == w @ grads`` for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.ones(k), gram)
    rtol = default_rtol(k, torch.float64) if rtol is None else rtol
    m = (m + m.T) / 2
    sq = np.diag(m).copy()
    w = np.zeros(k)
    active = np.nonzero(sq > 1e-12 * max(float(sq.max()), 0.0))[0]
    if len(active):
        sub = m[np.ix_(active, active)]
        n = np.sqrt(np.diag(sub))
        c = sub / np.outer(n, n)
        lam, vec = kept_eigh(c, rtol)
        a = (vec / lam) @ (vec.T @ np.ones(len(active)))  # C^+ 1
        x_sq = float(a @ c @ a)
        if x_sq > 0:
            b = a / n
            w[active] = float(np.ones(len(active)) @ sub @ b) / x_sq * b
    return like_gram(w, gram)


@torch.no_grad()
def config(grads: Tensor, losses: Tensor | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) the ConFIG update."""
    return apply_weights(config_weights(gram_matrix(grads), default_rtol(grads.shape[0], grads.dtype)), grads)


class ConFIG(GramWeighting):
    name = "config"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)

    def weights_from_gram(self, gram, losses, dtype):
        return config_weights(gram, default_rtol(gram.shape[0], dtype))
