"""Find the pluggable pieces (tasks, strategies, weighting methods) by name.

Each piece is one module in its package defining one subclass of the package's base class with a
non-empty ``name``. Adding a piece means adding a file; nothing else needs to be edited.
"""

from __future__ import annotations

import importlib
import pkgutil


def discover(package: str, base: type) -> dict[str, type]:
    pkg = importlib.import_module(package)
    found: dict[str, type] = {}
    for mod in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, base) and obj.name and obj.__module__ == module.__name__:
                found[obj.name] = obj
    return dict(sorted(found.items()))
