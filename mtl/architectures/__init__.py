"""Multi-task architectures, found by name: every module here that defines an ``Architecture`` subclass with a
``name``, and the modules a config names in ``architecture_modules``. ``base`` holds the interface."""

from mtl.architectures.base import Architecture, Trunk
from mtl.config.schema import options_of
from mtl.registry import chosen, registered, unknown_name

__all__ = ["Architecture", "Trunk", "adopt_plain_weights", "architecture_of", "architecture_options",
           "architecture_types"]


def architecture_types(extra_modules=()) -> dict[str, type]:
    """Every architecture by name: this package's and those of ``extra_modules`` (``architecture_modules``)."""
    return registered(__name__, Architecture, extra_modules, "architecture_modules", "architecture")


def architecture_of(cfg) -> type:
    """The class of ``model.architecture.name``."""
    types = architecture_types(cfg.get("architecture_modules") or ())
    return chosen(types, cfg.model.architecture.name, "model.architecture.name", "architecture")


def unknown_architecture(name: str, types: dict) -> str:
    return unknown_name("model.architecture.name", "architecture", name, types)


def architecture_options(cfg):
    """The run's architecture's ``Options`` filled from ``model.architecture.options``."""
    return options_of(architecture_of(cfg).Options, cfg.model.architecture.get("options"), "model.architecture.options")


def adopt_plain_weights(model, state: dict) -> list[str]:
    """A warm start of a model with an architecture (its backbone inside a ``Trunk``, its towers) from the weights of
    a model without one (``hps``: ``backbone.*``, ``heads.*``; or a captioner's encoder): the file's backbone goes to
    the trunk's backbone (``backbone.backbone.*``) and the architecture's own tensors (experts, gates, attention
    modules) keep their fresh initialisation, named in the returned note. ``state`` is changed in place; nothing
    happens (no note) where the model has no trunk or the file already has the architecture's layout. A backbone
    that does not fit is still refused by the strict load that follows."""
    if not isinstance(model.backbone, Trunk) or any(k.startswith(("towers.", "backbone.backbone.")) for k in state):
        return []
    own = model.state_dict()
    moved = {f"backbone.{k}": state.pop(k) for k in list(state) if k.startswith("backbone.") and f"backbone.{k}" in own}
    if not moved:
        return []
    state.update(moved)
    fresh = [k for k in own if k not in state and k.startswith(("towers.", "backbone."))
             and not k.startswith("backbone.backbone.")]
    state.update({k: own[k] for k in fresh})
    parts = sorted({".".join(k.split(".")[:2]) for k in fresh})
    name = model.build_info.cfg.model.architecture.name if getattr(model, "build_info", None) else "?"
    return [f"model.architecture.name={name}: the file has no such architecture: its backbone loaded into the "
            f"architecture's ({len(moved)} tensors); the architecture's own {len(fresh)} tensors start fresh "
            f"({', '.join(parts)})"]
