"""Faults injected on purpose, for the reliability tests: ``trainer.poison``.

Kept out of the step: the trainer calls ``poison`` on the batch before ``train_step``.
"""

from __future__ import annotations


def poison(batch: dict, spec: str | None, step: int, rank: int) -> None:
    """``trainer.poison = "STEP:TASK:RANK"``: that task's loss is NaN at that step on that rank (RANK ``*``: all).

    TASK ``crash`` makes that rank raise instead; ``stop`` makes it stop itself (SIGSTOP: a frozen process whose
    peers wait for it). The model multiplies the named task's loss by NaN.
    """
    if not spec:
        return
    at, task, who = spec.split(":")
    if int(at) != step or who not in ("*", str(rank)):
        return
    if task == "crash":  # a rank that dies mid-step: the others must not hang
        raise RuntimeError(f"trainer.poison: rank {rank} crashes at step {step} (testing)")
    if task == "stop":  # a rank that stops answering: the others must name it (mtl/heartbeat.py)
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)
        return
    batch["poison"] = task
