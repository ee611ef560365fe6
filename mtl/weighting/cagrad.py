"""CAGrad (Liu et al. 2021, "Conflict-Averse Gradient Descent for Multi-task Learning").

The update maximises the worst task's improvement within a ball around the mean gradient g_0::

    max_d min_t g_t . d     s.t.  ||d - g_0|| <= c ||g_0||,         g_0 = (1/K) sum_t g_t

Its dual is a K-dim problem over the simplex (phi = c^2 ||g_0||^2, g_w = sum_t w_t g_t)::

    w* = argmin_{w in simplex}  F(w) = g_w . g_0 + sqrt(phi) ||g_w||
    d  = g_0 + (sqrt(phi) / ||g_w*||) g_w*                                  (the paper's Algorithm 1)

Final rescale: Algorithm 1 steps along d itself; the authors' code (``rescale=1``, the setting of
their experiments, also LibMTL's default) divides it by (1 + c^2). We follow the code:
``CAGRAD_RESCALE = True`` returns d / (1 + c^2). With c = 0 both give exactly the mean gradient g_0.
``c = CAGRAD_C = 0.4`` (the paper's choice for its image benchmarks; c in [0, 1)).

Everything is a function of the K x K Gram matrix (||g_0||^2 = mean(GG^T), g_w . g_0 = w^T GG^T 1/K,
||g_w||^2 = w^T GG^T w), so the dual is solved in float64 on the CPU: for K = 2 exactly (to 1e-15 in
w) by golden-section search on the convex F(x, 1 - x); for K > 2 through its KKT system (a few non-negative QPs
along a parametric path, each support solved in closed form), with projected gradient descent on the simplex
(a backtracking line search) where that is not certified. A candidate is accepted where its KKT gap is below
``CAGRAD_KKT_TOL`` of the gradient's scale for float64 rows, and below the Gram matrix's own round-off for float32
rows (``kkt_tol``: ~1e-7, which 1e-12 asked for in vain). d is then ``alpha @ grads`` with
``alpha = (1/K + sqrt(phi)/||g_w|| * w) / (1 + c^2)``.

Degenerate input: if g_0 = 0 (e.g. exactly opposed gradients) then phi = 0 and d = g_0 = 0; if the
optimal g_w is 0 (a zero row, or opposed rows that cancel) the correction is dropped and d = g_0
(every direction in the ball is then equally good for the worst task). Non-finite input gives the
mean of the rows (non-finite: the trainer skips the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.base import GramWeighting, apply_weights, gram_matrix, gram_numpy, gram_round_off, like_gram
from mtl.weighting.checks import at_least
from mtl.weighting.qp import nonneg_qp

CAGRAD_C = 0.4  # radius of the ball around g_0, relative to ||g_0||
CAGRAD_RESCALE = True  # divide the update by 1 + c^2 (the authors' code, rescale=1)
CAGRAD_MAX_ITER = 2000  # projected-gradient iterations for K > 2
CAGRAD_SUPPORT_EVERY = 8  # K > 2: every so many iterations, try the stationary point on the iterate's support
CAGRAD_NEWTON_STEPS = 40  # its most non-negative QPs in each phase (bracket, Newton)
CAGRAD_KKT_TOL = 1e-12  # a candidate is the optimum when its KKT gap is below this times the gradient's scale
# ... for float64 rows; rows of lower precision give a Gram matrix with ~1e-7 relative round-off (``gram_round_off``),
# and the gap is asked to be below that instead (``kkt_tol``)


def kkt_tol(dtype: torch.dtype) -> float:
    """The KKT tolerance for a Gram matrix from rows of ``dtype``: ``CAGRAD_KKT_TOL``, or the Gram matrix's own
    relative round-off where that is larger (float32 and below: 1.2e-7)."""
    return max(CAGRAD_KKT_TOL, gram_round_off(dtype))


@dataclass
class DualSolve:
    """What ``cagrad_solve`` found: the dual's w, the projected-gradient iterations it ran (of ``max_iter``), whether
    w is certified the optimum (its KKT gap below the floor at the tolerance; K <= 2: always, the search is exact),
    and which step found it (closed form, golden section, parametric, support, projected gradient)."""

    w: np.ndarray
    iterations: int
    converged: bool
    how: str


def project_simplex(v: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {w >= 0, sum w = 1}."""
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    idx = np.arange(1, len(v) + 1)
    rho = np.nonzero(u - css / idx > 0)[0][-1]
    return np.maximum(v - css[rho] / (rho + 1.0), 0.0)


