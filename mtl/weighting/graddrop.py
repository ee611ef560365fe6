"""GradDrop, gradient sign dropout (Chen et al. 2020, "Just Pick a Sign: Optimizing Deep Multitask Models
with Gradient Sign Dropout").

Per coordinate p of the K task gradients (the rows of G), the gradient positive sign purity::

    P_p = 1/2 (1 + sum_t G[t, p] / sum_t |G[t, p]|)                      in [0, 1]

(1 when every task pushes coordinate p up, 0 when every task pushes it down, 1/2 when they cancel).
With one uniform draw U_p ~ U[0, 1) per coordinate, shared by the tasks, the kept sign is + where
P_p > U_p and - where P_p < U_p, and each task keeps only its components of that sign::

    M[t, p] = [P_p > U_p] [G[t, p] > 0]  +  [P_p < U_p] [G[t, p] < 0]
    d_p     = sum_t (leak_t + (1 - leak_t) M[t, p]) G[t, p]               (leak = 0: the paper's default)

So at every coordinate the kept contributions share one sign, chosen positive with probability P_p:
a sign backed by most of the gradient mass usually wins, and a coordinate where all tasks agree is
never touched (P = 1 keeps every positive component, P = 0 every negative one), which makes d the
plain sum when no coordinate conflicts. ``weighting.options.leak`` (0..1, one value for every task)
keeps that fraction of the dropped components; leak = 1 is the plain sum.

Where it is applied: the paper inserts GradDrop at a layer of activations (and sums the sign over the
batch); here it acts on the coordinates of the shared parameters' gradients, the rows that
``ddp.strategy=task_grads`` hands to ``combine``. It needs the rows themselves (per-coordinate signs),
so it is not a function of the Gram matrix: it subclasses ``RowWeighting`` and defines ``combine``, and
a gradient source that offers only the Gram matrix cannot run it.

FSDP2 (``parallel.engine=fsdp2``): each rank holds only its columns of G, and GradDrop is exact column by column,
so each rank combines its own columns (``combine_shard``; tested against one process in tests/test_fsdp.py).

Randomness: U is drawn from a ``torch.Generator`` on the rows' device seeded with ``stream_seed(seed,
step, "graddrop")``; the rows are already averaged over ranks, so every rank draws the same U and
computes the same d, and a resumed run repeats the draws (the step comes from ``begin_step``).

``weights()`` reports, per task, the fraction of its squared norm that survived:
``(kept_t . g_t) / ||g_t||^2`` (1 for a task nothing was dropped from; 1.0 before the first step and
for a zero row). d is not a combination ``w^T G`` of the rows, so these are not its coefficients.

Degenerate input: zero rows contribute nothing; all-zero input gives d = 0; identical rows are
never in conflict (d = K g); exactly opposed rows have P = 1/2 everywhere, so each coordinate keeps
one task's component, at random. Non-finite input propagates (the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import RowWeighting, step_generator, verify_present
from mtl.weighting.checks import ranged


def sign_purity(grads: Tensor) -> Tensor:
    """(P,) P = 1/2 (1 + sum_t g_t / sum_t |g_t|) per coordinate (1/2 where every row is 0)."""
    total, mass = grads.sum(0), grads.abs().sum(0)
    return 0.5 * (1.0 + total / torch.where(mass > 0, mass, 1.0))


def graddrop_mask(grads: Tensor, uniform: Tensor) -> Tensor:
    """(K, P) bool: the components kept, given one uniform draw per coordinate."""
    purity = sign_purity(grads)
    return ((purity > uniform) & (grads > 0)) | ((purity < uniform) & (grads < 0))


@torch.no_grad()
def graddrop_parts(grads: Tensor, uniform: Tensor, leak: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(K, P) task gradients and (P,) uniform draws -> ((P,) direction, (K,) kept . g, (K,) g . g). Every output
    is column by column (the direction) or a sum over columns (the other two): any set of columns gives its part."""
    g = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
    factor = leak + (1.0 - leak) * graddrop_mask(g, uniform.to(g.dtype)).to(g.dtype)
    kept = factor * g
    return kept.sum(0).to(grads.dtype), (kept * g).sum(1), (g * g).sum(1)


def kept_fraction(kept_dot: Tensor, sq: Tensor) -> Tensor:
    """(K,) the fraction of each task's squared norm kept (1 for a zero row)."""
    return torch.where(sq > 0, kept_dot / torch.where(sq > 0, sq, 1.0), 1.0)


@torch.no_grad()
def graddrop(grads: Tensor, uniform: Tensor, leak: float = 0.0) -> tuple[Tensor, Tensor]:
    """(K, P) task gradients and (P,) uniform draws -> ((P,) direction, (K,) kept fraction of each squared norm)."""
    d, kept_dot, sq = graddrop_parts(grads, uniform, leak)
    return d, kept_fraction(kept_dot, sq)


@dataclass
class GradDropOptions:
    # fraction of each dropped component kept anyway (the paper's leak; 0: pure sign dropout, 1: the sum)
    leak: float = ranged(0.0, lambda v: 0 <= v <= 1, "must be in [0, 1]")


class GradDrop(RowWeighting):
    name = "graddrop"
    Options = GradDropOptions
    updates_from_present_tasks = True  # no state but the step's draws: the rows of the present tasks (base.py)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.seed = int(cfg.seed)

    def uniform(self, n: int, device) -> Tensor:
        """This step's (n,) uniform draws, the same on every rank."""
        gen = step_generator(self.seed, self.step, "graddrop", device)
        return torch.rand(n, generator=gen, device=device, dtype=torch.float32)

    @torch.no_grad()
    def combine(self, grads, losses=None):
        verify_present(self, grads.shape[0])
        d, kept = graddrop(grads, self.uniform(grads.shape[1], grads.device), self.options.leak)
        self.last_weights = kept  # weights(): the fraction of each task's squared gradient norm kept
        return d

    @torch.no_grad()
    def combine_shard(self, rows, index, total):
        """FSDP2: exact per shard. The mask at coordinate p reads only column p of G and U_p, so this rank's
        columns of d are ``graddrop`` of its columns of G with U's entries at the same coordinates (all P draws
        are made, as in ``combine``, and indexed: the same U as one process). The kept fractions are sums over
        columns: each rank's part of kept . g is summed over the ranks (partial sums), g . g is the Gram diagonal."""
        uniform = self.uniform(total, rows.device)[index.to(rows.device)]
        d, kept_dot, _ = graddrop_parts(rows, uniform, self.options.leak)
        return d, kept_dot

    def finish_shard(self, sums, gram):
        self.last_weights = kept_fraction(sums.to(gram.dtype), gram.diagonal())
