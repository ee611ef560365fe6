"""What a multi-task architecture is: how the backbone's features reach each task's head, one file each.

An architecture is a module in ``mtl/architectures/`` (or a file the config names in ``architecture_modules``)
defining an ``Architecture`` subclass with a ``name``: ``model.architecture.name`` picks it (``hps``, hard parameter
sharing, the default). Its own options live in ``model.architecture.options``, declared by an ``Options`` dataclass
and checked like every config key.

``build(backbone, tasks, feature_shape, options, cfg)`` splits the network in two at the one tensor every strategy splits
at (the ``feature_leaf`` leaf, the features source's Gram matrix, ``detach``):

- the **trunk**: every module whose parameters more than one task reaches (the backbone, shared experts, ...). It
  maps ``batch[consumes]`` to the *shared tensor* (B, *shared_shape): the model's ``backbone`` attribute, so the
  strategies, FSDP2, DDP and the weighting methods' ``parameters`` source see every shared parameter as today;
- a **tower** per task (or none): the modules only that task reaches (its gate, its own experts). It maps the
  shared tensor to the features its head reads, of the backbone's ``feature_shape``, so every head works unchanged.

With ``hps`` the trunk is the backbone and there are no towers: the model is exactly what it was. An architecture
whose tasks read disjoint parts of the shared tensor (nothing is read by every task) sets ``features_source`` to
why the features source cannot serve it, and the config check refuses it by name.
"""

from __future__ import annotations

from torch import nn

from mtl.config.keys import NoOptions


class Architecture:
    name: str = ""  # model.architecture.name
    summary: str = ""
    Options: type = NoOptions  # model.architecture.options
    # None: the features source (weighting.source: features) works on the shared tensor; else why it does not
    features_source: str | None = None

    @classmethod
    def build(cls, backbone: nn.Module, tasks: list[str], feature_shape: tuple[int, ...], options, cfg) -> tuple[
            nn.Module, dict[str, nn.Module]]:
        """(the trunk, {task: tower}) for ``backbone`` whose features per item have ``feature_shape``; ``options``:
        the filled ``Options``; ``cfg``: the run's config (``data.image_size`` for a probe of the backbone)."""
        raise NotImplementedError(f"{cls.__name__} must define build")

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this architecture (each names the key and the fix)."""
        return []


class Trunk(nn.Module):
    """A trunk that wraps the backbone: it answers for it where the run asks the backbone (the batch field it reads,
    its pooling, its declared blocks, its feature shape), so the per-block settings, FSDP2's units and the input
    pipeline work through it. Subclasses define ``forward(x)`` -> the shared tensor."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    @property
    def consumes(self) -> str:
        return getattr(self.backbone, "consumes", "image")

    @property
    def pool(self) -> str:
        return getattr(self.backbone, "pool", "mean")

    def blocks(self) -> list[tuple[str, nn.Module]]:
        inner = self.backbone.blocks() if hasattr(self.backbone, "blocks") else []
        return [(f"backbone.{name}", m) for name, m in inner]
