"""The papers' toy problem: every gradient-level method from the papers' starting points. ``make bench-toy``.

    python -m mtl.tools.bench.toy [--variant cagrad|nashmtl] [--quick] [--methods 'a;b(c=1)'] [--jobs N] [--out DIR]

The problem is ``mtl/bench/toy_problem.py``: two losses of a point x in the plane (CAGrad's Fig. 1), whose Pareto set is the curve
from (-7, -8.43) to (7, -8.43) through (0, -8.3551). Each method is the ``Weighting`` class a training run builds
(``weighting_types()[name](cfg, tasks)``, K = 2 tasks, its options from the entry, e.g. ``cagrad(c=0.5)``),
stepped as the trainer steps it: ``begin_step``, ``combine(J, losses)`` on the 2 x 2 Jacobian (each loss's gradient
w.r.t. the 2-D parameter x), then Adam on x with the combined gradient, then ``end_step(losses)``. Every registered
gradient-level method runs unless ``--methods`` names some, plus the variant's extra entries (``EXTRA_ENTRIES``).

Two variants (``--variant``, ``mtl.bench.toy_problem.VARIANTS``), each by default at its paper's setting (``PAPER_SETTING``):
``cagrad`` is CAGrad's toy (f1 as is, its three starts, Adam lr 1e-3 for 100,000 steps); ``nashmtl`` is Nash-MTL's
(f1 scaled by 0.1, its five starts, lr 1e-3 for 35,000 steps), with the losses shifted by their minimum so that
methods that use loss values as positive numbers can run. ``--quick`` runs lr 1e-2 for 3,000 steps instead, a
smoke run whose output says it is not the papers' setting; ``--steps``/``--lr``/``--starts`` override either, and
the output says so too.

Adam is the papers' (betas (0.9, 0.999), eps 1e-8, no weight decay), written out in floats (``Adam2``;
tests/test_bench_toy.py checks it against ``torch.optim.Adam``): at this size a torch optimizer step would cost more
than most methods' maths. The (method, start) runs are independent; ``--jobs`` runs them in that many processes.

What is reported is what is robust to the start (``judge``): whether a run reaches the Pareto set (within
``--near`` = 0.1 of it) and at which step, whether it is on the set at the end, and if so whether at its centre (within
``CENTRED`` = 0.5 in x1 of the mean loss's minimiser (0, -8.3551)) or on which side; if not, whether it has stalled
(moved at most ``--near`` over the last tenth of its steps) or is still moving, and in which half of the plane.
The exact endpoint is not a result: in the upper region some methods' endpoints move by units when the start
moves by 1e-12 (docs/benchmark.md#the-toy-problem). Writes into ``--out``: ``toy.md`` (a summary per method
and a row per run), ``toy.json`` (the same, with the final points, each run's wall and CPU seconds and the
trajectories, every ``--keep_every`` steps) and ``toy.png`` (the trajectories over the mean loss's contours).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from mtl.bench.entries import parse_method
from mtl.bench.toy_problem import VARIANTS, distance_to_curve, loss_offsets, pareto_curve, toy_losses, toy_losses_and_jacobian
from mtl.config.schema import Config, check_options
from mtl.setup.build import build_weighting
from mtl.weighting import weighting_types

# The papers' settings: (Adam's lr, steps). CAGrad's toy.py: lr 1e-3, n_iter = 100,000; Nash-MTL's
# experiments/toy/trainer.py: lr 1e-3, n_epochs = 35,000 (its default).
PAPER_SETTING = {"cagrad": (1e-3, 100_000), "nashmtl": (1e-3, 35_000)}
QUICK_SETTING = (1e-2, 3_000)  # a smoke run: about the same distance for an Adam step of ~lr, not the papers' run
# Entries beyond every registered gradient-level method at its defaults. Both: CAGrad with c = 0 (exactly the mean
# gradient, the papers' linear scalarisation "LS" / "Adam"). CAGrad's: its figure's c = 0.5 (0.4, our default, is its
# image benchmarks' c). Nash-MTL's: nashmtl with the gradient-norm clip of its authors' code (max_norm = 1).
EXTRA_ENTRIES = {"cagrad": ("cagrad(c=0)", "cagrad(c=0.5)"), "nashmtl": ("cagrad(c=0)", "nashmtl(max_norm=1)")}
PROBE_STEPS = 300  # the steps each method runs to estimate its cost, for the order of the runs (--jobs > 1)
NEAR = 0.1  # the distance to the Pareto set that counts as reached
CENTRED = 0.5  # |x1| at most this, on the set: at the mean loss's minimiser (0, -8.3551)


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
    return sorted(n for n, cls in weighting_types().items() if cls.level == "grad")


_CFG = None


def build_method(entry: str, seed: int = 0):
    """The ``Weighting`` a run with ``weighting.method`` (and ``weighting.options``) from ``entry`` builds, K = 2."""
    name, options = parse_method(entry)
    types = weighting_types()
    if name not in types or types[name].level != "grad":
        close = difflib.get_close_matches(name, grad_methods(), n=1, cutoff=0.6)
        raise ValueError(f"{entry!r}: not a gradient-level method" + (f" — did you mean {close[0]!r}?" if close else "")
                         + f" (these are: {', '.join(grad_methods())})")
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


def run_one(entry: str, start, steps: int, lr: float, scale: float, shifted: bool, near: float, keep_every: int,
            curve) -> dict:
    """One method from one start: the trajectory (every ``keep_every`` steps and the last point) and its numbers."""
    torch.set_num_threads(1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    offsets = loss_offsets(scale, shifted)
    method = build_method(entry)
    opt = Adam2(list(start), lr)
    x = list(start)
    kept, reached, failed = [list(x)], None, None
    late = steps - steps // 10  # the step after which "moved" is measured (the last tenth of the run)
    x_late = list(x)
    for step in range(steps):
        f1, f2, jac = toy_losses_and_jacobian(x[0], x[1], scale, offsets)
        method.begin_step(step)
        d = method.combine(torch.tensor(jac, dtype=torch.float64), torch.tensor([f1, f2], dtype=torch.float64))
        d = d.tolist()
        if all(math.isfinite(v) for v in d):
            x = opt.step(d)
            method.end_step({"f1": f1, "f2": f2})
            if reached is None and -8.5 - near < x[1] < -8.3 + near and abs(x[0]) < 7 + near \
                    and float(distance_to_curve(np.array([x]), curve)[0]) <= near:  # (the set lies in that box)
                reached = step + 1
        elif failed is None:  # what the trainer does with a non-finite update: skip the step
            failed = step
        if (step + 1) % keep_every == 0:
            kept.append(list(x))
        if step + 1 == late:
            x_late = list(x)
    if kept[-1] != x:
        kept.append(list(x))
    f1, f2, _ = toy_losses_and_jacobian(x[0], x[1], scale, offsets)
    distance = float(distance_to_curve(np.array([x]), curve)[0])
    moved = math.dist(x, x_late)
    return {"method": entry, "start": list(start), "final": list(x), "distance": distance, "losses": [f1, f2],
            "reached": reached, "first_nonfinite": failed, "moved_last_tenth": moved,
            "ending": judge(x, distance, near, moved), "wall_s": time.perf_counter() - wall0,
            "cpu_s": time.process_time() - cpu0, "trajectory": kept}


def judge(final, distance: float, near: float = NEAR, moved: float = 0.0) -> str:
    """Where a run ends, in the terms that are robust to its start: on the set (centred, or on which side of the
    centre: f1's minimiser is at x1 = 7, f2's at x1 = -7) or off it: stalled (it moved at most ``near`` over the
    last tenth of its steps) or still moving, and in which half of the plane."""
    x1, x2 = final
    if distance <= near:
        if abs(x1) <= CENTRED:
            return "on the set, centred"
        return "on the set, f1's side (x1 > 0)" if x1 > 0 else "on the set, f2's side (x1 < 0)"
    half = "upper half (x2 > 0)" if x2 > 0 else "lower half"
    return f"off the set, {'still moving' if moved > near else 'stalled'} in the {half}"


def _run_star(args):
    return run_one(*args)


def run_all(methods: list[str], starts, steps: int, lr: float, scale: float, shifted: bool, near: float,
            keep_every: int, jobs: int) -> list[dict]:
    curve = pareto_curve()
    work = [(m, s, steps, lr, scale, shifted, near, keep_every, curve) for m in methods for s in starts]
    if jobs <= 1:
        return [run_one(*w) for w in work]
    # Longest first, so that the processes finish together (a method's step costs from ~80 us to ~1 ms here):
    # each method's cost per step is probed on PROBE_STEPS steps from the first start (while the pool's processes
    # start), and the results are put back in the table's order.
    with mp.get_context("spawn").Pool(jobs) as pool:
        cost = {m: run_one(m, starts[0], PROBE_STEPS, lr, scale, shifted, near, PROBE_STEPS, curve)["cpu_s"]
                for m in methods}
        order = sorted(range(len(work)), key=lambda i: -cost[work[i][0]])
        done = pool.map(_run_star, [work[i] for i in order], chunksize=1)
    results: list[dict] = [{}] * len(work)
    for i, r in zip(order, done):
        results[i] = r
    return results


def _reached(r: dict) -> str:
    text = "never" if r["reached"] is None else f"{r['reached']:,}"
    if r["first_nonfinite"] is not None:
        text += f" (non-finite update from step {r['first_nonfinite']:,}, skipped)"
    return text


def summary(results: list[dict]) -> str:
    """Per method: from how many starts it reaches the set, is on it at the end, and is there centred."""
    lines = ["| method | reaches the set from | on the set at the end | centred at the end | steps to reach it |",
             "|---|---|---|---|---|"]
    for m in dict.fromkeys(r["method"] for r in results):
        rows = [r for r in results if r["method"] == m]
        n = len(rows)
        steps = sorted(r["reached"] for r in rows if r["reached"] is not None)
        span = "-" if not steps else f"{steps[0]:,}" if len(steps) == 1 else f"{steps[0]:,} - {steps[-1]:,}"
        lines.append(f"| `{m}` | {sum(r['reached'] is not None for r in rows)}/{n} "
                     f"| {sum(r['ending'].startswith('on the set') for r in rows)}/{n} "
                     f"| {sum(r['ending'] == 'on the set, centred' for r in rows)}/{n} | {span} |")
    return "\n".join(lines)


def table(results: list[dict], near: float) -> str:
    lines = [f"| method | start | reaches the set (within {near:g}) at step | at the end |", "|---|---|---|---|"]
    for r in results:
        s = r["start"]
        lines.append(f"| `{r['method']}` | ({s[0]:g}, {s[1]:g}) | {_reached(r)} | {r['ending']} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str, scale: float, starts) -> None:
    # here, not at the top: the file backend (Agg) is chosen when a figure is written, never as a side effect of
    # importing this module (an importer may have chosen another backend)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in results))
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    n = 200
    grid = np.linspace(-10.5, 10.5, n)
    gx, gy = np.meshgrid(grid, grid)
    pts = torch.tensor(np.stack([gx, gy], -1), dtype=torch.float64)
    mean = toy_losses(pts, scale).mean(-1).numpy()
    curve = pareto_curve()
    colours = ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple"]
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.axis("off")
    for ax, m in zip(axes.flat, methods):
        ax.contour(gx, gy, mean, levels=20, cmap="viridis", linewidths=0.7)
        ax.plot(curve[:, 0], curve[:, 1], color="gray", linewidth=4, zorder=1)
        for r in (r for r in results if r["method"] == m):
            t = np.array(r["trajectory"])
            c = colours[[tuple(s) for s in starts].index(tuple(r["start"])) % len(colours)]
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


def parse_starts(text: str) -> tuple[tuple[float, float], ...]:
    """``"-8.5,7.5; 9,9"`` -> ((-8.5, 7.5), (9.0, 9.0)); raises ValueError naming the bad point."""
    starts = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        try:
            x1, x2 = (float(v) for v in part.split(","))
        except ValueError:
            raise ValueError(f"--starts: {part!r} is not a point 'x1,x2' (points are separated by ';')") from None
        starts.append((x1, x2))
    if not starts:
        raise ValueError("--starts: no point given")
    return tuple(starts)


def setting_label(variant: str, lr: float, steps: int, papers_starts: bool) -> str:
    """What the header says the run is: the paper's setting, or why not."""
    paper_lr, paper_steps = PAPER_SETTING[variant]
    if (lr, steps) == (paper_lr, paper_steps) and papers_starts:
        return f"the paper's setting (Adam lr {lr:g}, {steps:,} steps)"
    what = "the quick setting" if (lr, steps) == QUICK_SETTING else "a custom setting"
    return (f"{what} (Adam lr {lr:g}, {steps:,} steps{'' if papers_starts else ', starts given by --starts'}): "
            f"NOT the paper's setting (lr {paper_lr:g}, {paper_steps:,} steps, its starts)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="cagrad", choices=sorted(VARIANTS),
                   help="cagrad: CAGrad's toy (default); nashmtl: Nash-MTL's (f1 x 0.1, five starts, shifted losses)")
    p.add_argument("--quick", action="store_true",
                   help=f"lr {QUICK_SETTING[0]:g} for {QUICK_SETTING[1]:,} steps: a smoke run, not the paper's setting")
    p.add_argument("--steps", type=int, default=None, help="Adam steps per run (default: the paper's)")
    p.add_argument("--lr", type=float, default=None, help="Adam's learning rate (default: the paper's, 1e-3)")
    p.add_argument("--starts", default="", help="starting points, --starts='x1,x2;x1,x2' (default: the paper's)")
    p.add_argument("--methods", default="", help="entries separated by ';', e.g. 'mgda;cagrad(c=0.5)' "
                   "(default: every registered gradient-level method and the variant's extra entries)")
    p.add_argument("--near", type=float, default=NEAR, help="the distance to the Pareto set that counts as reached")
    p.add_argument("--keep_every", type=int, default=None,
                   help="keep every this many points of a trajectory (default: steps / 500)")
    p.add_argument("--jobs", type=int, default=1, help="processes (one (method, start) run each at a time)")
    p.add_argument("--out", default="runs/toy", help="output folder")
    p.add_argument("--no_plot", action="store_true", help="write the table and json only")
    a = p.parse_args(argv)
    variant = VARIANTS[a.variant]
    lr, steps = QUICK_SETTING if a.quick else PAPER_SETTING[a.variant]
    lr = lr if a.lr is None else a.lr
    steps = steps if a.steps is None else a.steps
    keep_every = a.keep_every or max(1, steps // 500)
    methods = [m.strip() for m in a.methods.split(";") if m.strip()] or [*grad_methods(), *EXTRA_ENTRIES[a.variant]]
    try:
        if steps < 1 or lr <= 0 or a.jobs < 1 or keep_every < 1:
            raise ValueError("--steps, --lr, --jobs and --keep_every must be positive")
        starts = parse_starts(a.starts) if a.starts.strip() else variant.starts
        for m in methods:
            build_method(m)
    except ValueError as e:
        print(f"bench_toy: {e}", file=sys.stderr)
        return 2
    label = setting_label(a.variant, lr, steps, starts == variant.starts)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(methods, starts, steps, lr, variant.scale, variant.shifted, a.near, keep_every, a.jobs)
    wall = time.perf_counter() - t0
    cpu = sum(r["cpu_s"] for r in results)
    shift = ", losses shifted by their minimum" if variant.shifted else ""
    header = (f"Toy problem (mtl/bench/toy_problem.py), {a.variant}'s variant (f1 x {variant.scale:g}{shift}), {label}.\n"
              f"{len(methods)} methods x {len(starts)} starts in {a.jobs} process(es): {wall:.0f} s of wall time, "
              f"{cpu:.0f} s of CPU in the runs ({cpu / len(results):.1f} s a run on average).\n\n")
    md = header + summary(results) + "\n\n" + table(results, a.near) + "\n"
    with open(os.path.join(a.out, "toy.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "toy.json"), "w") as f:
        json.dump({"variant": a.variant, "setting": label, "steps": steps, "lr": lr, "scale": variant.scale,
                   "shifted": variant.shifted, "starts": [list(s) for s in starts], "near": a.near,
                   "jobs": a.jobs, "wall_s": wall, "cpu_s": cpu, "results": results}, f)
    if not a.no_plot:
        plot(results, os.path.join(a.out, "toy.png"), variant.scale, starts)
    print(md)
    print(f"wrote {a.out}/toy.md, toy.json" + ("" if a.no_plot else ", toy.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
