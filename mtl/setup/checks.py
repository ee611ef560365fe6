"""Checks of a loaded config that need more than the schema: names, ranges and combinations.

Every check appends one message naming the key and the fix; ``load_run_config`` raises them all
together as one ConfigError (exit code 2).
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import sys

import torch
from omegaconf import OmegaConf

from mtl.architectures import architecture_types, unknown_architecture
from mtl.config.effective import mark_unread
from mtl.config.keys import check_options, config_keys
from mtl.config.load import interpolation_errors, load_config_collecting
from mtl.config.read_rules import unread_errors
from mtl.data.images import normalize_problem, resolve_image_size
from mtl.data.parquet_stream import hf_stream_errors
from mtl.data.streamed import webdataset_errors
from mtl.data.synthetic import num_classes_problem
from mtl.errors import ConfigError
from mtl.models import peft_adapters
from mtl.models.backbones import backbone_types, unknown_backbone
from mtl.models.backbones.base import Backbone
from mtl.parallel.fsdp import ENGINES
from mtl.parallel.fsdp import check as fsdp_check
from mtl.parallel.fsdp import check_method as fsdp_method_check
from mtl.setup.build import run_method_types
from mtl.setup.choices import _choice, did_you_mean
from mtl.setup.metric_checks import plateau_errors, watched_metric_errors
from mtl.setup.multi_input import check as multi_input_check
from mtl.setup.reads import run_shape
from mtl.strategies import strategy_types
from mtl.tasks import config_task_types, instance_types, task_kinds, task_types
from mtl.weighting import weighting_types

SEED_RANGE = (0, 2**32 - 1)  # numpy's seed (np.random.seed, mtl/setup/build.py) takes exactly these


def _positive(errors, cfg, *keys, allow_zero=False):
    for key in keys:
        value = cfg
        for part in key.split("."):
            value = value[part]
        if value < 0 or (value == 0 and not allow_zero):
            errors.append(f"{key}: must be {'>= 0' if allow_zero else '> 0'} (got {value})")


def _augment(errors, cfg):
    a = cfg.data.augment
    if (a.random_resized_crop or a.hflip) and cfg.data.source == "synthetic":
        errors.append("data.augment: applies to manifest/imagefolder images only; the synthetic captions name the "
                      "position, which a crop or flip would make false — turn data.augment off")
    for key, lo in (("scale", 0.0), ("ratio", 0.0)):
        v = list(a[key])
        if len(v) != 2 or not lo < v[0] <= v[1] or (key == "scale" and v[1] > 1.0):
            errors.append(f"data.augment.{key}: needs [low, high] with 0 < low <= high"
                          + (" <= 1" if key == "scale" else "") + f" (got {v})")


def validate(cfg) -> list[str]:
    """Every problem of a loaded config that the schema alone cannot see, one message each (naming the key and the
    fix), in the order the parts below check them: the named choices, the start of the run, sizes and ranges, the
    tasks, the strategy, the weighting method, multi-input mode, the plug-ins' options, the architecture."""
    errors: list[str] = []
    _choices(errors, cfg)
    errors += tracker_errors(cfg)
    backbone = _backbone(errors, cfg)
    errors += blockwise_errors(cfg, backbone)
    _start_errors(errors, cfg)
    _size_errors(errors, cfg, backbone)
    tasks = _tasks(errors, cfg)
    _task_names(errors, cfg, tasks)
    strategies, strategy = _strategy(errors, cfg)
    methods, method = _method(errors, cfg, strategy, strategies)
    errors += peft_adapters.check(cfg, strategy)  # model.peft (mtl/models/peft_adapters.py)
    errors += multi_input_check(cfg, strategy, method, methods)  # data.per_task, data.sampling (mtl/setup/multi_input.py)
    _options(errors, cfg, tasks, method, backbone)
    errors += architecture_errors(cfg, method)
    _loss_scale(errors, cfg, tasks)
    errors += plateau_errors(cfg, tasks)
    errors += watched_metric_errors(cfg, tasks)
    named = {e.split(":")[0] for e in errors}
    _finite(errors, OmegaConf.to_container(cfg, resolve=True), named)
    return errors


