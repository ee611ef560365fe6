"""Build a run from its config: data, tokenizer, model, collate (``build_run_inputs``, read-only),
strategy, weighting, optimizer, scheduler."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.architectures import adopt_plain_weights, architecture_of, architecture_options
from mtl.config.schema import multi_input
from mtl.data.loader import (
    BatchCollate,
    all_captions,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    input_collate,
    set_epoch,
    verify_task_fields,
)
from mtl.data.multi_input import build_task_datasets, class_source
from mtl.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from mtl.data.tokenizer import CaptionTokenizer, extend_to_texts, train_tokenizer
from mtl.delta_m import metric_specs
from mtl.errors import CheckpointError, ConfigError
from mtl.models import blockwise
from mtl.models import vision_encoder_decoder as ved
from mtl.models.backbones import build_backbone
from mtl.models.backbones.base import feature_channels, feature_kind
from mtl.models.decoder import CaptionDecoder
from mtl.models.multitask import MultiTaskModel
from mtl.optim_groups import min_lrs, split_by_layer
from mtl.parallel.dist import DistInfo
from mtl.parallel.fsdp import shard_model
from mtl.plateau import PlateauOnDeltaM
from mtl.registry import PLUGIN_KEYS
from mtl.run import checkpoint as ckpt
from mtl.run.faults import install_poison
from mtl.strategies import strategy_types
from mtl.tasks import BuildInfo, DataInfo, config_task_types
from mtl.weighting import weighting_types


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators from ``seed``: the first thing a run does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def tokenizer_source(cfg) -> str | None:
    """The folder the run's tokenizer comes from: ``tokenizer.path``, else ``init_from``'s, else None (train one)."""
    return cfg.tokenizer.path or (init_from_tokenizer(cfg.init_from) if cfg.get("init_from") else None)


def resolve_tokenizer(cfg, train_captions, source: str | None = None) -> CaptionTokenizer:
    """The run's tokenizer without writing anything: the run's own copy (``output_dir/tokenizer``) if there is
    one, else the one from ``source`` (``tokenizer_source``), else one trained on ``train_captions()``. A warm start
    (``init_from``) whose training captions have words its tokenizer lacks extends it with them
    (``extend_to_texts``; ``init_from_weights`` then grows the decoder's vocabulary to fit), or refuses a tokenizer
    that cannot grow: nothing trains on the unknown token in silence."""
    run_copy = os.path.join(cfg.output_dir, "tokenizer")
    if os.path.isfile(os.path.join(run_copy, "tokenizer.json")):
        return CaptionTokenizer.load(run_copy)
    source = source if source is not None else tokenizer_source(cfg)
    if not source:
        return train_tokenizer(train_captions(), cfg.tokenizer.vocab_size)
    tokenizer = CaptionTokenizer.load(source)
    if cfg.get("init_from") and any("captions" in t.requires for t in run_task_types(cfg).values()):
        tokenizer = extend_to_texts(tokenizer, train_captions(), f"init_from: the tokenizer {source!r}")[0]
    return tokenizer


def build_model(cfg, num_classes: int, class_names: list, tokenizer) -> MultiTaskModel:
    backbone = build_backbone(cfg)  # model.backbone.name, from mtl/models/backbones/ and backbone_modules
    shape = backbone.feature_shape(cfg)
    info = BuildInfo(cfg=cfg, feature_channels=feature_channels(shape),
                     feature_hw=tuple(shape[1:]) if feature_kind(shape) == "map" else (),
                     num_classes=num_classes, class_names=class_names, tokenizer=tokenizer,
                     feature_shape=tuple(shape), pool=getattr(backbone, "pool", "mean"))
    types = run_task_types(cfg)
    scale = cfg.get("loss_scale") or {}
    # model.architecture: the trunk (every shared module) and a tower per task before its head (mtl/architectures/)
    trunk, towers = architecture_of(cfg).build(backbone, list(cfg.tasks), tuple(shape),
                                               architecture_options(cfg), cfg)
    model = MultiTaskModel(trunk, {t: types[t].build(info) for t in cfg.tasks},
                           loss_scale={t: float(scale[t]) for t in cfg.tasks if t in scale}, towers=towers)
    # model.backbone.freeze_blocks: the first N blocks and what runs before them train no more (mtl/models/blockwise.py)
    model.frozen_blocks = blockwise.freeze(model, int(cfg.model.backbone.get("freeze_blocks") or 0))
    if cfg.trainer.get("poison"):  # testing only: the reliability tests' NaN loss
        install_poison(model)
    model.build_info = info  # what it was built for (its classes, its tokenizer): init_from_weights reads it
    return model


def run_task_types(cfg) -> dict[str, type]:
    """The classes of the run's tasks (``cfg.tasks``), from mtl/tasks/, the config's ``task_modules`` and its
    ``task_instances``."""
    types = config_task_types(cfg)
    return {t: types[t] for t in cfg.tasks}


def run_method_types(cfg) -> dict[str, type]:
    """The weighting methods a run can name: mtl/weighting/ and the config's ``weighting_modules``."""
    return weighting_types(cfg.get("weighting_modules") or ())


def build_collate(cfg, num_classes: int, class_names: list, tokenizer) -> BatchCollate:
    """The loaders' collate: ``image``, ``index`` and each of the run's tasks' own batch fields."""
    return BatchCollate(run_task_types(cfg), DataInfo(cfg=cfg, num_classes=num_classes, class_names=list(class_names),
                                                      tokenizer=tokenizer), input_collate(cfg.data.source))


@dataclass
class RunInputs:
    """The read-only part of a run (``build_run_inputs``): data, tokenizer, model and collate."""

    cfg: object
    train_ds: object
    val_ds: object
    tokenizer: CaptionTokenizer
    model: MultiTaskModel  # the bare model, on the CPU, in train mode, with its initial weights
    collate: BatchCollate
    # multi-input mode (data.per_task): {task: (train, val)} and {task: its own collate}; else None
    task_sets: dict | None = None
    task_collates: dict | None = None

    def task_vals(self) -> dict | None:
        """Multi-input mode: {task: its own validation set}; else None (every task evaluates on ``val_ds``)."""
        return None if self.task_sets is None else {t: val for t, (_, val) in self.task_sets.items()}

    def data_sets(self) -> list:
        """Every data set the run reads: the training and val sets, or in multi-input mode every task's two."""
        if self.task_sets is None:
            return [self.train_ds, self.val_ds]
        return [ds for pair in self.task_sets.values() for ds in pair]

    def skipped_lines(self) -> tuple[int, list[str]]:
        """(how many bad data lines ``data.on_error=skip`` left out, their reasons) over every data set."""
        sets = self.data_sets()
        return (sum(getattr(ds, "skipped", 0) for ds in sets),
                [r for ds in sets for r in getattr(ds, "skip_reasons", [])])

    def train_loader(self, rank: int = 0, world_size: int = 1, batch_size: int | None = None):
        """The run's training loader (epoch 0) for ``rank`` of ``world_size``."""
        if self.task_sets is not None:
            raise ConfigError("data.per_task: this tool reads one shared training loader and does not support "
                              "multi-input mode yet (docs/multi-input.md); run it on a config without data.per_task")
        loader = build_train_loader(self.train_ds, self.collate, batch_size or self.cfg.data.batch_size, rank,
                                    world_size, self.cfg.seed, heldout=int(self.cfg.data.get("heldout") or 0))
        set_epoch(loader, 0)
        return loader


def build_run_inputs(cfg, tokenizer_for: Callable | None = None, check_data: Callable | None = None) -> RunInputs:
    """Seed, then build a run's data sets, tokenizer, model and collate from a checked config: the public builder
    for tools (the doctor) and the trainer alike. Read-only by default: it creates, locks and writes nothing (the
    tokenizer is ``output_dir``'s copy if there is one, else ``tokenizer.path``/``init_from``'s, else trained in
    memory). ``tokenizer_for(captions)`` replaces that (the trainer's writes the run's copy);
    ``check_data(train_ds, task_sets)`` runs on the data sets before it (the trainer's checks what its feeds will
    refuse, so that a run refused for its data writes nothing). A task whose required record field the data does
    not have is refused here (DataError naming the task, field and fix)."""
    seed_everything(cfg.seed)
    types, task_sets = run_task_types(cfg), None
    if multi_input(cfg):  # each task its own data set; the class list is the labelled task's
        task_sets = build_task_datasets(cfg, types)
        for t, (train, val) in task_sets.items():
            verify_task_fields({t: types[t]}, {"training": train, "validation": val})
        train_ds = class_source(task_sets, types)
        val_ds = next(v for tr, v in task_sets.values() if tr is train_ds)

        def captions():
            return [c for tr, _ in task_sets.values() if "captions" in tr.provides for c in all_captions(tr.inner)]
    else:
        train_ds, val_ds = build_datasets(cfg)
        verify_task_fields(types, {"training": train_ds, "validation": val_ds})
        captions = lambda: all_captions(train_ds)  # noqa: E731
    if check_data is not None:
        check_data(train_ds, task_sets)
    tokenizer = tokenizer_for(captions) if tokenizer_for else resolve_tokenizer(cfg, captions)
    model = build_model(cfg, train_ds.num_classes, train_ds.class_names, tokenizer)
    for t, head in model.heads.items():  # the training split's statistics a head keeps (a regression's mean, std)
        head.fit_training_data(train_ds if task_sets is None else task_sets[t][0])
    collate = build_collate(cfg, train_ds.num_classes, train_ds.class_names, tokenizer)
    task_collates = None if task_sets is None else {
        t: BatchCollate({t: types[t]}, collate.info) for t in task_sets}
    return RunInputs(cfg, train_ds, val_ds, tokenizer, model, collate, task_sets, task_collates)


def build_eval_loaders(cfg, val_ds, collate: BatchCollate, task_vals: dict | None, rank: int = 0,
                       world_size: int = 1, pin_memory: bool = False) -> dict:
    """{task: its validation loader}, as a run evaluates (``mtl.run.evaluate.evaluate_run``): one loader over ``val_ds``
    shared by every task, or in multi-input mode (``task_vals``: {task: its val set}) each task's own loader over
    its own set, collated for that task alone."""
    d = cfg.data
    if task_vals is None:
        loader = build_eval_loader(val_ds, collate, d.eval_batch_size, rank, world_size, d.num_workers, pin_memory)
        return {t: loader for t in cfg.tasks}
    types = run_task_types(cfg)
    return {t: build_eval_loader(val, BatchCollate({t: types[t]}, collate.info), d.eval_batch_size, rank, world_size,
                                 d.num_workers, pin_memory) for t, val in task_vals.items()}


def build_strategy(cfg):
    return strategy_types()[cfg.ddp.strategy](cfg)


def build_weighting(cfg):
    return run_method_types(cfg)[cfg.weighting.method](cfg, list(cfg.tasks))


def wrap_ddp(model: torch.nn.Module, strategy, dist: DistInfo) -> torch.nn.Module:
    if not dist.distributed:
        return model
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **strategy.ddp_kwargs())


