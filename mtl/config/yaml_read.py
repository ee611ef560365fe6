"""Reading YAML: a user's config (its file, its ``base:`` chain, its plug-in paths) and a config.yaml mtl wrote
(a checkpoint's or an export's: data, not config; an anchor, alias or repeated key is refused by line).
"""

from __future__ import annotations

import os

import yaml

from mtl.errors import ConfigError
from mtl.registry import PLUGIN_KEYS

# ------------------------------------------------------------------ reading YAML: a user's config, and a saved one

USER_YAML_VALUES = 100_000  # a user's config: at most this many values (mappings, lists, scalars) once aliases expand
SAVED_YAML_FIX = "mtl writes config.yaml without anchors, aliases or repeated keys: it was edited after it was written"


class YamlRefusal(yaml.YAMLError):
    """YAML that parses but is refused: ``what`` is wrong, at 1-based ``line`` (None: the whole document)."""

    def __init__(self, line: int | None, what: str, first: int | None = None):
        where = f"lines {first} and {line}: " if first else f"line {line}: " if line else ""
        super().__init__(where + what)
        self.line, self.what = line, what


class _SavedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses every anchor and alias (at the event, before any node is built)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise YamlRefusal(event.start_mark.line + 1, f"an alias (*{event.anchor})")
        if getattr(event, "anchor", None) is not None:
            raise YamlRefusal(event.start_mark.line + 1, f"an anchor (&{event.anchor})")
        return super().compose_node(parent, index)


def load_user_yaml(stream):
    """A user's YAML (a config file or a command-line value) as plain data. Anchors and aliases are allowed, up to
    ``USER_YAML_VALUES`` values once expanded (counted on the node graph, never expanded); a key repeated in one
    mapping is refused (YAML would keep the last one silently). Raises YamlRefusal or yaml.YAMLError."""
    return _load(stream, yaml.SafeLoader, USER_YAML_VALUES)


def load_saved_yaml(stream):
    """A config.yaml mtl wrote (a checkpoint's or an export's) as plain data: an anchor, an alias or a repeated key is
    refused (YamlRefusal naming its line; mtl writes none), so nothing can make a reader expand it."""
    return _load(stream, _SavedLoader, None)


def _load(stream, loader_class, cap: int | None):
    loader = loader_class(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if cap is not None and _expanded_size(node, cap, {}, set()) > cap:
            raise YamlRefusal(None, f"it expands to more than {cap:,} values once its aliases (*name) are expanded "
                                    "(an alias repeats its anchor's whole value); write the values out, or use fewer "
                                    "aliases")
        _refuse_repeated_keys(node, set())
        return loader.construct_document(node)
    except RecursionError:
        raise YamlRefusal(None, "it is nested deeper than a config can be") from None
    finally:
        loader.dispose()


def _expanded_size(node, cap: int, sizes: dict, open_nodes: set) -> int:
    """The number of values ``node`` stands for once every alias is expanded, saturating at ``cap + 1``: each node of
    the graph is counted once (``sizes``), so a bomb costs its lines, not its expansion. A node inside itself (an
    alias within its own anchor) is infinite."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        return cap + 1
    open_nodes.add(id(node))
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total = min(cap + 1, total + _expanded_size(child, cap, sizes, open_nodes))
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def _refuse_repeated_keys(node, seen: set) -> None:
    """YamlRefusal for the first key that a mapping holds twice (a merge key ``<<`` is not a key: what it merges in
    may be overridden). ``seen``: the nodes already checked (an alias's node is checked once)."""
    if id(node) in seen or isinstance(node, yaml.ScalarNode):
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            _refuse_repeated_keys(child, seen)
        return
    lines: dict = {}
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            name, line = (key.tag, key.value), key.start_mark.line + 1
            if name in lines:
                raise YamlRefusal(line, f"key {key.value!r} appears twice in one mapping (YAML would silently keep "
                                        "the last); keep one", first=lines[name])
            lines[name] = line
        _refuse_repeated_keys(key, seen)
        _refuse_repeated_keys(value, seen)


def read_config_chain(path: str, seen: tuple = (), named_by: str | None = None) -> list[tuple[dict, str]]:
    """Return [(mapping, source)] for ``path`` and its ``base:`` chain, base first.

    ``named_by`` is the config file whose ``base:`` names ``path`` (None for the --config file).
    """
    if not os.path.isfile(path):
        if named_by is None:
            raise ConfigError(f"config file {path!r} does not exist (pass an existing file with --config)")
        raise ConfigError(
            f"config file {named_by!r}: its base file was not found at {path!r} ('base:' paths are relative to "
            f"the file that names them, here the folder {os.path.dirname(os.path.abspath(named_by))!r}) "
            "— copy the base file there too, or make 'base:' an absolute path or a path relative to that folder")
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"config file {path!r}: 'base:' files form a cycle")
    try:
        with open(path, encoding="utf-8") as f:
            data = load_user_yaml(f)
    except YamlRefusal as e:
        raise ConfigError(f"config file {path!r}: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys, not a {type(data).__name__}")
    plugin_paths_from_file(data, path)
    chain = []
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file name")
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        chain += read_config_chain(base_path, seen + (real,), named_by=path)
    chain.append((data, path))
    return chain


def plugin_paths_from_file(data: dict, path: str) -> None:
    """A relative ``.py`` path in a config file's ``task_modules``, ``backbone_modules`` or ``weighting_modules`` is
    read from that file's folder, as ``base:`` is (on the command line, from the working directory): made absolute
    here, in place, where the file is known. A path that exists only from the working directory is refused with
    the path to write instead."""
    folder = os.path.dirname(os.path.abspath(path))
    for key in PLUGIN_KEYS:
        specs = data.get(key)
        if not isinstance(specs, list):
            continue
        resolved = []
        for spec in specs:
            if isinstance(spec, str) and spec.endswith(".py") and not os.path.isabs(spec) and "${" not in spec:
                full = os.path.normpath(os.path.join(folder, spec))
                if not os.path.exists(full) and os.path.isfile(spec):
                    raise ConfigError(f"config file {path!r}: {key}: {spec!r} is read from this file's folder "
                                      f"{folder!r}, where it does not exist (it exists from the working directory): "
                                      f"write {os.path.relpath(os.path.abspath(spec), folder)!r}, or an absolute path")
                spec = full
            resolved.append(spec)
        data[key] = resolved
