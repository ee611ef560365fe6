"""Cost of each multi-task architecture against ``hps``, measured side by side in one process.

    python -m mtl.tools.bench.architectures [--config configs/default.yaml] [--steps 10] [--warmup 2]
                                            [--architectures hps mmoe cgc ple dselect_k] [key=value ...]

One trainer per (architecture, variant) on the same config, model and batch (taken once), one thread; the variants
are ``equal`` (``feature_leaf``), MGDA on the parameters source (``task_grads``) and on the features source
(``feature_leaf``). The trainers are stepped in turn, ``warmup + steps`` rounds, so machine noise hits all of them
alike; the table gives each one's median step and its ratio to ``hps`` with the same variant. Peak memory: one more
step of each under ``torch.profiler`` (the bytes of the parameters, gradients and optimizer state at its start plus
the highest running sum of its allocations; ``mtl.tools.bench.ved_step``'s measure). Each architecture runs with its
default options (``model.architecture.options``), which set how many experts it adds.

K = 2 is the main job's model (``configs/default.yaml``); K = 11 is QM9's MPNN (``--config configs/qm9_cpu.yaml``
with ``data.qm9.molecules=...`` for a quick build of the data).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

from mtl.architectures import architecture_types
from mtl.bench.step_memory import held_bytes, step_peak_bytes
from mtl.errors import ConfigError
from mtl.run.trainer import Trainer
from mtl.tools import tool_parser

VARIANTS = {
    "equal": ["ddp.strategy=feature_leaf", "weighting.method=equal"],
    "mgda (parameters)": ["ddp.strategy=task_grads", "weighting.method=mgda", "weighting.source=parameters"],
    "mgda (features)": ["ddp.strategy=feature_leaf", "weighting.method=mgda", "weighting.source=features"],
}


def build(config: str, overrides: list[str], out: str):
    """(a step of ``batch``, the batch, the bytes the model holds, the parameter count) for one trainer."""
    torch.manual_seed(0)
    trainer = Trainer.from_config(config, [*overrides, f"output_dir={out}", "trainer.progress=false"])
    trainer.bare.train()
    batch = trainer.feed.on_device(trainer.feed.take(0)[1])
    params = sum(p.numel() for p in trainer.bare.parameters())
    return ((lambda b: trainer.step_once(dict(b))), batch, lambda: held_bytes([trainer.bare], trainer.optimizer),
            params)


def measure(config: str, overrides: list[str], archs: list[str], steps: int, warmup: int):
    """(median step, peak bytes) per (architecture, variant), the parameter count per architecture, and the
    (architecture, variant) pairs the config refuses, with the reason (MTAN on a backbone that declares no blocks,
    Cross-stitch with the features source)."""
    refused = {}
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for a in archs:
            for v, extra in VARIANTS.items():
                try:
                    built[(a, v)] = build(config, [*overrides, f"model.architecture.name={a}", *extra],
                                          os.path.join(tmp, f"{a}_{len(v)}"))
                except ConfigError as e:  # this model cannot take it (mtan without blocks), or this source
                    refused[(a, v)] = e.errors[0]
        times = {key: [] for key in built}
        for r in range(warmup + steps):
            for key, (step, batch, _, _) in built.items():
                tic = time.perf_counter()
                step(batch)
                if r >= warmup:
                    times[key].append(time.perf_counter() - tic)
        mem = {key: step_peak_bytes(step, batch, held) for key, (step, batch, held, _) in built.items()}
    med = {key: statistics.median(t) for key, t in times.items()}
    return med, mem, {a: b[3] for (a, _), b in built.items()}, refused


def table(config, steps, warmup, med, mem, params, refused) -> str:
    mib = 2 ** 20
    rows = [f"{config}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of {steps} alternated "
            f"steps after {warmup}",
            "| architecture | parameters | variant | median step (ms) | vs hps | peak memory (MiB) | vs hps |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for (a, v), t in med.items():
        rows.append(f"| {a} | {params[a]:,} | {v} | {1000 * t:.1f} | {t / med[('hps', v)]:.2f}x | "
                    f"{mem[(a, v)] / mib:.1f} | {mem[(a, v)] / mem[('hps', v)]:.2f}x |")
    rows += [f"{a}, {v}: not measured: {why}" for (a, v), why in refused.items()]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = tool_parser("mtl.tools.bench.architectures", __doc__, config="configs/default.yaml",
                    overrides="key=value config overrides, for every trainer")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--architectures", nargs="+", default=list(architecture_types()))
    args = p.parse_args(argv)
    archs = ["hps", *[a for a in args.architectures if a != "hps"]]
    torch.set_num_threads(1)
    med, mem, params, refused = measure(args.config, list(args.overrides), archs, args.steps, args.warmup)
    print(table(args.config, args.steps, args.warmup, med, mem, params, refused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
