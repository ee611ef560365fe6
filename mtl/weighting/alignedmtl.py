"""Aligned-MTL (Senushkin et al. 2023, "Independent Component Alignment for Multi-Task Learning").

The task gradients (rows of G, K x P) are replaced by an orthogonal set of equal norms: with the
eigendecomposition of the K x K Gram matrix ``G G^T = V diag(lambda) V^T`` (the SVD G = V S W^T,
lambda = S^2), keeping the R = rank eigenpairs::

    B     = sqrt(lambda_min) V diag(1/sqrt(lambda)) V^T        (lambda_min: the smallest kept eigenvalue)
    G_hat = B G = sigma_min V W^T                               (aligned gradients)
    d     = G_hat^T w = (B w) @ G,      w = 1 (equal task weights, as in the paper and LibMTL: a SUM)

so the aligned gradients satisfy the Gram condition ``G_hat G_hat^T = lambda_min I`` (on the span of
the gradients; with full rank exactly lambda_min I): they are orthogonal, all of norm sigma_min, the
smallest singular value of G (the "balance" of the paper). Equivalently ``G d = sqrt(lambda_min)
(GG^T)^{1/2} w``. The eigendecomposition is of the tiny K x K matrix, in float64 on the CPU (``small_eigh``:
scipy's, which stays on one thread; numpy's waited 16 ms a call at K = 40 while another process held a core).

Rank: eigenvalues at most ``rtol * lambda_max`` count as zero (rtol = K * machine epsilon of the
gradients' dtype, float32 for anything that is not float64, as in LibMTL); B is built from the kept
eigenpairs only. Consequences for degenerate input: identical gradients (rank 1) give d = K g (the sum),
exactly opposed gradients give d = 0, a zero row is ignored (d = the other rows aligned), all-zero input
gives d = 0. Non-finite input gives w (a non-finite update: the trainer skips the step). This is the
encoder-gradient variant (not Aligned-MTL-UB, which aligns representation gradients).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.qp import kept_eigh


def default_rtol(k: int, dtype: torch.dtype) -> float:
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return k * eps


@torch.no_grad()
def alignedmtl_balance(gram: Tensor, rtol: float | None = None) -> Tensor:
    """(K, K) B with aligned gradients ``B @ grads``, for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.eye(k), gram)
    rtol = default_rtol(k, torch.float64) if rtol is None else rtol
    lam, vec = kept_eigh((m + m.T) / 2, rtol)
    if not len(lam):  # no eigenvalue above 0
        return torch.zeros(k, k, dtype=gram.dtype, device=gram.device)
    b = np.sqrt(lam.min()) * (vec / np.sqrt(lam)[None, :]) @ vec.T
    return like_gram(b, gram)


def alignedmtl_weights(gram: Tensor, task_weights: Tensor | None = None, rtol: float | None = None) -> Tensor:
    """(K,) alpha = B w with ``alignedmtl(grads) == alpha @ grads``; w defaults to ones."""
    b = alignedmtl_balance(gram, rtol)
    w = torch.ones(gram.shape[0], dtype=b.dtype, device=b.device) if task_weights is None else task_weights
    return b @ w.to(b)


@torch.no_grad()
def alignedmtl(grads: Tensor, losses: Tensor | None = None, *, task_weights: Tensor | None = None,
               rtol: float | None = None) -> Tensor:
    """(K, P) task gradients -> (P,) sum of the aligned (orthogonal, equal-norm) gradients."""
    rtol = default_rtol(grads.shape[0], grads.dtype) if rtol is None else rtol
    return apply_weights(alignedmtl_weights(gram_matrix(grads), task_weights, rtol), grads)


class AlignedMTL(GramWeighting):
    name = "alignedmtl"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)

    def weights_from_gram(self, gram, losses, dtype):
        return alignedmtl_weights(gram, rtol=default_rtol(gram.shape[0], dtype))
