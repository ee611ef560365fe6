"""Use a trained model: load it with one call, preprocess images as training does, classify and caption.

``load_model(path, device)`` takes a checkpoint folder (``output_dir/checkpoints/step_<N>``), an export
folder (``python -m mtl.tools.export``), a run's ``output_dir`` (its newest checkpoint) or the
``model.safetensors`` in one of them. It rebuilds the model from the saved ``config.yaml``, loads the
weights exactly (any missing or misshapen key is named), and returns a ``Predictor``: the model in eval
mode on ``device``, its tokenizer, its class names, and ``predict(images)``.

Where the pieces come from (``mtl.build.find_model_files``): the folder's own ``tokenizer/`` and
``class_names.json`` first, else the run folder's (``output_dir/tokenizer/``, ``output_dir/class_names.json``).
A run written before class names were saved falls back to the synthetic shape names or to "0", "1", ...

Images are read with the data code's own transform (``mtl.data.manifest.load_image``: RGB, the run's
``data.image_size``, the same scaling) and normalised as the loaders normalise them (``data.normalize``,
e.g. the pretrained weights' mean and std), so a file is seen exactly as the training and eval loaders see it.

The command-line tools in ``mtl/tools/`` (evaluate, predict, export) are thin wrappers over this module.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import math
import os
import shutil
import stat
import sys
from types import SimpleNamespace

import torch
from safetensors import SafetensorError

from mtl.build import (
    CLASS_NAMES_FILE,
    MODEL_FILE,
    ModelFiles,
    build_collate,
    build_eval_loaders,
    build_model,
    find_model_files,
    load_model_weights,
    read_model_weights,
    run_task_types,
    verify_model_files,
)
from mtl.config.checks import validate
from mtl.config.reads import refuse_unread
from mtl.config.resume import saved_config
from mtl.config.schema import config_from_data, load_config, multi_input, task_data
from mtl.data.images import UnusableImage, image_normalization, normalize_images
from mtl.data.loader import build_datasets, verify_task_fields
from mtl.data.manifest import IMAGE_EXTENSIONS, ImageFolderCaptions, ManifestDataset, load_image
from mtl.data.multi_input import build_task_val_sets
from mtl.data.tokenizer import CaptionTokenizer
from mtl.errors import CheckpointError, ConfigError, DataError, TrainingError
from mtl.files import free_bytes
from mtl.interop import interop_bytes, write_interop
from mtl.models.backbones.hf_vision import carried_files, use_carried_copy
from mtl.parallel.amp import DTYPES
from mtl.registry import PLUGIN_KEYS, copy_names, refuse_untrusted, use_folder_copies
from mtl.run.checkpoint import describe_os_error, write_manifest
from mtl.run.evaluate import evaluate_run
from mtl.run.finite import first_nonfinite
from mtl.run.runlock import alive  # the run lock's own test of a PID

LOAD_FIX = "Was it written with another version of mtl's model code, or edited by hand?"
# keys an evaluation may set: what to evaluate on, never the model (which comes from the checkpoint)
EVAL_KEYS = ("data.", "seed")


class Predictor:
    """A trained model ready for inference (what ``load_model`` returns)."""

    def __init__(self, model, cfg, tokenizer: CaptionTokenizer, class_names: list[str], device: torch.device,
                 files: ModelFiles, saved_config: dict | None = None):
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.class_names, self.device, self.files = class_names, device, files
        self.saved_config = saved_config  # the folder's config.yaml as plain data (what ``cfg`` was built from)
        self.normalization = image_normalization(cfg)  # what the training loaders applied (pretrained weights)

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
        return torch.stack([read_image(p, self.image_size) for p in paths])

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
            return read_image(image, self.image_size)
        except DataError as e:
            if on_unreadable is None:
                raise
            on_unreadable(os.fspath(image), e)
            return None

    def _predict_batch(self, x: torch.Tensor, num_beams: int) -> list[dict]:
        rows: list[dict] = [{} for _ in range(x.shape[0])]
        with self.model.autocast(self.device.type):
            features = self.model.backbone(x)
            for t, head in self.model.heads.items():  # each task says what it predicts (TaskHead.predict)
                for row, part in zip(rows, head.predict(self.model.task_features(t, features), num_beams=num_beams)):
                    row.update(part)
        return rows


def read_image(path, image_size: int) -> torch.Tensor:
    """One image file through the data code's transform; a missing or undecodable file is a DataError."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise DataError(f"image {path!r} not found") from None
    if not stat.S_ISREG(mode):  # never opened: a FIFO would block the job, a device never end
        raise DataError(f"image {path!r} is not a regular file but a {_file_kind(mode)}; pass image files only")
    try:
        return load_image(path, image_size)
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
    use_carried_copy(cfg, files.folder)  # hf_vision: its backbone/config.json and processor, not the pretrained folder
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
    load_model_weights(model, state, f"model {files.weights!r}", LOAD_FIX)
    dev = resolve_device(device)
    model.autocast_dtype = DTYPES.get(cfg.precision)  # as the run's own evaluation
    model.to(dev).eval()
    return Predictor(model, cfg, tokenizer, class_names, dev, files, saved)


