"""MoDo, multi-objective gradient with double sampling (Chen et al. 2023, "Three-Way Trade-Off in Multi-Objective
Learning: Optimization, Generalization and Conflict-Avoidance").

MGDA's weights found by one projected-gradient step per training step instead of a full solve, with a ridge::

    lambda(k+1) = Proj_simplex( lambda(k) - gamma (G1 G2^T lambda(k) + rho lambda(k)) ),     lambda(0) = 1/K
    d(k)        = G3^T lambda(k+1)

where the paper's G1, G2, G3 are the task gradients of three independent mini-batches (double sampling for an
unbiased estimate of G G^T lambda, a third batch for the update), as LibMTL's implementation draws them.

**One batch here.** A step of this framework has one batch, so G1 = G2 = G3 = G, this step's (rank-averaged)
task gradients: ``lambda <- Proj(lambda - gamma (G G^T + rho I) lambda)``, ``d = G^T lambda``. That is the
paper's algorithm with the same sample three times (its deterministic form), not double sampling: the bias of
``G G^T`` as an estimate of the expected Gram matrix is not removed. In exchange it is a function of the K x K
Gram matrix and the state lambda, so it costs a K-vector step and runs with either gradient source. Over
steps with a fixed G (and gamma below 2 / the largest eigenvalue of G G^T + rho I) lambda converges to the
min-norm point of MGDA with the ridge rho (``mgda_weights(G G^T + rho I)``; tested).

``weighting.options``: ``gamma`` = 1e-3 (lambda's step) and ``rho`` = 0.1 (the ridge), LibMTL's defaults. gamma
multiplies the raw Gram matrix, so its useful size depends on the gradients' scale (as in the paper).

State: lambda (a K-vector buffer, in ``state_dict()``). ``weights()`` reports lambda(k+1), the update's
coefficients. Degenerate input: zero rows give lambda -> (1 - gamma rho) lambda, re-projected; a non-finite
Gram matrix leaves lambda unchanged (the update is then non-finite and the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import SimplexGramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.cagrad import project_simplex
from mtl.weighting.checks import above, at_least

MODO_GAMMA = 1e-3
MODO_RHO = 0.1


def modo_step(m: np.ndarray, lambd: np.ndarray, gamma: float = MODO_GAMMA, rho: float = MODO_RHO) -> np.ndarray:
    """One step: Proj_simplex(lambda - gamma (m lambda + rho lambda)) for the (K, K) float64 Gram matrix m."""
    return project_simplex(lambd - gamma * (m @ lambd + rho * lambd))


@torch.no_grad()
def modo_weights(gram: Tensor, lambd: Tensor | None = None, gamma: float = MODO_GAMMA, rho: float = MODO_RHO) -> Tensor:
    """(K,) lambda(k+1) from the Gram matrix and lambda(k) (1/K when None); lambda(k) itself if gram is not finite."""
    k = gram.shape[0]
    start = np.full(k, 1.0 / k) if lambd is None else lambd.detach().cpu().double().numpy()
    m = gram_numpy(gram)
    return like_gram(start if m is None else modo_step(m, start, gamma, rho), gram)


@torch.no_grad()
def modo(grads: Tensor, losses: Tensor | None = None, *, lambd: Tensor | None = None, gamma: float = MODO_GAMMA,
         rho: float = MODO_RHO) -> Tensor:
    """(K, P) task gradients -> (P,) the single-batch MoDo update ``G^T lambda(k+1)`` (from 1/K when lambd is None)."""
    return apply_weights(modo_weights(gram_matrix(grads), lambd, gamma, rho), grads)


@dataclass
class MoDoOptions:
    gamma: float = above(MODO_GAMMA, 0)  # step size of the weights lambda (the paper's gamma; LibMTL's MoDo_gamma)
    rho: float = at_least(MODO_RHO, 0)  # ridge on lambda's update (LibMTL's MoDo_rho)


class MoDo(SimplexGramWeighting):
    name = "modo"
    Options = MoDoOptions
    state_name = "lambd"  # multi-input steps: MoDo over the present tasks (SimplexGramWeighting)

    def simplex_step(self, gram, lambd):
        new = modo_weights(gram, lambd, self.options.gamma, self.options.rho)
        return new, new  # the update's coefficients are lambda(k+1) itself
