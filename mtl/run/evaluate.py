"""Validation: each rank evaluates its shard, the partial results are gathered, every rank reduces."""

from __future__ import annotations

import torch

from mtl.data.loader import rng_untouched, to_device
from mtl.parallel.dist import all_gather_objects


@torch.no_grad()
def evaluate(model, loader, tasks: list[str], device: torch.device, max_batches: int = 0) -> dict:
    """``model`` is the bare MultiTaskModel. Returns {task: {metric: value}} (identical on every rank).

    Draws from no random stream that training uses (making the loader's iterator would draw a seed
    from torch's global generator), so ``trainer.eval_every`` can change on resume.
    """
    with rng_untouched():
        return _evaluate(model, loader, tasks, device, max_batches)


def _evaluate(model, loader, tasks: list[str], device: torch.device, max_batches: int) -> dict:
    was_training = model.training
    model.eval()
    parts: dict = {t: [] for t in tasks}
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            batch = to_device(batch, device)
            with model.autocast(device.type):
                features = model.backbone(batch[getattr(model.backbone, "consumes", "image")])
                for t in tasks:
                    parts[t].append(model.heads[t].eval_batch(model.task_features(t, features), batch))
    finally:
        model.train(was_training)
    gathered = all_gather_objects(parts)
    return {t: model.heads[t].eval_reduce([p for rank in gathered for p in rank[t]]) for t in tasks}


def evaluate_run(model, loaders: dict, device: torch.device, max_batches: int = 0) -> dict:
    """A run's evaluation (the trainer's, and ``mtl.inference``'s): {task: {metric: value}}. ``loaders`` maps each
    task to its validation loader (``mtl.build.build_eval_loaders``): the tasks that share one loader (one data set
    for every task) are evaluated in one pass over it, a task with its own (multi-input mode) on its own set."""
    groups: dict[int, tuple] = {}
    for t, loader in loaders.items():
        groups.setdefault(id(loader), (loader, []))[1].append(t)
    out: dict = {}
    for loader, tasks in groups.values():
        out.update(evaluate(model, loader, tasks, device, max_batches))
    return {t: out[t] for t in loaders}