def _choices(errors, cfg) -> None:
    """The keys that name one of a fixed set of values (and data.augment's ranges), and the seed's range."""
    _choice(errors, "precision", cfg.precision, ("fp32", "bf16", "fp16"))
    _choice(errors, "device", cfg.device, ("auto", "cpu", "cuda"))
    _choice(errors, "data.source", cfg.data.source, ("synthetic", "manifest", "imagefolder", "qm9", "hf", "webdataset",
                                                       "hf_stream"))
    _choice(errors, "data.on_error", cfg.data.on_error, ("raise", "skip"))
    if normalize_problem(cfg.data.normalize):  # auto | none | imagenet | {mean: [...], std: [...]}
        errors.append(normalize_problem(cfg.data.normalize))
    _augment(errors, cfg)
    _choice(errors, "ddp.backend", cfg.ddp.backend, ("auto", "gloo", "nccl"))
    _choice(errors, "parallel.engine", cfg.parallel.engine, ENGINES)
    _choice(errors, "optim.name", cfg.optim.name, ("adamw", "sgd"))
    _choice(errors, "optim.scheduler", cfg.optim.scheduler, ("cosine", "linear", "constant", "plateau"))
    if not SEED_RANGE[0] <= cfg.seed <= SEED_RANGE[1]:
        errors.append(f"seed: {cfg.seed} is outside {SEED_RANGE[0]}..{SEED_RANGE[1]} (2**32 - 1), the seeds numpy "
                      "takes; choose a seed in that range")


TRACKERS = ("tensorboard", "wandb", "mlflow", "csv")  # logging.trackers (mtl/run/trackers.py)
TRACKER_LIBRARIES = ("wandb", "mlflow")  # the trackers that come in the extra `trackers`


def tracker_installed(library: str) -> bool:
    """Whether ``library`` imports, without importing it (wandb and mlflow take seconds)."""
    if library in sys.modules:
        return sys.modules[library] is not None
    return importlib.util.find_spec(library) is not None


def tracker_errors(cfg) -> list[str]:
    """``logging.trackers``: known names, and their libraries installed (else one message naming the extra)."""
    names = list(OmegaConf.select(cfg, "logging.trackers", default=None) or [])
    errors: list[str] = []
    for name in names:
        _choice(errors, "logging.trackers", name, TRACKERS)
    missing = [n for n in dict.fromkeys(names) if n in TRACKER_LIBRARIES and not tracker_installed(n)]
    if missing:
        errors.append(f"logging.trackers: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                      "installed; install the trackers extra (pip install -e '.[trackers]', or make install), or "
                      f"remove {', '.join(missing)} from logging.trackers")
    return errors


def hf_errors(cfg) -> list[str]:
    """``data.source: hf``: its path set, and the datasets library installed (else one message naming the extra)."""
    errors = [] if cfg.data.hf.path else ["data.hf.path: data.source=hf needs the data set's folder (a save_to_disk "
                                          "folder, or the folder of the files data.hf.builder reads)"]
    if not tracker_installed("datasets"):
        errors.append("data.source: hf reads Hugging Face datasets, and the datasets library is not installed; install "
                      "the data extra (pip install -e '.[data]', or make install)")
    return errors


