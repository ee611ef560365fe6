"""The gradient-level methods' own solve, timed beside independent implementations: ``python -m
mtl.tools.bench.solve_cost``.

    python -m mtl.tools.bench.solve_cost [--k 2 11 40] [--methods cagrad pcgrad ...] [--rounds 15] [--seeds 3]

What is timed: ours, ``weights_for_gram(gram, losses, dtype)`` of a method built as a run builds it (the K x K float64
Gram matrix in, the K weights out: what a step adds to the backward passes and the Gram product); the reference,
the same computation as the library's code does it, from the Gram matrix where that code starts from it (LibMTL's
CAGrad and Aligned-MTL, TorchJD's aggregators) and from the K x 64 rows where it works on the rows (LibMTL's
PCGrad, IMTL-G, GradVac and MGDA (its MinNormSolver); TorchJD's ConFIG). The references are small re-implementations of the libraries' code
written for this benchmark, each labelled with where it comes from; they are not the project's code and nothing
imports them. One is the library itself: TorchJD 0.18's own CAGrad (``torchjd.aggregation.CAGradWeighting``, cvxpy's
Clarabel on the dual), installed by the dev extra (``torchjd[cagrad]``) and timed where it is installed.

Matrices: ``random``, K x 64 Gaussian rows; ``ill``, the case that cost CAGrad 60 ms at K = 11 (issue 34): two
nearly opposed rows (g, -g + 0.01 noise) and K - 2 rows 10x smaller, so the Gram matrix is nearly singular and 0
is nearly in the rows' hull. Rows in float32 (the Gram matrix from float32 rows, as ``gram_matrix`` forms it) and
float64. Each (method, K, kind, dtype) alternates ours and the reference ``rounds`` times on each of ``seeds``
matrices, in one process, each call timed right after an untimed call of the same function (warm: a long
reference, LibMTL's MGDA loop for example, leaves the caches cold for whatever runs next, which made ours 4x slower
in its wake); the table gives a row per reference: the medians and ours / the reference. CPU only; one thread.

``ref error``: how far the reference's answer is from ours (the largest over the seeds), so that a faster but
inexact reference shows as such. MGDA: ``||d_ref|| / ||d_ours|| - 1`` (ours is certified the min-norm point: its
KKT gap is below 1e-12 of the largest squared norm, 1.2e-7 for float32 rows, so a positive error is the reference's
distance from the minimum); the others: ``||d_ref - d_ours|| / ||d_ours||`` for the updates d = w @ rows. ``-`` for PCGrad and GradVac,
whose answers depend on the random order of the tasks (GradVac's also on its EMA state).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy.optimize import least_squares, minimize

from mtl.config.schema import Config
from mtl.weighting import weighting_types
from mtl.weighting.base import gram_matrix

P = 64  # the rows' length (the references that work on rows see K x P)


# ------------------------------------------------------------------ references (re-implemented, labelled)

def libmtl_cagrad(gram, rows, calpha=0.4, rescale=1):
    """LibMTL's CAGrad (LibMTL/weighting/CAGrad.py): SLSQP on the dual, from the Gram matrix."""
    gg = gram.cpu()
    k = gg.shape[0]
    g0_norm = (gg.mean() + 1e-8).sqrt()
    x_start = np.ones(k) / k
    bnds = tuple((0, 1) for _ in x_start)
    cons = ({"type": "eq", "fun": lambda x: 1 - sum(x)},)
    a = gg.numpy()
    b = x_start.copy()
    c = (calpha * g0_norm + 1e-8).item()

    def objfn(x):
        return (x.reshape(1, -1).dot(a).dot(b.reshape(-1, 1))
                + c * np.sqrt(x.reshape(1, -1).dot(a).dot(x.reshape(-1, 1)) + 1e-8)).sum()

    w = minimize(objfn, x_start, bounds=bnds, constraints=cons).x
    lmbda = c / (math.sqrt(max(float(w @ a @ w), 0.0)) + 1e-8)  # ||g_w|| from the Gram matrix
    alpha = 1.0 / k + lmbda * w
    return alpha / (1 + calpha ** 2) if rescale == 1 else alpha


