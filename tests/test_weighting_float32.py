"""Gram-matrix solvers on Gram matrices from float32 rows (issue 44 §3): ``gram_matrix`` is exactly symmetric, and
CAGrad's and MGDA's solves converge on such matrices (their own flags: CAGrad's ``DualSolve``, MGDA's NNLS answer
certified without its Frank-Wolfe fallback) to a point that meets each paper's optimality conditions. Before the fix
the float32 product was asymmetric by up to ~2e-6 of its entries and neither solver could meet its 1e-12 check.
Nash-MTL and UPGrad, checked for the same defect, meet their conditions on such matrices (they did before too)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtl.tools.bench.solve_cost import rows_for
from mtl.weighting import mgda as mgda_module
from mtl.weighting import qp
from mtl.weighting.base import gram_matrix, gram_numpy
from mtl.weighting.cagrad import CAGRAD_MAX_ITER, cagrad_solve, cagrad_weights, kkt_tol
from mtl.weighting.nashmtl import default_exists_tol, nashmtl_weights
from mtl.weighting.upgrad import upgrad_projections

from .weighting_cases import make

CASES = [(kind, k, seed) for kind in ("random", "ill") for k in (3, 11, 40) for seed in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gram_matrix_is_exactly_symmetric(dtype):
    for kind, k, seed in CASES:
        rows = rows_for(kind, k, seed).to(dtype)
        g = gram_matrix(rows)
        assert g.dtype == torch.float64 and torch.equal(g, g.T), (kind, k, seed)
        exact = rows.double() @ rows.double().T
        assert float((g - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    m = torch.tensor([[2.0, 1.0], [1.0 + 1e-7, 3.0]], dtype=torch.float64)  # a caller's (or an all-reduced) matrix
    assert np.array_equal(gram_numpy(m), gram_numpy(m).T)


def test_the_tolerance_follows_the_rows_precision():
    assert kkt_tol(torch.float64) == 1e-12
    assert kkt_tol(torch.float32) == kkt_tol(torch.bfloat16) == torch.finfo(torch.float32).eps
    assert mgda_module.default_tol(torch.float64) == 1e-12
    assert mgda_module.default_tol(torch.float16) == torch.finfo(torch.float32).eps


@pytest.mark.parametrize("kind,k,seed", CASES)
def test_cagrad_converges_on_float32_gram_matrices(kind, k, seed):
    """The dual converges (certified, far under the iteration cap) and the update solves the paper's problem for the
    Gram matrix it was given: d = alpha @ G lies in the ball ||d - g_0|| <= c ||g_0||, and its worst task's
    improvement min_t g_t . d meets the dual value F(w) of the w it came from (weak duality: no d in the ball does
    better than any F(w)), to the float32 Gram matrix's precision. Everything from M = G G^T in float64."""
    c = 0.4
    rows = rows_for(kind, k, seed).float()
    gram = gram_matrix(rows)
    m = gram_numpy(gram)
    sol = cagrad_solve(m, c, tol=kkt_tol(torch.float32))
    assert sol.converged and sol.iterations <= 50 < CAGRAD_MAX_ITER, sol
    method = make("cagrad", tasks=[f"t{i}" for i in range(k)], options={"c": c, "rescale": False})
    method.begin_step(0)
    alpha = method.weights_for_gram(gram, None, torch.float32).numpy()
    assert np.allclose(alpha, cagrad_weights(gram, c, False, kkt_tol(torch.float32)).numpy(), rtol=0, atol=0)
    ones = np.full(k, 1.0 / k)
    g0_norm = math.sqrt(float(ones @ m @ ones))
    offset = alpha - ones
    assert math.sqrt(max(float(offset @ m @ offset), 0.0)) <= c * g0_norm * (1 + 1e-6)  # in the ball
    w = offset / offset.sum()
    assert (w >= 0).all()
    dual = float(w @ m @ ones) + c * g0_norm * math.sqrt(max(float(w @ m @ w), 0.0))
    primal = float((m @ alpha).min())
    scale = math.sqrt(float(np.max(np.diag(m)))) * g0_norm
    assert abs(dual - primal) <= 1e-6 * scale, (dual, primal, scale)


@pytest.mark.parametrize("kind,k,seed", CASES)
def test_mgda_certifies_float32_gram_matrices_without_frank_wolfe(kind, k, seed, monkeypatch):
    """MGDA's NNLS answer is certified as it stands (its Frank-Wolfe fallback, up to 1,000 steps, is not needed),
    and meets the min-norm point's conditions (Sener & Koltun): d . g_t >= ||d||^2 for every task, with equality
    where alpha_t > 0, to the float32 Gram matrix's precision."""
    def no_fallback(*args, **kwargs):
        raise AssertionError("Frank-Wolfe fallback: the NNLS answer was not certified")

    monkeypatch.setattr(mgda_module, "frank_wolfe_min_norm", no_fallback)
    rows = rows_for(kind, k, seed).float()
    gram = gram_matrix(rows)
    method = make("mgda", tasks=[f"t{i}" for i in range(k)])
    method.begin_step(0)
    alpha = method.weights_for_gram(gram, None, torch.float32).numpy()
    m = gram_numpy(gram)
    dots, sq = m @ alpha, float(alpha @ m @ alpha)
    limit = torch.finfo(torch.float32).eps * float(np.max(np.diag(m)))
    assert (dots >= sq - limit).all() and (np.abs(dots[alpha > 0] - sq) <= limit).all()


@pytest.mark.parametrize("k,seed", [(k, seed) for k in (3, 11, 40) for seed in range(3)])
def test_nashmtl_and_upgrad_meet_their_conditions_on_float32_gram_matrices(k, seed):
    """The other Gram solvers checked for the same defect (they symmetrised their matrices already; IMTL-G and
    Aligned-MTL are closed forms): on float32 rows Nash-MTL solves its bargaining equation (M alpha)_t alpha_t = 1
    (random rows: a solution exists), and each of UPGrad's projections v_i >= e_i meets the non-negative QP's
    optimality conditions at the 1e-12 bar of ``nonneg_qp``."""
    rows = rows_for("random", k, seed).float()
    gram = gram_matrix(rows)
    m = gram_numpy(gram)
    alpha = nashmtl_weights(gram, exists_tol=default_exists_tol(torch.float32)).numpy()
    assert np.allclose((m @ alpha) * alpha, 1.0, rtol=0, atol=1e-9)
    for kind in ("random", "ill"):
        m = gram_numpy(gram_matrix(rows_for(kind, k, seed).float()))
        v = upgrad_projections(torch.from_numpy(m)).numpy()
        for i in range(k):
            lower = np.eye(k)[i]
            assert qp.qp_optimal(m, m @ lower, v[i] - lower, 1e-12), (kind, i)