def _start_errors(errors, cfg) -> None:
    """How the run starts: the norms the device and weights allow; resume, init_from, resume_reshard and overwrite
    against each other."""
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if cfg.model.backbone.norm == "sync" and on_cpu:
        errors.append("model.backbone.norm: sync (SyncBatchNorm) needs CUDA devices, and this run is on the CPU "
                      f"(device={cfg.device}); use model.backbone.norm=group (rank-independent) or batch")
    if cfg.model.backbone.norm == "frozen" and not cfg.model.backbone.weights and not cfg.init_from:
        errors.append("model.backbone.norm: frozen keeps the BatchNorm statistics of pretrained weights and trains "
                      "nothing in the norms, but model.backbone.weights is null (random weights): the network would "
                      "have no working normalisation. Set model.backbone.weights (e.g. IMAGENET1K_V2, or a local .pth "
                      "file), or learn from scratch with model.backbone.norm=group")
    if cfg.resume is not None and cfg.resume != "auto" and not os.path.isdir(cfg.resume):
        errors.append(f"resume: {cfg.resume!r} is neither null, 'auto' nor an existing checkpoint directory")
    if cfg.init_from is not None and not os.path.exists(cfg.init_from):
        errors.append(f"init_from: {cfg.init_from!r} does not exist (a checkpoint or export folder, a run's "
                      "output_dir, or a model.safetensors file)")
    if cfg.init_from is not None and cfg.resume not in (None, "auto"):
        errors.append("init_from: a warm start begins a new run, resume=<checkpoint> continues one; set only one "
                      "(with resume=auto, init_from is used only while output_dir has no checkpoint)")
    if cfg.get("resume_reshard") and cfg.resume is None:
        errors.append("resume_reshard: true only lets a resume continue where the resumed run cannot equal the "
                      "interrupted one; this run resumes nothing (resume=null). Set resume=auto or "
                      "resume=<checkpoint>, or remove resume_reshard")
    if cfg.overwrite and cfg.resume is not None:
        errors.append(f"overwrite: true starts over, resume={cfg.resume} continues a run; set one of them "
                      "(overwrite=false to resume, resume=null to start over)")


def _size_errors(errors, cfg, backbone) -> None:
    """Sizes and ranges: the positive keys, the data source's own (synthetic, qm9, the files), the decoder's shape,
    trainer.poison's form and Adam's betas."""
    _positive(errors, cfg, "trainer.max_steps", "data.batch_size", "data.eval_batch_size", "data.image_size",
              "trainer.log_every", "trainer.eval_every", "optim.lr", "ddp.bucket_cap_mb", "ddp.timeout_s",
              "tokenizer.vocab_size", "trainer.max_bad_steps")
    _positive(errors, cfg, "ddp.replica_check_every", "data.num_workers", "optim.warmup_steps", "optim.grad_clip", "optim.weight_decay",
              "checkpoint.every_steps", "checkpoint.keep_last", "trainer.eval_max_batches", "trainer.num_samples",
              "data.synthetic.noise", "data.synthetic.clutter", allow_zero=True)
    syn = cfg.data.synthetic
    if cfg.data.source == "synthetic":
        _positive(errors, cfg, "data.synthetic.train_size", "data.synthetic.val_size", "data.synthetic.max_count")
        problem = num_classes_problem(syn.num_classes)
        if problem:
            errors.append(problem)
    elif cfg.data.source == "qm9":
        errors += qm9_errors(cfg, backbone)
    elif cfg.data.source == "hf":
        errors += hf_errors(cfg)
    elif cfg.data.source in ("webdataset", "hf_stream"):
        errors += (webdataset_errors if cfg.data.source == "webdataset" else hf_stream_errors)(cfg)
    elif cfg.data.train_path is None or cfg.data.val_path is None:
        errors.append(f"data.train_path / data.val_path: data.source={cfg.data.source} needs both paths")
    if not 0.0 <= cfg.model.decoder.dropout < 1.0:
        errors.append(f"model.decoder.dropout: must be in [0, 1) (got {cfg.model.decoder.dropout})")
    if cfg.model.decoder.n_embd % max(1, cfg.model.decoder.n_head):
        errors.append(f"model.decoder.n_embd: {cfg.model.decoder.n_embd} must be divisible by model.decoder.n_head "
                      f"({cfg.model.decoder.n_head})")
    if cfg.model.decoder.pretrained and not cfg.tokenizer.path:
        errors.append("tokenizer.path: a pretrained decoder (model.decoder.pretrained) needs its own tokenizer; "
                      "set tokenizer.path to its directory")
    if cfg.trainer.poison is not None:
        parts = str(cfg.trainer.poison).split(":")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in [*cfg.tasks, "crash", "stop"] or not (parts[2] == "*"
                                                                                             or parts[2].isdigit()):
            errors.append(f"trainer.poison: {cfg.trainer.poison!r} must be STEP:TASK:RANK, e.g. 3:gen:1 or 3:cls:*")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        errors.append(f"optim.betas: needs two values in [0, 1), Adam's moment decay rates (got {list(cfg.optim.betas)})")


