"""A new task in one file: the dominant colour of the image, as a class over the synthetic palette.

Nothing else in mtl is edited to add it. Name the file in the config and add the task:

    task_modules: [docs/examples/dominant_colour.py]   # a path from this config file's folder, or a module name
    tasks: [cls, gen, colour]
    task_options: {colour: {label_smoothing: 0.1}}     # optional: this task's own, checked, options

The targets come from the data's raw records: the synthetic scenes give a ``colour`` field (the colour the
shapes were painted with), and a manifest line may carry one (``{"image": ..., "colour": "red", ...}``).
A data source without it is refused before training, naming this task, the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtl.data.synthetic import COLOUR_NAMES
from mtl.tasks import TaskHead


@dataclass
class ColourOptions:
    label_smoothing: float = 0.0  # cross-entropy label smoothing, 0..1


class DominantColourHead(TaskHead):
    name = "colour"                 # tasks: [..., colour]; logged as loss_colour, colour_acc, weight_colour
    metrics = {"acc": True}         # curves.png, the benchmark's table and delta-m use it (higher is better)
    requires = ("colour",)          # the raw record field this task cannot do without
    Options = ColourOptions         # task_options.colour

    @classmethod
    def check(cls, cfg):
        s = cls.options_from(cfg).label_smoothing
        return [] if 0.0 <= s < 1.0 else [f"task_options.colour.label_smoothing: must be in [0, 1) (got {s})"]

    @classmethod
    def item_fields(cls, record, info):
        # one record -> this task's batch fields; the default collate turns ints into a (B,) long tensor
        return {"colour_label": COLOUR_NAMES.index(record["colour"])}

    def __init__(self, info):
        super().__init__()
        self.smoothing = self.options_from(info.cfg).label_smoothing
        self.fc = nn.Linear(info.feature_channels, len(COLOUR_NAMES))

    def logits(self, features):
        return self.fc(features.mean(dim=(2, 3)))

    def forward(self, features, batch):
        # a mean over the local batch: every rank holds as many items (drop_last), so DDP's average is the global mean
        return F.cross_entropy(self.logits(features).float(), batch["colour_label"], label_smoothing=self.smoothing)

    @torch.no_grad()
    def eval_batch(self, features, batch):
        right = self.logits(features).argmax(-1) == batch["colour_label"]
        return {"correct": int(right.sum()), "n": int(right.numel())}

    def eval_reduce(self, parts):
        return {"acc": sum(p["correct"] for p in parts) / max(1, sum(p["n"] for p in parts))}

    @torch.no_grad()
    def predict(self, features, **options):
        return [{"colour": COLOUR_NAMES[i]} for i in self.logits(features).argmax(-1).tolist()]
