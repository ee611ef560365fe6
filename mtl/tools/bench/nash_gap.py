"""How far Nash-MTL's authors' iteration (``nashmtl(optim_niter=20)``) lies from the exact solve on real Gram matrices:
``python -m mtl.tools.bench.nash_gap``.

    python -m mtl.tools.bench.nash_gap [--config configs/qm9_cpu.yaml] [--steps 60] [--every 5] [--save grams.pt]
                                       [override ...]
    python -m mtl.tools.bench.nash_gap --cases     # the hard cases instead: no run, a second

Trains the config's model for ``--steps`` steps with the ``qm9`` preset's Nash-MTL entry (``task_grads``,
``max_norm=1.0``, ``optim_niter=20``, ``weighting.heads=weighted``), on the CPU, and records each step's Gram matrix
of the K task gradients (QM9: K = 11, the shared MPNN's parameters) with the alpha the iteration gave (warm-started,
as in a run, from the step before). For each it solves the same matrix exactly and prints, every ``--every`` steps
and summarised over all: the relative difference of alpha, ``||a_it - a_ex|| / ||a_ex||``, and of the update
direction d = sum_t a_t g_t before the clip, ``||d_it - d_ex|| / ||d_ex||`` (from the Gram matrix:
``sqrt((a_it - a_ex)^T M (a_it - a_ex) / a_ex^T M a_ex)``), with the cosine of the two directions, the convex steps
the iteration took and what stopped it (failed: a convex step had no solution, e.g. unbounded; residual or step:
the authors' two tests; cap: 20 steps), and the solve's time. ``--save`` keeps
the Gram matrices and both alphas (a torch file). Overrides are ``key=value`` on the config, as for train.py.

``--cases``: the same comparison, 20 steps from ones (a first update), on made-up hard cases (``hard_cases``): nearly
opposed gradients, very unequal norms, identical and zero gradients.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch

from mtl.run.trainer import Trainer
from mtl.weighting.nash_cccp import cccp_nash
from mtl.weighting.nashmtl import default_exists_tol, nashmtl_weights

ITERATIONS = 20  # the preset's optim_niter
ENTRY = ["weighting.method=nashmtl", "ddp.strategy=task_grads", "weighting.source=parameters",
         "weighting.options.max_norm=1.0", f"weighting.options.optim_niter={ITERATIONS}", "weighting.heads=weighted"]


def record(config: str, steps: int, overrides: list[str], seconds: list[float]) -> list[tuple[torch.Tensor, list[float]]]:
    """(Gram matrix, the iteration's alpha before the clip) of each of the first ``steps`` steps of a run; the time of
    each step's solve is appended to ``seconds``."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer.from_config(config, [f"output_dir={tmp}", "trainer.progress=false",
                                               "checkpoint.every_steps=0", *ENTRY, *overrides])
        w = trainer.weighting
        solve = w.weights_for_gram

        def recorded(gram, losses=None, dtype=torch.float32):
            tic = time.perf_counter()
            weights = solve(gram, losses, dtype)
            seconds.append(time.perf_counter() - tic)
            out.append((gram.detach().cpu().double().clone(), list(w.cached)))
            return weights

        w.weights_for_gram = recorded  # the step reads it through grad_hooks() each step
        batches = trainer.batches()
        trainer.bare.train()
        for _ in range(steps):
            trainer.step_once(next(batches)[1])
        trainer.close()
    return out


def hard_cases() -> list[tuple[str, torch.Tensor]]:
    """(what, K x P rows): gradients whose Nash solution is hard to reach (tests/test_nash_cccp.py runs them too)."""
    def rows(*r):
        return torch.tensor(r, dtype=torch.float64)

    cases = []
    for eps in (1e-2, 1e-4):
        cases += [(f"K=2, nearly opposed (eps {eps:g})", rows([1.0, 0.0], [-1.0, eps])),
                  (f"K=2, nearly opposed, norms 100:1 (eps {eps:g})", rows([100.0, 0.0], [-1.0, eps])),
                  (f"K=3, one pair nearly opposed (eps {eps:g})", rows([1.0, 0, 0], [-1.0, eps, 0], [0.5, -0.5, 1.0])),
                  (f"K=5, two pairs nearly opposed (eps {eps:g})",
                   rows([1.0, 0, 0, 0, 0], [-1.0, eps, 0, 0, 0], [0, 0, 1.0, 0, 0], [0, 0, -3.0, eps, 0],
                        [0.1, 0, 0.1, 0, 1.0]))]
    cases.append(("K=3, two identical rows", rows([3.0, 4.0, 0.0], [3.0, 4.0, 0.0], [0.0, 1.0, 1.0])))
    for k in (2, 5):
        g = torch.randn(k, 6, generator=torch.Generator().manual_seed(300 + k), dtype=torch.float64)
        g[1:] = g[1:] + 1.5 * g[0]
        cases.append((f"K={k}, norms 1e-2 .. 1e2", g * torch.logspace(-2, 2, k, dtype=torch.float64)[:, None]))
    cases.append(("K=2, one zero row", rows([0.0, 0.0], [3.0, 4.0])))
    return cases


