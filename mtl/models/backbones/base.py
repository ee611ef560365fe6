"""What a backbone is: the shared network every task head reads, one file per backbone.

A backbone is a module in ``mtl/models/backbones/`` (or a file the config names in ``backbone_modules``) defining a
``Backbone`` subclass with a ``name``: ``model.backbone.name`` picks it. It declares

- ``consumes``: the batch field it reads (``"image"``: (B, 3, H, W) images; ``"graph"``: a graph batch);
- ``build(cfg)``: the module, from the config (``model.backbone``; its own options in ``model.backbone.options``,
  declared by an ``Options`` dataclass and checked like every config key; ``check(cfg)`` adds its own checks);
- ``feature_shape(cfg)``: the shape of the features it gives per item, ``(C, h, w)`` for a feature map or ``(C,)``
  for a vector, which the heads are built for (``BuildInfo.feature_channels`` and ``feature_hw``).

``forward(x)`` maps ``batch[consumes]`` to the features (B, *feature_shape). Every head reads that one tensor, so it
is the single tensor at which the ``feature_leaf`` strategy splits the graph.

A class may serve several names (a torchvision family: ``resnet18`` ... ``resnet152``): it lists them in
``variants``, and each is a ``model.backbone.name`` of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.config.schema import NoOptions, options_of


class Backbone(nn.Module):
    name: str = ""  # model.backbone.name (a family's name when it lists ``variants``)
    variants: tuple[str, ...] = ()  # the names a class serving several networks answers to (else ``name``)
    consumes: str = "image"  # the batch field forward reads
    Options: type = NoOptions  # model.backbone.options

    @classmethod
    def build(cls, cfg) -> Backbone:
        """The backbone for the run's config (``cfg.model.backbone``)."""
        raise NotImplementedError(f"{cls.__name__} must define build(cfg)")

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this backbone (each one names the key and the fix)."""
        return []

    @classmethod
    def options_from(cls, cfg):
        """This backbone's ``Options`` filled from ``model.backbone.options``."""
        return options_of(cls.Options, cfg.model.backbone.get("options"), "model.backbone.options")

    @torch.no_grad()
    def feature_shape(self, cfg) -> tuple[int, ...]:
        """The features' shape per item. An image backbone: (C, h, w), from one zero image of ``data.image_size``
        run in eval mode (the module's mode is restored). Another input: override it."""
        if self.consumes != "image":
            raise NotImplementedError(f"{type(self).__name__} reads {self.consumes!r} and must define feature_shape")
        was = self.training
        self.eval()
        try:
            size = cfg.data.image_size
            return tuple(self(torch.zeros(1, 3, size, size)).shape[1:])
        finally:
            self.train(was)


def input_device_type(x) -> str:
    """The device type of a backbone's input ``batch[consumes]`` (autocast's): a tensor's, or a graph batch's ``x``."""
    device = getattr(x, "device", None)
    if device is None and hasattr(x, "x"):
        device = x.x.device
    return torch.device(device or "cpu").type
