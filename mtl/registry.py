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

from mtl.errors import CheckpointError, ConfigError


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
        where = "" if os.path.isabs(spec) else f" (a path on the command line is read from the working directory {os.getcwd()!r})"
        raise FileNotFoundError(f"no file {spec!r}{where}")
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


# ------------------------------------------------------------------ plug-in files carried by a model folder

# The config keys that name plug-in files. Every checkpoint and export carries a copy of each file they name
# (``<key>/<file name>``), and a model folder is loaded from those copies only.
PLUGIN_KEYS = ("task_modules", "backbone_modules", "weighting_modules", "architecture_modules")


def _is_builtin(spec: str) -> bool:
    """A dotted name inside mtl itself: the installed package's own code, never copied."""
    return not spec.endswith(".py") and (spec == "mtl" or spec.startswith("mtl."))


def copy_names(key: str, specs) -> dict[str, str]:
    """{a spec of ``key``: its copy's name in a model folder}: ``<key>/<file name>`` for a ``.py`` path (a second
    file of the same name gets a number in front), ``<key>/<dotted.name>.py`` for a module name outside mtl."""
    out: dict[str, str] = {}
    for spec in map(str, specs or ()):
        if spec in out or _is_builtin(spec):
            continue
        base = os.path.basename(spec) if spec.endswith(".py") else f"{spec}.py"
        name = f"{key}/{base}"
        out[spec] = name if name not in out.values() else f"{key}/{len(out)}_{base}"
    return out


def _source_file(spec: str, key: str) -> str:
    """The file a spec is imported from: the path itself, or a module name's ``.py`` file."""
    if spec.endswith(".py"):
        return spec
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{key}: cannot find module {spec!r}: {e}") from None
    origin = getattr(found, "origin", None) or ""
    if not origin.endswith(".py") or os.path.basename(origin) == "__init__.py":
        raise ConfigError(f"{key}: {spec!r} is not a single .py module ({origin or 'no file'}), so a model folder "
                          "cannot carry it; give the plug-in as one .py file")
    return origin


def plugin_files(cfg) -> dict[str, bytes]:
    """What each checkpoint carries of the run's plug-ins: {``<key>/<file>``: the file's bytes} for every spec of
    every ``PLUGIN_KEYS`` key (``.py`` paths and module names outside mtl)."""
    out = {}
    for key in PLUGIN_KEYS:
        for spec, name in copy_names(key, cfg.get(key)).items():
            path = _source_file(spec, key)
            try:
                with open(path, "rb") as f:
                    out[name] = f.read()
            except OSError as e:
                raise ConfigError(f"{key}: cannot read {path!r} to carry it in the checkpoints: {e.strerror}") from None
    return out


def use_folder_copies(cfg, folder: str) -> list[str]:
    """Point every ``PLUGIN_KEYS`` spec of ``cfg`` (a model folder's saved config) at the folder's own copy, in place;
    returns the copies, which importing will run. A spec without a copy in ``folder`` is refused unread
    (CheckpointError naming the key and the file): a model folder never imports code from outside itself. Module names inside mtl
    stay as they are (the installed package's own code). The copies' hashes are checked by the caller against the
    folder's manifest (``mtl.build.verify_model_files``)."""
    used, errors = [], []
    for key in PLUGIN_KEYS:
        names = copy_names(key, cfg.get(key))
        specs = []
        for spec in map(str, cfg.get(key) or ()):
            if spec not in names:
                specs.append(spec)
                continue
            copy = os.path.join(folder, *names[spec].split("/"))
            if not os.path.isfile(copy):
                errors.append(f"{key}: {spec!r} has no copy {names[spec]} in {folder!r}; a model folder imports only "
                              "the plug-in files it carries, never a file or module from outside it, so this one is "
                              "not read. Load a checkpoint or export written since mtl carries every plug-in file")
                continue
            used.append(copy)
            specs.append(copy)
        cfg[key] = specs
    if errors:
        raise CheckpointError("; ".join(errors))
    return used
