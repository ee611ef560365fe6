"""The toy problem (mtl/bench/toy_problem.py) and its benchmark (mtl/tools/bench/toy.py): the function's Pareto set, its
hand-derived Jacobian and the float Adam against torch, Nash-MTL's variant (its scale, starts and shifted losses),
the judgement of a run, the papers' setting as the default and the quick setting end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import mtl.tools.bench.toy as bench_toy
from mtl.bench.toy_problem import (
    NASH_STARTS,
    STARTS,
    VARIANTS,
    distance_to_curve,
    loss_minimum,
    loss_offsets,
    pareto_curve,
    toy_losses,
    toy_losses_and_jacobian,
)
from mtl.tools.bench.toy import EXTRA_ENTRIES, Adam2, grad_methods, judge, main, run_one, setting_label


@pytest.fixture(scope="module")
def curve():
    return pareto_curve()


def test_pareto_set_is_the_papers_segment(curve):
    """Where the two gradients are opposed: x2 = -8.3551 at x1 = 0 (the papers draw x2 = -8.3552), bending down to
    -8.4345 at the ends x1 = +-7, which are the minimisers of f1 and f2."""
    x1, x2 = curve[:, 0], curve[:, 1]
    assert x1[0] == -7 and x1[-1] == 7
    assert abs(x2[len(x2) // 2] - (-8.3552)) < 2e-4
    assert x2.max() <= -8.355 and x2.min() >= -8.4345 - 1e-4
    assert np.allclose(x2, x2[::-1], atol=1e-9)  # symmetric in x1
    pts = torch.tensor(curve, dtype=torch.float64, requires_grad=True)
    f = toy_losses(pts)
    g = torch.stack([torch.autograd.grad(f[:, t].sum(), pts, retain_graph=True)[0] for t in range(2)], 1)
    cos = torch.nn.functional.cosine_similarity(g[1:-1, 0], g[1:-1, 1], dim=1)
    assert float(cos.max()) < -1 + 1e-9  # exactly opposed inside: Pareto-stationary


def test_pareto_set_is_the_set_of_non_dominated_points(curve):
    """Along the curve f2 falls as f1 rises (a trade-off): the Pareto front f2 = F(f1). No point of a grid over
    [-10, 10]^2 (step 0.1) lies below that front beyond its interpolation error, and every grid point farther than
    0.1 from the curve lies strictly above it (it is dominated)."""
    axis = torch.linspace(-10, 10, 201, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    fg = toy_losses(grid).numpy()
    fc = toy_losses(torch.tensor(curve, dtype=torch.float64)).numpy()
    order = np.argsort(fc[:, 0])
    f1, f2 = fc[order, 0], fc[order, 1]
    assert (np.diff(f2) < 0).all()
    assert fg[:, 0].min() >= f1[0] - 1e-12 and fg[:, 1].min() >= f2[-1] - 1e-12  # the ends are the tasks' minima
    above = np.where(fg[:, 0] <= f1[-1], fg[:, 1] - np.interp(fg[:, 0], f1, f2), fg[:, 1] - f2[-1])
    assert above.min() > -1e-7
    far = distance_to_curve(grid.numpy(), curve[::4]) > 0.1
    assert far.sum() > 0.98 * len(grid) and above[far].min() > 0


@pytest.mark.parametrize("scale,shifted", [(1.0, False), (0.1, False), (0.1, True)])
def test_float_jacobian_equals_autograd(scale, shifted):
    pts = torch.rand(300, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 21 - 10.5
    pts = torch.cat([pts, torch.tensor([[-7.0, 1e-3], [3.0, -1e-3], [-8.5, 7.5], [9.0, 9.0], [0.0, -8.3552]],
                                       dtype=torch.float64)])
    x = pts.clone().requires_grad_(True)
    f = toy_losses(x, scale, shifted)
    jac = torch.stack([torch.autograd.grad(f[:, t].sum(), x, retain_graph=True)[0] for t in range(2)], 1)
    offsets = loss_offsets(scale, shifted)
    for i in range(len(pts)):
        f1, f2, j = toy_losses_and_jacobian(*pts[i].tolist(), scale, offsets)
        ref = float(jac[i].abs().max()) + float(f[i].detach().abs().max())
        assert abs(f1 - float(f[i, 0].detach())) <= 1e-12 * ref and abs(f2 - float(f[i, 1].detach())) <= 1e-12 * ref
        assert float((torch.tensor(j, dtype=torch.float64) - jac[i]).abs().max()) <= 1e-10 * max(ref, 1.0), i


def test_float_adam_equals_torch_adam():
    x = torch.tensor([-8.5, 7.5], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([x], lr=1e-3)
    mine = Adam2([-8.5, 7.5], 1e-3)
    for _ in range(40):
        *_, jac = toy_losses_and_jacobian(*x.tolist())
        g = [jac[0][0] + jac[1][0], jac[0][1] + jac[1][1]]
        x.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        mine.step(g)
        assert max(abs(a - b) for a, b in zip(mine.x, x.tolist())) < 1e-14


def test_a_run_on_the_set_is_reached_at_once_and_a_far_one_never(curve):
    on = run_one("mgda", (0.0, float(curve[len(curve) // 2, 1])), 3, 1e-2, 1.0, False, 0.1, 1, curve)
    assert on["reached"] == 1 and on["distance"] < 0.05 and len(on["trajectory"]) == 4
    assert on["ending"] == "on the set, centred"
    far = run_one("mgda", STARTS[2], 3, 1e-2, 1.0, False, 0.1, 1, curve)
    assert far["reached"] is None and far["distance"] > 17
    assert far["ending"] == "off the set, stalled in the upper half (x2 > 0)"  # 3 steps of 1e-2: moved < 0.1


def test_the_tool_writes_a_row_for_every_gradient_level_method_and_start(tmp_path):
    from mtl.weighting import weighting_types

    methods = grad_methods()
    assert set(methods) == {n for n, c in weighting_types().items() if c.level == "grad"} and len(methods) >= 15
    assert main(["--steps", "3", "--keep_every", "1", "--no_plot", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "toy.md").read_text()
    assert "a custom setting (Adam lr 0.001, 3 steps): NOT the paper's setting (lr 0.001, 100,000 steps" in md
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    entries = [*methods, *EXTRA_ENTRIES["cagrad"]]
    assert len(rows) == 3 * len(entries) + len(entries)  # a row per run, and one summary row per method
    for m in entries:
        for s in STARTS:
            assert sum(line.startswith(f"| `{m}` | ({s[0]:g}, {s[1]:g}) |") for line in rows) == 1, (m, s)
        assert f"| `{m}` | 0/3 | 0/3 | 0/3 | - |" in rows  # 3 steps of lr 1e-3 reach nothing
    assert not (tmp_path / "toy.png").exists()
    data = json.loads((tmp_path / "toy.json").read_text())
    assert all(len(r["trajectory"]) == 4 for r in data["results"])
    assert all(r["cpu_s"] > 0 and math.isfinite(r["losses"][0]) for r in data["results"])


def test_the_tool_draws_the_trajectories(tmp_path):
    assert main(["--steps", "2", "--methods", "mgda;cagrad(c=0.5)", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "toy.png").stat().st_size > 10_000


def test_the_tool_refuses_an_unknown_or_loss_level_method(tmp_path, capsys):
    assert main(["--methods", "uw", "--out", str(tmp_path)]) == 2
    assert main(["--methods", "cagrad(cc=1)", "--out", str(tmp_path)]) == 2
    assert "unknown option" in capsys.readouterr().err


def test_the_default_is_the_papers_setting(tmp_path, monkeypatch):
    """Without options the tool runs CAGrad's toy as its paper does (lr 1e-3, 100,000 steps, its three starts, f1 as
    is); --variant nashmtl runs Nash-MTL's (lr 1e-3, 35,000 steps, five starts, f1 x 0.1, shifted losses)."""
    calls = []

    def fake_run_all(methods, starts, steps, lr, scale, shifted, near, keep_every, jobs):
        calls.append((starts, steps, lr, scale, shifted, jobs))
        raise KeyboardInterrupt  # stop before the runs

    monkeypatch.setattr(bench_toy, "run_all", fake_run_all)
    for argv in (["--jobs", "2"], ["--variant", "nashmtl"]):
        with pytest.raises(KeyboardInterrupt):
            main([*argv, "--methods", "mgda", "--out", str(tmp_path)])
    assert calls == [(STARTS, 100_000, 1e-3, 1.0, False, 2), (NASH_STARTS, 35_000, 1e-3, 0.1, True, 1)]
    assert setting_label("cagrad", 1e-3, 100_000, True) == "the paper's setting (Adam lr 0.001, 100,000 steps)"
    assert "NOT the paper's" in setting_label("cagrad", 1e-3, 100_000, False)  # other starts
    assert "NOT the paper's" in setting_label("nashmtl", 1e-3, 100_000, True)
    assert setting_label("nashmtl", 1e-3, 35_000, True).startswith("the paper's setting")


