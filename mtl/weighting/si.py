"""SI, the scale-invariant baseline of Nash-MTL (Navon et al. 2022, its QM9 and scene tables): minimise
``sum_t log L_t``. Its authors' code is ``ScaleInvariantLinearScalarization`` (methods/weight_methods.py of
AvivNavon/nash-mtl): ``torch.sum(torch.log(losses))``, every task's weight 1, no epsilon.

The gradient of a task's part is ``grad L_t / L_t``: rescaling a task's loss by any c > 0 adds log c, a constant, to
the objective and leaves the step unchanged (the property that names it). ``gls`` is the same objective divided by
K: SI is K times gls's step, which matters to Adam only through its epsilon and to gradient clipping.

The term whose backward pass the step runs is ``L_t / Lbar_t``, with ``Lbar_t`` the loss value averaged over ranks
(one scalar all-reduce per task, held constant): its gradient is ``grad L_t / Lbar_t``, so that under DDP the
ranks' average is ``grad L / L`` of the *global* batch's loss, as one process on the global batch (as gls; a per-rank
log L_r would average grad L_r / L_r instead). The term's value is 1 (L_r / Lbar on a rank), not log L.

A zero loss: as the authors' code, no epsilon and no clamp. log 0 is -inf there; here the term is 0 / 0 and its
gradient grad L / 0: not finite, so the step's finite check skips that step on every rank (mtl/run/step.py) instead
of clamping it into a step the method does not define. A small positive loss gives the large, finite gradient
grad L / L, as the authors'. ``weights()`` reports the coefficient of log L_t, 1. Stateless. A step that holds only
some tasks (multi-input) sums the present tasks' logs.
"""

from __future__ import annotations

from mtl.parallel.dist import all_reduce_mean
from mtl.weighting.base import LossWeighting


class SI(LossWeighting):
    name = "si"

    def weigh(self, task, loss):
        # d log(L)/d theta = grad(L) / L with L the global batch's loss (see gls.py for why not log(L_r))
        return loss / all_reduce_mean(loss.detach())

    def weights(self):
        return {t: 1.0 for t in self.tasks}  # the coefficient of log L_t
