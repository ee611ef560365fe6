"""Backbones, found by name: every module here that defines a ``Backbone`` subclass with a ``name`` (or a family
listing its ``variants``), and the modules a config names in ``backbone_modules`` (a backbone file outside this
package). ``base`` holds the interface."""

from mtl.models.backbones.base import Backbone
from mtl.registry import chosen, registered, unknown_name

__all__ = ["Backbone", "backbone_types", "build_backbone"]


def backbone_types(extra_modules=()) -> dict[str, type]:
    """Every backbone by name: this package's, plus those of ``extra_modules`` (the config's ``backbone_modules``:
    dotted module names or ``.py`` file paths). Raises ConfigError naming a module that cannot be used, or a name
    taken by a built-in backbone."""
    return registered(__name__, Backbone, extra_modules, "backbone_modules", "backbone")


def build_backbone(cfg) -> Backbone:
    """The run's backbone: ``model.backbone.name`` among mtl/models/backbones/ and the config's ``backbone_modules``."""
    types = backbone_types(cfg.get("backbone_modules") or ())
    return chosen(types, cfg.model.backbone.name, "model.backbone.name", "backbone").build(cfg)


def unknown_backbone(name: str, types: dict) -> str:
    return unknown_name("model.backbone.name", "backbone", name, types)
