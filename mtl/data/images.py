"""Image files to tensors: EXIF orientation, aspect-preserving resize and crop, optional augmentation,
and the input normalisation that pretrained backbone weights expect.

- Every image is turned upright first (``ImageOps.exif_transpose``): phone photos store their
  rotation in EXIF, and a model trained on sideways pictures learns the wrong thing.
- A pretrained model's own transform, where it has one (``mtl.data.model_transforms``: an hf_vision folder's
  ``AutoImageProcessor``, timm weights' ``create_transform``), resizes and crops as its library does; otherwise
  (the torchvision CNNs) the short side is resized to ``data.image_size`` and the centre square cropped, so
  nothing is stretched (eval always; training too unless augmentation is on). ``prepare_images`` is the one place
  a data set is given its transform and normalisation.
- Training augmentation (``data.augment``, off by default so runs stay reproducible): a random
  resized crop and a horizontal flip (under a model's transform: a random box of the decoded image and the flip,
  which that transform then resizes and crops). Their random draws depend on (seed, epoch, index) only, so a
  resumed run and every data-loader worker see the same crops.
- An image more than ``MAX_ASPECT`` times as long as it is wide (a 1 x 1,000,000 strip) is refused before it is
  decoded (``shape_problem``): its centre square would be a sliver of it, and resizing its short side would make
  an intermediate image ``MAX_ASPECT`` x the output's size and more (gigabytes for such a strip). Below the limit
  the crop is the one it always was, so the memory a crop takes is bounded by ``MAX_ASPECT`` output images. Pillow's
  own limit stays in force: a file of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels (a decompression bomb)
  does not open.
- Normalisation (``data.normalize``: the library's or the weights' own statistics, imagenet, none, or an explicit
  mean and std) is applied by the loaders to whole batches; items stay in [0, 1] so they can be shown as pictures.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from mtl.config.schema import DataConfig
from mtl.data.model_transforms import (  # noqa: F401 (PROCESSOR_FILE, read_processor: imported from here too)
    PROCESSOR_FILE,
    ModelTransform,
    model_transform,
    processor_folder,
    processor_size,
    read_processor,
)
from mtl.errors import ConfigError, DataError

PIL_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# The longest side may be at most this many times the shortest: a panorama (4:1) or a banner (8:1) passes, a strip
# whose centre square would be under 5 % of it does not.
MAX_ASPECT = 20
NORMALIZE = ("auto", "none", "imagenet")
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # what every torchvision classification weight set was trained with
IMAGENET_STD = (0.229, 0.224, 0.225)


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
               key: tuple[int, int] = (0, 0), transform: ModelTransform | None = None) -> torch.Tensor:
    """An image file as float (3, S, S) in [0, 1]: upright (EXIF), RGB, then ``transform`` (the model's own, from its
    library: ``mtl.data.model_transforms``) or, without one, mtl's: short side resized and centre-cropped. With
    ``augment`` active, a random resized crop and/or flip drawn from (augment.seed, epoch, index) = key; under a
    model's transform the crop and flip are cut from the decoded image and the model's transform then runs on them
    as it does at evaluation (its resize, crop and resampling)."""
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
    return image_tensor(img, image_size, augment, key, transform)


def image_tensor(img: Image.Image, image_size: int, augment: Augment | None = None, key: tuple[int, int] = (0, 0),
                 transform: ModelTransform | None = None) -> torch.Tensor:
    """An upright RGB picture as float (3, S, S) in [0, 1]: ``load_image``'s transform (and augmentation) of a picture
    already opened (a file's, or a data set cell's bytes: mtl/data/hf_source.py)."""
    if transform is not None:
        return transform(_augmented(img, augment, key) if augment is not None and augment.active else img)
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


def _augmented(img: Image.Image, augment: Augment, key: tuple[int, int]) -> Image.Image:
    """The decoded image's random crop (a box of the image, not resized) and flip, drawn as ``load_image`` draws
    them from (augment.seed, epoch, index): what a model's own transform then resizes and crops."""
    index, epoch = key
    rng = np.random.default_rng([augment.seed, epoch, index])
    if augment.random_resized_crop:
        left, top, cw, ch = _random_box(rng, *img.size, augment)
        img = img.crop((left, top, left + cw, top + ch))
    if augment.hflip and rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


