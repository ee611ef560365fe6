"""The optimizer's parameter groups under ``optim.layer_decay`` (layer-wise learning-rate decay, as BEiT and MAE
fine-tune), and their one-line description printed at start-up.

The rule is MAE's ``util/lr_decay.py`` (``param_groups_lrd`` with ``get_layer_id_for_vit``), which is BEiT's
(``get_num_layer_for_vit`` with ``LayerDecayValueAssigner``): with L backbone blocks (``Backbone.blocks()``) a
parameter gets a layer id, and its lr is ``optim.lr * layer_decay ** (L + 1 - id)``:

- id 0: the backbone's parameters registered before its first block and in none (a ViT's cls token, position and
  patch embeddings; a ResNet's stem): ``decay ** (L + 1)``;
- id i + 1 for block i (0-based): ``decay ** (L - i)`` (the last block: ``decay ** 1``);
- id L + 1 for everything else: the backbone's parameters after its last block (a ViT's final norm), the heads
  (their decoder blocks included) and the weighting's: ``decay ** 0``, the full lr.

Each group of ``mtl.setup.build.build_optimizer`` (weight decay or not, a weighting's own lr) is split by that scale;
each new group carries ``lr_scale`` beside its ``lr``. The schedulers keep the ratios: transformers' warmup/cosine/linear
schedules multiply each group's own initial lr by one factor (``LambdaLR``), and the plateau schedule's floor
(``optim.plateau.min_lr``) is scaled per group (``min_lrs``). ``layer_decay: 1`` leaves the groups as they were.
"""

from __future__ import annotations

from torch import nn

from mtl.models.blockwise import backbone_blocks, before_first_block


def layer_ids(model: nn.Module) -> tuple[dict[int, int], int]:
    """({id(parameter): its layer id} for the backbone's parameters below id L + 1, L + 1)."""
    blocks = backbone_blocks(model)
    n = len(blocks)
    ids = {id(p): 0 for _, p in before_first_block(model.backbone, [(k[len("backbone."):], m) for k, m in blocks])}
    for i, (_, m) in enumerate(blocks):
        for p in m.parameters():
            ids[id(p)] = i + 1
    return ids, n + 1


def split_by_layer(groups: list[dict], model: nn.Module, decay: float, lr: float) -> list[dict]:
    """``groups`` (torch param-group dicts) split by layer-wise lr scale; each new group gets ``lr`` (its own or
    ``lr``, times the scale) and ``lr_scale``, deepest layers first. ``decay == 1``: ``groups`` as they are."""
    if decay == 1.0:
        return groups
    ids, top = layer_ids(model)
    out = []
    for g in groups:
        by_id: dict[int, list] = {}
        for p in g["params"]:
            by_id.setdefault(ids.get(id(p), top), []).append(p)
        for layer in sorted(by_id):
            scale = decay ** (top - layer)
            out.append({**g, "params": by_id[layer], "lr": g.get("lr", lr) * scale, "lr_scale": scale})
    return out


def min_lrs(optimizer, min_lr: float) -> list[float]:
    """The plateau schedule's floor per group: ``min_lr`` times the group's ``lr_scale``."""
    return [min_lr * g.get("lr_scale", 1.0) for g in optimizer.param_groups]


def describe(optimizer) -> str:
    """One line: each param group's lr scale, weight decay, and count of parameters (tensors and elements)."""
    parts = []
    for i, g in enumerate(optimizer.param_groups):
        n = sum(p.numel() for p in g["params"])
        parts.append(f"[{i}] lr x{g.get('lr_scale', 1.0):.4g} (lr {g.get('initial_lr', g['lr']):.3g}), weight_decay {g['weight_decay']:g}, "
                     f"{len(g['params'])} tensors, {n:,} parameters")
    return f"optimizer: {type(optimizer).__name__}, {len(parts)} param groups: " + "; ".join(parts)
