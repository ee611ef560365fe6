"""Benchmark task-weighting methods: quality, convergence, significance and cost in one table. ``make bench``.

    python -m mtl.tools.bench [--preset full|quick|gpu|qm9|qm9_cpu | --config configs/bench.yaml] [--plan] [--analyze]
                              [--on-change retrain|refuse] [key=value ...]

For every regime of ``bench.regimes`` (default: one, ``natural``), trains every method of the regime's list
(``bench.methods`` unless the regime names its own) for every seed of ``bench.seeds``, plus one single-task
baseline per task of the config (``single_<task>``: ``tasks=[<task>]``) that delta-m needs, each in
``output_dir/runs/<regime>/<method>/seed<k>/`` and each in **its own process** (``train.py``, or torchrun with
``bench.nproc`` > 1), ``bench.parallel`` at once, on this machine or as one Slurm job each (``bench.launcher``,
mtl/tools/bench/launch.py). A regime is a list of overrides (e.g. ``loss_scale.gen=100``: one task's loss on another
scale) with the effect it should show stated in advance (``expect``), printed above its results. Loss-level methods
run with ``bench.loss_strategy``, gradient-level ones with ``bench.grad_strategy``, or with ``bench.feature_strategy``
when the entry says ``source=features`` (``mgda(source=features)``: weighting.source, see docs/strategies.md).

Writes into ``output_dir``: ``results.md`` and ``results.csv`` (one row per regime and method), ``runs.csv`` (one
row per run), per regime a folder of PNG plots, ``runs.jsonl`` (one status line per run, failures with their
error) and TensorBoard hparams under ``tb/``. A failed run is recorded and the sweep goes on. A re-run reuses a
finished run only when the training configuration it recorded (``bench_run.json``: every key but ``output_dir``
and ``bench.*``, plus ``bench.nproc``) and the hashes of its code files (its method's, strategy's, backbone's and
tasks' files) are the ones it would train with now (mtl/tools/bench/record.py); an unfinished run of an earlier
sweep (killed, a node lost, Ctrl-C) resumes from its newest complete checkpoint when its record is the same, else it
starts from scratch (``earlier_attempt``; one line per run says which). While it trains, the sweep holds
``output_dir``'s lock (mtl/tools/bench/lock.py): a second sweep on the folder is refused, exit 2.

Definitions (mtl/tools/bench/stats.py holds the statistics):
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
  baseline); a metric is still improving when the one-sided 95% lower bound over seeds of its improvement over the
  window exceeds ``bench.plateau_tol`` (the seeds' spread carries the evaluation noise); converged otherwise,
  which means "not shown to improve by more than the tolerance", not "shown flat";
- read against numbers from elsewhere (mtl/tools/bench/compare.py): Δm against ``bench.reference`` (single-task
  metrics given in the config) in a second column; a paper's Δm per method (``bench.published``) beside ours, with
  Spearman's rank correlation and its Fisher-z interval; step time and memory of both gradient sources side by side;
- cost: step time (the median over seeds of each run's median step) as a ratio to ``equal``; peak memory of the
  run's (rank 0's) process: peak RSS on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU; the method's own
  maths (``combine_s``); bytes all-reduced per step with two or more processes; wall time. Each table prints the
  commit, versions and hardware of its runs, and says so when they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import math
import os
import re
import shutil
import statistics
import sys
import time

import yaml
from omegaconf import OmegaConf
from safetensors import safe_open
from torch.utils import tensorboard

from mtl.build import run_method_types
from mtl.config.checks import architecture_source_errors, gradient_source_errors, load_run_config
from mtl.config.schema import check_options
from mtl.delta_m import delta, metric_specs  # the one Δm, in the core
from mtl.errors import CheckpointError, ConfigError
from mtl.run.checkpoint import find_resumable, list_checkpoints, read_trainer_state
from mtl.run.error_report import run_guarded
from mtl.strategies import strategy_types
from mtl.tools.bench.compare import cost_table, published_entries, published_errors, published_table, reference_values
from mtl.tools.bench.design import comparisons_table, describe_design
from mtl.tools.bench.entries import method_spec, parse_method  # noqa: F401  (parse_method: this module's interface too)
from mtl.tools.bench.launch import drive, make_launcher, resuming
from mtl.tools.bench.lock import sweep_lock
from mtl.tools.bench.options import bench_option_errors, bench_options, keys_help
from mtl.tools.bench.plots import write_plots
from mtl.tools.bench.progress import Progress
from mtl.tools.bench.record import provenance, provenance_lines, read_record, reuse_problem, run_identity, write_record
from mtl.tools.bench.stats import (
    TESTS,
    holm,
    mark,
    mean_ci,
    min_detectable,
    paired_test,
    pooled_sd,
    slope_per_100,
    still_improving,
    window_change,
)
from mtl.tools.doctor import examine

PRESETS = {"full": "configs/bench.yaml", "quick": "configs/bench_quick.yaml", "gpu": "configs/bench_gpu.yaml",
           "qm9": "configs/bench_qm9.yaml", "qm9_cpu": "configs/bench_qm9_cpu.yaml"}
REGIME_KEYS = ("overrides", "methods", "baselines_from", "expect")
MARK = {1: "▲", -1: "▼", 0: ""}
LAUNCHERS = ("local", "slurm")


# ---------------------------------------------------------------------------------------------- methods

def strategy_for(cfg, level: str, source: str) -> str:
    b = bench_options(cfg)
    if level != "grad":
        return b.loss_strategy
    return b.feature_strategy if source == "features" else b.grad_strategy


def heldout_for(cfg) -> int:
    """``data.heldout`` for a bilevel method's runs (``needs_heldout_batch``): ``bench.heldout``, else a tenth of the
    synthetic training set rounded up to whole global batches (0 on user data: the method's check then asks)."""
    b = bench_options(cfg)
    if b.heldout:
        return int(b.heldout)
    if cfg.data.source != "synthetic":
        return 0
    glob = int(cfg.data.batch_size) * max(1, int(b.nproc))
    return -(-int(cfg.data.synthetic.train_size) // 10 // glob) * glob


def method_errors(cfg, entries=None, where_prefix: str = "bench.methods") -> list[str]:
    """Every problem of a list of methods (default ``bench.methods``), each naming the entry: unknown or repeated
    entries, the options checked as ``weighting.options`` is for a run (names and types by ``check_options``, ranges
    by the method's ``check``), and the gradient source against the method (as ``weighting.source``)."""
    types, strategies, errors, seen = run_method_types(cfg), strategy_types(), [], set()
    for i, entry in enumerate(bench_options(cfg).methods if entries is None else entries):
        where = f"{where_prefix}[{i}] {entry!r}"
        try:
            name, options, source = method_spec(entry)
        except ValueError as e:
            errors.append(f"{where}: {e}")
            continue
        if name not in types:
            errors.append(f"{where}: unknown method {name!r} (known: {', '.join(types)}; a method file outside "
                          "mtl/weighting goes in weighting_modules)")
            continue
        if entry in seen:
            errors.append(f"{where}: listed twice")
        seen.add(entry)
        found: list[str] = []
        check_options(options, types[name].Options, "weighting.options", found)
        run_cfg = copy.deepcopy(cfg)
        run_cfg.weighting.method, run_cfg.weighting.options, run_cfg.weighting.source = name, options, source
        run_cfg.ddp.strategy = strategy_for(cfg, types[name].level, source)
        if types[name].needs_heldout_batch:  # the tool gives it its held-out items; what else it refuses, it says
            run_cfg.data.heldout = heldout_for(cfg)
            found += [e if e.startswith("weighting.options") else e.replace("data.heldout:", "bench.heldout:", 1)
                      for e in types[name].check(run_cfg)]
        else:
            found += [e for e in types[name].check(run_cfg) if e.startswith("weighting.options")]
        found += gradient_source_errors(run_cfg, strategies.get(run_cfg.ddp.strategy), types[name], strategies)
        found += architecture_source_errors(run_cfg, types[name])
        errors += [f"{where}: {e}" for e in found]
    return errors


def method_overrides(entry: str) -> list[str]:
    """The run overrides of one ``bench.methods`` entry: the method, its source and each of its options."""
    name, options, source = method_spec(entry)
    shown = {k: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip() for k, v in options.items()}
    return [f"weighting.method={name}", f"weighting.source={source}",
            *(f"weighting.options.{k}={v}" for k, v in shown.items())]


def run_folder(label: str) -> str:
    """A folder name for a label: ``cagrad(c=0.2)`` -> ``cagrad_c=0.2``."""
    return re.sub(r"[^\w.=+-]+", "_", label).strip("_")


# ---------------------------------------------------------------------------------------------- regimes

def regimes(cfg) -> dict[str, dict]:
    """``{name: {overrides, methods, baselines_from, expect}}`` with defaults filled, in the config's order."""
    b = bench_options(cfg)
    raw = dict(b.regimes or {})
    if not raw:
        raw = {"natural": {}}
    out = {}
    for name, spec in raw.items():
        spec = dict(spec or {})
        out[str(name)] = {"overrides": [str(o) for o in spec.get("overrides") or []],
                          "methods": list(spec.get("methods") or b.methods),
                          "baselines_from": spec.get("baselines_from"), "expect": spec.get("expect") or "",
                          "_unknown": [k for k in spec if k not in REGIME_KEYS]}
    return {**out, **architecture_regimes(out, b.architectures)}


def architecture_regimes(specs: dict, architectures: list) -> dict[str, dict]:
    """``bench.architectures``, the sweep's architecture axis: each regime again with each architecture
    (``model.architecture.name``), as the regime ``<regime>+<architecture>``: the same methods and overrides, its
    single-task baselines those of the regime it repeats (an architecture shares a network between tasks, so a
    single task's baseline is the plain network's), so its Δm and the "Between regimes" column compare it with the
    same methods on the config's own architecture."""
    out = {}
    for arch in architectures:
        for name, spec in specs.items():
            expect = f"{spec['expect']} " if spec["expect"] else ""
            out[f"{name}+{arch}"] = {
                **spec, "overrides": [*spec["overrides"], f"model.architecture.name={arch}"],
                "baselines_from": spec["baselines_from"] or name,
                "expect": f"{expect}(the regime {name} with model.architecture.name={arch})"}
    return out


def bench_errors(cfg) -> list[str]:
    """Problems of the bench section's own keys (each naming the key and the fix): unknown keys and wrong types
    (``bench_option_errors``), then their values."""
    b, errors = bench_option_errors(cfg)
    if not 0 < b.alpha < 1:
        errors.append(f"bench.alpha: {b.alpha} must lie in (0, 1) (the family-wise level of the marks, e.g. 0.05)")
    if b.select not in ("best", "last"):
        errors.append(f"bench.select: {b.select!r} must be best (the best validation Δm) or last")
    elif b.select == "best" and not b.baselines and not any(
            (spec or {}).get("baselines_from") for spec in (b.regimes or {}).values()):
        errors.append("bench.select=best selects on validation Δm, which needs the single-task baselines: set "
                      "bench.baselines=true, or bench.select=last")
    if b.launcher not in LAUNCHERS:
        errors.append(f"bench.launcher: {b.launcher!r} must be one of {', '.join(LAUNCHERS)}")
    if b.launcher == "slurm" and b.slurm.cluster not in ("slurm", "local"):
        errors.append(f"bench.slurm.cluster: {b.slurm.cluster!r} must be slurm or local (submitit's local executor)")
    if not b.last_k >= 2:
        errors.append(f"bench.last_k: {b.last_k}: the convergence slope needs at least 2 evaluations")
    if b.test not in TESTS:
        errors.append(f"bench.test: {b.test!r} must be one of {', '.join(TESTS)} (the paired t-test, or the exact "
                      "sign-flip permutation test)")
    if not 0 < b.design.power < 1:
        errors.append(f"bench.design.power: {b.design.power} must lie in (0, 1) (e.g. 0.8)")
    if b.design.sd < 0:
        errors.append(f"bench.design.sd: {b.design.sd} must be >= 0 (0: not said)")
    for i, pair in enumerate(b.comparisons):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)) \
                or pair[0] == pair[1]:
            errors.append(f"bench.comparisons[{i}]: {pair!r} must be a pair of two different bench.methods entries, "
                          "[a, b] (a - b on the same seed)")
        elif any(x not in b.methods for x in pair):
            errors.append(f"bench.comparisons[{i}]: {', '.join(x for x in pair if x not in b.methods)} is not in "
                          "bench.methods (a comparison is between two of the sweep's entries, as written there)")
    return errors


