"""A trained model loaded for use: ``load_model(path, device)`` finds and checks the folder's files, rebuilds the
model from its saved ``config.yaml``, loads the weights exactly, and returns a ``Predictor`` (the model in eval mode,
its tokenizer, its class names, ``predict(images)``). ``mtl.inference`` describes the folders it takes."""

from __future__ import annotations

import copy
import json
import os
import stat
import sys

import torch

from mtl.checkpoint.finite import first_nonfinite
from mtl.checkpoint.folder import read_trainer_state
from mtl.checkpoint.trainable import refuse_other_base, trainable_only
from mtl.config.schema import config_from_data
from mtl.data.images import UnusableImage, image_normalization, model_transform, normalize_images
from mtl.data.loader import build_datasets
from mtl.data.manifest import IMAGE_EXTENSIONS, load_image
from mtl.data.tokenizer import CaptionTokenizer
from mtl.errors import CheckpointError, ConfigError, DataError, TrainingError
from mtl.models.backbones.hf_vision import use_carried_copy
from mtl.parallel.amp import DTYPES
from mtl.registry import refuse_untrusted, use_folder_copies
from mtl.setup.build import (
    CLASS_NAMES_FILE,
    MODEL_FILE,
    ModelFiles,
    build_model,
    find_model_files,
    load_model_weights,
    read_model_weights,
    verify_model_files,
)
from mtl.setup.resume import saved_config

LOAD_FIX = "Was it written with another version of mtl's model code, or edited by hand?"


class Predictor:
    """A trained model ready for inference (what ``load_model`` returns)."""

    def __init__(self, model, cfg, tokenizer: CaptionTokenizer, class_names: list[str], device: torch.device,
                 files: ModelFiles, saved_config: dict | None = None):
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.class_names, self.device, self.files = class_names, device, files
        self.saved_config = saved_config  # the folder's config.yaml as plain data (what ``cfg`` was built from)
        self.normalization = image_normalization(cfg)  # what the training loaders applied (pretrained weights)
        self.transform = model_transform(cfg)  # the model's own image transform from its library; None: mtl's

    @property
    def tasks(self) -> list[str]:
        return self.model.task_names

    @property
    def image_size(self) -> int:
        return int(self.cfg.data.image_size)

    @property
    def consumes(self) -> str:
        """The batch field the model's backbone reads (``Backbone.consumes``): ``image``, or e.g. ``graph`` (QM9)."""
        return getattr(self.model.backbone, "consumes", "image")

    def load_images(self, paths: list[str]) -> torch.Tensor:
        """(N, 3, S, S): the files as the training data sets read them."""
        return torch.stack([read_image(p, self.image_size, self.transform) for p in paths])

    @torch.no_grad()
    def predict(self, images, num_beams: int = 1, batch_size: int = 32, on_unreadable=None) -> list[dict | None]:
        """One dict per image: ``class`` (name), ``class_index``, ``prob`` (softmax probability of that class)
        for the ``cls`` task, ``caption`` for ``gen`` (greedy, or beam search with ``num_beams`` > 1), and
        ``count`` for ``count``. ``images``: file paths, or image tensors (3, S, S) / (N, 3, S, S) as the
        data sets give them. A file that cannot be read is a DataError, unless ``on_unreadable(path, error)`` is
        given: then it is called, the file skipped, and its place in the list is None. Only a model whose backbone
        reads images predicts here; any other is a ConfigError that says so."""
        if self.consumes != "image":
            raise ConfigError(f"predict: takes images, for models whose backbone reads images; this model's backbone "
                              f"({self.cfg.model.backbone.name}) reads {self.consumes!r} batches. Evaluate it on its "
                              "data instead: python -m mtl.tools.evaluate --checkpoint <the model>")
        if num_beams < 1:
            raise ConfigError(f"num_beams: must be >= 1 (got {num_beams})")
        if torch.is_tensor(images):
            images = list(images.unsqueeze(0) if images.dim() == 3 else images)
        images = list(images)
        out: list[dict | None] = []
        for start in range(0, len(images), batch_size):
            read = [self._read(i, on_unreadable) for i in images[start:start + batch_size]]
            if any(r is not None for r in read):
                x = torch.stack([r for r in read if r is not None]).to(self.device)
                rows = iter(self._predict_batch(normalize_images(x, self.normalization), num_beams))
            out += [None if r is None else next(rows) for r in read]
        return out

    def _read(self, image, on_unreadable) -> torch.Tensor | None:
        if not isinstance(image, str | os.PathLike):
            return image
        try:
            return read_image(image, self.image_size, self.transform)
        except DataError as e:
            if on_unreadable is None:
                raise
            on_unreadable(os.fspath(image), e)
            return None

    def _predict_batch(self, x: torch.Tensor, num_beams: int) -> list[dict]:
        rows: list[dict] = [{} for _ in range(x.shape[0])]
        with self.model.autocast(self.device.type):
            for t, features in self.model.features_by_task(x, list(self.model.heads)):  # per-task adapters: each its own
                head = self.model.heads[t]  # each task says what it predicts (TaskHead.predict)
                for row, part in zip(rows, head.predict(self.model.task_features(t, features), num_beams=num_beams)):
                    row.update(part)
        return rows


