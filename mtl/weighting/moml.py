"""MOML (Ye et al. 2021, "Multi-Objective Meta Learning"), for task weighting.

Multi-task learning as a multi-objective bilevel problem: the upper level minimises the held-out loss of EVERY
task as a separate objective, ``F_m(alpha) = L_m^val(theta*(alpha))`` for m in P (every task unless
``weighting.options.primary`` names some), over the task weights alpha (K,); the lower level trains the model on
``sum_k alpha_k L_k(theta)``. MOML approximates theta*(alpha) by unrolling the lower level and updates alpha along
the multiple-gradient-descent (MGDA) direction of the M hypergradients, the min-norm point of their convex hull::

    H_mk   = d F_m / d alpha_k       (one step unrolled: theta' = theta - lr grad_theta sum_k alpha_k L_k(theta))
           = -lr grad L_k(theta) . v_m,   v_m = grad L_m^val(theta')
           ~ -lr (L_k(theta + eps_m v_m) - L_k(theta - eps_m v_m)) / (2 eps_m),  eps_m = fd_eps / ||v_m||
    gamma  = argmin_{gamma in simplex} || gamma^T H ||^2         (mgda_weights of the M x M Gram matrix H H^T)
    alpha <- Adam step along d = gamma^T H

(``unrolled_hypergradients`` in mtl/weighting/bilevel.py; the MGDA solver is mtl/weighting/mgda.py's). The real
step then minimises ``sum_k alpha_k L_k`` with the new alpha. With one objective (M = 1) d is that objective's
hypergradient, which is Auto-Lambda's update.

Choices, stated (the paper leaves them to the application): one unrolled step (the paper allows T; its MTL
experiments use one), of size lr = the optimizer's current learning rate, with the Hessian-vector products by
central differences (the paper differentiates through the unrolled step exactly; on quadratics the two agree to
rounding, ``tests/test_bilevel.py``); alpha starts at ``init`` = 1 (the ``equal`` weighting), moves by Adam with
``lr`` = 1e-4 (Auto-Lambda's), unprojected, every ``update_every`` = 1 steps.

Cost of one meta update, M = |P| objectives (``meta_cost``): 2 + 2M forwards and 1 + M backward passes over the
whole model; 1 + M whole-model all-reduces (g and the v_m, the latter in one collective) and one of 2MK numbers;
about 3 + M parameter-sized vectors held. Exact under DDP as Auto-Lambda (mtl/weighting/bilevel.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtl.weighting.bilevel import LearnedLambda, MetaInputs, ModelVector, unrolled_hypergradients
from mtl.weighting.mgda import mgda_weights

MOML_INIT = 1.0  # alpha at the start: equal weights
MOML_LR = 1e-4  # Adam learning rate of alpha
MOML_FD_EPS = 0.01


def moml_direction(hypergrads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, gamma): MGDA's min-norm combination ``d = gamma^T H`` of the rows of ``hypergrads`` (M, K)."""
    gamma = mgda_weights(hypergrads.double() @ hypergrads.double().T).to(hypergrads.dtype)
    return gamma @ hypergrads, gamma


@dataclass
class MOMLOptions:
    init: float = MOML_INIT  # alpha of every task at the start
    lr: float = MOML_LR  # Adam learning rate of alpha
    update_every: int = 1  # a meta update every this many steps
    fd_eps: float = MOML_FD_EPS  # finite-difference step relative to ||v_m||
    primary: list[str] = field(default_factory=list)  # the upper level's objectives; empty: every task


class MOML(LearnedLambda):
    name = "moml"
    Options = MOMLOptions

    @classmethod
    def meta_cost(cls, num_tasks: int) -> dict:  # M = num_tasks objectives (fewer with ``primary``)
        return {"meta_forwards": 2 + 2 * num_tasks, "meta_backwards": 1 + num_tasks,
                "meta_allreduces": 1 + num_tasks, "meta_param_copies": 3 + num_tasks}

    def meta_step(self, meta: MetaInputs) -> dict:
        mv = ModelVector(meta.model)
        hyper, values = unrolled_hypergradients(
            lambda th: mv.losses(th, meta.batch, self.tasks), lambda th: mv.losses(th, meta.heldout, self.primary),
            mv.vector(), self.lam, float(meta.lr), float(self.options.fd_eps), meta.comm.all_reduce_mean)
        stats = {f"meta_heldout_loss/{t}": values[i] for i, t in enumerate(self.primary)}
        if bool(torch.isfinite(hyper).all()):  # the same decision on every rank: H is rank-averaged
            d, gamma = moml_direction(hyper)
            stats.update({f"meta_gamma/{t}": gamma[i] for i, t in enumerate(self.primary)})
            self.adam_step(d)
        return stats
