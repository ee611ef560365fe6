"""Cost of each step strategy, measured side by side: ``make bench-strategies``.

    python -m mtl.tools.bench.strategies --config configs/default.yaml [--nproc 2] [--rounds 7] [--steps 3]
                                   [--write docs/strategies.md] [key=value ...]

Time: one run of ``nproc`` gloo/nccl processes builds one trainer per strategy on the same model
and the same batches, then alternates the strategies ``rounds`` times (the order rotates each
round), timing ``steps`` optimizer steps each time. The table gives each strategy's median step
time as a ratio to ``combined`` from the same run, so machine noise hits all of them alike.
F and B (forward, and backward including its all-reduce) are measured in the same run, on the
``combined`` pattern, to compute the (F + 2B) / (F + B) bound.

Memory: a fresh run per strategy, so that one strategy's peak cannot hide another's. On CUDA the
peak of ``torch.cuda.max_memory_allocated`` during the steps; on the CPU the growth of the process's
peak RSS from just before the first step, on rank 0.

All-reduces and bytes per step: a counting DDP comm hook (plus the hand-made all-reduce of
``task_grads``), read on the last step. FSDP2 rows (``parallel.engine=fsdp2``) have no DDP reducer: their gradient
reductions are reduce-scatters, counted (with their bytes, the unsharded gradient each rank sends) on one more,
untimed step with a dispatch mode that sees every c10d op; the table shows them as "N RS" beside the
hand-made all-reduces.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils._python_dispatch import TorchDispatchMode

from mtl.data.loader import to_device
from mtl.errors import ConfigError
from mtl.parallel import dist
from mtl.parallel.dist import CountingComm, free_port
from mtl.run.error_report import run_guarded
from mtl.run.runtime_checks import verify_replicas
from mtl.run.trainer import Trainer
from mtl.setup.checks import load_run_config
from mtl.strategies import strategy_types
from mtl.tools import tool_parser

# label -> (strategy, overrides, how the table names it).
# "combined+find_unused": the same single backward with find_unused_parameters=True, to isolate what
# the flag itself costs (the seed articles claim 15-20% more memory and slower synchronisation).
# The two gradient sources, each with one gradient-level method (MGDA): what such a method costs.
VARIANTS = {
    "combined+find_unused": ("combined", ["ddp.find_unused_parameters=true"],
                             "`combined` + find_unused_parameters=True"),
    "task_grads+mgda": ("task_grads", ["weighting.method=mgda", "weighting.source=parameters"],
                        "`task_grads` + MGDA (source: parameters)"),
    "feature_leaf+mgda": ("feature_leaf", ["weighting.method=mgda", "weighting.source=features"],
                          "`feature_leaf` + MGDA (source: features)"),
    # the same strategies under FSDP2 (docs/fsdp.md): sharded parameters, gradients and optimizer state
    "fsdp2:combined": ("combined", ["parallel.engine=fsdp2"], "FSDP2 `combined`"),
    "fsdp2:feature_leaf": ("feature_leaf", ["parallel.engine=fsdp2"], "FSDP2 `feature_leaf`"),
    "fsdp2:task_grads+mgda": ("task_grads", ["parallel.engine=fsdp2", "weighting.method=mgda",
                                             "weighting.source=parameters"], "FSDP2 `task_grads` + MGDA"),
}


def strategies_to_time(only: list[str] | None = None) -> list[str]:
    """Every registered strategy but the unsafe ones, ``combined`` (the baseline) first, then the variants
    (or only those in ``only``, ``combined`` always)."""
    names = [n for n, cls in strategy_types().items() if not cls.unsafe and n != "combined"]
    return [n for n in ["combined", *names, *VARIANTS] if only is None or n == "combined" or n in only]
BEGIN, END = "<!-- bench-strategies:begin -->", "<!-- bench-strategies:end -->"


def _setup(rank: int, world: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))


def _trainer(config: str, overrides: list[str], label: str, out_dir: str):
    strategy, extra, _ = VARIANTS.get(label, (label, [], ""))
    return Trainer.from_config(config, [*overrides, *extra, f"ddp.strategy={strategy}", f"output_dir={out_dir}/{label}",
                                        "trainer.progress=false", "resume=null", "ddp.replica_check_every=0"])


def count_communication(trainer, counts: dict) -> None:
    """Count reduction rounds and bytes: a DDP comm hook, and the strategy's hand-made collectives
    (``counts['manual']``, through the ``CountingComm`` the step hands the strategy)."""
    if hasattr(trainer.model, "register_comm_hook"):
        def hook(state, bucket):
            counts["rounds"] += bucket.index() == 0
            counts["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(None, bucket)

        trainer.model.register_comm_hook(None, hook)
    trainer.parts.comm = CountingComm(counts)


def count_fsdp2_step(trainer, batch) -> dict:
    """One more (untimed) step of an FSDP2 trainer under a dispatch mode: its reduce-scatters and their bytes."""
    seen = {"reduce_scatters": 0, "rs_bytes": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "reduce_scatter" in str(func.overloadpacket):
                seen["reduce_scatters"] += 1
                seen["rs_bytes"] += args[1].numel() * args[1].element_size()  # the full (unsharded) input
            return func(*args, **(kwargs or {}))

    with Count():
        trainer.step_once(batch)
    return seen


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_worker(rank, world, port, config, overrides, rounds, steps, out_dir, result_file, only=None):
    _setup(rank, world, port)
    names = strategies_to_time(only)
    trainers = {s: _trainer(config, overrides, s, out_dir) for s in names}
    batches = {s: t.batches() for s, t in trainers.items()}
    counts = {s: {"rounds": 0, "manual": 0, "bytes": 0} for s in names}
    for s, t in trainers.items():
        count_communication(t, counts[s])
    times = {s: [] for s in names}
    per_step = {}
    for r in range(rounds + 1):  # round 0 warms every strategy up and is not timed
        order = names[r % len(names):] + names[: r % len(names)]
        for s in order:
            t = trainers[s]
            batch = to_device(next(batches[s])[1], t.device)
            for _ in range(steps):
                before = dict(counts[s])
                dist.barrier()
                _sync(t.device)
                tic = time.perf_counter()
                t.step_once(batch)
                _sync(t.device)
                if r:
                    times[s].append(time.perf_counter() - tic)
                per_step[s] = {k: counts[s][k] - before[k] for k in before}
    for s, t in trainers.items():  # FSDP2: its reduce-scatters, on one more untimed step
        if t.sharded:
            per_step[s].update(count_fsdp2_step(t, to_device(next(batches[s])[1], t.device)))
    # F and B on the combined pattern (DDP forward; backward with its all-reduce)
    t = trainers["combined"]
    batch = to_device(next(batches["combined"])[1], t.device)
    f_times, fb_times = [], []
    for _ in range(max(3, rounds)):
        for head in t.heads.values():
            head.prepare(batch, dist.all_reduce_sum)
        dist.barrier()
        _sync(t.device)
        tic = time.perf_counter()
        loss = sum(t.model(batch)["losses"].values())
        _sync(t.device)
        mid = time.perf_counter()
        loss.backward()
        _sync(t.device)
        f_times.append(mid - tic)
        fb_times.append(time.perf_counter() - tic)
        t.optimizer.zero_grad(set_to_none=False)
    check_times = []
    for _ in range(max(5, rounds)):
        dist.barrier()
        tic = time.perf_counter()
        verify_replicas(t.bare, t.step)
        check_times.append(time.perf_counter() - tic)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"times": times, "per_step": per_step, "F": statistics.median(f_times),
                       "FB": statistics.median(fb_times), "replica_check": statistics.median(check_times)}, f)
    for tr in trainers.values():
        tr.close()
    dist.destroy()


def _memory_worker(rank, world, port, config, overrides, strategy, steps, out_dir, result_file):
    _setup(rank, world, port)
    t = _trainer(config, overrides, strategy, out_dir)
    batches = t.batches()
    batch = to_device(next(batches)[1], t.device)
    if t.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(t.device)
        base = torch.cuda.memory_allocated(t.device)
    else:  # the resident size now (not the peak so far, which building the run may have set)
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    for _ in range(steps):
        t.step_once(batch)
    _sync(t.device)
    if t.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(t.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"growth_bytes": peak - base}, f)
    t.close()
    dist.destroy()


def run(config: str, overrides: list[str], nproc: int, rounds: int, steps: int, only: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "time.json")
        mp.start_processes(_time_worker, args=(nproc, free_port(), config, overrides, rounds, steps, tmp, res, only),
                           nprocs=nproc, start_method="spawn")
        with open(res) as f:
            timing = json.load(f)
        memory = {}
        for s in strategies_to_time(only):
            res = os.path.join(tmp, f"mem_{s}.json")
            mp.start_processes(_memory_worker, args=(nproc, free_port(), config, overrides, s, steps, tmp, res),
                               nprocs=nproc, start_method="spawn")
            with open(res) as f:
                memory[s] = json.load(f)["growth_bytes"]
    return {"timing": timing, "memory": memory}


def table(result: dict, meta: dict) -> str:
    types = strategy_types()
    t = result["timing"]
    med = {s: statistics.median(v) for s, v in t["times"].items()}
    f, fb = t["F"], t["FB"]
    b = max(fb - f, 1e-12)
    bound = (f + 2 * b) / (f + b)
    lines = [
        f"Measured with `{meta['command']}` on {meta['machine']} ({meta['date']}): {meta['nproc']} processes "
        f"({meta['backend']}), per-process batch {meta['batch']}, {meta['rounds']} alternations x {meta['steps']} steps. "
        f"F = {f * 1e3:.0f} ms, B = {b * 1e3:.0f} ms (backward with its all-reduce), so "
        f"(F + 2B) / (F + B) = {bound:.2f}.",
        "",
        "| strategy | step time vs combined (median) | peak step memory vs combined | all-reduces (+ FSDP2 "
        "reduce-scatters) / step | MB reduced / step | forwards | backbone backwards |",
        "|---|---|---|---|---|---|---|",
    ]
    mem_c = max(result["memory"]["combined"], 1)
    for s in t["times"]:
        c = types[VARIANTS.get(s, (s,))[0]]
        ps = t["per_step"][s]
        label = VARIANTS[s][2] if s in VARIANTS else f"`{s}`"
        k = c.cost(meta["tasks"])
        rounds = ps["rounds"] + ps.get("manual", 0)  # DDP's bucket rounds + the strategy's hand-made ones
        if "reduce_scatters" in ps:  # FSDP2: the reduce-scatters beside the hand-made all-reduces
            rounds = f"{rounds} + {ps['reduce_scatters']} RS"
        sent = ps["bytes"] + ps.get("rs_bytes", 0)
        lines.append(f"| {label} | {med[s] / med['combined']:.2f}x | {result['memory'][s] / mem_c:.2f}x | {rounds} "
                     f"| {sent / 2**20:.1f} | {k['forwards']} | {k['backbone_backwards']} |")
    rc = t["replica_check"]
    lines += ["", f"Median step time of `combined`: {med['combined'] * 1e3:.0f} ms. Peak step memory of `combined`: "
              f"{mem_c / 2**20:.0f} MB ({meta['memory_kind']}).",
              "", f"Replica check (`ddp.replica_check_every`): {rc * 1e3:.1f} ms per check = "
              f"{rc / med['combined'] * 100:.1f}% of one `combined` step; at the default of every 100 steps, "
              f"{rc / med['combined']:.3f}% of training time."]
    return "\n".join(lines)


def write_into(path: str, text: str) -> None:
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to fill")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = tool_parser("mtl.tools.bench.strategies", __doc__, "configs/default.yaml", "key=value config overrides")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--write", default=None, help="a markdown file whose bench-strategies section to replace")
    p.add_argument("--json", default=None, help="also save the raw numbers here")
    p.add_argument("--only", default=None, help="comma-separated strategies/variants to time (combined always)")
    a = p.parse_args(argv)

    def go():  # a config error or an unknown --only: one message and exit code 2, not a traceback
        cfg = load_run_config(a.config, a.overrides)
        tic = time.time()
        only = a.only.split(",") if a.only else None
        unknown = sorted(set(only or []) - set(strategies_to_time()))
        if unknown:
            raise ConfigError(f"--only: unknown {', '.join(unknown)} (known: {', '.join(strategies_to_time())})")
        result = run(a.config, a.overrides, a.nproc, a.rounds, a.steps, only)
        cuda = torch.cuda.is_available() and cfg.device != "cpu"
        default = not a.overrides and not a.only and (a.rounds, a.steps, a.nproc) == (7, 3, 2)
        args = [f"--config {a.config}", f"--nproc {a.nproc}", f"--rounds {a.rounds}", f"--steps {a.steps}",
                *([f"--only {a.only}"] if a.only else []), *a.overrides]
        meta = {"command": "make bench-strategies" if default else f"python -m mtl.tools.bench.strategies {' '.join(args)}",
                "machine": f"{platform.machine()} "
                f"{os.cpu_count()}-core {'GPU' if cuda else 'CPU'}", "date": time.strftime("%Y-%m-%d"),
                "nproc": a.nproc, "backend": "nccl" if cuda else "gloo", "batch": cfg.data.batch_size,
                "rounds": a.rounds, "steps": a.steps, "tasks": len(cfg.tasks),
                "memory_kind": "CUDA max_memory_allocated" if cuda else "growth of rank 0's peak RSS during the steps"}
        text = table(result, meta)
        print(text)
        print(f"\n(bench took {time.time() - tic:.0f} s)", file=sys.stderr)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, **result}, f, indent=2)
        if a.write:
            write_into(a.write, text)

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
