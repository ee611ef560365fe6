"""Task heads, found by name: every module here that defines a TaskHead subclass with a ``name``, and the
modules a config names in ``task_modules`` (a forker's task file outside this package).

A task *type* (a class with a ``kind`` and no ``name``: ``mtl.tasks.regression``'s ``regression``) makes any number
of named tasks: the config's ``task_instances`` section, task name -> ``{type: <kind>, <the type's arguments>}``
(``config_task_types``). QM9's 11 targets are 11 instances of one type; a CelebA-style set of 40 binary attributes
would be 40 instances of one binary type, one file and one config section."""

from __future__ import annotations

import difflib
import inspect

from mtl.errors import ConfigError
from mtl.registry import registered
from mtl.tasks.base import BuildInfo, DataInfo, TaskHead

__all__ = ["BuildInfo", "DataInfo", "TaskHead", "config_task_types", "instance_types", "task_kinds", "task_types"]


def task_types(extra_modules=()) -> dict[str, type]:
    """Every task by name: this package's, plus those of ``extra_modules`` (the config's ``task_modules``: dotted
    module names or ``.py`` file paths). Raises ConfigError naming a module that cannot be used."""
    return registered(__name__, TaskHead, extra_modules, "task_modules", "task")


def task_kinds(extra_modules=()) -> dict[str, type]:
    """Every task type that makes named tasks (``TaskHead.kind``), by kind: this package's and ``extra_modules``'."""
    return registered(__name__, TaskHead, extra_modules, "task_modules", "task type", attr="kind")


def instance_arguments(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments of a task type's ``instance`` (its ``task_instances.<name>`` keys besides ``type``)."""
    params = list(inspect.signature(cls.instance).parameters.values())[1:]  # after the task's name
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def instance_types(instances, kinds: dict[str, type], taken=()) -> tuple[dict[str, type], list[str]]:
    """The classes of ``task_instances`` (task name -> ``{type: <kind>, ...}``) and one message per problem: an
    unknown type or key (with the nearest valid one), a missing argument, a value the type refuses, or a name that a
    task in ``taken`` (the registered ones) already has."""
    out, errors = {}, []
    for name, spec in dict(instances or {}).items():
        key = f"task_instances.{name}"
        if name in taken:
            errors.append(f"{key}: {name!r} is already a task ({taken[name].__module__}); give the instance "
                          "another name")
            continue
        if not hasattr(spec, "items") or "type" not in spec:
            errors.append(f"{key}: needs a mapping with 'type' (one of {', '.join(kinds) or 'none'}) and the type's "
                          f"arguments, e.g. {{type: regression, field: y, column: 12}} (got {spec!r})")
            continue
        kind = spec["type"]
        if kind not in kinds:
            close = difflib.get_close_matches(str(kind), list(kinds), n=1, cutoff=0.6)
            errors.append(f"{key}.type: unknown task type {kind!r}" + (f" — did you mean {close[0]!r}?" if close else "")
                          + f" (known: {', '.join(kinds) or 'none'}; a type in a file of its own goes in task_modules)")
            continue
        cls, args = kinds[kind], {k: v for k, v in spec.items() if k != "type"}
        known = instance_arguments(cls)
        bad = False
        for arg in args:
            if arg not in known:
                close = difflib.get_close_matches(str(arg), list(known), n=1, cutoff=0.6)
                errors.append(f"{key}: unknown key {arg!r}" + (f" — did you mean {key + '.' + close[0]!r}?" if close
                                                                 else "")
                              + f" (a {kind} task takes: type, {', '.join(known)})")
                bad = True
        missing = [a for a, p in known.items() if p.default is inspect.Parameter.empty and a not in args]
        if missing:
            errors.append(f"{key}: a {kind} task needs {', '.join(missing)}")
            bad = True
        if bad:
            continue
        try:
            out[name] = cls.instance(str(name), **args)
        except (TypeError, ValueError) as e:
            errors.append(f"{key}: {e}")
    return out, errors


def config_task_types(cfg) -> dict[str, type]:
    """Every task a config can name: the registered ones (``task_types``, with its ``task_modules``) and its
    ``task_instances``. Raises ConfigError listing every problem."""
    modules = cfg.get("task_modules") or ()
    types = task_types(modules)
    made, errors = instance_types(cfg.get("task_instances") or {}, task_kinds(modules), types)
    if errors:
        raise ConfigError(errors)
    return {**types, **made}
