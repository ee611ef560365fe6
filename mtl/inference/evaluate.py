"""A trained model evaluated on data: ``eval_config`` (the model's config with the data to evaluate on),
``evaluate_model`` (flat metrics through the trainer's own evaluation), and the validation sets they read."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

from mtl.config.schema import load_config, multi_input, task_data
from mtl.data.hf_source import hf_split
from mtl.data.images import prepare_images
from mtl.data.loader import build_datasets, verify_task_fields
from mtl.data.manifest import ImageFolderCaptions, ManifestDataset
from mtl.data.multi_input import build_task_val_sets
from mtl.data.parquet_stream import hf_stream_split
from mtl.data.streamed import webdataset_split
from mtl.errors import ConfigError
from mtl.inference.model import Predictor, model_config
from mtl.run.evaluate import evaluate_run
from mtl.setup.build import build_collate, build_eval_loaders, run_task_types
from mtl.setup.checks import validate
from mtl.setup.reads import refuse_unread
from mtl.setup.resume import saved_config

# keys an evaluation may set: what to evaluate on, never the model (which comes from the checkpoint)
EVAL_KEYS = ("data.", "seed")


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
    # train.py's own checks (mtl.setup.checks.validate), on the keys an evaluation sets; the training paths it
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
    if d.source == "hf":  # data.hf.val_split, labelled with the model's classes
        ds = hf_split(cfg, "val", train=SimpleNamespace(class_names=list(class_names)))
        prepare_images(cfg, ds)  # the model's transform, and the eval loader normalises, as training did
        return ds
    if d.source in ("webdataset", "hf_stream"):  # the validation split only, labelled with the model's classes
        ds = (webdataset_split if d.source == "webdataset" else hf_stream_split)(cfg, "val", list(class_names))
        prepare_images(cfg, ds)  # the model's transform, and the eval loader normalises, as training did
        return ds
    if d.source not in ("manifest", "imagefolder"):
        raise ConfigError(f"data.source: {d.source!r} is not one of synthetic, manifest, imagefolder, qm9, hf, "
                          "webdataset, hf_stream")
    if not d.val_path:
        raise ConfigError(f"data.val_path: set it to the {d.source} to evaluate on")
    if d.source == "manifest":
        ds = ManifestDataset(d.val_path, d.image_root, d.image_size, len(class_names), d.on_error,
                             class_names=class_names)
    else:
        ds = ImageFolderCaptions(d.val_path, image_size=d.image_size, on_error=d.on_error, class_names=class_names)
    prepare_images(cfg, ds)  # the model's transform, and the eval loader normalises, as training did
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
    ``mtl.setup.build.build_eval_loaders``), in this one process: every task on the one val split, or in multi-input
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
