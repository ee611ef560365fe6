"""Auto-Lambda (Liu, Johns & Davison 2022, "Auto-Lambda: Disentangling Dynamic Task Relationships").

The task weights lambda (K,) are meta-learned: the training objective is ``L_tr(theta, lambda) = sum_i
lambda_i L_i(theta)`` on the training batch, and lambda moves to lower the held-out loss of the primary tasks P
(every task, the paper's multi-task setting, unless ``weighting.options.primary`` names some) after one virtual
gradient step of the model::

    theta'   = theta - alpha grad_theta L_tr(theta, lambda)              (alpha: the optimizer's current lr)
    L_val    = sum_{j in P} L_j^val(theta')                               (on the held-out batch)
    dL_val/dlambda_i = -alpha grad_theta L_i(theta) . v,     v = grad_theta' L_val(theta')

(one-step unrolled differentiation; ``grad_theta L_tr`` is linear in lambda with coefficient ``grad L_i``). The
Hessian-vector product ``grad L_i(theta) . v`` is approximated by central differences, as in DARTS (Liu et al.
2019) and the paper::

    h_i = -alpha (L_i(theta + eps v) - L_i(theta - eps v)) / (2 eps),     eps = fd_eps / ||v||

on the same training batch (its error is O(eps^2); ``autolambda_hypergradient``). lambda then takes one Adam step
(lr ``weighting.options.lr`` = 1e-4, betas (0.9, 0.999)) along h, every ``update_every`` steps, and starts at
``init`` = 0.1 for every task: the defaults of the paper's code. lambda is not projected (the paper's code does not
constrain it). The real step then minimises ``sum_i lambda_i L_i`` with the new lambda.

Differences from the paper's code, stated: the virtual step is a plain gradient step of size alpha = the
optimizer's current learning rate over every trainable parameter (the paper's code replays its SGD optimizer's
momentum and weight decay, which have no counterpart under AdamW); fd_eps = 0.01 is DARTS' and the paper's.

Cost of one meta update (``meta_cost``): 4 forwards and 2 backward passes over the whole model (training batch
at theta, held-out batch at theta', training batch at theta +- eps v), on top of the step's own; 2 all-reduces of
a whole-model gradient (g and v) and one of 2K loss values under DDP; about 4 whole-model-sized vectors held
(theta, g, theta', v) besides the forward graphs. With ``update_every = n`` the cost is paid on one step in n.

Exact under DDP (mtl/weighting/bilevel.py): g, v and the losses at theta +- eps v are rank-averaged, so lambda
is the same on every rank and equals a single process's on the global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from mtl.weighting.bilevel import LearnedLambda, MetaInputs, ModelVector, unrolled_hypergradients

AUTOL_INIT = 0.1  # lambda at the start, every task (the paper's code: weight_init=0.1)
AUTOL_LR = 1e-4  # Adam learning rate of lambda (the paper's code: autol_lr=1e-4)
AUTOL_FD_EPS = 0.01  # the finite-difference step, eps = fd_eps / ||v|| (DARTS, the paper's code)


def autolambda_hypergradient(task_losses: Callable[[Tensor], Tensor], meta_loss: Callable[[Tensor], Tensor],
                             theta: Tensor, lam: Tensor, alpha: float, fd_eps: float = AUTOL_FD_EPS,
                             mean: Callable[[Tensor], Tensor] = lambda t: t) -> tuple[Tensor, Tensor]:
    """(h, L_val): the finite-difference hypergradient dL_val/dlambda (K,) of the module docstring, and the held-out
    loss at theta'. ``task_losses(theta)`` -> (K,) training losses, ``meta_loss(theta)`` -> the scalar held-out
    loss, both this rank's share; ``mean`` averages over the ranks (identity in one process). A zero v (nothing
    to learn from the held-out batch) gives h = 0. (``unrolled_hypergradients`` with the one objective L_val.)"""
    h, values = unrolled_hypergradients(task_losses, lambda th: meta_loss(th).reshape(1), theta, lam, alpha, fd_eps,
                                        mean)
    return h[0], values[0]


@dataclass
class AutoLambdaOptions:
    init: float = AUTOL_INIT  # lambda of every task at the start
    lr: float = AUTOL_LR  # Adam learning rate of lambda
    update_every: int = 1  # a meta update every this many steps (1: every step, as in the paper)
    fd_eps: float = AUTOL_FD_EPS  # finite-difference step relative to ||v||
    primary: list[str] = field(default_factory=list)  # the tasks of the meta-objective; empty: every task


class AutoLambda(LearnedLambda):
    name = "autolambda"
    Options = AutoLambdaOptions
    meta_forwards = 4
    meta_backwards = 2
    meta_allreduces = 2
    meta_param_copies = 4

    def meta_step(self, meta: MetaInputs) -> dict:
        mv = ModelVector(meta.model)
        h, val = autolambda_hypergradient(
            lambda th: mv.losses(th, meta.batch, self.tasks),
            lambda th: mv.losses(th, meta.heldout, self.primary).sum(),
            mv.vector(), self.lam, float(meta.lr), float(self.options.fd_eps), meta.comm.all_reduce_mean)
        self.adam_step(h)
        return {"meta_heldout_loss": val.detach(), **{f"meta_hypergrad/{t}": h[i] for i, t in enumerate(self.tasks)}}
