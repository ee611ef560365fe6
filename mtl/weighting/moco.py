"""MoCo, multi-objective gradient correction (Fernando et al. 2023, "Mitigating Gradient Bias in Multi-objective
Learning: A Provably Convergent Approach").

MGDA's weights are biased when computed from stochastic gradients; MoCo tracks each task's gradient with a moving
average y_t and takes MGDA-like weights lambda of the tracked gradients, one step per training step::

    h_t(k)      = g_t(k) / ||g_t(k)|| * L_t(k)                  (the authors' normalisation; option normalize)
    y_t(k)      = y_t(k-1) - beta_k (y_t(k-1) - h_t(k)),          beta_k  = beta / k^beta_sigma,    y(0) = 0
    lambda(k)   = softmax( lambda(k-1) - gamma_k (Y Y^T + rho I) lambda(k-1) ),
                                                               gamma_k = gamma / k^gamma_sigma,  lambda(0) = 1/K
    d(k)        = Y(k)^T lambda(k)

(k counts the combinations from 1). This is the authors' shared code as LibMTL implements it: the paper's
Algorithm 1 tracks the raw stochastic gradients, projects y_t onto a ball and projects lambda's step onto the
simplex; the code normalises the gradients (scale h_t by the loss) and keeps lambda on the simplex with a
softmax of the stepped vector. ``weighting.options``: ``beta`` = 0.5, ``beta_sigma`` = 0.5, ``gamma`` = 0.1,
``gamma_sigma`` = 0.5, ``rho`` = 0 (LibMTL's defaults) and ``normalize`` = true (false: h_t = g_t, the paper's
raw gradients, without its ball projection).

Rows, not a Gram matrix: the update ``Y^T lambda`` is a combination of the *tracked* gradients (a K x P average
of earlier steps' rows), not of this step's rows, and Y Y^T needs the cross products of this step's rows with
the earlier average. A tracked K x K Gram matrix cannot give the update, so MoCo subclasses ``RowWeighting`` and
overrides ``combine``, like DB-MTL: it needs ``ddp.strategy=task_grads`` (``weighting.source: parameters``).
**Cost:** the K x P average Y is kept between steps (memory as much again as the task-gradient matrix G; a step
forms the new Y in its normalised targets, one K x P temporary) and is
saved in ``state_dict()`` (extra state, with k and lambda), so checkpoints grow by K x P numbers; a K x P update
and a K x K product per step, no solver.

DDP: the rows and losses ``combine`` receives are rank-averaged (the global batch's), so h, Y and lambda are
those of one process on the global batch, identical on every rank.

``weights()`` reports lambda (the coefficients on the tracked rows Y, not on this step's g_t). Degenerate
input: a zero row is normalised to zero (its norm is floored at 1e-8, as the authors' code); non-finite rows or
losses leave Y, lambda and k unchanged and give a non-finite update (the trainer skips the step). The losses
must be positive with ``normalize`` (h_t points along g_t only then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import RowWeighting, all_finite, kept_rows_refusal
from mtl.weighting.checks import at_least, ranged

MOCO_NORM_EPS = 1e-8


@torch.no_grad()
def moco_targets(grads: Tensor, losses: Tensor | None, normalize: bool = True) -> Tensor:
    """(K, P) h: each row scaled to the length of its loss (``normalize``) or the rows as they are."""
    if not normalize:
        return grads
    if losses is None:
        raise ValueError("moco with normalize=true needs the task losses (h_t = g_t / ||g_t|| * L_t)")
    return (grads / (grads.norm(dim=1, keepdim=True) + MOCO_NORM_EPS)).mul_(losses.to(grads)[:, None])


@torch.no_grad()
def moco_update(y: Tensor | None, lambd: Tensor, h: Tensor, beta: float, gamma: float, rho: float,
                out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One MoCo step with rates beta_k, gamma_k: (new Y, new lambda). ``y`` None is Y = 0. The new Y is
    ``y - beta (y - h)`` formed in ``out`` (a new tensor when None; ``h`` itself to spend no further K x P memory,
    which overwrites h); ``y`` is left as it is."""
    if y is None:
        y = torch.mul(h, beta) if out is None else torch.mul(h, beta, out=out)
    else:
        d = torch.sub(y, h) if out is None else torch.sub(y, h, out=out)  # y - h
        y = torch.sub(y, d.mul_(beta), out=d)  # y - beta (y - h)
    gram = (y @ y.T).to(lambd)
    k = lambd.numel()
    lam = torch.softmax(lambd - gamma * (gram + rho * torch.eye(k, dtype=lambd.dtype, device=lambd.device)) @ lambd, 0)
    return y, lam


@dataclass
class MoCoOptions:
    # rate of the gradient tracking y (LibMTL's MoCo_beta); at step k it is beta / k^beta_sigma
    beta: float = ranged(0.5, lambda v: 0 < v <= 1, "must be in (0, 1]")
    beta_sigma: float = at_least(0.5, 0)  # decay exponent of beta (LibMTL's MoCo_beta_sigma)
    gamma: float = at_least(0.1, 0)  # step of the weights lambda (LibMTL's MoCo_gamma); at step k gamma / k^gamma_sigma
    gamma_sigma: float = at_least(0.5, 0)  # decay exponent of gamma (LibMTL's MoCo_gamma_sigma)
    rho: float = at_least(0.0, 0)  # ridge on lambda's step (LibMTL's MoCo_rho)
    normalize: bool = True  # track g_t / ||g_t|| * L_t, as the authors' code (false: the raw gradients)


class MoCo(RowWeighting):
    name = "moco"
    absent_task_refusal = ("it tracks each task's gradient and lambda over every task with step-indexed rates; a present-only "
                           "update is not defined")
    fsdp2_refusal = kept_rows_refusal("K x P moving average of the task gradients")
    Options = MoCoOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("lambd", torch.full((k,), 1.0 / k, dtype=torch.float64))
        self.updates = 0  # combinations so far (k - 1)
        self.tracked: Tensor | None = None  # (K, P) Y, created at the first combination

    def weights(self):
        return dict(zip(self.tasks, self.lambd.tolist()))

    @torch.no_grad()
    def combine(self, grads, losses=None):
        o = self.options
        work = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
        h = moco_targets(work, None if losses is None else losses.to(work.device), o.normalize)
        step = self.updates + 1
        prev = None if self.tracked is None else self.tracked.to(device=work.device, dtype=work.dtype)
        # the new Y is formed in h where h is this step's own (normalised) tensor: Y and h are the only K x P state
        y, lam = moco_update(prev, self.lambd, h, o.beta / step ** o.beta_sigma, o.gamma / step ** o.gamma_sigma, o.rho,
                             out=None if h is grads else h)
        if all_finite(y) and all_finite(lam):  # a skipped step must not poison the state
            self.tracked, self.updates = y, step
            self.lambd.copy_(lam)
        return (lam.to(y) @ y).to(grads.dtype)

    def get_extra_state(self):
        return {"updates": self.updates, "tracked": self.tracked}

    def set_extra_state(self, state):
        self.updates = int(state["updates"])
        self.tracked = state["tracked"]
