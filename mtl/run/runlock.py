"""One run per ``output_dir``: a lock file, ``output_dir/run.lock``, held by the run's rank 0.

Two runs on one folder replaced each other's checkpoints, so a second run refuses at once and
names the holder (PID, host, since when). The file is created with ``O_EXCL`` (atomic, also on
NFS v3+), holds JSON ``{pid, host, start, job, since}``, and is removed when the run ends.

A lock left behind by a run that died (SIGKILL, OOM, a lost node) must not block its resume. It is
taken over when it is provably stale:

- same host, and its PID is gone, or now belongs to a process that started at another time (PID
  reuse; the start time comes from ``/proc/<pid>/stat`` where there is one);
- or it was written by an earlier attempt of *this* job: the same ``SLURM_JOB_ID`` (a requeued
  job keeps its id) or the same torchrun ``--rdzv-id``, which the job's next attempt may run on
  another host. A job's attempts never overlap (Slurm and torchrun stop one before the next).

A lock from another host and another job cannot be checked from here: the run refuses and says
which file to delete if that run is really gone.
"""

from __future__ import annotations

import json
import os
import socket
import time

LOCK_NAME = "run.lock"


class LockHeld(Exception):
    """The output_dir is in use by another run (the message names it)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused PID apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _job_id() -> str | None:
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(key, "")
        if value and value != "none":  # torchrun's default rdzv id is the literal "none": not an identity
            return f"{key}={value}"
    return None


def _stale_reason(holder: dict) -> str | None:
    """Why the lock ``holder`` is stale, or None if it may belong to a live run."""
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int):
        return "it names no process"
    if host == socket.gethostname():
        if not alive(pid):
            return f"PID {pid} on {host} is gone"
        start = _start_time(pid)
        if holder.get("start") and start and start != holder["start"]:
            return f"PID {pid} on {host} is now another process"
        if pid == os.getpid():
            return None  # this very process holds it (another run object in this process)
    job = _job_id()
    if job and holder.get("job") == job:
        if host != socket.gethostname() or not alive(pid):
            return f"it was left by an earlier attempt of this job ({job})"
    return None


def describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else ""
    job = f", {holder['job']}" if holder.get("job") else ""
    return f"PID {holder.get('pid')} on host {holder.get('host')}{job}{when}"


class RunLock:
    """``RunLock.acquire(output_dir)`` or LockHeld; ``release()`` removes the file (idempotent)."""

    def __init__(self, path: str, record: dict, note: str | None):
        self.path, self.record, self.note = path, record, note

    @classmethod
    def acquire(cls, output_dir: str) -> RunLock:
        """Take the lock; an OSError (e.g. a read-only folder) is left to the caller to explain."""
        path = os.path.join(output_dir, LOCK_NAME)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
                  "job": _job_id(), "since": round(time.time(), 3)}
        note = None
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(path)
                if holder is None:
                    continue  # released between our two calls: try again
                reason = _stale_reason(holder) if holder or _age(path) > 10 else None  # {}: maybe being written
                if reason is None:
                    raise LockHeld(
                        f"output_dir {output_dir!r} is in use by another run: {describe(holder)}. Wait for it to "
                        f"end or use another output_dir; if that run is really gone, delete {path}") from None
                if _take_aside(path, holder):
                    note = f"took over the stale lock {path} ({reason})"
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            return cls(path, record, note)
        raise LockHeld(f"output_dir {output_dir!r}: could not take {path}: other runs keep taking it")

    def release(self) -> None:
        if self.path is None:
            return
        holder = _read(self.path)
        if holder is not None and holder.get("pid") == self.record["pid"] and holder.get("since") == self.record["since"]:
            try:
                os.remove(self.path)
            except OSError:
                pass  # a read-only or vanished folder: a later run sees a dead PID and takes over
        self.path = None


def _read(path: str) -> dict | None:
    """The lock's record; ``{}`` if unreadable (half-written by a killed run: stale); None if gone."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _take_aside(path: str, holder: dict) -> bool:
    """Remove the stale lock ``holder``, unless another run replaced it meanwhile (then leave that one)."""
    aside = f"{path}.stale.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read(aside) != holder:  # we moved a fresh lock of a run that raced us: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)
    return True
