"""A model folder's JSON files (config.json, preprocessor_config.json) read as data, with one message naming the key
that pointed at them when they cannot be."""

from __future__ import annotations

import json

from mtl.errors import ConfigError


def read_json_object(path: str, key: str, fix: str) -> dict:
    """The JSON object in ``path``; a file that cannot be read, or holds no object, is one ConfigError naming ``key``,
    the file and ``fix``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {path!r} ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path!r} is not a JSON object; {fix}")
    return data
