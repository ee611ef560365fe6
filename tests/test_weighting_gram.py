"""Gram-matrix methods (GramWeighting: PCGrad, MGDA, CAGrad, Nash-MTL, IMTL-G, Aligned-MTL, UPGrad, GradNorm,
GradVac, DualProj, ConFIG, FairGrad, MoDo, SDMGrad): hand-worked cases from the papers' definitions, the property
each paper promises, and the Gram path against the row-by-row algorithms."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.optimize
import torch

from mtl.weighting import qp, weighting_types
from mtl.weighting.alignedmtl import alignedmtl, alignedmtl_balance, alignedmtl_weights
from mtl.weighting.base import GramWeighting, gram_matrix, stream_seed
from mtl.weighting.cagrad import cagrad, cagrad_weights
from mtl.weighting.conflictfree import config, config_weights
from mtl.weighting.dualproj import dualproj, dualproj_weights
from mtl.weighting.fairgrad import fairgrad, fairgrad_weights
from mtl.weighting.gradnorm import gradnorm, gradnorm_loss, gradnorm_renormalize, gradnorm_weight_grad
from mtl.weighting.gradvac import gradvac, gradvac_coefficients, gradvac_weights
from mtl.weighting.imtlg import imtlg, imtlg_weights
from mtl.weighting.mgda import mgda, mgda_weights
from mtl.weighting.modo import modo, modo_step, modo_weights
from mtl.weighting.nashmtl import (
    NASH_EXISTS_TOL,
    nashmtl,
    nashmtl_weights,
    simplex_min,
    simplex_min_nnls,
    solution_exists,
)
from mtl.weighting.pcgrad import pcgrad, pcgrad_coefficients, pcgrad_weights
from mtl.weighting.sdmgrad import SDMGRAD_LR, SDMGRAD_MOMENTUM, sdmgrad, sdmgrad_solve, sdmgrad_weights
from mtl.weighting.upgrad import upgrad, upgrad_projections

from .weighting_cases import (
    GRAD_METHODS,
    STATEFUL_GRAM,
    G,
    close,
    gram,
    gram_case,
    make,
    pcgrad_hard_cases,
    random_grads,
    roundtrip,
)

# --------------------------------------------------------------------------------------------------
# the Gram interface: w from (G G^T, losses, state), update w^T G

# The weights each method's combine() gave when it formed its update from the rows of G (before the methods
# computed their weights from the Gram matrix alone, GramWeighting),
# on the inputs of gram_case(k) over three steps of gram_case_run; d = w @ G. Kept to 12 digits.
PREVIOUS_WEIGHTS_TABLE = """
pcgrad/2     2.01920688901 1.1580998075
pcgrad/3     1.04284043033 1 3.25657698981
pcgrad/5     1 1.10371390616 2.87951823582 1.21798716191 3.93332891964
mgda/2       0.787116177779 0.212883822221
mgda/3       0.0559672806566 0 0.944032719343
mgda/5       0 0.00944535542895 0.951091097557 0 0.0394635470141
cagrad/2     0.831991663155 0.431034482759
cagrad/3     0.287356321839 0.287356321839 3.32324292536
cagrad/5     0.172413793103 0.172413793103 0.774226268152 0.172413793103 0.53309697277
nashmtl/2    0.405219976327 0.159597227352
nashmtl/3    0.278820705353 0.062197266331 2.18838449628
nashmtl/5    0.269018310371 0.102354826405 1.60463091743 0.304288485557 0.683666154408
imtlg/2      0.717435612243 0.282564387757
imtlg/3      0.145740706743 -0.0358017718224 0.89006106508
imtlg/5      -0.800075326983 0.323196332231 -2.0896053029 1.19182633168 2.37465796597
alignedmtl/2 1.09319813396 0.485084027605
alignedmtl/3 0.213011308818 -0.0366570659367 1.05737288122
alignedmtl/5 0.0910290806058 0.0285013228702 0.771557822553 0.023178550249 0.103267742067
upgrad/2     1.0096034445 0.579049903751
upgrad/3     0.347613476777 0.333333333333 1.08552566327
upgrad/5     0.2 0.214801897828 0.296342833555 0.251997514266 0.794547647477
gradnorm/2   1.02499985695 0.975000143051
gradnorm/3   1.01652884483 0.966942310333 1.01652884483
gradnorm/5   1.00985217094 0.960591316223 1.00985217094 1.00985217094 1.00985217094
"""
PREVIOUS_WEIGHTS = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in PREVIOUS_WEIGHTS_TABLE.strip().splitlines()}


def gram_case_run(method: str, g: torch.Tensor):
    """Three steps of ``method`` on the rows ``g`` (losses moving), returning the last update and the method."""
    k = g.shape[0]
    tasks = [f"t{i}" for i in range(k)]
    w = make(method, tasks=tasks)
    d = None
    for step in range(3):
        w.begin_step(step)
        d = w.combine(g, torch.linspace(1.0, 2.0, k, dtype=torch.float64))
        w.end_step({t: 1.0 + 0.3 * i - 0.1 * step * i for i, t in enumerate(tasks)})
    return d, w


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("method", sorted({key.split("/")[0] for key in PREVIOUS_WEIGHTS}))
def test_gram_path_equals_the_previous_implementation(method, k):
    g = gram_case(k)
    assert float((gram(g) / gram(g).diag().sqrt()[:, None] / gram(g).diag().sqrt()).min()) < -0.3  # conflicts
    d, _ = gram_case_run(method, g)
    expected = torch.tensor(PREVIOUS_WEIGHTS[f"{method}/{k}"], dtype=torch.float64) @ g
    # Nash-MTL's previous solver added a 1e-8 ridge everywhere, which moved alpha by ~1e-8 (relative);
    # it now solves the equation itself where a solution exists (tested to round-off below). CAGrad's projected
    # gradient stops ~1e-8 from the optimum in w, so its last digits follow the summation order of the matrix
    # products (threads): a fresh-clone make test saw cagrad/5 off by 2.5e-10 relative. Both to their solver's tolerance.
    tol = 1e-7 if method in ("nashmtl", "cagrad") else 1e-10
    close(d, expected, tol * float(expected.abs().max()))


@pytest.mark.parametrize("method", GRAD_METHODS)
def test_grad_methods_see_only_the_gram_matrix(method):
    """Rotating the rows (G -> G R, R orthogonal) keeps G G^T: the weights must not move, d must rotate."""
    assert issubclass(weighting_types()[method], GramWeighting)
    for k in (2, 3, 5):
        g = gram_case(k)
        r, _ = torch.linalg.qr(torch.randn(7, 7, generator=torch.Generator().manual_seed(k), dtype=torch.float64))
        d, w = gram_case_run(method, g)
        d_rot, w_rot = gram_case_run(method, g @ r)
        # to the solvers' tolerance (CAGrad's projected gradient stops ~1e-8 from the optimum in w)
        close(list(w_rot.weights().values()), list(w.weights().values()), 1e-7)
        close(d_rot, d @ r, 1e-7 * float(d.abs().max()))
        if method not in STATEFUL_GRAM:  # computing the weights again would move their state
            alpha = torch.tensor(list(w.weights().values()), dtype=torch.float64)
            close(alpha, w.weights_for_gram(gram_matrix(g), None, torch.float64), 1e-12)


@pytest.mark.parametrize("method", GRAD_METHODS)
def test_combine_keeps_the_grads_dtype(method):
    g = gram_case(3)
    for dtype in (torch.float32, torch.bfloat16):
        d, _ = gram_case_run(method, g.to(dtype))
        ref, _ = gram_case_run(method, g)
        assert d.dtype == dtype and torch.isfinite(d).all()
        assert float((d.double() - ref).abs().max()) < 0.05 * float(ref.abs().max())


# --------------------------------------------------------------------------------------------------
# PCGrad


def test_pcgrad_two_task_cases():
    close(pcgrad(G([3.0, 0.0], [0.0, 4.0])), [3.0, 4.0])  # orthogonal: no conflict, the sum
    close(pcgrad(G([1.0, 2.0], [-2.0, -4.0])), [0.0, 0.0])  # opposed: both projected to zero
    close(pcgrad(G([1.0, 2.0], [1.0, 2.0])), [2.0, 4.0])  # identical: the sum
    close(pcgrad(G([2.0, 1.0], [1.0, 3.0])), [3.0, 4.0])  # acute angle: the sum
    # 100x: g1=(100,0), g2=(-1,1): g1 -> g1 + 50 g2 = (50,50); g2 -> g2 + 0.01 g1 = (0,1)
    g = G([100.0, 0.0], [-1.0, 1.0])
    close(pcgrad(g), [50.0, 51.0])
    proj = pcgrad_coefficients(gram(g)) @ g
    close(proj, [[50.0, 50.0], [0.0, 1.0]])


def test_pcgrad_removes_the_conflict_with_the_other_task():
    for seed in range(20):
        g = random_grads(2, 6, seed)
        proj = pcgrad_coefficients(gram(g)) @ g
        for i, j in ((0, 1), (1, 0)):
            dot = float(proj[i] @ g[j])
            assert dot >= -1e-10
            if float(g[i] @ g[j]) < 0:
                assert abs(dot) < 1e-10  # projected exactly onto the normal plane
            else:
                close(proj[i], g[i])  # no conflict: untouched


def reference_pcgrad(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The paper's Algorithm 1 on the vectors themselves, with the same random order."""
    k = g.shape[0]
    out = []
    for i in range(k):
        order = [j for j in torch.randperm(k, generator=gen).tolist() if j != i]
        gi = g[i].clone()
        for j in order:
            dot = gi @ g[j]
            if dot < 0:
                gi = gi - dot / (g[j] @ g[j]) * g[j]
        out.append(gi)
    return torch.stack(out).sum(0)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_pcgrad_weights_from_the_gram_matrix_equal_the_row_by_row_algorithm(k):
    for n, g in enumerate(pcgrad_hard_cases(k)):
        for seed in range(4):
            d = pcgrad(g, generator=torch.Generator().manual_seed(seed))
            ref = reference_pcgrad(g, torch.Generator().manual_seed(seed))
            close(d, ref, 1e-9 * max(1.0, float(ref.abs().max())))
            w = make("pcgrad", seed=seed, tasks=[f"t{i}" for i in range(k)])
            w.begin_step(n)
            gen = torch.Generator().manual_seed(stream_seed(seed, n, "pcgrad")) if k > 2 else torch.Generator()
            close(w.combine(g, None), reference_pcgrad(g, gen), 1e-9 * max(1.0, float(ref.abs().max())))


