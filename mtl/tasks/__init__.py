"""Task heads, found by name: every module here that defines a TaskHead subclass with a ``name``, and the
modules a config names in ``task_modules`` (a forker's task file outside this package)."""

from mtl.registry import discover, discover_modules
from mtl.tasks.base import BuildInfo, DataInfo, TaskHead

__all__ = ["BuildInfo", "DataInfo", "TaskHead", "task_types"]


def task_types(extra_modules=()) -> dict[str, type]:
    """Every task by name: this package's, plus those of ``extra_modules`` (the config's ``task_modules``: dotted
    module names or ``.py`` file paths). Raises ConfigError naming a module that cannot be used."""
    found = discover(__name__, TaskHead)
    if extra_modules:
        for name, cls in discover_modules(list(extra_modules), TaskHead, "task_modules").items():
            if name in found and found[name] is not cls:
                from mtl.errors import ConfigError

                raise ConfigError(f"task_modules: task {name!r} of {cls.__module__} is also a built-in task "
                                  f"({found[name].__module__}); give it another name")
            found[name] = cls
    return dict(sorted(found.items()))
