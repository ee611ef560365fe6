"""Faults injected on purpose, for the reliability tests: ``trainer.poison``.

Kept out of the step and the model: the trainer calls ``poison`` on the batch before ``train_step``, and
``install_poison`` (``mtl.setup.poison``, below the run: called by the model builder only when ``trainer.poison`` is
set) adds the forward hook that turns the named task's loss into NaN.
"""

from __future__ import annotations

import os
import signal

from mtl.run import heartbeat
from mtl.setup.poison import install_poison  # noqa: F401  (its old place: the model builder's hook)

_signalled: set[str] = set()  # the phases this process has sent itself SIGTERM in (signal_at), since the run began


def poison(batch: dict, spec: str | None, step: int, rank: int) -> None:
    """``trainer.poison = "STEP:TASK:RANK"``: that task's loss is NaN at that step on that rank (RANK ``*``: all).

    TASK ``crash`` makes that rank raise instead; ``stop`` makes it stop itself (SIGSTOP: a frozen process whose
    peers wait for it). The hook of ``install_poison`` multiplies the named task's loss by NaN.
    """
    if not spec:
        return
    at, task, who = spec.split(":")
    if int(at) != step or who not in ("*", str(rank)):
        return
    if task == "crash":  # a rank that dies mid-step: the others must not hang
        raise RuntimeError(f"trainer.poison: rank {rank} crashes at step {step} (testing)")
    if task == "stop":  # a rank that stops answering: the others must name it (mtl/run/heartbeat.py)
        heartbeat.flush()  # the last step's beat is in the store, so the peers can name it
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    batch["poison"] = task


def signal_at(phase: str) -> None:
    """``MTL_TEST_SIGTERM_AT=<phase>`` (tests only): the process sends itself SIGTERM the first time the run enters
    that phase (``mtl.run.signals.enter_phase``: build, evaluation, sample figure, save ...), so a test hits each phase
    for sure instead of by timing. Entering ``start-up`` (a new run in this process) arms it again."""
    if phase == "start-up":
        _signalled.clear()
    if os.environ.get("MTL_TEST_SIGTERM_AT") == phase and phase not in _signalled:
        _signalled.add(phase)
        os.kill(os.getpid(), signal.SIGTERM)
