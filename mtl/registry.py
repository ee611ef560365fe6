"""Find the pluggable pieces (tasks, backbones, strategies, weighting methods) by name.

Each piece is one module in its package defining one subclass of the package's base class with a
non-empty ``name``. Adding a piece means adding a file; nothing else needs to be edited. A class that serves
several names (a torchvision backbone family) lists them in ``variants`` and is found by each of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil

from mtl.errors import ConfigError


def _plugins(module, base: type, attr: str = "name") -> dict[str, type]:
    """The ``base`` subclasses defined in ``module`` with a non-empty ``attr`` (``name``; or ``kind``: a task *type*
    that makes named tasks, ``TaskHead.instance``), by each name they answer to."""
    found = {}
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, base) and getattr(obj, attr, "") and obj.__module__ == module.__name__:
            for name in (getattr(obj, "variants", ()) if attr == "name" else ()) or (getattr(obj, attr),):
                found[name] = obj
    return found


def discover(package: str, base: type, attr: str = "name") -> dict[str, type]:
    pkg = importlib.import_module(package)
    found: dict[str, type] = {}
    for mod in pkgutil.iter_modules(pkg.__path__):
        found.update(_plugins(importlib.import_module(f"{package}.{mod.name}"), base, attr))
    return dict(sorted(found.items()))


def _import(spec: str):
    """A module by dotted name, or a ``.py`` file by path (imported once per absolute path, kept in sys.modules
    under ``mtl_plugins.<stem>_<n>`` so that its classes pickle in forked loader workers)."""
    import sys

    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    path = os.path.abspath(spec)
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path and module.__name__.startswith("mtl_plugins."):
            return module
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {spec!r} (from the current directory {os.getcwd()!r})")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"mtl_plugins.{stem}_{sum(1 for m in sys.modules if m.startswith('mtl_plugins.'))}"
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def discover_modules(specs: list[str], base: type, key: str, attr: str = "name") -> dict[str, type]:
    """The ``base`` subclasses with a ``name`` (or another ``attr``) defined in each module of ``specs`` (dotted names
    or .py paths). A module must define at least one class with a ``name`` or a ``kind``.

    ConfigError (all problems at once) names ``key``, the module and why it cannot be used."""
    found: dict[str, type] = {}
    errors = []
    for spec in specs:
        try:
            module = _import(str(spec))
        except Exception as e:  # an import error in a user's file: say which file and what went wrong
            errors.append(f"{key}: cannot import {spec!r}: {type(e).__name__}: {e} — give a dotted module name "
                          "importable here, or a path to a .py file")
            continue
        classes = _plugins(module, base, attr)
        if not _plugins(module, base) and not _plugins(module, base, "kind"):
            errors.append(f"{key}: {spec!r} defines no {base.__name__} subclass with a name")
        found.update(classes)
    if errors:
        raise ConfigError(errors)
    return found


def registered(package: str, base: type, extra_modules, key: str, kind: str, attr: str = "name") -> dict[str, type]:
    """``package``'s ``base`` subclasses by name plus those of ``extra_modules`` (the config's ``key``: dotted module
    names or ``.py`` file paths), sorted by name. Raises ConfigError naming a module that cannot be used, or a
    ``kind`` ("task", "backbone", "method") whose name a built-in one already has. ``attr``: what the classes are
    found by (``name``; ``kind`` for the task types that make named tasks)."""
    found = discover(package, base, attr)
    if extra_modules:
        for name, cls in discover_modules(list(extra_modules), base, key, attr).items():
            if name in found and found[name] is not cls:
                raise ConfigError(f"{key}: {kind} {name!r} of {cls.__module__} is also a built-in {kind} "
                                  f"({found[name].__module__}); give it another name")
            found[name] = cls
    return dict(sorted(found.items()))
