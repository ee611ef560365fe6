"""nashmtl(optim_niter=N): the authors' CCCP iteration (mtl/weighting/nash_cccp.py) against the exact solve.

What the iteration guarantees: every convex step's solution meets the constraints alpha_t (M alpha)_t >= 1, and the
CCCP objective sum_t (M alpha)_t + phi(alpha) does not increase from step to step; on well-conditioned Gram matrices
it ends near the exact solution (alpha_t (M alpha)_t = 1). On the hard cases its gap from the exact alpha is reported
(printed with -s) and held to what was measured; a zero gradient leaves the warm start, as in the authors' code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtl.tools.bench.nash_gap import hard_cases
from mtl.weighting.nash_cccp import cccp_nash, missing_solver
from mtl.weighting.nashmtl import nashmtl_weights

from .weighting_cases import G, make, random_grads, roundtrip

pytestmark = pytest.mark.skipif(missing_solver() is not None, reason="the nash extra (cvxpy, Clarabel) is missing")


def objective(m: np.ndarray, alpha: np.ndarray) -> float:
    """The CCCP objective: sum_t (M alpha)_t + sum_t log alpha_t + log (M alpha)_t."""
    return float((m @ alpha).sum() + np.log(alpha).sum() + np.log(m @ alpha).sum())


def exact(m: np.ndarray) -> np.ndarray:
    return nashmtl_weights(torch.tensor(m)).numpy()


def well_conditioned(k: int, seed: int) -> np.ndarray:
    g = random_grads(k, 8, 900 + 10 * k + seed)
    g[1:] = g[1:] + 1.5 * g[0]  # a common descent direction
    return (g @ g.T).numpy()


@pytest.mark.parametrize("k", [2, 3, 5, 11])
def test_cccp_is_feasible_descends_and_ends_at_the_exact_alpha(k):
    for seed in range(3):
        m = well_conditioned(k, seed)
        iterates = [cccp_nash(m, np.ones(k), n) for n in range(1, 6)]
        for a in iterates:  # each step's solution meets the constraints (to the solver's tolerance)
            assert (a > 0).all() and (a * (m @ a) >= 1 - 1e-6).all(), a * (m @ a)
        values = [objective(m, a) for a in iterates]
        assert all(b <= a + 1e-7 * abs(a) for a, b in zip(values, values[1:])), values
        a, e = cccp_nash(m, np.ones(k), 20), exact(m)
        assert np.abs(a - e).max() <= 1e-5 * np.abs(e).max(), (a, e)


def test_cccp_stops_by_the_authors_rule():
    """It stops when a step moves alpha by less than 1e-6 (keeping the iterate it solved from): started at the
    exact alpha it returns that start unchanged, and a budget of 0 steps returns the warm start."""
    m = well_conditioned(3, 0)
    e = exact(m)
    report: dict = {}
    assert np.array_equal(cccp_nash(m, e, 20, report), e) and report == {"steps": 0, "stop": "step"}
    start = np.array([0.3, 2.0, 5.0])
    assert np.array_equal(cccp_nash(m, start, 0, report), start) and report == {"steps": 0, "stop": "cap"}
    cccp_nash(m, np.ones(3), 20, report)
    assert 0 < report["steps"] < 20 and report["stop"] == "step"


def test_cccp_on_the_hard_cases_reports_its_gap():
    """Nearly opposed gradients, very unequal norms, identical rows (``nash_gap.hard_cases``; its --cases prints the
    table docs/methods.md gives): the relative gap of alpha (max-norm, to the exact alpha's largest entry) after 20
    steps from ones, printed (-s). Each run either fails its first step and
    keeps the start (nearly opposed pairs, where some (M 1)_t <= 0 makes the linearisation undefined) or ends
    feasible to the solver's accuracy (Clarabel reports some of these solutions inaccurate, as ECOS would)."""
    gaps, kept = [], 0
    for what, g in hard_cases():
        if "zero row" in what:  # test_cccp_zero_gradient_keeps_the_warm_start
            continue
        m = (g @ g.T).numpy()
        start = np.ones(m.shape[0])
        a, e = cccp_nash(m, start, 20), exact(m)
        if np.array_equal(a, start):
            kept += 1
            assert (m @ start).min() <= 0
        else:
            assert (a * (m @ a) >= 1 - 1e-2).all(), a * (m @ a)  # 0.997 where one norm is 100x the other
        gaps.append(float(np.abs(a - e).max() / np.abs(e).max()))
    print(f"relative alpha gap on the hard cases ({kept} kept the start):", ", ".join(f"{x:.1e}" for x in gaps))
    assert 0 < kept < len(gaps) and min(gaps) < 1e-6 and max(gaps) > 1e-2  # both kinds of case are exercised


def test_cccp_zero_gradient_keeps_the_warm_start():
    """A zero row: no alpha meets its constraint, the first solve fails and alpha stays the warm start (the authors'
    code does the same); the exact solve gives it 0 instead."""
    m = (G([0.0, 0.0], [3.0, 4.0]) @ G([0.0, 0.0], [3.0, 4.0]).T).numpy()
    report: dict = {}
    assert np.array_equal(cccp_nash(m, np.ones(2), 20, report), np.ones(2)) and report["stop"] == "failed"
    assert np.array_equal(cccp_nash(np.zeros((2, 2)), np.array([0.5, 2.0]), 20), np.array([0.5, 2.0]))


def test_the_option_changes_alpha_and_the_exact_solve_is_the_default():
    g = G([1.0, 0.0], [-1.0, 1e-2])  # nearly opposed: 20 steps from ones stop short of the exact alpha
    m = g @ g.T
    exact_method, cccp_method = make("nashmtl"), make("nashmtl", options={"optim_niter": 20})
    exact_method.begin_step(0)
    cccp_method.begin_step(0)
    a, b = exact_method.weights_for_gram(m, None, torch.float64), cccp_method.weights_for_gram(m, None, torch.float64)
    assert torch.equal(a, nashmtl_weights(m))
    assert torch.equal(b, torch.tensor(cccp_nash(m.numpy(), np.ones(2), 20)))
    assert cccp_method.warm == b.tolist()  # the next update starts here


def test_the_warm_start_resumes_bitwise():
    """Six updates straight equal three, a state_dict round trip (torch.save) into a fresh instance, and three more."""
    grams = [(g @ g.T) for g in (random_grads(3, 5, 40 + i) + 2.0 for i in range(6))]

    def run(method, steps):
        out = []
        for step in steps:
            method.begin_step(step)
            out.append(method.weights_for_gram(grams[step], None, torch.float64))
        return out

    whole = run(make("nashmtl", tasks=["a", "b", "c"], options={"optim_niter": 20}), range(6))
    first = make("nashmtl", tasks=["a", "b", "c"], options={"optim_niter": 20})
    cut = run(first, range(3))
    resumed = roundtrip(first)
    assert resumed.warm == first.warm and resumed.warm != [1.0, 1.0, 1.0]
    cut += run(resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))


def test_a_missing_solver_is_one_message_naming_the_extra(monkeypatch):
    from mtl.weighting import nash_cccp
    from mtl.weighting.nashmtl import NashMTL

    from .weighting_cases import cfg_for

    monkeypatch.setattr(nash_cccp.importlib.util, "find_spec", lambda name: None)
    errors = NashMTL.check(cfg_for("nashmtl", options={"optim_niter": 20}))
    assert errors == ["weighting.options.optim_niter: the authors' iteration needs cvxpy and Clarabel: pip install -c "
                      "constraints.txt -e '.[nash]' (or remove the option: the exact solve)"]
    assert NashMTL.check(cfg_for("nashmtl")) == []