_TORCHJD = {}


def torchjd_installed() -> bool:
    """Whether TorchJD's CAGrad can run here (torchjd with its cagrad extra: cvxpy and Clarabel; the dev extra)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torchjd", "cvxpy", "clarabel"))


def torchjd_cagrad(gram, rows, c=0.4):
    """TorchJD's own CAGrad (torchjd 0.18, ``torchjd.aggregation.CAGradWeighting``: cvxpy's Clarabel on the dual, from
    the Gram matrix in its dtype), not a re-implementation. Its weights are Algorithm 1's; divided by 1 + c^2 here to
    compare with ours (the authors' rescale, also LibMTL's)."""
    if c not in _TORCHJD:
        from torchjd.aggregation import CAGradWeighting  # the dev extra: imported only where it is timed

        _TORCHJD[c] = CAGradWeighting(c=c)
    return _TORCHJD[c](gram) / (1 + c * c)


def libmtl_pcgrad(gram, rows):
    """LibMTL's PCGrad (LibMTL/weighting/PCGrad.py): the row-by-row projections, shuffled with ``random``."""
    k = rows.shape[0]
    pc = rows.clone()
    batch_weight = np.ones(k)
    for i in range(k):
        order = list(range(k))
        random.shuffle(order)
        for j in order:
            g_ij = torch.dot(pc[i], rows[j])
            if g_ij < 0:
                pc[i] -= g_ij * rows[j] / (rows[j].norm().pow(2))
                batch_weight[j] -= (g_ij / (rows[j].norm().pow(2))).item()
    return pc.sum(0)


def torchjd_pcgrad(gram, rows):
    """TorchJD's PCGrad weighting (torchjd/aggregation/pcgrad.py): the projections on the Gram matrix."""
    gram = gram.cpu()
    k = gram.shape[0]
    weights = torch.zeros(k, dtype=gram.dtype)
    for i in range(k):
        current = torch.zeros(k, dtype=gram.dtype)
        current[i] = 1.0
        for j in torch.randperm(k):
            if j == i:
                continue
            inner = gram[j] @ current
            if inner < 0.0:
                current[j] -= inner / gram[j, j]
        weights = weights + current
    return weights


def torchjd_mgda(gram, rows, epsilon=0.001, max_iters=100):
    """TorchJD's MGDA weighting (torchjd/aggregation/mgda.py): Frank-Wolfe on the Gram matrix, 100 steps at most,
    stopping at a step below 1e-3 (so not the exact min-norm point)."""
    k = gram.shape[0]
    alpha = torch.ones(k, dtype=gram.dtype) / k
    for _ in range(max_iters):
        t = torch.argmin(gram @ alpha)
        e_t = torch.zeros(k, dtype=gram.dtype)
        e_t[t] = 1.0
        a = alpha @ (gram @ e_t)
        b = alpha @ (gram @ alpha)
        c = e_t @ (gram @ e_t)
        gamma = 1.0 if c <= a else (0.0 if b <= a else (b - a) / (b + c - 2 * a))
        alpha = (1 - gamma) * alpha + gamma * e_t
        if gamma < epsilon:
            break
    return alpha