def wrap_model(cfg, model: torch.nn.Module, strategy, dist: DistInfo) -> torch.nn.Module:
    """The engine (``parallel.engine``): DDP around ``model``, or FSDP2 sharding ``model`` in place (its parameters
    become DTensor shards, so the optimizer is built after this). One process: ``model`` itself. First the per-block
    settings (``model.activation_checkpointing``, ``model.compile``: ``blockwise.prepare``), in torchtitan's order."""
    model.block_notes = blockwise.prepare(cfg, model, dist.device.type)
    if cfg.parallel.engine == "fsdp2" and dist.distributed:
        return shard_model(model, cfg.precision, dist)
    return wrap_ddp(model, strategy, dist)


def build_optimizer(cfg, model: torch.nn.Module, weighting: torch.nn.Module) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    # a method whose parameters train at their own learning rate (``Weighting.params_lr``, e.g. UW's
    # weighting.options.lr): its own param group, as the papers' code does; 0 / absent: the model's lr
    own_lr = float(getattr(weighting, "params_lr", 0.0) or 0.0)
    own = [p for p in weighting.parameters() if p.requires_grad] if own_lr > 0 else []
    for module in (model, weighting):
        for p in module.parameters():
            if p.requires_grad and not any(p is q for q in own):
                (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on biases, norms, scalars
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0},
              {"params": own, "weight_decay": 0.0, "lr": own_lr}]
    groups = split_by_layer([g for g in groups if g["params"]], model, float(o.layer_decay), o.lr)  # optim.layer_decay
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=0.9)
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas))


