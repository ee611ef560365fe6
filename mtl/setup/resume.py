"""Which config changes a resume may make without breaking exactness (docs/reliability.md).

Safe to change: ``trainer.max_steps`` (under a cosine or linear schedule it changes the learning rate from the
resumed step on, said at start-up: ``mtl.run.run_folder.schedule_change``), the logging and evaluation intervals,
output options, and operational switches that do not touch the maths. Everything else (model shape, data, strategy,
weighting, batch size, seed, precision, optimizer ...) must match the checkpoint's config, or the
resumed run would not be the run that was interrupted; each differing key is listed.

The world size, ``parallel.engine`` and ``data.batch_size`` may change too (the model and optimizer state is
sharded, ``mtl/checkpoint/train_state.py``, and reshards on load): :func:`reshard_problems` says whether the resumed run
is still the interrupted one (same global batch, and no per-rank random stream to carry over to another
number of ranks, no statistics over each rank's own batch: BatchNorm), and otherwise asks for
``resume_reshard: true``.

A checkpoint's ``config.yaml`` is data, not a config: it is read with ``mtl.config.yaml_read.load_saved_yaml`` (an
anchor, alias or repeated key is refused by line: mtl writes none) and no ``${...}`` interpolation or resolver in it
is ever evaluated (a crafted ``seed: ${oc.env:TOKEN}`` is compared, and printed, as that literal text). mtl writes it
already resolved.
"""

from __future__ import annotations

import os

import yaml
from omegaconf import OmegaConf

from mtl.checkpoint.folder import LEGACY_FORMAT
from mtl.config.effective import in_effect, unread_keys
from mtl.config.keys import Config, multi_input
from mtl.config.load import drop_moved_options, move_keys
from mtl.config.yaml_read import SAVED_YAML_FIX, YamlRefusal, load_saved_yaml
from mtl.errors import CheckpointError
from mtl.setup.checks import option_defaults
from mtl.tasks import task_types

SAFE_TO_CHANGE = (
    "output_dir", "resume", "overwrite", "device", "trainer.max_steps", "trainer.log_every", "trainer.eval_every",
    "trainer.eval_max_batches", "trainer.num_samples", "trainer.progress",
    "trainer.max_bad_steps", "trainer.poison", "checkpoint.", "data.num_workers", "data.eval_batch_size",
    "ddp.timeout_s", "ddp.replica_check_every", "ddp.nan_monitor", "bench.", "logging.",
    "init_from", "init_from_fresh_class_head",  # only read at a fresh start: a resume loads its own checkpoint's weights
    "task_modules",  # where the task files are found; the tasks and their options are compared themselves
    "weighting_modules",  # where a method's file is found; the method and its options are compared themselves
    "backbone_modules",  # where a backbone's file is found; the backbone and its options are compared themselves
    "architecture_modules",  # where an architecture's file is found; the architecture and its options are compared
    "parallel.engine", "data.batch_size", "resume_reshard",  # checked by reshard_problems: the global batch must stay
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


def saved_config(checkpoint_dir: str) -> dict:
    """The checkpoint's ``config.yaml`` as plain data (nothing in it resolved)."""
    path = os.path.join(checkpoint_dir, "config.yaml")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {checkpoint_dir!r} has no config.yaml: it is incomplete or not written by mtl")
    try:
        with open(path, encoding="utf-8") as f:
            saved = load_saved_yaml(f)  # plain data: nothing in it is resolved, no anchor, alias or repeated key
    except YamlRefusal as e:
        raise CheckpointError(f"{path!r}, {e}: {SAVED_YAML_FIX}. Use another checkpoint or export, or restore the "
                              "file from the run") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path!r} cannot be read: {e}") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path!r} is not an mtl config (a mapping of keys expected)")
    return saved


