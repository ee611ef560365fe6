"""Build a run's pieces from its config: tokenizer, model, strategy, weighting, optimizer, scheduler."""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.data.tokenizer import CaptionTokenizer, train_tokenizer
from mtl.dist import DistInfo, barrier
from mtl.models.backbone import build_backbone
from mtl.models.multitask import MultiTaskModel
from mtl.strategies import strategy_types
from mtl.tasks import BuildInfo, task_types
from mtl.weighting import weighting_types


def build_tokenizer(cfg, train_captions, dist: DistInfo) -> CaptionTokenizer:
    """The run's own copy (``output_dir/tokenizer``) wins, so a resumed run decodes as before.

    Only rank 0 looks at the file system and writes; then EVERY rank meets at the barrier, whatever it
    sees on disk. (A rank that skipped the barrier because it looked after rank 0 had written the file
    entered DDP's start-up collective while rank 0 waited in the barrier: a deadlock.)
    """
    run_copy = os.path.join(cfg.output_dir, "tokenizer")
    if dist.is_main and not os.path.isfile(os.path.join(run_copy, "tokenizer.json")):
        tok = (CaptionTokenizer.load(cfg.tokenizer.path) if cfg.tokenizer.path
               else train_tokenizer(train_captions(), cfg.tokenizer.vocab_size))
        tok.save(run_copy)
    barrier()
    return CaptionTokenizer.load(run_copy)


def build_model(cfg, num_classes: int, class_names: list, tokenizer) -> MultiTaskModel:
    b = cfg.model.backbone
    backbone = build_backbone(b.name, b.weights, b.norm, b.stages)
    with torch.no_grad():
        was = backbone.training
        backbone.eval()
        fmap = backbone(torch.zeros(1, 3, cfg.data.image_size, cfg.data.image_size))
        backbone.train(was)
    info = BuildInfo(cfg=cfg, feature_channels=fmap.shape[1], feature_hw=tuple(fmap.shape[2:]),
                     num_classes=num_classes, class_names=class_names, tokenizer=tokenizer)
    types = task_types()
    return MultiTaskModel(backbone, {t: types[t].build(info) for t in cfg.tasks})


def build_strategy(cfg):
    return strategy_types()[cfg.ddp.strategy](cfg)


def build_weighting(cfg):
    return weighting_types()[cfg.weighting.method](cfg, list(cfg.tasks))


def wrap_ddp(model: torch.nn.Module, strategy, dist: DistInfo) -> torch.nn.Module:
    if not dist.distributed:
        return model
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **strategy.ddp_kwargs())


def build_optimizer(cfg, model: torch.nn.Module, weighting: torch.nn.Module) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for module in (model, weighting):
        for p in module.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)  # no decay on biases, norms, scalars
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
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
    if o.scheduler == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, o.warmup_steps, total)
    if o.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, o.warmup_steps, total)
    return get_constant_schedule_with_warmup(optimizer, o.warmup_steps)
