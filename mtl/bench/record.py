"""What each benchmark run was trained with and where: its training configuration (and that configuration's hash),
its code (``code_files``: the SHA-256 of each file of its weighting method, strategy, backbone and tasks, built-in or
plug-in, with their base classes) and its provenance (mtl's version, the commit with ``+dirty``, package versions,
hardware), kept in the run's folder as ``bench_run.json``.

A re-run of the sweep reuses a finished run only when the configuration it would train now and the hashes of those
code files equal the recorded ones. The commit is provenance only: a new commit that leaves the run's code files as
they were does not invalidate it, and a change elsewhere in the package (the trainer, the data code) is not seen
here. A record written before code hashes were recorded cannot say what code trained it: it counts as changed. The
tables print the provenance of their runs and say so when runs of one table differ in it.
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

import mtl
from mtl.config.schema import load_config_collecting
from mtl.files import sha256_file
from mtl.models.backbones import backbone_types
from mtl.setup.build import run_method_types, run_task_types
from mtl.strategies import strategy_types

RECORD = "bench_run.json"
# keys of the run config that cannot change what a run trains: where it writes, and the benchmark's own section (every
# bench.* key that reaches training does so through the run's overrides: methods, strategies, heldout, regimes;
# bench.nproc is added back as "nproc")
NOT_TRAINING = ("output_dir", "bench", "logging")  # logging: where the scalars go, not what is trained


def run_identity(config_path: str, overrides: list[str], nproc: int) -> tuple[dict, dict]:
    """``(training_config, code_files)`` of the run ``config_path`` + ``overrides``: what decides whether a finished
    run may be reused."""
    cfg = load_config_collecting(config_path, overrides, [])
    return _training_config(cfg, nproc), code_files(cfg)


def training_config(config_path: str, overrides: list[str], nproc: int) -> dict:
    """The resolved configuration a run trains with (``config_path`` + ``overrides``), without ``NOT_TRAINING``, plus
    the number of processes per run (it changes the global batch). Not checked: a run whose configuration its own
    checks refuse (``static`` without weights) fails as a run, recorded, and the sweep goes on."""
    return _training_config(load_config_collecting(config_path, overrides, []), nproc)


def _training_config(cfg, nproc: int) -> dict:
    out = OmegaConf.to_container(cfg, resolve=True)
    for key in NOT_TRAINING:
        out.pop(key, None)
    out["nproc"] = int(nproc)
    return out


# ---------------------------------------------------------------------------------------------- code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mtl.__file__)))  # the folder holding the mtl package
UNRESOLVED = "unresolved"  # a code_files value: the run's piece could not be found, so it is never reused


def _shown(path: str) -> str:
    """A code file as the record names it: relative to the folder holding mtl when inside it (``mtl/weighting/
    equal.py``: the same on every clone), else absolute (a plug-in file)."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith(os.pardir) else rel


def _class_files(cls: type, own: set[str]) -> list[str]:
    """The source files of ``cls`` and its base classes that are mtl's own or a plug-in's (``own``: the top-level
    module names that count, besides ``mtl`` and ``mtl_plugins``); torch's and python's are versions, not files."""
    out = []
    for c in cls.__mro__:
        top = c.__module__.split(".")[0]
        if top not in {"mtl", "mtl_plugins", *own}:
            continue
        path = getattr(sys.modules.get(c.__module__), "__file__", None)
        if path and path not in out:
            out.append(path)
    return out