def dual_gap(m: np.ndarray, b: np.ndarray, sqrt_phi: float, w: np.ndarray,
             tol: float = CAGRAD_KKT_TOL) -> tuple[float, float]:
    """(KKT gap, its round-off floor) of a simplex point w of the dual: ``max_{w_t > 0} dF_t - min_t dF_t`` bounds
    F(w) - min F (F is convex), and is 0 exactly at the optimum (g_w != 0). The floor: the gradient's term
    ``sqrt(phi) m w / ||g_w||`` carries round-off ~ eps max_t ||g_t||^2 / ||g_w|| (tiny g_w: nearly opposed rows)."""
    q = float(w @ m @ w)
    if not q > 0:
        return math.inf, 0.0
    grad = b + sqrt_phi * (m @ w) / math.sqrt(q)
    dmax = float(np.max(np.diag(m)))
    scale = float(np.abs(b).max()) + sqrt_phi * math.sqrt(dmax) + sqrt_phi * dmax / math.sqrt(q)
    return float(grad[w > 0].max() - grad.min()), tol * scale


def support_solution(m: np.ndarray, b: np.ndarray, sqrt_phi: float, support: np.ndarray) -> np.ndarray | None:
    """The dual's stationary point with exactly ``support`` (bool, K) positive, or None if it has none.

    With v = sqrt(phi) w / ||g_w||, stationarity on the support is ``m_S v_S = lam 1 - b_S`` and the scale fixes
    ``v^T m v = phi``: v_S = lam p - r (p = m_S^+ 1, r = m_S^+ b_S), a quadratic in lam (the larger root: v grows
    with lam). A coordinate that comes out <= 0 leaves the support (twice at most), and w = v / sum(v)."""
    support = support.copy()
    for _ in range(3):
        idx = np.flatnonzero(support)
        if idx.size == 0:
            return None
        ms = m[np.ix_(idx, idx)]
        sol = np.linalg.lstsq(ms, np.stack([np.ones(idx.size), b[idx]], 1), rcond=None)[0]
        p, r = sol[:, 0], sol[:, 1]
        mp = ms @ p
        a2, b2, c2 = float(p @ mp), float(mp @ r), float(r @ ms @ r)
        disc = b2 * b2 - a2 * (c2 - sqrt_phi * sqrt_phi)
        if not (a2 > 0 and disc >= 0):
            return None
        v = (b2 + math.sqrt(disc)) / a2 * p - r
        if (v > 0).all():
            w = np.zeros(len(b))
            w[idx] = v / v.sum()
            return w
        support[idx[v <= 0]] = False
    return None


