"""One shared backbone, one head per task; ``forward`` returns the losses as a dict keyed by task.

The arguments of ``forward`` are how a step strategy shapes the graph (see mtl/strategies/):
- ``tasks``: compute only these heads (per-task forwards);
- ``detach``: these heads read ``features.detach()`` (graph detachment);
- ``feature_leaf``: every head reads one leaf ``features.detach().requires_grad_()``, so the heads'
  backward passes stop at the leaf and the backbone is back-propagated once, by the strategy, with
  ``features.backward(leaf.grad)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class MultiTaskModel(nn.Module):
    def __init__(self, backbone: nn.Module, heads: dict[str, nn.Module]):
        super().__init__()
        self.backbone = backbone
        self.heads = nn.ModuleDict(heads)
        self.autocast_dtype: torch.dtype | None = None  # set by the trainer for bf16/fp16

    def autocast(self, device_type: str):
        """Autocast lives in the forward, so that the backward passes run outside it."""
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=self.autocast_dtype is not None)

    @property
    def task_names(self) -> list[str]:
        return list(self.heads.keys())

    def forward(self, batch: dict, tasks: Iterable[str] | None = None, detach: Iterable[str] = (),
                feature_leaf: bool = False) -> dict:
        image = batch["image"]
        with self.autocast(image.device.type):
            features = self.backbone(image)
            leaf = features.detach().requires_grad_() if feature_leaf else None
            shared = leaf if feature_leaf else features
            detach = set(detach)
            losses = {}
            for name in (self.task_names if tasks is None else tasks):
                losses[name] = self.heads[name](shared.detach() if name in detach else shared, batch).float()
                if batch.get("poison") == name:  # trainer.poison, for the non-finite-step tests
                    losses[name] = losses[name] * float("nan")
        return {"losses": losses, "features": features, "leaf": leaf}