def test_pcgrad_k3_follows_the_algorithm_and_is_reproducible():
    g = G([1.0, 0.0, 0.0], [-0.8, 1.0, 0.0], [-0.5, -0.9, 0.3])
    for seed in range(6):
        d = pcgrad(g, generator=torch.Generator().manual_seed(seed))
        close(d, reference_pcgrad(g, torch.Generator().manual_seed(seed)))
    a, b = make("pcgrad", seed=3, tasks=["a", "b", "c"]), make("pcgrad", seed=3, tasks=["a", "b", "c"])
    outs = set()
    for step in range(12):
        a.begin_step(step)
        b.begin_step(step)
        da, db = a.combine(g, None), b.combine(g, None)
        assert torch.equal(da, db)
        outs.add(tuple(round(x, 9) for x in da.tolist()))
    assert len(outs) > 1  # the order (and here the result) changes with the step
    seeds = {stream_seed(0, 1, "pcgrad"), stream_seed(0, 2, "pcgrad"), stream_seed(1, 1, "pcgrad"),
             stream_seed(0, 1, "rlw")}
    assert len(seeds) == 4  # another step, seed or method: another stream


# --------------------------------------------------------------------------------------------------
# MGDA


def test_mgda_two_task_cases():
    # orthogonal g1=(3,0), g2=(0,4): alpha = ((g2-g1).g2)/||g1-g2||^2 = 16/25
    close(mgda_weights(gram(G([3.0, 0.0], [0.0, 4.0]))), [16 / 25, 9 / 25])
    close(mgda(G([3.0, 0.0], [0.0, 4.0])), [48 / 25, 36 / 25])
    close(mgda(G([1.0, 2.0], [-3.0, -6.0])), [0.0, 0.0])  # opposed: the origin is in the hull
    close(mgda(G([100.0, 0.0], [0.0, 1.0])), [100 / 10001, 10000 / 10001])
    close(mgda(G([1.0, 2.0], [1.0, 2.0])), [1.0, 2.0])  # identical
    close(mgda(G([0.0, 0.0], [1.0, 2.0])), [0.0, 0.0])  # zero row: the origin


@pytest.mark.parametrize("k", [2, 3, 4])
def test_mgda_is_the_min_norm_point_and_descends_for_every_task(k):
    gen = torch.Generator().manual_seed(k)
    for seed in range(5):
        g = random_grads(k, 5, 100 * k + seed)
        alpha = mgda_weights(gram(g))
        assert alpha.min() >= 0 and abs(float(alpha.sum()) - 1) < 1e-12
        d = alpha @ g
        norm2 = float(d @ d)
        assert (g @ d >= norm2 - 1e-7).all()  # KKT: d . g_t >= ||d||^2 >= 0
        e = -torch.rand(4000, k, generator=gen, dtype=torch.float64).log()
        w = torch.cat([e / e.sum(1, keepdim=True), torch.eye(k, dtype=torch.float64)])  # uniform on the simplex
        others = ((w @ g) ** 2).sum(1)
        assert others.min() >= norm2 - 1e-7


