"""``cgc``: Customized Gate Control (Tang et al., RecSys 2020, §4.2, PLE's single level). Shared experts every task
reads, and experts of each task's own; task t's features are ``sum_e g_t(x)_e f_e(x)`` over the shared experts and
its own, with its softmax gate ``g_t(x) = softmax(W_t x)`` (eq. 1-3). Trunk: the backbone and the shared experts;
tower t: its own experts and its gate (only task t reaches them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.architectures.base import Architecture
from mtl.architectures.experts import ExpertTrunk, SoftmaxGate, experts, features_and_experts, mix
from mtl.models.backbones.base import feature_channels


@dataclass
class CGCOptions:
    shared_experts: int = 2
    task_experts: int = 1  # each task's own
    hidden: int = 0  # each expert's hidden width; 0: the features' width


class CGCTower(nn.Module):
    """Task t's experts and gate over [the shared experts (slots 1..), its own], reading the features (slot 0)."""

    def __init__(self, own: nn.ModuleList, gate: SoftmaxGate):
        super().__init__()
        self.experts, self.gate = own, gate

    def forward(self, shared):
        f, common = features_and_experts(shared)
        outputs = torch.cat([common, torch.stack([e(f) for e in self.experts], dim=1)], dim=1)
        return mix(self.gate(f), outputs)


def expert_counts(cfg, shared_min: int) -> list[str]:
    o, key = cfg.model.architecture.options, "model.architecture.options"
    errors = []
    if int(o.get("shared_experts", 2)) < shared_min:
        errors.append(f"{key}.shared_experts: needs at least {shared_min}")
    if int(o.get("task_experts", 1)) < 1:
        errors.append(f"{key}.task_experts: needs at least 1 (with none, use mmoe)")
    return errors


class CGC(Architecture):
    name = "cgc"
    summary = "shared and task-specific experts over the backbone's features, a softmax gate per task"
    Options = CGCOptions

    @classmethod
    def check(cls, cfg):
        return expert_counts(cfg, 1)

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        c, pool = feature_channels(feature_shape), getattr(backbone, "pool", "mean")
        n = options.shared_experts + options.task_experts
        trunk = ExpertTrunk(backbone, experts(options.shared_experts, feature_shape, options.hidden))
        return trunk, {t: CGCTower(experts(options.task_experts, feature_shape, options.hidden),
                                   SoftmaxGate(c, n, pool)) for t in tasks}
