"""IMTL-G (Liu et al. 2021, "Towards Impartial Multi-task Learning"), the gradient half of IMTL.

The update ``d = sum_t alpha_t g_t`` with ``sum_t alpha_t = 1`` has equal projections onto every task's
unit gradient u_t = g_t / ||g_t||: ``d . u_1 = d . u_t`` for all t. Closed form (rows t = 2..K)::

    D = [g_1 - g_t]_t,   U = [u_1 - u_t]_t,   alpha_{2..K} = g_1 U^T (D U^T)^{-1},   alpha_1 = 1 - sum alpha_{2..K}

Every product is a Gram entry (g_i . u_j = (GG^T)_ij / ||g_j||), so the (K-1) x (K-1) system is built
from the K x K Gram matrix and solved in float64 on the CPU by a pseudo-inverse whose cutoff is
``rcond * max_t ||g_t||`` (the entries of D U^T are in units of ||g||; where no singular value is below it,
the pseudo-inverse is the inverse and the system is solved by LU, a third of the SVD's cost at K = 40): ``IMTLG_RCOND`` for float64
gradients, ``IMTLG_RCOND_F32`` when the Gram matrix comes from lower-precision gradients.
The scale is that of a convex-like combination (alpha sums to 1, like the mean gradient). Only the
gradient half: IMTL-L (learned loss scales) and the hybrid are not part of this method.

Degenerate input:
- zero rows (||g_t||^2 <= 1e-12 max_s ||g_s||^2) have no direction u_t: they get alpha_t = 0 and the
  rule is applied to the others (one left: alpha = 1 for it); all-zero input gives d = 0.
- a singular D U^T (identical gradients: U = 0, any alpha satisfies the condition) is solved by the
  pseudo-inverse, which gives the minimum-norm alpha_{2..K} (identical rows: alpha = (1, 0, ...), d = g).
- exactly opposed gradients give alpha_1 ||g_1|| = alpha_2 ||g_2|| and d = 0 (equal projections 0).
- non-finite input gives alpha = 1/K (a non-finite update: the trainer skips the step).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram

IMTLG_RCOND = 1e-10  # singular values of D U^T below rcond * max ||g_t|| count as zero (float64 gradients)
IMTLG_RCOND_F32 = 1e-5  # the same for float32 (or lower) gradients: their Gram entries carry ~1e-7 noise


def default_rcond(dtype: torch.dtype) -> float:
    return IMTLG_RCOND if dtype == torch.float64 else IMTLG_RCOND_F32


@torch.no_grad()
def imtlg_weights(gram: Tensor, rcond: float = IMTLG_RCOND) -> Tensor:
    """(K,) alpha (summing to 1 over the non-zero rows) for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.full(k, 1.0 / k), gram)
    sq = np.diag(m).copy()
    alpha = np.zeros(k)
    active = np.nonzero(sq > 1e-12 * max(float(sq.max()), 0.0))[0]
    if len(active) == 1:
        alpha[active] = 1.0
    elif len(active) > 1:
        sub = m[np.ix_(active, active)]
        c = sub / np.sqrt(np.diag(sub))[None, :]  # c[i, j] = g_i . u_j
        g1_u = c[0, 0] - c[0, 1:]  # g_1 . (u_1 - u_t)
        du = c[0, 0] - c[0, 1:][None, :] - c[1:, 0][:, None] + c[1:, 1:]  # (g_1 - g_i) . (u_1 - u_j)
        cutoff = rcond * float(np.sqrt(sq[active].max()))
        if np.linalg.svd(du, compute_uv=False).min() > cutoff:  # no singular value cut: the inverse, by LU
            rest = np.linalg.solve(du.T, g1_u)
        else:
            u, s, vt = np.linalg.svd(du)
            keep = s > cutoff
            rest = g1_u @ ((vt[keep].T / s[keep]) @ u[:, keep].T)  # pseudo-inverse with an absolute cutoff
        alpha[active[1:]] = rest
        alpha[active[0]] = 1.0 - rest.sum()
    return like_gram(alpha, gram)


@torch.no_grad()
def imtlg(grads: Tensor, losses: Tensor | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) update with equal projections onto every unit task gradient."""
    return apply_weights(imtlg_weights(gram_matrix(grads), default_rcond(grads.dtype)), grads)


class IMTLG(GramWeighting):
    name = "imtlg"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)

    def weights_from_gram(self, gram, losses, dtype):
        return imtlg_weights(gram, default_rcond(dtype))
