"""PCGrad (Yu et al. 2020, "Gradient Surgery for Multi-Task Learning"): project away the conflicts.

For each task i, starting from ``g_i^PC = g_i``, and for every other task j (in a random order)::

    if g_i^PC . g_j < 0:   g_i^PC <- g_i^PC - (g_i^PC . g_j) / ||g_j||^2 * g_j

(the projection is onto the normal plane of the *original* g_j), and the update is the **sum**
``d = sum_i g_i^PC`` (the paper's Algorithm 1; the same scale as equal weighting, which sums the task
losses), or with ``weighting.options.reduction=mean`` the mean (the default of the widely used PyTorch
port, Pytorch-PCGrad): the same direction, 1/K the length.

Every projected row is a linear combination of the rows, so the whole computation runs on the K x K
Gram matrix ``M = G G^T``. Keep ``g_i^PC = sum_k C[i, k] g_k`` (C starts as the identity); then
``g_i^PC . g_j = sum_k C[i, k] M[k, j] = C[i] . M[:, j]``, and a projection on g_j changes only one
coefficient: ``C[i, j] -= (C[i] . M[:, j]) / M[j, j]``. ``pcgrad_coefficients`` returns C and the
update is ``d = w @ G`` with ``w = sum_i C[i, :]``. Nothing leaves the device (no .cpu(), no data-dependent Python branch).

Order: with K = 2 there is only one other task, so the result is deterministic. With K > 2 the
order of the other tasks is drawn independently for every task i from a ``torch.Generator`` seeded
from ``(cfg.seed, step)`` (see ``stream_seed``), so every rank draws the same order with no
communication and a resumed run repeats it exactly.

Degenerate input: a zero row g_j is never projected on (there is nothing to conflict with) and a
zero row g_i stays zero; all-zero input gives a zero update. Non-finite input propagates (so the
trainer's finite check skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, step_generator
from mtl.weighting.checks import one_of

PCGRAD_REDUCTIONS = ("sum", "mean")


@torch.no_grad()
def pcgrad_orders(k: int, generator: torch.Generator | None = None) -> Tensor:
    """(K, K-1) long: row i lists the other tasks in the order task i is projected on them (a fresh
    ``torch.randperm`` per task for K > 2 with a generator, else increasing)."""
    if k > 2 and generator is not None:
        orders = [[j for j in torch.randperm(k, generator=generator).tolist() if j != i] for i in range(k)]
    else:
        orders = [[j for j in range(k) if j != i] for i in range(k)]
    return torch.tensor(orders, dtype=torch.long).reshape(k, k - 1)


@torch.no_grad()
def pcgrad_coefficients(gram: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(K, K) C such that the projected gradients are ``C @ grads``; ``gram = grads @ grads.T``.

    Row i's projections touch only row i of C, so the K rows advance together: step t projects every row i on its
    t-th task ``order[i, t]`` at once (K - 1 vectorised steps, not K (K - 1) scalar ones; the same arithmetic)."""
    k = gram.shape[0]
    coef = torch.eye(k, dtype=gram.dtype, device=gram.device)
    if k < 2:
        return coef
    if k == 2:  # one projection each, on the other row: g_i^PC . g_j is the Gram entry itself (the same arithmetic)
        sq = gram.diagonal()
        conflict = (gram[0, 1] < 0) & (sq > 0)
        step = torch.where(conflict, gram[0, 1] / torch.where(sq > 0, sq, 1.0), 0.0)  # step[j]: row 1 - j on row j
        return coef - torch.diag(step).flip(0)
    orders = pcgrad_orders(k, generator).to(gram.device)
    sq = gram.diagonal()
    rows = torch.arange(k, device=gram.device)
    safe_sq = torch.where(sq > 0, sq, 1.0)
    for t in range(k - 1):
        j = orders[:, t]
        dot = torch.linalg.vecdot(coef, gram.index_select(1, j).T)  # g_i^PC . g_{j_i}, every i at once
        conflict = (dot < 0) & (sq[j] > 0)
        coef[rows, j] -= torch.where(conflict, dot / safe_sq[j], 0.0)
    return coef


def pcgrad_weights(gram: Tensor, generator: torch.Generator | None = None, reduction: str = "sum") -> Tensor:
    """(K,) alpha with ``pcgrad(grads) == alpha @ grads`` (``reduction``: sum or mean of the projected rows)."""
    coef = pcgrad_coefficients(gram, generator)
    return coef.sum(0) if reduction == "sum" else coef.mean(0)


@torch.no_grad()
def pcgrad(grads: Tensor, losses: Tensor | None = None, *, generator: torch.Generator | None = None,
           reduction: str = "sum") -> Tensor:
    """(K, P) task gradients -> (P,) sum (or mean) of the conflict-projected gradients."""
    return apply_weights(pcgrad_weights(gram_matrix(grads), generator, reduction), grads)


@dataclass
class PCGradOptions:
    # sum | mean of the projected gradients (the paper sums: the scale of equal weighting)
    reduction: str = one_of("sum", PCGRAD_REDUCTIONS)


class PCGrad(GramWeighting):
    name = "pcgrad"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)
    Options = PCGradOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.seed = int(cfg.seed)

    def weights_from_gram(self, gram, losses, dtype):
        k = gram.shape[0]
        gen = step_generator(self.seed, self.step, "pcgrad") if k > 2 else None
        return pcgrad_weights(gram, gen, self.options.reduction)