def min_norm_oracle(rows: torch.Tensor) -> float:
    """||d*||^2 of the min-norm point of the rows' hull, independently: scipy's NNLS on the rows themselves,
    min_{u >= 0} ||G^T u||^2 + (sum u - 1)^2 (Wolfe's), d* = G^T u / sum u."""
    g = rows.numpy()
    s = float((g * g).sum(1).max())
    a = np.vstack([g.T / np.sqrt(s), np.ones((1, g.shape[0]))])
    u = scipy.optimize.nnls(a, np.eye(a.shape[0])[-1])[0]
    d = (u / u.sum()) @ g
    return float(d @ d)


@pytest.mark.parametrize("k", [3, 5, 40])
def test_mgda_hard_cases_are_certified_min_norm_points(k):
    """Nearly opposed, one row 100x, identical rows, a zero row (K > P at K = 40: a singular Gram matrix), and the
    benchmark's ill case (g, -g + noise, K - 2 small rows): the KKT conditions hold to round-off and ||d||^2 is
    the independent NNLS's. (Frank-Wolfe from 1/K stopped at its iteration cap on the last with 7x the norm^2.)"""
    gen = torch.Generator().manual_seed(k)
    g = torch.randn(1, 64, generator=gen, dtype=torch.float64)
    ill = torch.cat([g, -g + 0.01 * torch.randn(1, 64, generator=gen, dtype=torch.float64),
                     0.1 * torch.randn(k - 2, 64, generator=gen, dtype=torch.float64)])
    for rows in [*pcgrad_hard_cases(k), ill]:
        m = gram(rows)
        scale = float(m.diagonal().max())
        alpha = mgda_weights(m)
        assert alpha.min() >= 0 and abs(float(alpha.sum()) - 1) < 1e-12
        d = alpha @ rows
        norm2 = float(d @ d)
        h = rows @ d  # (G G^T alpha)_t: >= ||d||^2 everywhere, = ||d||^2 where alpha_t > 0
        assert float(h.min()) >= norm2 - 1e-12 * scale
        assert float(h[alpha > 0].max()) <= norm2 + 1e-12 * scale
        assert abs(norm2 - min_norm_oracle(rows)) <= 1e-12 * scale


def test_the_eigendecompositions_are_not_numpys(monkeypatch):
    """Aligned-MTL and ConFIG take their K x K eigendecomposition from ``qp.small_eigh`` (scipy's): numpy's
    ``eigh`` runs OpenBLAS's thread pool from K = 26 on and, while another process holds a core, waited 16 ms a call
    at K = 40 (solve_cost benchmark; 0.1 ms otherwise). Same answers: the Gram condition holds at K = 40."""
    def refuse(*args, **kwargs):
        raise AssertionError("np.linalg.eigh called")

    monkeypatch.setattr(np.linalg, "eigh", refuse)
    g = random_grads(40, 64, 7)
    m = gram(g)
    b = alignedmtl_balance(m)
    close((b @ g) @ (b @ g).T, float(torch.linalg.eigvalsh(m).min()) * torch.eye(40, dtype=torch.float64), 1e-9)
    assert torch.isfinite(config_weights(m)).all()


def test_nonneg_qp_fast_path_is_taken_only_when_it_meets_the_kkt_conditions(monkeypatch):
    """``nonneg_qp`` answers a positive definite problem by scipy's NNLS on the Cholesky factor (no active-set
    least-squares solve: UPGrad's 40 QPs at K = 40 went from 45 ms to 4 ms), and falls back to the active set where
    that answer misses the optimality conditions: a singular q, or a wrong answer."""
    g = random_grads(6, 4, 11)  # K > P: the Gram matrix is singular (rank 4)
    for q, b in ((gram(random_grads(6, 9, 3)).numpy(), -np.ones(6)), (gram(g).numpy(), gram(g).numpy()[0])):
        exact = qp.nonneg_qp(q, b)
        assert qp.qp_optimal(q, b, exact, 1e-12)
        with monkeypatch.context() as mp:  # a fast path that answers wrongly is not trusted
            mp.setattr(qp, "cholesky_nnls", lambda q, b: np.ones(len(b)))
            close(qp.nonneg_qp(q, b), exact, 1e-10)
    q, b = gram(random_grads(6, 9, 3)).numpy(), -np.ones(6)
    with monkeypatch.context() as mp:  # positive definite: no least-squares solve in Python
        mp.setattr(np.linalg, "lstsq", lambda *a, **k: (_ for _ in ()).throw(AssertionError("active set used")))
        assert qp.qp_optimal(q, b, qp.nonneg_qp(q, b), 1e-12)


# --------------------------------------------------------------------------------------------------
# CAGrad


def test_cagrad_with_c_zero_is_the_mean():
    for k in (2, 3):
        g = random_grads(k, 7, k)
        close(cagrad(g, c=0.0), g.mean(0))
        close(cagrad(g, c=0.0, rescale=False), g.mean(0))


def test_cagrad_two_task_cases():
    c = 0.4
    g = G([1.0, 0.0], [0.0, 1.0])  # orthogonal, equal norms: by symmetry w = (1/2, 1/2), g_w = g_0
    close(cagrad(g, c=c, rescale=False), [(1 + c) / 2, (1 + c) / 2])
    close(cagrad(g, c=c), [(1 + c) / 2 / (1 + c * c), (1 + c) / 2 / (1 + c * c)])
    close(cagrad(G([1.0, 2.0], [-1.0, -2.0]), c=c), [0.0, 0.0])  # opposed: g_0 = 0
    close(cagrad(G([1.0, 2.0], [1.0, 2.0]), c=c, rescale=False), [1 + c, 2 * (1 + c)])  # identical
    # a zero row: the optimal g_w is 0 and the update is g_0
    close(cagrad(G([0.0, 0.0], [2.0, 4.0]), c=c, rescale=False), [1.0, 2.0])


def _circle(center, radius, n):
    t = torch.linspace(0, 2 * math.pi, n, dtype=torch.float64)
    return center + radius * torch.stack([t.cos(), t.sin()], 1)


@pytest.mark.parametrize("rows", [
    [[100.0, 0.0], [0.0, 1.0]],  # one gradient 100x the other
    [[100.0, 0.0], [-1.0, 1.0]],  # ... and in conflict
    [[1.0, 0.2], [-0.7, 1.0]],
])
def test_cagrad_maximises_the_worst_task_in_the_ball(rows):
    c = 0.4
    g = G(*rows)
    g0 = g.mean(0)
    d = cagrad(g, c=c, rescale=False)
    assert abs(float((d - g0).norm()) - c * float(g0.norm())) < 1e-9  # on the boundary of the ball
    worst = float((g @ d).min())
    samples = _circle(g0, c * float(g0.norm()), 200001)
    best_sampled = float((samples @ g.T).min(1).values.max())
    assert worst >= best_sampled - 1e-6 * float(g.norm()) ** 2
    close(cagrad(g, c=c), d / (1 + c * c))