def _task_names(errors, cfg, tasks: dict) -> None:
    """``tasks``: known names, at least one, no repeats."""
    unknown = [t for t in cfg.tasks if t not in tasks]
    if unknown:
        close = {t: difflib.get_close_matches(str(t), list(tasks), n=1, cutoff=0.6) for t in unknown}
        hints = "".join(f" — did you mean {c[0]!r} for {t!r}?" for t, c in close.items() if c)
        errors.append(f"tasks: unknown task {', '.join(map(repr, unknown))}{hints} (known: {', '.join(tasks)}; "
                      "named tasks of a task type go in task_instances)")
    if len(set(cfg.tasks)) != len(cfg.tasks) or not cfg.tasks:
        errors.append(f"tasks: needs at least one task and no repeats (got {list(cfg.tasks)})")


def _strategy(errors, cfg) -> tuple[dict, type | None]:
    """``ddp.strategy``: a known name and its own checks (unless ``ddp.unsafe``), and the engine's checks of it.
    Returns (every strategy, the run's or None)."""
    strategies = strategy_types()
    strategy = strategies.get(cfg.ddp.strategy)
    if strategy is None:
        errors.append(f"ddp.strategy: unknown strategy {cfg.ddp.strategy!r}{did_you_mean(cfg.ddp.strategy, strategies)} "
                      f"(known: {', '.join(strategies)})")
    else:
        if not cfg.ddp.unsafe:  # unsafe: the user asked to reproduce a known failure
            errors += strategy.check(cfg)
    errors += fsdp_check(cfg, strategy)
    return strategies, strategy


def _method(errors, cfg, strategy, strategies: dict) -> tuple[dict, type | None]:
    """``weighting.method``: a known name (mtl/weighting/ and ``weighting_modules``), its own checks, its held-out
    batch, its gradient source against the strategy, and the engine's checks of it. Returns (every method, the
    run's or None)."""
    try:
        methods = run_method_types(cfg)
    except ConfigError as e:
        errors += e.errors
        methods = weighting_types()
    method = methods.get(cfg.weighting.method)
    if method is None:
        close = difflib.get_close_matches(str(cfg.weighting.method), list(methods), n=1, cutoff=0.6)
        errors.append(f"weighting.method: unknown method {cfg.weighting.method!r}"
                      + (f" — did you mean {close[0]!r}?" if close else "") + f" (known: {', '.join(methods)})")
    else:
        errors += method.check(cfg)
        errors += heldout_errors(cfg, method)
        errors += gradient_source_errors(cfg, strategy, method, strategies)
        errors += heads_errors(cfg.weighting.heads)  # with a method that does not read it: the read rules say so
        errors += fsdp_method_check(cfg, method)
    return methods, method


def _finite(errors, node, named: set, prefix: str = "") -> None:
    """NaN and inf are refused in every numeric key (NaN passes every range check: each comparison is false),
    unless a check above already named the key (``named``)."""
    for key, value in node.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            _finite(errors, value, named, dotted)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
            if dotted not in named:
                errors.append(f"{dotted}: must be finite (got {value})")


