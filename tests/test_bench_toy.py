"""The toy problem (mtl/toy.py) and its benchmark (mtl/tools/bench_toy.py): the function's Pareto set, its
hand-derived Jacobian and the float Adam against torch, and the tool writing a row per method and start."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mtl.tools.bench_toy import EXTRA_ENTRIES, Adam2, grad_methods, main, run_one
from mtl.toy import STARTS, distance_to_curve, pareto_curve, toy_losses, toy_losses_and_jacobian


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


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_float_jacobian_equals_autograd(scale):
    pts = torch.rand(300, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 21 - 10.5
    pts = torch.cat([pts, torch.tensor([[-7.0, 1e-3], [3.0, -1e-3], [-8.5, 7.5], [9.0, 9.0], [0.0, -8.3552]],
                                       dtype=torch.float64)])
    x = pts.clone().requires_grad_(True)
    f = toy_losses(x, scale)
    jac = torch.stack([torch.autograd.grad(f[:, t].sum(), x, retain_graph=True)[0] for t in range(2)], 1)
    for i in range(len(pts)):
        f1, f2, j = toy_losses_and_jacobian(*pts[i].tolist(), scale=scale)
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
    on = run_one("mgda", (0.0, float(curve[len(curve) // 2, 1])), 3, 1e-2, 1.0, 0.1, 1, curve)
    assert on["reached"] == 1 and on["distance"] < 0.05 and len(on["trajectory"]) == 4
    far = run_one("mgda", STARTS[2], 3, 1e-2, 1.0, 0.1, 1, curve)
    assert far["reached"] is None and far["distance"] > 17


def test_the_tool_writes_a_row_for_every_gradient_level_method_and_start(tmp_path):
    from mtl.weighting import weighting_types

    methods = grad_methods()
    assert set(methods) == {n for n, c in weighting_types().items() if c.level == "grad"} and len(methods) >= 15
    assert main(["--steps", "3", "--keep_every", "1", "--no_plot", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "toy.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == 3 * (len(methods) + len(EXTRA_ENTRIES))
    for m in [*methods, *EXTRA_ENTRIES]:
        for s in STARTS:
            assert sum(line.startswith(f"| `{m}` | ({s[0]:g}, {s[1]:g}) |") for line in rows) == 1, (m, s)
    assert all(line.endswith("| never |") for line in rows)  # 3 steps of lr 1e-2 reach nothing
    assert math.isfinite(float(rows[0].split("|")[4]))
    assert not (tmp_path / "toy.png").exists()
    data = json.loads((tmp_path / "toy.json").read_text())
    assert all(len(r["trajectory"]) == 4 for r in data["results"])


def test_the_tool_draws_the_trajectories(tmp_path):
    assert main(["--steps", "2", "--methods", "mgda;cagrad(c=0.5)", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "toy.png").stat().st_size > 10_000


def test_the_tool_refuses_an_unknown_or_loss_level_method(tmp_path, capsys):
    assert main(["--methods", "uw", "--out", str(tmp_path)]) == 2
    assert main(["--methods", "cagrad(cc=1)", "--out", str(tmp_path)]) == 2
    assert "unknown option" in capsys.readouterr().err
