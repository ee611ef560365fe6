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

w, the Adam moments and the Adam step count are buffers; L(0) and the latest losses are extra state:
all of it is in ``state_dict()``. w is not an nn.Parameter (it is not updated by the model's optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights
from mtl.weighting.checks import option_range_errors

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


def gradnorm_renormalize(weights: Tensor, min_weight: float = GRADNORM_MIN_WEIGHT) -> Tensor:
    """Clamp at ``min_weight`` and rescale so that the weights sum to K."""
    w = weights.clamp_min(min_weight)
    return w * (w.numel() / w.sum())


@torch.no_grad()
def gradnorm(grads: Tensor, weights: Tensor) -> Tensor:
    """(K, P) task gradients and (K,) task weights -> (P,) sum_t w_t g_t."""
    return apply_weights(weights, grads)


@dataclass
class GradNormOptions:
    alpha: float = GRADNORM_ALPHA  # asymmetry: how strongly tasks that train slower are pulled up (the paper's alpha; 0: equal norms)
    lr: float = GRADNORM_LR  # Adam learning rate of the task weights


class GradNorm(GramWeighting):
    name = "gradnorm"
    Options = GradNormOptions

    @classmethod
    def check(cls, cfg):
        return option_range_errors(cfg, {"alpha": (lambda v: v >= 0, "must be >= 0"),
                                         "lr": (lambda v: v > 0, "must be > 0")})

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("task_weights", torch.ones(k))
        self.register_buffer("adam_m", torch.zeros(k))
        self.register_buffer("adam_v", torch.zeros(k))
        self.register_buffer("adam_t", torch.zeros(()))
        self.initial_losses: list[float] | None = None
        self.last_losses: list[float] | None = None

    def weights(self):
        """The task weights w of the next combination (d = sum_t w_t g_t)."""
        return dict(zip(self.tasks, self.task_weights.tolist()))

    def weights_from_gram(self, gram, losses, dtype):
        """This step's w; then w moves using the norms ||g_t|| = sqrt(diag(gram))."""
        out = self.task_weights.clone()
        if self.initial_losses is not None and self.last_losses is not None:
            self._update(gram.diagonal().clamp_min(0.0).sqrt().to(self.task_weights.dtype))
        return out

    @torch.no_grad()
    def _update(self, norms: Tensor) -> None:
        dev = self.task_weights.device
        norms = norms.to(dev)
        l0 = torch.tensor(self.initial_losses, device=dev).clamp_min(1e-12)
        lt = torch.tensor(self.last_losses, device=dev).clamp_min(1e-12)
        _, grad = gradnorm_weight_grad(self.task_weights, norms, l0, lt, self.options.alpha)
        ok = torch.isfinite(norms).all() & torch.isfinite(grad).all()  # no host sync: applied by torch.where
        grad = torch.where(ok, grad, 0.0)
        b1, b2 = _BETAS
        t = self.adam_t + 1
        m = b1 * self.adam_m + (1 - b1) * grad
        v = b2 * self.adam_v + (1 - b2) * grad * grad
        step = self.options.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + _EPS)
        w = gradnorm_renormalize(self.task_weights - step)
        self.task_weights.copy_(torch.where(ok, w, self.task_weights))
        self.adam_m.copy_(torch.where(ok, m, self.adam_m))
        self.adam_v.copy_(torch.where(ok, v, self.adam_v))
        self.adam_t.copy_(torch.where(ok, t, self.adam_t))

    def end_step(self, losses):
        values = [float(losses[t]) for t in self.tasks]
        if self.initial_losses is None:
            self.initial_losses = values
        self.last_losses = values

    def get_extra_state(self):
        return {"initial_losses": self.initial_losses, "last_losses": self.last_losses}

    def set_extra_state(self, state):
        self.initial_losses = state["initial_losses"]
        self.last_losses = state["last_losses"]

