"""Uncertainty weighting (Kendall et al. 2018, "Multi-Task Learning Using Uncertainty to Weigh Losses").

One learned log-variance per task, s_t = log sigma_t^2 (an nn.Parameter, initially 0)::

    term_t = 0.5 * exp(-s_t) * L_t + 0.5 * s_t

This is the paper's Gaussian-likelihood (regression) form, 1/(2 sigma^2) L + log sigma, applied to
every task, as in LibMTL; the paper's classification form (1/sigma^2 L + log sigma) is not used.
``weights()`` reports the factor on the loss, 0.5 * exp(-s_t). d term_t / d s_t = 0.5 - 0.5 exp(-s_t) L_t,
so s_t settles at log L_t.

The parameters go into the trainer's optimizer (ndim < 2: no weight decay), at the model's learning rate, or in a
param group of their own at ``weighting.options.lr`` when it is set (> 0): Nash-MTL's code trains them at 0.025
(its ``--method-params-lr``, a second Adam param group; the plateau schedule scales both groups). They are not
part of the DDP model, so their gradients, computed from each rank's own losses, must be averaged across ranks by
the trainer before the optimizer step (otherwise the ranks' s drift apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.weighting.base import LossWeighting
from mtl.weighting.checks import at_least


@dataclass
class UWOptions:
    # the learning rate of the log-variances, their own optimizer param group (Nash-MTL's QM9 code: 0.025); 0: the
    # model's optim.lr, in the model's group
    lr: float = at_least(0.0, 0, "0: the model's optim.lr")


class UW(LossWeighting):
    name = "uw"
    Options = UWOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.params_lr = float(self.options.lr)  # read by mtl.setup.build.build_optimizer (0: the model's group)
        self.log_vars = nn.Parameter(torch.zeros(len(self.tasks)))
        self._index = {t: i for i, t in enumerate(self.tasks)}

    def weigh(self, task, loss):
        s = self.log_vars[self._index[task]]
        return 0.5 * torch.exp(-s) * loss + 0.5 * s

    def weights(self):
        return dict(zip(self.tasks, (0.5 * torch.exp(-self.log_vars.detach())).tolist()))
