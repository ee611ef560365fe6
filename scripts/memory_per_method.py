"""Peak RSS growth over 3 training steps, one fresh process per weighting method (docs/strategies.md).

    python scripts/memory_per_method.py [--tree DIR ...] [--methods a,b] [--out FILE.json]
    python scripts/memory_per_method.py --libmtl [--libmtl-path DIRS] [--rounds N] [--steps N] [--interleaved]

For each method and each variant, a fresh Python process builds ``configs/default.yaml``'s model (ResNet-18 cut
after layer2, the 2-layer decoder) with a small batch (``data.batch_size=8``: the activations are small beside the
parameter-sized buffers this compares), on the CPU, one process, one thread, and takes optimizer steps. It reports
the growth of the peak resident set over the first 3 steps: the kernel's peak (VmHWM) is reset just before step 1
(``/proc/self/clear_refs``), so the growth is the peak during the steps less the resident set at their start, and
a transient peak of the build cannot hide part of it. And the median and the least time of steps 2 to ``--steps``
(default 3). With ``--libmtl`` and ``--rounds`` >= 3, a last table reads each method's ratios over the rounds:
their geometric mean with its 95% t-interval, and one-sided paired t-tests on the log ratios, Holm-adjusted across
the methods: "lower" (ours < LibMTL) and "<= within 5%" (non-inferiority); the rows also go to ``--out``.
Gradient-level methods run with ``ddp.strategy=task_grads`` (the parameters source), loss-level ones with
``feature_leaf``.

Variants: each source tree of mtl (``--tree``: a checkout; default: this one), stepping with
``Trainer.step_once``; and with ``--libmtl``, LibMTL's implementation of the same method (its class in
``LIBMTL`` below, with its own default hyper-parameters, on the parameters: ``rep_grad=False``) on the SAME
trainer: the same model, batch, optimizer and scheduler, its step being LibMTL's training loop's: the losses,
``optimizer.zero_grad(set_to_none=False)``, the method's ``backward(losses)``, the gradient clipping our config
has (``optim.grad_clip``, 1.0, by ``torch.nn.utils.clip_grad_norm_``: the same recipe on both sides), and
``optimizer.step()``. The two alternate per method, ``--rounds`` times. Every process of a ``--libmtl`` run
imports LibMTL before it builds the
trainer, so both variants start from the same resident set. LibMTL is not a dependency of mtl: it is used only
when ``import LibMTL`` works with ``--libmtl-path`` (directories, ``os.pathsep``-separated) in front of the path;
otherwise the script says so and exits 2. The PyPI release 1.1.5 lacks Aligned-MTL, UPGrad, DB-MTL, MoCo,
ExcessMTL and Nash-MTL (the repository's 1.1.5 has them); UPGrad needs qpsolvers and quadprog, Nash-MTL cvxpy
and ECOS, and the package imports them all.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARGIN = 0.05  # "ours <= LibMTL's" is claimed when ours is shown to be at most 5% above it (non-inferiority)
METHODS = ["equal", "pcgrad", "mgda", "cagrad", "alignedmtl", "upgrad", "gradvac", "gradnorm", "graddrop", "dbmtl",
           "moco", "excessmtl"]

# our method -> LibMTL's class, and its keyword arguments (LibMTL's defaults, from its config.py). GradDrop is
# left out: LibMTL runs it on the representation's gradients only (rep_grad=True), ours on the parameters'.
LIBMTL = {
    "equal": ("EW", {}),
    "pcgrad": ("PCGrad", {}),
    "mgda": ("MGDA", {"mgda_gn": "none"}),
    "cagrad": ("CAGrad", {"calpha": 0.5, "rescale": 1}),
    "alignedmtl": ("Aligned_MTL", {}),
    "upgrad": ("UPGrad", {"UPGrad_norm_eps": 1e-4, "UPGrad_reg_eps": 1e-4}),
    "gradvac": ("GradVac", {"GradVac_beta": 0.5, "GradVac_group_type": 0}),
    "gradnorm": ("GradNorm", {"alpha": 1.5}),
    "dbmtl": ("DB_MTL", {"DB_beta": 0.9, "DB_beta_sigma": 0}),
    "moco": ("MoCo", {"MoCo_beta": 0.5, "MoCo_beta_sigma": 0.5, "MoCo_gamma": 0.1, "MoCo_gamma_sigma": 0.5,
                      "MoCo_rho": 0}),
    "excessmtl": ("ExcessMTL", {"robust_step_size": 1e-2}),
    "imtlg": ("IMTL", {}),
    "nashmtl": ("Nash_MTL", {"update_weights_every": 1, "optim_niter": 20, "max_norm": 1.0}),
}


def memory_mib() -> tuple[float, float]:
    """(peak, current) resident set of this process, MiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                found[line[:5]] = int(line.split()[1]) / 1024
    if len(found) != 2:
        raise RuntimeError("no VmHWM/VmRSS in /proc/self/status")
    return found["VmHWM"], found["VmRSS"]