def read_image(path, image_size: int, transform=None) -> torch.Tensor:
    """One image file through the data code's transform (``transform``: the model's own, ``Predictor.transform``); a
    missing or undecodable file is a DataError."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise DataError(f"image {path!r} not found") from None
    if not stat.S_ISREG(mode):  # never opened: a FIFO would block the job, a device never end
        raise DataError(f"image {path!r} is not a regular file but a {_file_kind(mode)}; pass image files only")
    try:
        return load_image(path, image_size, transform=transform)
    except UnusableImage:  # it opens, and its message says what is wrong with it (a 1 x 1,000,000 strip)
        raise
    except DataError:
        raise DataError(f"image {path!r} cannot be decoded as an image; remove it or pass image files only") from None


def image_paths(inputs: list[str]) -> list[str]:
    """Files as given; each folder becomes the image files under it (by extension, recursively, sorted)."""
    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(d, n) for d, _, names in os.walk(item) for n in names
                           if n.lower().endswith(IMAGE_EXTENSIONS))
            if not found:
                raise DataError(f"folder {item!r} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
            paths += found
        elif os.path.exists(item):  # a file; one that is not a regular file is skipped and counted (read_image)
            paths.append(item)
        else:
            raise DataError(f"{item!r} is neither an image file nor a folder")
    if not paths:
        raise DataError("no images given: pass image files or folders")
    return paths


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder"))
    return next((name for test, name in kinds if test(mode)), "special file")


def resolve_device(device, key: str = "device") -> torch.device:
    """``device`` (auto | cpu | cuda | cuda:N, or a torch.device) as a device this machine has, checked before a
    model is loaded: a name that is no device, CUDA where none is visible, or an index past the last GPU is one
    ConfigError naming ``key`` (the tools pass ``--device``) and the fix."""
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"{key}: {device!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"{key}: {device!r} is not a device mtl runs on (auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {str(device)!r} asks for a CUDA device, and this machine has none that torch can "
                          f"use (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them); set {key}=cpu or {key}=auto")
    count, index = torch.cuda.device_count(), dev.index or 0
    if index >= count:
        raise ConfigError(f"{key}: {str(device)!r}: this machine has {count} CUDA device(s), cuda:0 to "
                          f"cuda:{count - 1}; set {key} to one of them, or {key}=auto")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _rel(path: str, folder: str) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")


def _class_names(files: ModelFiles, cfg, num_classes: int | None) -> list[str]:
    """The model's class names; ``num_classes``: how many its weights fix (a classifier head's rows), or None where
    they fix none (a model without a ``cls`` head: then the run's list, e.g. QM9's empty one, is taken as it is)."""
    if files.class_names:
        try:
            with open(files.class_names, encoding="utf-8") as f:
                names = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{files.class_names!r} cannot be read as JSON: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or (
                num_classes is not None and len(names) != num_classes):
            count = "" if num_classes is None else f"{num_classes} "
            raise CheckpointError(f"{files.class_names!r} must be a JSON list of {count}class names (the "
                                  "model's number of classes); restore the file or delete it")
        return names
    if cfg.data.source == "synthetic":  # drawn on the fly: building the splits costs nothing
        return list(build_datasets(cfg)[0].class_names)
    if cfg.data.source == "imagefolder":
        print(f"note: {files.folder!r} and its run folder have no {CLASS_NAMES_FILE} (written by runs since this "
              "was added); classes are named by their index, the sorted class folders of the training set",
              file=sys.stderr)
    return [str(i) for i in range(int(cfg.data.num_classes or 1) if num_classes is None else num_classes)]


def load_model(path: str, device="cpu", trust_plugins: bool = False) -> Predictor:
    """The trained model at ``path`` in eval mode on ``device`` (auto | cpu | cuda | cuda:N | a torch.device).

    Plug-in code the folder carries (``task_modules/`` ...) is imported, which runs it, only with ``trust_plugins``
    or where each file is byte-identical to the one at its recorded path on this machine (your own run's code):
    otherwise a ConfigError naming each file and its SHA-256, nothing imported (``mtl.registry.refuse_untrusted``).
    Weights holding a NaN or inf are a TrainingError naming the tensor."""
    files = find_model_files(os.fspath(path), "model")
    state = read_model_weights(files.weights, "model")  # first: is it ours at all?
    if files.config is None:
        raise CheckpointError(f"{files.folder!r} has no config.yaml next to {MODEL_FILE}: it is not an mtl "
                              "checkpoint or export folder")
    listed = verify_model_files(files, "model")  # as a resume does: every file we read matches the folder's manifest
    refuse_nonfinite(state, files.weights)
    if files.tokenizer is None:
        raise CheckpointError(f"{files.folder!r}: no tokenizer/ found in it or in its run folder; the model "
                              "cannot decode captions without the tokenizer it was trained with")
    saved = saved_config(files.folder)  # plain data: nothing in it resolved, no base: followed
    cfg = model_config(saved, files.config)  # keys and types only: paths in it (data, resume) may not exist here
    code = use_folder_copies(cfg, files.folder, listed)  # its own plug-in files only, inside it and in its manifest
    why = refuse_untrusted(code, files.folder, trust_plugins)  # before anything imports them
    partial = trainable_only(cfg)  # checkpoint.trainable_only: the base comes from its pretrained folders, checked
    if partial:
        held = os.path.join(files.folder, "trainer_state.pt")  # a checkpoint's record of its base
        refuse_other_base(read_trainer_state(files.folder).get("base") if os.path.isfile(held) else None, cfg,
                          f"{files.folder!r}")
    else:
        use_carried_copy(cfg, files.folder)  # hf_vision: its backbone/config.json and processor, not the pretrained one
    if code:
        print(f"note: {files.folder!r}: the model imports its plug-in code "
              f"({', '.join(_rel(c, files.folder) for c in code)}), {why}", file=sys.stderr)
    tokenizer = CaptionTokenizer.load(files.tokenizer)
    weighed = int(state["heads.cls.fc.weight"].shape[0]) if "heads.cls.fc.weight" in state else None
    class_names = _class_names(files, cfg, weighed)
    num_classes = len(class_names) if weighed is None else weighed
    # the backbone's weights are in our file: never download or read others (cfg keeps the name: it decides the
    # normalisation the run's loaders applied, data.normalize=auto)
    unweighted = copy.deepcopy(cfg)
    unweighted.model.backbone.weights = None
    model = build_model(unweighted, num_classes, class_names, tokenizer)
    if partial:  # the base's weights are the pretrained folders'; the file holds the rest
        state = {**{k: v for k, v in model.state_dict().items() if k not in state}, **state}
    load_model_weights(model, state, f"model {files.weights!r}", LOAD_FIX)
    dev = resolve_device(device)
    model.autocast_dtype = DTYPES.get(cfg.precision)  # as the run's own evaluation
    model.to(dev).eval()
    return Predictor(model, cfg, tokenizer, class_names, dev, files, saved)


def refuse_nonfinite(state: dict, weights: str) -> None:
    """A model file whose weights hold a NaN or inf (a run that diverged, or an edited file) predicts NaN: a
    TrainingError (exit 5, as training's own check, ``mtl.checkpoint.finite``) naming the first such tensor."""
    bad = first_nonfinite(state)
    if bad:
        raise TrainingError(f"model: {weights!r} holds NaN or inf values in {bad}: the model it saves diverged (or "
                            "the file was edited), so every prediction from it would be NaN. Use an earlier "
                            "checkpoint of the run")


def model_config(saved: dict, source: str, overrides: list[str] | None = None):
    """The config of a model folder (``saved``: its config.yaml as ``mtl.setup.resume.saved_config`` reads it) as data:
    ``mtl.config.schema.config_from_data``; a problem in the file itself is a CheckpointError naming it."""
    try:
        config_from_data(saved, source)
    except ConfigError as e:
        raise CheckpointError(f"{source!r} is not a config mtl wrote: " + "; ".join(e.errors)) from None
    return config_from_data(saved, source, overrides)
