"""Loss-level methods (LossWeighting: RLW, UW, DWA, GLS, SI, FAMO, STCH): the formula for given losses and steps, and a
state_dict round trip (a fresh instance loaded from it produces the same next weights)."""

from __future__ import annotations

import math

import pytest
import torch

from mtl.weighting.dwa import dwa_weights
from mtl.weighting.famo import FAMO_EPS, famo_logit_grad
from mtl.weighting.rlw import rlw_weights
from mtl.weighting.stch import stch_weights

from .weighting_cases import (
    LOSS_METHODS,
    TASKS,
    close,
    make,
    roundtrip,
)

# --------------------------------------------------------------------------------------------------
# loss-level methods


def test_rlw_weights_are_softmax_of_normals_shared_by_seed_and_step():
    a, b = make("rlw", seed=5), make("rlw", seed=5)
    seen = []
    for step in range(50):
        a.begin_step(step)
        b.begin_step(step)
        assert a.weights() == b.weights()
        w = a.weights()
        assert all(v > 0 for v in w.values()) and abs(sum(w.values()) - 1) < 1e-12
        seen.append(w["cls"])
    assert len(set(seen)) == 50  # a new draw every step
    other = make("rlw", seed=6)
    other.begin_step(3)
    a.begin_step(3)
    assert other.weights() != a.weights()
    # log(w1/w2) = z1 - z2 ~ N(0, 2) for standard-normal z
    diffs = torch.tensor([math.log(w[0] / w[1]) for w in (rlw_weights(0, s, 2) for s in range(4000))])
    assert abs(float(diffs.mean())) < 0.1 and abs(float(diffs.var()) - 2.0) < 0.2
    a.begin_step(9)
    loss = torch.tensor(3.0)
    close(a.weigh("gen", loss), 3.0 * a.weights()["gen"], 1e-6)
    fresh = roundtrip(a)
    assert fresh.weights() == a.weights()
    fresh.begin_step(10)
    a.begin_step(10)
    assert fresh.weights() == a.weights()


def test_uw_term_weights_and_gradient():
    w = make("uw")
    with torch.no_grad():
        w.log_vars.copy_(torch.tensor([0.3, -0.7]))
    loss = torch.tensor(2.0)
    term = w.weigh("gen", loss)
    close(term, 0.5 * math.exp(0.7) * 2.0 + 0.5 * -0.7, 1e-6)
    (grad,) = torch.autograd.grad(term, w.log_vars)
    close(grad, [0.0, 0.5 - 0.5 * math.exp(0.7) * 2.0], 1e-6)  # d/ds = 0.5 - 0.5 exp(-s) L
    assert w.weights()["cls"] == pytest.approx(0.5 * math.exp(-0.3))
    x = torch.tensor(1.5, requires_grad=True)
    (gx,) = torch.autograd.grad(w.weigh("cls", x**2), x)
    close(gx, 0.5 * math.exp(-0.3) * 3.0, 1e-6)
    assert [p for p in w.parameters()] == [w.log_vars]
    fresh = roundtrip(w)
    assert fresh.weights() == w.weights()
    close(fresh.weigh("gen", loss).detach(), term.detach())


def test_dwa_weights_follow_the_formula():
    w = make("dwa")
    assert w.weights() == {"cls": 1.0, "gen": 1.0}
    w.end_step({"cls": 1.0, "gen": 2.0})
    assert w.weights() == {"cls": 1.0, "gen": 1.0}  # still 1 for the first two steps
    w.end_step({"cls": 0.5, "gen": 1.8})
    r = torch.tensor([0.5 / 1.0, 1.8 / 2.0]) / 2.0
    expected = 2 * torch.softmax(r, 0)
    close(list(w.weights().values()), expected, 1e-6)
    assert w.weights()["gen"] > w.weights()["cls"]  # the slower task gains weight
    close(w.weigh("gen", torch.tensor(3.0)), 3.0 * float(expected[1]), 1e-6)
    w.end_step({"cls": 0.4, "gen": 0.9})
    close(dwa_weights([0.4, 0.9], [0.5, 1.8]), list(w.weights().values()), 1e-12)
    fresh = roundtrip(w)
    assert fresh.weights() == w.weights()
    for m in (w, fresh):
        m.end_step({"cls": 0.3, "gen": 0.85})
    assert fresh.weights() == w.weights()


