"""``accumulate``: gradient accumulation over the tasks, one all-reduce per step.

Every task but the last runs its forward AND backward inside ``no_sync()`` (DDP decides at forward
time whether the next backward syncs), so their gradients accumulate locally; the last task's pass
is synced and reduces the sum. ``find_unused_parameters=True`` is required: the last pass does not
reach the other heads, and DDP keeps the map of parameters used across the no_sync passes so that
their accumulated gradients are reduced too. Cost: a backbone forward and backward per task, one
all-reduce.
"""

import contextlib

from mtl.strategies.base import Strategy, no_sync


class Accumulate(Strategy):
    name = "accumulate"
    summary = "per-task forward+backward, all but the last inside no_sync(); one all-reduce"
    find_unused_parameters = True
    per_task_forwards = True
    forwards = "K"
    backbone_backwards = "K"

    def forward_backward(self, s):
        losses = {}
        for i, t in enumerate(s.tasks):
            last = i == len(s.tasks) - 1
            with contextlib.nullcontext() if last else no_sync(s.model):
                loss = s.model(s.batch, tasks=[t])["losses"][t]
                s.scale(s.weigh(t, loss)).backward()
            losses[t] = loss.detach()
        return losses, {}

