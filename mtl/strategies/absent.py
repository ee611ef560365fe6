"""The heads of tasks a step does not hold (multi-input mode, docs/multi-input.md), for DDP without
find_unused_parameters.

A sampling policy that leaves a task out of a step on every rank (``round_robin``, ``weighted``, ``temperature``)
leaves that task's head out of the graph: DDP built with find_unused_parameters=False would wait for those
parameters and fail at the next step. A strategy with one forward (``feature_leaf``, ``task_grads``) adds
``absent_heads_term`` (``0 * sum(p[0])`` over the absent heads' parameters, placeholder's trick) to ONE of its
backward passes, so every parameter gets exactly one (zero) gradient per step and DDP reduces as usual. The term
is None when the step holds every task (no cost outside multi-input mode).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def absent_heads_term(model: torch.nn.Module, tasks: list[str]) -> torch.Tensor | None:
    """A zero scalar reaching every trainable parameter of the heads (and towers) of the tasks not in ``tasks``, or
    None."""
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    params = [p for name in bare.heads if name not in tasks for p in bare.task_parameters(name)]
    return 0.0 * sum(p.reshape(-1)[0] for p in params) if params else None
