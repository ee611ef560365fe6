"""The cost of each multi-input sampling policy, as ratios in one run (docs/multi-input.md).

    python -m mtl.tools.bench.sampling --config configs/multi_input.yaml [--steps 6] [--rounds 3]
                                       [--strategy find_unused] [--only POLICY ...] [-- key=value ...]

One process builds one trainer per policy (``data.sampling.policy``; every other key as the config says, and
``ddp.strategy`` the same for all, default ``find_unused``, which every policy allows), warms each up with one
step, then alternates them ``rounds`` times, ``steps`` steps each time (so a load change on a shared machine
hits every policy alike). It prints, per policy, the median seconds per step, the rows (images) per step and
per second, and both as ratios to the first policy listed. A step of ``round_robin``, ``weighted`` or
``temperature`` holds one task's rows, a step of ``all`` every task's, so compare rows per second, not steps.

``--forwards`` instead times the backbone pass of an ``all`` step both ways: one forward and backward over the
concatenated per-task rows (what the model does), and one per task over its own rows (the alternative the
issue asked to weigh), alternated ``rounds`` x ``steps`` times; it prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from mtl.data.loader import to_device
from mtl.data.multi_input import POLICIES
from mtl.run.error_report import run_guarded
from mtl.run.trainer import Trainer


def measure(config: str, overrides: list[str], policies: list[str], strategy: str, steps: int,
            rounds: int) -> dict:

    torch.manual_seed(0)
    trainers, streams = {}, {}
    times: dict = {p: [] for p in policies}
    rows: dict = {p: 0 for p in policies}
    with tempfile.TemporaryDirectory(prefix="bench_sampling_") as out:
        try:
            for p in policies:
                t = Trainer.from_config(config, [*overrides, f"output_dir={out}/{p}", f"data.sampling.policy={p}",
                                                 f"ddp.strategy={strategy}", "trainer.progress=false"])
                trainers[p] = t
                t.bare.train()
                streams[p] = t.batches()
                t.step_once(to_device(next(streams[p])[1], t.device))  # warm-up
            for _ in range(rounds):
                for p in policies:
                    t = trainers[p]
                    tic = time.perf_counter()
                    for _ in range(steps):
                        batch = next(streams[p])[1]  # reading the rows counts: it differs between policies
                        rows[p] += int(batch["image"].shape[0])
                        t.step_once(to_device(batch, t.device))
                    times[p].append((time.perf_counter() - tic) / steps)
        finally:
            for t in trainers.values():
                t.close()
    table = {}
    for p in policies:
        s = statistics.median(times[p])
        per_step = rows[p] / (steps * rounds)
        table[p] = {"s_per_step": s, "rows_per_step": per_step, "rows_per_s": per_step / s}
    first = table[policies[0]]
    for r in table.values():
        r["step_time_ratio"] = r["s_per_step"] / first["s_per_step"]
        r["throughput_ratio"] = r["rows_per_s"] / first["rows_per_s"]
    return table


def _time_forwards(t, steps: int, rounds: int):
    t.bare.train()
    backbone, batch = t.bare.backbone, next(t.batches())[1]
    slices = [slice(*sub["rows"]) for sub in batch["multi_input"].values()]
    image = batch["image"].to(t.device)

    def concatenated():
        backbone(image).sum().backward()

    def per_task():
        for sl in slices:
            backbone(image[sl]).sum().backward()

    ways = {"concatenated": concatenated, "per_task": per_task}
    times: dict = {k: [] for k in ways}
    for fn in ways.values():
        fn()  # warm-up
    for _ in range(rounds * steps):
        for k, fn in ways.items():
            tic = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - tic)
            backbone.zero_grad(set_to_none=False)
    return times, image, slices


def forwards(config: str, overrides: list[str], steps: int, rounds: int) -> dict:
    """Median seconds of the backbone forward + backward over the concatenated rows vs one per task."""
    with tempfile.TemporaryDirectory(prefix="bench_forwards_") as out:
        t = Trainer.from_config(config, [*overrides, f"output_dir={out}", "data.sampling.policy=all",
                                         "trainer.progress=false"])
        try:
            times, image, slices = _time_forwards(t, steps, rounds)
        finally:
            t.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": int(image.shape[0]), "tasks": len(slices), **{f"{k}_s": v for k, v in med.items()},
            "per_task_over_concatenated": med["per_task"] / med["concatenated"]}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategy", default="find_unused")
    ap.add_argument("--only", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--forwards", action="store_true", help="time the concatenated backbone pass against one per task")
    a = ap.parse_args(argv)

    def go():
        if a.forwards:
            r = forwards(a.config, overrides, a.steps, a.rounds)
            print(f"backbone forward+backward, {r['rows']} rows of {r['tasks']} tasks: concatenated "
                  f"{r['concatenated_s'] * 1e3:.1f} ms, one per task {r['per_task_s'] * 1e3:.1f} ms, "
                  f"per task / concatenated = {r['per_task_over_concatenated']:.2f}x")
            return
        table = measure(a.config, overrides, a.only, a.strategy, a.steps, a.rounds)
        print(f"{'policy':<12} {'s/step':>8} {'rows/step':>9} {'rows/s':>8} {'step time':>10} {'throughput':>10}")
        for p, r in table.items():
            print(f"{p:<12} {r['s_per_step']:>8.3f} {r['rows_per_step']:>9.1f} {r['rows_per_s']:>8.1f} "
                  f"{r['step_time_ratio']:>9.2f}x {r['throughput_ratio']:>9.2f}x")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(table, f, indent=2)

    return run_guarded(go)  # a bad config or data: one line naming it, its exit code


if __name__ == "__main__":
    raise SystemExit(main())
