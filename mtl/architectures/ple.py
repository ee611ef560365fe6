"""``ple``: Progressive Layered Extraction (Tang et al., RecSys 2020, §4.3): ``layers`` levels of CGC, where each
level also keeps a shared path whose gate mixes every expert of the level. At level j, task k's input is its own
path's output of level j - 1 and the shared path's input the shared output (both the backbone's features at level
1); task k's gate reads its own input and weighs [the shared experts, its own experts] (eq. 4-5); the shared gate
reads the shared input and weighs every expert of the level. The last level has task gates only.

What is shared: a task's experts below the last level feed the shared gate, so every task reaches them; only the last
level's task experts and gates are one task's. Trunk: the backbone, levels 1 .. layers - 1 and the last level's
shared experts, giving ``(B, K + S, *S)``: each task's input to the last level (slot k), then the last level's shared
experts' outputs. Tower k: the last level's experts and gate of task k, reading slot k."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.architectures.base import Architecture, Trunk
from mtl.architectures.cgc import expert_counts
from mtl.architectures.experts import SoftmaxGate, experts, mix
from mtl.models.backbones.base import feature_channels


@dataclass
class PLEOptions:
    layers: int = 2  # extraction levels (1 would be cgc)
    shared_experts: int = 2  # per level
    task_experts: int = 1  # per task per level
    hidden: int = 0  # each expert's hidden width; 0: the features' width


class Level(nn.Module):
    """One extraction level below the last: shared and per-task experts, a gate per task and the shared gate."""

    def __init__(self, tasks, feature_shape, pool, o: PLEOptions):
        super().__init__()
        c = feature_channels(feature_shape)
        self.shared = experts(o.shared_experts, feature_shape, o.hidden)
        self.own = nn.ModuleDict({t: experts(o.task_experts, feature_shape, o.hidden) for t in tasks})
        self.gates = nn.ModuleDict({t: SoftmaxGate(c, o.shared_experts + o.task_experts, pool) for t in tasks})
        self.shared_gate = SoftmaxGate(c, o.shared_experts + len(tasks) * o.task_experts, pool)

    def forward(self, xs: torch.Tensor, xt: dict) -> tuple[torch.Tensor, dict]:
        so = [e(xs) for e in self.shared]
        to = {t: [e(xt[t]) for e in self.own[t]] for t in self.own}
        new = {t: mix(self.gates[t](xt[t]), torch.stack(so + to[t], dim=1)) for t in self.own}
        every = so + [y for t in self.own for y in to[t]]
        return mix(self.shared_gate(xs), torch.stack(every, dim=1)), new


class PLETrunk(Trunk):
    def __init__(self, backbone, tasks, feature_shape, pool, o: PLEOptions):
        super().__init__(backbone)
        self.tasks = list(tasks)
        self.levels = nn.ModuleList(Level(tasks, feature_shape, pool, o) for _ in range(o.layers - 1))
        self.last_shared = experts(o.shared_experts, feature_shape, o.hidden)

    def forward(self, x):
        f = self.backbone(x)
        xs, xt = f, {t: f for t in self.tasks}
        for level in self.levels:
            xs, xt = level(xs, xt)
        return torch.stack([xt[t] for t in self.tasks] + [e(xs) for e in self.last_shared], dim=1)


class PLETower(nn.Module):
    def __init__(self, slot: int, num_tasks: int, own: nn.ModuleList, gate: SoftmaxGate):
        super().__init__()
        self.slot, self.num_tasks, self.experts, self.gate = slot, num_tasks, own, gate

    def forward(self, shared):
        pieces = shared.split([1] * self.num_tasks + [shared.shape[1] - self.num_tasks], dim=1)  # see features_and_experts
        x = pieces[self.slot].squeeze(1)
        outputs = torch.cat([pieces[-1], torch.stack([e(x) for e in self.experts], dim=1)], dim=1)
        return mix(self.gate(x), outputs)


class PLE(Architecture):
    name = "ple"
    summary = "progressive levels of shared and task-specific experts, with a shared path between levels"
    Options = PLEOptions

    @classmethod
    def check(cls, cfg):
        errors = expert_counts(cfg, 1)
        if int(cfg.model.architecture.options.get("layers", 2)) < 2:
            errors.append("model.architecture.options.layers: needs at least 2 levels (one level is "
                          "model.architecture.name=cgc)")
        return errors

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        c, pool = feature_channels(feature_shape), getattr(backbone, "pool", "mean")
        trunk = PLETrunk(backbone, tasks, feature_shape, pool, options)
        n = options.shared_experts + options.task_experts
        return trunk, {t: PLETower(i, len(tasks), experts(options.task_experts, feature_shape, options.hidden),
                                   SoftmaxGate(c, n, pool)) for i, t in enumerate(tasks)}
