"""One shared backbone, one head per task; ``forward`` returns the losses as a dict keyed by task.

The backbone reads the batch field it declares (``Backbone.consumes``: ``image`` for the torchvision backbones,
mtl/models/backbones/); every head reads its features.

The arguments of ``forward`` are how a step strategy shapes the graph (see mtl/strategies/):
- ``tasks``: compute only these heads (per-task forwards);
- ``detach``: these heads read ``features.detach()`` (graph detachment);
- ``feature_leaf``: every head reads one leaf ``features.detach().requires_grad_()``, so the heads'
  backward passes stop at the leaf and the backbone is back-propagated once, by the strategy, with
  ``features.backward(leaf.grad)``.

Multi-input mode (``batch["multi_input"]``, mtl/data/multi_input.py): the backbone runs ONCE over every local
row (all the tasks' images, concatenated), and each head reads its own slice. Only the tasks present in the
step are computed (``tasks=None``: all of them). Each task's loss is the mean over its GLOBAL rows in the step:
a head's local mean times n_local * W / n_global (a head whose loss already is a global mean, the caption head
through ``prepare``, is left as it is), so DDP's average over ranks is the global mean whatever each rank
holds. A task present in the step but with no row on this rank gets a zero loss that still reaches its head's
parameters and the shared features (zero gradients): every rank then builds the same graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mtl.models.backbones.base import input_device_type


class MultiTaskModel(nn.Module):
    def __init__(self, backbone: nn.Module, heads: dict[str, nn.Module], loss_scale: dict[str, float] | None = None):
        super().__init__()
        self.backbone = backbone
        self.heads = nn.ModuleDict(heads)
        self.loss_scale = dict(loss_scale or {})  # config ``loss_scale``: task -> factor on its loss (1 if absent)
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
        x = batch[getattr(self.backbone, "consumes", "image")]  # a bare nn.Module backbone reads images
        with self.autocast(input_device_type(x)):
            features = self.backbone(x)
            leaf = features.detach().requires_grad_() if feature_leaf else None
            shared = leaf if feature_leaf else features
            detach = set(detach)
            losses = {}
            mi = batch.get("multi_input")
            for name in ((self.task_names if mi is None else list(mi)) if tasks is None else tasks):
                x = shared.detach() if name in detach else shared
                losses[name] = (self.heads[name](x, batch) if mi is None else self._task_loss(name, x, mi[name])).float()
                if name in self.loss_scale:
                    losses[name] = losses[name] * self.loss_scale[name]
        return {"losses": losses, "features": features, "leaf": leaf}

    def _task_loss(self, name: str, shared: torch.Tensor, sub: dict) -> torch.Tensor:
        """Multi-input: task ``name``'s loss on its own rows, as a share of the mean over its global rows."""
        head, (start, stop) = self.heads[name], sub["rows"]
        if stop == start:  # none of this task's rows here: zero, through the same parameters as on the other ranks
            return 0.0 * (shared.sum() + sum(p.reshape(-1)[0] for p in head.parameters() if p.requires_grad))
        loss = head(shared[start:stop], sub)
        if getattr(head, "loss_is_global_mean", False):
            return loss
        return loss * ((stop - start) * sub.get("world", 1) / sub["global_rows"])
