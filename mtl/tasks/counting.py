"""Counting: how many shapes an image holds, as a class over 1..``data.synthetic.max_count``.

A third head and the worked example of docs/extending.md. Not in the default ``tasks: [cls, gen]``;
enable it with ``tasks=[cls,gen,count]``.

The batch's ``count`` is (B,) long: the record's ``count`` (1..max_count for the synthetic
images; a manifest line may carry one), -1 (unknown) where the record has none. Unknown counts, and
any value outside 1..max_count, are ignored by the loss and by the evaluation. The head predicts
``count - 1`` with a Linear layer on the mean-pooled feature map.

The loss is the mean cross-entropy over the GLOBAL batch's known counts, as ``captioning.py`` does
for tokens: ``prepare`` all-reduces the number of known counts, and each rank's loss is its sum of
cross-entropies * world / global known count, so DDP's average over ranks is the global mean
whatever the world size and however the known counts are spread over the ranks. A batch without
any known count gives a loss of exactly 0 that is still a function of the head's parameters (their
gradient is a zero tensor, not None), so DDP, the ``placeholder`` strategy and the gradient-level
weighting methods all see the head as used.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtl.models.backbones.base import pool_features
from mtl.tasks.base import BuildInfo, TaskHead

IGNORE = -1  # the target of an unknown count


class CountingHead(TaskHead):
    name = "count"
    metrics = {"acc": True}

    @classmethod
    def item_fields(cls, record, info):
        # the synthetic scenes have a count; other data sets may (a "count" key in a manifest line), or not: -1
        count = record.get("count")
        return {"count": int(count) if isinstance(count, int) and not isinstance(count, bool) else IGNORE}

    def __init__(self, info: BuildInfo):
        super().__init__()
        self.max_count = int(info.cfg.data.synthetic.max_count)
        self.fc = nn.Linear(info.feature_channels, self.max_count)
        self.pool = info.pool  # token features: the backbone's CLS token or mean (pool_features)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(pool_features(features, self.pool))

    def known(self, batch: dict) -> torch.Tensor:
        """(B,) bool: which items have a count this head can predict."""
        count = batch["count"]
        return (count >= 1) & (count <= self.max_count)

    def targets(self, batch: dict) -> torch.Tensor:
        """count - 1 (the class) where known, IGNORE elsewhere."""
        return torch.where(self.known(batch), batch["count"] - 1, torch.full_like(batch["count"], IGNORE))

    def prepare(self, batch, reduce_sum):
        # One collective: [known counts on this rank, 1] summed over ranks = [global known, world].
        # On the batch's device, so that it works with nccl as well as gloo.
        local = torch.stack([self.known(batch).sum().to(torch.float64),
                             torch.ones((), dtype=torch.float64, device=batch["count"].device)])
        total = reduce_sum(local)
        batch["count_known_global"], batch["count_world"] = total[0], total[1]

    def nll_sum(self, features, batch) -> torch.Tensor:
        # reduction="sum" (not "mean", which is 0/0 = NaN when every count is unknown): ignored items
        # add exactly 0, and the result stays in the graph of self.fc even when all are ignored.
        return F.cross_entropy(self.logits(features).float(), self.targets(batch), ignore_index=IGNORE,
                               reduction="sum")

    def forward(self, features, batch):
        nll = self.nll_sum(features, batch)
        if "count_known_global" not in batch:  # used outside the trainer: a plain local mean
            return nll / self.known(batch).sum().clamp(min=1)
        scale = batch["count_world"] / batch["count_known_global"].clamp(min=1)
        return nll * scale.to(nll.dtype)

    @torch.no_grad()
    def predict(self, features, **options):
        return [{"count": c + 1} for c in self.logits(features).argmax(-1).tolist()]

    @torch.no_grad()
    def eval_batch(self, features, batch):
        logits = self.logits(features).float()
        known = self.known(batch)
        target = self.targets(batch)
        return {
            "correct": int(((logits.argmax(-1) == target) & known).sum()),
            "known": int(known.sum()),
            "loss_sum": float(F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")),
        }

    def eval_reduce(self, parts):
        known = sum(p["known"] for p in parts)
        if not known:  # e.g. user data, where every count is unknown: no accuracy to report
            return {"acc": math.nan, "loss": math.nan}
        return {"acc": sum(p["correct"] for p in parts) / known, "loss": sum(p["loss_sum"] for p in parts) / known}
