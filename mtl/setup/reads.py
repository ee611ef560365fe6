"""Which config keys a run reads, and the rule that a key the user set is read (docs/config.md).

``READS`` below declares, next to the schema, every key that some runs do not read and the condition under which
it is read: the data source(s), multi-input mode and its sampling policy, the scheduler, the optimizer, the run's
tasks, and what the run's plug-ins declare they read. A plug-in (backbone, task, weighting method, strategy) that
reads a key of the shared config beyond its own options lists it in its class attribute ``reads`` (e.g. the
torchvision backbones: ``model.backbone.weights``, ``norm``, ``stages``; the caption task: ``model.decoder.`` and
``tokenizer.``; a trailing dot: the whole section). A key no rule names is read by every run.

The rule (``unread_errors``): a key the user set (a config file of the chain or the command line; not a default)
that the run will not read is an error, one message per reason naming the keys, what makes them unread and the fix,
collected with the other config errors (exit 2) before anything starts. One exception keeps a base file usable: a key
set *earlier* in the precedence order than the choice that made it unread (``base: tiny.yaml`` sets
``data.synthetic.*``, the command line sets ``data.source=imagefolder``) is not an error; the later setting chose.
Either way the run's saved config leaves out every key it does not read (``mtl.config.effective.mark_unread``), and its
start-up summary lists those it left out that hold other than their defaults. A rule may name values that ask for
nothing (``off``: ``trainer.num_samples: 0``, no sample captions): a key set to one is left out where unread, not refused.
The keys of one command line share one place in that order: they are judged together, whatever their order.

A tool that applies overrides to a saved config (``python -m mtl.tools.evaluate``) takes the same rule with
``tool="evaluate"``: a key only training reads (``data.train_path``, ``data.augment.*`` ...) is not read there.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from mtl.config.keys import multi_input
from mtl.config.load import move_keys, user_set
from mtl.config.read_rules import (  # noqa: F401  (the rules, plain data: here too, as mtl.setup.reads offered them)
    DATA,
    IMAGE_FILES,
    MULTI,
    READS,
    Reads,
    RunShape,
    When,
    any_set,
    backbone,
    batch_size,
    declared,
    engine_is,
    heldout,
    images,
    in_tasks,
    method,
    not_read,
    one_set,
    optimizer_is,
    policy_is,
    sampling,
    scheduler_is,
    strategy,
    task,
    task_batch_size,
    task_source,
    unread_errors,
    warm_start,
)
from mtl.config.yaml_read import read_config_chain
from mtl.errors import ConfigError
from mtl.models.backbones import backbone_types
from mtl.setup.build import run_method_types
from mtl.strategies import strategy_types
from mtl.tasks import config_task_types


def run_shape(cfg, tool: str = "train") -> RunShape:
    """The shape of a loaded config: its sources, mode and plug-ins (a plug-in that cannot be found is None: its
    own error is reported by the checks, and the keys it would decide are not judged)."""
    plugins: dict = {}
    held = None  # whether the method reads a held-out batch
    if tool == "train":
        plugins["backbone"] = _plugin(lambda: backbone_types(cfg.get("backbone_modules") or ()),
                                      cfg.model.backbone.name)
        plugins["method"] = _plugin(lambda: run_method_types(cfg), cfg.weighting.method)
        plugins["strategy"] = _plugin(strategy_types, cfg.ddp.strategy)
        try:
            types = config_task_types(cfg)
        except ConfigError:
            types = {}
        plugins["task"] = (",".join(cfg.tasks), tuple(r for t in cfg.tasks for r in getattr(types[t], "reads", ())),
                           {n: getattr(c, "reads", ()) for n, c in types.items()}
                           ) if all(t in types for t in cfg.tasks) else None
        if plugins["method"] is not None:
            held = bool(run_method_types(cfg)[cfg.weighting.method].needs_heldout_batch)
    per_task = cfg.data.get("per_task") or {}
    return RunShape(
        multi_input=multi_input(cfg), source=str(cfg.data.source),
        task_sources={str(t): str((sec or {}).get("source", "synthetic")) for t, sec in per_task.items()},
        policy=str(cfg.data.sampling.policy), sampling_weights=str(cfg.data.sampling.weights),
        scheduler=str(cfg.optim.scheduler), optimizer=str(cfg.optim.name), tasks=tuple(cfg.tasks), heldout=held,
        plugins=plugins, tool=tool, init_from=cfg.get("init_from") is not None, engine=str(cfg.parallel.engine),
        best_metric=OmegaConf.select(cfg, "checkpoint.best_metric") is not None,
        early_stopping=OmegaConf.select(cfg, "trainer.early_stopping.metric") is not None,
        trackers=tuple(OmegaConf.select(cfg, "logging.trackers", default=None) or ()),
        peft=bool(OmegaConf.select(cfg, "model.peft.method", default=None)))


def _plugin(types, name):
    """(name, the keys it reads, {every plug-in of its family: the keys it reads}), or None if it is unknown."""
    try:
        found = types()
    except ConfigError:
        return None
    if name not in found:
        return None
    return name, tuple(getattr(found[name], "reads", ())), {n: getattr(c, "reads", ()) for n, c in found.items()}


def refuse_unread(cfg, config: str | None, overrides: list[str] | None, tool: str, only: tuple[str, ...]) -> None:
    """A tool's command-line ``overrides`` (on a saved config, or on the config file ``config``) that it does not
    read: one ConfigError listing them (exit 2). ``only``: the keys the tool takes (e.g. ``data.``, ``seed``)."""
    files = read_config_chain(config) if config else []
    for data, source in files:
        move_keys(data, source, [])
    setters = user_set(files, overrides)
    judged = {k for k, (_, where) in setters.items() if where == "command line"}
    errors, _ = unread_errors(cfg, run_shape(cfg, tool), setters, only=only,
                              named={k for k in setters if k not in judged})
    if errors:
        raise ConfigError(errors)