def test_gls_is_the_log_of_the_geometric_mean():
    w = make("gls")
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    losses = {"cls": x[0] ** 2, "gen": x[1] * 5.0}
    total = sum(w.weigh(t, losses[t]) for t in TASKS)
    # the terms are L_t / (K * L_t.detach()): the value is 1, the gradient that of log (L1 L2)^(1/2)
    close(total, 1.0, 1e-6)
    (gx,) = torch.autograd.grad(total, x)
    # d log L / dx = L'/(K L): 2x/(2 x^2) and 5/(2 * 5x)
    close(gx, [1 / 2.0, 1 / 6.0], 1e-6)
    assert torch.isfinite(w.weigh("cls", torch.tensor(0.0)))


def _si_grad(scales=(1.0, 1.0), x0=(2.0, 3.0)):
    w = make("si")
    x = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    losses = {"cls": scales[0] * x[0] ** 2, "gen": scales[1] * 5.0 * x[1]}
    total = sum(w.weigh(t, losses[t]) for t in TASKS)
    return total, torch.autograd.grad(total, x, retain_graph=True)[0], losses, x


def test_si_gradient_is_the_sum_of_the_tasks_gradients_over_their_losses():
    """SI (Nash-MTL's ScaleInvariantLinearScalarization, sum_t log L_t): the step's gradient is sum_t grad L_t / L_t,
    checked against autograd of the authors' objective torch.sum(torch.log(losses)); each weight is 1."""
    total, gx, losses, x = _si_grad()
    close(total, 2.0, 1e-12)  # the terms are L_t / L_t.detach(): value 1 each
    close(gx, [2 * 2.0 / 2.0**2, 5.0 / (5.0 * 3.0)], 1e-12)  # 2x / x^2 and 5 / 5x
    (want,) = torch.autograd.grad(torch.log(torch.stack([losses["cls"], losses["gen"]])).sum(), x, retain_graph=True)
    close(gx, want, 1e-12)
    assert make("si").weights() == {"cls": 1.0, "gen": 1.0}
    gls = make("gls")
    (g_gls,) = torch.autograd.grad(sum(gls.weigh(t, v) for t, v in losses.items()), x)
    close(gx, len(TASKS) * g_gls, 1e-12)  # gls is the same objective over K


@pytest.mark.parametrize("scales", [(1e-3, 1.0), (1.0, 250.0), (7.0, 0.01)])
def test_si_is_invariant_to_rescaling_any_tasks_loss(scales):
    """The property that names it: L_t -> c_t L_t (c_t > 0) leaves the step unchanged (equal's step changes)."""
    _, g1, _, _ = _si_grad()
    _, g2, _, _ = _si_grad(scales)
    close(g2, g1, 1e-12)
    eq = make("equal")
    x = torch.tensor([2.0, 3.0], dtype=torch.float64, requires_grad=True)
    e1 = torch.autograd.grad(eq.weigh("cls", x[0] ** 2) + eq.weigh("gen", 5.0 * x[1]), x)[0]
    e2 = torch.autograd.grad(eq.weigh("cls", scales[0] * x[0] ** 2) + eq.weigh("gen", scales[1] * 5.0 * x[1]), x)[0]
    assert not torch.allclose(e1, e2)  # the check above can fail: a scale-dependent method fails it


def test_si_with_a_zero_or_tiny_loss_no_epsilon_as_its_authors():
    """A zero loss: no clamp (the authors take log 0 = -inf): the term and its gradient are not finite, which the
    step's finite check skips; a tiny positive loss gives the large finite gradient grad L / L."""
    w = make("si")
    x = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    term = w.weigh("cls", x**2 + 3.0 * x)  # L = 0 at x = 0, grad L = 3
    assert not torch.isfinite(term)
    (gx,) = torch.autograd.grad(term, x)
    assert not torch.isfinite(gx)
    y = torch.tensor(1e-20, dtype=torch.float64, requires_grad=True)
    (gy,) = torch.autograd.grad(w.weigh("cls", 3.0 * y), y)
    close(gy, 1.0 / 1e-20, 1e-9)  # 3 / (3y): finite, huge, not clamped
    assert torch.isfinite(gy)


