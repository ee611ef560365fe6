"""Task-weighting methods, found by name: each method module here defines one Weighting subclass
(``base`` holds the base classes, ``qp`` the shared K x K solvers and ``checks`` the range checks of
the methods' options)."""

from mtl.registry import discover
from mtl.weighting.base import Weighting

__all__ = ["Weighting", "weighting_types"]


def weighting_types() -> dict[str, type]:
    return discover(__name__, Weighting)