def parametric_solution(m: np.ndarray, b: np.ndarray, sqrt_phi: float,
                        tol: float = CAGRAD_KKT_TOL) -> np.ndarray | None:
    """The dual's optimum found through its KKT system, or None: v(lam) = argmin_{v >= 0} v^T m v + 2 (b - lam 1).v
    (``nonneg_qp``) has ``psi(lam) = v^T m v`` convex and non-decreasing in lam with slope 2 sum(v), so Newton from a
    lam with psi >= phi walks down to psi = phi; each v's support is tried in closed form (``support_solution``)."""
    dmax = float(np.max(np.diag(m)))
    phi = sqrt_phi * sqrt_phi
    lo, t = float(b.min()), max(sqrt_phi * math.sqrt(dmax), 1e-300)
    for _ in range(CAGRAD_NEWTON_STEPS):  # a lam above the root (psi = 0 for lam <= min b)
        lam = lo + t
        v = nonneg_qp(m, b - lam)
        psi = float(v @ m @ v)
        if psi >= phi:
            break
        t *= 4.0
    else:
        return None
    for _ in range(CAGRAD_NEWTON_STEPS):
        w = support_solution(m, b, sqrt_phi, v > 0)
        if w is not None:
            gap, floor = dual_gap(m, b, sqrt_phi, w, tol)
            if gap <= floor:
                return w
        slope = 2.0 * float(v.sum())
        if not (slope > 0 and psi > phi):
            return None
        lam -= (psi - phi) / slope
        v = nonneg_qp(m, b - lam)
        psi = float(v @ m @ v)
    return None


def cagrad_solve(m: np.ndarray, c: float, max_iter: int = CAGRAD_MAX_ITER,
                 tol: float = CAGRAD_KKT_TOL) -> DualSolve:
    """argmin over the simplex of w^T m 1/K + c ||g_0|| sqrt(w^T m w), for a symmetric PSD float64 Gram m, with how
    it was found (``DualSolve``). K > 2: the parametric (KKT) solution first; where it is not certified, projected
    gradient from 1/K, trying the stationary point on its support as it goes. A candidate is the optimum where its
    KKT gap is below the floor at ``tol`` (``kkt_tol``: a Gram matrix from float32 rows is known to ~1e-7 only)."""
    k = m.shape[0]
    b = m.mean(axis=1)  # g_t . g_0
    sqrt_phi = c * math.sqrt(max(float(m.mean()), 0.0))

    def f(w):
        return float(w @ b) + sqrt_phi * math.sqrt(max(float(w @ m @ w), 0.0))

    if k == 1:
        return DualSolve(np.ones(1), 0, True, "closed form")
    if k == 2:  # golden-section search on x = w_1 in [0, 1] (F is convex in x)
        lo, hi = 0.0, 1.0
        r = (math.sqrt(5.0) - 1.0) / 2.0
        x1, x2 = hi - r * (hi - lo), lo + r * (hi - lo)
        f1, f2 = f(np.array([x1, 1 - x1])), f(np.array([x2, 1 - x2]))
        for _ in range(80):
            if f1 <= f2:
                hi, x2, f2 = x2, x1, f1
                x1 = hi - r * (hi - lo)
                f1 = f(np.array([x1, 1 - x1]))
            else:
                lo, x1, f1 = x1, x2, f2
                x2 = lo + r * (hi - lo)
                f2 = f(np.array([x2, 1 - x2]))
        x = (lo + hi) / 2
        cands = [np.array([x, 1 - x]), np.array([1.0, 0.0]), np.array([0.0, 1.0])]
        return DualSolve(min(cands, key=f), 0, True, "golden section")

    eps = 1e-30 * max(float(np.max(np.diag(m))), 1e-300)

    def grad(w):
        return b + sqrt_phi * (m @ w) / math.sqrt(max(float(w @ m @ w), 0.0) + eps)

    def certified(w_new, w_old):  # w_new meets the KKT conditions to round-off, and is no worse than w_old
        if w_new is None:
            return False
        gap, floor = dual_gap(m, b, sqrt_phi, w_new, tol)
        return gap <= floor and f(w_new) <= f(w_old) + floor

    w = np.full(k, 1.0 / k)
    # the KKT system's own path: a few non-negative QPs, certified in closed form on their support (nearly opposed
    # rows, where projected gradient crawls, included); it was tried only after 100 projected-gradient iterations,
    # which cost 10x the parametric solution on the ill-conditioned rows of solve_cost (issue 44)
    cand = parametric_solution(m, b, sqrt_phi, tol)
    if certified(cand, w):
        return DualSolve(cand, 0, True, "parametric")
    fw = f(w)
    step = 1.0 / max(float(np.linalg.norm(m, 2)), 1e-300)
    support = None
    it = 0
    for it in range(1, max_iter + 1):
        gw = grad(w)
        while True:
            new = project_simplex(w - step * gw)
            diff = new - w
            fn = f(new)
            if fn <= fw + float(gw @ diff) + float(diff @ diff) / (2 * step) or step < 1e-300:
                break
            step *= 0.5
        w, fw = new, fn
        if float(np.abs(diff).max()) < 1e-13:
            break
        step *= 2.0
        # projected gradient finds the optimum's support long before it converges in w: solve the stationarity
        # conditions on the support it holds (once it is steady), and stop where they certify the optimum
        if it % CAGRAD_SUPPORT_EVERY == 1:
            if support is not None and (support == (w > 0)).all():
                cand = support_solution(m, b, sqrt_phi, support)
                if certified(cand, w):
                    return DualSolve(cand, it, True, "support")
            support = w > 0
    gap, floor = dual_gap(m, b, sqrt_phi, w, tol)
    return DualSolve(w, it, gap <= floor, "projected gradient")


