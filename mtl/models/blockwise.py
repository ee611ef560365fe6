"""Per-block model settings: ``model.backbone.freeze_blocks``, ``model.activation_checkpointing`` and
``model.compile`` act on the blocks a model declares (``Backbone.blocks()``: a transformer's layers, a CNN's stages;
``TaskHead.shard_units()``: the caption decoder's GPT-2 blocks), the same units FSDP2 shards one by one
(``mtl.parallel.fsdp.shard_units``). docs/scale.md.

- ``freeze(model, n)``: the first n backbone blocks and every backbone parameter registered before the first block
  (the embeddings, a CNN's stem) get ``requires_grad=False``: no optimizer state, no gradient, no all-reduce (DDP
  and FSDP2 are built after this and see only the trainable parameters; ``task_grads``' shared list is the trainable
  backbone parameters).
- ``checkpoint_blocks(model)``: each block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint``
  (``use_reentrant=False``), set on the instance (what torch's ``checkpoint_wrapper`` does, without its extra module
  level: names and state dicts are unchanged, and FSDP2's hooks, which are on the module's call, still gather the
  block before its forward and before its backward, where the recomputation runs): a block keeps only its inputs for
  the backward pass and recomputes the rest, with the RNG state of its forward (dropout is the same), so losses and
  gradients are exact. Each backward pass over the graph recomputes again, so the strategies that run several
  (``retain_graph``, ``autograd.grad`` then ``backward``: task_grads, feature_leaf, detach) work. (torch's composable
  ``torch.distributed._composable.checkpoint`` does not: its recomputation re-enters a one-shot context manager on
  the second pass, an AttributeError in torch 2.14.)
- ``compile_blocks(model)``: ``module.compile()`` on every block (regional compilation: one graph per block class, so
  recompiles stay few; the module, its names and its state dict stay as they are), with inductor's
  ``fallback_random`` on: its random numbers come from eager's generator, so dropout draws eager's masks.

``prepare(cfg, model)`` applies checkpointing then compilation, the order torchtitan uses (activation checkpointing,
``torch.compile`` per block, then ``fully_shard`` per block and the root): ``mtl.setup.build.wrap_model`` calls it before
the engine. ``freeze`` runs when the model is built (``mtl.setup.build.build_model``), so that every tool sees what trains.
"""

from __future__ import annotations

import shutil

from torch import nn

from mtl.errors import ConfigError


def backbone_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The backbone's declared blocks, named from the model (``backbone.<name>``)."""
    return [(f"backbone.{name}", m) for name, m in model.backbone.blocks()]


