"""Which config changes a resume may make without breaking exactness (docs/reliability.md).

Safe to change: ``trainer.max_steps``, the logging and evaluation intervals, output options, and
operational switches that do not touch the maths. Everything else (model shape, data, strategy,
weighting, batch size, seed, precision, optimizer ...) must match the checkpoint's config, or the
resumed run would not be the run that was interrupted; each differing key is listed.

A checkpoint's ``config.yaml`` is data, not a config: it is read with ``yaml.safe_load`` and no
``${...}`` interpolation or resolver in it is ever evaluated (a crafted ``seed: ${oc.env:TOKEN}``
is compared, and printed, as that literal text). mtl writes it already resolved.
"""

from __future__ import annotations

import os

import yaml
from omegaconf import OmegaConf

from mtl.errors import CheckpointError

SAFE_TO_CHANGE = (
    "output_dir", "resume", "overwrite", "device", "trainer.max_steps", "trainer.log_every", "trainer.eval_every",
    "trainer.eval_max_batches", "trainer.num_samples", "trainer.progress",
    "trainer.max_bad_steps", "trainer.poison", "checkpoint.", "data.num_workers", "data.eval_batch_size",
    "ddp.timeout_s", "ddp.replica_check_every", "ddp.nan_monitor", "bench.",
    "init_from",  # only read at a fresh start: a resume loads its own checkpoint's weights
    "task_modules",  # where the task files are found; the tasks and their options are compared themselves
)


def _flatten(node, prefix=""):
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differing_keys(saved: dict, current: dict, defaults: dict | None = None, safe: tuple = SAFE_TO_CHANGE) -> list[str]:
    """Keys whose value differs and that may not change on resume (``safe``). A key the saved config lacks (it
    was added to the schema after the checkpoint was written) counts as its default from ``defaults``."""
    a, b = _flatten(saved), _flatten(current)
    if defaults:
        a = {**{k: v for k, v in _flatten(defaults).items() if k not in a}, **a}
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and not any(k == s or (s.endswith(".") and k.startswith(s))
                                                               for s in safe)]


def check_resume_config(checkpoint_dir: str, cfg) -> None:
    path = os.path.join(checkpoint_dir, "config.yaml")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {checkpoint_dir!r} has no config.yaml: it is incomplete or not written by mtl")
    try:
        with open(path, encoding="utf-8") as f:
            saved = yaml.safe_load(f)  # plain data: nothing in it is resolved
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path!r} cannot be read: {e}") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path!r} is not an mtl config (a mapping of keys expected)")
    from mtl.config import Config, drop_moved_options, move_keys
    from mtl.config_check import option_defaults
    from mtl.tasks import task_types

    # a checkpoint written before a key moved into a task's options (data.max_caption_tokens ...) reads as the new key
    moved = move_keys(saved, path, [])
    drop_moved_options(saved, moved, saved.get("tasks"))
    types = task_types(cfg.get("task_modules") or ())
    safe = SAFE_TO_CHANGE + tuple(f"task_options.{t}.{k}" for t in cfg.tasks if t in types
                                  for k in types[t].resume_safe)

    current = OmegaConf.to_container(cfg, resolve=True)
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), resolve=True)
    extra = option_defaults(cfg)  # a checkpoint from before options existed used the classes' defaults
    defaults["task_options"], defaults["weighting"]["options"] = extra["task_options"], extra["weighting"]["options"]
    diff = differing_keys(saved, current, defaults, safe)
    if diff:
        a, b = _flatten(saved), _flatten(current)
        a = {**{k: v for k, v in _flatten(defaults).items() if k not in a}, **a}
        lines = [f"  {k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in diff]
        raise CheckpointError(
            f"cannot resume from {checkpoint_dir!r}: the config changed in ways that break an exact resume:\n"
            + "\n".join(lines) + "\nRestore these keys, or start a new run in another output_dir. Keys that may change "
            "on resume: " + ", ".join(safe))