def verify_resume_config(checkpoint_dir: str, cfg) -> None:
    saved = saved_config(checkpoint_dir)
    path = os.path.join(checkpoint_dir, "config.yaml")

    # a checkpoint written before a key moved into a task's options (data.max_caption_tokens ...) reads as the new key
    moved = move_keys(saved, path, [])
    drop_moved_options(saved, moved, saved.get("tasks"))
    types = task_types(cfg.get("task_modules") or ())
    safe = SAFE_TO_CHANGE + tuple(f"task_options.{t}.{k}" for t in cfg.tasks if t in types
                                  for k in types[t].resume_safe)

    # a key this run does not read (mtl/config/read_rules.py) is not compared: its config leaves it out, and a checkpoint's
    # config.yaml written before that rule holds it
    not_read = tuple(unread_keys(cfg))
    current = in_effect(cfg)
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), resolve=True)
    extra = option_defaults(cfg)  # a checkpoint from before options existed used the classes' defaults
    defaults["task_options"], defaults["weighting"]["options"] = extra["task_options"], extra["weighting"]["options"]
    diff = differing_keys(saved, current, defaults, safe + not_read)
    if diff:
        a, b = _flatten(saved), _flatten(current)
        a = {**{k: v for k, v in _flatten(defaults).items() if k not in a}, **a}
        lines = [f"  {k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in diff]
        raise CheckpointError(
            f"cannot resume from {checkpoint_dir!r}: the config changed in ways that break an exact resume:\n"
            + "\n".join(lines) + "\nRestore these keys, or start a new run in another output_dir. Keys that may change "
            "on resume: " + ", ".join(safe))


def random_layers(model) -> list[str]:
    """The modules that draw random numbers in training: dropout (any ``_DropoutNd``) and stochastic depth with
    a probability above 0. Each rank's random state is its own; it does not carry over to another world size."""
    from torch import nn

    return [name for name, m in model.named_modules()
            if (isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth")
            and float(getattr(m, "p", 0) or 0) > 0]


def batch_statistics_layers(model) -> list[str]:
    """The modules whose training forward computes statistics over the process's own batch: BatchNorm (every
    ``_BatchNorm`` but SyncBatchNorm, whose statistics are over the global batch). On another number of processes
    each one normalises over other samples, so the run is another run. (tests/test_reshard.py checks that no other
    module of a model mtl builds mixes the samples of a batch.)"""
    from torch import nn

    return [name for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]


def reshard_problems(checkpoint_dir: str, state: dict, cfg, world_size: int, engine: str,
                     random: list[str], batch_stats: list[str] = ()) -> tuple[list[str], str]:
    """Why a resume of ``checkpoint_dir`` (its trainer ``state``) by this run (``world_size`` processes, ``engine``
    as it runs: "ddp" in one process, whatever the config says) would not continue the interrupted run, and a
    note saying what the resume is when it changes the world size or engine. ``random``: ``random_layers``;
    ``batch_stats``: ``batch_statistics_layers``.

    An mtl-checkpoint-v1 checkpoint (no sharded ``state/``) cannot reshard at all: a CheckpointError."""
    saved_world, saved_engine = int(state.get("world_size") or 1), state.get("engine") or "ddp"
    saved_batch = int(saved_config(checkpoint_dir).get("data", {}).get("batch_size") or cfg.data.batch_size)
    layout = f"{saved_world} process(es) with parallel.engine={saved_engine}"
    if not state.get("state") and (saved_world, saved_engine) != (world_size, engine):
        raise CheckpointError(
            f"checkpoint {os.path.join(checkpoint_dir, 'trainer_state.pt')!r} is in the {LEGACY_FORMAT} format (the full "
            f"optimizer state in trainer_state.pt, written before mtl saved sharded state): it resumes only as it "
            f"was written, with {layout}; this run has {world_size} process(es) with parallel.engine={engine}. Resume it "
            "with that world size and engine once: its next checkpoint can be resumed on any world size or engine")
    problems = []
    before, now = saved_batch * saved_world, cfg.data.batch_size * world_size
    # multi-input: data.batch_size is the global batch of the mixed policy only (the others read per-task sizes)
    if before != now and (not multi_input(cfg) or cfg.data.sampling.policy == "mixed"):
        keep = f"data.batch_size={before // world_size}" if before % world_size == 0 else (
            f"{saved_world} process(es) and data.batch_size={saved_batch}")
        problems.append(f"the global batch changes from {before} ({saved_batch} x {saved_world} process(es)) to "
                        f"{now} ({cfg.data.batch_size} x {world_size}): every later step averages another number "
                        f"of samples, from other cuts of the epoch's order (to keep it: {keep})")
    if saved_world != world_size and random:
        problems.append(f"the model draws random numbers in training ({', '.join(random[:3])}"
                        f"{' ...' if len(random) > 3 else ''}): each of the {saved_world} process(es) saved its own "
                        f"random state, which does not carry over to {world_size} (to keep it: {saved_world} "
                        "process(es), or no dropout in the run)")
    if saved_world != world_size and batch_stats:
        problems.append(f"the model computes statistics over each process's own batch (BatchNorm: "
                        f"{', '.join(batch_stats[:3])}{' ...' if len(batch_stats) > 3 else ''}): on {world_size} "
                        f"process(es) instead of {saved_world} each one normalises over other samples (to keep it: "
                        f"{saved_world} process(es), or model.backbone.norm=group, frozen or sync in the run)")
    if saved_world != world_size and multi_input(cfg):
        problems.append(f"multi-input mode (data.per_task): each task's rows per process are set per process, so "
                        f"{world_size} process(es) draw other global per-task batches than the {saved_world} that "
                        "saved it (to keep it: the same number of processes)")
    note = ""
    if (saved_world, saved_engine) != (world_size, engine) and not problems:
        note = (f"resume: a checkpoint of {layout}, resumed with {world_size} process(es) with parallel.engine={engine}; "
                f"the same global batch ({now}) and sample order: it continues the interrupted run up to floating-"
                "point rounding (another reduction order), not bitwise")
    return problems, note