def build_scheduler(cfg, optimizer):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    o, total = cfg.optim, cfg.trainer.max_steps
    if o.scheduler == "plateau":  # on the validation Δm, stepped by the trainer after each evaluation
        p = o.plateau
        return PlateauOnDeltaM(optimizer, metric_specs(cfg), dict(p.baselines), p.factor, p.patience,
                               min_lrs(optimizer, p.min_lr))  # the floor scaled per group (optim.layer_decay)
    if o.scheduler == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, o.warmup_steps, total)
    if o.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, o.warmup_steps, total)
    return get_constant_schedule_with_warmup(optimizer, o.warmup_steps)


# ------------------------------------------------------------------ a trained model's files (init_from, mtl.inference)

MODEL_FILE = "model.safetensors"
CLASS_NAMES_FILE = "class_names.json"


@dataclass
class ModelFiles:
    """Where a trained model's pieces are. ``tokenizer`` and ``class_names`` are the folder's own copies
    when it has them, else the run folder's (a checkpoint ``output_dir/checkpoints/step_N`` falls back
    to ``output_dir``); None when neither exists."""

    folder: str  # the checkpoint or export folder
    weights: str  # its model.safetensors
    config: str | None  # its config.yaml
    tokenizer: str | None  # a folder holding tokenizer.json
    class_names: str | None  # a class_names.json