def regime_configs(cfg, config_path: str, base_overrides: list[str]) -> tuple[dict, list[str]]:
    """``({regime: (spec, its run config)}, errors)``: each regime's overrides loaded and checked as a run's, and
    its method list checked (every error names the regime and the key)."""
    out, errors = {}, bench_errors(cfg)
    if bench_option_errors(cfg)[1]:  # a key or a type: the rest reads the section
        return out, errors
    specs, raw_regimes = regimes(cfg), bench_options(cfg).regimes
    for name, spec in specs.items():
        key = f"bench.regimes.{name}"
        if spec["_unknown"]:
            errors.append(f"{key}: unknown key(s) {', '.join(spec['_unknown'])} (known: {', '.join(REGIME_KEYS)})")
        if spec["baselines_from"] is not None and spec["baselines_from"] not in specs:
            errors.append(f"{key}.baselines_from: {spec['baselines_from']!r} is not a regime (known: {', '.join(specs)})")
        if not re.fullmatch(r"[\w.+-]+", name):
            errors.append(f"{key}: a regime name is a folder name: letters, digits, '_', '.', '+', '-'")
        try:
            rcfg = load_run_config(config_path, [*base_overrides, *spec["overrides"]])
        except ConfigError as e:
            errors += [f"{key}.overrides {spec['overrides']}: {m}" for m in e.errors]
            continue
        errors += method_errors(rcfg, spec["methods"], f"{key}.methods" if raw_regimes else "bench.methods")
        errors += reference_values(bench_options(cfg), metric_specs(rcfg))[1]
        out[name] = (spec, rcfg)
    if out:
        errors += published_errors(bench_options(cfg), run_method_types(next(iter(out.values()))[1]))
    return out, list(dict.fromkeys(errors))  # a problem every regime shares, once


# ---------------------------------------------------------------------------------------------- runs

