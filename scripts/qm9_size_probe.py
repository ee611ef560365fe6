"""Does a qm9_cpu size separate weighting methods beyond the seed noise? A probe run before a two-hour sweep.

    python scripts/qm9_size_probe.py --out DIR --size NAME='KEY=VALUE ...' [--size ...]
        [--methods 'equal,cagrad(source=features),...'] [--seeds 0,1,2] [--parallel 2] [--analyse-only]

For each size (overrides of ``configs/qm9_cpu.yaml``) it trains each method with each seed (``train.py``, one
thread a run, ``--parallel`` at once; ``DIR/NAME/<method>_seed<S>``), then reads each run as the bench would,
without the 33 single-task runs a size that the bench's Δm needs:

- the evaluation with the lowest validation Δm against the published single-task MAEs (``plateau_delta_m``, what
  the schedule reads), and its test MAEs;
- per method and seed, the change of Δm against ``equal`` on the same seed, with each task's MAE relative to
  ``equal``'s mean test MAE over the seeds (a stand-in for the single-task baseline: it weighs the tasks
  differently, so it reads the gap against the spread, not the bench's Δm itself);
- the paired t-test of those changes (``scipy.stats.ttest_1samp``), and the ratio |mean| / sd that Holm's
  strictest level needs at this many seeds and comparisons (``--comparisons``, the bench's 8): with 3 seeds,
  t(2) at 0.05 / 16 over sqrt(3);
- ``equal``'s slope of each validation MAE over its last 10 evaluations, in % per 100 steps (the bench's
  convergence reading).

A run folder that is not the run asked for (another size's, method's or seed's settings in its config.yaml, an
unfinished run, a non-finite test MAE) ends the probe with one line naming it: ``--analyse-only`` never reads a
stale folder as this size.

The figures in docs/notes.md ("other splits of qm9_cpu's budget probed") come from this script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import yaml
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mtl.bench.entries import method_spec  # noqa: E402

TASKS = ["mu", "alpha", "homo", "lumo", "r2", "zpve", "U0", "U", "H", "G", "Cv"]
METHODS = "equal,cagrad(source=features),nashmtl(source=features),imtlg(source=features)"


def folder(out: str, size: str, entry: str, seed: int) -> str:
    return os.path.join(out, size, f"{entry.replace('(', '_').replace(')', '').replace('=', '-')}_seed{seed}")


def train(out: str, size: str, overrides: list[str], entry: str, seed: int) -> str:
    name, options, source = method_spec(entry)
    run_dir = folder(out, size, entry, seed)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "qm9_cpu.yaml"),
           "ddp.strategy=feature_leaf", "checkpoint.every_steps=0", "trainer.progress=false", f"seed={seed}",
           f"weighting.method={name}", f"weighting.source={source}", f"output_dir={run_dir}", "overwrite=true",
           *[f"weighting.options.{k}={json.dumps(v)}" for k, v in options.items()], *overrides]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{size} {entry} seed {seed} failed ({shlex.join(cmd)}):\n{proc.stderr[-2000:]}")
    print(f"done: {os.path.relpath(run_dir, out)} in {time.perf_counter() - tic:.0f} s", flush=True)
    return run_dir


def expected_settings(overrides: list[str], entry: str, seed: int) -> dict:
    """What a run of this size, entry and seed must have in its config.yaml: dotted key -> value (YAML)."""
    name, options, source = method_spec(entry)
    want = {"seed": seed, "weighting.method": name, "weighting.source": source,
            **{f"weighting.options.{k}": v for k, v in options.items()}}
    for item in overrides:
        key, _, raw = item.partition("=")
        want[key] = yaml.safe_load(raw)
    return want


def read(run_dir: str, want: dict) -> dict:
    """The run's reading; exits with one line naming the run when it is not the run asked for (a stale folder of
    other settings), did not finish, or has a non-finite test MAE."""
    try:
        config = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
        final = json.load(open(os.path.join(run_dir, "final_metrics.json")))
        lines = list(map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))))
    except (OSError, ValueError, yaml.YAMLError) as e:
        sys.exit(f"{run_dir}: not a finished run ({e}); run the probe without --analyse-only")
    for key, value in want.items():
        have = config
        for part in key.split("."):
            have = have.get(part) if isinstance(have, dict) else None
        if have != value:
            sys.exit(f"{run_dir}: {key} is {have!r}, this size asks for {value!r}: a run of other settings; give "
                     "another --out or run the probe without --analyse-only")
    if final.get("step") != config["trainer"]["max_steps"]:
        sys.exit(f"{run_dir}: stopped at step {final.get('step')} of {config['trainer']['max_steps']}")
    evals = [r for r in lines if r.get("kind") == "eval"]
    if len(evals) < 10:
        sys.exit(f"{run_dir}: {len(evals)} evaluations; the probe reads the last 10")
    best = min(evals, key=lambda r: r["plateau_delta_m"])
    bad = [t for t in TASKS if not math.isfinite(best[f"test_{t}_mae"])]
    if bad or not math.isfinite(best["plateau_delta_m"]):
        sys.exit(f"{run_dir}: non-finite at step {best['step']}: {', '.join(bad) or 'plateau_delta_m'}")
    last = evals[-10:]
    steps = np.array([r["step"] for r in last], dtype=float)
    slope = {}
    for t in TASKS:
        values = np.array([r[f"{t}_mae"] for r in last])
        slope[t] = stats.linregress(steps, values).slope * 100 / values.mean() * 100
    return {"test": {t: best[f"test_{t}_mae"] for t in TASKS}, "step": best["step"], "slope": slope}


def report(out: str, size: str, overrides: list[str], methods: list[str], seeds: list[int], comparisons: int) -> dict:
    """Print the size's reading; return it: ``need`` (the |mean| / sd Holm's strictest level needs), ``slopes``
    (equal's, per task) and per method its ``diffs`` over the seeds, ``p`` and ``ratio``."""
    runs = {(m, s): read(folder(out, size, m, s), expected_settings(overrides, m, s)) for m in methods for s in seeds}
    base = {t: np.mean([runs[("equal", s)]["test"][t] for s in seeds]) for t in TASKS}
    need = stats.t.ppf(1 - 0.05 / (2 * comparisons), len(seeds) - 1) / np.sqrt(len(seeds))
    print(f"## {size} ({len(seeds)} seeds)")
    print("equal's test MAE (mean over seeds): " + ", ".join(f"{t} {base[t]:.4g}" for t in TASKS))
    slopes = np.array([[runs[("equal", s)]["slope"][t] for t in TASKS] for s in seeds]).mean(0)
    print("equal's validation slope over its last 10 evaluations, % per 100 steps: "
          + ", ".join(f"{t} {v:+.1f}" for t, v in zip(TASKS, slopes))
          + f"; selected steps {[runs[('equal', s)]['step'] for s in seeds]}")
    print(f"| method | Δm − Δm(equal) per seed | mean | sd | t | p | mean/sd (Holm's α/{comparisons} needs {need:.1f}) |")
    print("|---|---|---|---|---|---|---|")
    reading = {"need": float(need), "slopes": dict(zip(TASKS, slopes.tolist())), "methods": {}}
    for m in methods:
        if m == "equal":
            continue
        d = np.array([np.mean([(runs[(m, s)]["test"][t] - runs[("equal", s)]["test"][t]) / base[t] * 100
                               for t in TASKS]) for s in seeds])
        test = stats.ttest_1samp(d, 0.0)
        print(f"| `{m}` | {', '.join(f'{x:+.2f}' for x in d)} | {d.mean():+.2f} | {d.std(ddof=1):.2f} | "
              f"{test.statistic:+.2f} | {test.pvalue:.3f} | {abs(d.mean()) / d.std(ddof=1):.2f} |")
        reading["methods"][m] = {"diffs": d.tolist(), "p": float(test.pvalue), "ratio": abs(d.mean()) / d.std(ddof=1)}
    print()
    return reading


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the folder of the probe's runs")
    ap.add_argument("--size", action="append", required=True, metavar="NAME='KEY=VALUE ...'",
                    help="a size: its name and its overrides of configs/qm9_cpu.yaml (repeatable)")
    ap.add_argument("--methods", default=METHODS, help="comma-separated bench entries; equal is the reference")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--comparisons", type=int, default=8, help="the bench table's comparisons with equal (Holm)")
    ap.add_argument("--analyse-only", action="store_true", help="read the runs already in --out")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]  # entries have no commas in this probe
    if "equal" not in methods:
        ap.error("--methods needs equal: the differences are read against it")
    seeds = [int(s) for s in a.seeds.split(",")]
    sizes = {}
    for spec in a.size:
        name, eq, overrides = spec.partition("=")
        if not eq or not name.isidentifier():
            ap.error(f"--size {spec!r}: give NAME='KEY=VALUE ...'")
        sizes[name] = shlex.split(overrides)
    if not a.analyse_only:
        jobs = [(size, ov, m, s) for size, ov in sizes.items() for s in seeds for m in methods]
        with ThreadPoolExecutor(a.parallel) as pool:
            list(pool.map(lambda j: train(a.out, *j), jobs))
    for size, overrides in sizes.items():
        report(a.out, size, overrides, methods, seeds, a.comparisons)


if __name__ == "__main__":
    main()
