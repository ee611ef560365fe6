"""The wording of a value that is not one of a key's choices, shared by the config checks."""

from __future__ import annotations

import difflib


def _choice(errors: list[str], key: str, value, allowed) -> None:
    """Add ``key: 'value' is not one of ...`` (with the nearest choice) to ``errors`` unless ``value`` is allowed."""
    if value not in allowed:
        errors.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}{did_you_mean(value, allowed)}")


def did_you_mean(value, allowed) -> str:
    """`` — did you mean 'x'?`` for the allowed value nearest a mistyped one, or ""."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" — did you mean {close[0]!r}?" if close else ""
