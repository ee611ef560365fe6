"""``mtan``: Multi-Task Attention Network (Liu, Johns and Davison, CVPR 2019), on the backbone's declared blocks.

The backbone is shared whole; each task has an attention module per block (``Backbone.blocks()``: a CNN's stages,
a transformer's layers) that selects from that block's output p_j with a soft mask (eq. 1 of the paper)::

    a_1 = g_1(p_1) * p_1,      a_j = g_j([p_j ; f_j(a_{j-1})]) * p_j      (j = 2 .. J; the last uses the features)

where g_j is two 1x1 layers (the second with J's width, a sigmoid) and f_j maps the task's previous attended
features to block j's shape (a 3x3 convolution then pooling to its size, as the paper's shared "f" conv and
pooling; for tokens a linear layer). At the last block the mask is applied to the backbone's features (of the last
block's shape: a ResNet's last stage; a ViT's normed last layer), so every head reads the backbone's feature kind.

What is shared: the backbone. The shared tensor is every block's output and the features, flattened and
concatenated (B, sum_j numel(p_j) + numel(f)): each task's gradient of it is its pull on every block's output, so
the features source weighs the tasks on all of them at once. The towers are the attention modules.

Deviations from the paper, each for mtl's contract: the mask's input u_j is the block's output p_j (the paper's
is the block's intermediate features: a backbone declares its blocks, not their insides), and there is no
BatchNorm in g_j and f_j (it normalises with the local batch, so 2 processes would not equal 1; the backbones'
own norm follows ``model.backbone.norm``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mtl.architectures.base import Architecture, Trunk
from mtl.errors import ConfigError


class MTANTrunk(Trunk):
    """The backbone, with each declared block's output caught by a forward hook; forward gives them and the
    features, flattened and concatenated."""

    def __init__(self, backbone: nn.Module, shapes: list[tuple[int, ...]], feature_shape: tuple[int, ...]):
        super().__init__(backbone)
        self.shapes, self.feature_shape = [tuple(s) for s in shapes], tuple(feature_shape)
        self._caught: list[torch.Tensor] | None = None
        for _, block in backbone.blocks():
            block.register_forward_hook(self._catch)

    def _catch(self, module, args, output):
        if self._caught is not None:  # a recomputation (activation checkpointing) runs outside forward: not caught
            self._caught.append(output[0] if isinstance(output, tuple) else output)

    def forward(self, x):
        self._caught = []
        try:
            f = self.backbone(x)
            outs = self._caught
        finally:
            self._caught = None
        if len(outs) != len(self.shapes):
            raise RuntimeError(f"mtan: {len(outs)} block outputs caught, {len(self.shapes)} declared")
        return torch.cat([o.flatten(1) for o in outs] + [f.flatten(1)], dim=1)



def split(shared: torch.Tensor, shapes, feature_shape) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each block's output, the features) from the shared tensor ``MTANTrunk`` gives."""
    sizes = [math.prod(s) for s in shapes] + [math.prod(feature_shape)]
    parts = torch.split(shared, sizes, dim=1)
    b = shared.shape[0]
    return [p.reshape(b, *s) for p, s in zip(parts, shapes)], parts[-1].reshape(b, *feature_shape)


def _channels(shape) -> int:
    return shape[0] if len(shape) == 3 else shape[-1]


class Attention(nn.Module):
    """g_j: [p_j ; f_j(a_{j-1})] -> a mask of p_j's shape in (0, 1): two 1x1 layers, ReLU between, sigmoid after."""

    def __init__(self, c_in: int, c_out: int, conv: bool):
        super().__init__()
        layer = (lambda i, o: nn.Conv2d(i, o, 1)) if conv else nn.Linear
        self.inner, self.outer, self.conv = layer(c_in, c_out), layer(c_out, c_out), conv

    def forward(self, x):
        return torch.sigmoid(self.outer(torch.relu(self.inner(x))))


class Carry(nn.Module):
    """f_j: the task's attended features of block j - 1 to block j's shape (3x3 conv + ReLU + pooling; tokens: a
    linear layer + ReLU)."""

    def __init__(self, before: tuple[int, ...], after: tuple[int, ...]):
        super().__init__()
        self.size = tuple(after[1:]) if len(after) == 3 else None
        self.layer = (nn.Conv2d(before[0], after[0], 3, padding=1) if len(after) == 3
                      else nn.Linear(before[-1], after[-1]))

    def forward(self, a):
        y = torch.relu(self.layer(a))
        return F.adaptive_avg_pool2d(y, self.size) if self.size is not None else y


class MTANTower(nn.Module):
    def __init__(self, trunk: MTANTrunk):
        super().__init__()
        shapes, conv = trunk.shapes, len(trunk.feature_shape) == 3
        self.shapes, self.feature_shape = shapes, trunk.feature_shape
        self.attention = nn.ModuleList(
            Attention(_channels(s) * (1 if j == 0 else 2), _channels(s), conv) for j, s in enumerate(shapes))
        self.carry = nn.ModuleList(Carry(shapes[j - 1], shapes[j]) for j in range(1, len(shapes)))

    def forward(self, shared):
        outs, features = split(shared, self.shapes, self.feature_shape)
        a = None
        for j, p in enumerate(outs):
            x = p if a is None else torch.cat([p, self.carry[j - 1](a)], dim=1 if p.dim() == 4 else -1)
            target = features if j == len(outs) - 1 else p
            a = self.attention[j](x) * target
        return a


class MTAN(Architecture):
    name = "mtan"
    summary = "the backbone shared whole; each task's attention module per backbone block selects from its output"

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        blocks = backbone.blocks() if hasattr(backbone, "blocks") else []
        if not blocks or getattr(backbone, "consumes", "image") != "image":
            raise ConfigError(f"model.architecture.name=mtan: the backbone {type(backbone).__name__} declares no "
                              "blocks over images (Backbone.blocks()), and MTAN attends to each block's output; use "
                              "a backbone that declares them (the torchvision ones, hf_vision, timm)")
        shapes = block_shapes(backbone, blocks, int(cfg.data.image_size))
        problem = _shape_problem(shapes, tuple(feature_shape))
        if problem:
            raise ConfigError(f"model.architecture.name=mtan: {problem}")
        trunk = MTANTrunk(backbone, shapes, feature_shape)
        return trunk, {t: MTANTower(trunk) for t in tasks}


@torch.no_grad()
def block_shapes(backbone: nn.Module, blocks, image_size: int) -> list[tuple[int, ...]]:
    """Each declared block's output shape per item, from one zero image run in eval mode (its mode restored)."""
    caught = []
    hooks = [m.register_forward_hook(lambda mod, a, out: caught.append(out[0] if isinstance(out, tuple) else out))
             for _, m in blocks]
    was = backbone.training
    backbone.eval()
    try:
        backbone(torch.zeros(1, 3, image_size, image_size))
    finally:
        backbone.train(was)
        for h in hooks:
            h.remove()
    return [tuple(o.shape[1:]) for o in caught]


def _shape_problem(shapes, feature_shape) -> str | None:
    kinds = {len(s) for s in shapes}
    if kinds - {2, 3} or len(kinds) > 1 or len(feature_shape) != len(shapes[-1]):
        return (f"its blocks' outputs {shapes} and features {feature_shape} are not all maps (C, h, w) or all token "
                "sequences (N, C)")
    if shapes[-1] != feature_shape:
        return f"the last block's output {shapes[-1]} is not the features' shape {feature_shape}"
    if len(feature_shape) == 2 and len({s[0] for s in shapes}) > 1:
        return f"its blocks' token counts differ ({[s[0] for s in shapes]})"
    return None