def refuse_nonfinite(state: dict, weights: str) -> None:
    """A model file whose weights hold a NaN or inf (a run that diverged, or an edited file) predicts NaN: a
    TrainingError (exit 5, as training's own check, ``mtl.run.finite``) naming the first such tensor."""
    bad = first_nonfinite(state)
    if bad:
        raise TrainingError(f"model: {weights!r} holds NaN or inf values in {bad}: the model it saves diverged (or "
                            "the file was edited), so every prediction from it would be NaN. Use an earlier "
                            "checkpoint of the run")


def model_config(saved: dict, source: str, overrides: list[str] | None = None):
    """The config of a model folder (``saved``: its config.yaml as ``mtl.config.resume.saved_config`` reads it) as data:
    ``mtl.config.schema.config_from_data``; a problem in the file itself is a CheckpointError naming it."""
    try:
        config_from_data(saved, source)
    except ConfigError as e:
        raise CheckpointError(f"{source!r} is not a config mtl wrote: " + "; ".join(e.errors)) from None
    return config_from_data(saved, source, overrides)


# ------------------------------------------------------------------ evaluation


def eval_config(predictor: Predictor, config: str | None = None, overrides: list[str] | None = None):
    """The model's config with the data (``data.*`` and ``seed``) of ``config``, or of the model's own
    config, plus ``overrides``. Only ``data.*`` and ``seed`` may be overridden: the model is the checkpoint's."""
    overrides = list(overrides or [])
    bad = [o.split("=", 1)[0] for o in overrides
           if not any(o.split("=", 1)[0].strip().startswith(k) for k in EVAL_KEYS)]
    if bad:
        raise ConfigError([f"{k}: not an evaluation setting; the model's config comes from the checkpoint. Set "
                           "only data.* and seed here" for k in bad])
    if config:  # the user's own config file
        source = load_config(config, overrides)
    else:  # the model folder's config.yaml, as data (verified with the weights)
        source = model_config(predictor.saved_config or saved_config(predictor.files.folder), predictor.files.config,
                              overrides)
    cfg = copy.deepcopy(predictor.cfg)
    cfg.data, cfg.seed = source.data, source.seed
    refuse_unread(cfg, config, overrides, "evaluate", EVAL_KEYS)  # an override the evaluation does not read: exit 2
    if cfg.data.image_size == "auto":  # the model's own size (the pretrained folder it came from need not be here)
        cfg.data.image_size = predictor.image_size
    if cfg.data.image_size != predictor.image_size:
        raise ConfigError(f"data.image_size: the model was trained at {predictor.image_size}, not "
                          f"{cfg.data.image_size}; remove the override or set it to {predictor.image_size}")
    # train.py's own checks (mtl.config.checks.validate), on the keys an evaluation sets; the training paths it
    # never reads (train_path) are not asked for. The rest is the model's config, checked when it trained.
    problems = [e for e in validate(cfg) if e.split(":", 1)[0].startswith(EVAL_KEYS) and "train_path" not in e]
    if problems:
        raise ConfigError(problems)
    return cfg


def eval_dataset(cfg, class_names: list[str]):
    """The split to evaluate (``data.val_path``, or the synthetic or QM9 val split), labelled with the model's
    classes."""
    d = cfg.data
    if d.source == "qm9":  # the run's validation split (data.qm9.*, the seed's shuffle): molecule graphs, no classes
        return build_datasets(cfg)[1]
    if d.source == "synthetic":  # drawn on the fly: building the train split costs nothing
        ds = build_datasets(cfg)[1]
        if ds.num_classes > len(class_names):
            raise ConfigError(f"data.synthetic.num_classes: {ds.num_classes} shape kinds, but the model knows "
                              f"{len(class_names)}; set it to {len(class_names)}")
        return ds
    if d.source not in ("manifest", "imagefolder"):
        raise ConfigError(f"data.source: {d.source!r} is not one of synthetic, manifest, imagefolder, qm9")
    if not d.val_path:
        raise ConfigError(f"data.val_path: set it to the {d.source} to evaluate on")
    if d.source == "manifest":
        ds = ManifestDataset(d.val_path, d.image_root, d.image_size, len(class_names), d.on_error,
                             class_names=class_names)
    else:
        ds = ImageFolderCaptions(d.val_path, image_size=d.image_size, on_error=d.on_error, class_names=class_names)
    ds.normalization = image_normalization(cfg)  # the eval loader normalises as training did
    return ds


