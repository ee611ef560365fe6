"""Validation: each rank evaluates its shard, the partial results are gathered, every rank reduces."""

from __future__ import annotations

import torch

from mtl.dist import all_gather_objects


def to_device(batch: dict, device: torch.device) -> dict:
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, loader, tasks: list[str], device: torch.device, max_batches: int = 0) -> dict:
    """``model`` is the bare MultiTaskModel. Returns {task: {metric: value}} (identical on every rank)."""
    was_training = model.training
    model.eval()
    parts: dict = {t: [] for t in tasks}
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            batch = to_device(batch, device)
            with model.autocast(device.type):
                features = model.backbone(batch["image"])
                for t in tasks:
                    parts[t].append(model.heads[t].eval_batch(features, batch))
    finally:
        model.train(was_training)
    gathered = all_gather_objects(parts)
    return {t: model.heads[t].eval_reduce([p for rank in gathered for p in rank[t]]) for t in tasks}
