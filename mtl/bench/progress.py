"""What the sweep says while its runs train: every ``PERIOD_S`` one line per run in flight, the steps it has done of
its ``trainer.max_steps`` and the time it still needs, and one line for the sweep.

A run's progress is read from what it already writes: the last train record of its ``metrics.jsonl`` (one every
``trainer.log_every`` steps, each with its step and wall-clock time). Its rate is the steps between its first and
last records over the time between them, so start-up does not count; with fewer than two records there is no
estimate yet, and the line says so. The sweep's remaining time: the runs in flight's, plus the runs not started at
the mean length of the runs finished (else of the runs in flight's projected lengths), over ``bench.parallel``.
These lines go to the console only (not ``runs.jsonl``, ``errors.log`` or the tables).
"""

from __future__ import annotations

import json
import os
import time

PERIOD_S = 30.0  # how often the sweep prints its progress while runs train
TAIL_BYTES = 65536  # how much of the end of metrics.jsonl is read for its last record


def _train_record(line: str) -> tuple[int, float] | None:
    try:
        r = json.loads(line)
        return (int(r["step"]), float(r["time"])) if r.get("kind") == "train" else None
    except (ValueError, KeyError, TypeError, AttributeError):  # a line still being written, or not a record
        return None


def run_progress(run_dir: str) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """``((first step, its time), (last step, its time))`` of the run's train records in ``metrics.jsonl``; None
    before its first record. Reads the first line and the file's last ``TAIL_BYTES`` only."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            first_line = f.readline().decode(errors="replace")
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:  # not written yet
        return None
    records = [r for r in map(_train_record, tail) if r is not None]
    first = _train_record(first_line) or (records[0] if records else None)
    if first is None or not records:
        return None
    return first, records[-1]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def run_line(run: dict, max_steps: int | None, progress, now: float, started: float) -> tuple[str, float | None]:
    """(the run's line, its remaining seconds or None): ``natural uw seed 0: step 120/1320 (9%), 3.1 min running,
    about 29.4 min left``."""
    head = f"  {run['regime']} {run['label']} seed {run['seed']}: "
    of = f"/{max_steps}" if max_steps else ""
    running = f"{_minutes(now - started)} running"
    if progress is None:
        return head + f"no step recorded yet, {running}; no estimate yet", None
    (s0, t0), (s1, t1) = progress
    share = f" ({100 * s1 / max_steps:.0f}%)" if max_steps else ""
    if not max_steps or s1 <= s0 or t1 <= t0:
        return head + f"step {s1}{of}{share}, {running}; no estimate yet", None
    left = max(0, max_steps - s1) * (t1 - t0) / (s1 - s0)
    return head + f"step {s1}{of}{share}, {running}, about {_minutes(left)} left", left


def max_steps_of(run: dict) -> int | None:
    """The run's ``trainer.max_steps`` from its training configuration (``record.run_identity``); None if unknown."""
    try:
        steps = int(run["config"]["trainer"]["max_steps"])
    except (KeyError, TypeError, ValueError):
        return None
    return steps if steps > 0 else None


def progress_lines(running: list[tuple[dict, float]], pending: int, finished_s: list[float], parallel: int,
                   now: float | None = None) -> list[str]:
    """The progress report: one line per run in flight (``(run, its start time)``, the run with its ``dir``,
    ``config``, ``regime``, ``label``, ``seed``), then the sweep's line with ``pending`` runs not started,
    ``finished_s`` the wall times of the runs finished so far."""
    now = time.time() if now is None else now
    lines, lefts, lengths = [], [], []
    for run, started in running:
        line, left = run_line(run, max_steps_of(run), run_progress(run["dir"]), now, started)
        lines.append(line)
        lefts.append(left)
        if left is not None:
            lengths.append(now - started + left)
    per_run = (sum(finished_s) / len(finished_s)) if finished_s else (sum(lengths) / len(lengths) if lengths else None)
    head = f"bench: {len(running)} run(s) training, {pending} waiting"
    if None in lefts or (pending and per_run is None):
        return [head + "; no estimate for the sweep yet", *lines]
    left = (sum(lefts) + pending * per_run) / max(1, parallel)
    return [head + f"; the sweep: about {_minutes(max(left, max(lefts, default=0.0)))} left", *lines]


class Progress:
    """Prints ``progress_lines`` at most every ``period_s`` (the first after ``period_s``), from ``drive``'s loop."""

    def __init__(self, parallel: int, finished_s: list[float], period_s: float | None = None, out=print):
        self.parallel, self.finished_s, self.out = parallel, finished_s, out
        self.period_s = PERIOD_S if period_s is None else period_s
        self.last = time.time()

    def __call__(self, running: list[tuple[dict, float]], pending: int) -> None:
        now = time.time()
        if not running or now - self.last < self.period_s:
            return
        self.last = now
        self.out("\n".join(progress_lines(running, pending, self.finished_s, self.parallel, now)), flush=True)