def find_model_files(path: str, key: str) -> ModelFiles:
    """A checkpoint folder, an export folder, a run's output_dir (its newest checkpoint) or a model.safetensors.

    ``key`` names the setting in messages (e.g. ``init_from``, ``--model``). Raises CheckpointError.
    """
    what = "a checkpoint folder, an export folder, a run's output_dir or a model.safetensors file"
    if os.path.isfile(path):
        folder, weights = os.path.dirname(os.path.abspath(path)), path
    elif os.path.isdir(path):
        folder = path
        if not os.path.isfile(os.path.join(path, MODEL_FILE)):
            folder = ckpt.latest_checkpoint(path)  # a run's output_dir
            if folder is None:
                raise CheckpointError(f"{key}: {path!r} holds no {MODEL_FILE} and no complete checkpoints/step_<N>/: "
                                      f"it is not an mtl model folder. Pass {what}")
        weights = os.path.join(folder, MODEL_FILE)
    else:
        raise CheckpointError(f"{key}: {path!r} does not exist. Pass {what}")
    parent = os.path.dirname(os.path.abspath(folder))
    places = [folder] + ([os.path.dirname(parent)] if os.path.basename(parent) == "checkpoints" else [])
    tokenizers = [os.path.join(p, "tokenizer") for p in places]
    names = [os.path.join(p, CLASS_NAMES_FILE) for p in places]
    config = os.path.join(folder, "config.yaml")
    return ModelFiles(
        folder=folder, weights=weights, config=config if os.path.isfile(config) else None,
        tokenizer=next((t for t in tokenizers if os.path.isfile(os.path.join(t, TOKENIZER_FILE))), None),
        class_names=next((n for n in names if os.path.isfile(n)), None),
    )