def test_famo_terms_and_logit_update():
    w = make("famo")
    x = torch.tensor(2.0, requires_grad=True)
    term = w.weigh("cls", x**2)  # first step: c = 1, z = 1/2
    (gx,) = torch.autograd.grad(term, x)
    close(gx, 0.5 * 2 * 2.0 / (4.0 + FAMO_EPS), 1e-6)
    w.end_step({"cls": 1.0, "gen": 1.0})  # no update yet (no "before" loss)
    close(w.logits, [0.0, 0.0])
    w.begin_step(1)
    # c = (sum z/L)^-1 from the previous losses: (0.5 + 0.5)^-1 = 1; term = c z L / L.detach(), whose
    # gradient is that of c z log L (the value itself is c z)
    loss = torch.tensor(3.0, requires_grad=True)
    term = w.weigh("gen", loss)
    close(term, 0.5 * 3.0 / (3.0 + FAMO_EPS), 1e-6)
    (g,) = torch.autograd.grad(term, loss)
    close(g, 0.5 / (3.0 + FAMO_EPS), 1e-6)
    w.end_step({"cls": 0.5, "gen": 0.9})  # cls improved faster
    delta = torch.log(torch.tensor([1.0, 1.0]) + FAMO_EPS) - torch.log(torch.tensor([0.5, 0.9]) + FAMO_EPS)
    g = famo_logit_grad(torch.zeros(2), delta)
    close(g, 0.5 * (delta - delta.mean()), 1e-6)
    close(w.logits, -0.025 * torch.sign(g), 1e-6)  # the first Adam step moves each logit by ~lr
    z = w.weights()
    assert z["gen"] > 0.5 > z["cls"]  # the slower task gains weight
    w.begin_step(2)
    c = 1.0 / (z["cls"] / 0.5 + z["gen"] / 0.9)
    loss = torch.tensor(0.4, requires_grad=True)
    (g,) = torch.autograd.grad(w.weigh("cls", loss), loss)
    close(g, c * z["cls"] / (0.4 + FAMO_EPS), 1e-6)  # d/dL of c z log L
    for losses in ({"cls": 0.45, "gen": 0.8}, {"cls": 0.44, "gen": 0.6}):
        w.end_step(losses)
    fresh = roundtrip(w)
    assert fresh.weights() == w.weights()
    for m in (w, fresh):
        m.begin_step(5)
        m.end_step({"cls": 0.3, "gen": 0.55})
    assert fresh.weights() == w.weights()
    close(fresh.weigh("gen", torch.tensor(0.5)), w.weigh("gen", torch.tensor(0.5)), 1e-12)


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_loss_methods_are_separable(method):
    """A task's term must not change when another task's current loss does."""
    a, b = make(method), make(method)
    for m in (a, b):
        m.end_step({"cls": 1.0, "gen": 2.0})
        m.end_step({"cls": 0.8, "gen": 1.9})
        m.begin_step(2)
    x = torch.tensor(1.3)
    ta = [a.weigh("cls", x), a.weigh("gen", torch.tensor(0.1))]
    tb = [b.weigh("gen", torch.tensor(5.0)), b.weigh("cls", x)]
    close(ta[0].detach(), tb[1].detach(), 0.0)


# --------------------------------------------------------------------------------------------------
# STCH


def test_stch_warms_up_measures_the_nadir_then_weights_the_worst_task():
    w = make("stch", options={"warmup_steps": 3, "nadir_steps": 2, "mu": 0.5})
    x = torch.tensor(2.0, requires_grad=True)
    (gx,) = torch.autograd.grad(w.weigh("cls", x**2), x)
    close(gx, 2 * 2.0 / 4.0, 1e-6)  # warm-up: the gradient of log L
    for losses in ({"cls": 9.0, "gen": 9.0}, {"cls": 2.0, "gen": 4.0}, {"cls": 4.0, "gen": 2.0}):
        w.end_step(losses)
        assert w.weights() == {"cls": 1.0, "gen": 1.0}
    close(w.nadir(), [3.0, 3.0])  # the mean over the last 2 warm-up steps
    w.end_step({"cls": 1.5, "gen": 0.75})  # cls is further from its nadir (relative): it gets more weight
    expected = stch_weights([1.5, 0.75], [3.0, 3.0], 0.5)
    close(list(w.weights().values()), expected, 1e-12)
    close(expected, (2 * torch.softmax(torch.log(torch.tensor([0.5, 0.25], dtype=torch.float64)) / 0.5, 0)).tolist(), 1e-12)
    assert w.weights()["cls"] > 1 > w.weights()["gen"]
    x = torch.tensor(1.2, requires_grad=True)
    (gx,) = torch.autograd.grad(w.weigh("gen", x**2), x)
    close(gx, expected[1] * 2 / 1.2, 1e-6)  # w_t * d log L / dx
    fresh = roundtrip(w)
    assert fresh.weights() == w.weights()
    for m in (w, fresh):
        m.end_step({"cls": 1.0, "gen": 1.0})
    assert fresh.weights() == w.weights()
    sharp = stch_weights([1.5, 0.75], [3.0, 3.0], 1e-3)  # mu -> 0: the Tchebycheff max (the worst task only)
    close(sharp, [2.0, 0.0], 1e-12)
