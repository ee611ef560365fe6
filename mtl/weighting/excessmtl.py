"""ExcessMTL (He et al. 2024, "Robust Multi-Task Learning with Excess Risks").

Task weights move towards the tasks with the largest *excess* risk (how far a task is from its own
best), not the largest loss, so a task with high irreducible noise does not take over. The excess risk
of task t is estimated from a second-order expansion with a diagonal AdaGrad-style Hessian estimate::

    S_t(k)   = S_t(k-1) + g_t(k)^2                       (per coordinate, accumulated since the start)
    e_t(k)   = g_t^T diag(1 / sqrt(S_t(k) + 1e-7)) g_t    (the estimated excess risk)
    w(k)     = w(k-1) * exp(eta * e(k) / e(1)),  then w <- K w / sum(w)      (exponentiated gradient; w(0) = 1)
    d(k)     = sum_t w_t(k) g_t(k)

(the authors' code, as in LibMTL: the first step only records e(1), the normaliser of later steps, and
keeps w = 1; the weights of a step are updated before they are used). ``weighting.options.eta`` = 1e-2
(the robust step size, the authors' and LibMTL's default).

DDP: the rows are the rank-averaged gradients, so S, e and w are those of one process on the global
batch, identical on every rank.

It needs the rows: S is a per-coordinate K x P accumulator. **Cost:** S is kept between steps (as much
memory again as the task-gradient matrix G; it moves in place, with temporaries one row long) and is part of
``state_dict()`` (extra state), so checkpoints grow by K x P numbers; a K x P update per step, no solver.
``weights()`` reports w. Degenerate input: a task whose first e is 0 (a zero gradient) keeps its normaliser at 1e-12 (its later e are
compared against that floor); non-finite rows leave S and w unchanged (the trainer skips the step).

Multi-input steps that hold only some tasks S: d = sum_{t in S} w_t g_t over their rows; only S_t of the present
tasks accumulate; a task's first step records its own e(1) (NaN until then) and keeps its weight; the tasks of S
seen before move by the update above, and w_S is renormalised to keep its sum (all K keep summing to K). So
ExcessMTL over K tasks of which only S appear is ExcessMTL over S, and an absent task's state does not move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mtl.weighting.base import RowWeighting, all_finite, apply_weights, kept_rows_refusal, verify_present
from mtl.weighting.checks import at_least

EXCESS_EPS = 1e-7  # inside the square root of the accumulated squares, as the authors' code
EXCESS_MIN_NORMALISER = 1e-12


@torch.no_grad()
def excess_risks(accum: Tensor, grads: Tensor) -> Tensor:
    """(K,) e_t = g_t^T diag(1 / sqrt(S_t + eps)) g_t, with S already including this step's g^2. One row at a
    time: the temporaries are P long, not K x P."""
    return torch.stack([(g * g).div_((s + EXCESS_EPS).sqrt_()).sum() for s, g in zip(accum, grads)])


@torch.no_grad()
def accumulate_squares_(accum: Tensor, grads: Tensor) -> bool:
    """S <- S + g^2 in place, one row at a time (the same numbers as ``accum + grads * grads``), when the result is
    sure to be finite: finite rows whose largest square plus the largest S stays below the dtype's largest number.
    Returns False, and leaves S as it was, otherwise."""
    lo, hi = grads.aminmax()
    top = max(-float(lo), float(hi))
    if not math.isfinite(top) or top * top + float(accum.max()) >= torch.finfo(accum.dtype).max:
        return False
    for s, g in zip(accum, grads):
        s.add_(g * g)
    return True


@torch.no_grad()
def excess_update(weights: Tensor, risks: Tensor, normaliser: Tensor, eta: float) -> Tensor:
    """w * exp(eta e / e(1)), renormalised to sum K."""
    w = weights * torch.exp(eta * risks / normaliser)
    return w * (w.numel() / w.sum())


@dataclass
class ExcessMTLOptions:
    eta: float = at_least(1e-2, 0)  # step size of the exponentiated-gradient update of the task weights (robust_step_size)


class ExcessMTL(RowWeighting):
    name = "excessmtl"
    updates_from_present_tasks = True  # only the present tasks' accumulators, normalisers and weights move
    fsdp2_refusal = kept_rows_refusal("K x P accumulator S")
    Options = ExcessMTLOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.register_buffer("task_weights", torch.ones(len(self.tasks), dtype=torch.float64))
        self.accum: Tensor | None = None  # (K, P) S
        self.normaliser: Tensor | None = None  # (K,) e(1)

    def weights(self):
        return dict(zip(self.tasks, self.task_weights.tolist()))

    @torch.no_grad()
    def combine(self, grads, losses=None):
        verify_present(self, grads.shape[0])
        idx = self.present_index
        if len(idx) < len(self.tasks):
            return self._combine_present(grads, idx)
        work = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
        prev = None if self.accum is None else self.accum.to(device=work.device, dtype=work.dtype)
        if prev is not None and prev is self.accum and accumulate_squares_(prev, work):
            accum, ok = prev, True  # S moved in place: no second K x P accumulator
        else:  # the first step, another device or dtype, or a sum that might not be finite
            accum = work * work if prev is None else prev + work * work
            ok = all_finite(accum)
        risks = excess_risks(accum, work).double()
        if ok:  # a skipped step must not poison the state
            self.accum = accum
            if self.normaliser is None:
                self.normaliser = risks.clamp_min(EXCESS_MIN_NORMALISER)
            elif bool(torch.isnan(self.normaliser).any()):  # some task not yet seen (multi-input)
                self._move(list(range(len(self.tasks))), risks)
            else:
                w = excess_update(self.task_weights, risks.to(self.task_weights.device),
                                  self.normaliser.to(self.task_weights.device), self.options.eta)
                self.task_weights.copy_(w)
        return apply_weights(self.task_weights, grads)

    @torch.no_grad()
    def _combine_present(self, grads: Tensor, idx: list[int]) -> Tensor:
        """A step that holds the tasks ``idx`` only (see the module docstring)."""
        work = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
        k = len(self.tasks)
        accum = work * work if self.accum is None else \
            self.accum[idx].to(device=work.device, dtype=work.dtype) + work * work  # an unseen task's row is 0
        risks = excess_risks(accum, work).double()
        if all_finite(accum):
            if self.accum is None:
                self.accum = torch.zeros(k, work.shape[1], dtype=work.dtype, device=work.device)
            self.accum[idx] = accum.to(self.accum)
            if self.normaliser is None:
                self.normaliser = torch.full((k,), float("nan"), dtype=torch.float64, device=risks.device)
            self._move(idx, risks)
        return apply_weights(self.task_weights[idx], grads)

    def _move(self, idx: list[int], risks: Tensor) -> None:
        """Record e(1) of the tasks of ``idx`` not yet seen; move the others' weights; keep the sum of w[idx]."""
        dev = self.task_weights.device
        norm = self.normaliser.to(dev)
        part, risks = norm[idx], risks.to(dev)
        seen = ~torch.isnan(part)
        if bool(seen.any()):
            w = self.task_weights[idx] * torch.where(seen, torch.exp(self.options.eta * risks / part), 1.0)
            rest = [i for i in range(len(self.tasks)) if i not in idx]
            total = len(self.tasks) - (float(self.task_weights[rest].sum()) if rest else 0)
            self.task_weights[idx] = w * (total / w.sum())
        norm[idx] = torch.where(seen, part, risks.clamp_min(EXCESS_MIN_NORMALISER))
        self.normaliser = norm

    def get_extra_state(self):
        return {"accum": self.accum, "normaliser": self.normaliser}

    def set_extra_state(self, state):
        accum = state["accum"]  # our own copy: S then moves in place, and the state's tensor is not ours
        self.accum, self.normaliser = None if accum is None else accum.clone(), state["normaliser"]
