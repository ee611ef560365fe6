"""One shared backbone, one head per task; ``forward`` returns the losses as a dict keyed by task.

The backbone reads the batch field it declares (``Backbone.consumes``: ``image`` for the torchvision backbones,
mtl/models/backbones/); every head reads its features.

The arguments of ``forward`` are how a step strategy shapes the graph (see mtl/strategies/):
- ``tasks``: compute only these heads (per-task forwards);
- ``detach``: these heads read ``features.detach()`` (graph detachment);
- ``feature_leaf``: every head reads one leaf ``features.detach().requires_grad_()``, so the heads'
  backward passes stop at the leaf and the backbone is back-propagated by the strategy, with
  ``features.backward(leaf.grad)``;
- ``leaf_per_task``: each head reads a leaf of its own (``out["leaves"][task]``), so one backward call through
  every head leaves each task's gradient of the features in its own leaf.

Which rows each task reads is the batch's business, not the model's: ``mtl.data.multi_input.task_rows(batch)``
says it (every row for every task, or in multi-input mode each present task its own slice of the shared features,
its loss the mean over its global rows). The backbone runs ONCE over every local row; ``tasks=None`` computes the
tasks the batch holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mtl.data.multi_input import task_rows
from mtl.models.backbones.base import input_device_type


class MultiTaskModel(nn.Module):
    def __init__(self, backbone: nn.Module, heads: dict[str, nn.Module], loss_scale: dict[str, float] | None = None,
                 towers: dict[str, nn.Module] | None = None, adapters=None):
        super().__init__()
        # model.peft.per_task: each task's adapters on the encoder (mtl/models/peft_adapters.py), else None
        self.adapters = adapters
        self.backbone = backbone  # the trunk: every module more than one task reaches (mtl/architectures/base.py)
        self.heads = nn.ModuleDict(heads)
        if towers:  # each task's own modules between the shared tensor and its head (none: hps)
            self.towers = nn.ModuleDict(towers)
        self.loss_scale = dict(loss_scale or {})  # config ``loss_scale``: task -> factor on its loss (1 if absent)
        self.autocast_dtype: torch.dtype | None = None  # set by the trainer for bf16/fp16

    def autocast(self, device_type: str):
        """Autocast lives in the forward, so that the backward passes run outside it."""
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=self.autocast_dtype is not None)

    @property
    def task_names(self) -> list[str]:
        return list(self.heads.keys())

    def task_features(self, task: str, shared: torch.Tensor) -> torch.Tensor:
        """What ``task``'s head reads: the shared tensor through the task's tower (as it is under ``hps``)."""
        towers = getattr(self, "towers", None)
        return towers[task](shared) if towers is not None and task in towers else shared

    def task_parameters(self, task: str) -> list[nn.Parameter]:
        """The trainable parameters only ``task`` reaches: its tower's and its head's."""
        towers = getattr(self, "towers", None)
        mods = [self.heads[task]] + ([towers[task]] if towers is not None and task in towers else [])
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def features_by_task(self, x: torch.Tensor, tasks: Iterable[str]):
        """(task, the shared features it reads) for each of ``tasks``: one backbone forward for all, or with per-task
        adapters (``model.peft.per_task``) one each, under that task's adapters."""
        if self.adapters is None:
            features = self.backbone(x)
            for t in tasks:
                yield t, features
            return
        for t in tasks:
            with self.adapters.active(t):
                features = self.backbone(x)
            yield t, features

    def forward(self, batch: dict, tasks: Iterable[str] | None = None, detach: Iterable[str] = (),
                feature_leaf: bool = False, leaf_per_task: bool = False) -> dict:
        x = batch[getattr(self.backbone, "consumes", "image")]  # a bare nn.Module backbone reads images
        if self.adapters is not None:
            return self._forward_per_task(batch, x, tasks, bool(detach) or feature_leaf or leaf_per_task)
        with self.autocast(input_device_type(x)):
            features = self.backbone(x)
            leaf = features.detach().requires_grad_() if feature_leaf else None
            shared = leaf if feature_leaf else features
            detach = set(detach)
            losses, rows, leaves = {}, task_rows(batch), {}
            for name in rows.present(self.task_names) if tasks is None else tasks:
                if leaf_per_task:
                    x = leaves[name] = features.detach().requires_grad_()
                else:
                    x = shared.detach() if name in detach else shared
                losses[name] = rows.loss(self.heads[name], self.task_features(name, x), name, batch).float()
                if name in self.loss_scale:
                    losses[name] = losses[name] * self.loss_scale[name]
        return {"losses": losses, "features": features, "leaf": leaf, "leaves": leaves}

    def _forward_per_task(self, batch: dict, x: torch.Tensor, tasks: Iterable[str] | None, shared_graph: bool) -> dict:
        """Per-task adapters: one encoder forward per task, each under its task's adapters (``features``: the last's)."""
        if shared_graph:
            raise RuntimeError("model.peft.per_task: every task reads its own features; a strategy that shares one "
                               "forward (detach, feature_leaf, task_grads) is refused at config time")
        rows, losses, features = task_rows(batch), {}, None
        with self.autocast(input_device_type(x)):
            for name, features in self.features_by_task(x, rows.present(self.task_names) if tasks is None else tasks):
                losses[name] = rows.loss(self.heads[name], self.task_features(name, features), name, batch).float()
                if name in self.loss_scale:
                    losses[name] = losses[name] * self.loss_scale[name]
        return {"losses": losses, "features": features, "leaf": None, "leaves": {}}
