"""Nash-MTL (Navon et al. 2022, "Multi-Task Learning as a Bargaining Game").

The update is the Nash bargaining solution ``d = sum_t alpha_t g_t`` with alpha > 0 solving::

    (G G^T alpha)_t = 1 / alpha_t         for every task t            (i.e. d . g_t = 1 / alpha_t)

We solve it exactly (the paper's Algorithm 1, "solve G^T G alpha = 1/alpha"), not by the authors'
sequence of cvxpy problems. It is the stationarity condition of the strictly convex
``f(alpha) = 1/2 alpha^T GG^T alpha - sum_t log alpha_t`` over alpha > 0, which is self-concordant:
damped Newton (step 1/(1 + lambda), lambda the Newton decrement) stays inside alpha > 0 and converges
quadratically. It runs in float64 on the CPU on the K x K Gram matrix, rescaled to unit diagonal
(``alpha_t = beta_t / ||g_t||`` with ``C beta = 1/beta``, C the cosine matrix), so the iteration does
not depend on the gradients' scale. For K = 2 this is a 2 x 2 Newton solve (a handful of steps).

Scale: d is invariant to rescaling any g_t (d . g_t = 1/alpha_t; for orthogonal gradients d is the
sum of the unit gradients). The authors' code divides GG^T by its Frobenius norm N before solving, but
their constraint multiplies alpha back by N (``alpha_t N (GG^T/N alpha)_t >= 1``) and their objective
is only scaled by 1/N, so the normalisation cancels: their alpha solves the same equation (to their
solver's accuracy). No cvxpy (but for the ``optim_niter`` option below).

Options (``weighting.options``, the authors' code's arguments):
- ``update_every`` (1): solve for alpha only at steps that are multiples of it and reuse the last alpha in
  between (the authors' ``update_weights_every``; the paper's speed-up experiments solve every few steps).
  The reused alpha is kept in ``state_dict()`` (extra state), so a resumed run continues with it.
  A step that holds only some tasks (multi-input) reuses it only if it holds the same tasks as the step that
  solved it, and solves afresh otherwise; so Nash-MTL over K tasks of which only S appear is Nash-MTL over S.
- ``max_norm`` (0: off): the authors' clip of the shared gradient's norm after the weighted backward
  (their code's default is 1.0): when ``||d|| = sqrt(alpha^T GG^T alpha)`` exceeds it, alpha is scaled down
  so that ||d|| = max_norm. It applies to the shared parameters' direction only; the trainer's
  ``optim.grad_clip`` clips the whole gradient after it. It is the authors' ``clip_grad_norm_(shared_parameters,
  max_norm)`` (their QM9 code: 1.0; the ``qm9`` bench preset sets it) up to that function's 1e-6. At the exact
  solution ``||d||^2 = sum_t alpha_t d . g_t = K``, so a max_norm below sqrt(K) scales every update to that norm.
  Off by default: ``optim.grad_clip`` already bounds the step.
- ``optim_niter`` (0: the exact solve above): alpha from the authors' own iteration instead, at most this many
  concave-convex steps (their code: 20), each a convex problem solved by cvxpy, warm-started from the alpha the last
  update returned and stopped by their rule (mtl/weighting/nash_cccp.py; the ``nash`` extra). The warm start is kept
  in ``state_dict()`` (extra state), per task, so a resumed run continues from it. docs/methods.md gives how far
  its alpha lies from the exact one on QM9's Gram matrices.

Existence: the equation has a solution iff 0 is not in the convex hull of the unit gradients (some
direction improves every task): ``mu = min_{a in simplex} a^T C a > 0``. ``solution_exists`` computes
mu exactly (a small non-negative least-squares problem, see its docstring) and where mu
exceeds ``NASH_EXISTS_TOL`` (float64 rows; ``NASH_EXISTS_TOL_F32`` for lower precisions, whose Gram
entries carry ~1e-7 noise) the equation itself is solved, to round-off, however nearly opposed the
gradients are (alpha ~ 1/sqrt(mu)). Newton starts from the best multiple of the ones vector, which
keeps the damped phase short when the solution is large.

Degenerate input:
- a zero row (||g_t||^2 <= 1e-12 max_s ||g_s||^2) gets alpha_t = 0 and is left out of the system
  (the equation has no solution for it); all-zero input gives d = 0.
- when no direction improves every task (mu <= the tolerance: 0 in the convex hull, e.g. exactly
  opposed gradients) the equation has no solution; then, and only then, a ridge ``NASH_RIDGE`` * I on
  the cosine matrix keeps it solvable: alpha becomes large (~1/sqrt(ridge)) and d ~ 0 (0 up to
  rounding for opposed gradients of any norms). (A fixed ridge everywhere, as before, perturbed the
  equation by ridge * beta_t^2, which for nearly opposed gradients left it off by up to 0.7.)
- non-finite input gives alpha = 1 (a non-finite update: the trainer skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, like_gram
from mtl.weighting.checks import at_least
from mtl.weighting.nash_cccp import cccp_nash, missing_solver
from mtl.weighting.qp import nonneg_qp

NASH_RIDGE = 1e-8  # added to the unit diagonal of the cosine matrix, only where no solution exists
NASH_EXISTS_TOL = 1e-12  # a solution exists if min over the simplex of a^T C a is above this (float64 rows)
NASH_EXISTS_TOL_F32 = 1e-6  # the same for float32 (or lower) rows: their Gram entries carry ~1e-7 noise
NASH_MAX_ITER = 1000  # damped Newton steps
NASH_TOL = 1e-24  # stop when the squared Newton decrement is below this


def default_exists_tol(dtype: torch.dtype) -> float:
    return NASH_EXISTS_TOL if dtype == torch.float64 else NASH_EXISTS_TOL_F32


def solution_exists(c: np.ndarray, tol: float) -> bool:
    """Whether ``c beta = 1/beta`` has a solution beta > 0, for a PSD float64 c with unit diagonal.

    It does iff ``f(beta) = 1/2 beta^T c beta - sum log beta`` is bounded below on beta > 0, i.e. iff
    ``mu = min_{a in simplex} a^T c a > 0`` (0 is not in the convex hull of the unit gradients). mu comes
    exactly from a non-negative least-squares problem (``nonneg_qp``, an active-set method)::

        P = min_{a >= 0} a^T c a + (sum a - 1)^2 = mu / (1 + mu)

    (write a = t a' with a' in the simplex: t^2 a'^T c a' + (t - 1)^2 is least at q / (1 + q), q =
    a'^T c a', increasing in q), and at its optimum P = 1 - sum a, so mu = (1 - s) / s with s = sum a.
    """
    return simplex_min(c) > tol


def simplex_min(c: np.ndarray) -> float:
    """mu = min_{a in simplex} a^T c a for a PSD float64 c: in closed form for two tasks, else from the NNLS
    problem in ``solution_exists``.

    Two tasks: a = (t, 1 - t) gives a^T c a = t^2 (c00 - 2 c01 + c11) - 2 t (c11 - c01) + c11, a parabola whose
    least point on [0, 1] is t* = (c11 - c01) / (c00 - 2 c01 + c11), clipped (the min-norm point of a segment, as
    in Sener & Koltun's MGDA solver). The denominator is the squared distance of the two points; it is 0 only for
    identical points, where every t gives c00."""
    if c.shape[0] == 2:
        c00, c01, c11 = float(c[0, 0]), float(c[0, 1]), float(c[1, 1])
        den = c00 - 2.0 * c01 + c11
        t = min(max((c11 - c01) / den, 0.0), 1.0) if den > 0 else 1.0
        return t * t * c00 + 2.0 * t * (1.0 - t) * c01 + (1.0 - t) * (1.0 - t) * c11
    return simplex_min_nnls(c)


def simplex_min_nnls(c: np.ndarray) -> float:
    """``simplex_min`` for any K, from the NNLS problem in ``solution_exists``."""
    ones = np.ones(c.shape[0])
    s = float(nonneg_qp(c + np.outer(ones, ones), -ones).sum())
    return (1.0 - s) / s if s > 0 else 0.0


def solve_nash(c: np.ndarray, max_iter: int = NASH_MAX_ITER, tol: float = NASH_TOL) -> np.ndarray:
    """beta > 0 with c @ beta = 1 / beta, for a PSD float64 matrix c where a solution exists (damped Newton).

    Newton on the self-concordant f above, from the best multiple of the ones vector (f(t 1) is least at
    t^2 = K / 1^T c 1: a good start when the solution is large, as for nearly opposed gradients). It
    stops when the squared Newton decrement is below ``tol`` or, in the quadratic phase, stops shrinking
    (round-off reached).
    """
    k = c.shape[0]
    beta = np.full(k, np.sqrt(k / max(float(c.sum()), 1e-300)))
    last = np.inf
    for _ in range(max_iter):
        grad = c @ beta - 1.0 / beta
        hess = c + np.diag(1.0 / beta**2)
        step = np.linalg.solve(hess, grad)
        lam2 = float(grad @ step)
        if lam2 < tol or (lam2 < 1e-10 and lam2 > 0.25 * last):
            break
        last = lam2
        lam = np.sqrt(max(lam2, 0.0))
        beta = beta - (step if lam < 0.25 else step / (1.0 + lam))
        beta = np.maximum(beta, 1e-300)  # in exact arithmetic the step never leaves beta > 0
    return beta


@torch.no_grad()
def nashmtl_weights(gram: Tensor, ridge: float = NASH_RIDGE, max_iter: int = NASH_MAX_ITER,
                    exists_tol: float = NASH_EXISTS_TOL) -> Tensor:
    """(K,) alpha solving (GG^T alpha)_t = 1/alpha_t for the Gram matrix ``grads @ grads.T``.

    ``ridge`` is added to the cosine matrix only where no solution exists (``solution_exists`` with
    ``exists_tol``); where one exists the equation itself is solved, to round-off.
    """
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.ones(k), gram)
    sq = np.diag(m).copy()
    alpha = np.zeros(k)
    active = sq > 1e-12 * max(float(sq.max()), 0.0)
    if active.any():
        norms = np.sqrt(sq[active])
        cos = m[np.ix_(active, active)] / np.outer(norms, norms)
        cos = (cos + cos.T) / 2
        if not solution_exists(cos, exists_tol):
            cos = cos + ridge * np.eye(len(norms))
        alpha[active] = solve_nash(cos, max_iter) / norms
    return like_gram(alpha, gram)


@torch.no_grad()
def nashmtl(grads: Tensor, losses: Tensor | None = None, *, ridge: float = NASH_RIDGE) -> Tensor:
    """(K, P) task gradients -> (P,) Nash bargaining update sum_t alpha_t g_t."""
    return apply_weights(nashmtl_weights(gram_matrix(grads), ridge, exists_tol=default_exists_tol(grads.dtype)), grads)


def clip_weights(alpha: Tensor, gram: Tensor, max_norm: float) -> Tensor:
    """alpha scaled so that ``||alpha @ grads|| <= max_norm`` (0: unchanged), from the Gram matrix."""
    if max_norm <= 0:
        return alpha
    norm = (alpha @ gram @ alpha).clamp_min(0.0).sqrt()
    return alpha * torch.where(norm > max_norm, max_norm / torch.where(norm > 0, norm, 1.0), 1.0)


@dataclass
class NashMTLOptions:
    update_every: int = at_least(1, 1)  # solve for alpha every this many steps, reuse it in between (the authors' update_weights_every)
    # clip the shared-parameter update to this norm (the authors' max_norm, 1.0 in their code); 0: off
    max_norm: float = at_least(0.0, 0, "0: no clip")
    # the authors' CCCP iteration, at most this many convex steps (their optim_niter, 20), warm-started; 0: exact solve
    optim_niter: int = at_least(0, 0, "0: the exact solve")


class NashMTL(GramWeighting):
    name = "nashmtl"
    updates_from_present_tasks = True  # the alpha it reuses is re-solved when the step holds other tasks
    Options = NashMTLOptions

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self.cached: list[float] | None = None  # the last solved alpha (reused while step % update_every != 0)
        self.cached_tasks: list[str] | None = None  # the tasks it was solved for (multi-input: maybe a subset)
        self.warm = [1.0] * len(self.tasks)  # optim_niter: each task's alpha from the last update (the next start)

    @classmethod
    def check(cls, cfg) -> list[str]:
        errors = super().check(cfg)
        niter = (cfg.weighting.get("options") or {}).get("optim_niter", 0)
        if isinstance(niter, int) and niter > 0 and missing_solver():
            errors.append(f"weighting.options.optim_niter: the authors' iteration {missing_solver()} "
                          "(or remove the option: the exact solve)")
        return errors

    def weights_from_gram(self, gram, losses, dtype):
        if self.cached is None or len(self.cached) != gram.shape[0] or self.cached_tasks != self.present \
                or self.step % self.options.update_every == 0:
            self.cached = self.solve(gram, dtype)
            self.cached_tasks = list(self.present)
        alpha = torch.tensor(self.cached, dtype=gram.dtype, device=gram.device)
        return clip_weights(alpha, gram, self.options.max_norm)

    def head_weights_of(self, weights):
        """alpha before ``max_norm``'s clip: the authors clip the shared parameters' gradient only."""
        return torch.tensor(self.cached, dtype=weights.dtype, device=weights.device)

    def solve(self, gram: Tensor, dtype: torch.dtype) -> list[float]:
        """alpha for the present tasks' Gram matrix: exact, or the authors' iteration from the warm start."""
        m = gram_numpy(gram) if self.options.optim_niter > 0 else None
        if m is None:  # the exact solve (also: a non-finite Gram matrix, alpha = 1, the warm start kept)
            return nashmtl_weights(gram, exists_tol=default_exists_tol(dtype)).tolist()
        start = np.array([self.warm[i] for i in self.present_index])
        alpha = cccp_nash(m, start, self.options.optim_niter)
        for i, a in zip(self.present_index, alpha.tolist()):
            self.warm[i] = a
        return alpha.tolist()

    def get_extra_state(self):
        return {"step": self.step, "cached": self.cached, "cached_tasks": self.cached_tasks, "warm": list(self.warm)}

    def set_extra_state(self, state):
        self.step = int(state["step"])
        self.cached = None if state["cached"] is None else [float(x) for x in state["cached"]]
        # a checkpoint from before multi-input kept the alpha of every task
        self.cached_tasks = state.get("cached_tasks", None if self.cached is None else list(self.tasks))
        self.warm = [float(x) for x in state.get("warm", [1.0] * len(self.tasks))]  # a checkpoint from before it