def head_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each head's declared units (``TaskHead.shard_units``), named from the model (``heads.<task>.<name>``)."""
    return [(f"heads.{t}.{name}", m) for t, head in model.heads.items() for name, m in head.shard_units()]


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every declared block: the backbone's, then the heads'."""
    return backbone_blocks(model) + head_blocks(model)


def _require_backbone_blocks(model: nn.Module, key: str, why: str) -> list[tuple[str, nn.Module]]:
    blocks = backbone_blocks(model)
    if not blocks:
        raise ConfigError(f"{key}: the backbone {type(model.backbone).__name__} declares no blocks "
                          f"(Backbone.blocks() is empty), so {why}; use a backbone that declares them (hf_vision, "
                          f"timm, the torchvision ones) or remove the key")
    return blocks


def before_first_block(backbone: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """The backbone's parameters registered before its first block's first parameter and in no block (a ViT's
    embeddings, a ResNet's stem): the 'layer 0' of layer-wise lr decay, frozen with the first block."""
    inside = {id(p) for _, m in blocks for p in m.parameters()}
    first = {id(p) for p in blocks[0][1].parameters()} if blocks else set()
    out = []
    for name, p in backbone.named_parameters():
        if id(p) in first:
            break
        if id(p) not in inside:
            out.append((name, p))
    return out


def freeze(model: nn.Module, n: int) -> list[str]:
    """``model.backbone.freeze_blocks``: ``requires_grad=False`` on the first ``n`` backbone blocks and what comes
    before them; returns the frozen parameters' names (from the backbone)."""
    if n <= 0:
        return []
    key = "model.backbone.freeze_blocks"
    blocks = _require_backbone_blocks(model, key, "there is nothing to count the first N in")
    if n > len(blocks):
        raise ConfigError(f"{key}: {n} is more than the {len(blocks)} blocks the backbone "
                          f"{type(model.backbone).__name__} declares; use 0..{len(blocks)}")
    names = {id(p): name for name, p in model.backbone.named_parameters()}
    params = [p for _, p in before_first_block(model.backbone, blocks)]
    params += [p for _, m in blocks[:n] for p in m.parameters()]
    for p in params:
        p.requires_grad_(False)
    return [names[id(p)] for p in params]


def freeze_backbone(model: nn.Module) -> list[str]:
    """``model.backbone.freeze: true`` (a linear probe): ``requires_grad=False`` on every parameter of the backbone
    (its embeddings, every block, the final layernorm after them, which ``freeze_blocks`` = all blocks leaves
    training); the architecture's own modules (an MMoE's gates and experts) and the heads train. Returns the frozen
    parameters' names (from the trunk)."""
    inner = getattr(model.backbone, "backbone", model.backbone)  # the Backbone inside an architecture's trunk
    tracking = [name for name, m in inner.named_modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if tracking:  # in training mode they would go on updating their running statistics: the probe's features drift
        raise ConfigError(f"model.backbone.freeze: true, but the backbone has {len(tracking)} BatchNorm layer(s) "
                          f"({tracking[0]}, ...) whose running statistics training would still update, so the features "
                          "under the probe would drift; set model.backbone.norm=frozen (the pretrained statistics, "
                          "fixed) too")
    mine = {id(p) for p in inner.parameters()}
    frozen = [(name, p) for name, p in model.backbone.named_parameters() if id(p) in mine]
    for _, p in frozen:
        p.requires_grad_(False)
    model.frozen_key = "model.backbone.freeze"
    return [name for name, _ in frozen]


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Activation checkpointing on every declared block; returns their names."""
    _require_backbone_blocks(model, "model.activation_checkpointing", "there are no blocks to recompute")
    blocks = model_blocks(model)
    for _, m in blocks:
        _checkpoint_forward(m)
    return [name for name, _ in blocks]


def _checkpoint_forward(module: nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = module.forward  # the class's forward, bound

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)  # RNG state preserved (dropout replayed)

    module.forward = forward


def compiler_problem() -> str | None:
    """Why inductor cannot compile on this CPU, or None: the C++ compiler inductor calls (``torch._inductor.config
    .cpp.cxx``, else the ones it searches for) must exist."""
    from torch._inductor import config as inductor_config

    wanted = inductor_config.cpp.cxx
    names = [c for c in wanted if c] if isinstance(wanted, tuple) else [wanted]
    names = names or ["g++", "clang++", "c++"]
    if any(shutil.which(c) for c in names):
        return None
    return (f"torch.compile's inductor backend needs a C++ compiler and none of {', '.join(names)} is on PATH; "
            "install one (e.g. apt-get install g++) or set model.compile=false")


def compile_blocks(model: nn.Module, device_type: str = "cpu") -> list[str]:
    """``module.compile()`` on every declared block (regional compilation); returns their names."""
    _require_backbone_blocks(model, "model.compile", "there are no blocks to compile one by one")
    if device_type == "cpu":
        why = compiler_problem()
        if why:
            raise ConfigError(f"model.compile: {why}")
    import torch._inductor.config as inductor_config

    # the compiled blocks draw their random numbers (dropout masks) with eager's generator, not inductor's own: a run
    # with dropout then draws the masks eager draws (tests/test_scale.py), where inductor's own draws other ones
    inductor_config.fallback_random = True
    blocks = model_blocks(model)
    for _, m in blocks:
        m.compile()
    return [name for name, _ in blocks]


def prepare(cfg, model: nn.Module, device_type: str = "cpu") -> list[str]:
    """``model.activation_checkpointing`` then ``model.compile`` (torchtitan's order, before ``fully_shard``);
    returns one line per setting applied."""
    notes = []
    if cfg.model.get("activation_checkpointing"):
        names = checkpoint_blocks(model)
        notes.append(f"model.activation_checkpointing: {len(names)} blocks recompute in the backward pass")
    if cfg.model.get("compile"):
        names = compile_blocks(model, device_type)
        notes.append(f"model.compile: {len(names)} blocks compiled one by one (torch.compile, inductor)")
    return notes


def frozen_note(model: nn.Module) -> list[str]:
    """The start-up lines of the backbone's loading (``load_notes``: a pretrained folder's tensors it does not load,
    hf_vision) and of ``model.backbone.freeze_blocks`` or ``freeze`` (none when nothing is frozen)."""
    inner = getattr(model.backbone, "backbone", model.backbone)  # the Backbone inside an architecture's trunk
    notes = list(getattr(inner, "load_notes", []) or [])
    names = getattr(model, "frozen_blocks", [])
    if not names:
        return notes
    key = getattr(model, "frozen_key", "model.backbone.freeze_blocks")
    return notes + [f"{key}: {len(names)} backbone parameter tensors frozen ({names[0]} ... {names[-1]})"]
