"""Image classification on the pooled features: cross-entropy, top-1 accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.models.backbones.base import pool_features
from mtl.tasks.base import BuildInfo, TaskHead


class ClassificationHead(TaskHead):
    name = "cls"
    metrics = {"acc": True}
    requires = ("label",)

    @classmethod
    def item_fields(cls, record, info):
        return {"label": int(record["label"])}

    def __init__(self, info: BuildInfo):
        super().__init__()
        self.fc = nn.Linear(info.feature_channels, info.num_classes)
        self.pool = info.pool  # token features: the backbone's CLS token or mean (pool_features)
        self.class_names = list(info.class_names)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(pool_features(features, self.pool))

    def forward(self, features, batch):
        # A mean over the local batch: every rank holds the same number of samples (drop_last), so
        # DDP's average over ranks is the mean over the global batch.
        return F.cross_entropy(self.logits(features).float(), batch["label"])

    @torch.no_grad()
    def predict(self, features, **options):
        prob, index = self.logits(features).float().softmax(-1).max(-1)
        return [{"class": self.class_names[i], "class_index": i, "prob": p} for p, i in zip(prob.tolist(), index.tolist())]

    @torch.no_grad()
    def eval_batch(self, features, batch):
        logits = self.logits(features).float()
        return {
            "correct": int((logits.argmax(-1) == batch["label"]).sum()),
            "count": int(batch["label"].numel()),
            "loss_sum": float(F.cross_entropy(logits, batch["label"], reduction="sum")),
        }

    def eval_reduce(self, parts):
        n = max(1, sum(p["count"] for p in parts))
        return {"acc": sum(p["correct"] for p in parts) / n, "loss": sum(p["loss_sum"] for p in parts) / n}
