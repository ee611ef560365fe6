"""Multi-task architectures, found by name: every module here that defines an ``Architecture`` subclass with a
``name``, and the modules a config names in ``architecture_modules``. ``base`` holds the interface."""

from mtl.architectures.base import Architecture, Trunk
from mtl.config.schema import options_of
from mtl.errors import ConfigError
from mtl.registry import registered

__all__ = ["Architecture", "Trunk", "architecture_of", "architecture_options", "architecture_types"]


def architecture_types(extra_modules=()) -> dict[str, type]:
    """Every architecture by name: this package's and those of ``extra_modules`` (``architecture_modules``)."""
    return registered(__name__, Architecture, extra_modules, "architecture_modules", "architecture")


def architecture_of(cfg) -> type:
    """The class of ``model.architecture.name``."""
    types = architecture_types(cfg.get("architecture_modules") or ())
    name = cfg.model.architecture.name
    if name not in types:
        raise ConfigError(unknown_architecture(name, types))
    return types[name]


def unknown_architecture(name: str, types: dict) -> str:
    return f"model.architecture.name: unknown architecture {name!r} (supported: {', '.join(types)})"


def architecture_options(cfg):
    """The run's architecture's ``Options`` filled from ``model.architecture.options``."""
    return options_of(architecture_of(cfg).Options, cfg.model.architecture.get("options"), "model.architecture.options")
