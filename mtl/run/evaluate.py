"""Validation: each rank evaluates its shard, the partial results are gathered, every rank reduces."""

from __future__ import annotations

import torch

from mtl.data.loader import rng_untouched, to_device
from mtl.parallel.dist import all_gather_objects


class EvaluationStopped(Exception):
    """A rank's ``stop()`` said yes during the evaluation: every rank raises it together, with no metrics."""


@torch.no_grad()
def evaluate(model, loader, tasks: list[str], device: torch.device, max_batches: int = 0, stop=None) -> dict:
    """``model`` is the bare MultiTaskModel. Returns {task: {metric: value}} (identical on every rank).

    Draws from no random stream that training uses (making the loader's iterator would draw a seed
    from torch's global generator), so ``trainer.eval_every`` can change on resume.

    ``stop``: asked before each batch (the trainer's stop signal); once it says yes on any rank, the evaluation
    ends on every rank at the gather, with ``EvaluationStopped`` (a batch has no collective, so the ranks may stop
    at different batches).
    """
    with rng_untouched():
        return _evaluate(model, loader, tasks, device, max_batches, stop)


def _evaluate(model, loader, tasks: list[str], device: torch.device, max_batches: int, stop=None) -> dict:
    was_training = model.training
    model.eval()
    parts: dict = {t: [] for t in tasks}
    stopped = False
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            if stop is not None and stop():
                stopped = True
                break
            batch = to_device(batch, device)
            with model.autocast(device.type):
                x = batch[getattr(model.backbone, "consumes", "image")]
                for t, features in model.features_by_task(x, tasks):  # per-task adapters: one forward each
                    parts[t].append(model.heads[t].eval_batch(model.task_features(t, features), batch))
    finally:
        model.train(was_training)
    gathered = all_gather_objects((parts, stopped))
    if any(cut for _, cut in gathered):
        raise EvaluationStopped
    gathered = [rank for rank, _ in gathered]
    return {t: model.heads[t].eval_reduce([p for rank in gathered for p in rank[t]]) for t in tasks}


def evaluate_run(model, loaders: dict, device: torch.device, max_batches: int = 0, stop=None) -> dict:
    """A run's evaluation (the trainer's, and ``mtl.inference``'s): {task: {metric: value}}. ``loaders`` maps each
    task to its validation loader (``mtl.setup.build.build_eval_loaders``): the tasks that share one loader (one data set
    for every task) are evaluated in one pass over it, a task with its own (multi-input mode) on its own set.
    ``stop``: as ``evaluate``'s (EvaluationStopped)."""
    groups: dict[int, tuple] = {}
    for t, loader in loaders.items():
        groups.setdefault(id(loader), (loader, []))[1].append(t)
    out: dict = {}
    for loader, tasks in groups.values():
        out.update(evaluate(model, loader, tasks, device, max_batches, stop))
    return {t: out[t] for t in loaders}