def verify_model_files(files: ModelFiles, key: str) -> set[str]:
    """Trust a model folder only once its manifest checks out, as a resume does: a checkpoint through
    ``mtl.run.checkpoint.verify_checkpoint`` (every file's size and SHA-256), an export folder through its own manifest
    (``verify_manifest``, the same check), and every file of the folder that is read (the weights, config.yaml, the
    class names, the tokenizer) must be listed in it. Returns the names the manifest lists (checked), against which
    ``mtl.registry.use_folder_copies`` admits plug-in copies. Raises CheckpointError naming ``key``, the file and the
    fix."""
    folder = files.folder
    fix = ("It changed after it was written (corrupt, or edited by hand): use another checkpoint, or export again "
           "from the run's checkpoint")
    is_checkpoint = os.path.isfile(os.path.join(folder, "trainer_state.pt"))
    if not os.path.isfile(os.path.join(folder, ckpt.MANIFEST)):
        what = "checkpoint" if is_checkpoint else "export folder"
        raise CheckpointError(f"{key}: {what} {folder!r} has no {ckpt.MANIFEST}, so its files cannot be checked "
                              "(written by an mtl without checksums, or assembled by hand); load the weights only "
                              "from a checkpoint written by train.py or a folder written by mtl.tools.export")
    try:
        ckpt.verify_checkpoint(folder) if is_checkpoint else ckpt.verify_manifest(folder)
        with open(os.path.join(folder, ckpt.MANIFEST), encoding="utf-8") as f:
            listed = set(json.load(f)["files"])
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e.message}. {fix}") from None
    code = [os.path.join(folder, key, n) for key in PLUGIN_KEYS if os.path.isdir(os.path.join(folder, key))
            for n in sorted(os.listdir(os.path.join(folder, key)))]  # plug-in copies: imported on load
    used = [files.weights, files.config, files.class_names, *code, *(
        [os.path.join(files.tokenizer, n) for n in sorted(os.listdir(files.tokenizer))] if files.tokenizer else [])]
    for path in used:
        if path is None:
            continue
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder)).replace(os.sep, "/")
        if not rel.startswith("../") and os.path.isfile(path) and rel not in listed:
            raise CheckpointError(f"{key}: {rel} in {folder!r} is not in its {ckpt.MANIFEST} (added after it was "
                                  f"written). {fix}")
    return listed


def find_verified_model_files(path: str, key: str) -> ModelFiles:
    """``find_model_files`` whose folder has passed ``verify_model_files``: what every load path uses (the tools
    and ``init_from``)."""
    files = find_model_files(path, key)
    verify_model_files(files, key)
    return files


def read_model_weights(weights: str, key: str) -> dict:
    """The state dict in an mtl ``model.safetensors`` (a checkpoint's, or an export's copy of it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(weights, "pt") as f:
            meta = f.metadata() or {}
        state = load_file(weights)
    except Exception as e:
        raise CheckpointError(f"{key}: {weights!r} cannot be read as safetensors ({type(e).__name__}); it is "
                              "truncated or not a model file") from None
    if not str(meta.get("format", "")).startswith("mtl-checkpoint-"):  # any version: the keys are checked on load
        raise CheckpointError(f"{key}: {weights!r} is not an mtl model file (no {ckpt.FORMAT!r} tag): pass a file "
                              "written by train.py or mtl.tools.export. For torchvision backbone weights use "
                              "model.backbone.weights")
    return state


def load_model_weights(model: torch.nn.Module, state: dict, key: str, fix: str) -> None:
    """Load ``state`` into ``model`` exactly; anything missing, unexpected or of another shape is named."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {label} (e.g. {', '.join(v[:3])})"
                 for label, v in (("of another shape", shapes), ("missing", missing), ("unexpected", unexpected)) if v]
        raise CheckpointError(f"{key}: the weights do not fit this model: {'; '.join(parts)}. {fix}")
    model.load_state_dict(state)