def _loss_scale(errors, cfg, tasks) -> None:
    for t, v in (cfg.get("loss_scale") or {}).items():
        if t not in tasks:
            errors.append(f"loss_scale.{t}: {t!r} is not a task (known: {', '.join(tasks)})")
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            errors.append(f"loss_scale.{t}: must be a number > 0, the factor on {t}'s training loss (got {v!r})")


def qm9_errors(cfg, backbone) -> list[str]:
    """data.source=qm9: its section's values, and a backbone that reads graphs (docs/qm9.md)."""
    q, errors = cfg.data.qm9, []
    _choice(errors, "data.qm9.graph", q.graph, ("complete", "bond"))
    _positive(errors, cfg, "data.qm9.val_size")
    _positive(errors, cfg, "data.qm9.molecules", "data.qm9.test_size", "data.qm9.train_size", allow_zero=True)
    if q.molecules and q.molecules <= q.test_size + q.val_size:
        errors.append(f"data.qm9.molecules={q.molecules}: must exceed data.qm9.test_size + val_size ({q.test_size} + "
                      f"{q.val_size}) to leave a training split; lower the two sizes for a small run")
    if q.root is not None and not os.path.isdir(q.root):
        errors.append(f"data.qm9.root: {q.root!r} is not a folder — give the root of PyG's QM9 (the folder holding "
                      "processed/data_v3.pt), or null to build QM9 from qm9pack")
    if backbone is not None and backbone.consumes != "graph":
        errors.append(f"data.source=qm9 gives molecule graphs, and model.backbone.name={cfg.model.backbone.name} reads "
                      f"{backbone.consumes!r}; set model.backbone.name=mpnn")
    if cfg.data.get("per_task"):
        errors.append("data.per_task: multi-input mode reads image data sets; data.source=qm9 is one data set for "
                      "every task — remove data.per_task")
    return errors


SOURCES = ("parameters", "features")
HEADS = ("unweighted", "weighted")


def heads_errors(heads: str, method=None) -> list[str]:
    """weighting.heads: one of ``HEADS``; with ``method`` (the bench's entries, which no read rule judges), also
    that the method reads it (the Gram methods declare it in ``reads``)."""
    if heads not in HEADS:
        return [f"weighting.heads: {heads!r} is not one of {', '.join(HEADS)}{did_you_mean(heads, HEADS)}"]
    if method is not None and heads != "unweighted" and "weighting.heads" not in getattr(method, "reads", ()):
        return [f"weighting.heads: {heads} applies to the gradient-level methods whose update is w^T G (their w_t "
                f"weighs head t), and weighting.method={method.name} is not one; remove weighting.heads"]
    return []


def gradient_source_errors(cfg, strategy, method, strategies: dict) -> list[str]:
    """weighting.source against the method (gradient-level? Gram-only?) and the strategy (which sources it serves:
    ``Strategy.gradient_sources``)."""
    source, name = cfg.weighting.source, cfg.weighting.method
    if source not in SOURCES:
        return [f"weighting.source: {source!r} is not one of {', '.join(SOURCES)}{did_you_mean(source, SOURCES)}"]
    if method.level != "grad":
        if source == "features":
            return [f"weighting.source: features applies to gradient-level methods only, and weighting.method={name} is "
                    "loss-level (it weighs the losses, the backward passes do the rest); remove weighting.source"]
        return []
    errors = []
    if source == "parameters" and cfg.model.backbone.get("freeze"):
        errors.append("weighting.source: parameters takes each task's gradient of the shared backbone parameters, and "
                      "model.backbone.freeze: true leaves none training (a linear probe); use weighting.source=features "
                      "(the tasks' gradients of the shared features) or a loss-level method, or unfreeze the backbone")
    if source == "features" and not method.gram_only():
        errors.append(f"weighting.source: features gives a method only the K x K Gram matrix of the tasks' feature "
                      f"gradients, and weighting.method={name} needs the rows of G themselves (it overrides combine); "
                      "use weighting.source=parameters with ddp.strategy=task_grads")
    if strategy is not None and source not in strategy.gradient_sources:
        serving = [n for n, cls in strategies.items() if source in cls.gradient_sources and not cls.unsafe]
        other = "features" if source == "parameters" else "parameters"
        alt = [n for n, cls in strategies.items() if other in cls.gradient_sources and not cls.unsafe]
        hint = (f", or weighting.source=features with ddp.strategy={' or '.join(alt)} (the cheaper feature-level "
                "surrogate, see docs/strategies.md)" if other == "features" and alt and method.gram_only() else "")
        errors.append(f"weighting.method={name} needs each task's gradient of the shared {source} "
                      f"(weighting.source={source}), which ddp.strategy={cfg.ddp.strategy} does not give; use "
                      f"ddp.strategy={' or '.join(serving)}{hint}")
    return errors


