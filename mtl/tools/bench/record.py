"""What each benchmark run was trained with and where: its training configuration (and that configuration's hash) and
its provenance (commit, package versions, hardware), kept in the run's folder as ``bench_run.json``.

A re-run of the sweep reuses a finished run only when the hash of the configuration it would train now equals the
recorded one; the tables print the provenance of their runs and say so when runs of one table differ in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys

import numpy
import torch
from omegaconf import OmegaConf

from mtl.config.schema import load_config_collecting

RECORD = "bench_run.json"
# keys of the run config that cannot change what a run trains: where it writes, and the benchmark's own section (every
# bench.* key that reaches training does so through the run's overrides: methods, strategies, heldout, regimes;
# bench.nproc is added back as "nproc")
NOT_TRAINING = ("output_dir", "bench")


def training_config(config_path: str, overrides: list[str], nproc: int) -> dict:
    """The resolved configuration a run trains with (``config_path`` + ``overrides``), without ``NOT_TRAINING``, plus
    the number of processes per run (it changes the global batch). Not checked: a run whose configuration its own
    checks refuse (``static`` without weights) fails as a run, recorded, and the sweep goes on."""
    cfg = OmegaConf.to_container(load_config_collecting(config_path, overrides, []), resolve=True)
    for key in NOT_TRAINING:
        cfg.pop(key, None)
    cfg["nproc"] = int(nproc)
    return cfg


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configurations (``optim.lr: 0.003 -> 0.5``)."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, name = old.get(key, "<absent>"), new.get(key, "<absent>"), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a} -> {b}")
    return out


def _git(*args: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(threads: int | None = None) -> dict:
    """Where a run is trained: the commit (with ``+dirty`` for uncommitted changes to tracked files; ``unknown``
    outside a git checkout), the versions of python, torch and numpy, and the hardware (CPU model and count, the
    GPUs torch sees), plus ``OMP_NUM_THREADS`` of the run."""
    commit = _git("rev-parse", "--short=10", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"commit": commit or "unknown",
            "versions": f"python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}",
            "hardware": f"{_cpu_model()} x {os.cpu_count()} CPUs" + (f", {len(gpus)} x {gpus[0]}" if gpus else ""),
            "host": platform.node(), "threads": threads if threads is not None else os.environ.get("OMP_NUM_THREADS")}


def write_record(run_dir: str, config: dict, prov: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, RECORD), "w") as f:
        json.dump({"config_hash": config_hash(config), "config": config, "provenance": prov, "argv": sys.argv}, f,
                  indent=1, default=str)


def read_record(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def reuse_problem(run_dir: str, config: dict) -> str | None:
    """None when the finished run in ``run_dir`` was trained with ``config``; else why it cannot be reused."""
    rec = read_record(run_dir)
    if rec is None or "config_hash" not in rec:
        return f"no {RECORD} (its configuration is unknown)"
    if rec["config_hash"] == config_hash(config):
        return None
    keys = changed_keys(rec.get("config") or {}, config)
    return "its configuration changed: " + ("; ".join(keys[:6]) + (f"; +{len(keys) - 6} more" if len(keys) > 6 else "")
                                            if keys else "hash differs")


PROVENANCE_KEYS = ("commit", "versions", "hardware", "threads")


def provenance_lines(records: list[dict | None]) -> list[str]:
    """The provenance of one table's runs, one line when they share it; when they do not, a warning and one line per
    distinct provenance with its run count (``None``: a run without a record)."""
    groups: dict = {}
    for rec in records:
        p = (rec or {}).get("provenance") or {}
        key = tuple(str(p.get(k, "unknown")) for k in PROVENANCE_KEYS)
        groups[key] = groups.get(key, 0) + 1

    def text(key):
        if key == ("unknown",) * len(PROVENANCE_KEYS):
            return f"not recorded (no {RECORD})"
        commit, versions, hardware, threads = key
        return f"commit {commit}; {versions}; {hardware}; {threads} threads per process"

    if len(groups) <= 1:
        return [f"Runs: {text(k)}." for k in groups]
    differ = [name for i, name in enumerate(PROVENANCE_KEYS) if len({k[i] for k in groups}) > 1]
    return [f"**Mixed runs**: this table's runs differ in {', '.join(differ)}; step times and memory are compared "
            "across them, and quality may differ by version:",
            *(f"- {n} runs: {text(k)}" for k, n in groups.items())]