def libmtl_mgda(gram, rows, max_iter=250, stop_crit=1e-5):
    """LibMTL's MGDA (LibMTL/weighting/MGDA.py, ``_find_min_norm_element``, from the authors' MinNormSolver): the best
    pair's segment, then projected-gradient steps with an exact line search, until a step moves the weights by less
    than 1e-5 in l1 (so not the exact min-norm point either), from the rows' Gram matrix. LibMTL's loop never counts
    its iterations; the authors' 250 cap is kept here."""

    def min_norm_element_from2(v1v1, v1v2, v2v2):
        if v1v2 >= v1v1:
            return 0.999, v1v1
        if v1v2 >= v2v2:
            return 0.001, v2v2
        gamma = -1.0 * ((v1v2 - v2v2) / (v1v1 + v2v2 - 2 * v1v2))
        return gamma, v2v2 + gamma * (v1v2 - v2v2)

    def min_norm_2d(grad_mat):
        dmin, sol = 1e8, None
        for i in range(grad_mat.size()[0]):
            for j in range(i + 1, grad_mat.size()[0]):
                c, d = min_norm_element_from2(grad_mat[i, i], grad_mat[i, j], grad_mat[j, j])
                if d < dmin:
                    dmin, sol = d, [(i, j), c, d]
        return sol

    def projection2simplex(y):
        m = len(y)
        sorted_y = torch.sort(y, descending=True)[0]
        tmpsum = 0.0
        tmax_f = (torch.sum(y) - 1.0) / m
        for i in range(m - 1):
            tmpsum += sorted_y[i]
            tmax = (tmpsum - 1) / (i + 1.0)
            if tmax > sorted_y[i + 1]:
                tmax_f = tmax
                break
        return torch.max(y - tmax_f, torch.zeros(m, dtype=y.dtype))

    def next_point(cur_val, grad, n):
        proj_grad = grad - (torch.sum(grad) / n)
        tm1 = -1.0 * cur_val[proj_grad < 0] / proj_grad[proj_grad < 0]
        tm2 = (1.0 - cur_val[proj_grad > 0]) / (proj_grad[proj_grad > 0])
        t = torch.ones(1, dtype=grad.dtype)
        if (tm1 > 1e-7).sum() > 0:
            t = torch.min(tm1[tm1 > 1e-7])
        if (tm2 > 1e-7).sum() > 0:
            t = torch.min(t, torch.min(tm2[tm2 > 1e-7]))
        return projection2simplex(proj_grad * t + cur_val)

    grad_mat = rows.mm(rows.t())
    init_sol = min_norm_2d(grad_mat)
    n = rows.size()[0]
    sol_vec = torch.zeros(n, dtype=rows.dtype)
    sol_vec[init_sol[0][0]] = init_sol[1]
    sol_vec[init_sol[0][1]] = 1 - init_sol[1]
    if n < 3:
        return sol_vec
    for _ in range(max_iter):
        grad_dir = -1.0 * torch.matmul(grad_mat, sol_vec)
        new_point = next_point(sol_vec, grad_dir, n)
        v1v1 = torch.sum(sol_vec.unsqueeze(1).repeat(1, n) * sol_vec.unsqueeze(0).repeat(n, 1) * grad_mat)
        v1v2 = torch.sum(sol_vec.unsqueeze(1).repeat(1, n) * new_point.unsqueeze(0).repeat(n, 1) * grad_mat)
        v2v2 = torch.sum(new_point.unsqueeze(1).repeat(1, n) * new_point.unsqueeze(0).repeat(n, 1) * grad_mat)
        nc, nd = min_norm_element_from2(v1v1, v1v2, v2v2)
        new_sol_vec = nc * sol_vec + (1 - nc) * new_point
        if torch.sum(torch.abs(new_sol_vec - sol_vec)) < stop_crit:
            return sol_vec
        sol_vec = new_sol_vec
    return sol_vec


def libmtl_imtl(gram, rows):
    """LibMTL's IMTL gradient part (LibMTL/weighting/IMTL.py), on the rows."""
    unit = rows / torch.norm(rows, p=2, dim=-1, keepdim=True)
    d = rows[0:1].repeat(rows.shape[0] - 1, 1) - rows[1:]
    u = unit[0:1].repeat(rows.shape[0] - 1, 1) - unit[1:]
    alpha = torch.matmul(torch.matmul(rows[0], u.t()), torch.inverse(torch.matmul(d, u.t())))
    return torch.cat((1 - alpha.sum().unsqueeze(0), alpha), dim=0)