def test_cagrad_k3_maximises_the_worst_task_in_the_ball():
    c = 0.4
    g = G([1.0, 0.0, 0.2], [-0.5, 1.0, 0.0], [0.1, -0.6, 1.0])
    g0 = g.mean(0)
    d = cagrad(g, c=c, rescale=False)
    assert float((d - g0).norm()) <= c * float(g0.norm()) + 1e-9
    u = torch.randn(100000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    samples = g0 + c * float(g0.norm()) * u / u.norm(dim=1, keepdim=True)
    assert float((g @ d).min()) >= float((samples @ g.T).min(1).values.max()) - 1e-6
    alpha = cagrad_weights(gram(g), c, False)
    close(alpha @ g, d)


# --------------------------------------------------------------------------------------------------
# Nash-MTL


def test_nash_two_task_cases():
    close(nashmtl_weights(gram(G([3.0, 0.0], [0.0, 4.0]))), [1 / 3, 1 / 4], 1e-7)  # alpha_t = 1/||g_t||
    close(nashmtl(G([3.0, 0.0], [0.0, 4.0])), [1.0, 1.0], 1e-7)
    close(nashmtl_weights(gram(G([100.0, 0.0], [0.0, 1.0]))), [0.01, 1.0], 1e-7)
    # identical g: 2 alpha ||g||^2 = 1/alpha -> alpha = 1/(sqrt(2) ||g||)
    g = G([3.0, 4.0], [3.0, 4.0])
    close(nashmtl_weights(gram(g)), [1 / (5 * math.sqrt(2))] * 2, 1e-7)
    # opposed: no solution exists; the ridge keeps it finite and the update is 0
    d = nashmtl(G([1.0, 2.0], [-3.0, -6.0]))
    assert torch.isfinite(d).all() and float(d.norm()) < 1e-9
    # zero row: alpha = 0 for it, the other is normalised
    close(nashmtl_weights(gram(G([0.0, 0.0], [3.0, 4.0]))), [0.0, 0.2], 1e-7)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_nash_alpha_solves_the_bargaining_equation(k):
    for seed in range(5):
        g = random_grads(k, 6, 10 * k + seed)
        g[1:] = g[1:] + 1.5 * g[0]  # keep a common descent direction (the solution exists)
        m = gram(g)
        alpha = nashmtl_weights(m)
        assert (alpha > 0).all()
        close((m @ alpha) * alpha, torch.ones(k), 1e-6)  # (GG^T alpha)_t = 1/alpha_t


def nash_hard_cases():
    """Gradients with a common descent direction (the equation has a solution) that is hard to find."""
    cases = []
    for eps in (1e-2, 1e-3, 1e-4):  # nearly opposed: alpha ~ 1/sqrt(eps)
        cases.append(G([1.0, 0.0], [-1.0, eps]))
        cases.append(G([100.0, 0.0], [-1.0, eps]))  # ... and one 100x the other
        cases.append(G([1.0, 0.0, 0.0], [-1.0, eps, 0.0], [0.5, -0.5, 1.0]))  # K = 3, one pair nearly opposed
        cases.append(G([1.0, 0, 0, 0, 0], [-1.0, eps, 0, 0, 0], [0, 0, 1.0, 0, 0], [0, 0, -3.0, eps, 0],
                       [0.1, 0, 0.1, 0, 1.0]))  # K = 5, two nearly opposed pairs
    cases.append(G([3.0, 4.0, 0.0], [3.0, 4.0, 0.0], [0.0, 1.0, 1.0]))  # identical rows
    for k in (2, 3, 5):
        g = random_grads(k, 6, 300 + k)
        g[1:] = g[1:] + 1.5 * g[0]
        cases.append(g * torch.logspace(-2, 2, k, dtype=torch.float64)[:, None])  # norms 1e-2 .. 1e2
    return cases


def test_nash_tells_whether_a_solution_exists():
    def cos(g):
        u = g / g.norm(dim=1, keepdim=True)
        return (u @ u.T).numpy()

    for g in nash_hard_cases():
        assert solution_exists(cos(g), NASH_EXISTS_TOL)
    for g in (G([1.0, 2.0], [-3.0, -6.0]), G([1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [-1.0, -1.0, 0.0]),
              G([1.0, 0.0, 0.0], [-1.0, 1e-9, 0.0], [0.0, 0.0, 1.0])):  # 0 in the hull (to 1e-18)
        assert not solution_exists(cos(g), NASH_EXISTS_TOL)


def test_nash_simplex_min_equals_the_best_face():
    """mu = min over the simplex of a^T C a, against the minimum over every face (support) of the simplex."""
    def by_faces(c):
        k, best = c.shape[0], math.inf
        for r in range(1, k + 1):
            for face in itertools.combinations(range(k), r):
                sub = c[np.ix_(face, face)]
                kkt = np.block([[2 * sub, np.ones((r, 1))], [np.ones((1, r)), np.zeros((1, 1))]])
                a = np.linalg.lstsq(kkt, np.eye(r + 1)[-1], rcond=None)[0][:r]  # min on the face's plane
                if (a >= 0).all():
                    best = min(best, float(a @ sub @ a))
        return best

    for k in (2, 3, 5):
        for seed in range(6):
            g = random_grads(k, 4, 500 + 10 * k + seed)
            if seed % 2:
                g[1:] = -g[0] * torch.rand(k - 1, 1, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64) + 1e-3 * g[1:]  # nearly opposed to g_0
            u = g / g.norm(dim=1, keepdim=True)
            c = (u @ u.T).numpy()
            expected = by_faces(c)
            assert abs(simplex_min(c) - expected) <= 1e-6 * expected + 1e-15, (simplex_min(c), expected)


def test_two_task_simplex_min_in_closed_form_equals_the_nnls_one():
    """K = 2 takes the segment's min-norm point in closed form; it equals the general NNLS answer on random,
    nearly opposed, exactly opposed, identical, parallel, very unequal and zero rows (Gram and cosine matrices),
    and so decides the existence of a Nash-MTL / FairGrad solution the same way."""
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(2, 5, generator=gen, dtype=torch.float64) for _ in range(20)]
    base = torch.randn(5, generator=gen, dtype=torch.float64)
    cases += [torch.stack([base, -base]), torch.stack([base, -base + 1e-9]), torch.stack([base, base]),
              torch.stack([base, 3.0 * base]), torch.stack([base, 1e-6 * torch.randn(5, generator=gen,
                                                                                     dtype=torch.float64)]),
              torch.stack([base, torch.zeros(5, dtype=torch.float64)]), torch.stack([1e4 * base, -base + 0.1])]
    for g in cases:
        for m in (g @ g.T, (g / g.norm(dim=1, keepdim=True).clamp(min=1e-300)) @ (g / g.norm(dim=1, keepdim=True)
                                                                                 .clamp(min=1e-300)).T):
            c = m.numpy()
            closed, general = simplex_min(c), simplex_min_nnls(c)
            scale = float(np.abs(c).max())
            assert abs(closed - general) <= 1e-12 * scale, (c, closed, general)
            assert (closed > NASH_EXISTS_TOL * scale) == (general > NASH_EXISTS_TOL * scale) or \
                abs(general - NASH_EXISTS_TOL * scale) <= 1e-12 * scale


def test_nash_solves_the_equation_to_round_off_on_hard_cases():
    """Where a solution exists, (GG^T alpha)_t alpha_t = 1 to round-off (the fixed 1e-8 ridge was 0.7 off)."""
    for g in nash_hard_cases():
        m = gram(g)
        alpha = nashmtl_weights(m)
        assert torch.isfinite(alpha).all() and (alpha > 0).all(), alpha
        residual = ((m @ alpha) * alpha - 1).abs()
        size = (m.abs() @ alpha) * alpha  # the terms of (GG^T alpha)_t alpha_t before they cancel
        assert float((residual / (1 + size)).max()) < 1e-13, (residual.tolist(), size.tolist())
        assert float(residual.max()) < 1e-6  # alpha ~ 1e4 here: the equation holds to 1e-7 at worst
        d = alpha @ g
        close((g @ d) * alpha, torch.ones(len(alpha)), 1e-12 * float(1 + size.max()))


# --------------------------------------------------------------------------------------------------
# IMTL-G


def test_imtlg_two_task_cases():
    # orthogonal g1=(3,0), g2=(0,4): alpha = (4/7, 3/7), d = (12/7, 12/7)
    close(imtlg_weights(gram(G([3.0, 0.0], [0.0, 4.0]))), [4 / 7, 3 / 7])
    close(imtlg(G([3.0, 0.0], [0.0, 4.0])), [12 / 7, 12 / 7])
    close(imtlg(G([100.0, 0.0], [0.0, 1.0])), [100 / 101, 100 / 101])
    # opposed: d . u = -d . u forces d . u = 0, so alpha_1 ||g_1|| = alpha_2 ||g_2||
    close(imtlg_weights(gram(G([1.0, 2.0], [-3.0, -6.0]))), [0.75, 0.25])
    close(imtlg(G([1.0, 2.0], [-1.0, -2.0])), [0.0, 0.0])  # opposed, equal norms: equal (zero) projections
    close(imtlg(G([1.0, 2.0], [1.0, 2.0])), [1.0, 2.0])  # identical
    close(imtlg_weights(gram(G([0.0, 0.0], [1.0, 2.0]))), [0.0, 1.0])  # zero row


@pytest.mark.parametrize("k", [2, 3, 4])
def test_imtlg_has_equal_projections_onto_the_unit_gradients(k):
    for seed in range(5):
        g = random_grads(k, 6, 20 * k + seed)
        alpha = imtlg_weights(gram(g))
        assert abs(float(alpha.sum()) - 1) < 1e-10
        proj = (g / g.norm(dim=1, keepdim=True)) @ (alpha @ g)
        close(proj, proj[0].expand(k), 1e-9)


# --------------------------------------------------------------------------------------------------
# Aligned-MTL


def test_alignedmtl_two_task_cases():
    # orthogonal (3,0), (0,4): sigma_min = 3, aligned rows (3,0), (0,3), sum (3,3)
    close(alignedmtl(G([3.0, 0.0], [0.0, 4.0])), [3.0, 3.0])
    close(alignedmtl(G([100.0, 0.0], [0.0, 1.0])), [1.0, 1.0])
    close(alignedmtl(G([1.0, 2.0], [1.0, 2.0])), [2.0, 4.0])  # identical (rank 1): the sum
    close(alignedmtl(G([1.0, 2.0], [-1.0, -2.0])), [0.0, 0.0])  # opposed
    close(alignedmtl(G([0.0, 0.0], [1.0, 2.0])), [1.0, 2.0])  # zero row: the other row


@pytest.mark.parametrize("k", [2, 3, 4])
def test_alignedmtl_gram_condition(k):
    for seed in range(5):
        g = random_grads(k, 6, 30 * k + seed) * torch.tensor([100.0] + [1.0] * (k - 1), dtype=torch.float64)[:, None]
        m = gram(g)
        b = alignedmtl_balance(m)
        aligned = b @ g
        lam, vec = torch.linalg.eigh(m)
        close(gram(aligned), lam.min() * torch.eye(k), 1e-8 * float(lam.max()))  # orthogonal, equal norms
        d = alignedmtl_weights(m) @ g
        sqrt_m = vec @ torch.diag(lam.sqrt()) @ vec.T
        close(g @ d, lam.min().sqrt() * sqrt_m @ torch.ones(k, dtype=torch.float64), 1e-8 * float(lam.max()))


# --------------------------------------------------------------------------------------------------
# UPGrad


def test_upgrad_two_task_cases():
    close(upgrad(G([3.0, 0.0], [0.0, 4.0])), [1.5, 2.0])  # orthogonal: the mean
    close(upgrad(G([1.0, 2.0], [-3.0, -6.0])), [0.0, 0.0])  # opposed: both project to 0
    close(upgrad(G([1.0, 2.0], [1.0, 2.0])), [1.0, 2.0])  # identical
    # 100x in conflict: pi(g1) = (50, 50), pi(g2) = (0, 1), mean (25, 25.5)
    close(upgrad(G([100.0, 0.0], [-1.0, 1.0])), [25.0, 25.5])
    for seed in range(10):  # K = 2: the PCGrad projection, averaged
        g = random_grads(2, 4, seed)
        close(upgrad(g), pcgrad(g) / 2)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_upgrad_projects_onto_the_dual_cone(k):
    for seed in range(5):
        g = random_grads(k, 4, 40 * k + seed)
        v = upgrad_projections(gram(g))
        proj = v @ g
        assert (proj @ g.T >= -1e-9).all()  # every projection is in the dual cone
        u = v - torch.eye(k, dtype=torch.float64)
        assert (u >= -1e-12).all()
        # KKT of the projection: x - g_i = G^T u_i with u_i >= 0 and u_it > 0 only where g_t . x = 0
        assert (u * (proj @ g.T)).abs().max() < 1e-8
        d = upgrad(g)
        assert (g @ d >= -1e-9).all()  # never increases a task's loss to first order
        close(d, proj.mean(0))


def upgrad_kkt_violation(g: torch.Tensor) -> float:
    """Largest violation of the projection QPs' optimality conditions, relative to max ||g_t||^2 (1 + |v|).

    v_i = argmin_{v >= e_i} v^T M v (M = G G^T) iff v_i >= e_i, (M v_i)_t >= 0 for every t and
    (v_i - e_i)_t (M v_i)_t = 0 (convex QP: these are sufficient).
    """
    m = gram(g)
    v = upgrad_projections(m)
    k = g.shape[0]
    u = v - torch.eye(k, dtype=torch.float64)
    h = v @ m  # h[i, t] = g_t . pi(g_i)
    unit = float(m.diag().max()) * (1.0 + float(v.abs().sum(1).max()))
    return max(float((-u).clamp_min(0).max()), float((-h).clamp_min(0).max()) / unit,
               float((u.clamp_min(0) * h.abs()).max()) / unit)


def test_upgrad_nearly_opposed_k3_does_not_increase_a_loss():
    # nearly opposed, K = 3: a fixed number of coordinate-descent sweeps would return d with g_1 . d = -1.3e-3
    g = G([1.0, 0.0, 0.0], [-1.0, 0.01, 0.0], [0.5, -0.5, 1.0])
    d = upgrad(g)
    assert (g @ d >= 0).all(), (g @ d).tolist()
    close(d, [2.6771e-5, 5.3438e-3, 0.33599], 1e-4)
    close(g @ d, [2.6771e-5, 2.6667e-5, 1 / 3], 1e-4)
    assert upgrad_kkt_violation(g) < 1e-12


@pytest.mark.parametrize("k", [2, 3, 5])
def test_upgrad_projections_meet_the_kkt_conditions_on_hard_cases(k):
    cases = pcgrad_hard_cases(k)  # random, nearly opposed, 100x, identical rows, a zero row
    gen = torch.Generator().manual_seed(k)
    for _ in range(6):  # several rows nearly opposed to the first, in different directions
        g = random_grads(k, 6, int(torch.randint(1 << 30, (1,), generator=gen)))
        for t in range(1, k):
            g[t] = -g[0] * (0.5 + t) + 1e-3 * g[t]
        cases.append(g)
    for g in cases:
        assert upgrad_kkt_violation(g) < 1e-12
        d = upgrad(g)
        assert (g @ d >= -1e-12 * float(gram(g).diag().max())).all()


# --------------------------------------------------------------------------------------------------
# GradNorm


def test_gradnorm_loss_and_its_gradient():
    w = torch.tensor([1.0, 1.0], dtype=torch.float64)
    norms = torch.tensor([4.0, 1.0], dtype=torch.float64)
    l0 = torch.tensor([2.0, 2.0], dtype=torch.float64)
    lt = torch.tensor([1.0, 1.5], dtype=torch.float64)  # ratios (0.5, 0.75), r = (0.8, 1.2)
    r = torch.tensor([0.8, 1.2], dtype=torch.float64)
    target = 2.5 * r**1.5
    loss, grad = gradnorm_weight_grad(w, norms, l0, lt, 1.5)
    close(loss, (torch.tensor([4.0, 1.0], dtype=torch.float64) - target).abs().sum())
    close(grad, torch.sign(w * norms - target) * norms)  # target held constant
    close(gradnorm_loss(w, norms, l0, lt, 1.5), loss)
    assert grad[0] > 0 and grad[1] < 0  # the task with the larger weighted norm is pushed down
    w2 = gradnorm_renormalize(torch.tensor([3.0, -1.0, 1.0]))
    assert abs(float(w2.sum()) - 3) < 1e-6 and (w2 > 0).all()
    close(gradnorm(G([1.0, 2.0], [3.0, 4.0]), torch.tensor([0.5, 2.0], dtype=torch.float64)), [6.5, 9.0])


def test_gradnorm_weighting_updates_and_round_trips():
    w = make("gradnorm")
    grads = G([4.0, 0.0], [0.0, 1.0])
    w.begin_step(0)
    close(w.combine(grads, None), [4.0, 1.0])  # w = 1 until a loss history exists
    assert w.weights() == {"cls": 1.0, "gen": 1.0}
    w.end_step({"cls": 2.0, "gen": 2.0})
    w.begin_step(1)
    close(w.combine(grads, None), [4.0, 1.0])  # this step still uses w = 1 ...
    after = w.weights()  # ... and then moves it: equal ratios, cls has the larger norm
    assert after["cls"] < 1 < after["gen"] and abs(sum(after.values()) - 2) < 1e-6
    close(after["cls"], 1 - 0.025, 1e-4)  # a first Adam step moves by ~lr (before renormalising)
    w.end_step({"cls": 1.9, "gen": 1.5})
    fresh = roundtrip(w)
    assert fresh.weights() == w.weights()
    for step in (2, 3):
        for m in (w, fresh):
            m.begin_step(step)
            m.combine(grads, None)
            m.end_step({"cls": 1.8, "gen": 1.2})
    assert fresh.weights() == w.weights()
    nan = G([float("nan"), 0.0], [0.0, 1.0])
    before = w.weights()
    w.combine(nan, None)
    assert w.weights() == before  # non-finite gradients do not move the weights


# --------------------------------------------------------------------------------------------------
# GradVac


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_gradvac_with_beta_zero_is_pcgrad():
    for k in (2, 3, 5):
        for g in pcgrad_hard_cases(k):
            gens = [torch.Generator().manual_seed(9) for _ in range(2)]
            w, targets = gradvac_weights(gram(g), np.zeros((k, k)), 0.0, gens[0])
            close(w, pcgrad_weights(gram(g), gens[1]), 1e-12)
            assert (targets == 0).all()


@pytest.mark.parametrize("rows", [
    [[1.0, 0.0, 0.0], [0.3, 1.0, 0.0]],  # mild agreement, below a target of 0.5
    [[1.0, 0.0, 0.0], [-0.999, 0.0447, 0.0]],  # nearly opposed
    [[100.0, 0.0, 1.0], [-1.0, 2.0, 0.0]],  # one row 100x
])
def test_gradvac_reaches_the_target_cosine(rows):
    """The paper's Eq. 2: where cos(g_1, g_2) is below the target, g_1' = g_1 + c g_2 has cosine exactly the target."""
    g = G(*rows)
    for target in (0.5, 0.0, -0.3, 0.9):
        phi = cosine(g[0], g[1])
        targets = np.full((2, 2), target)
        coef = gradvac_weights(gram(g), targets, 0.0)[0]  # beta = 0: the targets stay
        c, _ = gradvac_coefficients(gram(g).numpy(), targets, 0.0, [[1], [0]])  # the corrected rows are C @ g
        new = [g[0] + c[0, 1] * g[1], g[1] + c[1, 0] * g[0]]
        close(coef, c.sum(0), 1e-12)
        for i, j in ((0, 1), (1, 0)):
            if phi < target:
                close(cosine(new[i], g[j]), target, 1e-9)
            else:
                close(new[i], g[i], 0)  # at or above the target: untouched


def test_gradvac_targets_follow_the_ema_and_survive_a_resume():
    w = make("gradvac", options={"beta": 0.3})
    g1, g2 = G([1.0, 0.0], [0.6, 0.8]), G([1.0, 0.0], [-0.6, 0.8])
    w.begin_step(0)
    close(w.combine(g1), g1.sum(0))  # cos 0.6 > target 0: nothing to correct
    close(w.targets, [[0.0, 0.3 * 0.6], [0.3 * 0.6, 0.0]])
    w.begin_step(1)
    w.combine(g2)  # cos -0.6 < target 0.18: corrected
    t = 0.7 * 0.18 + 0.3 * -0.6
    close(w.targets, [[0.0, t], [t, 0.0]])
    fresh = roundtrip(w)
    close(fresh.targets, w.targets, 0)
    for step in (2, 3):
        for m in (w, fresh):
            m.begin_step(step)
        close(fresh.combine(g2), w.combine(g2), 0)
    assert fresh.weights() == w.weights()
    zero = make("gradvac")  # a zero row: no cosine, nothing corrected, its targets stay
    close(zero.combine(G([0.0, 0.0], [1.0, 1.0])), [1.0, 1.0])
    close(zero.targets, torch.zeros(2, 2), 0)
    d, targets = gradvac(G([1.0, 2.0], [1.0, 2.0]), np.zeros((2, 2)))  # identical rows: the sum, targets rise
    close(d, [2.0, 4.0])
    close(targets, [[0.0, 0.5], [0.5, 0.0]])


# --------------------------------------------------------------------------------------------------
# DualProj


def dualproj_kkt_violation(g: torch.Tensor) -> float:
    """v = argmin_{v >= 1/K} v^T M v iff v >= 1/K, (M v)_t >= 0 and (v - 1/K)_t (M v)_t = 0 (relative)."""
    m = gram(g)
    v = dualproj_weights(m)
    u = v - 1.0 / g.shape[0]
    h = m @ v
    unit = float(m.diag().max()) * (1.0 + float(v.abs().sum()))
    return max(float((-u).clamp_min(0).max()), float((-h).clamp_min(0).max()) / unit,
               float((u.clamp_min(0) * h.abs()).max()) / unit)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_dualproj_is_the_projection_of_the_mean_onto_the_dual_cone(k):
    cases = pcgrad_hard_cases(k)
    for seed in range(4):
        g = random_grads(k, 6, 500 + 10 * k + seed)
        for t in range(1, k):
            g[t] = -g[0] * (0.5 + t) + 1e-3 * g[t]
        cases.append(g)
    for g in cases:
        assert dualproj_kkt_violation(g) < 1e-12
        d = dualproj(g)
        assert (g @ d >= -1e-12 * float(gram(g).diag().max())).all()
        # the projection is no farther from the mean than any other point of the cone we know (0, and upgrad's)
        mean = g.mean(0)
        assert float((d - mean).norm()) <= float(mean.norm()) + 1e-12
        assert float((d - mean).norm()) <= float((upgrad(g) - mean).norm()) + 1e-9
    g = G([1.0, 0.0], [0.5, 1.0])  # no conflict with the mean: d is the mean
    close(dualproj(g), g.mean(0))
    close(dualproj(G([1.0, 2.0], [-2.0, -4.0])), [0.0, 0.0])  # opposed
    # TorchJD's docstring example; TorchJD adds a 1e-4 ridge to a normalised Gram matrix, hence the tolerance
    close(dualproj(G([-4.0, 1.0, 1.0], [6.0, 1.0, 1.0])), [0.5563, 1.1109, 1.1109], 1e-3)


# --------------------------------------------------------------------------------------------------
# ConFIG


@pytest.mark.parametrize("k", [2, 3, 5])
def test_config_has_equal_positive_cosines_and_the_summed_projections_as_length(k):
    for seed in range(4):
        g = random_grads(k, 8, 700 + 10 * k + seed) * torch.logspace(-1, 1, k, dtype=torch.float64)[:, None]
        if seed == 1:
            g[1] = -g[0] + 1e-3 * g[1]  # nearly opposed
        if seed == 2:
            g[0] *= 100.0
        d = config(g)
        cos = (g @ d) / (g.norm(dim=1) * d.norm())
        close(cos, torch.full((k,), float(cos[0]), dtype=torch.float64), 1e-10)  # the same cosine with every task ...
        assert float(cos.min()) > 0  # ... and it is positive
        unit = d / d.norm()
        close(d.norm(), (g @ unit).sum(), 1e-9 * float(d.norm()))  # |d| = sum of the projections on d


def test_config_two_task_cases():
    close(config(G([3.0, 0.0], [0.0, 4.0])), [3.5, 3.5])  # orthogonal: the bisector, length 3/sqrt2 + 4/sqrt2
    close(config(G([1.0, 2.0], [-2.0, -4.0])), [0.0, 0.0])  # opposed: no direction helps both
    close(config(G([1.0, 2.0], [1.0, 2.0])), [2.0, 4.0])  # identical: the sum
    close(config(G([0.0, 0.0], [1.0, 2.0])), [1.0, 2.0])  # a zero row is left out
    close(config(G([-4.0, 1.0, 1.0], [6.0, 1.0, 1.0])), [0.1588, 2.0706, 2.0706], 1e-4)  # TorchJD's example
    close(config_weights(gram(G([1.0, 0.0], [0.0, 100.0]))) * torch.tensor([1.0, 100.0], dtype=torch.float64),
          [50.5, 50.5], 1e-9)  # 100x: equal angles, length (1 + 100)/sqrt2


# --------------------------------------------------------------------------------------------------
# FairGrad


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 5.0])
def test_fairgrad_solves_the_alpha_fair_equation(alpha):
    for g in nash_hard_cases():
        m = gram(g)
        w = fairgrad_weights(m, alpha)
        assert (w > 0).all()
        lhs, rhs = m @ w, w ** (-1.0 / alpha)  # (GG^T w)_t = w_t^(-1/alpha) ...
        size = m.abs() @ w + rhs  # ... to round-off in the terms of (GG^T w)_t, which cancel when w ~ 1e5
        assert float(((lhs - rhs).abs() / size).max()) < 1e-13, ((lhs - rhs).tolist(), size.tolist())
        if alpha == 1.0:  # proportional fairness is Nash-MTL's equation
            close(w, nashmtl_weights(m), 1e-7 * float(w.max()))


