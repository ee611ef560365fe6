"""What a task-weighting method is.

A method is one file in ``mtl/weighting/`` defining a ``Weighting`` subclass with a ``name``.

Loss-level methods (``level = "loss"``) turn each task's loss into the term whose backward pass the
step runs: ``weigh(task, loss)``. They see only scalars, so they cost next to nothing under DDP; a
method whose term is nonlinear in the loss (gls, famo: log L) must use the rank-averaged loss value
(one scalar all-reduce in ``weigh``), or DDP's average of the ranks' gradients is not the gradient
of the global batch's objective. Every strategy calls ``weigh`` once per task, in task order, on
every rank, so such a collective is safe. Their
weights may depend on the step (``begin_step``) and on the rank-averaged losses of earlier steps
(``end_step``), but never on another task's *current* loss, which is what lets a strategy run one
backward pass per task.

Gradient-level methods (``level = "grad"``) combine the K x P matrix of each task's *rank-averaged*
gradient of the shared parameters into one gradient: ``combine(grads, losses)``.

Any state (learned weights, loss history, RNG) lives in ``state_dict()`` so that it goes into
checkpoints: learnable weights as parameters or buffers, everything else through ``get_extra_state``.
"""

from __future__ import annotations

import torch
from torch import nn


class Weighting(nn.Module):
    name: str = ""
    level: str = "loss"  # "loss" | "grad"

    def __init__(self, cfg, tasks: list[str]):
        super().__init__()
        self.tasks = list(tasks)

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this method (each one names the key and the fix)."""
        return []

    def begin_step(self, step: int) -> None:
        """Called once before the step's forward passes."""

    def weigh(self, task: str, loss: torch.Tensor) -> torch.Tensor:
        """The term whose backward pass the step runs for ``task``."""
        return loss * self.weights()[task]

    def weights(self) -> dict[str, float]:
        """The current per-task loss weights (for the step and for logging)."""
        return {t: 1.0 for t in self.tasks}

    def end_step(self, losses: dict[str, float]) -> None:
        """Called after the step with each task's loss averaged over ranks (identical on every rank)."""

    def combine(self, grads: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """Gradient-level methods: (K, P) rank-averaged task gradients -> (P,) update direction."""
        raise NotImplementedError(f"{self.name} is a loss-level method")
