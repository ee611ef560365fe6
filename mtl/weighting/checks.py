"""Range checks of a weighting method's options (``weighting.options``), for the methods' ``check(cfg)``.

``check(cfg)`` runs before the options are type-checked and filled in (``mtl/config/checks.py``), so it sees
only what the user gave: a value of the wrong type is left to the type check, which names it already.
"""

from __future__ import annotations

from collections.abc import Callable


def option_range_errors(cfg, rules: dict[str, tuple[Callable[[float], bool], str]]) -> list[str]:
    """``rules``: option name -> (is the number allowed, what it must be, e.g. ``"must be > 0"``)."""
    given = cfg.weighting.get("options") or {}
    errors = []
    for name, (ok, what) in rules.items():
        value = given.get(name) if hasattr(given, "get") else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
            errors.append(f"weighting.options.{name}: {what} (got {value})")
    return errors


def option_choice_errors(cfg, name: str, allowed: tuple[str, ...]) -> list[str]:
    """An option that names one of ``allowed``."""
    given = cfg.weighting.get("options") or {}
    value = given.get(name) if hasattr(given, "get") else None
    if value is not None and value not in allowed:
        return [f"weighting.options.{name}: {value!r} is not one of {', '.join(allowed)}"]
    return []
