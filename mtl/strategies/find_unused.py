"""``find_unused``: one forward and one backward per task, DDP built with find_unused_parameters=True.

The seed articles' quick fix. Each task's forward runs only its own head, so the other head's
parameters are unused; find_unused_parameters makes DDP walk the graph at each forward and mark
them ready, so each backward completes a reduction. Cost: two backbone forwards, two backbone
backwards and two all-reduces of every bucket per step, plus the graph walk.
"""

from mtl.strategies.base import Strategy


class FindUnused(Strategy):
    name = "find_unused"
    summary = "per-task forward+backward, find_unused_parameters=True"
    find_unused_parameters = True
    per_task_forwards = True
    forwards = "K"
    backbone_backwards = "K"
    allreduces = "K"

    def forward_backward(self, s):
        losses = {}
        for t in s.tasks:
            loss = s.model(s.batch, tasks=[t])["losses"][t]
            s.scale(s.weigh(t, loss)).backward()
            losses[t] = loss.detach()
        return losses, {}
