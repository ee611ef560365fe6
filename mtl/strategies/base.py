"""What a step strategy is: how the model is wrapped in DDP and how a step's backward passes run.

A strategy is one file in ``mtl/strategies/`` defining a ``Strategy`` subclass with a ``name``.
``forward_backward`` runs the forward pass(es) and one backward pass per task (``combined`` runs
one in all) and leaves the rank-averaged gradient of the weighted objective in ``.grad``. The
trainer then clips, steps the optimizer and zeroes the gradients; strategies never do.

A strategy describes its own costs: the class attributes (forwards, backbone backward passes,
all-reduces per step, static_graph support) and the classmethods ``allreduce_bytes`` and
``extra_memory_bytes``. ``tests/test_allreduce_counts.py`` asserts the all-reduces and bytes with a
counting comm hook; ``mtl.tools.doctor``, ``mtl.tools.bench.sweep`` and ``mtl.tools.bench.strategies`` read them from the
class and never key a formula by a strategy's name.

Collectives a strategy runs by hand go through ``StepInputs.comm`` (a ``mtl.parallel.dist.Comm``), never a
module-level function, so tools count them by handing over a ``CountingComm``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.parallel.dist import Comm
from mtl.parallel.fsdp import is_sharded, no_gradient_sync


@dataclass
class StepInputs:
    model: torch.nn.Module  # DDP-wrapped when distributed, else the bare MultiTaskModel
    batch: dict
    tasks: list
    weigh: Callable[[str, torch.Tensor], torch.Tensor]  # the weighting method's per-task term
    scale: Callable[[torch.Tensor], torch.Tensor]  # AMP loss scaling (identity unless fp16)
    combine: Callable | None = None  # a gradient-level method's combine(grads, losses), else None
    # a Gram-only gradient-level method's weights_for_gram(gram, losses, dtype) -> w (K,), else None
    gram_weights: Callable | None = None
    # FSDP2: a row method that combines per shard (``RowWeighting.combine_shard`` / ``finish_shard``), else None
    combine_shard: Callable | None = None
    finish_shard: Callable | None = None
    # ``weighting.heads: weighted``: the Gram method's weights_for_heads() -> w (K,) of the step's combination, by which
    # the strategy multiplies each present head's gradient (``weigh_heads_``); None: the heads keep their own gradients
    head_weights: Callable | None = None
    loss_scale: Callable[[], float] = lambda: 1.0  # the current fp16 loss scale
    comm: Comm = field(default_factory=Comm)  # the collectives a strategy runs by hand
    # the per-task gradient norms and cosines for the step log (``gradient_stats`` / ``gram_stats``): asked for on
    # the steps the log writes; False: the strategy leaves them out (they are not needed to take the step)
    log_stats: bool = True


class Strategy:
    name: str = ""
    summary: str = ""
    find_unused_parameters: bool = False  # what DDP must be built with
    supports_static_graph: bool = False  # ddp.static_graph=true: only with one backward pass per forward
    unsafe: bool = False  # kept to reproduce a failure; never recommended or benchmarked
    # every parameter gets a gradient in every step (a zero term over the unused ones), so DDP needs no
    # find_unused_parameters when a head is unused in a step (multi-input mode, mtl/setup/multi_input.py)
    covers_unused_parameters: bool = False
    # per-step costs: an int, or "K" for one per task
    forwards: int | str = 1  # backbone forwards
    backbone_backwards: int | str = 1
    allreduces: int | str = 1  # reductions of every gradient bucket
    changes_objective: bool = False
    task_gradients: bool = False  # gives gradient-level weighting methods each task's gradient
    # the weighting.source values it serves a gradient-level method: "parameters" (each task's gradient of the
    # shared parameters) and/or "features" (of the shared features, through their Gram matrix)
    gradient_sources: tuple[str, ...] = ()
    # model.peft.per_task: every task's forward is its own (the encoder runs under each task's adapters), so each task
    # reads features of its own; False where the heads share one forward's features (detach, feature_leaf, task_grads)
    per_task_forwards: bool = False
    # parallel.engine=fsdp2: None if the strategy runs under FSDP2 (and is in its parity test), else why it does not
    fsdp2_refusal: str | None = None

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def cost(cls, num_tasks: int) -> dict:
        """{'forwards', 'backbone_backwards', 'allreduces'} per step for ``num_tasks`` tasks."""
        return {k: num_tasks if getattr(cls, k) == "K" else getattr(cls, k)
                for k in ("forwards", "backbone_backwards", "allreduces")}

    @classmethod
    def allreduce_bytes(cls, num_tasks: int, shared_params: int, head_params: int, elem: int = 4) -> int:
        """Bytes each process all-reduces per step: every bucket, ``allreduces`` times."""
        return cls.cost(num_tasks)["allreduces"] * (shared_params + head_params) * elem

    @classmethod
    def extra_memory_bytes(cls, num_tasks: int, shared_params: int, feature_numel: int, elem: int = 4) -> int:
        """Memory held beyond ``combined``'s during a step (feature map of the batch: ``feature_numel``)."""
        return 0

    @classmethod
    def fsdp2_problem(cls) -> str | None:
        """Why this strategy does not run under ``parallel.engine=fsdp2``, or None."""
        return cls.fsdp2_refusal

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Refuse DDP flags and options that are known to fail or desync with this strategy."""
        errors = []
        if cfg.parallel.engine == "fsdp2":  # no DDP flags apply; mtl.parallel.fsdp.check refuses them and the strategy
            return errors
        fu = cfg.ddp.find_unused_parameters
        if fu is not None and fu != cls.find_unused_parameters and not cls.tolerates_find_unused(fu):
            errors.append(cls.find_unused_reason(fu))
        if cfg.ddp.static_graph and not cls.supports_static_graph:
            errors.append(
                f"ddp.static_graph: true cannot be used with ddp.strategy={cls.name}: static_graph does not support "
                "several backward passes per step (and with no_sync it has silently stopped syncing). Set "
                "ddp.static_graph=false, or ddp.strategy=combined"
            )
        return errors

    @classmethod
    def tolerates_find_unused(cls, value: bool) -> bool:
        return False

    @classmethod
    def find_unused_reason(cls, value: bool) -> str:
        return (f"ddp.find_unused_parameters: {str(value).lower()} does not work with ddp.strategy={cls.name}, "
                f"which needs {str(cls.find_unused_parameters).lower()}; remove the key to use the strategy's own setting")

    def ddp_kwargs(self) -> dict:
        fu = self.cfg.ddp.find_unused_parameters
        return {
            "find_unused_parameters": self.find_unused_parameters if fu is None else bool(fu),
            "static_graph": bool(self.cfg.ddp.static_graph),
            "gradient_as_bucket_view": True,
            "bucket_cap_mb": self.cfg.ddp.bucket_cap_mb,
        }

    def forward_backward(self, step: StepInputs) -> tuple[dict, dict]:
        """Run the step's forward and backward passes.

        Returns (detached per-task losses, extra statistics to log).
        """
        raise NotImplementedError


def no_sync(model: torch.nn.Module):
    """``model.no_sync()`` under DDP, ``set_requires_gradient_sync(False)`` under FSDP2; nothing in a single
    process. (DDP decides at the forward, FSDP2 at the backward: wrap both.)"""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()

    return no_gradient_sync(model) if is_sharded(model) else contextlib.nullcontext()


def weigh_heads_(model: torch.nn.Module, tasks: list, weights: torch.Tensor) -> None:
    """Head t's gradient (already rank-averaged) times ``weights[t]``, in place, for each of the step's ``tasks``: what
    a backward pass of ``sum_t w_t L_t`` gives the heads (``weighting.heads: weighted``). Every rank holds the same
    w, so scaling the average is the average of the scaled. A parameter the backbone shares is left alone."""
    bare = model.module if isinstance(model, DistributedDataParallel) else model
    shared = {id(p) for p in bare.backbone.parameters()}
    for t, w in zip(tasks, weights.tolist()):
        grads = [p.grad for p in bare.heads[t].parameters() if p.grad is not None and id(p) not in shared]
        if grads:
            torch._foreach_mul_(grads, w)


def detached(losses: dict) -> dict:
    return {k: v.detach() for k, v in losses.items()}


def gradient_stats(tasks: list, rows: torch.Tensor, prefix: str = "") -> dict:
    """Per-task gradient norms and the pairwise cosines of the rows of ``rows`` (K, N), as tensors."""
    norms = rows.norm(dim=1)
    stats = {f"{prefix}grad_norm/{t}": norms[i] for i, t in enumerate(tasks)}
    unit = rows / norms.clamp(min=1e-30)[:, None]
    return _add_cosines(stats, tasks, unit @ unit.T, prefix)


def gram_stats(tasks: list, gram: torch.Tensor, prefix: str = "") -> dict:
    """``gradient_stats`` of the rows whose Gram matrix is ``gram`` (K, K)."""
    norms = gram.diagonal().clamp(min=0).sqrt()
    stats = {f"{prefix}grad_norm/{t}": norms[i] for i, t in enumerate(tasks)}
    inv = 1 / norms.clamp(min=1e-30)
    return _add_cosines(stats, tasks, gram * inv[:, None] * inv[None, :], prefix)


def _add_cosines(stats: dict, tasks: list, cos: torch.Tensor, prefix: str) -> dict:
    for i, a in enumerate(tasks):
        for j in range(i + 1, len(tasks)):
            stats[f"{prefix}grad_cos/{a}_{tasks[j]}"] = cos[i, j]
    return stats
