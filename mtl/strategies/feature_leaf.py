"""``feature_leaf``: one backbone forward, the heads' backward passes, one backbone backward.

Each head reads a leaf of its own, ``leaves[t] = features.detach().requires_grad_()`` (the same storage). One
backward call from the weighted sum of the losses runs every head's pass, each stopping at its own leaf, so it
leaves d(loss_t)/d(features) = g_t in ``leaves[t].grad``, task by task, as a backward pass per head would (the
heads' graphs are disjoint: each g_t is the same, bit for bit, as from a call of its own); then one backward
from the features, ``features.backward(sum_t g_t)``, carries the sum through the backbone. A backward pass is
linear in its incoming gradient, so this is exactly the gradient of the weighted sum, with one all-reduce (DDP
with find_unused_parameters=False sees every parameter get exactly one gradient). The per-task feature
gradients g_t are there on their own, between the two calls: two backward calls a step, where ``combined``
makes one (a call per head would make K + 1).

``weighting.source: features`` (a Gram-only gradient-level method: MGDA, PCGrad, ..., the MGDA-UB /
LibMTL ``rep_grad`` surrogate): the method's weights w come from the K x K Gram matrix of the g_t over
the GLOBAL batch, and the backbone backward carries ``sum_t w_t g_t`` instead of the plain sum. The
global Gram matrix is one all-reduce of K x K numbers: rank r's features are its own samples, so the
global Gram matrix is the sum over ranks of the local ones, once each g_t is put on the global loss's
scale. Rank r's loss is W times its share of the global mean (DDP averages the ranks' gradients;
the caption head scales its token sum by W / global tokens for the same reason), so its g_t is W times
the global loss's gradient at its samples, and ``gram = sum_r G_r G_r^T / W^2``. Every rank then
computes the same w from the same numbers, and DDP reduces the one backbone backward as usual.
Each head gets its own task's gradient, unweighted (the method's w weighs the tasks' pulls on the
SHARED parameters; a head is pulled by one task only), as ``task_grads`` does; with ``weighting.heads: weighted``
head t's is then multiplied by w_t, as in ``task_grads`` (``weigh_heads_``).

Multi-input steps that leave tasks out: only the present tasks' heads run (K' rows, a K' x K' Gram matrix), and
the first head pass also carries a zero term over the absent heads' parameters (mtl/strategies/absent.py), so
DDP needs no find_unused_parameters (``covers_unused_parameters``).
"""

import time

import torch

from mtl.strategies.absent import absent_heads_term
from mtl.strategies.base import Strategy, detached, gradient_stats, gram_stats, weigh_heads_
from mtl.weighting.base import apply_weights, gram_matrix


class FeatureLeaf(Strategy):
    name = "feature_leaf"
    summary = "one backbone forward and backward; per-task head backward into a feature leaf"
    gradient_sources = ("features",)
    covers_unused_parameters = True  # a zero term over the heads of the tasks a step leaves out

    @classmethod
    def extra_memory_bytes(cls, num_tasks, shared_params, feature_numel, elem=4):
        return (2 * num_tasks + 1) * feature_numel * elem  # each task's gradient of the leaf, stacked, and the sum

    def forward_backward(self, s):
        out = s.model(s.batch, leaf_per_task=True)
        leaves, losses, zero = out["leaves"], out["losses"], absent_heads_term(s.model, s.tasks)
        total = sum(s.weigh(t, losses[t]) for t in s.tasks)
        s.scale(total if zero is None else total + zero).backward()  # every head's pass; each stops at its leaf
        grads = torch.stack([leaves[t].grad.reshape(-1) for t in s.tasks])  # (K, feature map numel): small
        if s.gram_weights is None:
            total = grads.sum(0)
            stats = gradient_stats(s.tasks, grads.detach().float(), "feat_") if s.log_stats else {}
        else:
            total, stats = self._weighted(s, grads, losses)
        if out["features"].requires_grad:  # the one backbone backward (none for a frozen one: model.backbone.freeze)
            out["features"].backward(total.view_as(out["features"]))
        if s.head_weights is not None:  # weighting.heads: weighted (after the backward: DDP has averaged the heads)
            weigh_heads_(s.model, s.tasks, s.head_weights())
        if "multi_input" in s.batch:  # each task's feature rows are its own: their cosines are 0 by construction
            stats = {k: v for k, v in stats.items() if "grad_cos/" not in k}
        return detached(losses), stats

    @staticmethod
    def _weighted(s, grads: torch.Tensor, losses: dict) -> tuple[torch.Tensor, dict]:
        """(sum_t w_t g_t, stats): w from the global batch's Gram matrix of the feature gradients."""
        k, world = grads.shape[0], s.comm.world_size()
        loss_vec = torch.stack([losses[t].detach() for t in s.tasks]).to(torch.float64)
        reduced = s.comm.all_reduce_mean(torch.cat([gram_matrix(grads).reshape(-1), loss_vec]))  # ONE collective
        gram = reduced[: k * k].view(k, k) / world  # (sum_r G_r G_r^T) / W^2, see the module docstring
        tic = time.perf_counter()
        scale = s.loss_scale()  # fp16: the rows are scaled; the method sees the unscaled Gram matrix
        w = s.gram_weights(gram / (scale * scale), reduced[k * k:], grads.dtype)
        stats = {**(gram_stats(s.tasks, gram, "feat_") if s.log_stats else {}),  # the trainer unscales
                 "combine_s": time.perf_counter() - tic}
        return apply_weights(w, grads), stats
