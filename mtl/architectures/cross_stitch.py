"""``cross_stitch``: Cross-stitch networks (Misra, Shrivastava, Gupta and Hebert, CVPR 2016).

One copy of the backbone per task (a column, each starting from the backbone's weights), run in step; after every
declared block j the columns' outputs are mixed by a learned K x K matrix (eq. 1 of the paper, one scalar per pair of
tasks per block)::

    x_t^j = sum_s alpha^j_ts y_s^j,      alpha^j initialised to 0.9 on the diagonal and 0.1 / (K - 1) off it (§3.3)

Task t's head reads its column's output. What is shared: everything before the heads (every column reaches every
task's loss through the mixing), so the trunk is all the columns and the mixing; its output stacks the columns'
features ``(B, K, *S)``, and task t's tower takes slot t. No tensor is read by every task, so the features source
(the tasks' gradients of one shared tensor) is refused by name; the parameters source works (each task's gradient
of every column and mixing weight).

The columns run the backbone's declared ``stages()`` one after the other (the torchvision CNNs declare them); a
backbone that declares none is refused by name.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from mtl.architectures.base import Architecture
from mtl.errors import ConfigError


class CrossStitchTrunk(nn.Module):
    def __init__(self, backbone: nn.Module, tasks: list[str]):
        super().__init__()
        self.tasks = list(tasks)
        self.columns = nn.ModuleDict({t: backbone if i == 0 else copy.deepcopy(backbone) for i, t in enumerate(tasks)})
        self.stage_names = [name for name, _ in backbone.stages()]
        self.block_names = [name for name, _ in backbone.blocks()]
        k = len(tasks)
        init = torch.full((k, k), 0.1 / (k - 1)) if k > 1 else torch.zeros(k, k)
        init.fill_diagonal_(0.9 if k > 1 else 1.0)
        self.alpha = nn.ParameterList(nn.Parameter(init.clone()) for _ in self.block_names)

    @property
    def consumes(self) -> str:
        return getattr(self.columns[self.tasks[0]], "consumes", "image")

    @property
    def pool(self) -> str:
        return getattr(self.columns[self.tasks[0]], "pool", "mean")

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """Every column's blocks, block by block (the per-block settings and FSDP2 act on each)."""
        per_column = {t: c.blocks() for t, c in self.columns.items()}
        return [(f"columns.{t}.{per_column[t][j][0]}", per_column[t][j][1])
                for j in range(len(self.block_names)) for t in self.tasks]

    def forward(self, x):
        stages = {t: dict(c.stages()) for t, c in self.columns.items()}
        xs = [x] * len(self.tasks)
        j = 0
        for name in self.stage_names:
            ys = [stages[t][name](xi) for t, xi in zip(self.tasks, xs)]
            if name in self.block_names:  # a cross-stitch unit after every block
                stacked = torch.stack(ys, dim=1)  # (B, K, *S)
                a = self.alpha[j].to(stacked.dtype)
                xs = list(torch.einsum("ts,bs...->bt...", a, stacked).unbind(1))
                j += 1
            else:
                xs = ys
        return torch.stack(xs, dim=1)


class Column(nn.Module):
    """Task t's tower: its column's slot of the shared tensor."""

    def __init__(self, slot: int):
        super().__init__()
        self.slot = slot

    def forward(self, shared):
        return shared[:, self.slot]


class CrossStitch(Architecture):
    name = "cross_stitch"
    summary = "a backbone column per task, mixed after every block by learned cross-stitch units"
    features_source = ("each task reads its own column (cross-stitch shares weights through the mixing, not a "
                       "tensor every task reads), so there is no shared tensor to take the tasks' gradients of")

    @classmethod
    def check(cls, cfg):
        # both count depth in one backbone's blocks; the columns' blocks are K backbones' (a freeze or a rate per
        # column's block is not what these keys say)
        errors = []
        for key in ("freeze_blocks", "freeze"):
            if cfg.model.backbone.get(key):
                errors.append(f"model.backbone.{key}: not with model.architecture.name=cross_stitch (its K columns "
                              "each have the backbone's blocks); remove the key")
        if float(cfg.optim.get("layer_decay", 1.0)) != 1.0:
            errors.append("optim.layer_decay: not with model.architecture.name=cross_stitch (its K columns each have "
                          "the backbone's blocks); remove the key")
        return errors

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        stages = backbone.stages() if hasattr(backbone, "stages") else []
        names = [n for n, _ in stages]
        blocks = [n for n, _ in backbone.blocks()] if hasattr(backbone, "blocks") else []
        if not stages or not blocks or any(b not in names for b in blocks):
            raise ConfigError(f"model.architecture.name=cross_stitch: the backbone {type(backbone).__name__} does not "
                              "declare its forward as stages with its blocks among them (Backbone.stages()), and the "
                              "task columns must run block by block in step; use a torchvision backbone (resnet*, "
                              "convnext*, ...)")
        return CrossStitchTrunk(backbone, tasks), {t: Column(i) for i, t in enumerate(tasks)}