INIT_FROM_FIX = ("A warm start needs the model of the run that wrote the weights: set model.*, tasks, "
                 "data.image_size and the tokenizer as in that run's config.yaml (a class head's rows follow the "
                 "class names, the caption vocabulary grows with new words, another task head of another size is "
                 "re-initialised; the rest must fit)")
FRESH_CLASS_HEAD = "init_from_fresh_class_head"  # the config key that starts the class heads fresh


def init_from_tokenizer(source: str) -> str:
    """The tokenizer folder that goes with the ``init_from`` weights (a VisionEncoderDecoderModel folder's own)."""
    if ved.is_captioner_source(source):
        return ved.tokenizer_dir(source)
    found = find_verified_model_files(source, "init_from").tokenizer
    if found is None:
        raise CheckpointError(f"init_from: no tokenizer found with {source!r} (a tokenizer/ folder in it or in its "
                              "run folder); set tokenizer.path to the tokenizer those weights were trained with")
    return found


def init_from_weights(model: torch.nn.Module, source: str, class_names: list | None = None,
                      tokenizer: CaptionTokenizer | None = None, fresh_class_head: bool | None = None) -> str:
    """Warm start: load the weights of ``source`` into ``model`` (nothing else); return what was read, in words
    (one line, then a line per note).

    ``class_names``, ``tokenizer`` and ``fresh_class_head`` (``init_from_fresh_class_head``) default to what the
    model was built for (``build_model``). Fine-tuning onto other data:
    - the heads of the tasks that read labels follow the class names (``match_class_rows``): the rows of the classes
      both runs have carry over to this run's order, a new class keeps its fresh rows, a missing one is dropped;
      no class in common is refused unless those heads start fresh;
    - a caption decoder whose vocabulary this run's tokenizer extended (``resolve_tokenizer``) loads its old rows
      and grows as transformers' ``resize_token_embeddings`` does (``shrink_grown_decoders``);
    - another task head whose tensors all exist in the file but some with another shape keeps its fresh
      initialisation, and is named;
    everything else loads strictly (a missing, unexpected or misshapen backbone key is refused, naming it)."""
    info = getattr(model, "build_info", None)
    class_names = class_names if class_names is not None else (info.class_names if info else None)
    tokenizer = tokenizer if tokenizer is not None else (info.tokenizer if info else None)
    if fresh_class_head is None:
        fresh_class_head = bool(info.cfg.get(FRESH_CLASS_HEAD)) if info else False
    if ved.is_captioner_source(source):  # transformers' captioner layout (mtl/models/vision_encoder_decoder.py)
        files, state, notes = init_from_captioner(model, source, tokenizer)
        weights = files.folder
    else:
        files = find_verified_model_files(source, "init_from")
        weights = files.weights
        state = read_model_weights(weights, "init_from")
        notes = match_class_rows(model, state, files, class_names, fresh_class_head)
    notes += adopt_plain_weights(model, state)  # an hps (or captioner) file into a model with an architecture
    grown = shrink_grown_decoders(model, state, files, tokenizer)
    own = model.state_dict()
    fresh: dict[str, list[str]] = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "heads" and k in own and own[k].shape != v.shape:
            fresh.setdefault(parts[1], []).append(f"{k} {tuple(v.shape)} in the file, {tuple(own[k].shape)} here")
    kept = []  # the same head with other sizes: it keeps its fresh weights
    for task in fresh:
        head = {k for k in own if k.startswith(f"heads.{task}.")}
        if head == {k for k in state if k.startswith(f"heads.{task}.")}:
            state.update({k: own[k] for k in head})
            kept.append(task)
    load_model_weights(model, state, f"init_from {weights!r}", INIT_FROM_FIX)
    for name, decoder, size, added in grown:
        old = decoder.vocab_size
        decoder.resize_vocab(size)
        notes.append(f"{name}: vocabulary {old} -> {size} tokens, {len(added)} word(s) of the training captions added "
                     f"to the tokenizer ({shown(added)}); the old rows kept, the new ones as transformers' "
                     "resize_token_embeddings makes them")
    if kept:
        notes.append("re-initialised for their new shapes: " + "; ".join(
            f"heads.{t} ({', '.join(fresh[t][:2])})" for t in kept) + "; every other weight loaded")
    return weights + "".join(f"\ninit_from: {n}" for n in notes)


