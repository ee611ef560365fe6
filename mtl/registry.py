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


def unknown_name(key: str, kind: str, name: str, names) -> str:
    """The message for a config ``key`` that names no ``kind`` among ``names`` (the registered ones, listed)."""
    return f"{key}: unknown {kind} {name!r} (supported: {', '.join(names)})"


def chosen(types: dict[str, type], name: str, key: str, kind: str) -> type:
    """``types[name]``, the class the config's ``key`` names; a ConfigError listing ``types`` where none is ``name``."""
    if name not in types:
        raise ConfigError(unknown_name(key, kind, name, types))
    return types[name]


# ------------------------------------------------------------------ plug-in files carried by a model folder

# The config keys that name plug-in files. Every checkpoint and export carries a copy of each file they name
# (``<key>/<file name>``), and a model folder is loaded from those copies only.
PLUGIN_KEYS = ("task_modules", "backbone_modules", "weighting_modules", "architecture_modules")


def _is_builtin(spec: str) -> bool:
    """A dotted name inside mtl itself: the installed package's own code, never copied."""
    return not spec.endswith(".py") and (spec == "mtl" or spec.startswith("mtl."))


def _module_name(spec: str) -> bool:
    """A dotted module name (``pkg.mod``): identifiers only, so never a path (no ``/``, no ``..``)."""
    return all(part.isidentifier() for part in spec.split("."))


def copy_names(key: str, specs) -> dict[str, str]:
    """{a spec of ``key``: its copy's name in a model folder}: ``<key>/<file name>`` for a ``.py`` path (a second
    file of the same name gets a number in front), ``<key>/<dotted.name>.py`` for a module name outside mtl. A spec
    that is neither (``../x/pwn``: its copy's name would climb out of ``<key>/``) is a ConfigError naming it."""
    out: dict[str, str] = {}
    for spec in map(str, specs or ()):
        if spec in out or _is_builtin(spec):
            continue
        if not spec.endswith(".py") and not _module_name(spec):
            raise ConfigError(f"{key}: {spec!r} is neither a .py path nor a dotted module name")
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


def use_folder_copies(cfg, folder: str, listed) -> dict[str, str]:
    """Point every ``PLUGIN_KEYS`` spec of ``cfg`` (a model folder's saved config) at the folder's own copy, in place;
    returns {each copy: the spec it replaced}, the files importing will run (which only ``refuse_untrusted`` allows).
    Module names inside mtl stay as they are (the installed package's own code).

    A model folder never imports code from outside itself: a spec is refused unread (one CheckpointError naming each
    key, spec and why) when it is neither a ``.py`` path nor a module name, when its copy is missing, is a symbolic
    link, resolves (realpath) anywhere but ``folder/<key>/``, or is not in ``listed`` (the names in the folder's
    manifest, whose hashes ``mtl.setup.build.verify_model_files`` has checked)."""
    used, errors = {}, []
    for key in PLUGIN_KEYS:
        specs = list(map(str, cfg.get(key) or ()))
        bad = [s for s in specs if not s.endswith(".py") and not _module_name(s)]
        errors += [f"{key}: {s!r} is neither a .py file nor a module name: its copy would lie outside "
                   f"{key}/ in {folder!r}, and a model folder imports only code inside it" for s in bad]
        names = copy_names(key, [s for s in specs if s not in bad])
        resolved = []
        for spec in specs:
            if spec not in names:
                resolved.append(spec)
                continue
            copy = os.path.join(folder, *names[spec].split("/"))
            why = _uncontained(copy, os.path.join(folder, key), names[spec], listed)
            if why:
                errors.append(f"{key}: {spec!r} {why}; a model folder imports only the plug-in files it carries, "
                              "never a file or module from outside it, so this one is not read. Load a checkpoint "
                              "or export written by mtl, as it wrote it")
                continue
            used[copy] = spec
            resolved.append(copy)
        cfg[key] = resolved
    if errors:
        raise CheckpointError("; ".join(errors))
    return used


def _uncontained(copy: str, home: str, name: str, listed) -> str | None:
    """Why the copy ``name`` (``<key>/<file>``) at ``copy`` may not be imported, or None: it must be a regular file
    (no symbolic link) whose real path is inside ``home`` (the folder's ``<key>/``), listed in the manifest."""
    if os.path.islink(copy):
        return f"has a copy {name} that is a symbolic link (to {os.path.realpath(copy)!r}), not a file the folder holds"
    if not os.path.lexists(copy):
        return f"has no copy {name} in {os.path.dirname(home)!r}"
    if os.path.dirname(os.path.realpath(copy)) != os.path.realpath(home) or os.path.islink(home):
        return f"has a copy {name} that resolves to {os.path.realpath(copy)!r}, outside {home!r}"
    if not os.path.isfile(copy):
        return f"has a copy {name} that is not a regular file"
    if name not in listed:
        return f"has a copy {name} that is not in the folder's manifest.json"
    return None


# ------------------------------------------------------------------ consent to run a model folder's plug-in code

TRUST_FLAG = "--trust-plugins"


def _python_installation() -> list[str]:
    """The folders of the Python installation (standard library, installed packages): a file there is nobody's run
    code, so it never vouches for a copy (a stdlib module such as ``antigravity`` acts when imported)."""
    import site
    import sysconfig

    paths = [sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    paths += list(getattr(site, "getsitepackages", list)()) + [getattr(site, "USER_SITE", None)]
    return [os.path.realpath(p) for p in paths if p]


def recorded_source(spec: str) -> str | None:
    """The file on this machine at the path a run recorded for a plug-in (``spec``, from the folder's config.yaml:
    a ``.py`` path; a relative one is read from the working directory, as the run read it), or None: a module name
    (finding its file could import its package), a path that is no file here, or one inside the Python installation."""
    if not spec.endswith(".py"):
        return None
    path = os.path.realpath(spec)
    if not os.path.isfile(path) or any(os.path.commonpath([path, p]) == p for p in _python_installation()):
        return None
    return path


def _sha256(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def refuse_untrusted(copies: dict[str, str], folder: str, trusted: bool) -> str:
    """Consent to import a model folder's plug-in copies (``copies``: {copy: its spec}, from ``use_folder_copies``),
    as transformers' ``trust_remote_code``: given by ``trusted`` (the tools' --trust-plugins, ``load_model``'s
    ``trust_plugins=True``), or, without it, by each copy being byte-identical to the file at its recorded path on
    this machine (``recorded_source``: your own run's code). Otherwise one ConfigError (exit 2, nothing imported)
    naming each copy that lacks it, its SHA-256, and the flag. Returns why the code may run, in words."""
    if not copies or trusted:
        return f"trusted by {TRUST_FLAG}"
    rel = {c: os.path.relpath(c, folder).replace(os.sep, "/") for c in copies}
    sources = {c: recorded_source(spec) for c, spec in copies.items()}
    unvouched = [c for c, src in sources.items() if src is None or _sha256(src) != _sha256(c)]
    if unvouched:
        files = ", ".join(f"{rel[c]} (SHA-256 {_sha256(c)})" for c in unvouched)
        raise ConfigError(f"{folder!r} carries plug-in code, and loading the model would import it, which runs it: "
                          f"{files}. No file at the path its config.yaml records on this machine has the same bytes "
                          f"(as your own run's code would). Read it, and if you trust it pass {TRUST_FLAG} "
                          "(mtl.inference.load_model(..., trust_plugins=True))")
    return "each identical to the file at its recorded path (" + ", ".join(sources.values()) + ")"