def plan(cfg, loaded: dict | None = None) -> list[dict]:
    """Every run of the sweep: ``{regime, label, seed, dir, overrides, level}``; the baselines as ``single_<task>``
    (in a regime with ``baselines_from``, the other regime's baseline runs stand in: not planned twice). ``loaded``:
    ``regime_configs``' regimes (default: every regime with ``cfg`` itself)."""
    b = bench_options(cfg)
    if loaded is None:
        loaded = {name: (spec, cfg) for name, spec in regimes(cfg).items()}
    runs = []
    for regime, (spec, rcfg) in loaded.items():
        types = run_method_types(rcfg)
        labels = list(spec["methods"])
        if b.baselines and spec["baselines_from"] is None:
            labels += [f"single_{t}" for t in rcfg.tasks]
        for label in labels:
            for seed in b.seeds:
                if label.startswith("single_"):
                    task = label.split("_", 1)[1]
                    level, over = "loss", [f"tasks=[{task}]", "weighting.method=equal",
                                           f"ddp.strategy={b.loss_strategy}", *plateau_baselines_of(rcfg, task)]
                else:
                    name, _, source = method_spec(label)
                    level = types[name].level
                    over = [*method_overrides(label), f"ddp.strategy={strategy_for(cfg, level, source)}"]
                    if types[name].needs_heldout_batch:
                        over.append(f"data.heldout={heldout_for(rcfg)}")
                out = os.path.join(cfg.output_dir, "runs", regime, run_folder(label), f"seed{seed}")
                runs.append({"regime": regime, "label": label, "seed": seed, "dir": out, "level": level,
                             "overrides": [*spec["overrides"], *over, f"seed={seed}", f"output_dir={out}",
                                           "trainer.progress=false", "resume=null"]})
    return runs


def plateau_baselines_of(rcfg, task: str) -> list[str]:
    """A single-task run's ``optim.plateau.baselines``: only its task's metrics (the config check refuses a baseline
    of a task the run does not have); none without the plateau schedule."""
    baselines = rcfg.optim.plateau.baselines
    if rcfg.optim.scheduler != "plateau" or not baselines:
        return []
    own = {key: baselines[key] for key, t, _ in metric_specs(rcfg) if t == task and key in baselines}
    return [f"optim.plateau.baselines={json.dumps(own)}"]


def train_script() -> str:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")
    return here if os.path.isfile(here) else "train.py"


def run_command(config: str, overrides: list[str], nproc: int) -> list[str]:
    if nproc > 1:
        return [sys.executable, "-m", "mtl.tools.launch", "--standalone", f"--nproc_per_node={nproc}", train_script(),
                "--config", config, *overrides]
    return [sys.executable, train_script(), "--config", config, *overrides]


def run_threads(cfg) -> int:
    b = bench_options(cfg)
    if b.threads > 0:
        return b.threads
    return max(1, (os.cpu_count() or 1) // (max(1, b.parallel) * max(1, b.nproc)))


def run_all(cfg, config_path: str, base_overrides: list[str], runs: list[dict], on_change: str = "retrain",
            train: bool = True) -> list[dict]:
    """Train the runs not finished before with the same training configuration and code (``record.run_identity``),
    ``bench.parallel`` at once, through ``bench.launcher``; record each one's status (and error) in ``runs.jsonl``. A
    finished run whose configuration or code changed is trained again (``on_change="retrain"``) or refused before
    anything trains (``"refuse"``: a ConfigError listing every such run and what changed). ``train=False`` (``--analyze``): train
    nothing; the runs not finished with this configuration are marked ``missing``."""
    total, pending, refused, nproc = len(runs), [], [], bench_options(cfg).nproc
    for i, r in enumerate(runs, 1):
        r["index"] = i
        head = f"[{i}/{total}] {r['regime']} {r['label']} seed {r['seed']}"
        r["config"], r["code"] = run_identity(config_path, [*base_overrides, *r["overrides"]], nproc)
        if os.path.isfile(os.path.join(r["dir"], "final_metrics.json")):
            problem = reuse_problem(r["dir"], r["config"], r["code"])
            if problem is None:
                print(f"{head}: finished before with this configuration, skipped", flush=True)
                r["status"] = "ok"
                continue
            if not train:
                print(f"{head}: not analysed: {problem}", flush=True)
            elif on_change == "refuse":
                refused.append(f"{head} ({r['dir']}): {problem}")
                continue
            else:
                print(f"{head}: finished before, but {problem}: training it again", flush=True)
        elif not train:
            print(f"{head}: not finished (yet)", flush=True)
        if not train:
            r["status"] = "missing"
            continue
        pending.append(r)
    if refused:
        raise ConfigError([f"--on-change refuse: {len(refused)} finished run(s) were trained with another "
                           "configuration or code (re-train them with --on-change retrain, or use another "
                           "output_dir):",
                           *refused])
    if pending:
        os.makedirs(cfg.output_dir, exist_ok=True)
        _drive(cfg, config_path, base_overrides, pending, total, os.path.join(cfg.output_dir, "runs.jsonl"))
    return runs


def launch_threads(cfg) -> int:
    """OMP_NUM_THREADS of each run's processes: ``bench.threads``; else for the local launcher this machine's CPUs
    shared by the runs at once, for Slurm the job's CPUs (``bench.slurm.cpus_per_run``) over its processes."""
    b = bench_options(cfg)
    if b.launcher == "slurm":
        return b.threads or max(1, int(b.slurm.cpus_per_run) // max(1, b.nproc))
    return run_threads(cfg)


def _drive(cfg, config_path, base_overrides, pending, total, status_path) -> None:
    b = bench_options(cfg)
    threads = launch_threads(cfg)
    launcher = make_launcher(cfg, {**os.environ, "OMP_NUM_THREADS": str(threads)}, threads)
    parallel, durations = max(1, b.parallel), []

    def begin(r):
        left = len(pending) + 1
        eta = statistics.mean(durations) * left / parallel if durations else None
        resume_from, how = earlier_attempt(r)
        print(f"[{r['index']}/{total}] {r['regime']} {r['label']} seed {r['seed']}: training ({launcher.name})"
              + (f", {how}" if how else "") + (f" (ETA for the sweep {eta / 60:.1f} min)" if eta else ""), flush=True)
        if resume_from is None and os.path.isdir(r["dir"]):
            shutil.rmtree(r["dir"])  # nothing to resume (or not this run's to resume): start it again from scratch
        os.makedirs(r["dir"], exist_ok=True)
        r["resume"] = resume_from is not None
        command = run_command(os.path.abspath(config_path), [*base_overrides, *r["overrides"]], b.nproc)
        if r["resume"]:  # the trainer's own resume: the newest complete checkpoint, bit for bit
            command = resuming(command)
        return command, lambda: write_record(r["dir"], r["config"], provenance(threads), r["code"])

    def finish(r, outcome):
        durations.append(r["wall_s"])
        if outcome is True:
            r["status"], r["error"] = "ok", None
        else:  # a failed run is recorded and the sweep goes on
            r["status"], r["error"] = "failed", outcome
            print(f"[{r['index']}/{total}] {r['regime']} {r['label']} seed {r['seed']}: FAILED: {r['error']}",
                  flush=True)
            with open(os.path.join(cfg.output_dir, "errors.log"), "a") as f:
                f.write(f"== {r['regime']} {r['label']} seed {r['seed']}\n{r['error']}\n")
        with open(status_path, "a") as f:
            f.write(json.dumps({k: r.get(k) for k in ("regime", "label", "seed", "status", "error", "wall_s")})
                    + "\n")

    drive(launcher, pending, parallel, begin, finish, report=Progress(parallel, durations))


def earlier_attempt(r: dict) -> tuple[str | None, str]:
    """What an unfinished earlier attempt of run ``r`` left in its folder (a sweep whose job was killed, a node lost,
    a Ctrl-C): ``(its newest complete checkpoint, how the run starts)`` when it trained with the configuration and
    code the run would train with now (its ``bench_run.json``, as a finished run is reused), so ``resume=auto``
    continues it bit for bit; else ``(None, why it starts from scratch)``: no checkpoint, a broken one, or one of
    another configuration or code (which the trainer's resume would refuse, or which is not this run). ``(None, "")``
    for a new run."""
    if not os.path.isdir(r["dir"]) or not os.listdir(r["dir"]):
        return None, ""
    finished = os.path.isfile(os.path.join(r["dir"], "final_metrics.json"))
    if finished:  # trained again because its configuration or code changed (run_all said so)
        return None, "from scratch (the finished run in its folder is replaced)"
    try:
        path, _ = find_resumable(r["dir"])
    except CheckpointError as e:
        return None, f"from scratch: an unfinished earlier attempt left only broken checkpoints ({e.message})"
    if path is None:
        return None, "from scratch: an unfinished earlier attempt left no complete checkpoint"
    problem = reuse_problem(r["dir"], r["config"], r["code"])
    if problem is not None:
        return None, f"from scratch: an unfinished earlier attempt has a checkpoint, but {problem}"
    step = int(read_trainer_state(path)["step"])
    return path, f"resuming an unfinished earlier attempt from its newest checkpoint, step {step} (resume=auto)"


# ------------------------------------------------------------------------------------------ analysis

def read_run(run_dir: str, last_k: int, specs: list) -> dict | None:
    """One finished run's numbers: per metric its validation curve ``val[key] = [(step, value)]``, its test values by
    step ``test[key]`` (empty without a test split) and the slope of its last ``last_k`` validation evaluations (per
    100 steps); step time, peak memory, the method's maths time, its ``bench_run.json`` record."""
    if not os.path.isfile(os.path.join(run_dir, "final_metrics.json")):
        return None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "final_metrics.json")) as f:
        final = json.load(f)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    t0 = rows[0]["time"] - train[0].get("step_time_s", 0.0) if rows and train else 0.0
    out = {"wall_s": final.get("wall_time_s"), "train": train, "evals": evals, "t0": t0,
           "step_time_s": statistics.median(r["step_time_s"] for r in train[1:] or train) if train else float("nan"),
           "peak_mem_mb": max((r.get("peak_mem_mb") or 0.0 for r in train), default=float("nan")),
           "steps": max((r["step"] for r in rows), default=0), "record": read_record(run_dir),
           "eval_steps": sorted({e["step"] for e in evals}), "val": {}, "test": {}}
    combine = [r["combine_s"] for r in train if r.get("combine_s") is not None]
    out["combine_s"] = statistics.median(combine) if combine else 0.0
    for key, _, _ in specs:
        points = sorted((e["step"], e[key]) for e in evals if e.get(key) is not None)
        if points:
            out["val"][key] = points
            out[key + "_slope"] = slope_per_100(points, last_k)
            out[key + "_window"] = window_change(points, last_k)[0]
        test = {e["step"]: e["test_" + key] for e in evals if e.get("test_" + key) is not None}
        if test:
            out["test"][key] = test
    return out


