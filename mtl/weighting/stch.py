"""STCH, smooth Tchebycheff scalarization (Lin et al. 2024, "Smooth Tchebycheff Scalarization for
Multi-Objective Optimization").

The Tchebycheff scalarization ``max_t lambda_t (f_t - z*_t)`` optimises the worst objective; its smooth
version is ``g_mu = mu log sum_t exp(lambda_t (f_t - z*_t) / mu)``, which tends to the max as mu -> 0.
Its gradient is a softmax-weighted sum::

    grad g_mu = sum_t softmax_t(lambda (f - z*) / mu) lambda_t grad f_t

For multi-task learning (the authors' code, as in LibMTL): lambda = 1, the objectives are the
log-losses normalised by a *nadir* point, ``f_t = log(L_t / nadir_t)`` (so z* = 0 in that space and
every task starts near 0 whatever its loss scale), and the objective is K g_mu. Before that, a warm-up
minimises ``sum_t log L_t`` and measures the nadir: the mean rank-averaged loss of each task over the
last ``nadir_steps`` of the ``warmup_steps`` warm-up steps (the authors use epochs: 4 warm-up epochs
and the nadir from the 5th). After the warm-up, task t's term has the gradient

    K softmax_t( log(L / nadir) / mu ) * grad log L_t

Separability: the softmax couples the tasks' *current* losses, which a per-task term may not read (a
strategy runs one backward pass per task). Here the softmax is computed from the previous step's
rank-averaged losses (as FAMO's c): a one-step lag in the weights, while each term's gradient is still
that of log L_t with the current loss. The log's gradient uses the rank-averaged current loss (one scalar
all-reduce per task, as ``gls``), so 2 processes equal 1 process on the global batch.

``weighting.options``: ``mu`` = 1.0 (the authors' and LibMTL's default), ``warmup_steps`` = 100,
``nadir_steps`` = 20. State (extra state, all in ``state_dict()``): the step count, the nadir (or the
running sum while it is measured) and the previous losses. ``weights()`` reports the coefficient of
log L_t (1 during the warm-up). Losses at or below 1e-20 are clamped (the authors add 1e-20 in the log).

Multi-input steps that hold only some tasks S: each task counts its own steps (the steps that held it), so its
warm-up, its nadir window and its previous loss are its own; a step's weights are K' softmax over S of its
tasks' previous losses against their nadirs once every task of S has finished its warm-up (1 before). So STCH
over K tasks of which only S appear is STCH over S, and an absent task's state does not move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtl.parallel.dist import all_reduce_mean
from mtl.weighting.base import LossWeighting, k_softmax
from mtl.weighting.checks import above, at_least

STCH_EPS = 1e-20


def stch_weights(losses: list[float], nadir: list[float], mu: float) -> list[float]:
    """K softmax_t(log(L_t / nadir_t) / mu): the coefficients of log L_t in K * smooth Tchebycheff."""
    return k_softmax([math.log(max(a, STCH_EPS) / max(b, STCH_EPS)) / mu for a, b in zip(losses, nadir)])


@dataclass
class STCHOptions:
    mu: float = above(1.0, 0)  # smoothing: the softmax temperature (-> 0: the worst task only, the Tchebycheff max)
    warmup_steps: int = at_least(100, 1, "the nadir is measured there")  # steps of plain sum of log-losses before the scalarization starts
    nadir_steps: int = at_least(20, 1)  # the last this many warm-up steps give the nadir point (the mean of each task's loss)


class STCH(LossWeighting):
    name = "stch"
    updates_from_present_tasks = True  # per-task warm-up, nadir and previous loss (module docstring)
    Options = STCHOptions

    @classmethod
    def check(cls, cfg):
        errors = super().check(cfg)
        given = cfg.weighting.get("options") or {}
        warm, nadir = given.get("warmup_steps", STCHOptions.warmup_steps), given.get("nadir_steps", STCHOptions.nadir_steps)
        if isinstance(warm, int) and isinstance(nadir, int) and 1 <= warm < nadir:
            errors.append(f"weighting.options.nadir_steps: {nadir} is more than weighting.options.warmup_steps ({warm})")
        return errors

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.steps = [0] * len(self.tasks)  # per task: finished steps that held it (end_step calls)
        self.nadir_sum = [0.0] * len(self.tasks)
        self.prev: list[float | None] | None = None  # per task: its loss at the last step that held it
        self._index = {t: i for i, t in enumerate(self.tasks)}
        self._w = [1.0] * len(self.tasks)

    def _refresh(self):
        o, idx = self.options, self.present_index
        self._w = [1.0] * len(self.tasks)
        if self.prev is not None and all(self.steps[i] > o.warmup_steps and self.prev[i] is not None for i in idx):
            nadir = self.nadir()
            for i, w in zip(idx, stch_weights([self.prev[i] for i in idx], [nadir[i] for i in idx], o.mu)):
                self._w[i] = w

    def begin_step(self, step, present=None):
        super().begin_step(step, present)
        self._refresh()

    def nadir(self) -> list[float]:
        return [s / self.options.nadir_steps for s in self.nadir_sum]

    def weigh(self, task, loss):
        # the gradient of w_t log(L_t) of the global batch: the rank's loss over the rank-averaged value (see gls.py)
        return self._w[self._index[task]] * loss / all_reduce_mean(loss.detach()).clamp_min(STCH_EPS)

    def weights(self):
        return dict(zip(self.tasks, self._w))  # an absent task: 1.0 (it has no term in the step)

    def end_step(self, losses):
        o = self.options
        if self.prev is None:
            self.prev = [None] * len(self.tasks)
        for i, t in enumerate(self.tasks):
            if t not in losses:  # a task the step did not hold keeps its state
                continue
            self.steps[i] += 1
            if o.warmup_steps - o.nadir_steps < self.steps[i] <= o.warmup_steps:
                self.nadir_sum[i] += float(losses[t])
            self.prev[i] = float(losses[t])
        self._refresh()

    def get_extra_state(self):
        return {"steps": list(self.steps), "nadir_sum": list(self.nadir_sum), "prev": self.prev}

    def set_extra_state(self, state):
        s = state["steps"]
        self.steps = [int(s)] * len(self.tasks) if isinstance(s, int) else [int(x) for x in s]  # an int: before
        self.nadir_sum = [float(x) for x in state["nadir_sum"]]
        self.prev = None if state["prev"] is None else [None if x is None else float(x) for x in state["prev"]]
        self._refresh()
