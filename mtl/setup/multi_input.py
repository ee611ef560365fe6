"""Config checks of multi-input mode (``data.per_task``, ``data.sampling``; docs/multi-input.md).

Which strategies and weighting methods a sampling policy allows, and why:

- ``all`` and ``mixed`` put every task in every step (``mixed``: at least one row over all ranks, maybe none on
  some rank). A task with no row on a rank gets a zero loss through its head and the shared features
  (mtl/models/multitask.py), so every rank builds the same graph: every strategy and method is allowed, as
  without multi-input (tests/test_multi_input_ddp.py proves feature_leaf, find_unused, placeholder, accumulate
  and task_grads with pcgrad at 2 processes against 1).
- ``round_robin``, ``weighted`` and ``temperature`` leave whole tasks out of a step, on every rank: the absent
  task's head gets no gradient in that step. DDP built with ``find_unused_parameters=False`` then waits for those
  parameters forever and fails at the next step ("Expected to have finished reduction in the prior iteration",
  the seed articles' error). So a strategy is allowed only if DDP is told (find_unused_parameters=True:
  ``find_unused``, ``accumulate``, ``combined`` with ``ddp.find_unused_parameters=true``) or if it gives the
  absent heads a zero gradient itself (``covers_unused_parameters``: ``placeholder``'s zero term in every pass;
  ``feature_leaf`` and ``task_grads`` add one over the absent heads to their first head pass,
  mtl/strategies/absent.py). ``combined`` and ``detach`` (find_unused_parameters=false) are refused.
  Weighting (mtl/weighting/base.py): the method is told the step's tasks (``begin_step(step, present)``); a
  loss-level method weighs the present tasks only, a gradient-level one combines their K' rows only (the
  K'-task problem, no zero row for an absent task). Allowed (``Weighting.allows_absent_tasks()``): loss-level
  methods whose ``end_step`` keeps nothing, and methods with ``updates_from_present_tasks`` (state moved only by
  the present tasks: DWA, FAMO, GradNorm, GradVac, Nash-MTL, MoDo, SDMGrad, DB-MTL, ExcessMTL, STCH; or no state:
  the other Gram methods and GradDrop). Every other method is refused with its own reason (``absent_task_refusal``:
  MoCo; a bilevel method refuses multi-input mode as a whole in its own check).
"""

from __future__ import annotations

import difflib
import os

from mtl.config.keys import TaskDataConfig, check_options
from mtl.data.multi_input import ABSENT_POLICIES, POLICIES, SOURCES
from mtl.weighting import weighting_types


def _near(value: str, allowed) -> str:
    close = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.6)
    return f" — did you mean {close[0]!r}?" if close else ""


