"""The pretrained model's own image transform, from its library: what a file image becomes before the model sees it.

- ``hf_vision`` with a model folder that has a ``preprocessor_config.json`` (``model.backbone.pretrained`` or
  ``config``): transformers' ``AutoImageProcessor`` of that folder (its resize: ViT's and SigLIP's stretch to H x W,
  CLIP's and DINOv2's shortest side then centre crop; its resampling, bicubic for CLIP, SigLIP and DINOv2).
- ``timm`` with weights (``model.backbone.pretrained``): ``timm.data.create_transform(**resolve_data_config(...))`` of
  the pretrained config (the folder's ``config.json`` ``pretrained_cfg`` where timm's ``save_pretrained`` wrote one,
  else timm's own for ``model.backbone.options.model``): its resize, ``crop_pct``, crop mode and interpolation.
- Anything else (the torchvision CNNs, a timm or hf model without such a folder or weights): None, and mtl's own
  transform (``mtl.data.images.load_image``: short side resized, centre square, bilinear) as before.

The transform here stops before normalisation: it gives (3, S, S) floats in [0, 1] (the library's resize, crop,
resampling and rescale), and the loaders normalise whole batches with the library's mean and std
(``ModelTransform.normalization``; ``data.normalize`` may replace them), which is the library's own normalisation to
float rounding. ``data.image_size`` other than the library's own size scales its sizes (the resize and the crop alike,
so DINOv2's 256 -> 224 becomes 73 -> 64 at 64); a processor that then gives no S x S image is refused by name.
"""

from __future__ import annotations

import json
import os

import torch
from PIL import Image

from mtl.config.json_read import read_json_object
from mtl.errors import ConfigError

PROCESSOR_FILE = "preprocessor_config.json"  # a transformers model folder's image processor (size, mean, std)
TIMM_DEFAULT_MODEL = "resnet18"  # mtl.models.backbones.timm_models.TimmOptions.model's default
PROBE = (91, 37)  # a non-square image (width, height) each transform is tried on when it is made


def processor_folder(cfg) -> str | None:
    """The model folder whose ``preprocessor_config.json`` gives the input's statistics (``model.backbone.pretrained``,
    else ``model.backbone.config``: hf_vision's), or None where the backbone has no such file."""
    b = cfg.model.backbone
    for folder in (b.get("pretrained"), b.get("config")):
        if folder and os.path.isfile(os.path.join(str(folder), PROCESSOR_FILE)):
            return str(folder)
    return None


def read_processor(folder: str) -> dict:
    """A model folder's ``preprocessor_config.json`` as a dict; a file that cannot be read is a ConfigError naming it."""
    return read_json_object(os.path.join(folder, PROCESSOR_FILE), "model.backbone", "restore it or set data.normalize")


def _edge(size) -> int | None:
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def processor_size(folder: str) -> int | None:
    """The square size the folder's image processor feeds the model (``crop_size`` where it crops, else ``size``)."""
    return processor_size_of(read_processor(folder))


def processor_size_of(p: dict) -> int | None:
    for key in (("crop_size",) if p.get("do_center_crop") else ()) + ("size",):
        size = _edge(p.get(key))
        if size is not None:
            return size
    return None


def size_overrides(p: dict, image_size: int) -> dict:
    """The processor settings that make its output ``image_size`` square where that is not its own size: a crop
    becomes S x S and the resize before it scales by S / its crop; without a crop the resize itself becomes S."""
    native = processor_size_of(p)
    if native is None or native == image_size:
        return {}
    crop, size = bool(p.get("do_center_crop")) and p.get("crop_size") is not None, p.get("size")
    out = {"crop_size": {"height": image_size, "width": image_size}} if crop else {}
    if isinstance(size, dict):
        out["size"] = {k: (round(v * image_size / native) if crop else image_size) for k, v in size.items()
                       if k in ("height", "width", "shortest_edge") and isinstance(v, int)}
    elif isinstance(size, int):
        out["size"] = round(size * image_size / native) if crop else image_size
    return out


