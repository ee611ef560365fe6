"""The FSDP2 engine (``parallel.engine: fsdp2``): ``fully_shard`` per backbone block (``Backbone.blocks()``: a
transformer's layers, a CNN's stages) or stage, per head and per unit a head declares (the caption decoder's
transformer blocks), then the root.

DDP (``parallel.engine: ddp``, the default) keeps a full copy of the parameters, gradients and optimizer
state on every rank and all-reduces the gradients. FSDP2 (``torch.distributed.fsdp.fully_shard``,
DTensor-based) keeps 1/W of each on every rank: a group's parameters are all-gathered for its forward
and again for its backward, and its gradients are reduce-scattered when its backward is done, so each
rank ends the backward passes holding its shard of the rank-averaged gradient (a DTensor).

What that changes for a step (docs/fsdp.md):

- FSDP2 decides at the *backward* (not at the forward, as DDP does) whether a group's gradients are
  reduced, and at the end of every backward pass it reduce-scatters what each group has accumulated.
  So a strategy that runs several backward passes per step is correct as long as each parameter's
  gradient is reduced once per pass that produced it: ``combined``, ``feature_leaf`` and ``detach``
  run as they are; ``accumulate`` turns gradient sync off for all but the last pass
  (``set_requires_gradient_sync(False)``, through ``mtl.strategies.base.no_sync``).
- A strategy declares whether it runs under FSDP2 on its class (``Strategy.fsdp2_refusal``); a
  refused one is one config error naming the reason (``check``).
- ``task_grads`` (gradient-level weighting) keeps each rank's shard of each task's gradient and sums the
  shards' Gram matrices in one K x K all-reduce (``local_shards``, and ``shard_index`` for a method that
  combines per shard); a weighting method that cannot run on shards is refused (``check_method``).
- fp16 uses torch's ``ShardedGradScaler`` (mtl/parallel/amp.py), which agrees on an overflow over the ranks.
- The gradient norm (finite check, clipping) is the global norm over the shards (``grad_norm``).
- Checkpoints hold the sharded model and optimizer state (``mtl/checkpoint/train_state.py``) and the full model
  gathered to rank 0 for ``model.safetensors`` (``full_model_state``); the full optimizer state
  (``full_optimizer_state``) is what mtl-checkpoint-v1 checkpoints held, still read on resume.

Nothing here runs without a process group: a 1-process run is the bare model under either engine.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from mtl.errors import ConfigError

ENGINES = ("ddp", "fsdp2")


def check(cfg, strategy) -> list[str]:
    """Config-time refusals for ``parallel.engine: fsdp2`` (``strategy``: the strategy class, or None)."""
    if cfg.parallel.engine != "fsdp2":
        return []
    errors = []
    why = strategy.fsdp2_problem() if strategy is not None else None
    if why:
        errors.append(f"ddp.strategy: {cfg.ddp.strategy} does not run with parallel.engine=fsdp2: {why}. "
                      "Use ddp.strategy=feature_leaf (or combined, detach, accumulate), or parallel.engine=ddp")
    for key, value, default in (("find_unused_parameters", cfg.ddp.find_unused_parameters, None),
                                ("static_graph", cfg.ddp.static_graph, False)):
        if value != default:
            errors.append(f"ddp.{key}: a DistributedDataParallel option, meaningless with parallel.engine=fsdp2 "
                          "(FSDP2 has no reducer); remove the key")
    if cfg.ddp.nan_monitor:
        errors.append("ddp.nan_monitor: not supported with parallel.engine=fsdp2 (it recomputes each task's gradient "
                      "with autograd.grad on the parameters, which FSDP2 holds as shards); non-finite steps are "
                      "still skipped on every rank. Set ddp.nan_monitor=false, or parallel.engine=ddp to locate a NaN")
    if cfg.model.backbone.norm == "batch":
        errors.append("model.backbone.norm: batch keeps per-rank running statistics, which DDP copies from rank 0 at "
                      "every forward and FSDP2 does not (each rank would evaluate with its own); use "
                      "model.backbone.norm=group or frozen (rank-independent) or sync (CUDA), or parallel.engine=ddp")
    return errors


def check_method(cfg, method) -> list[str]:
    """Config-time refusal of a weighting method (``method``: its class) for ``parallel.engine: fsdp2``."""
    if cfg.parallel.engine != "fsdp2":
        return []
    errors = []
    why = method.fsdp2_problem()
    if why:
        errors.append(f"weighting.method: {method.name} does not run with parallel.engine=fsdp2: {why}. Use a "
                      "Gram-based method (pcgrad, mgda, cagrad, nashmtl, ...) or graddrop, or parallel.engine=ddp")
    if cfg.weighting.get("heads") == "weighted":  # task_grads' sharded path leaves the heads as they are
        errors.append("weighting.heads: weighted does not run with parallel.engine=fsdp2 (the heads' sharded gradients "
                      "are not weighted there); use parallel.engine=ddp, or remove weighting.heads")
    return errors


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def shard_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules sharded on their own, in the order ``fully_shard`` wraps them (an inner unit before the unit
    that holds it); the root comes last (``shard_model``). Backbone: ``backbone_units``. Heads: for each head, the
    units it declares (``TaskHead.shard_units``: the caption decoder's transformer blocks), then the head itself,
    which keeps the rest (the tied embedding / LM head)."""
    units = backbone_units(model.backbone)
    for name, head in model.heads.items():
        inner = head.shard_units()
        _verify_no_shared_parameters(name, head, inner)
        units += [(f"heads.{name}.{sub}", m) for sub, m in inner]
        units.append((f"heads.{name}", head))
    return units


