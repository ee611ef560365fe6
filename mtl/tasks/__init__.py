"""Task heads, found by name: every module here that defines a TaskHead subclass with a ``name``, and the
modules a config names in ``task_modules`` (a forker's task file outside this package)."""

from mtl.registry import registered
from mtl.tasks.base import BuildInfo, DataInfo, TaskHead

__all__ = ["BuildInfo", "DataInfo", "TaskHead", "task_types"]


def task_types(extra_modules=()) -> dict[str, type]:
    """Every task by name: this package's, plus those of ``extra_modules`` (the config's ``task_modules``: dotted
    module names or ``.py`` file paths). Raises ConfigError naming a module that cannot be used."""
    return registered(__name__, TaskHead, extra_modules, "task_modules", "task")
