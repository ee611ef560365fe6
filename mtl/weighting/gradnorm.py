"""GradNorm (Chen et al. 2018, "GradNorm: Gradient Normalization for Adaptive Loss Balancing").

Learnable task weights w (initially 1, kept at sum_t w_t = K). The step's update is ``d = sum_t w_t g_t``
(the same scale as equal weighting). After combining, w is moved to balance the weighted gradient
norms::

    G_t     = w_t ||g_t||                         (norm of the weighted task gradient)
    L~_t    = L_t / L_t(0),    r_t = L~_t / mean(L~)    (relative inverse training rate)
    L_grad  = sum_t | G_t - mean(G) * r_t^alpha |       (the target mean(G) r_t^alpha held constant)
    dL_grad/dw_t = sign(G_t - target_t) * ||g_t||        (taken with torch.autograd.grad)

then one Adam step on w (learning rate ``weighting.options.lr`` = 0.025, betas (0.9, 0.999), as the
paper's optimiser), clamping at ``GRADNORM_MIN_WEIGHT``, and the paper's renormalisation
``w <- K w / sum(w)``. ``weighting.options.alpha`` = 1.5 (the paper's NYUv2 setting).

Where the norms come from: the paper takes ||g_t|| on the last shared layer; here they are the norms of
the rows of ``grads`` (the square roots of the Gram matrix's diagonal), i.e. over whatever shared
parameters the strategy hands to ``combine``. The rows are already averaged over ranks, so the norms
(and hence w) are identical on every rank with no extra all-reduce. The losses: L_t(0) is the first
step's rank-averaged loss and L_t is the latest rank-averaged loss given to ``end_step``, i.e. the
ratios lag the gradients by one step (this keeps w identical on every rank whatever ``losses`` the
caller passes to ``combine``); before the first ``end_step`` w is not updated. Steps with non-finite
norms do not update w (the trainer skips them).

Steps that hold only some tasks S (multi-input, docs/multi-input.md), defined so that GradNorm over K tasks of
which only S ever appear is GradNorm over S: the update is ``sum_{t in S} w_t g_t`` over the K' rows of S; then
only w_S moves, by the rule above over S alone (means over S; L_t(0) is task t's first observed loss and L_t its
latest, each from the steps that held it; no move until every task of S has both), one Adam step with per-task
step counts, the clamp, and ``w_S <- w_S * (K - sum of the absent tasks' w) / sum(w_S)``, so every weight keeps
its place and the sum of all K stays K. An absent task's weight, moments, step count and losses do not change.
``weights()`` reports w (an absent task's unchanged weight too).

w, the Adam moments and the per-task Adam step counts are buffers; L(0) and the latest losses are extra state:
all of it is in ``state_dict()``. w is not an nn.Parameter (it is not updated by the model's optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights
from mtl.weighting.checks import above, at_least

GRADNORM_ALPHA = 1.5  # asymmetry: how strongly slow tasks are pulled up
GRADNORM_LR = 0.025  # Adam learning rate of the task weights
GRADNORM_MIN_WEIGHT = 1e-3  # weights are clamped here before renormalising (they must stay > 0)
_BETAS, _EPS = (0.9, 0.999), 1e-8


def gradnorm_loss(weights: Tensor, norms: Tensor, initial_losses: Tensor, losses: Tensor,
                  alpha: float = GRADNORM_ALPHA) -> Tensor:
    """The GradNorm loss sum_t |w_t ||g_t|| - mean(G) r_t^alpha| (differentiable in ``weights``)."""
    g = weights * norms
    ratio = losses / initial_losses
    r = ratio / ratio.mean()
    target = (g.mean() * r.pow(alpha)).detach()
    return (g - target).abs().sum()


def gradnorm_weight_grad(weights: Tensor, norms: Tensor, initial_losses: Tensor, losses: Tensor,
                         alpha: float = GRADNORM_ALPHA) -> tuple[Tensor, Tensor]:
    """(L_grad, dL_grad/dw) at ``weights``, by torch.autograd.grad (norms and losses are constants)."""
    with torch.enable_grad():
        w = weights.detach().clone().requires_grad_(True)
        loss = gradnorm_loss(w, norms.detach(), initial_losses.detach(), losses.detach(), alpha)
        (grad,) = torch.autograd.grad(loss, w)
    return loss.detach(), grad


def gradnorm_renormalize(weights: Tensor, min_weight: float = GRADNORM_MIN_WEIGHT, total=None) -> Tensor:
    """Clamp at ``min_weight`` and rescale so that the weights sum to ``total`` (K by default)."""
    w = weights.clamp_min(min_weight)
    return w * ((w.numel() if total is None else total) / w.sum())


@torch.no_grad()
def gradnorm(grads: Tensor, weights: Tensor) -> Tensor:
    """(K, P) task gradients and (K,) task weights -> (P,) sum_t w_t g_t."""
    return apply_weights(weights, grads)


@dataclass
class GradNormOptions:
    # asymmetry: how strongly tasks that train slower are pulled up (the paper's alpha; 0: equal norms)
    alpha: float = at_least(GRADNORM_ALPHA, 0)
    lr: float = above(GRADNORM_LR, 0)  # Adam learning rate of the task weights


class GradNorm(GramWeighting):
    name = "gradnorm"
    Options = GradNormOptions
    updates_from_present_tasks = True  # only the present tasks' weights move (module docstring)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("task_weights", torch.ones(k))
        self.register_buffer("adam_m", torch.zeros(k))
        self.register_buffer("adam_v", torch.zeros(k))
        self.register_buffer("adam_t", torch.zeros(k))  # per task
        self.initial_losses: list[float | None] = [None] * k  # per task: its first observed loss
        self.last_losses: list[float | None] = [None] * k  # per task: its latest observed loss
        self._used: tuple[int, list, Tensor] | None = None  # (step, present tasks, w) of the last combination

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "adam_t"
        if key in state_dict and state_dict[key].dim() == 0:  # a checkpoint from before per-task step counts
            state_dict[key] = state_dict[key].expand(len(self.tasks)).clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def weights(self):
        """The task weights w of the next combination (d = sum_t w_t g_t), an absent task's included."""
        return dict(zip(self.tasks, self.task_weights.tolist()))

    def step_weights(self):
        """What the trainer logs: once this step's combination is done, the w it used (``weights()`` has already
        moved on to the next one's); before it, the present tasks' ``weights()``."""
        if self._used is not None and self._used[0] == self.step and self._used[1] == self.present:
            return dict(zip(self.present, self._used[2].tolist()))
        return super().step_weights()

    def weights_from_gram(self, gram, losses, dtype):
        """This step's w_S; then w_S moves using the norms ||g_t|| = sqrt(diag(gram))."""
        idx = self.present_index
        out = self.task_weights[idx].clone()
        self._used = (self.step, list(self.present), out)  # what step_weights() logs: this step's w, not the next one's
        if all(self.initial_losses[i] is not None and self.last_losses[i] is not None for i in idx):
            self._update(idx, gram.diagonal().clamp_min(0.0).sqrt().to(self.task_weights.dtype))
        return out

    @torch.no_grad()
    def _update(self, idx: list[int], norms: Tensor) -> None:
        dev = self.task_weights.device
        norms = norms.to(dev)
        ix = torch.tensor(idx, device=dev, dtype=torch.long)
        l0 = torch.tensor([self.initial_losses[i] for i in idx], device=dev).clamp_min(1e-12)
        lt = torch.tensor([self.last_losses[i] for i in idx], device=dev).clamp_min(1e-12)
        w0, m0, v0, t0 = (b[ix] for b in (self.task_weights, self.adam_m, self.adam_v, self.adam_t))
        _, grad = gradnorm_weight_grad(w0, norms, l0, lt, self.options.alpha)
        ok = torch.isfinite(norms).all() & torch.isfinite(grad).all()  # no host sync: applied by torch.where
        grad = torch.where(ok, grad, 0.0)
        b1, b2 = _BETAS
        t = t0 + 1
        m = b1 * m0 + (1 - b1) * grad
        v = b2 * v0 + (1 - b2) * grad * grad
        step = self.options.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + _EPS)
        rest = [i for i in range(len(self.tasks)) if i not in idx]
        # all K keep summing to K (a host sync on subset steps only: a Python total, as K itself, rounds the same)
        total = len(self.tasks) - (float(self.task_weights[rest].sum()) if rest else 0)
        w = gradnorm_renormalize(w0 - step, total=total)
        for buf, new, old in ((self.task_weights, w, w0), (self.adam_m, m, m0), (self.adam_v, v, v0),
                              (self.adam_t, t, t0)):
            buf[ix] = torch.where(ok, new, old)

    def end_step(self, losses):
        for i, t in enumerate(self.tasks):
            if t in losses:  # a task the step did not hold keeps its losses
                if self.initial_losses[i] is None:
                    self.initial_losses[i] = float(losses[t])
                self.last_losses[i] = float(losses[t])

    def get_extra_state(self):
        return {"initial_losses": list(self.initial_losses), "last_losses": list(self.last_losses)}

    def set_extra_state(self, state):
        k = len(self.tasks)
        self.initial_losses = list(state["initial_losses"] or [None] * k)
        self.last_losses = list(state["last_losses"] or [None] * k)