def heldout_errors(cfg, method) -> list[str]:
    """data.heldout: a part of the training set that only a bilevel method reads (mtl/data/heldout.py)."""
    h = int(cfg.data.heldout)
    if h < 0:
        return [f"data.heldout: must be >= 0 (got {h})"]
    if h and not method.needs_heldout_batch:
        users = sorted(n for n, m in weighting_types().items() if m.needs_heldout_batch)
        return [f"data.heldout: {h} training items would be held out, and weighting.method={method.name} never reads "
                f"them (only {', '.join(users)} do); remove data.heldout to train on every item"]
    if h and cfg.data.source == "synthetic" and h >= cfg.data.synthetic.train_size:
        return [f"data.heldout: {h} is not fewer than data.synthetic.train_size ({cfg.data.synthetic.train_size}); "
                "hold out a part of the training set, leaving at least one global batch to train on"]
    return []


def _tasks(errors, cfg) -> dict[str, type]:
    """The tasks the config can name: the registered ones (and ``task_modules``') and its ``task_instances``."""
    try:
        tasks = task_types(cfg.task_modules)
        kinds = task_kinds(cfg.task_modules)
    except ConfigError as e:
        errors += e.errors
        tasks, kinds = task_types(), task_kinds()
    made, problems = instance_types(cfg.get("task_instances") or {}, kinds, tasks)
    errors += problems
    return {**tasks, **made}


def _task_checks(errors, cfg, tasks) -> None:
    """Each configured task's own ``check`` (after its options were checked: a task reads them)."""
    for t in cfg.tasks:
        if t in tasks and not any(e.startswith(f"task_options.{t}") for e in errors):
            errors += tasks[t].check(cfg)


def blockwise_errors(cfg, backbone: type | None) -> list[str]:
    """``optim.layer_decay`` in (0, 1]; ``model.backbone.freeze_blocks`` >= 0; the per-block keys refused for a
    backbone class that declares no blocks (``Backbone.blocks`` not overridden: the QM9 MPNN). A count of blocks
    above the backbone's is refused when the model is built (``mtl.models.blockwise.freeze``)."""
    errors = []
    decay = cfg.optim.layer_decay
    if not 0.0 < decay <= 1.0:
        errors.append(f"optim.layer_decay: {decay} is outside (0, 1]; a block d blocks below the top trains at "
                      "lr * layer_decay**d (0.65-0.75 is BEiT's and MAE's range; 1 turns it off)")
    freeze = cfg.model.backbone.get("freeze_blocks", 0)
    if freeze < 0:
        errors.append(f"model.backbone.freeze_blocks: {freeze} is negative; 0 freezes nothing, N the first N blocks")
    if cfg.model.backbone.get("freeze") and freeze:
        errors.append(f"model.backbone.freeze_blocks: {freeze} with model.backbone.freeze: true, which freezes the "
                      "whole backbone; remove one of them")
    if backbone is None or backbone.blocks is not Backbone.blocks:
        return errors
    for key, on in (("model.activation_checkpointing", cfg.model.get("activation_checkpointing")),
                    ("model.compile", cfg.model.get("compile")), ("optim.layer_decay", decay != 1.0)):
        if on:
            errors.append(f"{key}: the backbone {cfg.model.backbone.name!r} ({backbone.__name__}) declares no blocks "
                          "(Backbone.blocks()), and this setting acts per block; use a backbone that declares them "
                          "(hf_vision, timm, the torchvision ones) or remove the key")
    return errors


