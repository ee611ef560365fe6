"""Range checks of a weighting method's options (``weighting.options``).

A method declares each option's allowed values next to its default, in its ``Options`` dataclass:
``ranged(default, ok, what)`` for a number (``ok(value)`` says whether it is allowed, ``what`` what it must be,
e.g. ``"must be in [0, 1)"``), its shorthands ``at_least(default, low)`` and ``above(default, low)``, and
``one_of(default, allowed)`` for a name. ``Weighting.check`` reports every option the
user gave outside them (``option_errors``); a method's own ``check`` adds only what one option cannot say alone.

``check(cfg)`` runs before the options are type-checked and filled in (``mtl/setup/checks.py``), so it sees
only what the user gave: a value of the wrong type is left to the type check, which names it already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field, fields


def ranged(default, ok: Callable[[float], bool], what: str):
    """An option field: its default, and the numbers it allows (``ok``), described by ``what``."""
    return field(default=default, metadata={"range": (ok, what)})


def at_least(default, low, note: str = ""):
    """An option field whose numbers must be >= ``low`` (``note``: what the bound means, added to the message)."""
    return ranged(default, lambda v: v >= low, f"must be >= {low}" + (f" ({note})" if note else ""))


def above(default, low):
    """An option field whose numbers must be > ``low``."""
    return ranged(default, lambda v: v > low, f"must be > {low}")


def one_of(default: str, allowed: tuple[str, ...]):
    """An option field that names one of ``allowed``, ``default`` by default."""
    return field(default=default, metadata={"choices": tuple(allowed)})


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


def option_errors(cfg, options: type) -> list[str]:
    """The errors of the options the user gave against what the ``options`` dataclass's fields declare
    (``ranged``, ``one_of``), in field order."""
    errors = []
    for f in fields(options):
        if "range" in f.metadata:
            errors += option_range_errors(cfg, {f.name: f.metadata["range"]})
        if "choices" in f.metadata:
            errors += option_choice_errors(cfg, f.name, f.metadata["choices"])
    return errors