def normalize_problem(value) -> str | None:
    """Why ``data.normalize`` is not one of auto, none, imagenet or ``{mean: [r, g, b], std: [r, g, b]}``, or None."""
    if isinstance(value, str) and value in NORMALIZE:
        return None
    if isinstance(value, Mapping) and set(value) == {"mean", "std"}:
        ok = all(isinstance(value[k], Sequence) and not isinstance(value[k], str) and len(value[k]) == 3
                 and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value[k])
                 for k in ("mean", "std"))
        if ok and all(x > 0 for x in value["std"]):
            return None
    shown = dict(value) if isinstance(value, Mapping) else value
    close = difflib.get_close_matches(value, NORMALIZE, n=1) if isinstance(value, str) else []
    hint = f" — did you mean {close[0]!r}?" if close else ""
    return (f"data.normalize: {shown!r} is not one of {', '.join(NORMALIZE)} nor {{mean: [r, g, b], std: [r, g, b]}} "
            "(three finite numbers each, every std > 0; e.g. data.normalize={mean:[0.5,0.5,0.5],std:[0.5,0.5,0.5]})"
            f"{hint}")


def image_normalization(cfg) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) the backbone's input should be normalised with, or None for [0, 1] input.

    ``data.normalize``: ``auto`` uses the pretrained weights' own statistics (a model-owned transform,
    ``mtl.data.model_transforms``: the transformers image processor's ``image_mean``/``image_std``, the timm weights'
    pretrained config's ``mean``/``std``; a torchvision weights name: its ``transforms()``; a local weights file:
    ImageNet's, which all torchvision weights use) and none when the backbone starts from scratch; ``imagenet`` and
    ``none`` force either, and ``{mean: [...], std: [...]}`` gives them.
    """
    mode = cfg.data.normalize
    problem = normalize_problem(mode)
    if problem:
        raise ConfigError(problem)
    if isinstance(mode, Mapping):
        return tuple(float(x) for x in mode["mean"]), tuple(float(x) for x in mode["std"])
    if mode == "auto":
        owned = model_transform(cfg)
        if owned is not None:  # the library's own statistics (None: its processor does not normalise)
            return owned.normalization
        folder = processor_folder(cfg)
        if folder:  # a processor file, on a backbone that is not hf_vision
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


def processor_normalization(folder: str):
    """(mean, std) of the folder's ``preprocessor_config.json``; None where it does not normalise
    (``do_normalize: false``)."""
    p = read_processor(folder)
    if p.get("do_normalize") is False:
        return None
    if "image_mean" not in p or "image_std" not in p:
        return IMAGENET_MEAN, IMAGENET_STD  # transformers' image processors' default
    return tuple(float(x) for x in p["image_mean"]), tuple(float(x) for x in p["image_std"])


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
    """One line for the start-up summary: the image transform, size and normalisation this run's images get, and
    where each comes from."""
    norm, folder, owned = image_normalization(cfg), processor_folder(cfg), model_transform(cfg)
    size = f"images: {cfg.data.image_size} px (data.image_size"
    if folder:
        native = processor_size(folder)
        size += f"; the model folder's processor: {native})" if native is not None else ")"
    else:
        size += ")"
    size += (f", image files through {owned.text}" if owned is not None
             else ", image files through mtl's resize short side, centre crop, bilinear")
    if norm is None:
        return f"{size}, not normalised (data.normalize={cfg.data.normalize})"
    where = ((owned.stats_from if owned is not None else os.path.join(folder, PROCESSOR_FILE))
             if cfg.data.normalize == "auto" and (owned is not None or folder)
             else "data.normalize" if isinstance(cfg.data.normalize, Mapping)
             else f"data.normalize={cfg.data.normalize}")
    mean, std = (", ".join(f"{x:g}" for x in t) for t in norm)
    return f"{size}, normalised with mean ({mean}) std ({std}) from {where}"


def prepare_images(cfg, *datasets) -> None:
    """The one place a data set is told how its images are made for the model: ``normalization`` (what the loaders
    normalise its batches with, ``image_normalization``) and, for data sets of image files, ``image_transform`` (the
    model's own from its library, ``model_transform``, or None: mtl's)."""
    norm, owned = image_normalization(cfg), model_transform(cfg)
    for ds in datasets:
        ds.normalization = norm
        if hasattr(ds, "image_transform"):
            ds.image_transform = owned


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
