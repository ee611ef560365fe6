"""DWA, dynamic weight average (Liu et al. 2019, "End-to-End Multi-Task Learning with Attention").

The weight of a task grows when its loss falls more slowly than the others'::

    r_t(k-1) = L_t(k-1) / L_t(k-2),      w_t(k) = K * softmax_t( r_t(k-1) / T ),      term_t = w_t(k) * L_t

with T = ``weighting.options.T`` = 2.0 (the paper's temperature) and w_t = 1 for the first two steps. Here k counts
optimizer steps and L_t(k) is the rank-averaged loss of step k as given to ``end_step`` (identical on
every rank). The paper and LibMTL use epoch-average losses (k = epoch); per-step losses react faster
but are noisier (the ratio of two single-batch losses). The last two loss vectors are kept in
``state_dict()`` (extra state), so a resumed run continues with the same weights. A non-positive
previous loss is clamped at 1e-12 and the ratio at ``DWA_MAX_RATIO`` so the softmax stays finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtl.weighting.base import Weighting
from mtl.weighting.checks import option_range_errors

DWA_T = 2.0
DWA_MAX_RATIO = 1e6


def dwa_weights(prev: list[float], prev2: list[float], temperature: float = DWA_T) -> list[float]:
    """K * softmax(r / T) with r = prev / prev2 (the last and the second-to-last step's losses)."""
    r = [min(max(a, 0.0) / max(b, 1e-12), DWA_MAX_RATIO) / temperature for a, b in zip(prev, prev2)]
    top = max(r)
    e = [math.exp(x - top) for x in r]
    total = sum(e)
    return [len(e) * x / total for x in e]


@dataclass
class DWAOptions:
    T: float = DWA_T  # softmax temperature: larger T gives more even weights (the paper's T = 2)


class DWA(Weighting):
    name = "dwa"
    Options = DWAOptions

    @classmethod
    def check(cls, cfg):
        return option_range_errors(cfg, {"T": (lambda v: v > 0, "must be > 0")})

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.history: list[list[float]] = []  # the last two steps' rank-averaged losses, oldest first
        self._w = {t: 1.0 for t in self.tasks}

    def _refresh(self):
        if len(self.history) < 2:
            self._w = {t: 1.0 for t in self.tasks}
        else:
            self._w = dict(zip(self.tasks, dwa_weights(self.history[-1], self.history[-2], self.options.T)))

    def weigh(self, task, loss):
        return loss * self._w[task]

    def weights(self):
        return dict(self._w)

    def end_step(self, losses):
        self.history = (self.history + [[float(losses[t]) for t in self.tasks]])[-2:]
        self._refresh()

    def get_extra_state(self):
        return {"history": [list(h) for h in self.history]}

    def set_extra_state(self, state):
        self.history = [list(map(float, h)) for h in state["history"]]
        self._refresh()
