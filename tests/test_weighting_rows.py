"""Methods that need the rows of G (RowWeighting: GradDrop, DB-MTL, ExcessMTL, MoCo): hand-worked cases, their K x P
state, and its round trip."""

from __future__ import annotations

import math

import pytest
import torch

from mtl.weighting.dbmtl import dbmtl_average, dbmtl_scales
from mtl.weighting.excessmtl import excess_risks
from mtl.weighting.graddrop import graddrop, graddrop_mask, sign_purity
from mtl.weighting.moco import moco_targets, moco_update

from .weighting_cases import (
    G,
    close,
    make,
    pcgrad_hard_cases,
    random_grads,
    roundtrip,
)

# --------------------------------------------------------------------------------------------------
# GradDrop


def test_graddrop_hand_worked_case():
    g = G([1.0, -2.0, 3.0, 0.0, 1.0], [2.0, 1.0, -1.0, 0.0, 0.0])
    close(sign_purity(g), [1.0, 1 / 3, 0.75, 0.5, 1.0])
    # coordinate 0: both positive (P = 1) -> both kept; 1: P = 1/3 < u = 0.5 -> the negative sign; 2: P = 0.75 <
    # u = 0.9 -> the negative sign; 3: nothing; 4: only task 0, positive (P = 1) -> kept
    u = torch.tensor([0.3, 0.5, 0.9, 0.1, 0.99])
    d, kept = graddrop(g, u)
    close(d, [3.0, -2.0, -1.0, 0.0, 1.0])
    close(kept, [(1 + 4 + 1) / 15, (4 + 1) / 6])  # the kept share of each task's squared norm
    d, _ = graddrop(g, torch.tensor([0.3, 0.2, 0.5, 0.1, 0.99]))  # u below P: the positive signs win
    close(d, [3.0, 1.0, 3.0, 0.0, 1.0])
    close(graddrop(g, u, leak=1.0)[0], g.sum(0))  # leak 1: the plain sum
    close(graddrop(g, u, leak=0.25)[0], [3.0, -2.0 + 0.25, -1.0 + 0.75, 0.0, 1.0])


