"""GLS, geometric loss strategy (Chennupati et al. 2019, "MultiNet++"): minimise the geometric mean.

The objective is ``(prod_t L_t)^(1/K)``. Its logarithm ``(1/K) sum_t log L_t`` has the same minimiser
(log is increasing) and is separable, so the per-task term is::

    term_t = log(L_t) / K,         d term_t = grad L_t / (K L_t)

The gradient of the geometric mean itself is ``GM * sum_t grad L_t / (K L_t)`` with GM = (prod L)^(1/K):
the same direction, scaled by the (positive) current geometric mean. We drop that common factor, which
would couple the tasks' current losses (a strategy runs one backward per task), and which an adaptive
optimizer largely ignores anyway. In effect each task's gradient is divided by its own loss, so every
task counts by its *relative* improvement.

Under DDP each rank takes the log of its own batch's loss and DDP averages the gradients, so the
objective is the rank-mean of log L_t (not the log of the rank-mean); with equal per-rank batch sizes
this is the usual stochastic estimate. Losses are clamped at ``GLS_EPS`` before the log (the gradient is
0 below it). ``weights()`` reports the coefficient of log L_t, 1/K. Stateless.
"""

from __future__ import annotations

from mtl.dist import all_reduce_mean
from mtl.weighting.base import Weighting

GLS_EPS = 1e-12


class GLS(Weighting):
    name = "gls"

    def weigh(self, task, loss):
        # d log(L)/d theta = grad(L) / L with L the GLOBAL batch's loss. Each rank's term is its own loss
        # divided by the rank-averaged value (one scalar all-reduce), so that DDP's average of the
        # ranks' gradients is grad(L_global) / (K L_global), as in one process on the global batch.
        # log(L_r) per rank would average grad(L_r) / L_r instead: a different, world-size-dependent step.
        return loss / (len(self.tasks) * all_reduce_mean(loss.detach()).clamp_min(GLS_EPS))

    def weights(self):
        return {t: 1.0 / len(self.tasks) for t in self.tasks}
