"""``task_grads``: each task's rank-averaged gradient of the shared parameters, for gradient-level weighting.

One backbone forward (the ``feature_leaf`` graph, run under ``no_sync()`` so DDP reduces nothing by
itself). For each task: its head backward pass into the feature leaf, then one backbone backward
with ``torch.autograd.grad(features, shared, leaf_grad_t)``, which fills row t of the K x P matrix
G without touching ``.grad``. Then ONE all-reduce, by hand, of [G, head gradients, losses], so that
every row is averaged over ranks *before* the weighting method combines the rows. Combining first
and averaging after would give a different, rank-count-dependent answer for every nonlinear
method (PCGrad, MGDA, CAGrad, Nash-MTL, ...).

Cost: one backbone forward, K backbone backward passes, one all-reduce of K*P_shared + P_heads
numbers, and G held in memory (K * P_shared floats). With a loss-level method the rows are summed,
which reproduces ``combined`` (the parity tests check it).
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.strategies.base import Strategy, gradient_stats, no_sync


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _write_grads(params: list, flat: torch.Tensor) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pieces = torch.split(flat, [p.numel() for p in params])
    torch._foreach_copy_([p.grad for p in params], [v.view_as(p) for v, p in zip(pieces, params)])


class TaskGrads(Strategy):
    name = "task_grads"
    summary = "one backbone forward, a backbone backward per task, per-task rank-averaged shared gradients"
    task_gradients = True
    backbone_backwards = "K"  # one per task
    allreduces = 1  # by hand, coalesced

    @classmethod
    def allreduce_bytes(cls, num_tasks, shared_params, head_params, elem=4):
        return (num_tasks * shared_params + head_params + num_tasks) * elem  # [G, head gradients, losses]

    @classmethod
    def extra_memory_bytes(cls, num_tasks, shared_params, feature_numel, elem=4):
        return num_tasks * shared_params * elem + 2 * feature_numel * elem  # G, and the leaf with its gradient

    def forward_backward(self, s):
        bare = s.model.module if isinstance(s.model, DistributedDataParallel) else s.model
        shared = [p for p in bare.backbone.parameters() if p.requires_grad]
        heads = [p for p in bare.heads.parameters() if p.requires_grad]
        with no_sync(s.model):
            out = s.model(s.batch, feature_leaf=True)
        leaf, features, losses = out["leaf"], out["features"], out["losses"]
        rows, before = [], 0.0
        for i, t in enumerate(s.tasks):
            s.scale(s.weigh(t, losses[t])).backward()  # head t's pass; stops at the leaf
            g_feat, before = leaf.grad - before, leaf.grad.clone()
            g = torch.autograd.grad(features, shared, grad_outputs=g_feat, retain_graph=i < len(s.tasks) - 1,
                                    allow_unused=True)
            rows.append(_flat(torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, shared)))
        for p in heads:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = torch.stack(rows)
        k, n = grads.shape
        loss_vec = torch.stack([losses[t].detach().float() for t in s.tasks]).to(grads.dtype)
        buf = s.comm.all_reduce_mean(torch.cat([grads.reshape(-1), _flat(p.grad for p in heads), loss_vec]))
        grads = buf[: k * n].view(k, n)
        _write_grads(heads, buf[k * n: -k])
        tic = time.perf_counter()
        if s.combine is None:  # loss-level weighting: the weighted rows just add up
            direction = grads.sum(0)
        else:  # gradient-level: the method sees unscaled, rank-averaged rows
            scale = s.loss_scale()
            direction = s.combine(grads / scale, buf[-k:]) * scale
        if direction.is_cuda:
            torch.cuda.synchronize(direction.device)
        stats = {**gradient_stats(s.tasks, grads), "combine_s": time.perf_counter() - tic}  # the method's own maths
        _write_grads(shared, direction.to(shared[0].dtype))
        return {t: v.detach() for t, v in losses.items()}, stats