def eval_task_sets(cfg, class_names: list[str]) -> dict:
    """Multi-input mode (``data.per_task``): {task: its own validation set}, read as the run read it and labelled
    with the model's classes. The training sets are not read; a set that is missing names its task and key."""
    types = run_task_types(cfg)
    s = cfg.data.synthetic
    for t in types:
        if task_data(cfg, t).source == "synthetic" and "label" in types[t].requires and s.num_classes > len(class_names):
            raise ConfigError(f"data.synthetic.num_classes: {s.num_classes} shape kinds for task {t}, but the model "
                              f"knows {len(class_names)}; set it to {len(class_names)}")
    sets = build_task_val_sets(cfg, types, SimpleNamespace(class_names=list(class_names),
                                                            num_classes=len(class_names)))
    for t, ds in sets.items():
        verify_task_fields({t: types[t]}, {f"validation (data.per_task.{t}.val_path)": ds})
    return sets


def evaluate_model(predictor: Predictor, cfg, max_batches: int = 0, num_beams: int | None = None) -> dict:
    """Flat metrics (``cls_acc``, ``gen_bleu4`` ...; as in the run's ``final_metrics.json``) on the eval data
    of ``cfg`` (see ``eval_config``), through the trainer's own evaluation (``mtl.run.evaluate.evaluate_run`` over
    ``mtl.build.build_eval_loaders``), in this one process: every task on the one val split, or in multi-input
    mode (``data.per_task``) each task on its own validation set. ``images``: how many were evaluated (per task
    in multi-input mode)."""
    collate = build_collate(cfg, len(predictor.class_names), predictor.class_names, predictor.tokenizer)
    if multi_input(cfg):
        val_ds, task_vals = None, eval_task_sets(cfg, predictor.class_names)
    else:
        val_ds, task_vals = eval_dataset(cfg, predictor.class_names), None
        verify_task_fields(run_task_types(cfg), {"evaluation": val_ds})
    loaders = build_eval_loaders(cfg, val_ds, collate, task_vals)
    beamed = {h: h.num_beams for h in predictor.model.heads.values() if hasattr(h, "num_beams")}  # e.g. gen's
    try:
        for head in beamed:
            head.num_beams = int(num_beams or beamed[head])
        metrics = evaluate_run(predictor.model, loaders, predictor.device, max_batches)
    finally:
        for head, beams in beamed.items():
            head.num_beams = beams
    flat = {f"{t}_{k}": v for t, m in metrics.items() for k, v in m.items() if k != "samples"}

    def count(ds) -> int:
        return len(ds) if not max_batches else min(len(ds), max_batches * cfg.data.eval_batch_size)

    images = count(val_ds) if task_vals is None else {t: count(ds) for t, ds in task_vals.items()}
    # NaN (e.g. counting on data without counts) is not JSON: null
    return {**{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in flat.items()},
            "images": images}


# ------------------------------------------------------------------ export


