"""Loading a config: its files (``mtl.config.yaml_read``) and the command line's ``key=value`` overrides merged onto
the schema's defaults (``mtl.config.keys``), each unknown key and wrong type reported with where it came from, all
together (ConfigError, exit 2); the keys that moved (``MOVED_KEYS``) read as their new names; a saved config read as
data (``config_from_data``).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from mtl.config.keys import Config, _flat, _known_keys, _schema_node, suggest_key
from mtl.config.yaml_read import YamlRefusal, load_user_yaml, read_config_chain
from mtl.errors import ConfigError

# Keys that moved: old key -> new key. A config (file or command line) or a checkpoint's config.yaml that uses the old
# key keeps working: its value is read as the new key's, in the same place of the precedence order, and a config that
# uses it gets a one-line note naming the new key. Giving both, with different values, in one file is an error.
MOVED_KEYS = {
    "data.max_caption_tokens": "task_options.gen.max_tokens",  # into the caption task's own options
    "trainer.num_beams": "task_options.gen.num_beams",
    "ddp.engine": "parallel.engine",  # fsdp2 is not DDP: the engine is chosen beside DDP, not inside it
}


_NOTED: set[str] = set()


def move_keys(data: dict, source: str, errors: list[str], notes: list[str] | None = None) -> set[str]:
    """Rewrite the ``MOVED_KEYS`` of one plain nested mapping (a YAML file, the overrides, a saved config) to their
    new place, in place. Returns the tasks whose options received a moved value; ``notes`` gets one line per old key
    found."""
    tasks = set()
    for old, new in MOVED_KEYS.items():
        *parents, leaf = old.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        target = data
        for p in new_parents:
            if not isinstance(target.get(p), dict):
                target[p] = {}
            target = target[p]
        if new_leaf in target and target[new_leaf] != value:
            errors.append(f"{source}: {old} (the old name) and {new} are both set, to {value!r} and "
                          f"{target[new_leaf]!r}; keep only {new}")
            continue
        target.setdefault(new_leaf, value)
        if notes is not None:
            notes.append(f"note: {source}: {old} is now {new} (the old name still works; rename it)")
        if new_parents[0] == "task_options":
            tasks.add(new_parents[1])
    return tasks


def drop_moved_options(data: dict, moved: set[str], tasks) -> None:
    """A moved key of a task the run does not train was ignored before it moved: drop it again (in place)."""
    options = data.get("task_options") or {}
    for t in moved:
        if t not in list(tasks or []) and t in options:
            del options[t]


def parse_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """``["a.b=1", "c=[x, y]"]`` -> nested dict; values are parsed as YAML (so ``null`` is None)."""
    out: dict = {}
    errors = []
    for item in overrides:
        if "=" not in item:
            errors.append(f"command line: {item!r} is not of the form key=value")
            continue
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = load_user_yaml(raw) if raw.strip() else ""
        except YamlRefusal as e:
            errors.append(f"command line: {key}: {e.what}")
            continue
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                errors.append(f"command line: {key!r} sets a key inside a value")
                break
        else:
            node[parts[-1]] = value
    return out, errors


def _merge_into(cfg: DictConfig, data: dict, source: str, prefix: list[str], errors: list[str]) -> None:
    for key, value in data.items():
        path = prefix + [str(key)]
        dotted = ".".join(path)
        sub = _schema_node(Config, path)
        if sub is not None and isinstance(value, dict):
            _merge_into(cfg, value, source, path, errors)
            continue
        if path in (["task_options"], ["task_instances"]) and isinstance(value, dict):  # one task's do not wipe another's
            for task, options in value.items():
                _update(cfg, f"{path[0]}.{task}", options, source, errors, merge=isinstance(options, dict),
                        add=True)  # task names and their options are checked against the task classes later
            continue
        if path == ["bench"] and isinstance(value, dict):  # the tool's section: merged key by key, at every depth
            _update(cfg, "bench", value, source, errors, merge=True, add=True)
            continue
        if path == ["data", "per_task"] and isinstance(value, dict):  # one task's section does not wipe another's
            for task, section in value.items():
                _update(cfg, f"data.per_task.{task}", section, source, errors, merge=isinstance(section, dict), add=True)
            continue
        _update(cfg, dotted, value, source, errors)


def _update(cfg: DictConfig, dotted: str, value: Any, source: str, errors: list[str], merge: bool = False,
            add: bool = False) -> None:
    try:
        OmegaConf.update(cfg, dotted, value, merge=merge, force_add=add)
    except OmegaConfBaseException as e:
        errors.append(f"{source}: {dotted}: {_explain(e, dotted, value)}")


def _explain(e: Exception, dotted: str, value: Any) -> str:
    msg = str(e).split("\n")[0]
    name = type(e).__name__
    if name in ("ConfigAttributeError", "ConfigKeyError") or "not in struct" in msg or "Key '" in msg:
        parent, _, leaf = dotted.rpartition(".")
        known = _known_keys(parent.split(".") if parent else [])
        return f"unknown key {leaf!r}{suggest_key(dotted)}" + (f" (known keys here: {', '.join(known)})" if known else "")
    return f"bad value {value!r}: {msg}"


def _read_into(path: str, overrides: list[str] | None, errors: list[str], chain: list | None = None,
               setters: dict | None = None) -> DictConfig:
    """The config with every mergeable value applied; each key or type problem is appended to ``errors``.
    ``chain``: [(mapping, source)] to merge instead of reading ``path`` and its base files (data, not set by the
    user). ``setters``: filled with ``user_set``'s map of the keys the user set."""
    cfg = OmegaConf.structured(Config)
    OmegaConf.set_struct(cfg, True)
    moved: set[str] = set()
    notes: list[str] = []  # a config file or the command line, not a checkpoint's config.yaml (mtl wrote that one)
    files = read_config_chain(path) if chain is None else chain
    for data, source in files:
        moved |= move_keys(data, source, errors, notes if chain is None else None)
        _merge_into(cfg, data, source, [], errors)
    over, over_errors = parse_overrides(list(overrides or []))
    errors += over_errors
    moved |= move_keys(over, "command line", errors, notes)
    _merge_into(cfg, over, "command line", [], errors)
    if setters is not None:
        setters.update(user_set(files if chain is None else [], overrides))
    new = [n for n in dict.fromkeys(notes) if n not in _NOTED]
    if new and os.environ.get("RANK", "0") == "0":  # said once per process (of rank 0), not once per rank or load
        _NOTED.update(new)
        print("\n".join(new), file=sys.stderr, flush=True)
    if moved:
        options = OmegaConf.to_container(cfg.task_options)
        drop_moved_options({"task_options": options}, moved, cfg.tasks)
        cfg.task_options = options
    return cfg


