"""Benchmark task-weighting methods: quality, convergence, significance and cost in one table. ``make bench``.

    python -m mtl.tools.bench [--preset full|quick|gpu|qm9|qm9_cpu | --config configs/bench.yaml] [--plan] [--analyze]
                              [--on-change retrain|refuse] [key=value ...]

For every regime of ``bench.regimes`` (default: one, ``natural``), trains every method of the regime's list
(``bench.methods`` unless the regime names its own) for every seed of ``bench.seeds``, plus one single-task
baseline per task of the config (``single_<task>``: ``tasks=[<task>]``) that delta-m needs, each in
``output_dir/runs/<regime>/<method>/seed<k>/`` and each in **its own process** (``train.py``, or torchrun with
``bench.nproc`` > 1), ``bench.parallel`` at once, on this machine or as one Slurm job each (``bench.launcher``,
mtl/bench/launch.py). A regime is a list of overrides (e.g. ``loss_scale.gen=100``: one task's loss on another
scale) with the effect it should show stated in advance (``expect``), printed above its results. Loss-level methods
run with ``bench.loss_strategy``, gradient-level ones with ``bench.grad_strategy``, or with ``bench.feature_strategy``
when the entry says ``source=features`` (``mgda(source=features)``: weighting.source, see docs/strategies.md).

Writes into ``output_dir``: ``results.md`` and ``results.csv`` (one row per regime and method), ``runs.csv`` (one
row per run), per regime a folder of PNG plots, ``runs.jsonl`` (one status line per run, failures with their
error) and TensorBoard hparams under ``tb/``. A failed run is recorded and the sweep goes on. A re-run reuses a
finished run only when the training configuration it recorded (``bench_run.json``: every key but ``output_dir``
and ``bench.*``, plus ``bench.nproc``) and the hashes of its code files (its method's, strategy's, backbone's and
tasks' files) are the ones it would train with now (mtl/bench/record.py); an unfinished run of an earlier
sweep (killed, a node lost, Ctrl-C) resumes from its newest complete checkpoint when its record is the same, else it
starts from scratch (``earlier_attempt``; one line per run says which). While it trains, the sweep holds
``output_dir``'s lock (mtl/bench/lock.py): a second sweep on the folder is refused, exit 2.

Definitions (mtl/bench/stats.py holds the statistics):
- the reported evaluation of a run: the one with the lowest validation delta-m (``bench.select: best``; ``last``:
  the last one), its metrics read on the held-out test split (``data.synthetic.test_size`` / ``data.test_path``)
  when the runs evaluated one; per method the mean over seeds ± the half-width of the 95% t-interval;
- delta-m % (Maninis et al. 2019), lower is better as Nash-MTL and FAMO report it: per task the mean over its
  declared metrics (``TaskHead.metrics``) of ``(-1)^h_i (M_i - B_i) / B_i * 100`` against the single-task baselines B
  (their mean over seeds; h_i = 1 if higher is better), then the mean over tasks;
- against ``equal``: per seed, the method's delta-m minus equal's on the same seed; the mean, its t-interval and the
  two-sided paired t-test (``bench.test: signflip``: the exact sign-flip permutation test); Holm's correction across
  the table's methods; marked ▼ / ▲ (lower / higher delta-m) where the adjusted p is below ``bench.alpha``, which
  bounds the chance of any false mark in a table by alpha when the per-seed differences are about normal (for
  skewed ones it does not: docs/benchmark.md); each table opens with the smallest difference its seeds detect with
  80% power at Holm's strictest level alpha / m. The pre-registered comparisons (``bench.comparisons``: pairs of
  methods, a - b on the same seed) get a table of their own, Holm across them only, with the power of each at Holm's
  level (``--plan`` prints the design: ``bench.design``). Between
  regimes, the same for each method's delta-m in a regime minus its delta-m in the first regime (not tested, no
  mark, where its runs trained a different number of steps in the two: that difference is the training length's);
- convergence: per run the change of each validation metric over its last ``last_k`` evaluations (the
  least-squares slope times the window's span; with ``bench.plateau_relative``: in % of the metric's single-task
  baseline); over seeds the one-sided 95% t bounds of its improvement over the window (the seeds' spread carries
  the evaluation noise): **converged** when the upper bound is below ``bench.plateau_tol``, **improving** when the
  lower bound is above it, **undetermined** when neither (never read as converged); each table counts the verdicts;
- read against numbers from elsewhere (mtl/bench/compare.py): Δm against ``bench.reference`` (single-task
  metrics given in the config) in a second column; a paper's Δm per method (``bench.published``) beside ours, with
  Spearman's rank correlation and its Fisher-z interval; step time and memory of both gradient sources side by side;
- cost: step time (the median over seeds of each run's median step) as a ratio to ``equal``; peak memory of the
  run's (rank 0's) process: peak RSS on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU; the method's own
  maths (``combine_s``); bytes all-reduced per step with two or more processes; wall time. Each table prints the
  commit, versions and hardware of its runs, and says so when they differ.

This file is the command line and the sweep's order of work; the parts are mtl/bench/regimes.py (the methods, the
regimes, the plan and what ``--plan`` prints), runs.py (training the runs), results.py (reading them back: Δm, the
tests, convergence, cost) and tables.py (results.md, the CSVs, the hparams).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from mtl.bench.design import describe_design, describe_pilot
from mtl.bench.doctor import examine
from mtl.bench.lock import sweep_lock
from mtl.bench.options import bench_options, keys_help
from mtl.bench.plots import write_plots
from mtl.bench.regimes import describe_plan, describe_protocol, list_runs, plan, regime_configs
from mtl.bench.results import summarize
from mtl.bench.runs import run_all
from mtl.bench.tables import write_hparams, write_results
from mtl.delta_m import metric_specs  # the one Δm, in the core
from mtl.errors import ConfigError
from mtl.run.error_report import run_guarded
from mtl.setup.checks import load_run_config

PRESETS = {"full": "configs/bench.yaml", "quick": "configs/bench_quick.yaml", "gpu": "configs/bench_gpu.yaml",
           "qm9": "configs/bench_qm9.yaml", "qm9_cpu": "configs/bench_qm9_cpu.yaml"}


GOAL_REPS = 10  # measurements of the step-time goal (F + 2B) / (F + B) under the tables: its interval is over these

HELP = """overrides (key=value, as train.py takes them) change the bench config for the whole sweep, e.g.
  bench.seeds=[0,1,2]  bench.methods=[equal,'cagrad(c=0.2)','mgda(source=features)']  trainer.max_steps=700
  bench.parallel=2  bench.nproc=2  bench.launcher=slurm bench.slurm.partition=gpu  output_dir=runs/mine
