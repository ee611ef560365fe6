"""Nash-MTL's own iteration for alpha (the authors' code, ``NashMTL.solve_optimization``): ``nashmtl(optim_niter=N)``.

The exact solve (mtl/weighting/nashmtl.py) finds alpha > 0 with ``(M alpha)_t = 1 / alpha_t``, M = G G^T. The
authors instead run at most ``optim_niter`` (20) steps of the concave-convex procedure on

    min_alpha  sum_t (M alpha)_t + phi(alpha)   s.t.  alpha_t (M alpha)_t >= 1,  alpha >= 0,
    phi(alpha) = sum_t log alpha_t + log (M alpha)_t      (concave)

each step tau a convex problem: phi linearised at the previous iterate alpha_tau, i.e. the linear objective
``(1^T M + grad phi(alpha_tau))^T alpha`` with ``grad phi(a) = 1/a + M (1 / (M a))`` over the same convex set. As in
their code: M is divided by its Frobenius norm N (the constraint becomes ``alpha_t (M/N alpha)_t >= 1/N``, the
objective is divided by N: the same problem, better scaled for the solver); the first iterate is the alpha the last
update returned (ones before the first: the warm start, kept by the caller between steps and in its checkpoint);
and after each solve it stops, keeping the iterate it solved FROM (not the new solution), when

    the solve failed (no solution: e.g. a zero gradient, whose constraint no alpha meets),
    || (M/N) alpha_tau - 1/(alpha_tau + 1e-10) || < 1e-3                 (their residual, on the normalised M), or
    || alpha_new - alpha_tau || < 1e-6,

else it moves to the new solution; after ``optim_niter`` solves it returns the last one. (Their residual test is on
the normalised system, whose solution is sqrt(N) times the one the constraints aim at, so it fires only where
N is near 1; the step-length test and the step cap are the ones that stop it in practice.)

What differs from their code: each convex problem is solved by Clarabel (the solver cvxpy 1.9 uses for exponential
cones; their ECOS, max 100 iterations, is no dependency of cvxpy any more), in float64 (theirs: float32's Gram
matrix); the problem is built once per task count with M/N, the objective's coefficients and log N as cvxpy
parameters (theirs re-canonicalises it at each solve), which solves the same problem. cvxpy and Clarabel come from
the ``nash`` extra.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import numpy as np

CCCP_RESIDUAL_TOL = 1e-3  # their _stop_criteria: ||(M/N) alpha - 1/(alpha + 1e-10)|| below this
CCCP_STEP_TOL = 1e-6  # their _stop_criteria: ||alpha_new - alpha|| below this
NASH_EXTRA = "cvxpy and Clarabel: pip install -c constraints.txt -e '.[nash]'"


def missing_solver() -> str | None:
    """What is missing for the iteration (the ``nash`` extra), or None."""
    if all(importlib.util.find_spec(m) is not None for m in ("cvxpy", "clarabel")):
        return None
    return f"needs {NASH_EXTRA}"


@functools.lru_cache(maxsize=8)
def _problem(k: int):
    """The convex step for k tasks: (problem, alpha, M/N, objective coefficients, -log N), the last three parameters."""
    import cvxpy as cp  # import here: an optional dependency (the nash extra), needed only with optim_niter

    alpha = cp.Variable(k, nonneg=True)
    gram, coef, rhs = cp.Parameter((k, k)), cp.Parameter(k), cp.Parameter()
    problem = cp.Problem(cp.Minimize(coef @ alpha), [cp.log(alpha) + cp.log(gram @ alpha) >= rhs])
    return problem, alpha, gram, coef, rhs


def cccp_step(m: np.ndarray, norm: float, prev: np.ndarray) -> np.ndarray | None:
    """One convex step from ``prev`` for the normalised Gram matrix ``m`` = M/N: the new alpha, or None where the
    solver found none."""
    import cvxpy as cp  # import here: an optional dependency (the nash extra), needed only with optim_niter

    problem, alpha, gram, coef, rhs = _problem(m.shape[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        grad_phi = 1.0 / prev + m @ (1.0 / (m @ prev))
    lin = m.sum(axis=0) + grad_phi / norm  # 1^T (M/N) + grad phi / N: their objective, divided by N
    if not np.isfinite(lin).all():
        return None
    gram.value, coef.value, rhs.value = m, lin, -np.log(norm)
    try:
        with warnings.catch_warnings():  # "Solution may be inaccurate": used all the same, as the authors' code does
            warnings.simplefilter("ignore", UserWarning)
            # a fresh Clarabel solver each time: its answer depends on the data only, not on the solves before it
            # (cvxpy's warm start updates the last solver in place; the authors' ECOS has no warm start)
            problem.solve(solver=cp.CLARABEL, warm_start=False)
    except cp.error.SolverError:
        return None
    return None if alpha.value is None else np.asarray(alpha.value, dtype=np.float64)


def cccp_nash(gram: np.ndarray, warm: np.ndarray, niter: int, report: dict | None = None) -> np.ndarray:
    """alpha from at most ``niter`` CCCP steps on the float64 Gram matrix ``gram`` (K x K, finite), from ``warm``
    (the last update's alpha; ones at first), with the authors' stopping rule (module docstring). ``report``, if
    given, gets ``steps`` (the steps taken) and ``stop`` (what ended it: failed, residual, step or cap)."""
    if missing_solver():
        raise ImportError(f"nashmtl(optim_niter=...) {missing_solver()}")
    norm = float(np.linalg.norm(gram))
    alpha, steps, stop = np.array(warm, dtype=np.float64), 0, "cap"
    if not norm > 0:  # every gradient zero: no step can be solved, as in their code the warm start stays
        niter, stop = 0, "failed"
    m = gram / norm if norm > 0 else gram
    for _ in range(niter):
        new = cccp_step(m, norm, alpha)
        if new is None:
            stop = "failed"
            break
        if np.linalg.norm(m @ alpha - 1.0 / (alpha + 1e-10)) < CCCP_RESIDUAL_TOL:
            stop = "residual"
            break
        if np.linalg.norm(new - alpha) < CCCP_STEP_TOL:
            stop = "step"
            break
        alpha, steps = new, steps + 1
    if report is not None:
        report.update(steps=steps, stop=stop)
    return alpha