def backbone_units(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """The backbone's units, in forward order, named from the model. A backbone that declares blocks
    (``Backbone.blocks()``: a transformer's layers, a CNN's stages): each block is a unit, and every other
    parameter-holding module on the way to them is one too, as a whole (a ViT's embeddings and final norm, a ResNet's
    stem): a walk from the backbone down that stops at a block or at a module holding none. Without declared blocks:
    each child of a ``Sequential`` child of the backbone whose children are containers themselves (ResNet's
    layer1..layerN, a ``.features`` CNN's blocks); any other child with parameters as a whole."""
    blocks = backbone.blocks() if hasattr(backbone, "blocks") else []
    if blocks:
        is_block = {id(m) for _, m in blocks}
        holds = {id(c) for _, m in blocks for c in _ancestors(backbone, m)}
        units = []

        def walk(prefix, module):
            for name, child in module.named_children():
                path = f"{prefix}.{name}"
                # no forward of its own (ModuleList, ParameterList, ...): no unit (FSDP2 gathers a unit in its
                # forward); its modules are walked, its own parameters stay with the module above
                container = type(child).forward is nn.Module.forward
                if id(child) in is_block or (id(child) not in holds and _has_params(child) and not container):
                    units.append((path, child))
                elif id(child) in holds or container:
                    walk(path, child)

        walk("backbone", backbone)
        return units
    units = []
    for name, child in backbone.named_children():
        split = isinstance(child, nn.Sequential) and any(any(True for _ in c.children()) for c in child.children())
        parts = child.named_children() if split else [("", child)]
        for sub, m in parts:
            if _has_params(m):
                units.append((f"backbone.{name}" + (f".{sub}" if sub else ""), m))
    return units


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """The modules strictly between ``root`` and ``target`` (its containers)."""
    for name, m in root.named_modules():
        if m is target:
            parts = name.split(".")
            return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []


def _verify_no_shared_parameters(name: str, head: nn.Module, inner: list[tuple[str, nn.Module]]) -> None:
    """A parameter lives in one FSDP2 unit: a tied weight (GPT-2's wte and LM head) split over two units would be
    sharded twice and stop being one parameter. Refuse a head whose declared units share a parameter with each
    other or with the rest of the head: a ConfigError (one message for the job, not a traceback per rank) naming
    the head and ``TaskHead.shard_units``, the code to change."""
    owner = {}
    fix = "keep tied weights in one FSDP2 unit (declare neither end, or a module holding both), or use parallel.engine=ddp"
    for sub, m in inner:
        for p in m.parameters():
            if id(p) in owner:
                raise ConfigError(f"heads.{name}: the shard units {owner[id(p)]} and {sub} its TaskHead.shard_units "
                                  f"declares share a parameter; {fix}")
            owner[id(p)] = sub
    inside = {id(p) for _, m in inner for p in m.parameters()}
    for pname, p in head.named_parameters(remove_duplicate=False):
        if id(p) in inside and not any(pname.startswith(f"{sub}.") for sub, _ in inner):
            raise ConfigError(f"heads.{name}: its parameter {pname} is tied to a parameter of the shard unit "
                              f"{owner[id(p)]} that its TaskHead.shard_units declares; {fix}")


def gathered_now(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """The units (of ``units``: ``shard_units(model)``, plus ``("", model)`` for the root) whose full parameters
    exist right now, with their bytes. FSDP2 registers a unit's full (unsharded) parameters on its modules while it
    is gathered and its DTensor shards otherwise, so a unit is gathered when its own parameters are plain tensors."""
    from torch.distributed.tensor import DTensor

    taken, out = set(), {}
    for name, m in units:  # inner units come first: a unit's own parameters are what its inner units leave
        own = [p for p in m.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        if own and not any(isinstance(p, DTensor) for p in own):
            out[name] = sum(p.numel() * p.element_size() for p in own)
    return out


@contextlib.contextmanager
def watch_gathered(model: nn.Module):
    """Record, at every forward and every backward of each leaf module, which units are gathered (``gathered_now``):
    yields a list that fills with (``"forward"`` or ``"backward"``, the module's name, {unit: bytes}). The backward
    sample is taken when the gradient of the module's output arrives, before the module's own backward. For the
    memory tool and the tests (it costs a walk over the parameters per sample)."""
    units = [*shard_units(model), ("", model)]
    samples, handles = [], []

    def sample(phase, name):
        samples.append((phase, name, gathered_now(model, units)))

    def on_output(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: sample("backward", name))
        return hook

    for name, m in model.named_modules():
        if next(m.children(), None) is None and _has_params(m):
            handles.append(m.register_forward_pre_hook(lambda module, args, name=name: sample("forward", name)))
            handles.append(m.register_forward_hook(on_output(name)))
    try:
        yield samples
    finally:
        for h in handles:
            h.remove()


def mixed_precision(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":  # bf16 compute and all-gathers, fp32 sharded parameters and gradient reduction
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # fp32 throughout; fp16: fp32 parameters and gradients, the model's own fp16 autocast, the sharded GradScaler
    # (mtl/parallel/amp.py), as under DDP
    return MixedPrecisionPolicy()


def shard_model(model: nn.Module, precision: str, dist) -> nn.Module:
    """``fully_shard`` every unit of ``shard_units`` and then the root, on a 1-D mesh of all ranks.
    The parameters become DTensors: build the optimizer after this."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    mp = mixed_precision(precision)
    for _, unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """FSDP2's ``no_sync``: backward passes inside keep their (unsharded) gradients local and accumulate them;
    the next backward pass with sync on reduce-scatters the sum (FSDP2 decides at the backward)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every group's full parameters on every rank for a block (evaluation): all-gathered once, on entry,
    with no collective inside, so ranks may run different numbers of batches; resharded on exit."""
    mods = fsdp_modules(model)
    inner = [m for m in mods if m is not model]  # the root keeps FSDP2's own setting (no reshard after forward)
    for m in mods:
        m.unshard()
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in inner:
            m.set_reshard_after_forward(True, recurse=False)
        for m in mods:
            m.reshard()


# ------------------------------------------------------------------ per-task gradient shards (task_grads)


def local_shards(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of each parameter's gradient: the DTensor's local shard (a view: writes reach ``.grad``).
    A parameter left without a gradient gets a zero one first."""
    from torch.distributed.tensor import DTensor

    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return out


def shard_index(params: list[torch.Tensor]) -> torch.Tensor:
    """(n,) int64: the positions of this rank's gradient shards (``local_shards``, concatenated) in the flat
    vector of the full parameters, concatenated in the same order (the coordinates a method that needs the rows
    of G sees in one process). FSDP2 shards dim 0; the offset comes from DTensor's own layout."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    parts, start = [], 0
    for p in params:
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            row = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 0
            first = start + (offset[0] * row if p.dim() else 0)
            parts.append(torch.arange(first, first + math.prod(shape), dtype=torch.int64))
        else:
            parts.append(torch.arange(start, start + p.numel(), dtype=torch.int64))
        start += p.numel()
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


# ------------------------------------------------------------------ gradient norm over shards


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads``. Without DTensors: ``torch.nn.utils.get_total_norm`` as it is. With
    FSDP2's DTensor shards (and plain gradients beside them, e.g. learned loss weights): get_total_norm of the
    shards is a DTensor whose ``full_tensor()`` is the norm over every rank's shard (one all-reduce; tested
    against a single process in tests/test_fsdp.py), combined with the plain part's norm."""
    from torch.distributed.tensor import DTensor

    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if not sharded:
        return torch.nn.utils.get_total_norm(plain)
    total = torch.nn.utils.get_total_norm(sharded)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    if plain:
        total = torch.linalg.vector_norm(torch.stack([total, torch.nn.utils.get_total_norm(plain).to(total)]))
    return total


def clip_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """``clip_grads_with_norm_``: every gradient times min(1, max_norm / (total + 1e-6)); shards too (the
    coefficient is one number, the same on every rank, since ``total`` is the global norm)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)


# ------------------------------------------------------------------ checkpoints: full state, gathered on rank 0


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: nn.Module) -> dict:
    """Collective: the full, unsharded state dict on CPU on rank 0 (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict) -> None:
    """Every rank holds the full ``state`` (read from model.safetensors): each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=True))


class Owner(nn.Module):
    """The modules whose parameters the optimizer holds (the model, and learned loss weights), so that
    optimizer state is keyed by their names (``model.backbone...``, ``weighting...``)."""

    def __init__(self, model: nn.Module, weighting: nn.Module):
        super().__init__()
        self.model, self.weighting = model, weighting


def full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer) -> dict:
    """Collective: the optimizer's full state keyed by parameter name, on CPU on rank 0 (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(Owner(model, weighting), optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state(model: nn.Module, weighting: nn.Module, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(Owner(model, weighting), optimizer, state, options=_options())
