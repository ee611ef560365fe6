"""A user's weighting method in one file (docs/benchmark.md, "Your own method in the sweep").

Each task's gradient is scaled to unit norm before they are summed: w_t = 1 / ||g_t||. The weights are a
function of the Gram matrix G G^T alone (its diagonal), so the method runs on either gradient source
(``weighting.source: parameters`` with ``task_grads``, or ``features`` with ``feature_leaf``), and it is
invariant to the scale of each task's loss. Use it with

    weighting_modules: [docs/examples/unit_gradients.py]
    weighting: {method: unit_gradients}
"""

from dataclasses import dataclass

import torch

from mtl.weighting.base import GramWeighting


class UnitGradients(GramWeighting):
    name = "unit_gradients"

    @dataclass
    class Options:
        eps: float = 1e-12  # added to each squared norm: a task with a zero gradient gets a finite weight

    def weights_from_gram(self, gram, losses, dtype):
        return 1.0 / torch.sqrt(torch.diagonal(gram) + self.options.eps)