def select(d: dict, specs: list, ref: dict, how: str, split: str) -> None:
    """Fill the run's reported metrics ``d[key]`` and ``d["selected_step"]``: the evaluation chosen on validation
    (``how="best"``: the lowest validation Δm against ``ref``, each run over the metrics it has; ``"last"``: the
    last), its values read on ``split`` ("test" or "validation")."""
    steps = [s for s in d["eval_steps"] if all(dict(d["val"][k]).get(s) is not None for k in d["val"])]
    if not steps:
        return
    chosen = steps[-1]
    if how == "best":  # the lowest validation Δm; a tie goes to the later evaluation; nan (no reference): the last
        scores = {s: delta({k: dict(pts)[s] for k, pts in d["val"].items()}, ref, specs, partial=True) for s in steps}
        finite = [s for s in steps if scores[s] == scores[s]]
        if finite:
            chosen = min(finite, key=lambda s: (scores[s], -s))
    d["selected_step"] = chosen
    for key, pts in d["val"].items():
        d[key] = d["test"][key].get(chosen, float("nan")) if split == "test" else dict(pts)[chosen]


def allreduce_bytes(run_dir: str, strategy: str, num_tasks: int, method: type | None = None, every: int = 1) -> int:
    """Bytes each process all-reduces per step with two or more processes (from the model's sizes): the strategy's,
    plus a bilevel ``method``'s whole-model gradients (``meta_allreduces``) once in ``every`` steps."""
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        return 0
    shared = heads = 0
    with safe_open(os.path.join(ckpts[-1][1], "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = math.prod(f.get_slice(k).get_shape())
            if k.startswith("backbone."):
                shared += n
            elif not k.endswith("transformer.wte.weight"):  # tied to lm_head.weight: one parameter, counted once
                heads += n
    meta = method.meta_cost(num_tasks)["meta_allreduces"] * (shared + heads) * 4 // max(1, every) if method is not None else 0
    return strategy_types()[strategy].allreduce_bytes(num_tasks, shared, heads) + meta


def meta_cost_note(method: type, options: dict, heldout: int, num_tasks: int) -> str:
    """What a bilevel method's meta update costs, in words (empty for any other method)."""
    if not method.needs_heldout_batch:
        return ""
    c, every = method.meta_cost(num_tasks), int(options.get("update_every", 1))
    return (f"+{c['meta_forwards']} forwards and +{c['meta_backwards']} backward passes over the whole model, "
            f"{c['meta_allreduces']} whole-model gradient all-reduces and ~{c['meta_param_copies']} parameter-sized "
            f"vectors held, {'every step' if every == 1 else f'once every {every} steps'}; trains on all but the "
            f"{heldout} held-out items (data.heldout)")


def per_seed(runs: list[dict], last_k: int, specs: list) -> dict:
    """``{label: {seed: data or None}}`` of one regime's runs (data: ``read_run``; None for a failed run)."""
    out: dict = {}
    for r in runs:
        d = read_run(r["dir"], last_k, specs) if r.get("status") == "ok" else None
        if d is not None:
            d["delta_m"] = float("nan")
        out.setdefault(r["label"], {})[r["seed"]] = d
    return out


def report_split(datas: list[dict]) -> str:
    """"test" when every run evaluated a test split, else "validation"."""
    return "test" if datas and all(d["test"] for d in datas) else "validation"


def summarize(cfg, regime: str, spec: dict, rcfg, runs: list[dict], baseline_runs: list[dict]) -> tuple[list, dict]:
    """One regime's rows (one per method, then one per baseline) and its baselines ``{metric: mean}``."""
    b = bench_options(cfg)
    specs = metric_specs(rcfg)
    types = run_method_types(rcfg)
    status = {(r["label"], r["seed"]): r.get("status") for r in [*runs, *baseline_runs]}
    data = per_seed(runs, b.last_k, specs)
    bdata = per_seed(baseline_runs, b.last_k, specs)
    bruns = {key: [d for d in bdata.get(f"single_{task}", {}).values() if d] for key, task, _ in specs}
    # the scale the evaluations are selected on: the baselines' last validation values (mean over seeds)
    ref = {key: mean_ci(d["val"][key][-1][1] for d in bruns[key] if key in d["val"])[0] for key, _, _ in specs}
    every = [d for group in (data, bdata) for seeds in group.values() for d in seeds.values() if d]
    split = report_split(every)
    for d in every:
        select(d, specs, ref, b.select, split)
    base = {key: mean_ci(d.get(key) for d in bruns[key])[0] for key, _, _ in specs}
    given = reference_values(b, specs)[0]  # bench.reference: a second Δm, against single-task metrics from elsewhere
    for d in every:
        d["delta_m"] = delta(d, base, specs)
        if b.plateau_relative:  # the slope in % of the baseline per 100 steps (nan where the baseline is 0 or nan)
            for key, _, _ in specs:
                scale = 100 / abs(base[key]) if base[key] == base[key] and base[key] else float("nan")
                for suffix in ("_slope", "_window"):
                    if key + suffix in d:
                        d[key + suffix] *= scale
        d["delta_m_ref"] = delta(d, given, specs, partial=True) if given else float("nan")
    eq = data.get("equal", {})
    rows = []
    labels = list(spec["methods"]) + [f"single_{t}" for t in rcfg.tasks if f"single_{t}" in bdata]
    for label in labels:
        seeds = (bdata if label.startswith("single_") else data).get(label, {})
        ok = {s: d for s, d in seeds.items() if d}
        single = label.startswith("single_")
        name, options, source = ("equal", {}, "") if single else method_spec(label)
        level = "single-task" if single else types[name].level
        row = {"regime": regime, "method": label, "level": level, "source": source if level == "grad" else "",
               "runs_ok": len(ok), "runs": len(seeds),
               "failed": [f"seed {s}: {status.get((label, s)) or 'failed'}" for s, d in seeds.items() if not d]}
        keys = [k for k, _, _ in specs]
        for key in keys:
            row[key], row[key + "_ci"] = mean_ci(d.get(key) for d in ok.values())
            row[key + "_slope"], row[key + "_slope_ci"] = mean_ci(d.get(key + "_slope") for d in ok.values())
            row[key + "_window"], row[key + "_window_ci"] = mean_ci(d.get(key + "_window") for d in ok.values())
        row["plateau"], row["moving"] = converged(row, ok, specs, b.plateau_tol)
        row["delta_m"], row["delta_m_ci"] = mean_ci(d.get("delta_m") for d in ok.values())
        row["delta_m_ref"], row["delta_m_ref_ci"] = mean_ci(d.get("delta_m_ref") for d in ok.values())
        row["split"] = split
        row["selected_step"] = statistics.median(d["selected_step"] for d in ok.values() if "selected_step" in d) \
            if any("selected_step" in d for d in ok.values()) else float("nan")
        diffs = [ok[s]["delta_m"] - eq[s]["delta_m"] for s in ok if eq.get(s) and not single and label != "equal"]
        test = paired_test(diffs, b.alpha, b.test)
        row["vs_equal"], row["vs_equal_lo"], row["vs_equal_hi"], row["vs_equal_p"] = (
            test["mean"], test["lo"], test["hi"], test["p"])
        row["_diffs"] = diffs
        row["seeds_better"] = f"{sum(x < 0 for x in diffs)}/{len(diffs)}" if diffs and label != "equal" else ""
        for key in ("peak_mem_mb", "wall_s", "combine_s"):
            row[key], row[key + "_ci"] = mean_ci(d[key] for d in ok.values())
        # the median over seeds of each run's median step time: one run slowed by a busy machine does not count
        row["step_time_s"] = statistics.median(d["step_time_s"] for d in ok.values()) if ok else float("nan")
        strategy = b.loss_strategy if single else strategy_for(cfg, level, source)
        row["strategy"] = strategy
        first = next(iter(ok), None)
        row["allreduce_mb"] = (allreduce_bytes(_run_dir(baseline_runs if single else runs, label, first), strategy,
                                               1 if single else len(rcfg.tasks), types[name],
                                               int(options.get("update_every", 1))) / 2**20
                               if first is not None else float("nan"))
        row["meta_cost"] = meta_cost_note(types[name], options, heldout_for(rcfg), len(rcfg.tasks)) if not single else ""
        row["_seeds"] = ok
        rows.append(row)
    adjust(rows, "vs_equal", b.alpha)
    eqrow = next((r for r in rows if r["method"] == "equal"), None)
    for r in rows:
        r["time_vs_equal"] = r["step_time_s"] / eqrow["step_time_s"] if eqrow else float("nan")
        r["mem_vs_equal"] = r["peak_mem_mb"] / eqrow["peak_mem_mb"] if eqrow else float("nan")
    methods = [r for r in rows if r["level"] != "single-task"]
    for key, _, higher in specs:  # mean rank over the metrics (1 = best), methods only
        order = sorted((r for r in methods if r[key] == r[key]), key=lambda r: -r[key] if higher else r[key])
        for i, r in enumerate(order, 1):
            r.setdefault("_ranks", []).append(i)
    for r in rows:
        r["mean_rank"] = statistics.mean(r.pop("_ranks", [float("nan")]))
    return rows, base


def converged(row: dict, seeds: dict, specs: list, tol: float) -> tuple[bool | None, list[str]]:
    """(converged, the metrics still improving): a metric is still improving when its per-seed improvements over
    the window (``<key>_window`` with the sign that makes an improvement positive) show a mean improvement above
    ``tol`` at one-sided 95% (``stats.still_improving``); converged otherwise ("not shown to improve by more than
    tol"). None: not decided (fewer than two seeds, or fewer than two evaluations). Metrics the row does not have (a
    baseline's other task) do not count."""
    have = [(k, higher) for k, _, higher in specs if row[k] == row[k]]
    verdicts = {k: still_improving([(1 if higher else -1) * d[k + "_window"] for d in seeds.values()
                                    if d.get(k + "_window") is not None], tol) for k, higher in have}
    if not have or any(v is None for v in verdicts.values()):
        return None, []
    moving = [k for k, v in verdicts.items() if v]
    return not moving, moving


def adjust(rows: list[dict], key: str, alpha: float) -> None:
    """Holm's correction across the rows of one table: ``<key>_p_holm`` and the mark ``<key>_sig`` of each row
    (rows without a test, e.g. equal itself and the baselines, get nan and no mark)."""
    for r, p in zip(rows, holm([r.get(key + "_p", float("nan")) for r in rows])):
        r[key + "_p_holm"] = p
        r[key + "_sig"] = mark(r[key], p, alpha)


def detectable(rows: list[dict], alpha: float) -> dict:
    """What one table's seeds can detect: from the pooled spread of its paired differences (``_diffs``), the
    smallest true difference the paired t-test finds with 80% power, at ``alpha`` and at Holm's strictest level
    ``alpha / m`` (m: the methods tested)."""
    groups = [r["_diffs"] for r in rows if len(r.get("_diffs") or []) >= 3]
    sd, n = pooled_sd(groups)
    m = max(1, len(groups))
    return {"sd": sd, "n": n, "m": m, "mde": min_detectable(sd, n, alpha), "mde_holm": min_detectable(sd, n, alpha / m)}


def _run_dir(runs: list[dict], label: str, seed) -> str:
    return next(r["dir"] for r in runs if r["label"] == label and r["seed"] == seed)


def _trained_steps(seeds: dict) -> int:
    """The steps a method's runs trained (the longest over its seeds)."""
    return max((d.get("steps", 0) for d in seeds.values()), default=0)


def regime_effects(cfg, all_rows: dict[str, list]) -> list[dict]:
    """For each regime after the first and each method in both: its delta-m there minus its delta-m in the first
    regime, seed by seed (the paired t-test): did the regime change what the method reaches? Where the method's runs
    trained a different number of steps in the two regimes (e.g. a short regime read for its cost only), the
    difference measures the training length, not the regime: it is given without a test or a mark (``untested``:
    the two lengths) and does not count in Holm's m."""
    alpha = bench_options(cfg).alpha
    names = list(all_rows)
    if len(names) < 2:
        return []
    ref = {r["method"]: r for r in all_rows[names[0]] if r["level"] != "single-task"}
    out = []
    for name in names[1:]:
        for r in all_rows[name]:
            if r["level"] == "single-task" or r["method"] not in ref:
                continue
            a, b = ref[r["method"]]["_seeds"], r["_seeds"]
            diffs = [b[s]["delta_m"] - a[s]["delta_m"] for s in b if s in a]
            lengths = (_trained_steps(a), _trained_steps(b))
            if lengths[0] != lengths[1]:  # a change of training length, not of the regime: no test, no mark
                nan = float("nan")
                out.append({"regime": name, "reference": names[0], "method": r["method"],
                            "delta_m_ref": ref[r["method"]]["delta_m"], "delta_m": r["delta_m"],
                            "change": statistics.mean(diffs) if diffs else nan, "change_lo": nan, "change_hi": nan,
                            "change_p": nan, "_diffs": [], "untested": lengths})
                continue
            t = paired_test(diffs, alpha, bench_options(cfg).test)
            out.append({"regime": name, "reference": names[0], "method": r["method"],
                        "delta_m_ref": ref[r["method"]]["delta_m"], "delta_m": r["delta_m"], "change": t["mean"],
                        "change_lo": t["lo"], "change_hi": t["hi"], "change_p": t["p"], "_diffs": diffs})
    for name in names[1:]:  # Holm across the methods of each regime's comparison
        adjust([e for e in out if e["regime"] == name], "change", alpha)
    return out


# ------------------------------------------------------------------------------------------ tables

def _pm(v: float, ci: float, digits: int = 3) -> str:
    if v != v:
        return "n/a"
    return f"{v:.{digits}f}" + (f" ± {ci:.{digits}f}" if ci == ci else "")


def _interval(mean: float, lo: float, hi: float, sig: int, p: float, digits: int = 2) -> str:
    """``mean [lo, hi] mark (p_Holm)``: the mark only where the Holm-adjusted p is below the table's alpha."""
    if mean != mean:
        return ""
    if lo != lo:
        return f"{mean:+.{digits}f} (too few seeds for a test)"
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] {MARK[sig]} (p_Holm {p:.3f})".replace("  ", " ")


def quality_sentence(cfg, rows: list[dict]) -> str:
    """How each run's reported evaluation was chosen and on which split it is read."""
    split = next((r["split"] for r in rows if r.get("split")), "validation")
    how = ("the evaluation with the best (lowest) validation Δm (bench.select=best; a run's Δm on validation against "
           "the baselines' last validation values)" if bench_options(cfg).select == "best" else
           "the last evaluation (bench.select=last)")
    where = ("read on the held-out test split, which nothing selected on" if split == "test" else
             "read on the same validation split it was chosen on (the runs have no test split: set "
             "data.synthetic.test_size or data.test_path), so it is optimistic")
    return f"Quality: per run {how}, {where}."


def eval_window(rows: list[dict], last_k: int) -> tuple[int, list[int]]:
    """(the evaluations the slope is read over, their steps): ``last_k``, or fewer where the runs have fewer."""
    steps = [d["eval_steps"] for r in rows for d in r["_seeds"].values() if d.get("eval_steps")]
    if not steps:
        return 0, []
    shortest = min(steps, key=len)
    return min(last_k, len(shortest)), shortest[-last_k:]


def regime_table(cfg, rcfg, regime: str, spec: dict, rows: list[dict], base: dict, shares_baselines: str | None) -> str:
    b = bench_options(cfg)
    specs = metric_specs(rcfg)
    keys = [k for k, _, _ in specs]
    has_ref = bool(b.reference.metrics)
    methods = [r for r in rows if r["level"] != "single-task"]
    lines = [f"### Regime `{regime}`" + (f" (overrides: `{' '.join(spec['overrides'])}`)" if spec["overrides"] else ""),
             "", detectable_lead(cfg, methods) + (" The \"vs equal\" column is exploratory: the pre-registered "
                                                  "comparisons are the table above." if b.comparisons else ""), ""]
    if spec["expect"]:
        lines += [f"Expected (stated before the run): {spec['expect'].strip()}", ""]
    tasks = list(dict.fromkeys(t for _, t, _ in specs))
    per_task = "; ".join(f"{t}: {', '.join(k for k, tt, _ in specs if tt == t)}" for t in tasks)
    lines += [f"Mean ± 95% t-interval over seeds {list(b.seeds)}. {quality_sentence(cfg, rows)} Δm %: lower "
              f"is better (as Nash-MTL and FAMO report it); per task the mean relative change of its metrics against "
              f"the single-task baseline ({per_task}), then the mean over the {len(tasks)} tasks, so each task weighs "
              "the same. Single-task baselines"
              + (f" (from regime `{shares_baselines}`)" if shares_baselines else "") + ": "
              + ", ".join(f"{k} {base[k]:.3f}" for k in keys) + ". " + reference_sentence(b, specs, rows)
              + test_sentence(cfg, methods) + " Peak memory: "
              "the run's own process (peak RSS on the CPU, max allocated on a GPU).", "",
              *provenance_lines([d.get("record") for r in rows for d in r["_seeds"].values()]), "",
              "| method | level | source | " + " | ".join(keys) + " | Δm % (lower is better) "
              + ("| Δm % vs reference " if has_ref else "") + "| vs equal (Δm) "
              "| seeds better | mean rank | step time vs equal | peak mem MB (vs equal) | method maths (ms) "
              "| MB all-reduced/step | wall (s) |",
              "|---|---|---|" + "---|" * (len(keys) + has_ref) + "---|---|---|---|---|---|---|---|---|"]
    for r in sorted(methods, key=lambda r: (r["delta_m"] != r["delta_m"], r["delta_m"] if r["delta_m"] == r["delta_m"]
                                            else 0)):
        failed = _not_ok_note(r)
        if not r["runs_ok"]:
            lines.append(f"| `{r['method']}`{failed} | {r['level']} | {r['source']} | "
                         + " | ".join("n/a" for _ in range(len(keys) + 9 + has_ref)) + " |")
            continue
        mem = "n/a" if r["peak_mem_mb"] != r["peak_mem_mb"] else f"{r['peak_mem_mb']:.0f} ({r['mem_vs_equal']:.2f}x)"
        lines.append(
            f"| `{r['method']}`{failed} | {r['level']} | {r['source']} | "
            + " | ".join(_pm(r[k], r[k + "_ci"]) for k in keys)
            + f" | {_pm(r['delta_m'], r['delta_m_ci'], 2)} "
            + (f"| {_pm(r['delta_m_ref'], r['delta_m_ref_ci'], 2)} " if has_ref else "")
            + f"| {_interval(r['vs_equal'], r['vs_equal_lo'], r['vs_equal_hi'], r['vs_equal_sig'], r['vs_equal_p_holm'])} "
            f"| {r['seeds_better']} | {r['mean_rank']:.1f} "
            f"| {r['time_vs_equal']:.2f}x | {mem} | {r['combine_s'] * 1e3:.2f} | {r['allreduce_mb']:.1f} "
            f"| {r['wall_s']:.0f} |")
    window, steps = eval_window(rows, b.last_k)
    unit = " %" if b.plateau_relative else ""
    lines += ["", f"Convergence in `{regime}`: the change of each validation metric over the last {window} evaluations"
              + (f" (steps {', '.join(map(str, steps))})" if steps else "") + " (its least-squares slope times the "
              f"window's span; mean ± 95% t-interval over seeds{'; in % of the single-task baseline' if b.plateau_relative else ''}"
              f"; negative: falling). Still improving: the one-sided 95% lower bound over seeds of the improvement "
              f"over the window exceeds {b.plateau_tol:g}{unit}; converged otherwise, i.e. not shown to improve by "
              f"more than {b.plateau_tol:g}{unit} (with this spread and these seeds, not shown flat). The selected "
              "evaluation's step is the median over seeds. \"no\" lists the metrics still improving.",
              "", "| run | steps | selected step | "
              + " | ".join(f"{k} change{unit} over the window" for k in keys)
              + " | converged |", "|---|---|---|" + "---|" * len(keys) + "---|"]
    for r in rows:
        if not r["runs_ok"]:
            continue  # listed under the failed runs
        steps_run = max((d["steps"] for d in r["_seeds"].values()), default=0)
        verdict = ("not decided (one seed or one evaluation)" if r["plateau"] is None else "yes" if r["plateau"]
                   else "no: " + ", ".join(r["moving"]))
        sel = "" if r["selected_step"] != r["selected_step"] else f"{r['selected_step']:.0f}"
        lines.append(f"| `{r['method']}` | {steps_run} | {sel} | "
                     + " | ".join(_pm(r[k + "_window"], r[k + "_window_ci"], 3) if k in base and r[k] == r[k] else "—"
                                  for k in keys)
                     + f" | {verdict} |")
    notes = [f"- `{r['method']}`: {r['meta_cost']}" for r in methods if r.get("meta_cost")]
    if notes:
        lines += ["", "Bilevel methods: what each meta update adds to a step (declared by the class, "
                      "``Weighting.meta_cost``; the step time and memory above are measured):", *notes]
    failures = [f"- `{r['method']}` {x}" for r in rows for x in r["failed"]]
    if failures:
        lines += ["", "Failed or missing runs (the errors: runs.jsonl, errors.log; missing: not finished with this "
                      "configuration when analysed):", *failures]
    return "\n".join(lines)


def _not_ok_note(row: dict) -> str:
    """" (1 of 3 failed)", " (3 of 3 missing)", " (1 of 3 failed, 1 missing)" or "": a row's runs without results."""
    missing = sum(x.endswith(": missing") for x in row["failed"])
    failed = row["runs"] - row["runs_ok"] - missing
    parts = [f"{failed} failed"] * bool(failed) + [f"{missing} missing"] * bool(missing)
    if not parts:
        return ""
    return f" ({parts[0].split()[0]} of {row['runs']} {parts[0].split()[1]}" + "".join(f", {p}" for p in parts[1:]) + ")"


def reference_sentence(b, specs: list, rows: list[dict]) -> str:
    """With ``bench.reference``: its values, and each of our single-task runs' Δm against them (its own task's);
    empty without one."""
    given = reference_values(b, specs)[0]
    if not given:
        return ""
    singles = ", ".join(f"{r['method']} {_pm(r['delta_m_ref'], r['delta_m_ref_ci'], 2)}" for r in rows
                        if r["level"] == "single-task")
    return (f"Δm % vs reference: the same Δm against the single-task metrics of {b.reference.source or 'bench.reference'} "
            f"(" + ", ".join(f"{k} {v:g}" for k, v in given.items()) + "); our single-task runs against them: "
            + (singles or "none") + ". ")


def detectable_lead(cfg, rows: list[dict]) -> str:
    """The line that opens a table: the smallest difference its seeds detect with 80% power at Holm's strictest
    level (``detectable``)."""
    a, d = bench_options(cfg).alpha, detectable(rows, bench_options(cfg).alpha)
    if d["mde_holm"] != d["mde_holm"]:
        return "**Detectable here: not said (fewer than 3 seeds).**"
    return (f"**Detectable here (80% power at Holm's level α/{d['m']} = {a / d['m']:.4g}): {d['mde_holm']:.2f} Δm "
            f"points** (paired spread sd {d['sd']:.2f} over {d['n']} seeds).")


def test_sentence(cfg, rows: list[dict], what: str = "vs equal: Δm − Δm(equal) on the same seed") -> str:
    """How one table's marks are made and what its seeds can detect (``detectable``)."""
    b = bench_options(cfg)
    a, d = b.alpha, detectable(rows, b.alpha)
    test = "paired t-test" if b.test == "t" else "exact sign-flip permutation test"
    text = (f"{what}: mean [{100 * (1 - a):g}% t-interval], two-sided {test} over seeds; ▲ / ▼ where Holm's "
            f"adjusted p (p_Holm, across the {d['m']} comparison{'s' if d['m'] != 1 else ''} of this table) is below "
            f"{a:g}: ▼ a lower Δm "
            "(better), ▲ a higher one (worse); the chance of any false mark is at most "
            f"{a:g} when the per-seed differences are about normal (not for skewed ones: docs/benchmark.md).")
    if d["mde"] == d["mde"]:
        return text + (f" Detectable here (80% power, paired spread sd {d['sd']:.2f} over {d['n']} seeds): a "
                       f"difference of {d['mde']:.2f} at α = {a:g}, {d['mde_holm']:.2f} at Holm's strictest level "
                       f"α/{d['m']}; no mark means not detectable by this design, not equal.")
    return text + " Too few seeds (fewer than 3) to test or to say what is detectable."


def effects_table(cfg, effects: list[dict]) -> str:
    if not effects:
        return ""
    tested = [e for e in effects if not e.get("untested")]
    what = "Each method's Δm in a regime minus its Δm in the reference regime, on the same seeds"
    sentence = test_sentence(cfg, tested, what) if tested else what + "."
    if len(tested) < len(effects):
        sentence += (" Not tested where the method's runs trained a different number of steps in the two regimes: "
                     "the difference is then the training length's, not the regime's.")
    lines = ["### Between regimes", "", detectable_lead(cfg, tested), "", sentence, "",
             "| regime | method | Δm % in reference | Δm % in regime | change |", "|---|---|---|---|---|"]
    for e in effects:
        if e.get("untested"):
            ref_steps, steps = e["untested"]
            change = (f"{e['change']:+.2f} (not tested: {steps} steps against {ref_steps})" if e["change"] == e["change"]
                      else f"not tested: {steps} steps against {ref_steps}")
        else:
            change = _interval(e["change"], e["change_lo"], e["change_hi"], e["change_sig"], e["change_p_holm"])
        lines.append(f"| `{e['regime']}` vs `{e['reference']}` | `{e['method']}` | {e['delta_m_ref']:.2f} "
                     f"| {e['delta_m']:.2f} | {change} |")
    return "\n".join(lines)


CSV_FIXED = ["regime", "method", "level", "source", "strategy", "runs_ok", "runs"]
CSV_TAIL = ["split", "selected_step", "delta_m", "delta_m_ci", "delta_m_ref", "delta_m_ref_ci",
            "vs_equal", "vs_equal_lo", "vs_equal_hi", "vs_equal_p",
            "vs_equal_p_holm", "vs_equal_sig", "seeds_better", "mean_rank", "plateau", "time_vs_equal", "mem_vs_equal",
            "combine_s", "allreduce_mb", "step_time_s", "peak_mem_mb", "wall_s"]


def write_results(cfg, per_regime: dict, meta: dict) -> str:
    """results.md, results.csv (one row per regime and method or baseline) and runs.csv (one per run)."""
    out = cfg.output_dir
    all_keys = list(dict.fromkeys(k for rcfg, rows, _ in per_regime.values() for k, _, _ in metric_specs(rcfg)))
    fields = CSV_FIXED + [k + s for k in all_keys for s in ("", "_ci", "_slope", "_slope_ci", "_window",
                                                          "_window_ci")] + CSV_TAIL
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for _, rows, _ in per_regime.values():
            for r in rows:
                w.writerow(r)
    run_fields = ["regime", "method", "seed", "selected_step", "delta_m", "delta_m_ref", "steps", "step_time_s",
                  "peak_mem_mb", "combine_s", "wall_s"] + [k + s for k in all_keys for s in ("", "_slope", "_window")]
    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=run_fields, extrasaction="ignore")
        w.writeheader()
        for regime, method, seed, d in finished_runs(per_regime, meta["regimes"]):
            w.writerow({**d, "regime": regime, "method": method, "seed": seed})
    opts = bench_options(cfg)
    blocks = [f"Protocol: {opts.protocol.strip()}"] if opts.protocol.strip() else []
    for regime, (rcfg, rows, base) in per_regime.items():
        spec = meta["regimes"][regime]
        first = regime == next(iter(per_regime))  # the published table is read beside the first regime only
        if first and opts.comparisons:  # the pre-registered comparisons lead: they are what the design is for
            blocks.append(comparisons_table(cfg, regime, rows))
        blocks.append(regime_table(cfg, rcfg, regime, spec, rows, base, spec["baselines_from"]))
        blocks += [t for t in (published_table(opts, regime, rows) if first else "",
                               cost_table(regime, rows, len(rcfg.tasks))) if t]
    effects = regime_effects(cfg, {k: v[1] for k, v in per_regime.items()})
    if effects:
        blocks.append(effects_table(cfg, effects))
    f_ms, b_ms = meta.get("forward_s", float("nan")) * 1e3, meta.get("backward_s", float("nan")) * 1e3
    if f_ms == f_ms:
        blocks.append(f"Measured F = {f_ms:.0f} ms, B = {b_ms:.0f} ms (one process, the bench model), so "
                      f"(F + 2B) / (F + B) = {(f_ms + 2 * b_ms) / (f_ms + b_ms):.2f}: the step-time goal for "
                      "gradient-level methods with source=parameters, before their own maths.")
    text = "\n\n".join(blocks)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def finished_runs(per_regime: dict, regime_specs: dict) -> list[tuple[str, str, int, dict]]:
    """(regime, method, seed, its data) of every finished run, from the rows ``summarize`` read them into, once each:
    a baseline borrowed from another regime (baselines_from) is that regime's run."""
    out, seen = [], set()
    for regime, (_, rows, _) in per_regime.items():
        for r in rows:
            home = (regime_specs[regime].get("baselines_from") or regime) if r["level"] == "single-task" else regime
            for seed, d in r["_seeds"].items():
                if (home, r["method"], seed) not in seen:
                    seen.add((home, r["method"], seed))
                    out.append((home, r["method"], seed, d))
    return out


