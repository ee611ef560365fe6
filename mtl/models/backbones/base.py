"""What a backbone is: the shared network every task head reads, one file per backbone.

A backbone is a module in ``mtl/models/backbones/`` (or a file the config names in ``backbone_modules``) defining a
``Backbone`` subclass with a ``name``: ``model.backbone.name`` picks it. It declares

- ``consumes``: the batch field it reads (``"image"``: (B, 3, H, W) images; ``"graph"``: a graph batch);
- ``build(cfg)``: the module, from the config (``model.backbone``; its own options in ``model.backbone.options``,
  declared by an ``Options`` dataclass and checked like every config key; ``check(cfg)`` adds its own checks);
- ``feature_shape(cfg)``: the shape of the features it gives per item, which the heads are built for
  (``BuildInfo.feature_shape``). Three kinds (``feature_kind``): a map ``(C, h, w)`` (a CNN), a token sequence
  ``(N, C)`` (a vision transformer: the cross-attention memory as it is) or a vector ``(C,)`` (a graph network's
  readout). A head that wants one vector per item pools them with ``pool_features``: a map's mean over (h, w), a
  token sequence's token 0 or mean (the backbone's ``pool``: ``"cls"`` or ``"mean"``, as the model defines it).
- ``blocks()``: its repeated units in forward order, named from the backbone (a transformer's blocks, a CNN's
  stages). FSDP2 shards each on its own, ``model.activation_checkpointing`` and ``model.compile`` wrap each,
  ``optim.layer_decay`` counts depth in them and ``model.backbone.freeze_blocks`` freezes the first N. Default: none
  declared (FSDP2 then splits the backbone by its children, ``mtl.parallel.fsdp.shard_units``).

``forward(x)`` maps ``batch[consumes]`` to the features (B, *feature_shape). Every head reads that one tensor, so it
is the single tensor at which the ``feature_leaf`` strategy splits the graph.

A class may serve several names (a torchvision family: ``resnet18`` ... ``resnet152``): it lists them in
``variants``, and each is a ``model.backbone.name`` of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.config.keys import NoOptions, options_of
from mtl.errors import ConfigError

FEATURE_KINDS = {3: "map", 2: "tokens", 1: "vector"}  # len(feature_shape) -> kind
POOLS = ("cls", "mean")


def feature_kind(shape: tuple[int, ...]) -> str:
    """``"map"`` for (C, h, w), ``"tokens"`` for (N, C), ``"vector"`` for (C,)."""
    if len(shape) not in FEATURE_KINDS:
        raise ValueError(f"a backbone's feature_shape is (C, h, w), (N, C) or (C,), not {tuple(shape)}")
    return FEATURE_KINDS[len(shape)]


def feature_channels(shape: tuple[int, ...]) -> int:
    """C, the width of one feature vector: a map's channels, a token's width, a vector's length."""
    return int(shape[-1] if feature_kind(shape) == "tokens" else shape[0])


def pool_features(features: torch.Tensor, pool: str = "mean") -> torch.Tensor:
    """(B, C): one vector per item. A map (B, C, h, w): the mean over (h, w). Tokens (B, N, C): token 0 for
    ``pool="cls"``, the mean over the tokens for ``"mean"``. A vector (B, C): as it is."""
    if features.dim() == 4:
        return features.mean(dim=(2, 3))
    if features.dim() == 3:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, not {pool!r}")
        return features[:, 0] if pool == "cls" else features.mean(dim=1)
    if features.dim() == 2:
        return features
    raise ValueError(f"features of shape {tuple(features.shape)} are not (B, C, h, w), (B, N, C) or (B, C)")


class Backbone(nn.Module):
    name: str = ""  # model.backbone.name (a family's name when it lists ``variants``)
    variants: tuple[str, ...] = ()  # the names a class serving several networks answers to (else ``name``)
    consumes: str = "image"  # the batch field forward reads
    Options: type = NoOptions  # model.backbone.options
    pool: str = "mean"  # token features: the vector a pooling head reads ("cls": token 0, "mean"); see pool_features

    @classmethod
    def build(cls, cfg) -> Backbone:
        """The backbone for the run's config (``cfg.model.backbone``)."""
        raise NotImplementedError(f"{cls.__name__} must define build(cfg)")

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this backbone (each one names the key and the fix)."""
        return []

    @classmethod
    def refuse_unchecked(cls, cfg) -> None:
        """Raise one ConfigError with ``check(cfg)``'s messages, if any: what ``build`` calls first, so that building
        straight from a config (no config checks before it) refuses what the checks refuse."""
        errors = cls.check(cfg)
        if errors:
            raise ConfigError(errors)

    @classmethod
    def options_from(cls, cfg):
        """This backbone's ``Options`` filled from ``model.backbone.options``."""
        return options_of(cls.Options, cfg.model.backbone.get("options"), "model.backbone.options")

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The repeated units in forward order, as (name relative to the backbone, module). Default: none."""
        return []

    def stages(self) -> list[tuple[str, nn.Module]]:
        """The whole forward as modules applied one after the other, (name relative to the backbone, module):
        ``forward(x)`` is the last applied to ... the first applied to x, and the declared blocks are among them. What
        an architecture that runs several copies of the backbone in step needs (``cross_stitch``). Default: none
        declared (such an architecture is refused)."""
        return []

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
