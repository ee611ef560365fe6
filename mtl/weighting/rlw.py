"""RLW, random loss weighting (Lin et al. 2022, "Reasonable Effectiveness of Random Weighting").

At every step the loss weights are drawn afresh::

    z ~ N(0, I_K),     w = softmax(z),     term_t = w_t * L_t

(the paper's default: standard-normal samples through a softmax, so sum_t w_t = 1; equal weighting
has sum K). The draw happens once per step, in ``begin_step(step)``, from a ``torch.Generator``
seeded with ``stream_seed(cfg.seed, step, "rlw")`` (a hash of the three): every rank draws the same weights with
no communication, the weights do not depend on how many draws happened before, and a resumed run
repeats them exactly. The seed and the current step are kept in ``state_dict()`` (extra state). A step that
holds only some tasks (multi-input) draws K' weights for its present tasks (RLW over them).
"""

from __future__ import annotations

import torch

from mtl.weighting.base import LossWeighting, step_generator


def rlw_weights(seed: int, step: int, k: int) -> list[float]:
    """softmax of K standard-normal samples drawn from the (seed, step) stream."""
    gen = step_generator(seed, step, "rlw")
    z = torch.randn(k, generator=gen, dtype=torch.float64)
    return torch.softmax(z, dim=0).tolist()


class RLW(LossWeighting):
    name = "rlw"

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.seed = int(cfg.seed)
        self.begin_step(0)

    def begin_step(self, step, present=None):
        super().begin_step(step, present)
        self._w = dict(zip(self.present, rlw_weights(self.seed, self.step, len(self.present))))

    def weigh(self, task, loss):
        return loss * self._w[task]

    def weights(self):
        return dict(self._w)

    def get_extra_state(self):
        return {"seed": self.seed, "step": self.step}

    def set_extra_state(self, state):
        self.seed = int(state["seed"])
        self.begin_step(state["step"])
