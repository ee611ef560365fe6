"""DB-MTL, dual-balancing multi-task learning (Lin et al. 2023, "Dual-Balancing for Multi-Task Learning").

Two balances. Loss scale: each task contributes the gradient of its log-loss, ``g_t / L_t`` (scale-free
in the loss). Gradient magnitude: an exponential moving average of those gradients is kept per task and
every task's average is rescaled to the largest one's norm::

    h_t(k)  = beta_k h_t(k-1) + (1 - beta_k) g_t(k) / L_t(k),      beta_k = beta / k^sigma,   h_t(0) = 0
    d(k)    = sum_t (max_s ||h_s(k)|| / ||h_t(k)||) h_t(k)

(as LibMTL's implementation, the paper's reference: no bias correction of the average, so its norm
builds up over the first ~1/(1 - beta) steps). ``weighting.options``: ``beta`` = 0.9 and ``sigma`` = 0
(a constant beta), LibMTL's defaults.

DDP: the rows g_t and the losses L_t that ``combine`` receives are the rank-averaged ones (the global
batch's gradient and loss), so ``g_t / L_t`` is the gradient of log L_t of the global batch, exactly as
one process on the global batch; every rank keeps the same averages.

It needs the rows (the average h is a K x P matrix, not a function of this step's Gram matrix), so it
subclasses ``RowWeighting`` and defines ``combine``. **Cost:** the K x P average is kept between steps,
as much memory again as the task-gradient matrix G, and updated in place (one K x P temporary per step); it is
part of ``state_dict()`` (extra state), so checkpoints grow by K x P numbers; a K x P update per step, no solver.

``weights()`` reports ``max_s ||h_s|| / (||h_t|| L_t)``, the factor on this step's g_t inside the update's
newest term (1.0 before the first step). Degenerate input: a zero average row gets factor 0 (nothing to
rescale); a loss at or below 1e-8 divides by 1e-8 (LibMTL adds 1e-8 inside the log). Non-finite rows
or losses leave the average unchanged and give a non-finite update (the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import RowWeighting, all_finite, kept_rows_refusal, verify_present
from mtl.weighting.checks import at_least, ranged

DBMTL_EPS = 1e-8


@torch.no_grad()
def dbmtl_average(average: Tensor | None, grads: Tensor, losses: Tensor, beta: float) -> Tensor:
    """The new (K, P) average ``beta h + (1 - beta) g / L`` (h = 0 when ``average`` is None)."""
    log_grads = grads / losses.to(grads.dtype).clamp_min(DBMTL_EPS)[:, None]
    if average is None:
        return (1.0 - beta) * log_grads
    return beta * average + (1.0 - beta) * log_grads


@torch.no_grad()
def dbmtl_scales(average: Tensor) -> Tensor:
    """(K,) max_s ||h_s|| / ||h_t|| (0 for a zero row)."""
    norms = average.norm(dim=1)
    return torch.where(norms > 0, norms.max() / torch.where(norms > 0, norms, 1.0), 0.0)


@dataclass
class DBMTLOptions:
    beta: float = ranged(0.9, lambda v: 0 <= v < 1, "must be in [0, 1)")  # EMA rate of the log-loss gradients (LibMTL's DB_beta)
    sigma: float = at_least(0.0, 0)  # the rate at step k is beta / k^sigma (LibMTL's DB_beta_sigma; 0: constant)


# Multi-input steps that hold only some tasks S: the update is over S alone (the largest norm among S), only
# h_S moves, and each task counts its own updates for beta_k (h_t(0) = 0 for a task not yet seen, which gives
# the same first average as a fresh start); so DB-MTL over K tasks of which only S appear is DB-MTL over S.


class DBMTL(RowWeighting):
    name = "dbmtl"
    updates_from_present_tasks = True  # only the present tasks' averages and step counts move
    fsdp2_refusal = kept_rows_refusal("K x P average h") + (" (and its norms need the rank-averaged losses first: a "
                                                            "second collective)")
    Options = DBMTLOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.updates = [0] * len(self.tasks)  # per task: combinations that moved its average so far (k - 1)
        self.average: Tensor | None = None  # (K, P) h, created at the first combination

    @torch.no_grad()
    def combine(self, grads, losses=None):
        if losses is None:
            raise ValueError("dbmtl needs the task losses (the gradient of log L_t is g_t / L_t)")
        verify_present(self, grads.shape[0])
        work = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
        idx = self.present_index
        counts = {self.updates[i] for i in idx}
        if len(counts) == 1:  # the usual case (always, with every task in every step): one scalar rate
            beta = self.options.beta / (counts.pop() + 1) ** self.options.sigma
        else:
            beta = torch.tensor([self.options.beta / (self.updates[i] + 1) ** self.options.sigma for i in idx],
                                device=work.device, dtype=work.dtype)[:, None]
        if len(idx) == len(self.tasks):  # every task: the average moves in place (no further K x P copy)
            new, ok = self._update_in_place(work, losses.to(work.device), beta)
        else:
            new, ok = self._update_part(work, losses.to(work.device), beta, idx)
        scales = dbmtl_scales(new)
        rate = 1.0 - beta if isinstance(beta, float) else (1.0 - beta[:, 0])
        # weights(): each task's factor on its gradient
        self.last_weights = scales * rate / losses.to(work.device, work.dtype).clamp_min(DBMTL_EPS)
        return (scales @ new).to(grads.dtype)

    def _update_in_place(self, work: Tensor, losses: Tensor, beta) -> tuple[Tensor, bool]:
        """``dbmtl_average`` with every task present, computed in the average itself: the same products and sum,
        so the same numbers, with one K x P temporary (the scaled log-loss gradients) instead of four. Returns (the
        new average, whether it was finite and kept)."""
        term = (work / losses.to(work.dtype).clamp_min(DBMTL_EPS)[:, None]).mul_(1.0 - beta)  # (1 - beta) g / L
        if not all_finite(term):  # a skipped step must not poison the average: leave it
            prev = None if self.average is None else self.average.to(device=work.device, dtype=work.dtype)
            return term if prev is None else prev * beta + term, False
        if self.average is None:
            self.average = term
        else:  # (a finite average and term whose sum overflows, past 1e38 in float32, would not be caught)
            self.average = self.average.to(device=work.device, dtype=work.dtype).mul_(beta).add_(term)
        for i in self.present_index:
            self.updates[i] += 1
        return self.average, True

    def _update_part(self, work: Tensor, losses: Tensor, beta, idx: list[int]) -> tuple[Tensor, bool]:
        """Only some tasks present: their rows of the average move (a task not yet seen has h = 0, whose average is
        the fresh start's)."""
        prev = None if self.average is None else self.average[idx].to(device=work.device, dtype=work.dtype)
        new = dbmtl_average(prev, work, losses, beta)
        ok = all_finite(new)
        if ok:  # a skipped step must not poison the average
            if self.average is None:
                self.average = torch.zeros(len(self.tasks), new.shape[1], dtype=new.dtype, device=new.device)
            self.average[idx] = new.to(self.average)
            for i in idx:
                self.updates[i] += 1
        return new, ok

    def get_extra_state(self):
        return {"updates": list(self.updates), "average": self.average}

    def set_extra_state(self, state):
        u = state["updates"]
        self.updates = [int(u)] * len(self.tasks) if isinstance(u, int) else [int(x) for x in u]  # an int: before
        average = state["average"]  # our own copy: the average then moves in place, and the state's tensor is not ours
        self.average = None if average is None else average.clone()
