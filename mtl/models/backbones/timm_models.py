"""``timm``: a timm model, ``timm.create_model(options.model, pretrained=False, num_classes=0)``, with weights from a
local file (``model.backbone.pretrained``: a ``.safetensors``/``.bin``/``.pth`` state dict, or a folder that timm's
``save_pretrained``/``push_to_hub`` wrote: ``model.safetensors`` or ``pytorch_model.bin``). Nothing is downloaded.

Features: ``forward_features`` exactly: a CNN's last-stage map (B, C, h, w), or a ViT-like model's token sequence
(B, N, C) (``pool`` "cls" where the model has a class token and pools it, else "mean"). The classifier head is
removed (``num_classes=0``); parameters ``forward_features`` does not use (a ViT's ``fc_norm``/head norm) are
deleted (replaced by ``nn.Identity``), so DDP sees no parameter without a gradient. BatchNorm layers follow
``model.backbone.norm`` (batch | group | frozen | sync) as the torchvision backbones do (``convert_norm``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os

from torch import nn

from mtl.errors import ConfigError
from mtl.models.backbones.base import Backbone
from mtl.models.backbones.torchvision_cnn import NORMS, _read_state_dict, convert_norm

INSTALL = "pip install -c constraints.txt -e '.[vision]'"
KEY = "model.backbone.pretrained"
UNUSED = ("fc_norm", "head_drop", "head", "attn_pool")  # parts forward_head uses and forward_features does not


@dataclasses.dataclass
class TimmOptions:
    model: str = "resnet18"  # the timm model name (timm.list_models())
    img_size: int | None = None  # ViT-like models: the input size their position embeddings are built for
    patch_size: int | None = None  # ViT-like models
    embed_dim: int | None = None  # ViT-like models: a smaller width
    depth: int | None = None  # ViT-like models: fewer blocks
    num_heads: int | None = None  # ViT-like models
    drop_path_rate: float = 0.0  # stochastic depth


def import_timm():
    try:
        import timm
    except ImportError:
        raise ConfigError(f"model.backbone.name: timm is not installed; install it with `{INSTALL}`") from None
    if timm is None:
        raise ConfigError(f"model.backbone.name: timm is not installed; install it with `{INSTALL}`")
    return timm


def _weights_file(path: str) -> str:
    if os.path.isdir(path):
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise ConfigError(f"{KEY}: folder {path!r} has no model.safetensors or pytorch_model.bin (a timm "
                          "save_pretrained folder); point it at such a folder or a weights file")
    return path


def load_weights(model: nn.Module, path: str) -> None:
    """Load the state dict in ``path`` (file or timm folder) into ``model``; ConfigError naming the file when keys
    are missing or unexpected (beyond the removed classifier) or shapes differ."""
    file = _weights_file(path)
    try:
        state = _read_state_dict(file)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.backbone.weights", KEY)) from None
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own or k.split(".")[0] not in UNUSED + ("fc", "classifier")}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise ConfigError(f"{KEY}: {file!r} is not a {type(model).__name__} of these options' shape "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]}); point it "
                          "at this model's weights or set model.backbone.options.model to the file's model")
    model.load_state_dict(state)


class TimmBackbone(Backbone):
    """A timm model (``self.model``) whose features are its ``forward_features``."""

    name = "timm"
    reads = ("model.backbone.pretrained", "model.backbone.freeze_blocks", "model.backbone.norm")
    Options = TimmOptions

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        token_pool = getattr(model, "global_pool", None) == "token" and getattr(model, "cls_token", None) is not None
        self.pool = "cls" if token_pool else "mean"

    @classmethod
    def check(cls, cfg):
        norm = cfg.model.backbone.norm
        if norm not in NORMS:
            return [f"model.backbone.norm: {norm!r} is not one of {', '.join(NORMS)}"]
        return []

    @classmethod
    def build(cls, cfg):
        cls.refuse_unchecked(cfg)
        timm = import_timm()
        opts = cls.options_from(cfg)
        if opts.model not in timm.list_models():
            close = difflib.get_close_matches(opts.model, timm.list_models(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (see timm.list_models())"
            raise ConfigError(f"model.backbone.options.model: {opts.model!r} is not a timm model{hint}")
        kwargs = {k: v for k, v in dataclasses.asdict(opts).items() if k != "model" and v is not None}
        try:
            model = timm.create_model(opts.model, pretrained=False, num_classes=0, **kwargs)
        except TypeError as e:
            raise ConfigError(f"model.backbone.options: the timm model {opts.model!r} does not take these options "
                              f"({e}); remove them") from None
        for part in UNUSED:
            if isinstance(getattr(model, part, None), nn.Module):
                setattr(model, part, nn.Identity())
        pretrained = cfg.model.backbone.pretrained
        if pretrained:
            load_weights(model, str(pretrained))
        return cls(convert_norm(model, cfg.model.backbone.norm))

    def forward(self, x):
        return self.model.forward_features(x)

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The model's blocks (ViT), stages (ConvNeXt, ...) or layer1..4 (ResNet), in forward order."""
        for attr in ("blocks", "stages"):
            seq = getattr(self.model, attr, None)
            if isinstance(seq, (nn.Sequential, nn.ModuleList)) and len(seq):
                return [(f"model.{attr}.{i}", m) for i, m in enumerate(seq)]
        return [(f"model.{n}", getattr(self.model, n)) for n in ("layer1", "layer2", "layer3", "layer4")
                if isinstance(getattr(self.model, n, None), nn.Module)]
