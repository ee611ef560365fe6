"""Task-weighting methods, found by name: each method module here defines one Weighting subclass
(``base`` holds the base classes, ``qp`` the shared K x K solvers and ``checks`` the range checks of
the methods' options), and so does each module a config names in ``weighting_modules``."""

from mtl.registry import registered
from mtl.weighting.base import Weighting

__all__ = ["Weighting", "weighting_types"]


def weighting_types(extra_modules=()) -> dict[str, type]:
    """Every method by name: this package's, plus those of ``extra_modules`` (the config's ``weighting_modules``:
    dotted module names or ``.py`` file paths, a user's method outside this package). Raises ConfigError naming a
    module that cannot be used, or a name taken by a built-in method."""
    return registered(__name__, Weighting, extra_modules, "weighting_modules", "method")