def test_fairgrad_cases_and_alpha():
    close(fairgrad_weights(gram(G([2.0, 0.0], [0.0, 1.0])), 2.0), [4 ** (-2 / 3), 1.0])  # orthogonal: ||g_t||^2 w_t = w_t^(-1/a)
    g = G([1.0, 0.0], [0.3, 1.0]) * torch.tensor([[1.0], [10.0]], dtype=torch.float64)
    improvement = {a: (g @ fairgrad(g, alpha=a)) for a in (0.5, 1.0, 4.0)}
    # larger alpha favours the worse-off task more: the ratio of the improvements moves towards 1
    ratios = [float(v.min() / v.max()) for v in improvement.values()]
    assert ratios[0] < ratios[1] < ratios[2], ratios
    w = fairgrad_weights(gram(G([0.0, 0.0], [1.0, 2.0])))
    close(w, [0.0, 5 ** -0.5])  # a zero row gets 0; the other: 5 w = 1/w
    d = fairgrad(G([1.0, 2.0], [-2.0, -4.0]))  # opposed: no solution, the ridge gives d ~ 0
    assert torch.isfinite(d).all() and float(d.norm()) < 1e-3


# --------------------------------------------------------------------------------------------------
# MoDo, SDMGrad (single-batch: the three samples are the same batch) and MoCo


