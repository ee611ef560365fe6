"""FORUM (Ye et al. 2024, "A First-Order Multi-Gradient Algorithm for Multi-Objective Bi-Level Optimization"),
for task weighting.

The multi-objective bilevel problem of MOML (mtl/weighting/moml.py): upper level ``min F_m(alpha, omega) =
L_m^val(omega)`` for m in P (every task unless ``weighting.options.primary`` names some), lower level
``omega in argmin f(alpha, omega) = sum_k alpha_k L_k(omega)``. FORUM replaces the lower level by the
value-function constraint ``q(z) = f(alpha, omega) - f(alpha, omega_T) <= 0`` over z = (alpha, omega), where
omega_T is T gradient steps on f(alpha, .) from omega (``inner_steps``, size ``inner_lr``), treated as a constant
(first order: no second derivatives), so::

    grad q = ( L(omega) - L(omega_T),  grad_omega f(alpha, omega) )          (the alpha part, the omega part)
    grad F_m = ( 0,  g_m ),   g_m = grad L_m^val(omega)

and moves z along the solution of ``min_d max_m <grad F_m, d> + |d|^2 / 2  s.t.  <grad q, d> <= -phi``,
``phi = rho/2 |grad q|^2``: by duality ``d = -(sum_m lam_m grad F_m + nu grad q)``, where (lam, nu), lam in the
simplex and nu >= 0, minimise ``|sum_m lam_m grad F_m + nu grad q|^2 / 2 - nu phi`` (``forum_dual``: exact, by
the KKT conditions on each support; M + 1 <= a dozen variables). The step, size eta::

    alpha <- Proj(alpha - eta nu (L(omega) - L(omega_T)))     (Proj: onto {alpha >= 0, sum alpha = K})
    omega <- omega - eta (nu grad_omega f(alpha, omega) + sum_m lam_m g_m)

Here eta is the optimizer's: omega's step is the real step, whose gradient is ``nu sum_k alpha_k grad L_k`` (the
losses weighed by ``nu alpha_k``, through the strategy, with the alpha of before the update) plus the held-out
term ``sum_m lam_m g_m`` (``meta_gradient``, added to ``.grad`` after the backward passes); alpha moves by a plain
step of the optimizer's current learning rate. So under FORUM the model DOES follow the held-out gradients: the
upper level is minimised over omega too, as in the paper (the held-out items are still never in a training
batch).

Choices, stated: ``inner_steps`` T = 1 of size ``inner_lr`` (0: the optimizer's current learning rate),
``rho`` = 0.1, alpha starting at 1 (``equal``) on the simplex scaled to K (the paper's constraint set for alpha is
the application's). ``weights()`` reports what multiplies the step's losses, nu alpha with the alpha of before
its update (logged as ``weight_<task>``; nu as ``meta_nu``, that alpha as ``meta_alpha/<task>``).

Cost of one meta update, M = |P| (``meta_cost``): T + 2 forwards and T + M backward passes over the whole
model, T + M whole-model all-reduces (the g_m in one collective), about M + 4 parameter-sized vectors held; the
real step then adds one vector to the gradients. Exact under DDP (mtl/weighting/bilevel.py): every gradient and
loss above is rank-averaged, so (lam, nu), alpha and the added gradient are the same on every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mtl.weighting.bilevel import BilevelWeighting, MetaInputs, ModelVector, flat_grad
from mtl.weighting.checks import above, at_least

FORUM_RHO = 0.1  # phi = rho/2 |grad q|^2: how fast the constraint's violation must fall
FORUM_INNER_STEPS = 1  # T: gradient steps that approximate the lower level's optimum


def forum_dual(gram: np.ndarray, phi: float) -> tuple[np.ndarray, float]:
    """(lam, nu) minimising ``u^T Q u / 2 - nu phi`` over u = (lam, nu), lam in the simplex, nu >= 0, where Q
    ((M+1) x (M+1), PSD) is the Gram matrix of (grad F_1, ..., grad F_M, grad q): the dual of FORUM's direction
    problem. Exact: the KKT system is solved on every support of u and the best point that satisfies every KKT
    condition is kept (M + 1 is small)."""
    m = gram.shape[0] - 1
    scale = max(float(np.abs(np.diag(gram)).max()), 1e-300)
    tol = 1e-9 * max(scale, abs(phi))
    lin = np.zeros(m + 1)
    lin[m] = -phi
    best, best_val = None, np.inf
    for r in range(1, m + 1):
        for sub in itertools.combinations(range(m), r):
            for with_nu in (False, True):
                idx = list(sub) + ([m] if with_nu else [])
                n = len(idx)
                a = np.zeros((n + 1, n + 1))
                a[:n, :n] = gram[np.ix_(idx, idx)]
                a[:r, n] = a[n, :r] = 1.0  # the simplex's equality, on the lam part
                rhs = np.concatenate([-lin[idx], [1.0]])
                sol = np.linalg.lstsq(a, rhs, rcond=None)[0]
                u = np.zeros(m + 1)
                u[idx] = sol[:n]
                if (u < -tol).any():
                    continue
                u = np.clip(u, 0.0, None)
                grad = gram @ u + lin + np.concatenate([np.full(m, sol[n]), [0.0]])  # + tau on the lam part
                if (grad < -tol * 10).any():  # a coordinate at 0 that would lower the objective
                    continue
                val = 0.5 * u @ gram @ u + lin @ u
                if val < best_val - tol:
                    best, best_val = u, val
    if best is None:  # rounding left no KKT point: the best simplex vertex with its optimal nu
        best = min((np.eye(m + 1)[i] for i in range(m)), key=lambda u: 0.5 * u @ gram @ u)
        q = gram[m, m]
        best[m] = max(0.0, (phi - gram[m, :m] @ best[:m]) / q) if q > 0 else 0.0
    return best[:m], float(best[m])


def project_scaled_simplex(x: Tensor, total: float) -> Tensor:
    """The Euclidean projection of ``x`` onto {y >= 0, sum y = total}."""
    u, _ = torch.sort(x, descending=True)
    css = torch.cumsum(u, 0) - total
    k = torch.arange(1, len(x) + 1, dtype=x.dtype, device=x.device)
    rho = int(torch.nonzero(u - css / k > 0).max())
    return torch.clamp(x - css[rho] / (rho + 1), min=0)


def forum_step(gram: Tensor, gap: Tensor, rho: float) -> tuple[Tensor, float, float]:
    """(lam, nu, phi) of one FORUM step from the Gram matrix (M+1, M+1) of (g_1, ..., g_M, grad_omega f) over
    omega: the alpha part of grad q (``gap`` = L(omega) - L(omega_T), (K,)) enters its last diagonal entry."""
    q = gram.detach().double().cpu().numpy().copy()
    q[-1, -1] += float((gap.double() ** 2).sum())
    phi = 0.5 * rho * q[-1, -1]
    lam, nu = forum_dual(q, phi)
    return torch.as_tensor(lam, dtype=gram.dtype), nu, phi


@dataclass
class FORUMOptions:
    rho: float = above(FORUM_RHO, 0)  # phi = rho/2 |grad q|^2
    inner_steps: int = at_least(FORUM_INNER_STEPS, 1)  # T
    inner_lr: float = at_least(0.0, 0, "0: the optimizer's learning rate")  # step size of the T inner steps
    init: float = above(1.0, 0)  # alpha of every task at the start (the simplex is scaled to K)
    primary: list[str] = field(default_factory=list)  # the upper level's objectives; empty: every task


class FORUM(BilevelWeighting):
    name = "forum"
    Options = FORUMOptions

    @classmethod
    def meta_cost(cls, num_tasks: int, inner_steps: int = FORUM_INNER_STEPS) -> dict:
        return {"meta_forwards": inner_steps + 2, "meta_backwards": inner_steps + num_tasks,
                "meta_allreduces": inner_steps + num_tasks, "meta_param_copies": num_tasks + 4}

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("lam", torch.full((k,), float(self.options.init)))  # alpha, the task weights
        self.register_buffer("coef", torch.full((k,), float(self.options.init)))  # nu alpha: the step's weights
        self._extra: Tensor | None = None

    def wants_heldout(self, step):  # every step is a FORUM step (its direction needs the held-out gradients)
        return True

    def meta_step(self, meta: MetaInputs) -> dict:
        mean = meta.comm.all_reduce_mean
        mv = ModelVector(meta.model)
        theta = mv.vector().requires_grad_(True)
        alpha = self.lam.detach().to(theta.dtype)
        losses = mv.losses(theta, meta.batch, self.tasks)
        g_f = flat_grad((alpha * losses).sum(), theta, mean)  # grad_omega f(alpha, omega)
        inner_lr = float(self.options.inner_lr) or float(meta.lr)
        omega, step_grad = theta.detach(), g_f
        for t in range(int(self.options.inner_steps)):
            omega = (omega - inner_lr * step_grad).requires_grad_(t + 1 < int(self.options.inner_steps))
            if t + 1 < int(self.options.inner_steps):
                step_grad = flat_grad((alpha * mv.losses(omega, meta.batch, self.tasks)).sum(), omega, mean)
                omega = omega.detach()
        with torch.no_grad():
            gap = mean(torch.cat([losses.detach(), mv.losses(omega, meta.batch, self.tasks)]).double())
            gap = gap[: len(self.tasks)] - gap[len(self.tasks):]
        values = mv.losses(theta, meta.heldout, self.primary)
        m = len(self.primary)
        g_val = mean(torch.stack([torch.autograd.grad(values[i], theta, retain_graph=i + 1 < m,
                                                      materialize_grads=True)[0] for i in range(m)]).detach())
        rows = torch.cat([g_val, g_f[None]])
        gram = (rows.double() @ rows.double().T)
        lam, nu, phi = forum_step(gram, gap, float(self.options.rho))
        stats = {"meta_nu": torch.tensor(nu), **{f"meta_lambda/{t}": lam[i] for i, t in enumerate(self.primary)},
                 **{f"meta_alpha/{t}": a for t, a in zip(self.tasks, self.lam.detach().clone())},
                 **{f"meta_gap/{t}": gap[i] for i, t in enumerate(self.tasks)},
                 **{f"meta_heldout_loss/{t}": v for t, v in zip(self.primary, mean(values.detach()))}}
        if bool(torch.isfinite(gram).all()) and bool(torch.isfinite(gap).all()):
            with torch.no_grad():
                self.coef.copy_(nu * self.lam)  # the real step's loss weights: nu alpha, alpha before its update
                new = self.lam.double() - float(meta.lr) * nu * gap.to(self.lam.device)
                self.lam.copy_(project_scaled_simplex(new, float(len(self.tasks))).to(self.lam.dtype))
                self._extra = (lam.to(g_val) @ g_val)
        return stats

    def meta_gradient(self) -> Tensor | None:
        extra, self._extra = self._extra, None
        return extra

    def weigh(self, task, loss):
        return self.coef[self.tasks.index(task)] * loss

    def weights(self):
        """nu alpha: what multiplies each task's loss in the step (alpha of before the meta update)."""
        return dict(zip(self.tasks, self.coef.tolist()))