def cagrad_dual(m: np.ndarray, c: float, max_iter: int = CAGRAD_MAX_ITER, tol: float = CAGRAD_KKT_TOL) -> np.ndarray:
    """argmin over the simplex of w^T m 1/K + c ||g_0|| sqrt(w^T m w), for a symmetric PSD float64 Gram m."""
    return cagrad_solve(m, c, max_iter, tol).w


@torch.no_grad()
def cagrad_weights(gram: Tensor, c: float = CAGRAD_C, rescale: bool = CAGRAD_RESCALE,
                   tol: float = CAGRAD_KKT_TOL) -> Tensor:
    """(K,) alpha with ``cagrad(grads) == alpha @ grads`` for the Gram matrix ``grads @ grads.T``; ``tol``: the dual's
    KKT tolerance (``kkt_tol`` of the rows' dtype)."""
    k = gram.shape[0]
    m = gram_numpy(gram)
    if m is None:
        return like_gram(np.full(k, 1.0 / k), gram)
    alpha = np.full(k, 1.0 / k)
    g0_sq = max(float(m.mean()), 0.0)
    if c > 0 and g0_sq > 0:
        w = cagrad_dual(m, c, tol=tol)
        gw_norm = math.sqrt(max(float(w @ m @ w), 0.0))
        if gw_norm > 1e-12 * math.sqrt(max(float(np.max(np.diag(m))), 0.0)):
            alpha = alpha + c * math.sqrt(g0_sq) / gw_norm * w
    if rescale:
        alpha = alpha / (1.0 + c * c)
    return like_gram(alpha, gram)


@torch.no_grad()
def cagrad(grads: Tensor, losses: Tensor | None = None, *, c: float = CAGRAD_C,
           rescale: bool = CAGRAD_RESCALE) -> Tensor:
    """(K, P) task gradients -> (P,) conflict-averse update (divided by 1 + c^2 when ``rescale``)."""
    return apply_weights(cagrad_weights(gram_matrix(grads), c, rescale, kkt_tol(grads.dtype)), grads)


@dataclass
class CAGradOptions:
    c: float = at_least(CAGRAD_C, 0)  # the radius of the ball around the average gradient (the paper's c; 0: equal weights)
    rescale: bool = CAGRAD_RESCALE  # divide the update by 1 + c^2, as the authors' code does


class CAGrad(GramWeighting):
    name = "cagrad"
    updates_from_present_tasks = True  # stateless: the K'-task problem of the present tasks (base.py)
    Options = CAGradOptions

    def weights_from_gram(self, gram, losses, dtype):
        return cagrad_weights(gram, self.options.c, self.options.rescale, kkt_tol(dtype))
