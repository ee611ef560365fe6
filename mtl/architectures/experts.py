"""The pieces the mixture-of-experts architectures share (``mmoe``, ``cgc``, ``ple``, ``dselect_k``).

An expert here sits on the backbone's features and keeps their kind: a two-layer MLP (Linear, ReLU, Linear) over
the channel dimension, at every position of a map (a 1x1-conv pair), every token, or the one vector, so each head
reads what it would read from the backbone. A gate reads one vector per item (``pool_features``: a map's mean, a
transformer's CLS or mean token) and gives each item a weight per expert; a task's features are the weighted sum
of the experts' outputs for that item.

The shared tensor stacks what the towers read along dimension 1: ``(B, 1 + E, *feature_shape)``, slot 0 the
backbone's features (the gates' input), slots 1.. the shared experts' outputs. One tensor, so every strategy splits
the graph there as it does at the backbone's output under ``hps``.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.architectures.base import Trunk
from mtl.models.backbones.base import feature_channels, pool_features


class Expert(nn.Module):
    """Linear(C, H), ReLU, Linear(H, C) over the channel dimension of (B, C, h, w), (B, N, C) or (B, C) features."""

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.inner = nn.Linear(channels, hidden)
        self.outer = nn.Linear(hidden, channels)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        if f.dim() == 4:  # a map: channels first
            return self.outer(torch.relu(self.inner(f.movedim(1, -1)))).movedim(-1, 1)
        return self.outer(torch.relu(self.inner(f)))


def experts(n: int, feature_shape: tuple[int, ...], hidden: int) -> nn.ModuleList:
    c = feature_channels(feature_shape)
    return nn.ModuleList(Expert(c, hidden or c) for _ in range(n))


def features_and_experts(shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot 0 (the features) and slots 1.. (the shared experts' outputs) of an ``ExpertTrunk``'s tensor. A split, not
    two slices: its backward joins the two gradients, where each slice's would fill a zero tensor of the whole
    shared tensor (measured: most of a step's time on the main job's map, ``python -m mtl.tools.bench.libmtl``)."""
    f, outputs = shared.split([1, shared.shape[1] - 1], dim=1)
    return f.squeeze(1), outputs


def mix(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """sum_e weights[b, e] * outputs[b, e]: weights (B, E), outputs (B, E, *S) -> (B, *S)."""
    weights = weights.to(outputs.dtype)
    if outputs.dim() == 3:  # vectors: the product and the sum beat a batch of (1, E) @ (E, C) products
        return (weights.unsqueeze(-1) * outputs).sum(1)
    # maps and tokens: (B, 1, E) @ (B, E, prod S), with no (B, E, *S) temporary (python -m mtl.tools.bench.libmtl)
    return torch.bmm(weights.unsqueeze(1), outputs.flatten(2)).view(outputs.shape[0], *outputs.shape[2:])


class ExpertTrunk(Trunk):
    """The backbone, then the shared experts on its features: ``(B, 1 + E, *S)``, slot 0 the features."""

    def __init__(self, backbone: nn.Module, shared: nn.ModuleList):
        super().__init__(backbone)
        self.experts = shared

    def forward(self, x) -> torch.Tensor:
        f = self.backbone(x)
        return torch.stack([f, *(e(f) for e in self.experts)], dim=1)


class SoftmaxGate(nn.Module):
    """One task's gate: softmax(Linear(pooled features)) over ``n`` experts, (B, n)."""

    def __init__(self, channels: int, n: int, pool: str):
        super().__init__()
        self.linear, self.pool = nn.Linear(channels, n), pool

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(pool_features(f, self.pool)).float(), dim=-1)


class GatedTower(nn.Module):
    """A task's tower over an ``ExpertTrunk``'s tensor: its gate (reading the features) mixes the shared experts."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate = gate

    def forward(self, shared):
        f, outputs = features_and_experts(shared)
        return mix(self.gate(f), outputs)
