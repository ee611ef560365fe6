"""The checks of the metrics a run's options name: ``optim.scheduler=plateau``'s baselines (the Δm the rate follows)
and the metric a best checkpoint or early stopping watches (``checkpoint.best_metric``,
``trainer.early_stopping.metric``), against what the run's tasks log."""

from __future__ import annotations

import difflib

from omegaconf import OmegaConf

from mtl.setup.choices import _choice, did_you_mean


def plateau_errors(cfg, tasks: dict) -> list[str]:
    """optim.scheduler=plateau: a baseline > 0 for every metric of the run's tasks (its Δm needs them), no other
    key, and the scheduler's own ranges."""
    p = cfg.optim.plateau
    if cfg.optim.scheduler != "plateau":
        return [] if not p.baselines else ["optim.plateau.baselines: read only by optim.scheduler=plateau (the rate "
                                           f"on the validation Δm), and optim.scheduler={cfg.optim.scheduler}; set "
                                           "optim.scheduler=plateau or remove the baselines"]
    errors = []
    if not 0 < p.factor < 1:
        errors.append(f"optim.plateau.factor: must be in (0, 1), the factor on the rate (got {p.factor})")
    if p.patience < 0 or p.min_lr < 0:
        errors.append(f"optim.plateau.patience / min_lr: must be >= 0 (got {p.patience}, {p.min_lr})")
    if cfg.optim.warmup_steps:
        errors.append(f"optim.warmup_steps={cfg.optim.warmup_steps}: optim.scheduler=plateau has no warmup; set 0")
    keys = [k for t in cfg.tasks if t in tasks for k, _ in tasks[t].metric_keys()]
    for key in keys:
        value = p.baselines.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            errors.append(f"optim.plateau.baselines.{key}: needs the single-task value of {key} (> 0) for the Δm the "
                          f"rate follows (got {value!r}); give one for each of {', '.join(keys)}")
    for key in p.baselines:
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.6)
            errors.append(f"optim.plateau.baselines.{key}: not a metric of the run's tasks"
                          + (f" — did you mean {close[0]!r}?" if close else "") + f" (they are: {', '.join(keys)})")
    return errors


def logged_metrics(cfg, tasks: dict) -> list[str]:
    """The evaluation metrics a run logs that a best checkpoint or early stopping can watch: each task's declared
    metrics, its other watchable numbers (``Task.watchable``: the caption task's exact and ppl) and its loss
    (``<task>_<metric>``), the test split's (``test_<task>_<metric>``) when there is one, and the validation Δm
    (``plateau_delta_m``) under optim.scheduler=plateau."""
    keys = [f"{t}_{m}" for t in cfg.tasks if t in tasks
            for m in dict.fromkeys([*tasks[t].metrics, *tasks[t].watchable, "loss"])]
    d = cfg.data
    test = (d.qm9.test_size if d.source == "qm9" else d.synthetic.test_size if d.source == "synthetic"
            else d.test_path) if not d.get("per_task") else None
    return keys + ([f"test_{k}" for k in keys] if test else []) + (
        ["plateau_delta_m"] if cfg.optim.scheduler == "plateau" else [])


def watched_metric_errors(cfg, tasks: dict) -> list[str]:
    """checkpoint.best_metric and trainer.early_stopping: a metric the run logs, a mode, and their ranges."""
    errors, es = [], cfg.trainer.early_stopping
    logged = logged_metrics(cfg, tasks)
    for key, metric, mode in (("checkpoint.best_metric", cfg.checkpoint.best_metric, "checkpoint.best_mode"),
                              ("trainer.early_stopping.metric", es.metric, "trainer.early_stopping.mode")):
        if metric is None:
            continue
        if metric not in logged and all(t in tasks for t in cfg.tasks):
            errors.append(f"{key}: {metric!r} is not a metric this run logs{did_you_mean(metric, logged)} (it logs: "
                          f"{', '.join(logged)})")
        _choice(errors, mode, OmegaConf.select(cfg, mode), ("max", "min"))
    if es.metric is not None and (es.patience < 1 or es.min_delta < 0):
        errors.append(f"trainer.early_stopping.patience / min_delta: patience must be >= 1 and min_delta >= 0 (got "
                      f"{es.patience}, {es.min_delta})")
    return errors
