"""The two-objective toy problem of CAGrad (Liu et al. 2021, Fig. 1), also used by Nash-MTL (Navon et al. 2022).

Two losses of a point x = (x1, x2) in the plane. Above the x1 axis each is a log-valley (``h``), below it a
wide quadratic bowl (``q``), blended by the clamped tanh gates ``c1(x2)`` (on for x2 > 0) and ``c2(x2)``
(on for x2 < 0)::

    h1 = log max(|-0.5 (x1 + 7) + tanh(x2)|, 5e-6) + 6        q1 = ((x1 - 7)^2 + 0.1 (x2 + 8)^2) / 10 - 20
    h2 = log max(|-0.5 (x1 - 3) - tanh(x2) + 2|, 5e-6) + 6    q2 = ((x1 + 7)^2 + 0.1 (x2 + 8)^2) / 10 - 20
    c1 = max(tanh(x2 / 2), 0)                                 c2 = max(tanh(-x2 / 2), 0)
    f1 = s (h1 c1 + q1 c2)                                    f2 = h2 c1 + q2 c2

``s`` scales the first loss: 1 in CAGrad's figure, 0.1 in Nash-MTL's (their ``--scale``); the Pareto set does
not depend on it. In the bowl the two minima are at x1 = 7 (f1) and x1 = -7 (f2), and the Pareto set is the
curve between them where the two gradients are opposed: ``pareto_curve`` finds it numerically (the papers
draw it as the segment x2 = -8.3552, -7 <= x1 <= 7; it is x2 = -8.3551 at x1 = 0 and bends down to
x2 = -8.4345 at the ends, tests/test_bench_toy.py checks it is the set of non-dominated points).

``toy_losses`` is the torch definition (batched, for contours and the tests); ``toy_losses_and_jacobian``
is the same function with its hand-derived Jacobian in plain Python floats, which is what the benchmark
steps (a torch autograd pass per step would cost more than most methods' maths); the tests check the two
against each other.

``VARIANTS`` holds the two papers' versions: CAGrad's (s = 1, its three ``STARTS``) and Nash-MTL's (s = 0.1, its
five ``NASH_STARTS``, from its experiments/toy code). In Nash-MTL's we also shift each loss by its minimum over the
plane (``loss_minimum``, -19.9894 for the unscaled f1 and for f2; ``loss_offsets``): each loss is then >= 0 and 0
at its minimiser, so that the methods that use loss values as positive numbers (the gradient of log L_t is
g_t / L_t) can run. The shift changes no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import minimize_scalar
from torch import Tensor

LOWER = 5e-6  # the log-valleys' floor, as in the papers' code
STARTS = ((-8.5, 7.5), (-8.5, -5.0), (9.0, 9.0))  # CAGrad's three starting points
NASH_STARTS = ((-8.5, 7.5), (0.0, 0.0), (9.0, 9.0), (-7.5, -0.5), (9.0, -1.0))  # Nash-MTL's five (experiments/toy)
PARETO_X1 = (-7.0, 7.0)  # the Pareto set's ends: the minimisers of f2 and f1
CENTRE = (0.0, -8.3551)  # the minimiser of the mean (f1 + f2) / 2 at s = 1, the middle of the Pareto set


@dataclass(frozen=True)
class Variant:
    """One paper's version of the problem: the factor on f1, the starting points, and whether the losses are
    shifted by their minimum (f_t - min f_t >= 0)."""

    name: str
    scale: float
    starts: tuple[tuple[float, float], ...]
    shifted: bool


VARIANTS = {"cagrad": Variant("cagrad", 1.0, STARTS, False),
            "nashmtl": Variant("nashmtl", 0.1, NASH_STARTS, True)}


def _unscaled_f1_at(x2: float) -> float:
    return toy_losses_and_jacobian(PARETO_X1[1], x2)[0]


@lru_cache(maxsize=1)
def loss_minimum() -> tuple[float, float]:
    """(x2, value) of the minimum of the unscaled f1 over the plane, at x1 = 7 (f2's is the mirror image, at x1 = -7,
    with the same value): in the lower bowl, where f1 = q1 c2 (the upper half's f1 is >= log(5e-6) + 6 > -7)."""
    res = minimize_scalar(_unscaled_f1_at, bounds=(-10.0, -7.0), method="bounded", options={"xatol": 1e-12})
    return float(res.x), float(res.fun)


def loss_offsets(scale: float, shifted: bool) -> tuple[float, float]:
    """What is subtracted from (f1, f2): their minima (s * LOSS_MIN, LOSS_MIN) when ``shifted``, else zeros."""
    if not shifted:
        return 0.0, 0.0
    low = loss_minimum()[1]
    return scale * low, low


def toy_losses(x: Tensor, scale: float = 1.0, shifted: bool = False) -> Tensor:
    """(..., 2) points -> (..., 2) losses (f1, f2), minus their minima when ``shifted``."""
    x1, x2 = x[..., 0], x[..., 1]
    h1 = torch.clamp((0.5 * (-x1 - 7) - torch.tanh(-x2)).abs(), LOWER).log() + 6
    h2 = torch.clamp((0.5 * (-x1 + 3) + torch.tanh(-x2) + 2).abs(), LOWER).log() + 6
    q1 = ((-x1 + 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    q2 = ((-x1 - 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    c1 = torch.clamp(torch.tanh(x2 * 0.5), 0)
    c2 = torch.clamp(torch.tanh(-x2 * 0.5), 0)
    off1, off2 = loss_offsets(scale, shifted)
    return torch.stack([scale * (h1 * c1 + q1 * c2) - off1, h2 * c1 + q2 * c2 - off2], dim=-1)


def toy_losses_and_jacobian(x1: float, x2: float, scale: float = 1.0,
                            offsets: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, list[list[float]]]:
    """(f1 - offsets[0], f2 - offsets[1], J) at one point, J[t] = the gradient of f_t w.r.t. (x1, x2), in Python
    floats (``offsets``: ``loss_offsets(scale, shifted)``, computed once by the caller)."""
    t = math.tanh(x2)
    sech2 = 1.0 - t * t  # d tanh(x2) / dx2
    u1 = -0.5 * x1 - 3.5 + t  # h1 = log|u1| + 6
    u2 = -0.5 * x1 + 3.5 - t  # h2 = log|u2| + 6
    h1, h2 = math.log(max(abs(u1), LOWER)) + 6, math.log(max(abs(u2), LOWER)) + 6
    # d log|u| / du = 1/u where |u| >= LOWER, 0 on the floor (torch's clamp passes the gradient at the bound)
    r1 = 1.0 / u1 if abs(u1) >= LOWER else 0.0
    r2 = 1.0 / u2 if abs(u2) >= LOWER else 0.0
    dh1 = (-0.5 * r1, sech2 * r1)
    dh2 = (-0.5 * r2, -sech2 * r2)
    half = math.tanh(0.5 * x2)
    dhalf = 0.5 * (1.0 - half * half)
    c1, dc1 = (half, dhalf) if half >= 0 else (0.0, 0.0)
    c2, dc2 = (-half, -dhalf) if -half >= 0 else (0.0, 0.0)
    b = 0.1 * (x2 + 8) ** 2
    q1, q2 = ((x1 - 7) ** 2 + b) / 10 - 20, ((x1 + 7) ** 2 + b) / 10 - 20
    dq1 = (0.2 * (x1 - 7), 0.02 * (x2 + 8))
    dq2 = (0.2 * (x1 + 7), 0.02 * (x2 + 8))
    f1 = scale * (h1 * c1 + q1 * c2) - offsets[0]
    f2 = h2 * c1 + q2 * c2 - offsets[1]
    g1 = [scale * (dh1[0] * c1 + dq1[0] * c2), scale * (dh1[1] * c1 + h1 * dc1 + dq1[1] * c2 + q1 * dc2)]
    g2 = [dh2[0] * c1 + dq2[0] * c2, dh2[1] * c1 + h2 * dc1 + dq2[1] * c2 + q2 * dc2]
    return f1, f2, [g1, g2]


def _jacobian(points: Tensor) -> Tensor:
    """(N, 2) points -> (N, 2, 2) Jacobians by autograd (rows of the batch are independent)."""
    x = points.detach().clone().requires_grad_(True)
    f = toy_losses(x)
    rows = [torch.autograd.grad(f[:, t].sum(), x, retain_graph=True)[0] for t in range(2)]
    return torch.stack(rows, dim=1)


def _opposition(x1: Tensor, x2: Tensor) -> Tensor:
    """det [grad f1; grad f2]: zero where the two gradients are parallel."""
    jac = _jacobian(torch.stack([x1, x2], dim=1))
    return jac[:, 0, 0] * jac[:, 1, 1] - jac[:, 0, 1] * jac[:, 1, 0]


def pareto_curve(n: int = 281, lo: float = -9.5, hi: float = -7.5) -> np.ndarray:
    """(n, 2) points of the Pareto set: for x1 in [-7, 7], the x2 in [lo, hi] where the gradients are parallel
    (bisection on the determinant of the Jacobian, to float64 round-off)."""
    x1 = torch.linspace(*PARETO_X1, n, dtype=torch.float64)
    a = torch.full_like(x1, lo)
    b = torch.full_like(x1, hi)
    fa = _opposition(x1, a)
    if bool((fa * _opposition(x1, b) > 0).any()):
        raise ValueError("the bracket does not contain the Pareto set")
    for _ in range(60):
        m = (a + b) / 2
        fm = _opposition(x1, m)
        left = fa * fm > 0
        a, fa = torch.where(left, m, a), torch.where(left, fm, fa)
        b = torch.where(left, b, m)
    return torch.stack([x1, (a + b) / 2], dim=1).numpy()


def distance_to_curve(points: np.ndarray, curve: np.ndarray) -> np.ndarray:
    """(N,) Euclidean distance of each point to the polyline through ``curve``'s points."""
    p = np.asarray(points, dtype=np.float64).reshape(-1, 1, 2)
    a, b = curve[:-1][None], curve[1:][None]
    ab = b - a
    t = np.clip(((p - a) * ab).sum(-1) / (ab * ab).sum(-1), 0.0, 1.0)
    nearest = a + t[..., None] * ab
    return np.sqrt(((p - nearest) ** 2).sum(-1)).min(axis=1)
