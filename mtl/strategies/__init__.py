"""Step strategies, found by name: each module here defines one Strategy subclass (docs/strategies.md)."""

from mtl.registry import discover
from mtl.strategies.base import StepInputs, Strategy

__all__ = ["StepInputs", "Strategy", "strategy_types"]


def strategy_types() -> dict[str, type]:
    return discover(__name__, Strategy)
