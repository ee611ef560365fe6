"""Δm %: a multi-task run's metrics against single-task baselines, in the literature's sign (lower is better), as
Nash-MTL and FAMO report it. The one definition the core (the plateau scheduler on the validation Δm) and the
benchmark (mtl/tools/bench, its tables) use."""

from __future__ import annotations

import statistics

from mtl.tasks import config_task_types


def delta(d: dict, base: dict, specs: list, partial: bool = False) -> float:
    """Δm % of one run against the baselines, lower is better (as Nash-MTL and FAMO report it): per task the mean over
    its metrics of ``(-1)^h_i (M_i - B_i) / B_i * 100`` (h_i = 1 if higher is better), then the mean over tasks, so
    each task weighs the same however many metrics it declares. ``specs``: ``[(metric key, task, higher is better)]``
    (``metric_specs``). nan when a metric or a baseline is missing (with ``partial``: over the tasks whose metrics
    the run has, as a single-task baseline has its own task's)."""
    rel = {key: (-1 if higher else 1) * (d[key] - base[key]) / base[key] * 100
           for key, _, higher in specs if d.get(key) == d.get(key) and key in d and base.get(key) == base.get(key)
           and base.get(key)}
    tasks = [t for t in dict.fromkeys(t for _, t, _ in specs)
             if not partial or all(k in rel for k, tt, _ in specs if tt == t)]
    if not specs or not tasks or any(k not in rel for k, t, _ in specs if t in tasks):
        return float("nan")
    return statistics.mean(statistics.mean(rel[k] for k, t, _ in specs if t == task) for task in tasks)


def metric_specs(cfg) -> list[tuple[str, str, bool]]:
    """``[(metric key, task, higher is better)]``: the quality metrics each of the config's tasks declares
    (``TaskHead.metrics``; ``task_modules``' and ``task_instances``' tasks too)."""
    types = config_task_types(cfg)
    return [(key, t, higher) for t in cfg.tasks for key, higher in types[t].metric_keys()]
