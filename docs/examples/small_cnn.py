"""A new backbone in one file: a small convolutional network, written from scratch.

Nothing else in mtl is edited to add it. Name the file in the config and pick the backbone:

    backbone_modules: [docs/examples/small_cnn.py]   # a path from this config file's folder, or a module name
    model:
      backbone:
        name: small_cnn
        options: {width: 32, blocks: 2}              # optional: this backbone's own, checked, options

It declares what it reads (``consumes = "image"``: the batch's (B, 3, H, W) images) and the shape of what it gives
(``feature_shape``: (C, h, w)); the task heads are built for that shape. A graph backbone reads ``"graph"`` and
gives (C,) per item instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mtl.models.backbones import Backbone


@dataclass
class SmallCNNOptions:
    width: int = 32  # channels of the first block; each further block doubles them
    blocks: int = 2  # conv-norm-relu blocks, each halving the resolution


class SmallCNN(Backbone):
    name = "small_cnn"             # model.backbone.name
    consumes = "image"             # the batch field it reads
    Options = SmallCNNOptions      # model.backbone.options

    @classmethod
    def check(cls, cfg):
        o = cls.options_from(cfg)
        return [] if o.width > 0 and o.blocks > 0 else [
            f"model.backbone.options: width and blocks must be > 0 (got {o.width}, {o.blocks})"]

    @classmethod
    def build(cls, cfg):
        return cls(cls.options_from(cfg))

    def __init__(self, options: SmallCNNOptions):
        super().__init__()
        layers, c_in = [], 3
        for i in range(options.blocks):
            c_out = options.width * 2 ** i
            # GroupNorm: a sample's features do not depend on the rest of its rank's batch (2 ranks = 1 process)
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.GroupNorm(4, c_out), nn.ReLU()]
            c_in = c_out
        self.body = nn.Sequential(*layers)
        self.out_channels = c_in

    def feature_shape(self, cfg):
        h = cfg.data.image_size
        for _ in range(len(self.body) // 3):
            h = (h + 1) // 2  # stride 2, padding 1, kernel 3
        return (self.out_channels, h, h)

    def forward(self, images):
        return self.body(images)
