"""Where a strategy's step time goes, beside ``combined``'s: torch.profiler, per operator, in one run.

    python -m mtl.tools.profile_strategies --config configs/default.yaml [--nproc 2] [--rounds 3] [--top 12]
                                           LABEL [LABEL ...] [-- key=value ...]

LABEL: a strategy or a ``mtl.tools.bench.strategies`` variant (``task_grads+mgda``, ``feature_leaf+mgda``).
One run of ``nproc`` processes builds a trainer per label (and ``combined``), warms each up with one step,
then alternates them ``rounds`` times, one profiled step each time (every rank profiles, so all ranks run
the same code). Rank 0 prints, per label, the median step time (profiled: the profiler adds its own
overhead, so read the bench for ratios) and the operators whose self CPU time per step differs most from
``combined``'s: where the extra time goes. The profiler sees the operators of the threads it is enabled on
(the main thread's); time spent waiting for a collective shows as the wait (``aten::`` ops do not include it).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time

import torch.multiprocessing as mp

from mtl.data.loader import to_device
from mtl.errors import ConfigError
from mtl.parallel import dist
from mtl.parallel.dist import free_port
from mtl.run.error_report import run_guarded
from mtl.setup.checks import load_run_config
from mtl.strategies import strategy_types
from mtl.tools import tool_parser
from mtl.tools.bench.strategies import VARIANTS, _setup, _trainer


def _worker(rank, world, port, config, overrides, labels, rounds, out_dir, result_file):
    _setup(rank, world, port)
    from torch.profiler import ProfilerActivity, profile

    names = ["combined", *[n for n in labels if n != "combined"]]
    trainers = {n: _trainer(config, overrides, n, out_dir) for n in names}
    batches = {n: t.batches() for n, t in trainers.items()}
    ops = {n: collections.Counter() for n in names}
    wall = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        for n in names:
            t = trainers[n]
            batch = to_device(next(batches[n])[1], t.device)
            dist.barrier()
            if not r:
                t.step_once(batch)
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                tic = time.perf_counter()
                t.step_once(batch)
                wall[n].append(time.perf_counter() - tic)
            for e in prof.key_averages():
                ops[n][e.key] += e.self_cpu_time_total / rounds / 1e3  # ms per step
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"wall": {n: statistics.median(v) * 1e3 for n, v in wall.items()},
                       "ops": {n: dict(c) for n, c in ops.items()}}, f)
    for t in trainers.values():
        t.close()
    dist.destroy()


def report(result: dict, top: int) -> str:
    wall, ops = result["wall"], result["ops"]
    base = ops["combined"]
    lines = [f"combined: {wall['combined']:.0f} ms per profiled step"]
    for n in ops:
        if n == "combined":
            continue
        diff = {k: ops[n].get(k, 0.0) - base.get(k, 0.0) for k in set(ops[n]) | set(base)}
        lines += ["", f"{n}: {wall[n]:.0f} ms per profiled step ({wall[n] / wall['combined']:.2f}x), "
                  f"{wall[n] - wall['combined']:+.0f} ms; the operators that differ most (self CPU ms per step):",
                  "| operator | combined | " + n + " | difference |", "|---|---|---|---|"]
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:top]:
            lines.append(f"| `{k}` | {base.get(k, 0.0):.1f} | {ops[n].get(k, 0.0):.1f} | {diff[k]:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = tool_parser("mtl.tools.profile_strategies", __doc__, "configs/default.yaml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("labels", nargs="+", help="strategies or bench variants, then key=value overrides")
    a = p.parse_args(argv)
    labels = [x for x in a.labels if "=" not in x]
    overrides = [x for x in a.labels if "=" in x]

    def go():
        # a bad label, option or config is one message before any process starts (not a traceback per worker)
        known = [*strategy_types(), *VARIANTS]
        unknown = [x for x in labels if x not in known]
        if unknown:
            raise ConfigError(f"unknown label(s) {', '.join(unknown)}: give strategies or variants "
                              f"({', '.join(known)})")
        if a.nproc < 1 or a.rounds < 1 or a.top < 1:
            raise ConfigError("--nproc, --rounds and --top must be >= 1")
        load_run_config(a.config, overrides, announce=False)
        with tempfile.TemporaryDirectory() as tmp:
            res = os.path.join(tmp, "profile.json")
            mp.start_processes(_worker, args=(a.nproc, free_port(), a.config, overrides, labels, a.rounds, tmp, res),
                               nprocs=a.nproc, start_method="spawn")
            with open(res) as f:
                result = json.load(f)
        print(report(result, a.top))

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
