"""The torchvision image backbones: a torchvision classification network cut before its pooling.

Each maps images (B, 3, H, W) to a feature map (B, C, h, w), with ``out_channels = C``. Two ``Backbone`` plug-ins
serve the families by name (``variants``): ``ResNetTrunk`` and ``FeaturesTrunk``. Their config keys are
``model.backbone.name``, ``weights``, ``norm`` and ``stages``.

Supported families: ResNet/ResNeXt/Wide-ResNet (``resnet18`` ... ``resnet152``), ConvNeXt
(``convnext_tiny`` ...), and the ``.features``-style CNNs (EfficientNet, MobileNet, RegNet-free VGG,
...). ``stages`` keeps only the first N stages (ResNet: layer1..layerN; ConvNeXt: N stages), which
gives a smaller network with a finer feature map: useful for the small built-in images.
"""

from __future__ import annotations

import difflib
import os

import torch
from torch import nn

from mtl.errors import ConfigError
from mtl.models.backbones.base import Backbone
from mtl.registry import unknown_name

RESNETS = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
           "resnext101_32x8d", "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2"}
CONVNEXTS = {"convnext_tiny", "convnext_small", "convnext_base", "convnext_large"}
FEATURE_CNNS = {"efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3",
                "efficientnet_v2_s", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
                "vgg11_bn", "vgg16_bn"}
SUPPORTED = sorted(RESNETS | CONVNEXTS | FEATURE_CNNS)
NORMS = ("batch", "group", "frozen", "sync")


class TorchvisionTrunk(Backbone):
    """A torchvision family (its names in ``variants``), built from ``model.backbone.name``, ``weights``, ``norm`` and
    ``stages``."""

    reads = ("model.backbone.weights", "model.backbone.norm", "model.backbone.stages",
             "model.backbone.freeze_blocks")  # mtl/config/read_rules.py

    @classmethod
    def build(cls, cfg):
        b = cfg.model.backbone
        return build_torchvision_backbone(b.name, b.weights, b.norm, b.stages)

    @classmethod
    def check(cls, cfg):
        norm = cfg.model.backbone.norm
        close = difflib.get_close_matches(str(norm), NORMS, n=1, cutoff=0.6)  # a "did you mean", as every enum key
        return [] if norm in NORMS else [f"model.backbone.norm: {norm!r} is not one of {', '.join(NORMS)}"
                                         + (f" — did you mean {close[0]!r}?" if close else "")]


class ResNetTrunk(TorchvisionTrunk):
    name = "resnet"
    variants = tuple(sorted(RESNETS))

    def __init__(self, net: nn.Module, stages: int):
        super().__init__()
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        layers = [net.layer1, net.layer2, net.layer3, net.layer4][:stages]
        self.layers = nn.Sequential(*layers)
        last = layers[-1][-1]
        self.out_channels = (last.bn3 if hasattr(last, "bn3") else last.bn2).num_features

    def forward(self, x):
        return self.layers(self.stem(x))

    def blocks(self):
        """Its stages (layer1..layerN); the stem runs before them."""
        return [(f"layers.{i}", m) for i, m in enumerate(self.layers)]

    def stages(self):
        return [("stem", self.stem), *self.blocks()]


class FeaturesTrunk(TorchvisionTrunk):
    """Networks whose ``.features`` Sequential is the whole convolutional trunk (ConvNeXt, EfficientNet, ...)."""

    name = "features"
    variants = tuple(sorted(CONVNEXTS | FEATURE_CNNS))

    def __init__(self, features: nn.Sequential):
        super().__init__()
        self.features = features
        with torch.no_grad():
            was = features.training
            features.eval()
            self.out_channels = features(torch.zeros(1, 3, 64, 64)).shape[1]
            features.train(was)

    def forward(self, x):
        return self.features(x)

    def blocks(self):
        """The children of ``.features`` that hold parameters (a ConvNeXt's stem, stages and downsampling layers, an
        EfficientNet's stem conv, stages and last conv), in forward order."""
        return [(f"features.{name}", m) for name, m in self.features.named_children() if any(True for _ in m.parameters())]

    def stages(self):
        return [(f"features.{name}", m) for name, m in self.features.named_children()]


