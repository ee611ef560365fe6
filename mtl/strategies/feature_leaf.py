"""``feature_leaf``: one backbone forward, one independent backward per head, one backbone backward.

Every head reads a leaf ``leaf = features.detach().requires_grad_()``. Each task's backward pass
runs through its head only and accumulates d(loss_t)/d(features) into ``leaf.grad``; then one
backward from the features, ``features.backward(leaf.grad)``, carries the sum through the backbone.
A backward pass is linear in its incoming gradient, so this is exactly the gradient of the weighted
sum, with one all-reduce (DDP with find_unused_parameters=False sees every parameter get exactly one
gradient). The per-task feature gradients are available on their own, between the head passes.
"""

import torch

from mtl.strategies.base import Strategy, detached, gradient_stats


class FeatureLeaf(Strategy):
    name = "feature_leaf"
    summary = "one backbone forward and backward; per-task head backward into a feature leaf"

    @classmethod
    def extra_memory_bytes(cls, num_tasks, shared_params, feature_numel, elem=4):
        return 2 * feature_numel * elem  # the leaf and its accumulated gradient

    def forward_backward(self, s):
        out = s.model(s.batch, feature_leaf=True)
        leaf, losses = out["leaf"], out["losses"]
        per_task, before = [], 0.0
        for t in s.tasks:  # one backward pass per task; each stops at the leaf
            s.scale(s.weigh(t, losses[t])).backward()
            per_task.append((leaf.grad - before).detach().float().flatten())
            before = leaf.grad.clone()
        out["features"].backward(leaf.grad)  # the one backbone backward, for the weighted sum
        return detached(losses), gradient_stats(s.tasks, torch.stack(per_task), "feat_")
