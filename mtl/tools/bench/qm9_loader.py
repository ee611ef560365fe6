"""QM9's loader against the model's step: batches per second of the training loader alone, and one training step:

    python -m mtl.tools.bench.qm9_loader [--config configs/qm9.yaml] [--graphs bond,complete]
                                         [--paths per_item,batched] [--workers 0,2] [--steps 2] [--json out.json]
                                         [key=value ...]

For each graph (``data.qm9.graph``) and each path of the records (``per_item``: the former path, the complete graph
made per molecule in ``__getitem__`` with PyG's transforms, every epoch; ``batched``: the graph of each item kept
after its first read and the complete graph made per batch by the collate, ``mtl.data.qm9_source.complete_batch``),
the run's own training loader (``build_train_loader``: its sampler, its collate with the 11 tasks' targets, batch
``data.batch_size``) is read with each number of workers, twice over the training split: the first pass (each item
read for the first time, the workers started) and the second (what the other epochs of a run cost), with the CPU
time of the training process per batch (with workers: what receiving a batch costs it, which bounds the rate any
number of workers can reach). With workers, each is read twice: the batch sent tensor by tensor (each tensor a
shared-memory storage of its own, as before issue 35) and packed as one buffer (``mtl.data.packing``, what the run
does). Then the run's
step (``Trainer.step_once``: forward, backward, the weighting, the optimizer) is timed on ``--steps`` batches after
one untimed. The ratio is loader batches per second times the step's seconds: how many steps' worth of batches the
loader makes in the time of one step (above 1: it keeps up).

The training split should be large enough to give batches of QM9's real sizes (the first molecules of QM9, which
``data.qm9.molecules`` reads, are the smallest): e.g. ``data.qm9.train_size=6000`` of the whole cache.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from mtl.data.loader import build_train_loader
from mtl.data.qm9_source import QM9Split, qm9_splits
from mtl.run.error_report import run_guarded
from mtl.run.trainer import Trainer
from mtl.setup.build import build_collate
from mtl.setup.checks import load_run_config
from mtl.tools import tool_parser

PATHS = ("per_item", "batched")


def loader_rates(cfg, path: str, workers: int, pack: bool = True) -> tuple[float, float, float]:
    """(batches per second of the first pass, of the second, and the second's CPU milliseconds per batch in this
    process alone: with workers, what receiving a batch costs the training process, which bounds the rate any
    number of workers can reach) of the run's training loader; ``pack=False``: each tensor sent on its own."""
    train = qm9_splits(cfg)["train"]
    ds = QM9Split(train.graphs, train.indices, train.graph, "training", batched=path == "batched")
    loader = build_train_loader(ds, build_collate(cfg, 0, [], None), cfg.data.batch_size, 0, 1, cfg.seed,
                                num_workers=workers, pack=pack)
    rates = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        start, cpu, n = time.perf_counter(), time.process_time(), 0
        for _ in loader:
            n += 1
        rates.append(n / (time.perf_counter() - start))
    return rates[0], rates[1], (time.process_time() - cpu) / n * 1e3


def step_seconds(config: str, overrides: list[str], steps: int) -> float:
    """The run's training step: the mean over ``steps`` batches after one untimed (the batches taken first)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer.from_config(config, [*overrides, f"output_dir={tmp}/run", "trainer.progress=false", "resume=null",
                                         "checkpoint.every_steps=0"])
        try:
            stream = t.batches()
            batches = [next(stream)[1] for _ in range(steps + 1)]
            t.step_once(batches[0])
            start = time.perf_counter()
            for b in batches[1:]:
                t.step_once(b)
            return (time.perf_counter() - start) / steps
        finally:
            t.close()


def measure(config: str, overrides: list[str], graphs: list[str], paths: list[str], workers: list[int],
            steps: int) -> list[dict]:
    rows = []
    for graph in graphs:
        over = [*overrides, f"data.qm9.graph={graph}"]
        cfg = load_run_config(config, over)
        step = step_seconds(config, over, steps) if steps else float("nan")
        for path in paths:
            for w, pack in [(n, p) for n in workers for p in ((False, True) if n else (False,))]:
                first, warm, cpu_ms = loader_rates(cfg, path, w, pack)
                rows.append({"graph": graph, "path": path, "workers": w, "packed": pack,
                             "first_pass_batches_per_s": first,
                             "batches_per_s": warm, "main_cpu_ms_per_batch": cpu_ms, "step_s": step,
                             "ratio": warm * step,
                             "batch_size": int(cfg.data.batch_size)})
                print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    sent = "packed" if r["packed"] else "tensor by tensor" if r["workers"] else "in process"
    return (f"{r['graph']:<8} {r['path']:<8} workers {r['workers']} ({sent}): loader {r['batches_per_s']:7.1f} batches/s "
            f"({1e3 / r['batches_per_s']:5.1f} ms a batch, {r['main_cpu_ms_per_batch']:5.1f} ms of this process's CPU; "
            f"first pass {r['first_pass_batches_per_s']:6.1f}/s), step "
            f"{r['step_s']:.3f} s: the loader makes {r['ratio']:.0f} steps' batches per step")


def main(argv: list[str] | None = None) -> int:
    p = tool_parser("mtl.tools.bench.qm9_loader", __doc__, "configs/qm9.yaml", "key=value config overrides")
    p.add_argument("--graphs", default="bond,complete")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--workers", default="0", help="numbers of loader workers, comma-separated (e.g. 0,2)")
    p.add_argument("--steps", type=int, default=2, help="timed model steps per graph (0: no step)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    graphs, paths = a.graphs.split(","), a.paths.split(",")
    try:
        workers = [int(w) for w in a.workers.split(",")]
    except ValueError:
        p.error(f"--workers: comma-separated integers (got {a.workers!r})")
    if set(graphs) - {"bond", "complete"} or set(paths) - set(PATHS) or a.steps < 0 or min(workers) < 0:
        p.error("--graphs: bond,complete; --paths: per_item,batched; --steps >= 0; --workers >= 0")

    def go():
        print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs", flush=True)
        rows = measure(a.config, a.overrides, graphs, paths, workers, a.steps)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
