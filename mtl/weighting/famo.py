"""FAMO (Liu et al. 2023, "FAMO: Fast Adaptive Multitask Optimization").

Task logits xi (K, initially 0), task weights z = softmax(xi). The paper's update direction is::

    d = sum_t c z_t grad L_t / L_t,        c = ( sum_i z_i / L_i )^-1

i.e. the gradient of ``c * sum_t z_t log L_t`` with c held constant. Per-task term (separable)::

    term_t = c * z_t * log(L_t + FAMO_EPS)           (z and c are constants for the backward pass)

c couples the tasks' *current* losses, which a per-task term may not read, so c is computed from the
previous step's rank-averaged losses (c = 1 at the first step). c only scales the whole update by a
common positive factor, so the direction is exactly the paper's. The paper's lower bounds L*_t are 0.

After the step, xi moves so that tasks whose log-loss fell *less* gain weight::

    delta_t = log L_t(before) - log L_t(after)
    xi <- Adam step on  J_softmax(xi)^T delta + gamma xi      (J^T delta = z * (delta - z . delta))

with ``weighting.options.lr`` = 0.025 and weight decay (L2 on xi) ``weighting.options.gamma`` = 1e-3,
Adam betas (0.9, 0.999), as in the paper and its code. Approximation: the paper evaluates L(after) with an extra
forward pass on the same batch after the update; we run none. "before" is step k-1's loss and "after"
is step k's loss (next batch, updated parameters), both rank-averaged as given to ``end_step``; so the
xi update is delayed by one step and sees batch-to-batch noise, at the cost of zero extra forwards.
Everything is computed from rank-averaged losses, so xi is identical on every rank with no
communication.

State: xi and the Adam moments are buffers (not nn.Parameters: the model's optimizer must not touch
xi), the Adam step count and the previous losses are extra state; all are in ``state_dict()``.
``weights()`` reports z (the paper's task weights; the loss multiplier is c z_t / L_t).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtl.dist import all_reduce_mean
from mtl.weighting.base import Weighting
from mtl.weighting.checks import option_range_errors

FAMO_LR = 0.025  # step size of the task logits
FAMO_GAMMA = 1e-3  # weight decay on the task logits
FAMO_EPS = 1e-8  # inside the logs
_BETAS, _ADAM_EPS = (0.9, 0.999), 1e-8


def famo_logit_grad(logits: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """J_softmax(logits)^T delta = z * (delta - z . delta), the paper's update direction for xi."""
    z = torch.softmax(logits, dim=0)
    return z * (delta - (z * delta).sum())


def famo_scale(z: torch.Tensor, losses: torch.Tensor, eps: float = FAMO_EPS) -> torch.Tensor:
    """c = (sum_i z_i / L_i)^-1."""
    return 1.0 / (z / (losses + eps)).sum()


@dataclass
class FAMOOptions:
    gamma: float = FAMO_GAMMA  # weight decay (L2) on the task logits (the paper's gamma)
    lr: float = FAMO_LR  # Adam learning rate of the task logits (the paper's beta)


class FAMO(Weighting):
    name = "famo"
    Options = FAMOOptions

    @classmethod
    def check(cls, cfg):
        return option_range_errors(cfg, {"gamma": (lambda v: v >= 0, "must be >= 0"),
                                         "lr": (lambda v: v > 0, "must be > 0")})

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("logits", torch.zeros(k))
        self.register_buffer("adam_m", torch.zeros(k))
        self.register_buffer("adam_v", torch.zeros(k))
        self.adam_t = 0
        self.prev_losses: list[float] | None = None
        self._index = {t: i for i, t in enumerate(self.tasks)}
        self._coef: torch.Tensor | None = None

    def _coefficients(self) -> torch.Tensor:
        """c * z, the coefficient of log(L_t + eps) in each term (cached until xi or c changes)."""
        if self._coef is None or self._coef.device != self.logits.device:
            z = torch.softmax(self.logits, dim=0)
            if self.prev_losses is None:
                c = torch.ones((), device=z.device)
            else:
                c = famo_scale(z, torch.tensor(self.prev_losses, device=z.device, dtype=z.dtype))
            self._coef = (c * z).detach()
        return self._coef

    def begin_step(self, step):
        self._coef = None

    def weigh(self, task, loss):
        coef = self._coefficients()[self._index[task]]
        # the gradient of coef * log(L_global): the rank's loss over the rank-averaged value (see gls.py)
        return coef * loss / (all_reduce_mean(loss.detach()) + FAMO_EPS)

    def weights(self):
        return dict(zip(self.tasks, torch.softmax(self.logits, dim=0).tolist()))

    @torch.no_grad()
    def end_step(self, losses):
        current = [float(losses[t]) for t in self.tasks]
        if self.prev_losses is not None:
            dev = self.logits.device
            before = torch.tensor(self.prev_losses, device=dev)
            after = torch.tensor(current, device=dev)
            delta = torch.log(before + FAMO_EPS) - torch.log(after + FAMO_EPS)
            g = famo_logit_grad(self.logits, delta) + self.options.gamma * self.logits
            b1, b2 = _BETAS
            self.adam_t += 1
            self.adam_m.mul_(b1).add_(g, alpha=1 - b1)
            self.adam_v.mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = self.adam_m / (1 - b1**self.adam_t)
            v_hat = self.adam_v / (1 - b2**self.adam_t)
            self.logits.sub_(self.options.lr * m_hat / (v_hat.sqrt() + _ADAM_EPS))
        self.prev_losses = current
        self._coef = None

    def get_extra_state(self):
        return {"adam_t": self.adam_t, "prev_losses": self.prev_losses}

    def set_extra_state(self, state):
        self.adam_t = int(state["adam_t"])
        self.prev_losses = None if state["prev_losses"] is None else [float(x) for x in state["prev_losses"]]
        self._coef = None
