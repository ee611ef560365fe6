"""Task-weighting methods, found by name: each module here defines one Weighting subclass."""

from mtl.registry import discover
from mtl.weighting.base import Weighting

__all__ = ["Weighting", "weighting_types"]


def weighting_types() -> dict[str, type]:
    return discover(__name__, Weighting)
