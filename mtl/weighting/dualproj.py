"""DualProj (TorchJD, after Lopez-Paz & Ranzato 2017, "Gradient Episodic Memory", Eq. 11): the mean
gradient projected onto the dual cone of the task gradients.

    d = argmin_x ||x - g_bar||^2   s.t.  g_t . x >= 0 for every task t,      g_bar = (1/K) sum_t g_t

so d never increases a task's loss to first order, and d = g_bar whenever g_bar already has that
property (no conflict with the mean). Its dual is a K-dim QP on the Gram matrix M = G G^T (the same as
UPGrad's, for the preference vector 1/K instead of e_i)::

    d = G^T v,    v = argmin_{v >= 1/K} v^T M v

(Lagrange: x = g_bar + G^T u with u >= 0, u_t (g_t . x) = 0; v = 1/K + u). UPGrad averages the
projections of the K rows; DualProj projects their mean once. Solved exactly by the active-set NNLS
of ``mtl/weighting/qp.py`` in float64 on the CPU; TorchJD instead adds a 1e-4 ridge to a normalised
Gram matrix before its quadprog call, which moves its answer by ~1e-4.

KKT conditions (tested): ``v >= 1/K``, ``(M v)_t >= 0`` for every t, ``(v - 1/K)_t (M v)_t = 0``.

Degenerate input: a zero row imposes no constraint; exactly opposed rows give d = 0; identical rows
give d = g; all-zero input gives d = 0. Non-finite input gives w = 1/K (the mean; the trainer skips
the step). No options (the preference vector is uniform).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix
from mtl.weighting.upgrad import dual_cone_weights


@torch.no_grad()
def dualproj_weights(gram: Tensor) -> Tensor:
    """(K,) v with ``dualproj(grads) == v @ grads`` for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    return dual_cone_weights(gram, np.full(k, 1.0 / k))


@torch.no_grad()
def dualproj(grads: Tensor, losses: Tensor | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) the mean gradient projected onto the dual cone of the rows."""
    return apply_weights(dualproj_weights(gram_matrix(grads)), grads)


class DualProj(GramWeighting):
    name = "dualproj"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)

    def weights_from_gram(self, gram, losses, dtype):
        return dualproj_weights(gram)