def check(cfg, strategy, method, methods: dict[str, type] | None = None) -> list[str]:
    """Errors of ``data.per_task`` / ``data.sampling``; fills each task's section with its defaults. ``methods``: the
    weighting methods the run can name (``mtl.setup.build.run_method_types``; default: the shipped ones), for the refusal's
    list of allowed methods."""
    errors: list[str] = []
    per_task, sp = cfg.data.get("per_task") or {}, cfg.data.sampling
    if not per_task:
        if sp.policy != "all":
            errors.append(f"data.sampling.policy: {sp.policy} applies to multi-input mode only; give each task its "
                          "own data set in data.per_task.<task> (docs/multi-input.md), or remove data.sampling")
        return errors
    for t in per_task:
        if t not in cfg.tasks:
            errors.append(f"data.per_task.{t}: {t!r} is not a task of this run{_near(t, cfg.tasks)} "
                          f"(tasks: {', '.join(cfg.tasks)})")
    missing = [t for t in cfg.tasks if t not in per_task]
    if missing:
        errors.append("data.per_task: multi-input mode needs a data section for every task; add "
                      + ", ".join(f"data.per_task.{t}" for t in missing) + " (e.g. {source: synthetic})")
    filled = {}
    for t in cfg.tasks:
        if t not in per_task:
            continue
        key = f"data.per_task.{t}"
        d = TaskDataConfig(**check_options(per_task[t], TaskDataConfig, key, errors))
        filled[t] = vars(d)
        if d.source not in SOURCES:
            errors.append(f"{key}.source: {d.source!r} is not one of {', '.join(SOURCES)}{_near(d.source, SOURCES)}")
        if d.on_error not in ("raise", "skip"):
            errors.append(f"{key}.on_error: {d.on_error!r} is not one of raise, skip")
        for name in ("batch_size", "train_size", "val_size"):
            if getattr(d, name) < 1:
                errors.append(f"{key}.{name}: must be > 0 (got {getattr(d, name)})")
        if d.ratio <= 0:
            errors.append(f"{key}.ratio: must be > 0 (got {d.ratio})")
        # the GLOBAL rows of a step that holds the task (mixed draws data.batch_size rows instead); torchrun's world
        # size: the process group starts after this check
        world = int(os.environ.get("WORLD_SIZE", "1")) if sp.policy != "mixed" else 1
        if d.source == "synthetic" and d.batch_size * world > d.train_size:
            errors.append(f"{key}.batch_size: {d.batch_size} per process x {world} process(es) = {d.batch_size * world} "
                          f"rows in a step that holds {t}, more than the task's train_size ({d.train_size}); such a "
                          f"step could not be filled. Set {key}.batch_size <= {max(1, d.train_size // world)} or raise "
                          f"{key}.train_size")
        if d.source not in ("synthetic", "hf") and (not d.train_path or not d.val_path):
            errors.append(f"{key}: source={d.source} needs train_path and val_path")
    cfg.data.per_task = filled
    if sp.policy not in POLICIES:
        errors.append(f"data.sampling.policy: {sp.policy!r} is not one of {', '.join(POLICIES)}"
                      f"{_near(sp.policy, POLICIES)}")
    if sp.weights not in ("set", "size"):
        errors.append(f"data.sampling.weights: {sp.weights!r} is not one of set, size{_near(sp.weights, ('set', 'size'))}")
    if sp.temperature <= 0:
        errors.append(f"data.sampling.temperature: must be > 0 (got {sp.temperature})")
    if sp.policy == "mixed" and cfg.data.batch_size < len(cfg.tasks):
        errors.append(f"data.batch_size: {cfg.data.batch_size} is fewer than the {len(cfg.tasks)} tasks; "
                      "sampling.policy=mixed puts every task in every step, so raise it")
    if cfg.parallel.engine == "fsdp2":
        errors.append("data.per_task: multi-input mode is tested under parallel.engine=ddp only; use parallel.engine=ddp")
    if sp.policy in ABSENT_POLICIES:
        errors += _absent_task_errors(cfg, strategy, method, methods)
    return errors


def _absent_task_errors(cfg, strategy, method, methods) -> list[str]:
    errors = []
    why = (f"data.sampling.policy={cfg.data.sampling.policy}, which leaves tasks out of whole steps (an absent "
           "task's head gets no gradient)")
    if strategy is not None and not cfg.ddp.unsafe:
        fu = cfg.ddp.find_unused_parameters
        told = strategy.find_unused_parameters if fu is None else bool(fu)
        if not told and not strategy.covers_unused_parameters:
            errors.append(
                f"ddp.strategy: {strategy.name} builds DDP with find_unused_parameters=false, and {why}: under DDP the "
                "next step fails with 'Expected to have finished reduction in the prior iteration'. Use "
                "ddp.strategy=find_unused, accumulate, placeholder, feature_leaf or task_grads (or combined with "
                "ddp.find_unused_parameters=true), or data.sampling.policy=all or mixed (every task in every step)")
    # a bilevel method refuses multi-input mode as a whole in its own check (one message, not two)
    if method is not None and not method.allows_absent_tasks() and not method.needs_heldout_batch:
        reason = method.absent_task_refusal or (
            "a gradient-level method combines the step's task gradients" if method.level == "grad" else
            "it updates its state from every task's loss after each step") + "; not yet defined for a step without some tasks"
        errors.append(f"weighting.method: {method.name} is not supported with {why}: {reason}. Use a method that "
                      f"weighs or combines the present tasks only ({', '.join(present_only_methods(methods))}), or "
                      "data.sampling.policy=all or mixed")
    return errors


def present_only_methods(methods: dict[str, type] | None = None) -> list[str]:
    """The weighting methods (of ``methods``; default: the shipped ones) allowed with policies that leave tasks out
    of a step."""
    return sorted(n for n, m in (methods or weighting_types()).items() if m.allows_absent_tasks())
