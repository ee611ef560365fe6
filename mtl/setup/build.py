"""Build a run from its config: data, tokenizer, model, collate (``build_run_inputs``, read-only),
strategy, weighting, optimizer, scheduler."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.architectures import architecture_of, architecture_options
from mtl.config.keys import multi_input
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
from mtl.data.tokenizer import CaptionTokenizer, extend_to_texts, train_tokenizer
from mtl.delta_m import metric_specs
from mtl.errors import ConfigError
from mtl.models import blockwise, peft_adapters
from mtl.models.backbones import build_backbone
from mtl.models.backbones.base import feature_channels, feature_kind
from mtl.models.multitask import MultiTaskModel
from mtl.optim.layer_groups import min_lrs, split_by_layer
from mtl.optim.plateau import PlateauOnDeltaM
from mtl.parallel.dist import DistInfo
from mtl.parallel.fsdp import shard_model
from mtl.setup.model_files import (  # noqa: F401  (a trained model's files: here too, as mtl.setup.build offered them)
    CLASS_NAMES_FILE,
    FRESH_CLASS_HEAD,
    INIT_FROM_FIX,
    MODEL_FILE,
    ModelFiles,
    find_model_files,
    find_verified_model_files,
    init_from_captioner,
    init_from_tokenizer,
    init_from_weights,
    load_model_weights,
    match_class_rows,
    numbered,
    read_class_names,
    read_model_weights,
    shown,
    shrink_grown_decoders,
    verify_model_files,
)
from mtl.setup.poison import install_poison
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
    heads = {t: types[t].build(info) for t in cfg.tasks}  # after the trunk: the order of the initial weights' draws
    switch, notes = None, []
    if peft_adapters.peft_on(cfg):  # model.peft: LoRA on the encoder (and a pretrained decoder), the base frozen
        switch, notes = peft_adapters.apply(cfg, backbone, heads, list(cfg.tasks))
    model = MultiTaskModel(trunk, heads, loss_scale={t: float(scale[t]) for t in cfg.tasks if t in scale},
                           towers=towers, adapters=switch)
    model.peft_notes = [*notes, peft_adapters.count_note(model)] if notes else []
    # model.backbone.freeze: the whole backbone trains no more (a linear probe); freeze_blocks: the first N blocks and
    # what runs before them (mtl/models/blockwise.py)
    model.frozen_blocks = (blockwise.freeze_backbone(model) if cfg.model.backbone.get("freeze") else
                           blockwise.freeze(model, int(cfg.model.backbone.get("freeze_blocks") or 0)))
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
