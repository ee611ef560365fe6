"""The config in effect: the keys a run reads (a key it does not read is marked on its node, ``mark_unread``), as
the run saves it (``to_yaml``: config.yaml) and prints it at start-up (``config_summary``).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mtl.config.keys import Config, _flat, _show

# A key the run does not read (``mtl.config.read_rules``) is marked on its node of the checked config with this flag: the
# printed and saved config (``to_yaml``, ``config_summary``, ``in_effect``) leave it out.
UNREAD = "mtl_not_read"


def mark_unread(cfg: DictConfig, keys) -> None:
    """Mark the dotted ``keys`` (a section: its node, so every key in it) as not read by the run."""
    for key in keys:
        node = cfg
        for part in key.rstrip(".").split("."):
            if not isinstance(node, DictConfig) or part not in node:  # a section a check dropped (task_options.<t>)
                node = None
                break
            node = node._get_node(part)
        if node is not None:
            node._set_flag(UNREAD, True)


def unread_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """The keys ``mark_unread`` marked, a section as ``section.`` (with its dot)."""
    out = []
    for key in cfg.keys() if isinstance(cfg, DictConfig) else ():
        node = cfg._get_node(key)
        if node._get_node_flag(UNREAD):
            out.append(f"{prefix}{key}" + ("." if isinstance(node, DictConfig) else ""))
        elif isinstance(node, DictConfig):
            out += unread_keys(node, f"{prefix}{key}.")
    return out


def in_effect(cfg: DictConfig) -> dict:
    """The resolved config as plain data, without the keys the run does not read (``mark_unread``)."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in unread_keys(cfg):
        *parents, leaf = key.rstrip(".").split(".")
        nodes = [data]
        for p in parents:
            nodes.append(nodes[-1].get(p, {}))
        nodes[-1].pop(leaf, None)
        for node, name in reversed(list(zip(nodes[:-1], parents))):  # a section left with no key read goes too
            if node.get(name) == {}:
                del node[name]
    return data


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as saved with a run (``config.yaml``): only the keys it reads."""
    if not unread_keys(cfg):
        return OmegaConf.to_yaml(cfg, resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(in_effect(cfg)))


def config_summary(cfg: DictConfig, saved_to: str | None = None, skip: tuple[str, ...] = ()) -> str:
    """A few lines for the console: only the keys that differ from the schema defaults, one line per section,
    leaving out the keys the run does not read (``mark_unread``) and those that start with one of ``skip``.

    The full resolved config is in ``saved_to`` (``output_dir/config.yaml``).
    """
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(Config)))
    values = _flat(in_effect(cfg))
    unread = tuple(unread_keys(cfg))
    left = [f"{k}={_show(v)}" for k, v in _flat(OmegaConf.to_container(cfg, resolve=True)).items()
            if (k in unread or k.startswith(tuple(u for u in unread if u.endswith(".")))) and defaults.get(k) != v]
    changed = {k: v for k, v in values.items() if defaults.get(k, object()) != v and not k.startswith(tuple(skip))}
    groups: dict[str, list[str]] = {}
    for k, v in changed.items():
        section, _, rest = k.partition(".") if "." in k else ("", "", k)
        groups.setdefault(section, []).append(f"{rest}={_show(v)}")
    where = f" (all of it: {saved_to})" if saved_to else ""
    lines = [f"resolved config: only what differs from the defaults{where}"]
    for section, items in groups.items():
        lines.append(f"  {section + ': ' if section else ''}{' '.join(items)}")
    if not changed:
        lines.append("  (all defaults)")
    if left:  # set in a config file before a later setting made them unread (mtl/config/read_rules.py)
        lines.append(f"  not read by this run, left out: {' '.join(left)}")
    return "\n".join(lines)