def reference_project_simplex(v: np.ndarray) -> np.ndarray:
    """Euclidean projection onto the simplex by bisection on the shift (independent of the sort-based one)."""
    lo, hi = float(v.min()) - 1.0, float(v.max())
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.maximum(v - mid, 0).sum() > 1 else (lo, mid)
    return np.maximum(v - (lo + hi) / 2, 0)


def test_modo_hand_worked_step_and_state():
    w = make("modo", options={"gamma": 0.1, "rho": 0.1})
    g = G([1.0, 0.0], [0.0, 2.0])
    # lambda - 0.1 (GG^T lambda + 0.1 lambda) = (0.5, 0.5) - 0.1 (0.55, 2.05) = (0.445, 0.295); projected: + 0.13 each
    close(w.combine(g), [0.575, 2 * 0.425])
    close(list(w.weights().values()), [0.575, 0.425])
    fresh = roundtrip(w)
    close(fresh.combine(g), w.combine(g), 0)
    close(modo_weights(gram(g), None, 0.1, 0.1), [0.575, 0.425])  # the pure function from 1/K
    before = w.lambd.clone()
    w.combine(G([float("nan"), 0.0], [0.0, 1.0]))
    close(w.lambd, before, 0)  # a non-finite step leaves lambda as it was


@pytest.mark.parametrize("k", [2, 3, 5])
def test_modo_converges_to_the_ridge_min_norm_point(k):
    """With a fixed G, lambda's projected-gradient steps converge to argmin_simplex lambda^T (GG^T + rho I) lambda."""
    for rows in pcgrad_hard_cases(k):
        m = gram(rows).numpy()
        rho = 0.1 * float(np.trace(m)) / k + 1e-3  # a ridge on the scale of the rows
        gamma = 1.0 / (np.linalg.eigvalsh(m).max() + rho)
        lam = np.full(k, 1.0 / k)
        for i in range(1500):  # contracts by at least 1 - rho gamma (>= 1/55 here) a step
            step = modo_step(m, lam, gamma, rho)
            if i < 10:
                close(step, reference_project_simplex(lam - gamma * (m @ lam + rho * lam)), 1e-12)
            lam = step
        target = mgda_weights(torch.tensor(m + rho * np.eye(k)))
        close(lam, target, 1e-7)
    same = G([1.0, 2.0], [1.0, 2.0])  # identical rows keep the uniform weights: d = g
    close(modo(same), [1.0, 2.0], 1e-12)
    close(modo(G([0.0, 0.0], [0.0, 0.0])), [0.0, 0.0], 0)