def write_hparams(cfg, per_regime: dict, regime_specs: dict) -> None:
    """The TensorBoard hparams view (``tb/``): one entry per finished run, from ``summarize``'s rows."""
    writer = tensorboard.SummaryWriter(os.path.join(cfg.output_dir, "tb"))
    for regime, method, seed, d in finished_runs(per_regime, regime_specs):
        metrics = {f"hparam/{k}": d[k] for k, _, _ in metric_specs(per_regime[regime][0]) if k in d}
        metrics["hparam/delta_m"] = d["delta_m"]  # lower is better, as in the tables
        metrics["hparam/step_time_s"] = d["step_time_s"]
        metrics["hparam/peak_mem_mb"] = d["peak_mem_mb"]
        writer.add_hparams({"regime": regime, "method": method, "seed": seed}, metrics,
                           run_name=f"{regime}-{method}-seed{seed}")
    writer.close()


def describe_plan(runs: list[dict]) -> str:
    """How many runs of which kind, per regime (``--plan``): what a sweep estimate multiplies."""
    counts: dict = {}
    for r in runs:
        kind = "single-task" if r["label"].startswith("single_") else r["level"]
        if "weighting.source=features" in r["overrides"]:
            kind = "grad (source=features)"
        counts.setdefault(r["regime"], {}).setdefault(kind, 0)
        counts[r["regime"]][kind] += 1
    lines = [f"{len(runs)} runs"]
    for regime, kinds in counts.items():
        lines.append(f"  {regime}: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    return "\n".join(lines)


def _flat(node, prefix: str = "") -> list[str]:
    """``key=value`` for every leaf of a (nested) mapping."""
    out = []
    for k, v in (node or {}).items():
        if isinstance(v, dict) and v:
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True, width=1_000).strip().removesuffix('...').strip()}")
    return out


