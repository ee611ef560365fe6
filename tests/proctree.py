"""Killing a whole job as a node crash would: the launcher and every process below it.

torchrun starts its workers in sessions of their own, so killing the launcher's process group leaves
them running. These helpers walk /proc for the descendants instead (no psutil needed).
"""

from __future__ import annotations

import os
import signal
import time


def children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p not in found:
            found.append(p)
            todo += children(p)
    return found


def state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped, Z for a zombie, ...); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, stopped or sleeping; a zombie (dead, not yet reaped) counts as gone."""
    return state(pid) not in ("", "Z", "X")


def kill_tree(pid: int, timeout: float = 30.0, while_frozen=None) -> list[int]:
    """SIGKILL ``pid`` and every descendant at once; return the pids killed, all verified gone.

    The tree is frozen first (SIGSTOP) so that nothing forks while it is being collected;
    ``while_frozen()``, if given, runs then (e.g. to look at what the job was doing when it died).
    """
    pids = tree(pid)
    for p in pids:
        _signal(p, signal.SIGSTOP)
    pids = tree(pid)  # anything forked between the first walk and the freeze
    for p in pids:
        _signal(p, signal.SIGSTOP)
    try:
        if while_frozen is not None:
            while_frozen()
    finally:
        for p in pids:
            _signal(p, signal.SIGKILL)
    deadline = time.time() + timeout
    while any(alive(p) for p in pids):
        if time.time() > deadline:
            raise AssertionError(f"still alive after SIGKILL: {[p for p in pids if alive(p)]}")
        time.sleep(0.02)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
