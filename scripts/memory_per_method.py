"""Peak RSS growth over 3 training steps, one fresh process per weighting method (docs/strategies.md).

    python scripts/memory_per_method.py [--tree DIR ...] [--methods a,b] [--out FILE.json]

For each method and each source tree (``--tree``: a checkout of mtl; default: this one), a fresh Python process
builds ``configs/default.yaml``'s model (ResNet-18 cut after layer2, the 2-layer decoder) with a small batch
(``data.batch_size=8``: the activations are small beside the parameter-sized buffers this compares), on the CPU,
one process, and takes optimizer steps with ``Trainer.step_once``. It reports the growth of the peak resident set
(VmHWM) from the built trainer to the end of step 3, and the median time of steps 2 to ``--steps`` (default 3). Gradient-level methods
run with ``ddp.strategy=task_grads`` (the parameters source), loss-level ones with ``feature_leaf``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["equal", "pcgrad", "mgda", "cagrad", "alignedmtl", "upgrad", "gradvac", "gradnorm", "graddrop", "dbmtl",
           "moco", "excessmtl"]


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def one(method: str, out_dir: str, steps: int = 3) -> dict:
    """In this process: build, then 3 steps; the peak RSS before and after, and the step times."""
    import torch

    from mtl.run.trainer import Trainer
    from mtl.weighting import weighting_types

    torch.set_num_threads(1)
    grad = weighting_types()[method].level == "grad"
    trainer = Trainer.from_config(os.path.join(ROOT, "configs", "default.yaml"), [
        f"output_dir={out_dir}", "overwrite=true", "device=cpu", "trainer.progress=false", "data.batch_size=8",
        "data.num_workers=0", "data.synthetic.train_size=256", "data.synthetic.val_size=16", f"trainer.max_steps={max(3, steps)}",
        f"weighting.method={method}", f"ddp.strategy={'task_grads' if grad else 'feature_leaf'}"])
    batches = trainer.batches()
    batch = [next(batches)[1] for _ in range(max(3, steps))]  # drawn first: the loader's memory is not the step's
    before = peak_rss_mib()
    times, after = [], None
    for i, b in enumerate(batch):
        tic = time.perf_counter()
        trainer.step_once(b)
        times.append(time.perf_counter() - tic)
        if i == 2:
            after = peak_rss_mib()
    trainer.close()
    return {"method": method, "growth_mib": after - before, "peak_mib": after,
            "step_s": sorted(times[1:])[len(times[1:]) // 2]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="a source tree of mtl (default: this one); give two to compare")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=3, help="steps per process (the growth is always over the first 3)")
    ap.add_argument("--out", help="write the rows as JSON here too")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: measure this method, print one JSON line
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.one, tmp, args.steps)))
        return
    trees = args.tree or [ROOT]
    rows = []
    for method in args.methods.split(","):
        for tree in trees:  # side by side: the trees alternate per method
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", method, "--steps", str(args.steps)],
                                  cwd=tree, env=env,
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{method} in {tree} failed:\n{proc.stderr[-3000:]}")
            row = {**json.loads(proc.stdout.strip().splitlines()[-1]), "tree": tree}
            rows.append(row)
            print(f"{method:12s} {tree:40s} growth {row['growth_mib']:7.1f} MiB  step {row['step_s']:.3f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