def describe_protocol(cfg, loaded: dict) -> str:
    """The protocol the runs follow, read from the config (``--plan``): the tasks and the metrics Δm takes, the data
    and its splits, the batch, the optimizer and schedule, the steps and evaluations, the selection and the split
    reported, the seeds, and what Δm and the published table are read against. ``bench.protocol`` (the protocol in
    words) comes first when given; the lines below are what runs."""
    b = bench_options(cfg)
    rcfg = next(iter(loaded.values()))[1] if loaded else cfg
    c = OmegaConf.to_container(rcfg, resolve=True)
    specs = metric_specs(rcfg)
    data = c["data"]
    source_section = data.get(data["source"]) if isinstance(data.get(data["source"]), dict) else None
    lines = ["protocol (from the config; the runs use exactly this):"]
    if b.protocol.strip():
        lines.append(f"  in words: {b.protocol.strip()}")
    lines += [f"  tasks (K = {len(c['tasks'])}): {', '.join(c['tasks'])}; Δm over "
              + ", ".join(f"{k} ({'higher' if h else 'lower'} is better)" for k, _, h in specs),
              f"  data: source={data['source']}" + (f" {' '.join(_flat(source_section))}" if source_section else "")
              + f"; batch {data['batch_size']} per process x {b.nproc} process(es) = {data['batch_size'] * b.nproc}",
              f"  model: {' '.join(_flat(c['model']['backbone']))}",
              f"  optimizer: {' '.join(_flat(c['optim']))}",
              f"  trainer: {' '.join(_flat({k: v for k, v in c['trainer'].items() if k not in ('progress', 'poison')}))}",
              f"  selection: bench.select={b.select} ("
              + ("the evaluation with the best validation Δm against our single-task runs" if b.select == "best"
                 else "the last evaluation") + "), its metrics read on the test split when the runs evaluate one",
              f"  seeds: {list(b.seeds)}; single-task baselines: "
              + (", ".join(f"single_{t}" for t in c["tasks"]) if b.baselines else "none (bench.baselines=false)")]
    given, _ = reference_values(b, specs)
    if given:
        lines.append(f"  Δm also against {b.reference.source or 'bench.reference'}: "
                     + ", ".join(f"{k} {v:g}" for k, v in given.items()))
    if b.published.dm:
        lines.append(f"  read beside {b.published.source or 'bench.published'}: "
                     + ", ".join(f"{name} {dm:g} (ours: {entry or 'not in mtl'})"
                                 for name, dm, entry in published_entries(b)))
    return "\n".join(lines)


def list_runs(runs: list[dict]) -> str:
    """Every planned run (``--plan``), one line each: its regime, label, seed, folder and the overrides it trains
    with beyond the config (the seed and the folder aside)."""
    lines = []
    for i, r in enumerate(runs, 1):
        over = [o for o in r["overrides"] if not o.startswith(("seed=", "output_dir=", "trainer.progress=", "resume="))]
        lines.append(f"[{i}/{len(runs)}] {r['regime']} {r['label']} seed {r['seed']}: {r['dir']}  {' '.join(over)}")
    return "\n".join(lines)


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
    report = examine(first_cfg, batches=1) if bench_options(cfg).launcher == "local" else {}
    regime_specs = {k: v[0] for k, v in loaded.items()}
    text = write_results(cfg, per_regime, {"forward_s": report.get("forward_s", float("nan")),
                                           "backward_s": report.get("backward_s", float("nan")),
                                           "regimes": regime_specs})
    write_hparams(cfg, per_regime, regime_specs)
    print(text)
    print(f"\nbench: {len(runs)} runs, {time.time() - tic:.0f} s this invocation; results in {cfg.output_dir}")


if __name__ == "__main__":
    sys.exit(main())