def load_config(path: str, overrides: list[str] | None = None) -> DictConfig:
    """Load ``path`` (and its base chain) and apply ``overrides``, checking keys, types and ``${...}``
    interpolations only.

    Raises ConfigError listing every problem. ``mtl.setup.checks.load_run_config`` adds the semantic checks.
    """
    errors: list[str] = []
    cfg = _read_into(path, overrides, errors)
    errors += interpolation_errors(cfg)
    if errors:
        raise ConfigError(errors)
    return cfg


def interpolation_errors(node, prefix: str = "") -> list[str]:
    """One message per key whose ``${...}`` cannot be resolved (a loop, an unset environment variable, a value
    of the wrong type), naming the key and its text; the resolved value is never shown (it may be a secret)."""
    errors = []
    for key in (list(node.keys()) if isinstance(node, DictConfig) else range(len(node))):
        dotted = f"{prefix}.{key}" if prefix else str(key)
        try:
            value = node[key]
        except OmegaConfBaseException as e:
            raw = node._get_node(key)._value()
            why = ("it does not give a valid value for this key's type" if isinstance(e, ValidationError)
                   else str(e).splitlines()[0])
            errors.append(f"{dotted}: {raw!r} cannot be resolved: {why}. Set the variable, or give the value itself")
            continue
        if OmegaConf.is_config(value):
            errors += interpolation_errors(value, dotted)
    return errors


def load_config_collecting(path: str, overrides: list[str] | None, errors: list[str],
                           setters: dict | None = None) -> DictConfig:
    """Like ``load_config``, but key/type problems are appended to ``errors`` and the offending values left
    at their defaults, so that further checks can run and every problem be reported at once. ``setters``: filled
    with the keys the user set (``user_set``)."""
    return _read_into(path, overrides, errors, setters=setters)


def user_set(files: list[tuple[dict, str]], overrides: list[str] | None) -> dict[str, tuple[int, str]]:
    """Every key the user set, as ``{dotted key: (position, where)}``: its last setting in the precedence order (the
    ``base:`` files first, then the config file, then the command line) and the file or "command line". The command
    line is one position: keys given together are judged together, whatever their order (``optim.betas=... optim.name=
    sgd`` is refused as the reverse is). ``files``: ``read_config_chain``'s [(mapping, source)] after ``move_keys`` (a
    key's old name counts as the key). A key no file or override names holds the schema's default: it is not here."""
    out: dict[str, tuple[int, str]] = {}
    for i, (data, source) in enumerate(files):
        for key in _flat(data, empty=True):
            out[key] = (i, source)
    for item in overrides or []:
        one, _ = parse_overrides([item])
        move_keys(one, "command line", [])
        for key in _flat(one, empty=True):
            out[key] = (len(files), "command line")
    return out


def config_from_data(data: dict, source: str, overrides: list[str] | None = None) -> DictConfig:
    """A config from a plain mapping that is data, not a config file: a checkpoint's or an export's config.yaml as
    ``mtl.setup.resume.saved_config`` reads it (mtl writes it resolved and whole). Nothing in it is resolved or read: a
    ``base:`` key, or a ``${...}`` in any value, is refused, never evaluated. ``overrides`` go on top. Keys and
    types are checked as in ``load_config``; raises ConfigError listing every problem (``source`` names the file)."""
    errors = [f"{source}: base: {data['base']!r}: this file is complete and is read as data; 'base:' is not "
              "followed here. Remove the line"] if "base" in data else []
    errors += [f"{source}: {k}: {v!r} is an interpolation; this file is read as data (mtl writes it resolved), so "
               "'${...}' in it is never evaluated. Restore the file from the run, or put the value itself there"
               for k, v in _strings(data) if "${" in v]
    if errors:
        raise ConfigError(errors)
    plain = copy.deepcopy(data)  # merging moves renamed keys in place
    cfg = _read_into(source, overrides, errors, chain=[(plain, source)])
    if errors:
        raise ConfigError(errors)
    return cfg


def _strings(node, prefix: str = ""):
    """(dotted key, value) for every string in a plain nested mapping or list."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if isinstance(v, str):
            yield f"{prefix}{k}", v
        else:
            yield from _strings(v, f"{prefix}{k}.")
