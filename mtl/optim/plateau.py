"""``optim.scheduler: plateau``: torch's ReduceLROnPlateau on the validation Δm (the QM9 papers' schedule).

After each evaluation the trainer hands the validation metrics to ``evaluated``, which computes Δm % against
``optim.plateau.baselines`` (single-task values per metric key, e.g. Nash-MTL's published MAEs; lower is better,
``mtl.delta_m``) and steps ReduceLROnPlateau with it (mode min; ``factor``, ``patience``, ``min_lr``). The per-step
``step()`` the training step calls does nothing: the learning rate only moves at evaluations. The metrics are the
same on every rank (gathered), so every rank takes the same decision and the replicas stay equal.
"""

from __future__ import annotations

import torch

from mtl.delta_m import delta


class PlateauOnDeltaM:
    def __init__(self, optimizer: torch.optim.Optimizer, specs: list, baselines: dict, factor: float, patience: int,
                 min_lr: float):
        self.optimizer, self.specs, self.baselines = optimizer, list(specs), dict(baselines)
        self.inner = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=factor,
                                                                patience=patience, min_lr=min_lr)
        self.last_delta_m: float | None = None

    def step(self) -> None:
        """A training step: the rate moves only at evaluations (``evaluated``)."""

    def evaluated(self, metrics: dict) -> float:
        """Step on the validation metrics (``<task>_<metric>`` keys); returns their Δm %."""
        self.last_delta_m = delta(metrics, self.baselines, self.specs)
        self.inner.step(self.last_delta_m)
        return self.last_delta_m

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "last_delta_m": self.last_delta_m}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.last_delta_m = state["last_delta_m"]
