"""The entries of ``bench.methods``: a method name, optionally with options, ``name(key=value, ...)``; the key
``source`` is the gradient source (``weighting.source``), the key ``heads`` the heads' weighting
(``weighting.heads``), every other key a method option."""

from __future__ import annotations

import re

import yaml

_ENTRY = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$")


def parse_method(entry: str) -> tuple[str, dict]:
    """``"cagrad(c=0.2, rescale=false)"`` -> ``("cagrad", {"c": 0.2, "rescale": False})``; values are YAML.
    A plain name has no options. Raises ValueError for anything else."""
    m = _ENTRY.match(str(entry))
    if not m:
        raise ValueError("needs a method name, optionally with options: name(key=value, ...)")
    options = {}
    for part in (m.group(2) or "").split(","):
        if not part.strip():
            continue
        key, eq, raw = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"{part.strip()!r} is not key=value")
        try:
            options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            options[key.strip()] = raw.strip()
    return m.group(1), options


def method_spec(entry: str) -> tuple[str, dict, str]:
    """``(name, weighting.options, weighting.source)`` of an entry: ``source`` in the parentheses is the gradient
    source (``mgda(source=features)``), every other key a method option."""
    name, options = parse_method(entry)
    source = options.pop("source", "parameters")
    options.pop("heads", None)  # entry_heads
    return name, options, source


def entry_heads(entry: str) -> str | None:
    """The entry's ``heads`` (``weighting.heads``: ``nashmtl(heads=weighted)``), or None where it gives none."""
    heads = parse_method(entry)[1].get("heads")
    return None if heads is None else str(heads)


def without_source(entry: str) -> str:
    """The entry's method and options without its gradient source: ``cagrad(c=0.2, source=features)`` ->
    ``cagrad(c=0.2)``, ``mgda(source=features)`` -> ``mgda`` (what the cost table pairs the two sources by); its
    ``heads`` stays."""
    name, options, _ = method_spec(entry)
    if entry_heads(entry) is not None:
        options["heads"] = entry_heads(entry)
    shown = ", ".join(f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                      for k, v in options.items())
    return f"{name}({shown})" if shown else name