def _backbone(errors, cfg) -> type | None:
    """The class of ``model.backbone.name``, among the built-in backbones and ``backbone_modules`` (its options and
    own checks: ``_options``)."""
    try:
        types = backbone_types(cfg.get("backbone_modules") or ())
    except ConfigError as e:
        errors += e.errors
        types = backbone_types()
    backbone = types.get(cfg.model.backbone.name)
    if backbone is None:
        errors.append(unknown_backbone(cfg.model.backbone.name, types))
    return backbone


def _options(errors, cfg, tasks, method, backbone=None) -> None:
    """Check the task and method options against the classes' ``Options`` and fill in their defaults, so that
    ``config.yaml`` holds every value a run used. Options of a known task this run does not train are checked, then dropped
    (a base config's caption options stay harmless under ``tasks=[cls]``); an unknown task name is an error."""
    for t in cfg.task_options:
        if t not in tasks:
            close = difflib.get_close_matches(str(t), list(tasks), n=1, cutoff=0.6)
            errors.append(f"task_options.{t}: {t!r} is not a task" + (f" — did you mean {close[0]!r}?" if close else "")
                          + f" (known: {', '.join(tasks)}; a task file outside mtl/tasks goes in task_modules, a "
                          "named task of a task type in task_instances)")
        elif t not in cfg.tasks:  # checked all the same, so that a typo there is not silently dropped
            check_options(cfg.task_options.get(t), tasks[t].Options, f"task_options.{t}", errors)
    cfg.task_options = {t: check_options(cfg.task_options.get(t), tasks[t].Options, f"task_options.{t}", errors)
                        for t in cfg.tasks if t in tasks}
    _task_checks(errors, cfg, tasks)
    if method is not None:
        cfg.weighting.options = check_options(cfg.weighting.options, method.Options, "weighting.options", errors)
    if backbone is not None:
        cfg.model.backbone.options = check_options(cfg.model.backbone.options, backbone.Options,
                                                   "model.backbone.options", errors)
        if not any(e.startswith("model.backbone.options") for e in errors):  # its check reads them
            errors += backbone.check(cfg)


def architecture_errors(cfg, method) -> list[str]:
    """``model.architecture``: a known name, its options (filled in), its own checks, and a features source it can
    serve (mtl/architectures/)."""
    try:
        types = architecture_types(cfg.get("architecture_modules") or ())
    except ConfigError as e:
        return e.errors
    a = cfg.model.architecture
    arch = types.get(a.name)
    if arch is None:
        return [unknown_architecture(a.name, types)]
    errors: list[str] = []
    a.options = check_options(a.options, arch.Options, "model.architecture.options", errors)
    if errors:
        return errors
    errors += arch.check(cfg)
    return errors + architecture_source_errors(cfg, method, arch)


def architecture_source_errors(cfg, method, arch=None) -> list[str]:
    """``weighting.source: features`` with an architecture that has no tensor every task reads (``cross_stitch``)."""
    if arch is None:
        arch = architecture_types(cfg.get("architecture_modules") or ()).get(cfg.model.architecture.name)
    if arch is not None and arch.features_source and method is not None and method.level == "grad" \
            and cfg.weighting.source == "features":
        return [f"weighting.source: features cannot serve model.architecture.name={arch.name}: "
                f"{arch.features_source}; set weighting.source=parameters"]
    return []