def libmtl_alignedmtl(gram, rows):
    """LibMTL's Aligned-MTL (LibMTL/weighting/Aligned_MTL.py): the eigendecomposition of the Gram matrix."""
    lmbda, v = torch.linalg.eigh(gram, UPLO="L")
    tol = torch.max(lmbda) * max(gram.shape[-2:]) * torch.finfo().eps
    rank = int((lmbda > tol).sum())
    order = torch.argsort(lmbda, dim=-1, descending=True)
    lmbda, v = lmbda[order][:rank], v[:, order][:, :rank]
    sigma = torch.diag(1 / lmbda.sqrt())
    b = lmbda[-1].sqrt() * ((v @ sigma) @ v.t())
    return b.sum(0)


def torchjd_config(gram, rows):
    """TorchJD's ConFIG (torchjd/aggregation/config.py), on the rows."""
    weights = torch.ones(rows.shape[0], dtype=rows.dtype)
    units = torch.nan_to_num(rows / rows.norm(dim=1).unsqueeze(1), 0.0)
    best = torch.linalg.pinv(units) @ weights
    unit_target = best / best.norm()
    length = sum(torch.dot(g, unit_target) for g in rows)
    return length * unit_target


def fairgrad_authors(gram, rows, alpha=1.0):
    """FairGrad's authors' code (and LibMTL's FairGrad.py): ``scipy.optimize.least_squares`` on the residual."""
    gtg = gram.cpu().numpy()
    k = gtg.shape[0]

    def objfn(x):
        return np.dot(gtg, x) - np.power(1 / x, 1 / alpha)

    return least_squares(objfn, np.ones(k) / k, bounds=(0, np.inf)).x


def libmtl_gradvac(gram, rows, beta=0.5, state={}):  # noqa: B006 (the EMA targets, kept between calls as in LibMTL)
    """LibMTL's GradVac (LibMTL/weighting/GradVac.py): the row-by-row corrections with EMA targets rho_T."""
    k = rows.shape[0]
    rho_t = state.setdefault(k, torch.zeros(k, k, dtype=rows.dtype))
    pc = rows.clone()
    batch_weight = np.ones(k)
    for i in range(k):
        order = [j for j in range(k) if j != i]
        random.shuffle(order)
        for j in order:
            rho_ij = torch.dot(pc[i], rows[j]) / (pc[i].norm() * rows[j].norm())
            if rho_ij < rho_t[i, j]:
                w = pc[i].norm() * (rho_t[i, j] * (1 - rho_ij ** 2).sqrt() - rho_ij * (1 - rho_t[i, j] ** 2).sqrt()) / (
                    rows[j].norm() * (1 - rho_t[i, j] ** 2).sqrt())
                pc[i] += rows[j] * w
                batch_weight[j] += w.item()
            rho_t[i, j] = (1 - beta) * rho_t[i, j] + beta * rho_ij
    return pc.sum(0)


REFERENCES = {
    "cagrad": {"LibMTL (SLSQP)": libmtl_cagrad, **({"TorchJD 0.18 (Clarabel)": torchjd_cagrad} if torchjd_installed() else {})},
    "pcgrad": {"LibMTL (rows)": libmtl_pcgrad, "TorchJD (Gram)": torchjd_pcgrad},
    "mgda": {"TorchJD (FW, tol 1e-3)": torchjd_mgda, "LibMTL (MinNormSolver)": libmtl_mgda},
    "imtlg": {"LibMTL (rows)": libmtl_imtl},
    "alignedmtl": {"LibMTL (eigh)": libmtl_alignedmtl},
    "config": {"TorchJD (rows)": torchjd_config},
    "fairgrad": {"authors (least_squares)": fairgrad_authors},
    "gradvac": {"LibMTL (rows)": libmtl_gradvac},
}
# methods with no reference timed here, and why (TorchJD's Nash-MTL needs ecos beside cvxpy, its UPGrad and DualProj
# quadprog: neither is a dependency; TorchJD's CAGrad, cvxpy and Clarabel, is, in the dev extra)
# whose references' answers depend on a random order of the tasks (and GradVac's on its EMA state): not compared
RANDOM_ORDER = ("pcgrad", "gradvac")
UNREFERENCED = ("nashmtl", "upgrad", "dualproj", "modo", "sdmgrad", "gradnorm")


# ------------------------------------------------------------------ the benchmark