def reset_peak() -> None:
    """Set the kernel's peak resident set (VmHWM) to the current one (Linux: "5" into clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(method: str, out_dir: str, steps: int):
    import torch

    from mtl.run.trainer import Trainer
    from mtl.weighting import weighting_types

    torch.set_num_threads(1)
    grad = weighting_types()[method].level == "grad"
    return Trainer.from_config(os.path.join(ROOT, "configs", "default.yaml"), [
        f"output_dir={out_dir}", "overwrite=true", "device=cpu", "trainer.progress=false", "data.batch_size=8",
        "data.num_workers=0", "data.synthetic.train_size=256", "data.synthetic.val_size=16",
        f"trainer.max_steps={max(3, steps)}", f"weighting.method={method}",
        f"ddp.strategy={'task_grads' if grad else 'feature_leaf'}"])


def libmtl_step(trainer, method: str):
    """LibMTL's training step for ``method`` on ``trainer``'s model, optimizer and scheduler: a function of a batch."""
    import LibMTL.weighting as lw
    import numpy as np
    import torch

    from mtl.parallel.dist import all_reduce_sum

    name, kwargs = LIBMTL[method]
    bare, tasks = trainer.bare, list(trainer.parts.tasks)
    shared = [p for p in bare.backbone.parameters() if p.requires_grad]

    class Harness(getattr(lw, name)):  # what LibMTL's model (architecture x weighting) gives its weighting
        def get_share_params(self):
            return iter(shared)

        def zero_grad_share_params(self):
            bare.backbone.zero_grad(set_to_none=False)

    if name == "Aligned_MTL":  # it calls torch.symeig, which torch 2 only raises in; torch's own replacement:
        torch.symeig = lambda a, eigenvectors=False, upper=False: torch.linalg.eigh(a, UPLO="U" if upper else "L")
    w = Harness()
    w.task_num, w.task_name, w.device, w.rep_grad, w.encoder = len(tasks), tasks, trainer.device, False, bare.backbone
    w.epoch, w.epochs = 1, 2  # past the first epoch: GradNorm weighs from its second (EW before)
    w.train_loss_buffer = np.ones((len(tasks), 2))  # GradNorm's first-epoch losses: values only, not memory
    w.init_param()
    own = list(w.parameters(recurse=False))  # not the encoder's, which it holds too
    # GradNorm's and IMTL's loss scales: trained as in LibMTL's model, by the same kind of optimizer (a group of
    # the trainer's own would not fit its scheduler)
    extra = None
    if own:
        kind = type(trainer.optimizer)
        known = inspect.signature(kind).parameters
        extra = kind(own, **{k: v for k, v in trainer.optimizer.defaults.items() if k in known})

    clip = trainer.parts.grad_clip

    def step(batch):
        for t in tasks:
            bare.heads[t].prepare(batch, all_reduce_sum)
        losses = bare(batch)["losses"]
        trainer.optimizer.zero_grad(set_to_none=False)
        if extra is not None:
            extra.zero_grad(set_to_none=False)
        w.backward(torch.stack([losses[t] for t in tasks]), **kwargs)
        if clip > 0:  # the same recipe as ours (optim.grad_clip; LibMTL's trainer has no clipping of its own)
            torch.nn.utils.clip_grad_norm_(trainer.params, clip)
        trainer.optimizer.step()
        if extra is not None:
            extra.step()
        trainer.scheduler.step()

    return step


def one(method: str, out_dir: str, steps: int = 3, lib: str | None = None) -> dict:
    """In this process: build, then the steps (ours, or with ``lib`` LibMTL's); the peak RSS growth over the
    first 3 steps and the median time of steps 2 to ``steps``."""
    if lib is not None:
        import LibMTL.weighting  # noqa: F401  both variants import it first: the same resident set at the start

    trainer = build(method, out_dir, steps)
    batches = trainer.batches()
    batch = [next(batches)[1] for _ in range(max(3, steps))]  # drawn first: the loader's memory is not the step's
    if lib == "libmtl":
        from mtl.run.evaluate import to_device

        run = libmtl_step(trainer, method)
        batch = [to_device(b, trainer.device) for b in batch]
    else:
        run = trainer.step_once
    reset_peak()
    start = memory_mib()[1]
    times, after = [], None
    for i, b in enumerate(batch):
        tic = time.perf_counter()
        run(b)
        times.append(time.perf_counter() - tic)
        if i == 2:
            after = memory_mib()[0]
    trainer.close()
    return {"method": method, "growth_mib": after - start, "peak_mib": after,
            "step_s": statistics.median(times[1:]), "step_min_s": min(times[1:])}


def interleaved(method: str, out_dir: str, blocks: int = 8, block: int = 5) -> dict:
    """In this process: one trainer, stepped by ours and by LibMTL's step in alternating blocks of ``block``
    steps (after 3 of each to warm up), ``blocks`` blocks each; the median step time of each. Both share the
    process, its allocator and the model, so what differs is the step's own code, not a fresh process's draw."""
    import LibMTL.weighting  # noqa: F401

    from mtl.run.evaluate import to_device

    trainer = build(method, out_dir, 6 + 2 * blocks * block)
    batches = trainer.batches()
    batch = [to_device(next(batches)[1], trainer.device) for _ in range(block)]
    steps = {"ours": trainer.step_once, "libmtl": libmtl_step(trainer, method)}
    times = {name: [] for name in steps}
    for run in steps.values():
        for b in batch[:3]:
            run(b)
    for _ in range(blocks):
        for name, run in steps.items():
            for b in batch:
                tic = time.perf_counter()
                run(b)
                times[name].append(time.perf_counter() - tic)
    trainer.close()
    return {"method": method, **{f"{name}_step_s": statistics.median(t) for name, t in times.items()}}


def child(method: str, steps: int, cwd: str, pythonpath: str, lib: str | None = None, fail: bool = True) -> dict | None:
    """One fresh process: ``one(method)`` with ``pythonpath`` (and LibMTL's, for a LibMTL run) in front. A failed
    process ends the script, or with ``fail=False`` is reported in one line and gives None."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, "--steps", str(steps)]
    if lib:
        cmd += ["--lib", lib]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        if fail:
            sys.exit(f"{method} ({lib or cwd}) failed:\n{proc.stderr[-3000:]}")
        print(f"{method} ({lib}) failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def libmtl_found(path: str) -> str | None:
    """Why ``import LibMTL.weighting`` fails with ``path`` in front, or None when it works (a fresh process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, ROOT) if p)}
    proc = subprocess.run([sys.executable, "-c", "import LibMTL.weighting"], env=env, capture_output=True,
                          text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no message)"])[-1]


def against_libmtl(methods: list[str], steps: int, rounds: int, path: str, both: bool = False) -> list[dict]:
    why = libmtl_found(path)
    if why is not None:
        print(f"LibMTL is not importable ({why}): nothing compared. Give --libmtl-path (or LIBMTL_PATH) the folders "
              "that hold LibMTL and its solvers (qpsolvers, quadprog, cvxpy, ecos), e.g. a `pip install --target "
              "DIR`; never mtl's own environment.", file=sys.stderr)
        sys.exit(2)
    pythonpath = os.pathsep.join(p for p in (path, ROOT) if p)
    rows = []
    for r in range(rounds):
        for method in methods:
            ours = child(method, steps, ROOT, pythonpath, lib="ours")
            lib = child(method, steps, ROOT, pythonpath, lib="libmtl", fail=False)
            if lib is None:  # LibMTL's implementation fails on this torch: the row says so
                rows.append({"round": r, "method": method, "ours": ours, "libmtl": None})
                continue
            row = {"round": r, "method": method, "ours": ours, "libmtl": lib,
                   "memory_ratio": ours["growth_mib"] / lib["growth_mib"], "time_ratio": ours["step_s"] / lib["step_s"],
                   "min_time_ratio": ours["step_min_s"] / lib["step_min_s"]}
            if both:  # the same method again, both steps in one process (``interleaved``)
                mixed = child(method, steps, ROOT, pythonpath, lib="both", fail=False)
                row["interleaved"] = mixed
                if mixed is not None:
                    row["interleaved_ratio"] = mixed["ours_step_s"] / mixed["libmtl_step_s"]
            rows.append(row)
            print(f"{method:11s} round {r}: growth ours {ours['growth_mib']:6.1f} MiB, LibMTL {lib['growth_mib']:6.1f}"
                  f" MiB ({row['memory_ratio']:.2f}x); step ours {ours['step_s'] * 1e3:6.0f} ms, LibMTL "
                  f"{lib['step_s'] * 1e3:6.0f} ms ({row['time_ratio']:.2f}x; fastest steps {row['min_time_ratio']:.2f}x)"
                  + (f"; one process, interleaved {row['interleaved_ratio']:.2f}x" if "interleaved_ratio" in row else ""),
                  flush=True)
    print("\n| method | LibMTL class | growth ours, MiB | LibMTL, MiB | ours / LibMTL | step time ours / LibMTL, median "
          "| fastest step ours / LibMTL |")
    print("|---|---|---|---|---|---|---|")
    for method in methods:
        mine = [r for r in rows if r["method"] == method and r["libmtl"] is not None]
        if not mine:
            print(f"| `{method}` | {LIBMTL[method][0]} | (LibMTL's failed: above) | | | | |")
            continue

        def cell(key, fmt, mine=mine):  # one value per round, "first / second / ..."
            return " / ".join(format(key(r), fmt) for r in mine)

        print(f"| `{method}` | {LIBMTL[method][0]} | {cell(lambda r: r['ours']['growth_mib'], '.1f')} | "
              f"{cell(lambda r: r['libmtl']['growth_mib'], '.1f')} | {cell(lambda r: r['memory_ratio'], '.2f')} | "
              f"{cell(lambda r: r['time_ratio'], '.2f')} | {cell(lambda r: r['min_time_ratio'], '.2f')} |")
    return rows


def verdicts(methods: list[str], rows: list[dict], margin: float = MARGIN, alpha: float = 0.05) -> list[dict]:
    """Per method and measure (memory growth, median step time): the geometric mean of the rounds' ratios with its
    95% t-interval, and two one-sided paired t-tests on the log ratios (``ratio_test``), Holm-adjusted across the
    methods of each measure: "lower" (ours < LibMTL) and "<= within 5%" (non-inferiority: ours is not more than
    ``margin`` above LibMTL's). Printed as a table; returned as rows."""
    from mtl.bench.stats import holm, ratio_test  # import here: the children never load scipy

    out = []
    measures = [("memory growth", "memory_ratio"), ("step time (median)", "time_ratio")]
    if any("interleaved_ratio" in r for r in rows):
        measures.append(("step time, one process interleaved", "interleaved_ratio"))
    for measure, key in measures:
        tests = {m: ratio_test([r[key] for r in rows if r["method"] == m and r.get(key)], margin) for m in methods}
        for name in ("p_lower", "p_within"):
            for m, p in zip(methods, holm([tests[m][name] for m in methods])):
                tests[m][name + "_holm"] = p
        out += [{"measure": measure, "method": m, **t} for m, t in tests.items()]
    print(f"\n| measure | method | rounds | ours / LibMTL, geometric mean [95% CI] | lower: p (Holm) "
          f"| within {margin:.0%}: p (Holm) | verdict at {alpha:g} |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        verdict = ("lower" if r["p_lower_holm"] < alpha else f"<= (within {margin:.0%})" if r["p_within_holm"] < alpha
                   else "not shown <=" if r["n"] >= 3 else "too few rounds")
        print(f"| {r['measure']} | `{r['method']}` | {r['n']} | {r['ratio']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] | "
              f"{r['p_lower']:.3g} ({r['p_lower_holm']:.3g}) | {r['p_within']:.3g} ({r['p_within_holm']:.3g}) | "
              f"{verdict} |")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="a source tree of mtl (default: this one); give two to compare")
    ap.add_argument("--methods", help=f"default: {','.join(METHODS)}; with --libmtl: {','.join(LIBMTL)}")
    ap.add_argument("--steps", type=int, default=3, help="steps per process (the growth is always over the first 3)")
    ap.add_argument("--libmtl", action="store_true", help="compare each method with LibMTL's, side by side")
    ap.add_argument("--libmtl-path", default=os.environ.get("LIBMTL_PATH", ""),
                    help="folders put in front of the path for LibMTL and its solvers (default: $LIBMTL_PATH)")
    ap.add_argument("--rounds", type=int, default=1, help="with --libmtl: the pairs, per method, alternating")
    ap.add_argument("--interleaved", action="store_true",
                    help="with --libmtl: also time both steps in one process, alternating blocks (a third measure)")
    ap.add_argument("--out", help="write the rows as JSON here too")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: measure this method, print one JSON line
    ap.add_argument("--lib", choices=["ours", "libmtl", "both"], help=argparse.SUPPRESS)  # the child, --libmtl
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(interleaved(args.one, tmp) if args.lib == "both" else one(args.one, tmp, args.steps,
                                                                                          args.lib)))
        return
    if args.libmtl:
        methods = args.methods.split(",") if args.methods else list(LIBMTL)
        unknown = [m for m in methods if m not in LIBMTL]
        if unknown:
            sys.exit(f"--methods: no LibMTL counterpart for {', '.join(unknown)} (known: {', '.join(LIBMTL)})")
        rows = against_libmtl(methods, args.steps, args.rounds, args.libmtl_path, args.interleaved)
        rows = {"rounds": rows, "verdicts": verdicts(methods, rows)}
    else:
        rows = []
        for method in (args.methods.split(",") if args.methods else METHODS):
            for tree in args.tree or [ROOT]:  # side by side: the trees alternate per method
                row = {**child(method, args.steps, tree, tree), "tree": tree}
                rows.append(row)
                print(f"{method:12s} {tree:40s} growth {row['growth_mib']:7.1f} MiB  step {row['step_s']:.3f} s",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
