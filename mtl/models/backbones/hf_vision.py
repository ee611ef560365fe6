"""``hf_vision``: a transformers vision model from a local folder, through its Auto classes.

``model.backbone.pretrained: DIR`` loads the folder's weights; ``model.backbone.config: DIR`` builds random weights of
the shape its ``config.json`` gives (exactly one of the two). Nothing is downloaded (``local_files_only=True``).
Supported: ViT, DeiT, DINOv2, CLIP's and SigLIP's vision towers (a full CLIP/SigLIP folder: its ``vision_config``),
Swin, ConvNeXt, and other models of transformers' image-feature mapping with a ``last_hidden_state``.

The transformers model is ``self.model``; ``forward(pixel_values)`` returns ``self.model(pixel_values=x)
.last_hidden_state`` exactly: the token sequence (B, N, C). A model whose output is a map (ConvNeXt: (B, C, h, w)) is
flattened to tokens (B, h*w, C). ``pool`` is what a pooling head reads: ``"cls"`` (token 0) for models with a CLS
token (ViT, DeiT, DINOv2, CLIP), ``"mean"`` otherwise (SigLIP, Swin, ConvNeXt). Where this differs from the model's
own pooler: CLIP's pooler applies ``post_layernorm`` to token 0 and DINOv2's is token 0 after the final layernorm (the
same as here); SigLIP's attention-pooling head, ViT's tanh pooler and ConvNeXt's final layernorm are not used. Those
unused pooler parameters are not built (``add_pooling_layer=False``, SigLIP's ``vision_use_head=False``) or, where the
class cannot leave them out (CLIP's ``post_layernorm``, ConvNeXt's ``layernorm``, DINOv2's ``mask_token``), frozen
(``freeze_unused``), so DDP sees no trainable parameter without a gradient; the state dict keeps every key.

Images of another size than the model's (``data.image_size`` against the config's ``image_size``): models with
``interpolate_pos_encoding`` (ViT, DeiT, CLIP, SigLIP, Swin) interpolate their position embeddings, DINOv2 always does,
and models without absolute positions (ConvNeXt) take any size; any other model is refused by name.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn

from mtl.config.json_read import read_json_object
from mtl.data.images import PROCESSOR_FILE
from mtl.errors import ConfigError
from mtl.models.backbones.base import Backbone

CLS_POOLED = {"vit", "deit", "dinov2", "dinov2_with_registers", "clip_vision_model", "beit", "data2vec-vision",
              "vit_mae", "vit_msn", "ijepa"}
ANY_SIZE = {"dinov2", "dinov2_with_registers", "convnext", "convnextv2", "resnet", "regnet", "bit"}  # no fixed positions
TOWERS = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}  # a full folder's vision tower
CARRIED = "backbone"  # the sub-folder of a checkpoint or export that holds the backbone's config.json and processor


def _supported() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_MAPPING_NAMES) | {"clip_vision_model", "siglip_vision_model"} | set(TOWERS)


def source_of(cfg) -> tuple[str, str]:
    """(the config key, the folder) this run's hf_vision model comes from: ``model.backbone.pretrained`` or
    ``model.backbone.config``."""
    b = cfg.model.backbone
    return ("model.backbone.pretrained", b.pretrained) if b.pretrained else ("model.backbone.config", b.config)


def vision_config(folder: str, key: str):
    """The transformers config of the vision model in ``folder`` (a full CLIP/SigLIP folder: its vision tower's).
    ConfigError naming ``key`` when the folder is not a transformers vision model."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    fix = ("point it at a local transformers vision-model folder (e.g. `huggingface-cli download "
           "google/vit-base-patch16-224 --local-dir DIR`)")
    if not folder or not os.path.isdir(folder):
        raise ConfigError(f"{key}: the folder {folder!r} does not exist; {fix}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(f"{key}: {folder!r} has no config.json; {fix}")
    model_type = _model_type(folder, key)
    if model_type not in CONFIG_MAPPING_NAMES:
        what = ("names no model_type" if model_type is None else
                f"names model_type {model_type!r}, which transformers {transformers.__version__} does not know")
        raise ConfigError(f"{key}: {folder!r}/config.json {what}; point it at a transformers vision-model folder "
                          "(ViT, DeiT, DINOv2, CLIP, SigLIP, Swin, ConvNeXt), or install a transformers that has it")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # an unknown model_type, a damaged file ...
        raise ConfigError(f"{key}: cannot read {folder!r}/config.json as a transformers config "
                          f"({type(e).__name__}: {e}); point it at a transformers vision-model folder") from None
    if config.model_type in TOWERS:
        config = config.vision_config
    if config.model_type not in _supported():
        raise ConfigError(f"{key}: {folder!r} holds a {config.model_type!r} model, not a vision model; point it at a "
                          "transformers vision-model folder (ViT, DeiT, DINOv2, CLIP, SigLIP, Swin, ConvNeXt)")
    return config


def _model_type(folder: str, key: str):
    """The ``model_type`` of the folder's config.json (None where it names none); a file that is not a JSON object is
    a ConfigError naming ``key``."""
    data = read_json_object(os.path.join(folder, "config.json"), key, "restore it or point the key at another folder")
    return data.get("model_type")


def model_image_size(config) -> int | None:
    size = getattr(config, "image_size", None)
    return int(size[0] if isinstance(size, (list, tuple)) else size) if size else None


def size_problem(config, image_size: int) -> str | None:
    """Why the model cannot take ``image_size`` images, or None."""
    native = model_image_size(config)
    if native is None or native == image_size or config.model_type in ANY_SIZE or _interpolates(config):
        return None
    return (f"data.image_size: {image_size} is not the size of the {config.model_type!r} model ({native}), which "
            f"cannot interpolate its position embeddings; set data.image_size: {native}")


def _model_class(config):
    import transformers
    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(config.model_type)
    return getattr(transformers, name) if name else AutoModel


def _interpolates(config) -> bool:
    return "interpolate_pos_encoding" in inspect.signature(_model_class(config).forward).parameters


def carried_files(cfg) -> dict[str, bytes]:
    """What each checkpoint of an hf_vision run carries so that its model folder needs no other folder:
    ``backbone/config.json`` (the model's shape; the weights are in model.safetensors) and the folder's
    ``backbone/preprocessor_config.json`` (the input's size and statistics). {} for another backbone."""
    if cfg.model.backbone.name != HFVisionBackbone.name:
        return {}
    key, folder = source_of(cfg)
    out = {}
    for name in ("config.json", PROCESSOR_FILE):
        path = os.path.join(str(folder), name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[f"{CARRIED}/{name}"] = f.read()
    return out


def use_carried_copy(cfg, folder: str) -> bool:
    """Point a model folder's config (``cfg``, in place) at the folder's own ``backbone/`` copy: the backbone is built
    from its config.json (random weights, then the folder's model.safetensors) and normalised with its
    preprocessor_config.json, wherever the run's pretrained folder is now. False where the folder has no copy."""
    copy = os.path.join(folder, CARRIED)
    if cfg.model.backbone.name != HFVisionBackbone.name or not os.path.isfile(os.path.join(copy, "config.json")):
        return False
    cfg.model.backbone.pretrained = None
    cfg.model.backbone.config = copy
    return True


def unused_note(folder: str, unused: list[str]) -> list[str]:
    """The start-up line for the folder's tensors the backbone does not load (a full CLIP or SigLIP folder: its text
    tower, projections and logit scale; SigLIP's vision pooling head; ViT's pooler), counted by their top-level
    part; none when every tensor is loaded."""
    if not unused:
        return []
    parts: dict[str, int] = {}
    for name in unused:
        top = name.split(".")[0]
        parts[top] = parts.get(top, 0) + 1
    text = " (its text tower is not loaded)" if "text_model" in parts else ""
    return [f"model.backbone.pretrained: {len(unused)} tensors of {folder!r} unused{text}: "
            + ", ".join(f"{k} {v}" for k, v in parts.items())]


@torch.no_grad()
def _zero_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def freeze_unused(backbone: nn.Module, image_size: int) -> list[str]:
    """Freeze (``requires_grad=False``) the parameters the features do not depend on (a pooler's or a head's the
    class builds anyway: CLIP's ``post_layernorm``, ConvNeXt's final ``layernorm``, DINOv2's ``mask_token``), found by
    one backward pass of one image in eval mode (no dropout, no BatchNorm update, the RNG untouched); returns their
    names. DDP then sees no trainable parameter without a gradient."""
    was = backbone.training
    backbone.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            backbone(torch.zeros(1, 3, image_size, image_size)).float().sum().backward()
        unused = [n for n, p in backbone.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        _zero_grads(backbone)
        backbone.train(was)
    for n, p in backbone.named_parameters():
        if n in unused:
            p.requires_grad_(False)
    return unused


class HFVisionBackbone(Backbone):
    """A transformers vision model (``self.model``) whose features are its ``last_hidden_state`` tokens."""

    name = "hf_vision"
    reads = ("model.backbone.pretrained", "model.backbone.config", "model.backbone.freeze_blocks")  # mtl/config/read_rules.py

    def __init__(self, model: nn.Module, interpolate: bool = False):
        super().__init__()
        self.model = model
        self.model_type = model.config.model_type
        self.pool = "cls" if self.model_type in CLS_POOLED else "mean"
        self.interpolate = bool(interpolate)  # pass interpolate_pos_encoding=True (images of another size)

    @classmethod
    def check(cls, cfg):
        b = cfg.model.backbone
        if bool(b.pretrained) == bool(b.config):
            return ["model.backbone.pretrained / model.backbone.config: hf_vision needs exactly one of them (pretrained: "
                    "a local transformers vision-model folder, its weights; config: a folder whose config.json gives "
                    f"random weights of that shape); got pretrained={b.pretrained!r}, config={b.config!r}"]
        try:  # the folder holds a transformers vision model (its config.json only: cheap)
            vision_config(*reversed(source_of(cfg)))
        except ConfigError as e:
            return e.errors
        return []

    @classmethod
    def build(cls, cfg):
        cls.refuse_unchecked(cfg)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        key, folder = source_of(cfg)
        config = vision_config(folder, key)
        problem = size_problem(config, int(cfg.data.image_size))
        if problem:
            raise ConfigError(problem)
        if config.model_type == "siglip_vision_model":
            config.vision_use_head = False  # its attention-pooling head: unused (pool "mean")
        klass = _model_class(config)
        kwargs = {"add_pooling_layer": False} if "add_pooling_layer" in inspect.signature(klass.__init__).parameters else {}
        unused: list[str] = []
        try:
            if key == "model.backbone.pretrained":
                model, info = klass.from_pretrained(folder, config=config, local_files_only=True,
                                                    output_loading_info=True, **kwargs)
                unused = sorted(info.get("unexpected_keys") or [])
            else:
                model = klass(config, **kwargs)
        except Exception as e:  # weights that do not fit the config, a damaged file ...
            raise ConfigError(f"{key}: cannot load the {config.model_type!r} model in {folder!r} "
                              f"({type(e).__name__}: {e})") from None
        native = model_image_size(config)
        backbone = cls(model, interpolate=native is not None and native != int(cfg.data.image_size)
                       and _interpolates(config))
        backbone.frozen_unused = freeze_unused(backbone, int(cfg.data.image_size))
        backbone.load_notes = unused_note(folder, unused)
        return backbone

    def forward(self, x):
        kwargs = {"interpolate_pos_encoding": True} if self.interpolate else {}
        out = self.model(pixel_values=x, **kwargs).last_hidden_state
        if out.dim() == 4:  # a map (B, C, h, w) (ConvNeXt): one token per cell
            out = out.flatten(2).transpose(1, 2)
        return out

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The encoder's transformer layers (ViT, DeiT, DINOv2, CLIP, SigLIP), or its stages (Swin, ConvNeXt): the
        first ``nn.ModuleList`` of the model, in forward order, named from the backbone (``model.layers.0`` ...)."""
        for path, module in self.model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module):
                return [(f"model.{path}.{i}", m) for i, m in enumerate(module)]
        return []