def test_nash_mtl_variant_is_its_papers_problem():
    """Nash-MTL's experiments/toy: f1 scaled by 0.1 and the five starts of its trainer. Shifted by their minimum, both
    losses are >= 0 over the plane and 0 at their minimisers, the ends of the Pareto set; the gradients do not move."""
    v = VARIANTS["nashmtl"]
    assert (v.scale, v.shifted) == (0.1, True)
    assert v.starts == ((-8.5, 7.5), (0.0, 0.0), (9.0, 9.0), (-7.5, -0.5), (9.0, -1.0))
    c = VARIANTS["cagrad"]
    assert (c.scale, c.shifted, c.starts) == (1.0, False, ((-8.5, 7.5), (-8.5, -5.0), (9.0, 9.0)))
    x2_min, low = loss_minimum()
    assert abs(low - (-19.98942513696)) < 1e-9 and abs(x2_min - (-8.4344598)) < 1e-6
    axis = torch.linspace(-10, 10, 401, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    f = toy_losses(grid, 0.1, shifted=True)
    assert float(f.min()) >= 0
    ends = torch.tensor([[7.0, x2_min], [-7.0, x2_min]], dtype=torch.float64)
    fe = toy_losses(ends, 0.1, shifted=True)
    assert abs(float(fe[0, 0])) < 1e-12 and abs(float(fe[1, 1])) < 1e-12
    plain = toy_losses(grid, 0.1)
    assert torch.allclose(plain - f, torch.tensor([0.1 * low, low], dtype=torch.float64), atol=1e-12, rtol=0)
    assert loss_offsets(1.0, False) == (0.0, 0.0)


def test_judge_says_only_what_is_robust():
    """On the set: centred (|x1| <= 0.5) or the side; off it: stalled or still moving (over the last tenth of the
    run), and the half of the plane. Nothing finer: two starts 1e-12 apart can end units apart (PCGrad, CAGrad in the
    upper region), so the exact endpoint is no result."""
    mid = -8.3551
    assert judge((0.3, mid), 0.01) == "on the set, centred"
    assert judge((-0.3, mid), 0.01) == "on the set, centred"
    assert judge((3.3, -8.37), 0.0) == "on the set, f1's side (x1 > 0)"
    assert judge((-6.6, -8.43), 0.0) == "on the set, f2's side (x1 < 0)"
    assert judge((0.0, -8.0), 0.36) == "off the set, stalled in the lower half"
    assert judge((-6.0, 0.5), 8.9, moved=0.05) == "off the set, stalled in the upper half (x2 > 0)"
    assert judge((-6.0, 0.5), 8.9, moved=0.5) == "off the set, still moving in the upper half (x2 > 0)"
    assert judge((0.0, -8.3), 0.06, near=0.05) == "off the set, stalled in the lower half"
    assert judge((3.0, -8.37), 0.0, moved=5.0) == "on the set, f1's side (x1 > 0)"  # on the set: moving along it


def test_quick_setting_end_to_end(tmp_path):
    """--quick (lr 1e-2, 3,000 steps) runs the whole tool, labelled as not the paper's setting. What it finds from
    (-8.5, -5), the start every method reaches the set from: the mean at its centre, MGDA at f2's end."""
    assert main(["--quick", "--methods", "cagrad(c=0);mgda", "--no_plot", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "toy.md").read_text()
    assert "the quick setting (Adam lr 0.01, 3,000 steps): NOT the paper's setting (lr 0.001, 100,000 steps" in md
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in md.splitlines()}
    assert rows[("`cagrad(c=0)`", "(-8.5, -5)")].endswith("| on the set, centred |")
    assert rows[("`mgda`", "(-8.5, -5)")].endswith("| on the set, f2's side (x1 < 0) |")
    assert "| `cagrad(c=0)` | 1/3 | 1/3 | 1/3 |" in md
    data = json.loads((tmp_path / "toy.json").read_text())
    assert data["steps"] == 3000 and data["lr"] == 1e-2 and len(data["results"]) == 6
    assert all(len(r["trajectory"]) == 501 for r in data["results"])  # every 6th of 3,000 steps, and the start


def test_nash_variant_runs_the_methods_that_need_positive_losses(tmp_path):
    """In Nash-MTL's variant the losses are >= 0, so DB-MTL (g_t / L_t, the gradient of log L_t) steps with finite
    updates from all five starts (a few quick steps)."""
    assert main(["--variant", "nashmtl", "--lr", "1e-2", "--steps", "200", "--methods", "dbmtl;nashmtl(max_norm=1)",
                 "--no_plot", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "toy.json").read_text())
    assert data["scale"] == 0.1 and data["shifted"] and len(data["results"]) == 10
    for r in data["results"]:
        assert r["first_nonfinite"] is None and min(r["losses"]) >= 0, r["method"]
        assert r["final"] != r["start"]


def test_a_skipped_step_keeps_the_trajectorys_bookkeeping(curve):
    """excessmtl from (9, 9) at lr 1e-2 makes non-finite updates from step 372 (CAGrad's losses are not >= 0): those
    steps are skipped, as the trainer skips them, but still count for the kept points and the last tenth."""
    r = run_one("excessmtl", STARTS[2], 400, 1e-2, 1.0, False, 0.1, 1, curve)
    assert r["first_nonfinite"] == 372
    assert len(r["trajectory"]) == 401  # the start and one point per step, skipped or not
    assert r["moved_last_tenth"] == math.dist(r["final"], r["trajectory"][360])


@pytest.mark.slow
def test_runs_in_two_processes_come_back_in_the_tables_order_with_the_same_numbers():
    """--jobs 2 runs the longest methods first (a probe of each method's cost), then puts every result back in
    the (method, start) order of the table: the numbers equal a one-process run's, row for row."""
    methods, starts = ["mgda", "nashmtl", "cagrad(c=0.5)"], STARTS[:2]
    args = (methods, starts, 200, 1e-3, 1.0, False, 0.1, 50)
    one = bench_toy.run_all(*args, jobs=1)
    two = bench_toy.run_all(*args, jobs=2)
    assert [(r["method"], r["start"]) for r in two] == [(m, list(s)) for m in methods for s in starts]
    for a, b in zip(one, two):
        assert a["final"] == b["final"] and a["trajectory"] == b["trajectory"]
