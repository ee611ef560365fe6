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

Steps that hold only some tasks S (multi-input, docs/multi-input.md), defined so that FAMO over K tasks of which
only S ever appear is FAMO over S: the step's weights are ``z_S = softmax(xi_S)`` and ``c = (sum_{i in S} z_i /
L_i^prev)^-1``, where L_i^prev is task i's loss at the last step that held it (c = 1 while a task of S has none).
After the step, the update runs over U, the tasks of S observed before: ``delta_i = log L_i^prev - log L_i`` for i
in U (its loss now against its last observation, however many steps ago), the direction ``J_softmax(xi_U)^T
delta_U + gamma xi_U``, and one Adam step on xi_U with per-task step counts (each task's moments and bias
correction move only in the steps that update it). An absent task's logit, moments, step count and last loss do
not change. With every task in every step this is the update above, exactly. ``weights()`` reports z_S (an absent
task's exp(xi_t) on the same scale: its share against the present ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtl.parallel.dist import all_reduce_mean
from mtl.weighting.base import LossWeighting
from mtl.weighting.checks import above, at_least

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
    gamma: float = at_least(FAMO_GAMMA, 0)  # weight decay (L2) on the task logits (the paper's gamma)
    lr: float = above(FAMO_LR, 0)  # Adam learning rate of the task logits (the paper's beta)


class FAMO(LossWeighting):
    name = "famo"
    Options = FAMOOptions
    updates_from_present_tasks = True  # the present tasks' softmax and update only (module docstring)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("logits", torch.zeros(k))
        self.register_buffer("adam_m", torch.zeros(k))
        self.register_buffer("adam_v", torch.zeros(k))
        self.adam_t = [0] * k  # per task: the Adam steps that moved its logit
        self.prev_losses: list[float | None] = [None] * k  # per task: its loss at the last step that held it
        self._index = {t: i for i, t in enumerate(self.tasks)}
        self._coef: dict[str, torch.Tensor] | None = None

    def _coefficients(self) -> dict[str, torch.Tensor]:
        """c * z_S per present task, the coefficient of log(L_t + eps) in its term (cached for the step)."""
        if self._coef is None or next(iter(self._coef.values())).device != self.logits.device:
            idx = self.present_index
            z = torch.softmax(self.logits[idx], dim=0)
            prev = [self.prev_losses[i] for i in idx]
            if any(x is None for x in prev):
                c = torch.ones((), device=z.device)
            else:
                c = famo_scale(z, torch.tensor(prev, device=z.device, dtype=z.dtype))
            self._coef = dict(zip(self.present, (c * z).detach()))
        return self._coef

    def begin_step(self, step, present=None):
        super().begin_step(step, present)
        self._coef = None

    def weigh(self, task, loss):
        coef = self._coefficients()[task]
        # the gradient of coef * log(L_global): the rank's loss over the rank-averaged value (see gls.py)
        return coef * loss / (all_reduce_mean(loss.detach()) + FAMO_EPS)

    def weights(self):
        """z: the softmax over the present tasks' logits, and an absent task's logit on the same scale,
        exp(xi_t) / sum_{s present} exp(xi_s) (with every task present: softmax(xi))."""
        idx = self.present_index
        z = torch.exp(self.logits - torch.logsumexp(self.logits[idx], dim=0))
        z[idx] = torch.softmax(self.logits[idx], dim=0)  # the step's z to the last bit
        return dict(zip(self.tasks, z.tolist()))

    @torch.no_grad()
    def end_step(self, losses):
        seen = [t for t in self.tasks if t in losses]
        upd = [self._index[t] for t in seen if self.prev_losses[self._index[t]] is not None]
        if upd:
            dev = self.logits.device
            before = torch.tensor([self.prev_losses[i] for i in upd], device=dev)
            after = torch.tensor([float(losses[self.tasks[i]]) for i in upd], device=dev)
            delta = torch.log(before + FAMO_EPS) - torch.log(after + FAMO_EPS)
            xi = self.logits[upd]
            g = famo_logit_grad(xi, delta) + self.options.gamma * xi
            b1, b2 = _BETAS
            for i in upd:
                self.adam_t[i] += 1
            m = self.adam_m[upd] * b1 + (1 - b1) * g
            v = self.adam_v[upd] * b2 + (1 - b2) * g * g
            self.adam_m[upd], self.adam_v[upd] = m, v
            m_hat = m / torch.tensor([1 - b1 ** self.adam_t[i] for i in upd], device=dev, dtype=xi.dtype)
            v_hat = v / torch.tensor([1 - b2 ** self.adam_t[i] for i in upd], device=dev, dtype=xi.dtype)
            self.logits[upd] = xi - self.options.lr * m_hat / (v_hat.sqrt() + _ADAM_EPS)
        for t in seen:
            self.prev_losses[self._index[t]] = float(losses[t])
        self._coef = None

    def get_extra_state(self):
        return {"adam_t": list(self.adam_t), "prev_losses": list(self.prev_losses)}

    def set_extra_state(self, state):
        k, t, prev = len(self.tasks), state["adam_t"], state["prev_losses"]
        self.adam_t = [int(t)] * k if isinstance(t, int) else [int(x) for x in t]  # an int: before per-task counts
        self.prev_losses = [None] * k if prev is None else [None if x is None else float(x) for x in prev]
        self._coef = None