@pytest.mark.parametrize("k", [2, 3, 5])
def test_graddrop_keeps_one_sign_per_coordinate_chosen_with_probability_p(k):
    for g in pcgrad_hard_cases(k):  # random, nearly opposed, 100x, identical rows, a zero row
        for seed in range(3):
            u = torch.rand(g.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            mask = graddrop_mask(g, u)
            kept = torch.where(mask, g, 0.0)
            assert not ((kept > 0).any(0) & (kept < 0).any(0)).any()  # one sign per coordinate
            p = sign_purity(g)
            both = (g > 0).any(0) & (g < 0).any(0)
            assert torch.equal((kept > 0).any(0)[both], (u < p)[both])  # + exactly where u < P
            agree = ~both  # no conflict: every component kept
            assert torch.equal(mask[:, agree], (g != 0)[:, agree])
            d, frac = graddrop(g, u)
            close(d, kept.sum(0))
            assert ((frac >= -1e-12) & (frac <= 1 + 1e-12)).all()
    g = random_grads(1, 6, 5).repeat(k, 1)  # identical rows: nothing conflicts, the sum
    close(graddrop(g, torch.rand(6))[0], k * g[0])
    # the positive sign wins with probability P: 20000 draws at a coordinate with P = 0.75
    g = G([3.0], [-1.0]).repeat(1, 20000)  # 20000 copies of one coordinate, one draw each
    draws = torch.rand(20000, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    wins = float((graddrop(g, draws)[0] > 0).double().mean())
    assert abs(wins - 0.75) < 0.015  # 5 standard deviations


def test_graddrop_draws_are_shared_by_seed_and_step():
    g = random_grads(3, 500, 1)
    g[1] = -g[0] + 0.3 * g[1]  # conflicts everywhere
    a, b, other = make("graddrop", seed=3, tasks=["a", "b", "c"]), make("graddrop", seed=3, tasks=["a", "b", "c"]), \
        make("graddrop", seed=4, tasks=["a", "b", "c"])
    for m in (a, b, other):
        m.begin_step(7)
    da, db, do = a.combine(g), b.combine(g), other.combine(g)
    assert torch.equal(da, db)  # same seed and step: the same draws (every rank)
    assert not torch.equal(da, do)
    a.begin_step(8)
    assert not torch.equal(a.combine(g), da)  # a new draw every step
    fresh = make("graddrop", seed=3, tasks=["a", "b", "c"])  # a resumed run: same config, the step from the trainer
    fresh.load_state_dict(a.state_dict())
    fresh.begin_step(7)
    assert torch.equal(fresh.combine(g), da)
    assert all(0 <= v <= 1 for v in a.weights().values())
    assert make("graddrop").weights() == {"cls": 1.0, "gen": 1.0}
    d32 = b.combine(g.float())
    assert d32.dtype == torch.float32 and torch.isfinite(d32).all()
    for rows in ([[0.0, 0.0], [0.0, 0.0]], [[1.0, float("nan")], [1.0, 1.0]]):
        d = a.combine(G(*rows))
        assert d.shape == (2,)
    close(a.combine(G([0.0, 0.0], [0.0, 0.0])), [0.0, 0.0], 0)


# --------------------------------------------------------------------------------------------------
# DB-MTL


def test_dbmtl_hand_worked_and_balanced():
    w = make("dbmtl")
    g = G([3.0, 0.0], [0.0, 1.0])
    losses = torch.tensor([1.0, 0.5], dtype=torch.float64)
    # h = 0.1 * g / L = (0.3, 0), (0, 0.2): both rescaled to the larger norm 0.3
    close(w.combine(g, losses), [0.3, 0.3])
    close(list(w.weights().values()), [0.1, 1.5 * 0.1 / 0.5])
    # h = 0.9 h + 0.1 g / L = 0.19 (3, 0), 0.19 (0, 2)
    close(w.combine(g, losses), [0.57, 0.57])
    fresh = make("dbmtl")
    fresh.load_state_dict(w.state_dict())
    close(fresh.combine(g, losses), w.combine(g, losses), 0)
    for k in (2, 3, 5):
        for rows in pcgrad_hard_cases(k):
            m = make("dbmtl", tasks=[f"t{i}" for i in range(k)])
            for _ in range(3):
                d = m.combine(rows, torch.linspace(0.5, 3.0, k, dtype=torch.float64))
            h = m.average
            scaled = dbmtl_scales(h)[:, None] * h  # every non-zero average row at the largest norm
            norms = scaled.norm(dim=1)[h.norm(dim=1) > 0]
            close(norms, torch.full_like(norms, float(h.norm(dim=1).max())), 1e-12)
            close(d, scaled.sum(0), 1e-12)
    # the log-loss gradient is scale-free: g_t and L_t both x 100 leave everything unchanged
    a, b = make("dbmtl"), make("dbmtl")
    close(a.combine(g, losses), b.combine(g * torch.tensor([[100.0], [1.0]], dtype=torch.float64),
                                          losses * torch.tensor([100.0, 1.0], dtype=torch.float64)), 1e-12)
    # sigma: the rate at step k is beta / k^sigma
    h1 = dbmtl_average(None, g, losses, 0.9)
    s = make("dbmtl", options={"sigma": 1.0})
    s.combine(g, losses)
    s.combine(2 * g, losses)
    close(s.average, dbmtl_average(h1, 2 * g, losses, 0.9 / 2))
    before = s.average.clone()
    s.combine(G([float("nan"), 0.0], [0.0, 1.0]), losses)
    close(s.average, before, 0)  # a non-finite step does not poison the average


# --------------------------------------------------------------------------------------------------
# ExcessMTL


def test_excessmtl_follows_the_exponentiated_update():
    w = make("excessmtl", options={"eta": 0.5})
    g1, g2 = G([3.0, 0.0], [0.0, 1.0]), G([1.0, 0.0], [0.0, 1.0])
    close(w.combine(g1), [3.0, 1.0])  # first step: w = 1, e(1) recorded
    s = g1 * g1
    e1 = excess_risks(s, g1)
    close(e1, [9.0 / math.sqrt(9.0 + 1e-7), 1.0 / math.sqrt(1.0 + 1e-7)])
    d = w.combine(g2)
    s = s + g2 * g2
    e2 = excess_risks(s, g2)
    raw = torch.exp(0.5 * e2 / e1)
    expected = 2 * raw / raw.sum()
    close(list(w.weights().values()), expected, 1e-12)
    close(d, expected @ g2, 1e-12)
    # task 1's gradient shrank against its history (its excess risk fell), task 2's did not: task 2 gains weight
    assert w.weights()["gen"] > 1 > w.weights()["cls"]
    fresh = make("excessmtl", options={"eta": 0.5})
    fresh.load_state_dict(w.state_dict())
    close(fresh.combine(g2), w.combine(g2), 0)
    assert fresh.weights() == w.weights()
    for k in (2, 3, 5):
        for rows in pcgrad_hard_cases(k):
            m = make("excessmtl", tasks=[f"t{i}" for i in range(k)])
            for _ in range(3):
                d = m.combine(rows)
            assert torch.isfinite(d).all() and abs(sum(m.weights().values()) - k) < 1e-9
    before = w.weights()
    w.combine(G([float("nan"), 0.0], [0.0, 1.0]))
    assert w.weights() == before


def test_moco_follows_its_update_and_tracks_the_gradients():
    w = make("moco")
    g = G([3.0, 0.0], [0.0, 1.0])
    losses = torch.tensor([1.0, 2.0], dtype=torch.float64)
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)  # g_t / ||g_t|| * L_t
    close(moco_targets(g, losses), h, 1e-8)  # (the norm gets + 1e-8, as the authors' code)
    # step 1: beta_1 = 0.5, gamma_1 = 0.1; y = 0.5 h, lambda = softmax(1/2 - 0.1 diag(0.25, 1) 1/2)
    lam1 = torch.softmax(torch.tensor([0.5 - 0.1 * 0.125, 0.5 - 0.1 * 0.5], dtype=torch.float64), 0)
    close(w.combine(g, losses), lam1 @ (0.5 * h), 1e-8)
    close(list(w.weights().values()), lam1, 1e-8)
    y1, lam1 = 0.5 * moco_targets(g, losses), w.lambd.clone()
    # step 2: beta_2 = 0.5 / sqrt 2, gamma_2 = 0.1 / sqrt 2
    g2 = G([0.0, 5.0], [1.0, 1.0])
    h2 = moco_targets(g2, losses)
    y2 = y1 - 0.5 / math.sqrt(2) * (y1 - h2)
    lam2 = torch.softmax(lam1 - 0.1 / math.sqrt(2) * (y2 @ y2.T) @ lam1, 0)
    close(w.combine(g2, losses), lam2 @ y2, 1e-12)
    close(moco_update(y1, lam1, h2, 0.5 / math.sqrt(2), 0.1 / math.sqrt(2), 0.0)[1], lam2, 0)
    fresh = roundtrip(w)
    close(fresh.combine(g, losses), w.combine(g, losses), 0)
    assert fresh.weights() == w.weights()
    # constant gradients: y converges to h; the update is scale-free in each g_t (normalised) but scales with L_t
    c = make("moco")
    for _ in range(300):
        d = c.combine(g, losses)
    close(c.tracked, h, 1e-3)
    a, b = make("moco"), make("moco")
    close(a.combine(g, losses), b.combine(g * torch.tensor([[100.0], [0.01]], dtype=torch.float64), losses),
          1e-5)  # to the 1e-8 added to the norm (0.01 here)
    assert torch.isfinite(d).all()
    for k in (2, 3, 5):
        for rows in pcgrad_hard_cases(k):
            m = make("moco", tasks=[f"t{i}" for i in range(k)])
            for _ in range(3):
                d = m.combine(rows, torch.linspace(0.5, 3.0, k, dtype=torch.float64))
            assert torch.isfinite(d).all() and abs(sum(m.weights().values()) - 1) < 1e-12
    before = (w.tracked.clone(), w.lambd.clone(), w.updates)
    w.combine(G([float("nan"), 0.0], [0.0, 1.0]), losses)
    close(w.tracked, before[0], 0)
    close(w.lambd, before[1], 0)
    assert w.updates == before[2]
    with pytest.raises(ValueError, match="losses"):
        make("moco").combine(g, None)
    close(make("moco", options={"normalize": False}).combine(g, None), 0.5 * g.T @ torch.softmax(
        torch.tensor([0.5 - 0.1 * 0.5 * 2.25, 0.5 - 0.1 * 0.5 * 0.25], dtype=torch.float64), 0), 1e-12)
