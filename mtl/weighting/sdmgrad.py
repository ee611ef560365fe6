"""SDMGrad, stochastic direction-oriented multi-objective gradient descent (Xiao et al. 2023, "Direction-oriented
Multi-objective Learning: Simple and Provable Stochastic Algorithms").

The update stays close to the mean gradient g0 while improving the worst task, through a regularised MGDA
subproblem on the simplex::

    w*  = argmin_{w in simplex}  1/2 ||G^T w||^2 + lamda <G^T w, g0>,          g0 = (1/K) sum_t g_t
    d   = (G^T w* + lamda g0) / (1 + lamda)

solved approximately: ``niter`` steps of projected SGD (step 5, momentum 0.5, the momentum restarted every
training step) on the Gram matrix divided by s^2, s the mean gradient norm, warm-started from the previous
step's w (the authors' code and LibMTL's; the division makes the step 5 scale-free; their code adds 1e-8 to
s^2, which we leave out so that tiny gradients are not frozen). ``weighting.options``: ``lamda`` = 0.3 and
``niter`` = 20, LibMTL's defaults. lamda -> infinity gives the mean gradient; lamda = 0 makes the subproblem
MGDA's. Note, kept as the authors have it: with step 5 the inner iteration is unstable around an interior
optimum whose curvature along the simplex exceeds 2/5 (two orthogonal gradients of norms 1 and 2 give 2.2), so
there w does not settle at the optimum but at a vertex (tested); the optimum is still a fixed point of each
projected step.

**One batch here.** The paper estimates the subproblem's gradient G G^T w with two independent mini-batches
(xi_1, xi_2: double sampling, unbiased) and forms d from a third (zeta); LibMTL's implementation draws those
three batches per step. A step of this framework has one batch, so the three coincide: w comes from this step's
Gram matrix G G^T and d from this step's G, the paper's algorithm with the same sample three times (its
deterministic form), not double sampling. In exchange it is a function of the K x K Gram matrix and the state
w, a K x K problem per step, and runs with either gradient source.

State: w (a K-vector buffer, in ``state_dict()``). ``weights()`` reports the update's coefficients
``(w + lamda / K) / (1 + lamda)``. Degenerate input: an all-zero Gram matrix leaves w unchanged (d = 0); a
non-finite one leaves w unchanged (the update is then non-finite and the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import SimplexGramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.cagrad import project_simplex
from mtl.weighting.checks import at_least

SDMGRAD_LAMDA = 0.3
SDMGRAD_NITER = 20
SDMGRAD_LR = 5.0  # the inner projected SGD's step and momentum (the authors' code)
SDMGRAD_MOMENTUM = 0.5


def sdmgrad_solve(m: np.ndarray, w: np.ndarray, lamda: float = SDMGRAD_LAMDA, niter: int = SDMGRAD_NITER,
                  lr: float = SDMGRAD_LR, momentum: float = SDMGRAD_MOMENTUM) -> np.ndarray:
    """``niter`` projected heavy-ball steps from w on 1/2 w^T M w + lamda w^T M 1/K, M = m / s^2 (s: mean ||g_t||)."""
    s = float(np.mean(np.sqrt(np.clip(np.diag(m), 0.0, None))))
    if s <= 0:
        return w
    mm = m / (s * s)
    pull = lamda * mm.mean(axis=1)  # the gradient of lamda <G^T w, g0>
    buf = None
    for _ in range(niter):
        grad = mm @ w + pull
        buf = grad if buf is None else momentum * buf + grad  # torch.optim.SGD's momentum (no dampening)
        w = project_simplex(w - lr * buf)
    return w


@torch.no_grad()
def sdmgrad_weights(gram: Tensor, w: Tensor | None = None, lamda: float = SDMGRAD_LAMDA,
                    niter: int = SDMGRAD_NITER) -> tuple[Tensor, Tensor]:
    """(coefficients (w' + lamda/K) / (1 + lamda), the new w') for the Gram matrix, from w (1/K when None)."""
    k = gram.shape[0]
    start = np.full(k, 1.0 / k) if w is None else w.detach().cpu().double().numpy()
    m = gram_numpy(gram)
    new = start if m is None else sdmgrad_solve(m, start, lamda, niter)
    return like_gram((new + lamda / k) / (1.0 + lamda), gram), like_gram(new, gram)


@torch.no_grad()
def sdmgrad(grads: Tensor, losses: Tensor | None = None, *, w: Tensor | None = None, lamda: float = SDMGRAD_LAMDA,
            niter: int = SDMGRAD_NITER) -> Tensor:
    """(K, P) task gradients -> (P,) the single-batch SDMGrad update (w warm-started from 1/K when None)."""
    return apply_weights(sdmgrad_weights(gram_matrix(grads), w, lamda, niter)[0], grads)


@dataclass
class SDMGradOptions:
    lamda: float = at_least(SDMGRAD_LAMDA, 0)  # pull towards the mean gradient (the paper's lambda; LibMTL's SDMGrad_lamda)
    niter: int = at_least(SDMGRAD_NITER, 1)  # projected-SGD steps on the weights per training step (LibMTL's SDMGrad_niter)


class SDMGrad(SimplexGramWeighting):
    name = "sdmgrad"
    Options = SDMGradOptions
    state_name = "w"  # multi-input steps: SDMGrad over the present tasks, warm-started from their part of w

    def simplex_step(self, gram, w):
        return sdmgrad_weights(gram, w, self.options.lamda, self.options.niter)
