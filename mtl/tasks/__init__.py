"""Task heads, found by name: every module here that defines a TaskHead subclass with a ``name``."""

from mtl.registry import discover
from mtl.tasks.base import BuildInfo, TaskHead

__all__ = ["BuildInfo", "TaskHead", "task_types"]


def task_types() -> dict[str, type]:
    return discover(__name__, TaskHead)
