"""Image files to tensors: EXIF orientation, aspect-preserving resize and crop, optional augmentation,
and the input normalisation that pretrained backbone weights expect.

- Every image is turned upright first (``ImageOps.exif_transpose``): phone photos store their
  rotation in EXIF, and a model trained on sideways pictures learns the wrong thing.
- The short side is resized to ``data.image_size`` and the centre square cropped, so nothing is
  stretched (eval always; training too unless augmentation is on).
- Training augmentation (``data.augment``, off by default so runs stay reproducible): a random
  resized crop and a horizontal flip. Their random draws depend on (seed, epoch, index) only, so a
  resumed run and every data-loader worker see the same crops.
- An image more than ``MAX_ASPECT`` times as long as it is wide (a 1 x 1,000,000 strip) is refused before it is
  decoded (``shape_problem``): its centre square would be a sliver of it, and resizing its short side would make
  an intermediate image ``MAX_ASPECT`` x the output's size and more (gigabytes for such a strip). Below the limit
  the crop is the one it always was, so the memory a crop takes is bounded by ``MAX_ASPECT`` output images. Pillow's
  own limit stays in force: a file of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels (a decompression bomb)
  does not open.
- Normalisation (``data.normalize``) is applied by the loaders to whole batches; items stay in
  [0, 1] so they can be shown as pictures.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from mtl.config.schema import DataConfig
from mtl.errors import ConfigError, DataError

PIL_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# The longest side may be at most this many times the shortest: a panorama (4:1) or a banner (8:1) passes, a strip
# whose centre square would be under 5 % of it does not.
MAX_ASPECT = 20
NORMALIZE = ("auto", "none", "imagenet")
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # what every torchvision classification weight set was trained with
IMAGENET_STD = (0.229, 0.224, 0.225)
PROCESSOR_FILE = "preprocessor_config.json"  # a transformers model folder's image processor (size, mean, std)


@dataclass(frozen=True)
class Augment:
    """Training-time augmentation of file images (``data.augment``); all off: a deterministic centre crop."""

    random_resized_crop: bool = False
    scale: tuple[float, float] = (0.35, 1.0)  # crop area, as a fraction of the image's
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # crop aspect ratio (width / height)
    hflip: bool = False
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.random_resized_crop or self.hflip

    @classmethod
    def from_config(cls, cfg) -> Augment:
        a = cfg.data.augment
        return cls(bool(a.random_resized_crop), tuple(a.scale), tuple(a.ratio), bool(a.hflip), int(cfg.seed))


class UnusableImage(DataError):
    """An image that opens but cannot be made into a sane crop (``shape_problem``); the message names the file."""


def shape_problem(width: int, height: int) -> str | None:
    """Why an image of ``width`` x ``height`` pixels cannot be cropped to a square for the model, or None."""
    short, long = min(width, height), max(width, height)
    if short < 1 or long > MAX_ASPECT * short:
        ratio = f"{long / short:,.0f}:1" if short else "no pixels on one side"
        return (f"is {width:,} x {height:,} pixels ({ratio}), more elongated than the {MAX_ASPECT}:1 the centre "
                "crop takes (its square would be a sliver of it, and resizing it whole could take gigabytes)")
    return None


def _random_box(rng: np.random.Generator, w: int, h: int, aug: Augment) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a crop with a random area fraction and aspect ratio; the centre square
    if ten draws do not fit inside the image."""
    lo, hi = math.log(aug.ratio[0]), math.log(aug.ratio[1])
    for _ in range(10):
        area = w * h * rng.uniform(*aug.scale)
        ratio = math.exp(rng.uniform(lo, hi))
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(w - cw + 1)), int(rng.integers(h - ch + 1)), cw, ch
    side = min(w, h)
    return (w - side) // 2, (h - side) // 2, side, side


def _centre_crop(img: Image.Image, size: int) -> Image.Image:
    """Resize the short side to ``size`` (keeping the aspect ratio), then cut out the centre square."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def load_image(path: str, image_size: int, where: str = "", augment: Augment | None = None,
               key: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """An image file as float (3, S, S) in [0, 1]: upright (EXIF), RGB, short side resized and centre-cropped;
    with ``augment`` active, a random resized crop and/or flip drawn from (augment.seed, epoch, index) = key."""
    problem = None
    try:
        with Image.open(path) as raw:
            problem = shape_problem(*raw.size)  # from the header: a strip is refused before it is decoded
            if problem is None:
                img = ImageOps.exif_transpose(raw).convert("RGB")
    except PIL_ERRORS as e:
        raise DataError(
            f"image {path!r}{where} could not be read at load time ({e}); it changed after validation "
            "— restore the file or drop its line"
        ) from None
    if problem is not None:
        raise UnusableImage(f"image {path!r}{where} {problem} — crop it to a less elongated shape, or leave it out")
    return image_tensor(img, image_size, augment, key)


def image_tensor(img: Image.Image, image_size: int, augment: Augment | None = None,
                 key: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """An upright RGB picture as float (3, S, S) in [0, 1]: ``load_image``'s crop (and augmentation) of a picture
    already opened (a file's, or a data set cell's bytes: mtl/data/hf_source.py)."""
    if augment is not None and augment.active:
        index, epoch = key
        rng = np.random.default_rng([augment.seed, epoch, index])
        if augment.random_resized_crop:
            left, top, cw, ch = _random_box(rng, *img.size, augment)
            img = img.resize((image_size, image_size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        else:
            img = _centre_crop(img, image_size)
        if augment.hflip and rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
    else:
        img = _centre_crop(img, image_size)
    arr = np.asarray(img, dtype=np.uint8).copy()
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


def image_normalization(cfg) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) the backbone's input should be normalised with, or None for [0, 1] input.

    ``data.normalize``: ``auto`` uses the pretrained weights' own statistics (a transformers model folder,
    ``model.backbone.pretrained`` or ``config``: its ``preprocessor_config.json``'s ``image_mean``/``image_std``; a
    torchvision weights name: its ``transforms()``; a local weights file: ImageNet's, which all torchvision weights
    use) and none when the backbone starts from scratch; ``imagenet`` and ``none`` force either.
    """
    mode = cfg.data.normalize
    if mode not in NORMALIZE:
        raise ConfigError(f"data.normalize: {mode!r} is not one of {', '.join(NORMALIZE)}")
    folder = processor_folder(cfg)
    if mode == "auto" and folder:  # a transformers model folder: its image processor's (None: it does not normalise)
        return processor_normalization(folder)
    weights = cfg.model.backbone.weights
    if mode == "none" or (mode == "auto" and not weights):
        return None
    if mode == "imagenet" or weights.endswith((".pt", ".pth", ".safetensors", ".bin")) or "/" in weights:
        return IMAGENET_MEAN, IMAGENET_STD
    import torchvision

    try:
        t = torchvision.models.get_model_weights(cfg.model.backbone.name)[weights].transforms()
    except (KeyError, ValueError):
        return IMAGENET_MEAN, IMAGENET_STD  # an unknown name is reported by the backbone builder
    return tuple(float(x) for x in t.mean), tuple(float(x) for x in t.std)


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
    path = os.path.join(folder, PROCESSOR_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.backbone: cannot read {path!r} ({e}); restore it or set data.normalize") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.backbone: {path!r} is not a JSON object; restore it or set data.normalize")
    return data


