"""The papers' toy problem: every gradient-level method from CAGrad's three starting points. ``make bench-toy``.

    python -m mtl.tools.bench_toy [--steps N] [--lr 1e-3] [--scale 1.0] [--methods a,b(c=1)] [--jobs N] [--out DIR]

The problem is ``mtl/toy.py`` (CAGrad's Fig. 1, also Nash-MTL's): two losses of a point x in the plane, whose
Pareto set is the curve from (-7, -8.43) to (7, -8.43) through (0, -8.3551). Each method is the
``Weighting`` class a training run builds (``weighting_types()[name](cfg, tasks)``, K = 2 tasks, its options from
the entry, e.g. ``cagrad(c=0.5)``), stepped as the trainer steps it: ``begin_step``, ``combine(J, losses)`` on the
2 x 2 Jacobian (each loss's gradient w.r.t. the 2-D parameter x), then Adam on x with the combined gradient, then
``end_step(losses)``. Every registered gradient-level method runs unless ``--methods`` names some.

Adam is the papers' (betas (0.9, 0.999), eps 1e-8, no weight decay), written out in floats (``Adam2``;
tests/test_bench_toy.py checks it against ``torch.optim.Adam``): at this size a torch optimizer step would cost
more than most methods' maths. **The default is not the papers' run:** lr 1e-2 for 3,000 steps instead of
their lr 1e-3 for 100,000 (CAGrad) or 35,000 (Nash-MTL) steps. Adam moves each coordinate by at most about lr a
step, so from (9, 9) the set (17.4 below) needs at least ~17,400 steps at lr 1e-3, and a method's own maths
costs 0.3-3 ms a step here (one process, K = 2): the papers' length for ~20 methods x 3 starts is an hour of
CPU, the default a couple of minutes. The larger lr covers the same distance but is a different run (some
methods end elsewhere; docs/benchmark.md shows both). ``--lr 1e-3 --steps 100000`` is the papers'
setting; ``--jobs`` runs the (method, start) pairs in that many processes. The default list is every registered
gradient-level method plus ``cagrad(c=0)`` (the mean gradient: the papers' linear scalarisation) and
``cagrad(c=0.5)`` (the c of CAGrad's toy figure).

Writes into ``--out``: ``toy.md`` (per method and start: the final point, its distance to the Pareto set,
the mean loss (f1 + f2) / 2 there, and the first step within ``--near`` (0.1) of the set, or "never"),
``toy.json`` (the same numbers and the trajectories, every ``--keep_every`` steps) and ``toy.png``
(the trajectories over the contours of the mean loss, one panel per method).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

DEFAULT_STEPS = 3000
DEFAULT_LR = 1e-2
PAPER_LR = 1e-3
# Linear scalarisation (the papers' "LS" / "Adam"): CAGrad with c = 0 is exactly the mean gradient; and CAGrad with
# the c of CAGrad's toy figure (0.5; 0.4 is its default for the image benchmarks)
EXTRA_ENTRIES = ("cagrad(c=0)", "cagrad(c=0.5)")
NEAR = 0.1


class Adam2:
    """Adam (Kingma & Ba 2015, as ``torch.optim.Adam`` with its defaults) on a point of the plane, in floats."""

    def __init__(self, x: list[float], lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.x, self.lr, self.b1, self.b2, self.eps = list(x), lr, betas[0], betas[1], eps
        self.m, self.v, self.t = [0.0, 0.0], [0.0, 0.0], 0

    def step(self, grad: list[float]) -> list[float]:
        self.t += 1
        c1, c2 = 1.0 - self.b1 ** self.t, 1.0 - self.b2 ** self.t
        for i in range(2):
            self.m[i] = self.b1 * self.m[i] + (1.0 - self.b1) * grad[i]
            self.v[i] = self.b2 * self.v[i] + (1.0 - self.b2) * grad[i] * grad[i]
            self.x[i] -= self.lr / c1 * self.m[i] / (math.sqrt(self.v[i] / c2) + self.eps)
        return self.x


def grad_methods() -> list[str]:
    """Every registered gradient-level method, by name."""
    from mtl.weighting import weighting_types

    return sorted(n for n, cls in weighting_types().items() if cls.level == "grad")


_CFG = None


def build_method(entry: str, seed: int = 0):
    """The ``Weighting`` a run with ``weighting.method`` (and ``weighting.options``) from ``entry`` builds, K = 2."""
    from omegaconf import OmegaConf

    from mtl.build import build_weighting
    from mtl.config import Config, check_options
    from mtl.tools.bench import parse_method
    from mtl.weighting import weighting_types

    name, options = parse_method(entry)
    types = weighting_types()
    if name not in types or types[name].level != "grad":
        raise ValueError(f"{entry!r}: not a gradient-level method (these are: {', '.join(grad_methods())})")
    global _CFG
    if _CFG is None:  # building the structured config takes ~0.1 s; the methods read it only when constructed
        _CFG = OmegaConf.structured(Config)
    cfg = _CFG
    cfg.seed, cfg.tasks = seed, ["f1", "f2"]
    cfg.weighting.method, cfg.weighting.options = name, options
    errors: list[str] = []
    check_options(options, types[name].Options, "weighting.options", errors)
    errors += types[name].check(cfg)
    if errors:
        raise ValueError(f"{entry!r}: " + "; ".join(errors))
    return build_weighting(cfg)


def run_one(entry: str, start, steps: int, lr: float, scale: float, near: float, keep_every: int, curve) -> dict:
    """One method from one start: the trajectory (every ``keep_every`` steps and the last point) and its numbers."""
    import torch

    from mtl.toy import distance_to_curve, toy_losses_and_jacobian

    torch.set_num_threads(1)
    method = build_method(entry)
    opt = Adam2(list(start), lr)
    x = list(start)
    kept, reached, failed = [list(x)], None, None
    for step in range(steps):
        f1, f2, jac = toy_losses_and_jacobian(x[0], x[1], scale)
        method.begin_step(step)
        d = method.combine(torch.tensor(jac, dtype=torch.float64), torch.tensor([f1, f2], dtype=torch.float64))
        d = d.tolist()
        if not all(math.isfinite(v) for v in d):  # what the trainer does with a non-finite update: skip the step
            failed = failed if failed is not None else step
            continue
        x = opt.step(d)
        method.end_step({"f1": f1, "f2": f2})
        if reached is None and -8.5 - near < x[1] < -8.3 + near and abs(x[0]) < 7 + near \
                and float(distance_to_curve(np.array([x]), curve)[0]) <= near:  # (the set lies in that box)
            reached = step + 1
        if (step + 1) % keep_every == 0:
            kept.append(list(x))
    if kept[-1] != x:
        kept.append(list(x))
    f1, f2, _ = toy_losses_and_jacobian(x[0], x[1], scale)
    return {"method": entry, "start": list(start), "final": list(x),
            "distance": float(distance_to_curve(np.array([x]), curve)[0]), "mean_loss": (f1 + f2) / 2,
            "reached": reached, "first_nonfinite": failed, "trajectory": kept}


def _run_star(args):
    return run_one(*args)


def run_all(methods: list[str], steps: int, lr: float, scale: float, near: float, keep_every: int, jobs: int) -> list[dict]:
    from mtl.toy import STARTS, pareto_curve

    curve = pareto_curve()
    work = [(m, s, steps, lr, scale, near, keep_every, curve) for m in methods for s in STARTS]
    if jobs <= 1:
        return [run_one(*w) for w in work]
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(jobs) as pool:
        return pool.map(_run_star, work, chunksize=1)


def table(results: list[dict], near: float) -> str:
    lines = [f"| method | start | final point | distance to the Pareto set | mean loss | steps to within {near} |",
             "|---|---|---|---|---|---|"]
    for r in results:
        s, f = r["start"], r["final"]
        reached = "never" if r["reached"] is None else f"{r['reached']:,}"
        if r["first_nonfinite"] is not None:
            reached += f" (non-finite update from step {r['first_nonfinite']})"
        lines.append(f"| `{r['method']}` | ({s[0]:g}, {s[1]:g}) | ({f[0]:.3f}, {f[1]:.3f}) | {r['distance']:.3f} "
                     f"| {r['mean_loss']:.3f} | {reached} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str, scale: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from mtl.toy import STARTS, pareto_curve, toy_losses

    methods = list(dict.fromkeys(r["method"] for r in results))
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    n = 200
    grid = np.linspace(-10.5, 10.5, n)
    gx, gy = np.meshgrid(grid, grid)
    pts = torch.tensor(np.stack([gx, gy], -1), dtype=torch.float64)
    mean = toy_losses(pts, scale).mean(-1).numpy()
    curve = pareto_curve()
    colours = ["tab:red", "tab:blue", "tab:green"]
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.axis("off")
    for ax, m in zip(axes.flat, methods):
        ax.contour(gx, gy, mean, levels=20, cmap="viridis", linewidths=0.7)
        ax.plot(curve[:, 0], curve[:, 1], color="gray", linewidth=4, zorder=1)
        for r in (r for r in results if r["method"] == m):
            t = np.array(r["trajectory"])
            c = colours[[tuple(s) for s in STARTS].index(tuple(r["start"])) % 3]
            ax.plot(t[:, 0], t[:, 1], color=c, linewidth=1.2, zorder=3)
            ax.plot(*r["start"], "o", color="k", markersize=4, zorder=4)
            ax.plot(*r["final"], "*", color=c, markersize=9, zorder=5)
        ax.set_title(m, fontsize=10)
        ax.set_xlim(-10.5, 10.5)
        ax.set_ylim(-10.5, 10.5)
        ax.set_aspect("equal")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"Adam steps per run (default {DEFAULT_STEPS})")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"Adam's learning rate (default {DEFAULT_LR}: the papers' {PAPER_LR} x 10)")
    p.add_argument("--scale", type=float, default=1.0, help="factor on f1 (CAGrad: 1, Nash-MTL: 0.1)")
    p.add_argument("--methods", default="", help="entries separated by ';', e.g. 'mgda;cagrad(c=0.5)' "
                   "(default: every registered gradient-level method)")
    p.add_argument("--near", type=float, default=NEAR, help="the distance to the Pareto set that counts as reached")
    p.add_argument("--keep_every", type=int, default=50, help="keep every this many points of a trajectory")
    p.add_argument("--jobs", type=int, default=1, help="processes (one (method, start) run each at a time)")
    p.add_argument("--out", default="runs/toy", help="output folder")
    p.add_argument("--no_plot", action="store_true", help="write the table and json only")
    a = p.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(";") if m.strip()] or [*grad_methods(), *EXTRA_ENTRIES]
    try:
        for m in methods:
            build_method(m)
    except ValueError as e:
        print(f"bench_toy: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(methods, a.steps, a.lr, a.scale, a.near, a.keep_every, a.jobs)
    wall = time.perf_counter() - t0
    header = (f"Toy problem (mtl/toy.py), f1 scale {a.scale:g}: {len(methods)} methods x 3 starts, {a.steps:,} Adam "
              f"steps of lr {a.lr:g}, {a.jobs} process(es), {wall:.0f} s.\n\n")
    md = header + table(results, a.near) + "\n"
    with open(os.path.join(a.out, "toy.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "toy.json"), "w") as f:
        json.dump({"steps": a.steps, "lr": a.lr, "scale": a.scale, "near": a.near, "wall_s": wall,
                   "results": results}, f)
    if not a.no_plot:
        plot(results, os.path.join(a.out, "toy.png"), a.scale)
    print(md)
    print(f"wrote {a.out}/toy.md, toy.json" + ("" if a.no_plot else ", toy.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
