"""GLS, geometric loss strategy (Chennupati et al. 2019, "MultiNet++"): minimise the geometric mean.

The objective is ``(prod_t L_t)^(1/K)``. Its logarithm ``(1/K) sum_t log L_t`` has the same minimiser
(log is increasing) and is separable; the gradient of a task's part is::

    grad (log(L_t) / K) = grad L_t / (K L_t)

The gradient of the geometric mean itself is ``GM * sum_t grad L_t / (K L_t)`` with GM = (prod L)^(1/K):
the same direction, scaled by the (positive) current geometric mean. We drop that common factor, which
would couple the tasks' current losses (a strategy runs one backward per task), and which an adaptive
optimizer largely ignores anyway. In effect each task's gradient is divided by its own loss, so every
task counts by its *relative* improvement.

The term whose backward pass the step runs is not the log itself but ``L_t / (K * Lbar_t)``, with
``Lbar_t`` the loss value averaged over ranks (one scalar all-reduce per task, held constant): its
gradient is ``grad L_t / (K Lbar_t)``. Under DDP each rank divides its own batch's loss by that same
rank-averaged value and DDP averages the ranks' gradients, so with equal per-rank batch sizes the step
follows ``grad L / (K L)`` for L the *global* batch's loss, the gradient of log of the global loss,
exactly as one process on the global batch (a per-rank log L_r would average grad L_r / L_r instead: a
different step for every world size). The term's value is 1/K (times L_r / Lbar on a rank), not
log L. The divisor is clamped at ``GLS_EPS`` (a zero loss gives a finite term). ``weights()`` reports
the coefficient of log L_t, 1/K. Stateless. A step that holds only some tasks (multi-input) takes the
geometric mean of the present ones: K is their number, K'.
"""

from __future__ import annotations

from mtl.parallel.dist import all_reduce_mean
from mtl.weighting.base import LossWeighting

GLS_EPS = 1e-12


class GLS(LossWeighting):
    name = "gls"

    def weigh(self, task, loss):
        # d log(L)/d theta = grad(L) / L with L the GLOBAL batch's loss. Each rank's term is its own loss
        # divided by the rank-averaged value (one scalar all-reduce), so that DDP's average of the
        # ranks' gradients is grad(L_global) / (K L_global), as in one process on the global batch.
        # log(L_r) per rank would average grad(L_r) / L_r instead: a different, world-size-dependent step.
        return loss / (len(self.present) * all_reduce_mean(loss.detach()).clamp_min(GLS_EPS))

    def weights(self):
        return {t: 1.0 / len(self.present) for t in self.tasks}  # the coefficient of log L_t in this step
