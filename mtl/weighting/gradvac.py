"""GradVac, Gradient Vaccine (Wang et al. 2021, "Gradient Vaccine: Investigating and Improving Multi-task
Optimization in Massively Multilingual Models").

PCGrad with a target: PCGrad only removes negative cosines (target 0); GradVac pulls the cosine between
two tasks' gradients up to a per-pair target phi^_ij that follows the cosines seen in training. For each
task i, starting from g_i' = g_i, and for every other task j in a random order::

    phi_ij = cos(g_i', g_j)
    if phi_ij < phi^_ij:
        g_i' <- g_i' + ||g_i'|| (phi^_ij sqrt(1 - phi_ij^2) - phi_ij sqrt(1 - phi^_ij^2))
                        / (||g_j|| sqrt(1 - phi^_ij^2))  g_j                    (the paper's Eq. 2)
    phi^_ij <- (1 - beta) phi^_ij + beta phi_ij                                 (Eq. 3, every step)

and the update is d = sum_i g_i'. The added multiple of g_j is the one that leaves the new g_i' at
cosine exactly phi^_ij with g_j (in the plane of g_i' and g_j); with phi^ = 0 it is PCGrad's
projection. The targets start at 0 and are compared *before* this step's EMA update; the EMA takes the
cosine before the correction. beta = ``weighting.options.beta`` = 0.5 (LibMTL's and TorchJD's
default). This is the whole-model variant (one cosine per pair over all shared parameters; LibMTL's
group_type 0), not the per-layer one.

As in PCGrad, every g_i' stays a combination of the rows, ``g_i' = sum_k C[i, k] g_k``, so everything is
a function of the Gram matrix M: ``||g_i'||^2 = C_i M C_i^T`` and ``g_i' . g_j = C_i M[:, j]``, and the
correction adds to ``C[i, j]``. Computed in float64 on the CPU (K x K). The update is ``w^T G`` with
``w = sum_i C[i, :]``.

Order: for K > 2 the order of the other tasks is drawn for every i from a ``torch.Generator`` seeded
with ``stream_seed(seed, step, "gradvac")`` (the same on every rank, repeated on resume). State: the
K x K targets, a buffer in ``state_dict()``; every rank sees the same rank-averaged rows and so keeps
the same targets. A step with some tasks only (multi-input) reads and moves the present pairs' targets only.

Degenerate input: a pair with a zero row has no cosine: nothing is corrected and its target is left
as it is; cosines are clipped to [-1, 1] against round-off, and a target of +-1 (reachable only with
beta = 1) is held at +-(1 - 1e-12) so that the division stays finite. Non-finite input gives w = 1
(the sum; a non-finite update, so the trainer skips the step) and leaves the targets alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram, step_generator
from mtl.weighting.checks import ranged

GRADVAC_BETA = 0.5  # EMA rate of the cosine targets
_MAX_TARGET = 1.0 - 1e-12


def gradvac_coefficients(m: np.ndarray, targets: np.ndarray, beta: float,
                         orders: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(C, new targets) for a PSD float64 Gram matrix m: the corrected rows are ``C @ grads``.

    ``orders[i]`` is the order in which task i visits the other tasks; ``targets`` is not modified."""
    k = m.shape[0]
    coef = np.eye(k)
    new = targets.copy()
    norms = np.sqrt(np.maximum(np.diag(m), 0.0))
    tiny = 1e-300
    for i in range(k):
        for j in orders[i]:
            ni = math.sqrt(max(float(coef[i] @ m @ coef[i]), 0.0))
            if ni <= tiny or norms[j] <= tiny:
                continue
            phi = min(max(float(coef[i] @ m[:, j]) / (ni * norms[j]), -1.0), 1.0)
            target = min(max(float(new[i, j]), -_MAX_TARGET), _MAX_TARGET)
            if phi < target:
                root_t = math.sqrt(1.0 - target * target)
                coef[i, j] += ni * (target * math.sqrt(1.0 - phi * phi) - phi * root_t) / (norms[j] * root_t)
            new[i, j] = (1.0 - beta) * new[i, j] + beta * phi
    return coef, new


def gradvac_orders(k: int, generator: torch.Generator | None) -> list[list[int]]:
    """For each task, the other tasks in the order it visits them (random for K > 2)."""
    if k <= 2 or generator is None:
        return [[j for j in range(k) if j != i] for i in range(k)]
    return [[j for j in torch.randperm(k, generator=generator).tolist() if j != i] for i in range(k)]


@torch.no_grad()
def gradvac_weights(gram: Tensor, targets: np.ndarray, beta: float = GRADVAC_BETA,
                    generator: torch.Generator | None = None) -> tuple[Tensor, np.ndarray]:
    """((K,) w with d = w @ grads, the updated (K, K) targets) for the Gram matrix ``grads @ grads.T``."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.ones(k), gram), targets
    coef, new = gradvac_coefficients((m + m.T) / 2, targets, beta, gradvac_orders(k, generator))
    return like_gram(coef.sum(0), gram), new


@torch.no_grad()
def gradvac(grads: Tensor, targets: np.ndarray, beta: float = GRADVAC_BETA,
            generator: torch.Generator | None = None) -> tuple[Tensor, np.ndarray]:
    """(K, P) task gradients and (K, K) targets -> ((P,) sum of the corrected rows, the updated targets)."""
    w, new = gradvac_weights(gram_matrix(grads), targets, beta, generator)
    return apply_weights(w, grads), new


@dataclass
class GradVacOptions:
    # EMA rate of the per-pair cosine targets (the paper's beta; 0: the targets stay 0, i.e. PCGrad)
    beta: float = ranged(GRADVAC_BETA, lambda v: 0 <= v <= 1, "must be in [0, 1]")


class GradVac(GramWeighting):
    name = "gradvac"
    updates_from_present_tasks = True  # only the present pairs' targets are read and moved
    Options = GradVacOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("targets", torch.zeros(k, k, dtype=torch.float64))
        self.seed = int(cfg.seed)

    def weights_from_gram(self, gram, losses, dtype):
        k = gram.shape[0]
        gen = step_generator(self.seed, self.step, "gradvac") if k > 2 else None
        # a step with some tasks only: the targets of the present pairs, and only those move (base.py)
        idx = torch.tensor(self.present_index, dtype=torch.long)
        targets = self.targets.detach().cpu()[idx][:, idx]
        w, new = gradvac_weights(gram, targets.numpy(), self.options.beta, gen)
        self.targets[idx.to(self.targets.device)[:, None], idx.to(self.targets.device)[None, :]] = \
            torch.as_tensor(new, dtype=self.targets.dtype, device=self.targets.device)
        return w

    def get_extra_state(self):
        return {"step": self.step}

    def set_extra_state(self, state):
        self.step = int(state["step"])