def _load_weights(name: str, weights: str | None) -> nn.Module:
    import torchvision  # here, not at the top: a process that only checks a config (mtl.tools.launch) skips its 1.2 s

    if weights is None:
        return torchvision.models.get_model(name, weights=None)
    if os.path.sep in weights or weights.endswith((".pt", ".pth", ".safetensors", ".bin")):
        net = torchvision.models.get_model(name, weights=None)
        state = _read_state_dict(weights)
        if any(k.startswith("backbone.") for k in state) and any(k.startswith("heads.") for k in state):
            raise ConfigError(f"model.backbone.weights: {weights!r} is a whole mtl model (backbone and heads), not "
                              f"torchvision {name} weights; to start a new run from it set init_from={weights} "
                              "and model.backbone.weights=null")
        missing, unexpected = net.load_state_dict(state, strict=False)
        # the classifier may be absent or of another size: we cut it off anyway
        bad = [k for k in missing if not k.startswith(("fc.", "classifier.", "heads."))]
        if bad or unexpected:
            raise ConfigError(
                f"model.backbone.weights: {weights!r} does not fit {name}: "
                f"{len(bad)} missing keys (e.g. {bad[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        return net
    try:
        enum = torchvision.models.get_model_weights(name)[weights]
    except KeyError:
        names = [w.name for w in torchvision.models.get_model_weights(name)] + ["DEFAULT"]
        raise ConfigError(
            f"model.backbone.weights: {weights!r} is neither a local file nor a torchvision weights name for "
            f"{name} (known: {', '.join(names)})"
        ) from None
    try:
        return torchvision.models.get_model(name, weights=enum)
    except Exception as e:  # no network, proxy, corrupt cache ...
        raise ConfigError(
            f"model.backbone.weights: could not download {name} weights {weights!r} ({type(e).__name__}: {e}). "
            "Download them where a network is available and pass the file path instead, or set weights: null"
        ) from None


def _read_state_dict(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"model.backbone.weights: file {path!r} does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"model.backbone.weights: cannot read {path!r} as a state dict: {e}") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"model.backbone.weights: {path!r} holds no state dict")
    return state


def _group_count(channels: int) -> int:
    for g in (32, 16, 8, 4, 2, 1):
        if channels % g == 0:
            return g
    return 1


def convert_norm(module: nn.Module, norm: str) -> nn.Module:
    """Swap BatchNorm2d layers for a rank-independent norm (group/frozen) or SyncBatchNorm."""
    if norm == "batch":
        return module
    if norm == "sync":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            if norm == "group":
                new = nn.GroupNorm(_group_count(child.num_features), child.num_features, affine=True)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    new.bias.copy_(child.bias)
            else:  # frozen: keep the (possibly pretrained) statistics, train nothing in the norm
                from torchvision.ops import FrozenBatchNorm2d

                new = FrozenBatchNorm2d(child.num_features, eps=child.eps)
                with torch.no_grad():
                    for k in ("weight", "bias", "running_mean", "running_var"):
                        getattr(new, k).copy_(getattr(child, k))
            setattr(module, name, new)
        else:
            convert_norm(child, norm)
    return module


def build_torchvision_backbone(name: str, weights: str | None = None, norm: str = "batch",
                               stages: int = 4) -> Backbone:
    if name not in SUPPORTED:
        raise ConfigError(unknown_name("model.backbone.name", "backbone", name, SUPPORTED))
    if norm not in NORMS:
        raise ConfigError(f"model.backbone.norm: {norm!r} is not one of {', '.join(NORMS)}")
    net = _load_weights(name, weights)
    if name in RESNETS:
        if not 1 <= stages <= 4:
            raise ConfigError(f"model.backbone.stages: {stages} must be 1..4 for {name}")
        trunk = ResNetTrunk(net, stages)
    elif name in CONVNEXTS:
        if not 1 <= stages <= 4:
            raise ConfigError(f"model.backbone.stages: {stages} must be 1..4 for {name}")
        trunk = FeaturesTrunk(net.features[: 2 * stages])
    else:
        if stages != 4:
            raise ConfigError(f"model.backbone.stages: {name} supports only the full trunk (stages: 4)")
        trunk = FeaturesTrunk(net.features)
    return convert_norm(trunk, norm)