def init_from_captioner(model: torch.nn.Module, folder: str,
                        tokenizer: CaptionTokenizer | None) -> tuple[ModelFiles, dict, list[str]]:
    """``init_from`` of a ``VisionEncoderDecoderModel`` folder: (its files, the state dict under mtl's names, the
    notes). The folder is checked against the run's config and the built model first (ConfigError naming each key
    to set); the encoder becomes the backbone, the decoder the caption head's, and the other heads start fresh."""
    info = getattr(model, "build_info", None)
    if info is None:
        raise ValueError("init_from_captioner: the model must come from build_model (its config is needed)")
    old = CaptionTokenizer.load(folder) if os.path.isfile(os.path.join(folder, TOKENIZER_FILE)) else None
    errors = ved.check_model(info.cfg, model, folder, ved.read_config(folder), tokenizer, old)
    if errors:
        raise ConfigError(errors)
    state, notes = ved.ved_state(model, ved.load_folder(folder))
    files = ModelFiles(folder=folder, weights=folder, config=None, tokenizer=folder, class_names=None)
    return files, state, notes


def shown(names: list, limit: int = 8) -> str:
    """Names for a message: the first ``limit``, and how many there are in all when more."""
    return ", ".join(map(str, names[:limit])) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def read_class_names(path: str) -> list[str]:
    """A model folder's ``class_names.json``: a JSON list of strings."""
    try:
        with open(path, encoding="utf-8") as f:
            names = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"init_from: {path!r} cannot be read as JSON ({e}); export the model again") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"init_from: {path!r} is not a JSON list of class names; export the model again")
    return names