def processor_normalization(folder: str):
    """(mean, std) of the folder's image processor; None where it does not normalise (``do_normalize: false``)."""
    p = read_processor(folder)
    if p.get("do_normalize") is False:
        return None
    if "image_mean" not in p or "image_std" not in p:
        return IMAGENET_MEAN, IMAGENET_STD  # transformers' image processors' default
    return tuple(float(x) for x in p["image_mean"]), tuple(float(x) for x in p["image_std"])


def processor_size(folder: str) -> int | None:
    """The square size the folder's image processor feeds the model (``crop_size`` where it crops, else ``size``)."""
    p = read_processor(folder)
    for key in (("crop_size",) if p.get("do_center_crop") else ()) + ("size",):
        size = p.get(key)
        if isinstance(size, dict):
            size = size.get("height") or size.get("shortest_edge")
        if isinstance(size, int):
            return size
    return None


def resolve_image_size(cfg) -> list[str]:
    """``data.image_size``: a size in pixels, or ``auto``, replaced here by the size the model folder's image
    processor feeds the model (``processor_size``: hf_vision's ``model.backbone.pretrained`` or ``config``); the
    problem, if any, as config errors (the key then keeps the schema's default so the other checks can run)."""
    size = cfg.data.image_size
    if size == "auto":
        folder = processor_folder(cfg)
        native = processor_size(folder) if folder else None
        if native is not None:
            cfg.data.image_size = native
            return []
        cfg.data.image_size = DataConfig.image_size
        named = [str(f) for f in (cfg.model.backbone.get("pretrained"), cfg.model.backbone.get("config")) if f]
        where = (f"{os.path.join(folder, PROCESSOR_FILE)} gives no size" if folder else
                 f"{' nor '.join(repr(f) for f in named)} has no {PROCESSOR_FILE}" if named else
                 f"this run's backbone has no model folder with a {PROCESSOR_FILE} (model.backbone.pretrained "
                 "or config: hf_vision)")
        return [f"data.image_size: auto takes the model folder's image size, and {where}; set the size in pixels"]
    if isinstance(size, bool) or not isinstance(size, int):
        cfg.data.image_size = DataConfig.image_size
        return [f"data.image_size: {size!r} is neither a size in pixels nor auto"]
    return []


def normalization_text(cfg) -> str:
    """One line for the start-up summary: the image size and the normalisation this run's images get, and where
    each comes from."""
    norm, folder = image_normalization(cfg), processor_folder(cfg)
    size = f"images: {cfg.data.image_size} px (data.image_size"
    if folder:
        native = processor_size(folder)
        size += f"; the model folder's processor: {native})" if native is not None else ")"
    else:
        size += ")"
    if norm is None:
        return f"{size}, not normalised (data.normalize={cfg.data.normalize})"
    where = (f"{os.path.join(folder, PROCESSOR_FILE)}" if cfg.data.normalize == "auto" and folder
             else f"data.normalize={cfg.data.normalize}")
    mean, std = (", ".join(f"{x:g}" for x in t) for t in norm)
    return f"{size}, normalised with mean ({mean}) std ({std}) from {where}"


def normalize_images(images: torch.Tensor, normalization) -> torch.Tensor:
    """``(images - mean) / std`` per channel for (N, 3, H, W) images in [0, 1]; unchanged when ``normalization``
    (what ``image_normalization`` gives) is None. Everything that feeds the model images calls this."""
    if not normalization:
        return images
    mean, std = normalization
    shape = (1, 3, 1, 1)
    return (images - torch.tensor(mean, dtype=images.dtype, device=images.device).view(shape)) / torch.tensor(
        std, dtype=images.dtype, device=images.device).view(shape)


class Normalized:
    """A collate function whose batch images are normalised: ``(image - mean) / std`` per channel."""

    def __init__(self, collate, mean, std):
        self.collate = collate
        self.normalization = (tuple(mean), tuple(std))

    def __call__(self, items: list[dict]) -> dict:
        batch = self.collate(items)
        batch["image"] = normalize_images(batch["image"], self.normalization)
        return batch
