"""The sweep's runs: each planned run trained in its own process (``train.py``, or torchrun with ``bench.nproc`` > 1),
``bench.parallel`` at once through ``bench.launcher`` (mtl/bench/launch.py), unless it finished before with the same
training configuration and code (mtl/bench/record.py); an unfinished earlier attempt resumes from its newest complete
checkpoint. Each run's status goes to ``runs.jsonl``, a failure's error to ``errors.log``."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys

from omegaconf import OmegaConf

from mtl.bench.launch import AT_CAP, drive, make_launcher, resuming
from mtl.bench.options import bench_options
from mtl.bench.progress import Progress
from mtl.bench.record import provenance, reuse_problem, run_identity, write_record
from mtl.checkpoint.folder import find_resumable, read_trainer_state
from mtl.errors import CheckpointError, ConfigError


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
        prepare_sweep_store(cfg)
        _drive(cfg, config_path, base_overrides, pending, total, os.path.join(cfg.output_dir, "runs.jsonl"))
    return runs


def sweep_group(cfg) -> list[str]:
    """The overrides that group a sweep's runs in the trackers: ``logging.group`` (wandb's group, mlflow's experiment),
    the sweep's folder name unless the config names a group; and, where mlflow logs to a local store (no
    MLFLOW_TRACKING_URI, no ``logging.mlflow_dir`` of the config's own), ``logging.mlflow_dir``: the sweep's folder, so
    that every run is in one store (``prepare_sweep_store`` makes it first). Not part of a run's identity
    (record.NOT_TRAINING)."""
    out = []
    if not OmegaConf.select(cfg, "logging.group", default=None):
        out.append(f"logging.group={json.dumps(_sweep_name(cfg))}")
    if _sweep_store(cfg):
        out.append(f"logging.mlflow_dir={json.dumps(os.path.abspath(cfg.output_dir))}")
    return out


def _sweep_name(cfg) -> str:
    return OmegaConf.select(cfg, "logging.group", default=None) or os.path.basename(os.path.abspath(cfg.output_dir))


def _sweep_store(cfg) -> bool:
    return ("mlflow" in (OmegaConf.select(cfg, "logging.trackers", default=None) or [])
            and not os.environ.get("MLFLOW_TRACKING_URI") and not OmegaConf.select(cfg, "logging.mlflow_dir", default=None))


def prepare_sweep_store(cfg) -> None:
    """The sweep's local MLflow store and its experiment, made once before runs write to it at once."""
    if _sweep_store(cfg):
        from mtl.run.trackers import prepare_mlflow_store  # import here: mlflow, only for a sweep that logs to it

        prepare_mlflow_store(os.path.abspath(cfg.output_dir), _sweep_name(cfg))


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
        command = run_command(os.path.abspath(config_path), [*base_overrides, *r["overrides"], *sweep_group(cfg)], b.nproc)
        if r["resume"]:  # the trainer's own resume: the newest complete checkpoint, bit for bit
            command = resuming(command)
        return command, lambda: write_record(r["dir"], r["config"], provenance(threads), r["code"])

    def finish(r, outcome):
        durations.append(r["wall_s"])
        if outcome is True:
            r["status"], r["error"] = "ok", None
        elif outcome.startswith(AT_CAP):  # not failed: the next bench invocation resumes it (earlier_attempt)
            r["status"], r["error"] = "unfinished", outcome
            unfinished.append(f"{r['regime']} {r['label']} seed {r['seed']}")
            print(f"[{r['index']}/{total}] {r['regime']} {r['label']} seed {r['seed']}: UNFINISHED: {outcome}",
                  flush=True)
        else:  # a failed run is recorded and the sweep goes on
            r["status"], r["error"] = "failed", outcome
            print(f"[{r['index']}/{total}] {r['regime']} {r['label']} seed {r['seed']}: FAILED: {r['error']}",
                  flush=True)
            with open(os.path.join(cfg.output_dir, "errors.log"), "a") as f:
                f.write(f"== {r['regime']} {r['label']} seed {r['seed']}\n{r['error']}\n")
        with open(status_path, "a") as f:
            f.write(json.dumps({k: r.get(k) for k in ("regime", "label", "seed", "status", "error", "wall_s")})
                    + "\n")

    unfinished: list[str] = []
    drive(launcher, pending, parallel, begin, finish, report=Progress(parallel, durations))
    if unfinished:
        print(f"bench: {len(unfinished)} run(s) {AT_CAP} of time-limit requeues, each resubmitted from its newest "
              f"checkpoint by the next bench invocation: {'; '.join(unfinished)}", flush=True)


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