def match_class_rows(model: torch.nn.Module, state: dict, files: ModelFiles, class_names: list | None,
                     fresh: bool) -> list[str]:
    """The heads of the tasks that read labels (``requires`` has ``label``), in ``state`` (in place): their per-class
    tensors (first dimension the file's class count there, this run's here) get the rows of the classes both runs
    have, in this run's order, and a new class keeps the model's own fresh rows. ``fresh``: those heads keep their
    fresh initialisation. Returns the notes. Refused (CheckpointError): no class in common; a folder without
    class_names.json whose head has another size."""
    own = model.state_dict()
    heads = [t for t, h in model.heads.items() if "label" in getattr(h, "requires", ())]
    if not heads:
        return []
    fix = f"Set {FRESH_CLASS_HEAD}=true to start " + "/".join(f"heads.{t}" for t in heads) + " fresh (every other " \
          "weight loads)"
    if fresh:
        for t in heads:
            for k in [k for k in state if k.startswith(f"heads.{t}.")]:
                del state[k]
            state.update({k: v for k, v in own.items() if k.startswith(f"heads.{t}.")})
        return [", ".join(f"heads.{t}" for t in heads) + f": fresh ({FRESH_CLASS_HEAD}=true)"]
    if class_names is None:
        raise ValueError("init_from_weights: the run's class names are needed for its class heads")
    new = list(class_names)
    old = read_class_names(files.class_names) if files.class_names else None
    notes = []
    for t in heads:
        keys = [k for k in own if k.startswith(f"heads.{t}.")]
        if not all(k in state for k in keys):
            continue  # a head the file lacks: the strict load names it
        if old is None:
            if all(state[k].shape == own[k].shape for k in keys):
                notes.append(f"heads.{t}: {files.folder!r} has no {CLASS_NAMES_FILE}, so its rows load by position, "
                             f"taken to be this run's {len(new)} classes in this order ({shown(new)})")
                continue
            raise CheckpointError(f"init_from: {files.folder!r} has no {CLASS_NAMES_FILE} and its heads.{t} is of "
                                  f"another size than this run's {len(new)} classes, so its rows cannot be matched "
                                  f"to them. {fix}")
        if numbered(old) and numbered(new):
            notes.append(f"heads.{t}: both runs' classes are integer labels ({shown(old)}"
                         f"{'' if old == new else '; this run: ' + shown(new)}), so its rows load by index: if the two "
                         "data sets number their classes differently, name them (class names as labels, or a first "
                         'manifest line {"classes": [...]}) and the rows follow the names')
        if old == new:
            continue
        rows = [k for k in keys if k in state and state[k].ndim >= 1 and state[k].ndim == own[k].ndim
                and state[k].shape[0] == len(old) and own[k].shape[0] == len(new)
                and state[k].shape[1:] == own[k].shape[1:]]
        if not rows:
            continue
        where = {n: i for i, n in enumerate(old)}
        carried = [n for n in new if n in where]
        if not carried:
            raise CheckpointError(f"init_from: none of this run's {len(new)} classes ({shown(new)}) is among the "
                                  f"{len(old)} of {files.class_names!r} ({shown(old)}), so heads.{t}'s rows cannot "
                                  f"carry over. {fix}, or train on data with that model's classes")
        for k in rows:
            merged = own[k].detach().clone()
            for i, n in enumerate(new):
                if n in where:
                    merged[i] = state[k][where[n]]
            state[k] = merged
        added, dropped = [n for n in new if n not in where], [n for n in old if n not in set(new)]
        moved = [f"{n} {where[n]}->{i}" for i, n in enumerate(new) if n in where and where[n] != i]
        notes.append(f"heads.{t} rows matched by class name ({CLASS_NAMES_FILE}): carried {len(carried)} "
                     f"({shown(carried)}{'; moved ' + shown(moved) if moved else ''}), new {len(added)}"
                     f"{' (' + shown(added) + ', initialised as a fresh head)' if added else ''}, dropped "
                     f"{len(dropped)}{' (' + shown(dropped) + ')' if dropped else ''}")
    return notes


def numbered(names: list[str]) -> bool:
    """Whether ``names`` are the classes of integer labels, which name nothing: "0", "1", ..."""
    return names == [str(i) for i in range(len(names))]


def shrink_grown_decoders(model: torch.nn.Module, state: dict, files: ModelFiles,
                          tokenizer: CaptionTokenizer | None) -> list[tuple[str, CaptionDecoder, int, list[str]]]:
    """Each caption decoder whose vocabulary this run's ``tokenizer`` extended from the model folder's (every old
    token keeps its id; ``resolve_tokenizer``) is shrunk back to the file's rows, so the file loads; returns
    (its name, it, its size, the words added) for ``init_from_weights`` to grow it again after the load."""
    decoders = [(n, m) for n, m in model.named_modules() if isinstance(m, CaptionDecoder)]
    if not decoders or tokenizer is None or files.tokenizer is None:
        return []
    old_vocab, new_vocab = CaptionTokenizer.load(files.tokenizer).vocab(), tokenizer.vocab()
    if len(new_vocab) <= len(old_vocab) or any(new_vocab.get(w) != i for w, i in old_vocab.items()):
        return []  # not an extension of the folder's tokenizer
    added = [w for w, _ in sorted(new_vocab.items(), key=lambda kv: kv[1]) if w not in old_vocab]
    out = []
    for name, decoder in decoders:
        rows = state.get(f"{name}.lm.transformer.wte.weight")
        if rows is not None and rows.shape[0] == len(old_vocab) and decoder.vocab_size == len(new_vocab):
            out.append((name, decoder, decoder.vocab_size, added))
            decoder.resize_vocab(len(old_vocab))
    return out