def sdmgrad_reference(m: np.ndarray, w: np.ndarray, lamda: float, niter: int) -> np.ndarray:
    """The paper's subproblem 1/2 |G^T w|^2 + lamda <G^T w, g0> by projected heavy ball, written from the definition."""
    k = len(w)
    scale2 = np.mean(np.sqrt(np.diag(m))) ** 2
    velocity = np.zeros(k)
    for i in range(niter):
        grad = (m @ w + lamda * m @ np.full(k, 1.0 / k)) / scale2
        velocity = grad if i == 0 else SDMGRAD_MOMENTUM * velocity + grad
        w = reference_project_simplex(w - SDMGRAD_LR * velocity)
    return w


def test_sdmgrad_hand_worked_and_against_the_definition():
    g = G([1.0, 0.0], [0.0, 2.0])
    # s = 1.5: M = diag(1, 4) / 2.25; grad = M w + 0.3 M 1/2 = (0.2889, 1.1556); w - 5 grad projects onto (1, 0)
    alpha, w = sdmgrad_weights(gram(g), None, 0.3, 1)
    close(w, [1.0, 0.0])
    close(alpha, [1.3 / 1.3 - 0.15 / 1.3, 0.15 / 1.3])
    for k in (2, 3, 5):
        for rows in pcgrad_hard_cases(k):
            m = gram(rows).numpy()
            start = np.full(k, 1.0 / k)
            close(sdmgrad_solve(m, start, 0.3, 20), sdmgrad_reference(m, start, 0.3, 20), 1e-10)
    # lamda -> infinity: the mean gradient; lamda = 0: G^T w
    close(sdmgrad(g, lamda=1e12), g.mean(0), 1e-9)
    a0, w0 = sdmgrad_weights(gram(g), None, 0.0, 20)
    close(a0, w0, 0)
    close(sdmgrad(G([1.0, 2.0], [1.0, 2.0])), [1.0, 2.0], 1e-12)  # identical rows: d = g
    close(sdmgrad(G([0.0, 0.0], [0.0, 0.0])), [0.0, 0.0], 0)
    # the authors' step 5 is unstable around an interior optimum with curvature above 2/5 (the docstring): from the
    # exact optimum (0.8, 0.2) of two orthogonal rows, round-off grows until w sits at a vertex
    close(sdmgrad_solve(gram(g).numpy(), np.array([0.8, 0.2]), 0.0, 50), [1.0, 0.0])


