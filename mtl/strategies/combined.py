"""``combined``: one forward, one backward on the weighted sum of the task losses.

The baseline every other strategy is measured against. It is not a two-pass strategy: you cannot
see or treat the tasks' gradients separately.
"""

from mtl.strategies.base import Strategy, detached


class Combined(Strategy):
    name = "combined"
    summary = "one forward, one backward on the weighted sum"
    supports_static_graph = True  # one backward per forward
    per_task_forwards = True  # the model runs the encoder once per task (per-task adapters)

    @classmethod
    def tolerates_find_unused(cls, value):
        return True  # one backward per forward: the extra graph walk costs time, nothing else

    def forward_backward(self, s):
        losses = s.model(s.batch)["losses"]
        total = sum(s.weigh(t, losses[t]) for t in s.tasks)
        s.scale(total).backward()
        return detached(losses), {}