def print_cases() -> None:
    print("| case | rel. diff. of alpha | rel. diff. of d | steps | stopped by |")
    print("|---|---|---|---|---|")
    for what, g in hard_cases():
        gram, report = g @ g.T, {}
        it = cccp_nash(gram.numpy(), [1.0] * g.shape[0], ITERATIONS, report).tolist()
        _, da, dd, _ = gaps(gram, it, torch.float64)
        print(f"| {what} | {da:.1e} | {dd:.1e} | {report['steps']} | {report['stop']} |")


def gaps(gram: torch.Tensor, iterated: list[float], dtype=torch.float32) -> tuple[list[float], float, float, float]:
    """(exact alpha, relative alpha difference, relative direction difference, cosine of the directions); ``dtype``:
    of the rows the Gram matrix came from (the exact solve's tolerance)."""
    exact = nashmtl_weights(gram, exists_tol=default_exists_tol(dtype)).double()
    it = torch.tensor(iterated, dtype=torch.float64)
    diff = it - exact
    d_ex, d_it = float(exact @ gram @ exact), float(it @ gram @ it)
    cos = float(it @ gram @ exact) / math.sqrt(max(d_ex * d_it, 1e-300))
    return exact.tolist(), float(diff.norm() / exact.norm()), math.sqrt(max(float(diff @ gram @ diff), 0.0) / d_ex), cos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtl.tools.bench.nash_gap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join("configs", "qm9_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--save", default=None, help="a torch file for the Gram matrices and both alphas")
    parser.add_argument("--cases", action="store_true", help="the made-up hard cases instead of a run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.cases:
        print_cases()
        return 0
    torch.set_num_threads(1)
    seconds: list[float] = []
    rows = record(args.config, args.steps, args.overrides, seconds)
    table, saved, start = [], [], [1.0] * rows[0][0].shape[0]
    for step, (gram, iterated) in enumerate(rows):
        exact, da, dd, cos = gaps(gram, iterated)
        report: dict = {}
        again = cccp_nash(gram.numpy(), start, ITERATIONS, report).tolist()  # the same solve, to say what ended it
        assert again == iterated, f"step {step}: the iteration did not repeat"
        table.append((step, da, dd, cos, report))
        start = iterated
        saved.append({"gram": gram, "iterated": iterated, "exact": exact})
    print(f"Nash-MTL, {args.config}, K = {rows[0][0].shape[0]}: the authors' iteration (optim_niter=20, warm-started) "
          "against the exact solve, on each step's Gram matrix")
    print("| step | rel. diff. of alpha | rel. diff. of d | cos(d_it, d_ex) | steps | stopped by |")
    print("|---|---|---|---|---|---|")
    for step, da, dd, cos, report in table:
        if step % args.every == 0 or step == len(table) - 1:
            print(f"| {step} | {da:.2e} | {dd:.2e} | {cos:.6f} | {report['steps']} | {report['stop']} |")
    for name, col in (("alpha", 1), ("d", 2)):
        values = [r[col] for r in table]
        print(f"{name}: median {statistics.median(values):.2e}, max {max(values):.2e} over {len(values)} steps")
    for stop in ("failed", "residual", "step", "cap"):
        these = [r for r in table if r[4]["stop"] == stop]
        if these:
            print(f"stopped by {stop}: {len(these)} steps (of them {sum(r[4]['steps'] == 0 for r in these)} kept the "
                  f"warm start), rel. diff. of d median {statistics.median(r[2] for r in these):.2e}, max "
                  f"{max(r[2] for r in these):.2e}, steps {[r[0] for r in these] if stop in ('failed', 'cap') else '...'}")
    exact_s = []
    for gram, _ in rows:
        tic = time.perf_counter()
        nashmtl_weights(gram, exists_tol=default_exists_tol(torch.float32))
        exact_s.append(time.perf_counter() - tic)
    rest = seconds[1:] or seconds
    print(f"solve time a step: the iteration median {1e3 * statistics.median(rest):.1f} ms, max {1e3 * max(rest):.1f} ms "
          f"after the first (which imports cvxpy and builds the problem: {1e3 * seconds[0]:.0f} ms); the exact solve "
          f"median {1e3 * statistics.median(exact_s):.2f} ms")
    if args.save:
        torch.save(saved, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
