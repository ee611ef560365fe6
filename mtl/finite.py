"""Non-finite values where a run keeps them: the weights after a step, a state about to be saved, the final
evaluation. (Losses and gradients are checked in the step itself, mtl/step.py.)

Each check that decides for the run is agreed over the ranks: under FSDP2 each rank sees only its own shards.
"""

from __future__ import annotations

import math

import torch

from mtl.dist import all_reduce_sum


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2 DTensor's shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def first_nonfinite(tree, prefix: str = "") -> str | None:
    """The key path of the first floating-point tensor (this rank's part) in ``tree`` (nested dicts, lists,
    tuples) holding a NaN or inf, or None."""
    if torch.is_tensor(tree):
        t = _local(tree)
        return prefix or "(tensor)" if t.is_floating_point() and not bool(torch.isfinite(t).all()) else None
    if isinstance(tree, float):
        return prefix if not math.isfinite(tree) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = first_nonfinite(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return None


def params_finite(params: list[torch.Tensor], sharded: bool) -> bool:
    """Whether every parameter is finite, the same answer on every rank. ``sharded`` (FSDP2: each rank holds other
    shards): agreed in a collective; otherwise every rank holds the same replicas and decides alone."""
    if not params:
        return True
    ok = torch.stack([torch.isfinite(_local(p.detach())).all() for p in params]).all()
    if not sharded:
        return bool(ok)
    return bool(all_reduce_sum((~ok).to(torch.float32).reshape(1))[0] == 0)


def nonfinite_eval(metrics: dict[str, float], tasks: list[str]) -> list[str]:
    """The evaluation metrics (``<task>_<name>``) that show a diverged model: any inf, and a NaN beside a metric
    of the same task that is a number. (A task whose metrics are all NaN had nothing to score: a counting task on
    data with no known counts.)"""
    bad = []
    for task in tasks:
        own = {k: v for k, v in metrics.items() if k.startswith(f"{task}_") and isinstance(v, (int, float))}
        scored = any(math.isfinite(v) for v in own.values())
        bad += [k for k, v in own.items() if math.isinf(v) or (math.isnan(v) and scored)]
    return bad
