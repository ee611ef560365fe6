"""Δm %: a multi-task run's metrics against single-task baselines, in the literature's sign (lower is better), as
Nash-MTL and FAMO report it. The one definition the core (the plateau scheduler on the validation Δm) and the
benchmark (mtl/tools/bench, its tables) use."""

from __future__ import annotations

import math
import statistics

from mtl.errors import DataError
from mtl.tasks import config_task_types


def delta(d: dict, base: dict, specs: list, partial: bool = False) -> float:
    """Δm % of one run against the baselines, lower is better (as Nash-MTL and FAMO report it): per task the mean over
    its metrics of ``(-1)^h_i (M_i - B_i) / B_i * 100`` (h_i = 1 if higher is better), then the mean over tasks, so
    each task weighs the same however many metrics it declares. ``specs``: ``[(metric key, task, higher is better)]``
    (``metric_specs``). nan when a metric or a baseline is missing (absent, None or nan: not measured, as the
    benchmark's mean over no baseline run; with ``partial``: over the tasks whose metrics the run has, as a
    single-task baseline has its own task's). A baseline of 0 or +-inf is refused (``verify_baselines``): Δm divides
    by it."""
    verify_baselines(base, specs)
    rel = {key: (-1 if higher else 1) * (d[key] - base[key]) / base[key] * 100
           for key, _, higher in specs if _measured(d.get(key)) and _measured(base.get(key))}
    tasks = [t for t in dict.fromkeys(t for _, t, _ in specs)
             if not partial or all(k in rel for k, tt, _ in specs if tt == t)]
    if not specs or not tasks or any(k not in rel for k, t, _ in specs if t in tasks):
        return float("nan")
    return statistics.mean(statistics.mean(rel[k] for k, t, _ in specs if t == task) for task in tasks)


def _measured(value) -> bool:
    return value is not None and value == value


def verify_baselines(base: dict, specs: list) -> None:
    """Raise ``DataError`` naming every baseline of ``specs`` that is 0 or +-inf (or not a number): Δm divides each
    metric's change by its baseline, so it is not defined against one of them. Absent, None and nan are "not
    measured" (``delta`` gives nan), never a value it divides by."""
    bad = []
    for key, _, _ in specs:
        value = base.get(key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value != value):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0 or math.isinf(value):
            bad.append(f"{key}={value!r}")
    if bad:
        raise DataError(f"Δm: the single-task baseline {', '.join(bad)} is 0 or not finite, and Δm divides each "
                        "metric's change by its baseline, so it is not defined against it. A metric that is 0 on the "
                        "baseline runs is not defined on this data for Δm: train the baselines longer, or compare "
                        "on metrics that are not 0 there (a given baseline: a finite number other than 0)")


def metric_specs(cfg) -> list[tuple[str, str, bool]]:
    """``[(metric key, task, higher is better)]``: the quality metrics each of the config's tasks declares
    (``TaskHead.metrics``; ``task_modules``' and ``task_instances``' tasks too)."""
    types = config_task_types(cfg)
    return [(key, t, higher) for t in cfg.tasks for key, higher in types[t].metric_keys()]
