"""DWA, dynamic weight average (Liu et al. 2019, "End-to-End Multi-Task Learning with Attention").

The weight of a task grows when its loss falls more slowly than the others'::

    r_t(k-1) = L_t(k-1) / L_t(k-2),      w_t(k) = K * softmax_t( r_t(k-1) / T ),      term_t = w_t(k) * L_t

with T = ``weighting.options.T`` = 2.0 (the paper's temperature) and w_t = 1 for the first two steps. Here k counts
optimizer steps and L_t(k) is the rank-averaged loss of step k as given to ``end_step`` (identical on
every rank). The paper and LibMTL use epoch-average losses (k = epoch); per-step losses react faster
but are noisier (the ratio of two single-batch losses). The last two loss vectors are kept in
``state_dict()`` (extra state), so a resumed run continues with the same weights. A non-positive
previous loss is clamped at 1e-12 and the ratio at ``DWA_MAX_RATIO`` so the softmax stays finite.

Multi-input steps that leave tasks out (docs/multi-input.md): ``end_step`` gets the present tasks' losses only,
and each task keeps its own last two losses, moved on only by the steps that hold it, so r_t is the ratio of its
last two observations and an absent task's state does not change. A step's weights are DWA over its present
tasks S (``begin_step(step, present)``): ``w_S = K' softmax(r_S / T)``, w = 1 until every task of S has two
observations; so DWA over K tasks of which only S appear is DWA over S.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtl.weighting.base import LossWeighting, k_softmax
from mtl.weighting.checks import above

DWA_T = 2.0
DWA_MAX_RATIO = 1e6


def dwa_weights(prev: list[float], prev2: list[float], temperature: float = DWA_T) -> list[float]:
    """K * softmax(r / T) with r = prev / prev2 (the last and the second-to-last step's losses)."""
    return k_softmax([min(max(a, 0.0) / max(b, 1e-12), DWA_MAX_RATIO) / temperature for a, b in zip(prev, prev2)])


@dataclass
class DWAOptions:
    T: float = above(DWA_T, 0)  # softmax temperature: larger T gives more even weights (the paper's T = 2)


class DWA(LossWeighting):
    name = "dwa"
    Options = DWAOptions
    updates_from_present_tasks = True  # end_step may get a subset of the tasks (multi-input, mtl/setup/multi_input.py)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        # per task, its second-to-last and last rank-averaged loss (None: not yet seen)
        self.prev: list[float | None] = [None] * len(self.tasks)
        self.last: list[float | None] = [None] * len(self.tasks)
        self._w = {t: 1.0 for t in self.tasks}

    @property
    def history(self) -> list[list]:
        """The last two loss vectors, oldest first (fewer at the start)."""
        return [row for row in (self.prev, self.last) if any(x is not None for x in row)]

    def _refresh(self):
        idx = self.present_index
        self._w = {t: 1.0 for t in self.tasks}
        if all(self.prev[i] is not None and self.last[i] is not None for i in idx):
            w = dwa_weights([self.last[i] for i in idx], [self.prev[i] for i in idx], self.options.T)
            self._w.update(zip(self.present, w))

    def begin_step(self, step, present=None):
        super().begin_step(step, present)
        self._refresh()

    def weigh(self, task, loss):
        return loss * self._w[task]

    def weights(self):
        return dict(self._w)

    def end_step(self, losses):
        for i, t in enumerate(self.tasks):
            if t in losses:  # a task the step did not hold keeps its state
                self.prev[i], self.last[i] = self.last[i], float(losses[t])
        self._refresh()

    def get_extra_state(self):
        return {"history": [list(h) for h in self.history]}

    def set_extra_state(self, state):
        rows = [[None if x is None else float(x) for x in h] for h in state["history"]]
        empty = [None] * len(self.tasks)
        self.prev, self.last = ([empty, *rows][-2:] if rows else [empty, empty])
        self.prev, self.last = list(self.prev), list(self.last)
        self._refresh()