def code_files(cfg) -> dict[str, str]:
    """``{file: sha256}`` of the code a run of ``cfg`` loads for its weighting method, strategy, backbone and tasks
    (built-in or from ``*_modules``), with the files of their base classes. A piece that cannot be found (an
    unknown name: the run will fail) is ``{"<role> <name>": UNRESOLVED}``, which is never reused."""
    own = {str(s).split(".")[0] for key in ("task_modules", "backbone_modules", "weighting_modules")
           for s in (cfg.get(key) or ()) if not str(s).endswith(".py")}
    pieces = [("weighting method", cfg.weighting.method, lambda: run_method_types(cfg)),
              ("strategy", cfg.ddp.strategy, strategy_types),
              ("backbone", cfg.model.backbone.name, lambda: backbone_types(cfg.get("backbone_modules") or ()))]
    out: dict[str, str] = {}
    try:
        tasks = run_task_types(cfg)
    except Exception:  # an unknown task or a plug-in that does not import: the run fails, its record says so
        tasks = {}
        out[f"tasks {list(cfg.tasks)}"] = UNRESOLVED
    for role, name, types in pieces:
        try:
            cls = types()[name]
        except Exception:  # as above
            out[f"{role} {name}"] = UNRESOLVED
            continue
        for path in _class_files(cls, own):
            out[_shown(path)] = _hash_or_unresolved(path)
    for cls in tasks.values():
        for path in _class_files(cls, own):
            out[_shown(path)] = _hash_or_unresolved(path)
    return dict(sorted(out.items()))


def _hash_or_unresolved(path: str) -> str:
    try:
        return sha256_file(path)
    except OSError:
        return UNRESOLVED


def changed_code(old: dict, new: dict) -> list[str]:
    """The code files that differ between two ``code_files`` (``mine.py changed``, ``loaded now, not before``)."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if b == UNRESOLVED:
            out.append(f"{path}: cannot be found now")
        elif a is None:
            out.append(f"{path}: loaded now, not before")
        elif b is None:
            out.append(f"{path}: loaded before, not now")
        elif a != b:
            out.append(f"{path} changed (sha256 {a[:12]} -> {b[:12]})")
    return out


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
    outside a git checkout or without git), the versions of mtl, python, torch and numpy, and the hardware (CPU model and count, the
    GPUs torch sees), plus ``OMP_NUM_THREADS`` of the run."""
    commit = _git("rev-parse", "--short=10", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"commit": commit or "unknown",
            "versions": f"mtl {mtl.__version__}, python {platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}",
            "hardware": f"{_cpu_model()} x {os.cpu_count()} CPUs" + (f", {len(gpus)} x {gpus[0]}" if gpus else ""),
            "host": platform.node(), "threads": threads if threads is not None else os.environ.get("OMP_NUM_THREADS")}


def write_record(run_dir: str, config: dict, prov: dict, code: dict | None = None) -> None:
    """The run's ``bench_run.json``: its training configuration and hash, its ``code_files`` and its provenance."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, RECORD), "w") as f:
        json.dump({"config_hash": config_hash(config), "config": config, "code": code, "provenance": prov,
                   "argv": sys.argv}, f, indent=1, default=str)


def read_record(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _listed(items: list[str]) -> str:
    return "; ".join(items[:6]) + (f"; +{len(items) - 6} more" if len(items) > 6 else "")


def reuse_problem(run_dir: str, config: dict, code: dict) -> str | None:
    """None when the finished run in ``run_dir`` was trained with ``config`` and the code files ``code`` (as
    ``code_files`` gives them now); else why it cannot be reused: the configuration keys and the code files that
    changed. A record without code hashes (written before they were recorded) counts as changed."""
    rec = read_record(run_dir)
    if rec is None or "config_hash" not in rec:
        return f"no {RECORD} (its configuration is unknown)"
    problems = []
    if rec["config_hash"] != config_hash(config):
        keys = changed_keys(rec.get("config") or {}, config)
        problems.append("its configuration changed: " + (_listed(keys) if keys else "hash differs"))
    old = rec.get("code")
    if not isinstance(old, dict) or not old:
        problems.append(f"its {RECORD} has no code hashes (written by an older mtl), so the code that trained it is "
                        "unknown")
    else:
        files = changed_code(old, code)
        if files:
            problems.append("its code changed: " + _listed(files))
    return ", and ".join(problems) or None


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