A finished run is reused only when its training configuration (every key but output_dir and bench.*) and its code
(the files of its method, strategy, backbone and tasks, plug-ins too) are unchanged; an unfinished run with a
complete checkpoint of the same configuration and code resumes from it (resume=auto). One sweep per output_dir: a
second one is refused (exit 2) naming the first one's PID. Exit codes: 0 done (failed runs are in runs.jsonl), 2 a
config or option error, an --on-change refuse or a folder in use.

outputs, under output_dir:
  results.md    one table per regime (quality, Δm lower is better, vs equal with p_Holm, cost) and convergence
  results.csv   one row per regime and method or baseline      runs.csv  one row per finished run
  runs.jsonl    one status line per run (failures with their error); errors.log
  <regime>/     PNG plots: metrics vs step and vs wall time (bands: 95% over seeds), task weights, gradient cosine
  runs/<regime>/<method>/seed<k>/   each run's own folder (train.py's files, log.txt, bench_run.json)
  tb/           TensorBoard hparams, one entry per run                slurm/  submitit's job logs (launcher slurm)
Methodology and presets: docs/benchmark.md."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtl.tools.bench", epilog=f"{HELP}\n\n{keys_help()}",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Benchmark task-weighting methods: every method of bench.methods x every "
                                            "seed, plus the single-task baselines, each its own run; then the tables.")
    p.add_argument("--config", default=None, help="the bench config (default: the preset's)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="full (configs/bench.yaml, the 60-minute CPU sweep), quick (<= 10 min CPU), gpu; qm9 (the "
                        "papers' QM9 protocol, for GPUs), qm9_cpu (QM9 reduced to this CPU: make bench-qm9)")
    p.add_argument("--plan", action="store_true",
                   help="check the config and list every run (regime, method, seed, folder, overrides); train nothing")
    p.add_argument("--on-change", choices=("retrain", "refuse"), default="retrain",
                   help="a finished run whose training configuration (any key but output_dir and bench.*; bench.nproc "
                        "counts) or code (the files of its method, strategy, backbone and tasks) differs from what "
                        "it would train now: train it again (default), or refuse and exit 2 listing every such run "
                        "and the keys and files that changed")
    p.add_argument("--analyze", action="store_true",
                   help="train nothing: write the tables and plots from the runs that finished with this "
                        "configuration (the others are listed as missing), e.g. while a Slurm sweep is still running")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (below)")
    a = p.parse_args(argv)
    config = a.config or PRESETS[a.preset or "full"]

    def go():
        if a.config and a.preset:
            raise ConfigError("--config and --preset: give one of them (a preset is a config file: "
                              f"{PRESETS[a.preset]})")
        cfg = load_run_config(config, a.overrides)
        loaded, errors = regime_configs(cfg, config, a.overrides)
        if errors:
            raise ConfigError(errors)
        runs = plan(cfg, loaded=loaded)
        print(describe_plan(runs), flush=True)
        if a.plan:
            print(describe_protocol(cfg, loaded))
            print(describe_design(cfg))
            print(describe_pilot(cfg, f"--preset {a.preset}" if a.preset else f"--config {config}"))
            print(list_runs(runs))
            return
        # one sweep per output_dir while it trains (--analyze trains nothing: it may read a sweep in progress)
        with contextlib.nullcontext() if a.analyze else sweep_lock(cfg.output_dir):
            sweep(cfg, config, a.overrides, loaded, runs, a.on_change, train=not a.analyze)

    return run_guarded(go)


def sweep(cfg, config: str, overrides: list[str], loaded: dict, runs: list[dict], on_change: str, train: bool) -> None:
    """Train what is missing (``run_all``), then the tables, plots and hparams of ``runs``."""
    tic = time.time()
    run_all(cfg, config, overrides, runs, on_change, train=train)
    per_regime = {}
    for regime, (spec, rcfg) in loaded.items():
        source = spec["baselines_from"] or regime
        mine = [r for r in runs if r["regime"] == regime and not r["label"].startswith("single_")]
        baselines = [r for r in runs if r["regime"] == source and r["label"].startswith("single_")]
        rows, base = summarize(cfg, regime, spec, rcfg, mine, baselines)
        per_regime[regime] = (rcfg, rows, base)
        data = {r["method"]: list(r["_seeds"].values()) for r in rows if r["_seeds"]}
        write_plots(rcfg, metric_specs(rcfg), data, os.path.join(cfg.output_dir, regime), list(spec["methods"]))
    first_cfg = next(iter(loaded.values()))[1]
    # F and B of the bench model, one process on this machine: where the runs trained (the local launcher);
    # a Slurm sweep's runs trained on other nodes, so this machine's F and B would say nothing of them
    report = examine(first_cfg, batches=1, goal_reps=GOAL_REPS) if bench_options(cfg).launcher == "local" else {}
    regime_specs = {k: v[0] for k, v in loaded.items()}
    text = write_results(cfg, per_regime, {"forward_s": report.get("forward_s", float("nan")),
                                           "backward_s": report.get("backward_s", float("nan")),
                                           "step_goals": report.get("step_goals", []),
                                           "regimes": regime_specs})
    write_hparams(cfg, per_regime, regime_specs)
    print(text)
    left = [f"{r['regime']} {r['label']} seed {r['seed']}" for r in runs if r.get("status") == "unfinished"]
    print(f"\nbench: {len(runs)} runs, {time.time() - tic:.0f} s this invocation; results in {cfg.output_dir}"
          + (f"; {len(left)} unfinished at the requeue cap of their Slurm jobs, resubmitted from their newest "
             f"checkpoints by the next bench invocation: {'; '.join(left)}" if left else ""))