def option_defaults(cfg) -> dict:
    """The options the config's tasks and method take when none are given, shaped like the config."""
    tasks = config_task_types(cfg)
    method = run_method_types(cfg).get(cfg.weighting.method)
    return {"task_options": {t: check_options({}, tasks[t].Options, "", []) for t in cfg.tasks if t in tasks},
            "weighting": {"options": check_options({}, method.Options, "", []) if method else {}}}


def options_help() -> str:
    """Each task's and weighting method's own options (for ``train.py --help``)."""
    lines = []
    for section, types in (("task_options.<task>", task_types()), ("weighting.options (method=<name>)",
                                                                   weighting_types())):
        rows = [(name, config_keys(cls.Options)) for name, cls in types.items()]
        lines.append(f"{section}:")
        for name, keys in rows:
            if not any(c for *_, c in keys):  # undocumented (or none): one line
                lines.append(f"  {name}: " + (", ".join(f"{k}: {t} = {d!r}" for k, t, d, _ in keys) or "(no options)"))
                continue
            lines.append(f"  {name}:")  # one line per option, with its comment from the Options dataclass
            lines += [f"    {k}: {t} = {d!r}" + (f"  # {c}" if c else "") for k, t, d, c in keys]
    return "\n".join(lines)


def load_run_config(path: str, overrides: list[str] | None = None, announce: bool = True):
    """The checked config. Key and type problems and the checks below are reported together, in one
    ConfigError (a value that failed its key or type check keeps its default for the checks below).
    ``announce``: print the line of a strategy chosen for the method (``auto_strategy``), on rank 0."""
    errors: list[str] = []
    setters: dict = {}
    cfg = load_config_collecting(path, overrides, errors, setters)
    unresolved = interpolation_errors(cfg)
    if unresolved:  # the checks below would read those keys
        raise ConfigError(errors + unresolved)
    note = auto_strategy(cfg, explicit="ddp.strategy" in setters)
    errors += resolve_image_size(cfg)  # data.image_size: auto -> the model folder's size (an int from here on)
    errors += validate(cfg)
    # a key the user set that the run does not read (mtl/config/read_rules.py), unless a check above refused it already
    unread, keys = unread_errors(cfg, run_shape(cfg), setters, named={e.split(":")[0] for e in errors})
    errors += unread
    if errors:
        raise ConfigError(errors)
    mark_unread(cfg, keys)  # left out of the printed and saved config
    if note and announce and int(os.environ.get("RANK", "0")) == 0:
        print(f"mtl: {note}", flush=True)
    return cfg


def auto_strategy(cfg, explicit: bool) -> str | None:
    """A gradient-level method whose ``weighting.source`` the configured strategy does not serve gets the one
    strategy that does (task_grads for the parameters, feature_leaf for the features), but only when
    ``ddp.strategy`` holds its default (``explicit`` False): a strategy the user named is never replaced (the
    check then refuses it, naming the key and the fix). Returns the line that says what was chosen, or None."""
    strategies = strategy_types()
    strategy = strategies.get(cfg.ddp.strategy)
    source = cfg.weighting.source
    try:
        method = run_method_types(cfg).get(cfg.weighting.method)
    except ConfigError:  # validate reports it
        return None
    if explicit or strategy is None or method is None or method.level != "grad" or source not in SOURCES \
            or source in strategy.gradient_sources:
        return None
    serving = [n for n, cls in strategies.items() if source in cls.gradient_sources and not cls.unsafe]
    if len(serving) != 1:
        return None
    default, cfg.ddp.strategy = cfg.ddp.strategy, serving[0]
    return (f"ddp.strategy={serving[0]}, not the default {default}: weighting.method={cfg.weighting.method} needs each "
            f"task's gradient of the shared {source} (weighting.source={source}), which only {serving[0]} gives. "
            "Set ddp.strategy to choose yourself")