def export_model(path: str, out: str, trust_plugins: bool = False) -> str:
    """Write a self-contained folder ``out``: model.safetensors, config.yaml, tokenizer/, class_names.json, the
    plug-in files (``<key>/<file>``: task_modules/, backbone_modules/, weighting_modules/), and the parts in other
    libraries' layouts (``mtl.interop``: hf_decoder/ for transformers, torchvision_backbone/, README.md), with
    manifest.json last.

    The model is loaded first (so a broken checkpoint is refused, not copied; its plug-in code, and so the copy of
    it, only with ``trust_plugins`` or where it is your own run's code: ``load_model``). Before anything is written, the free
    space is checked against the export's size (``export_bytes``): too little is one ConfigError (exit 2) naming the
    folder, the bytes needed and free. The folder appears whole or not at all: it is written next to ``out`` as
    ``<out>.<pid>.tmp`` and renamed; a write that fails anyway (the disk filled up meanwhile) is one CheckpointError
    (exit 4, as a checkpoint that cannot be saved) and leaves nothing behind. A ``<out>.<pid>.tmp`` left by an export
    that was killed (its process gone) is removed by the next export to ``out``."""
    out = os.fspath(out).rstrip(os.sep) or os.sep
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out: {out!r} already exists and is not an empty folder; choose a new folder")
    predictor = load_model(path, "cpu", trust_plugins)
    parent = os.path.dirname(os.path.abspath(out))
    _remove_stale_exports(out)
    needed, free = export_bytes(predictor), free_bytes(parent)
    if free is not None and free < needed:
        raise ConfigError(f"--out: the disk of {out!r} has {free:,} bytes free, and the export needs about "
                          f"{needed:,}; free space or choose --out on another disk (nothing was written)")
    made = []  # the folders above out that the export makes: removed again if it fails
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    tmp = f"{out}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        shutil.copyfile(predictor.files.weights, os.path.join(tmp, MODEL_FILE))
        shutil.copyfile(predictor.files.config, os.path.join(tmp, "config.yaml"))
        predictor.tokenizer.save(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, CLASS_NAMES_FILE), "w", encoding="utf-8") as f:
            json.dump(predictor.class_names, f, indent=1)
        for key in PLUGIN_KEYS:  # the plug-in files the model was loaded with, under the names it loads them by
            original = [str(m) for m in (predictor.saved_config or {}).get(key) or []]
            for spec, name in copy_names(key, original).items():
                os.makedirs(os.path.join(tmp, key), exist_ok=True)
                shutil.copyfile(str(predictor.cfg[key][original.index(spec)]), os.path.join(tmp, *name.split("/")))
        for name, data in carried_files(predictor.cfg).items():  # hf_vision: backbone/config.json and processor
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        write_interop(tmp, predictor)  # the decoder for transformers, the backbone for torchvision (mtl/interop.py)
        write_manifest(tmp)  # last: the size and SHA-256 of every file, checked wherever the folder is loaded
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:  # safetensors' writer (transformers' save_pretrained) raises its own
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        room = f"{needed:,} bytes to write, {'an unknown number' if free is None else f'{free:,}'} free before it began"
        raise CheckpointError(f"cannot write the export {out!r}: {_write_failure(e, tmp)} ({room}); nothing was left "
                              "behind. Free space or choose another --out, then export again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


EXPORT_MARGIN = 1.05, 1 << 20  # x1.05 + 1 MiB over the known sizes: headers, JSON files, the exported program's graph


def export_bytes(predictor: Predictor) -> int:
    """About the bytes ``export_model`` writes, from the sizes known before writing (the files it copies, the tensors
    of the parts ``mtl.interop`` writes), with ``EXPORT_MARGIN``."""
    copied = [predictor.files.weights, predictor.files.config]
    if predictor.files.tokenizer:
        copied += [os.path.join(predictor.files.tokenizer, n) for n in os.listdir(predictor.files.tokenizer)]
    copied += [str(s) for key in PLUGIN_KEYS for s in predictor.cfg.get(key) or () if os.path.isfile(str(s))]
    known = sum(os.path.getsize(f) for f in copied if os.path.isfile(f)) + interop_bytes(predictor)
    scale, extra = EXPORT_MARGIN
    return int(known * scale) + extra


def _write_failure(error: Exception, tmp: str) -> str:
    """Which file of the export could not be written, and why, in the words of a checkpoint save."""
    if isinstance(error, OSError):
        where = f"{os.path.relpath(error.filename, tmp)}: " if error.filename and str(error.filename).startswith(tmp) else ""
        return where + describe_os_error(error)
    text = str(error)  # safetensors: "Error while serializing: I/O error: No space left on device (os error 28)"
    return "no space left on device" if f"os error {errno.ENOSPC})" in text else f"{type(error).__name__}: {text}"


def _remove_stale_exports(out: str) -> None:
    """The half-written folders ``<out>.<pid>.tmp`` of earlier exports to ``out`` whose process is gone (killed before
    it could clean up): removed, each with a note."""
    parent, base = os.path.split(os.path.abspath(out))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(base) + 1:-len(".tmp")] if name.startswith(base + ".") and name.endswith(".tmp") else ""
        path = os.path.join(parent, name)
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)) and os.path.isdir(path) \
                and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            print(f"note: removed {path!r}, the half-written folder of an earlier export to {out!r} that stopped "
                  f"before it finished (its process {pid} is gone)", file=sys.stderr, flush=True)