def rows_for(kind: str, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * k + seed)
    if kind == "random":
        return torch.randn(k, P, generator=gen, dtype=torch.float64)
    g = torch.randn(1, P, generator=gen, dtype=torch.float64)
    others = 0.1 * torch.randn(max(k - 2, 0), P, generator=gen, dtype=torch.float64)
    opposed = -g + 0.01 * torch.randn(1, P, generator=gen, dtype=torch.float64)
    return torch.cat([g, opposed, others])[:k]


def build(method: str, k: int):
    cfg = OmegaConf.structured(Config)
    cfg.weighting.method = method
    cfg.tasks = [f"t{i}" for i in range(k)]
    return weighting_types()[method](cfg, list(cfg.tasks))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def update(out, rows: torch.Tensor) -> torch.Tensor:
    """The float64 update of a reference's answer: its K weights times the rows, or the P-vector it returned."""
    out = torch.as_tensor(out).double().flatten()
    return out @ rows.double() if out.shape[0] == rows.shape[0] else out


def ref_error(method: str, ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """How far a reference's update is from ours: for MGDA the min-norm value, ||d_ref|| / ||d_ours|| - 1 (>= 0 up
    to round-off: ours is certified the minimum); else ||d_ref - d_ours|| / ||d_ours||."""
    if method == "mgda":
        return float(theirs.norm() / ours.norm() - 1)
    return float((theirs - ours).norm() / ours.norm())


def measure(method: str, k: int, kind: str, dtype: torch.dtype, rounds: int, seeds: int) -> dict:
    refs = REFERENCES.get(method, {})
    ours, theirs = [], {name: [] for name in refs}
    errors = {name: [] for name in refs}
    for seed in range(seeds):
        rows = rows_for(kind, k, seed).to(dtype)
        gram = gram_matrix(rows)
        losses = torch.linspace(1.0, 2.0, k, dtype=torch.float64)
        m = build(method, k)
        step = 0
        for r in range(rounds + 1):  # round 0 warms up, untimed
            order = [("ours", None), *refs.items()]
            if r % 2:
                order.reverse()
            for name, fn in order:  # each call timed right after an untimed one: warm, whatever ran before
                if name == "ours":
                    for _ in range(2):
                        m.begin_step(step)
                        step += 1
                        t = timed(lambda: m.weights_for_gram(gram, losses, dtype))  # noqa: B023
                    if r:
                        ours.append(t)
                else:
                    out = []
                    for _ in range(2):
                        t = timed(lambda: out.append(fn(gram.to(dtype), rows)))  # noqa: B023
                    if r:
                        theirs[name].append(t)
                    if r == rounds and method not in RANDOM_ORDER:
                        errors[name].append(ref_error(method, update(m.last_weights, rows), update(out[-1], rows)))
    med = {name: statistics.median(ts) for name, ts in theirs.items()}
    err = {name: max(errs, key=abs) if errs else None for name, errs in errors.items()}
    return {"ours": statistics.median(ours), "refs": med, "errors": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 11, 40])
    ap.add_argument("--methods", nargs="+", default=[*REFERENCES, *UNREFERENCED])
    ap.add_argument("--kinds", nargs="+", default=["random", "ill"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"1 thread; medians of {args.rounds} x {args.seeds} (ms)")
    print("| method | K | Gram | rows | ours ms | reference | ref ms | ref error | ours / ref |")
    print("|---|---:|---|---|---:|---|---:|---:|---:|")
    for method in args.methods:
        for k in args.k:
            for kind in args.kinds:
                for dt in args.dtypes:
                    res = measure(method, k, kind, getattr(torch, dt), args.rounds, args.seeds)
                    case = f"| {method} | {k} | {kind} | {dt} | {res['ours'] * 1e3:.3f} |"
                    for name, t in res["refs"].items():
                        err = res["errors"][name]
                        err = "-" if err is None else f"{err:.1e}"
                        print(f"{case} {name} | {t * 1e3:.3f} | {err} | {res['ours'] / t:.2f} |", flush=True)
                    if not res["refs"]:
                        print(f"{case} none | - | - | - |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