class ModelTransform:
    """A picklable callable (the data-loader workers get a copy): an upright RGB ``PIL.Image`` -> float (3, S, S) in
    [0, 1] through the library's own resize, crop and resampling. ``normalization``: the library's (mean, std), or
    None where it does not normalise. ``text``: what it is, for the start-up summary."""

    def __init__(self, kind: str, source: str, settings: dict, image_size: int):
        self.kind, self.source, self.settings, self.image_size = kind, source, dict(settings), int(image_size)
        self._fn = None

    def __getstate__(self):
        return {**self.__dict__, "_fn": None}  # each worker builds its own from the settings

    @property
    def fn(self):
        if self._fn is None:
            self._fn = _hf_processor(self.source, self.settings) if self.kind == "hf" else _timm_transform(self.settings)
        return self._fn

    def __call__(self, img: Image.Image) -> torch.Tensor:
        if self.kind == "hf":
            x = self.fn(images=img, return_tensors="pt", do_normalize=False)["pixel_values"][0]
        else:
            x = self.fn(img)  # timm without its Normalize ends in MaybePILToTensor: uint8, 0..255
            if x.dtype == torch.uint8:
                return x.float().div_(255.0)
        return x.float()

    @property
    def normalization(self):
        if self.kind == "hf":
            p = self.fn
            if not getattr(p, "do_normalize", False):
                return None
            return tuple(float(v) for v in p.image_mean), tuple(float(v) for v in p.image_std)
        return tuple(float(v) for v in self.settings["mean"]), tuple(float(v) for v in self.settings["std"])

    @property
    def stats_from(self) -> str:
        """Where ``normalization`` comes from, for the start-up summary."""
        if self.kind == "hf":
            return os.path.join(self.source, PROCESSOR_FILE)
        return f"the pretrained_cfg of {self.source}"

    @property
    def text(self) -> str:
        if self.kind == "hf":
            p = self.fn
            return f"AutoImageProcessor of {self.source} ({type(p).__name__}: {_hf_steps(p)})"
        s = self.settings
        steps = ", ".join(type(t).__name__ + _timm_step(t) for t in self.fn.transforms)
        return (f"timm.data.create_transform of {self.source} (crop_pct {s['crop_pct']:g}, {s['crop_mode']}, "
                f"{s['interpolation']}: {steps})")

    def verify(self) -> ModelTransform:
        """Self, after one non-square image gave (3, S, S); a ConfigError naming the folder where it did not."""
        shape = tuple(self(Image.new("RGB", PROBE)).shape)
        if shape != (3, self.image_size, self.image_size):
            raise ConfigError(f"data.image_size: the image transform of {self.source} ({self.text}) gives images of "
                              f"{shape[1:]} pixels, not {self.image_size} x {self.image_size}; set data.image_size: "
                              "auto (the model's own size)")
        return self


def _hf_processor(folder: str, overrides: dict):
    from transformers import AutoImageProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoImageProcessor.from_pretrained(folder, local_files_only=True, **overrides)
    except Exception as e:  # a processor class transformers does not know, a damaged file ...
        raise ConfigError(f"model.backbone: cannot load the image processor in {os.path.join(folder, PROCESSOR_FILE)!r} "
                          f"({type(e).__name__}: {e}); restore the file") from None


def _hf_steps(p) -> str:
    """The processor's resize, crop and resampling in a few words (``resize shortest 256 bicubic, crop 224x224``)."""
    from transformers.image_utils import PILImageResampling

    steps = []
    size = getattr(p, "size", None) or {}
    size = size if isinstance(size, dict) else {k: getattr(size, k, None) for k in ("shortest_edge", "height", "width")}
    if getattr(p, "do_resize", False):
        resample = getattr(p, "resample", None)
        how = PILImageResampling(resample).name.lower() if isinstance(resample, int) else str(resample or "")
        shape = (f"shortest {size['shortest_edge']}" if size.get("shortest_edge") else
                 f"to {size.get('height')}x{size.get('width')}")
        steps.append(f"resize {shape} {how}".strip())
    crop = getattr(p, "crop_size", None)
    if getattr(p, "do_center_crop", False) and crop:
        crop = crop if isinstance(crop, dict) else {"height": crop.height, "width": crop.width}
        steps.append(f"crop {crop['height']}x{crop['width']}")
    return ", ".join(steps) or "no resize"


def _timm_transform(settings: dict):
    from timm.data import create_transform

    return create_transform(**settings, is_training=False, normalize=False)


def _timm_step(t) -> str:
    size = getattr(t, "size", None)
    return f" {size}" if size is not None else ""


def _timm_pretrained_cfg(cfg) -> dict:
    """The pretrained config of the run's timm weights: the folder's ``config.json`` ``pretrained_cfg`` (timm's
    ``save_pretrained``), else timm's own for the model name."""
    b = cfg.model.backbone
    folder = str(b.pretrained)
    path = os.path.join(folder, "config.json")
    if os.path.isdir(folder) and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f).get("pretrained_cfg")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"model.backbone.pretrained: cannot read {path!r} ({e}); restore it") from None
        if isinstance(saved, dict):
            return saved
    from timm.models import get_pretrained_cfg

    name = (b.get("options") or {}).get("model") or TIMM_DEFAULT_MODEL
    found = get_pretrained_cfg(name)
    return found.to_dict() if found is not None else {}


def model_transform(cfg) -> ModelTransform | None:
    """The run's model-owned image transform (see the module's text), checked on a non-square image; None where the
    backbone has none (mtl's own transform then)."""
    b, size = cfg.model.backbone, int(cfg.data.image_size)
    if b.name == "hf_vision" and processor_folder(cfg):
        folder = processor_folder(cfg)
        return ModelTransform("hf", folder, size_overrides(read_processor(folder), size), size).verify()
    if b.name == "timm" and b.get("pretrained"):
        from timm.data import resolve_data_config

        data = resolve_data_config(pretrained_cfg=_timm_pretrained_cfg(cfg))
        data["input_size"] = (3, size, size)
        return ModelTransform("timm", str(b.pretrained), data, size).verify()
    return None
