"""What a resumed run really did, read from its folder rather than from the "resuming from" line it prints.

A run that prints the right checkpoint and then starts again from step 0 (with the checkpoint's weights or without
them) prints the same line; and one that starts over from scratch with no checkpoint at all ends with the weights of an
uninterrupted run, so comparing the final model alone cannot tell either. What does tell: ``metrics.jsonl``. Rank 0
writes one ``train`` record per step (``trainer.log_every=1``), time-stamped, and a resume from checkpoint step N keeps
the records of steps <= N and drops the rest. So, with the records and the newest complete checkpoint on disk read
just before the resumed process started (``snapshot``), ``check_resume`` asserts after it:

- the records of steps <= N written before are still there, unchanged (same time stamps), first in the file;
- the resumed process's own train records are steps N+1, N+2, ... with none repeated or skipped, and the records
  of later steps from before are gone once it has logged (a process killed before that may leave them);
- the whole file holds each step 1, 2, ... once, in order.

``tests/test_mutants.py`` runs this check against a copy of the package that restarts from step 0 after its load, and
asserts that it fails there.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple


class Before(NamedTuple):
    """The folder as the resumed process found it: the checkpoint step it must continue from, and the records."""

    step: int
    records: list[dict]


def metrics_records(out: str) -> list[dict]:
    """``metrics.jsonl``'s complete records, in file order (a line a kill cut short is left out, as a resume does)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    found = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def newest_complete(out: str) -> int:
    """The step of the newest complete checkpoint on disk, read here without mtl: a published ``step_<N>`` holding
    its manifest (written last), or a ``.step_<N>.old`` copy whose ``step_<N>`` is gone (a re-save cut short,
    which the next start puts back); 0 if none."""
    root = os.path.join(out, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [int(m.group(1)) for n in names if (m := re.match(r"^step_(\d+)$", n))
             and os.path.isfile(os.path.join(root, n, "manifest.json"))]
    steps += [int(m.group(1)) for n in names if (m := re.match(r"^\.step_(\d+)\.old$", n))
              and f"step_{m.group(1)}" not in names and os.path.isfile(os.path.join(root, n, "manifest.json"))]
    return max(steps, default=0)


def snapshot(out: str) -> Before:
    """Read before a (resumed) process starts on ``out``, with no other process running on it."""
    return Before(newest_complete(out), metrics_records(out))


def train_steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if r.get("kind") == "train"]


def check_resume(out: str, before: Before, last_step: int | None = None) -> list[int]:
    """Assert that the process that ran on ``out`` since ``before`` continued from checkpoint step ``before.step``
    (see the module's docstring); with ``last_step``, that it also trained up to it. Returns the steps it trained."""
    n, after = before.step, metrics_records(out)
    kept = [r for r in before.records if r["step"] <= n]
    assert after[:len(kept)] == kept, (
        f"{out}: the records of steps 1-{n} written before the resume were dropped or rewritten (the first train "
        f"steps now: {train_steps(after)[:5]}): the resumed run did not continue from its checkpoint step_{n}")
    rest = after[len(kept):]
    stale = [r for r in rest if r in before.records]  # left by an earlier process: gone once the resume starts logging
    own = train_steps([r for r in rest if r not in before.records])
    assert not (stale and own), f"{out}: records of steps after step_{n} from before the resume were kept: {stale}"
    assert own == list(range(n + 1, n + 1 + len(own))), (
        f"{out}: after checkpoint step_{n} the resumed process trained steps {own}; expected {n + 1}, {n + 2}, ... "
        "(a restart, or a step trained twice or skipped)")
    steps = train_steps(after)
    assert steps == list(range(1, len(steps) + 1)), f"{out}: train steps {steps}: each step once, in order"
    if last_step is not None:
        assert steps and steps[-1] == last_step, f"{out}: train steps {steps}, expected up to {last_step}"
    return own


def model_bytes(out: str, step: int) -> bytes:
    with open(os.path.join(out, "checkpoints", f"step_{step}", "model.safetensors"), "rb") as f:
        return f.read()