@pytest.mark.parametrize("rows", [[[1.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [-1.0, 1e-3]], [[100.0, 0.0], [1.0, 1.0]],
                                  [[1.0, 0.3], [0.2, 1.0]]])
@pytest.mark.parametrize("lamda", [0.0, 0.3, 2.0])
def test_sdmgrad_optimum_is_a_fixed_point(rows, lamda):
    """The exact minimiser of the subproblem over the simplex (K = 2: a clipped 1-D quadratic) is a fixed point of a
    projected step (of any size)."""
    m = gram(G(*rows)).numpy()
    mm = m / np.mean(np.sqrt(np.diag(m))) ** 2
    b = lamda * mm.mean(1)
    # f(x) = 1/2 w^T M w + b^T w on w = (x, 1 - x): f'(x) = (M w + b) . (1, -1)
    a = mm[0, 0] + mm[1, 1] - 2 * mm[0, 1]
    slope0 = (mm @ np.array([0.0, 1.0]) + b) @ np.array([1.0, -1.0])
    x = float(np.clip(-slope0 / a, 0.0, 1.0)) if a > 0 else float(slope0 < 0)
    opt = np.array([x, 1 - x])
    close(sdmgrad_solve(m, opt, lamda, 1), opt, 1e-9)
    w = make("sdmgrad", options={"lamda": lamda, "niter": 1})
    w.w.copy_(torch.tensor(opt))
    w.combine(G(*rows))
    close(w.w, opt, 1e-9)
    fresh = roundtrip(w)
    close(fresh.combine(G(*rows)), w.combine(G(*rows)), 0)
