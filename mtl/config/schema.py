"""The typed config schema and its loader.

A run's config is one YAML file (which may name a ``base:`` file to build on) plus ``key=value``
overrides from the command line. Every value is checked against the dataclasses below before
anything starts: an unknown key or a wrong type is reported with the key and where it came from,
and *all* such errors are reported together (``ConfigError``, exit code 2).

Interpolations: a user config (its files and the command line) is trusted like a script. It may use
``${other.key}`` and OmegaConf's built-in resolvers (``oc.env``, ``oc.select``, ``oc.decode`` ...);
mtl registers none of its own. ``to_yaml`` resolves them, so the printed and saved config (and every
checkpoint's) holds plain values. Files that are data, not config (a checkpoint's ``config.yaml``),
are never read through OmegaConf (``mtl.config.resume``).

Checks that need more than the schema (known names, ranges, combinations of options) live in
``mtl.config.checks`` so that this module stays free of imports from the rest of the package.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import os
import re
import sys
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from mtl.errors import ConfigError
from mtl.registry import PLUGIN_KEYS


@dataclass
class NoOptions:
    """The ``Options`` of a task or weighting method that has none."""


@dataclass
class SyntheticConfig:
    """The built-in data set: procedurally drawn shapes, generated from the seed (no download)."""

    train_size: int = 4000
    val_size: int = 500
    num_classes: int = 4  # shape kinds; the classification label
    max_count: int = 3  # 1..max_count shapes per image; the caption says how many
    noise: float = 0.05  # std of the Gaussian pixel noise (difficulty)
    clutter: int = 0  # number of small distractor blobs per image (difficulty)
    train_seed_offset: int = 0  # train split is drawn from seed + this
    val_seed_offset: int = 1_000_003  # val split is drawn from seed + this (a different stream)
    # a held-out test split, evaluated beside val and logged as test_<metric> (nothing selects on it); 0: none
    test_size: int = 0
    test_seed_offset: int = 2_000_003  # test split is drawn from seed + this


@dataclass
class AugmentConfig:
    """Training augmentation of manifest/ImageFolder images; off by default so runs are reproducible."""

    random_resized_crop: bool = False  # crop a random part (area fraction `scale`, aspect `ratio`), resize to image_size
    scale: list[float] = field(default_factory=lambda: [0.35, 1.0])
    ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333])
    hflip: bool = False  # mirror half of the images (not for captions that say left/right)


@dataclass
class TaskDataConfig:
    """One task's own data set in multi-input mode (``data.per_task.<task>``; docs/multi-input.md)."""

    source: str = "synthetic"  # synthetic | manifest | imagefolder
    batch_size: int = 8  # PER PROCESS, in a step that holds this task (sampling.policy=mixed: data.batch_size)
    ratio: float = 1.0  # sampling.policy=weighted with sampling.weights=set: this task's share of the steps
    train_size: int = 512  # synthetic: this task's own images (a stream of its own: no image is another task's)
    val_size: int = 128  # synthetic
    train_path: str | None = None  # manifest .jsonl, or an ImageFolder root
    val_path: str | None = None
    image_root: str | None = None  # base for relative image paths; default: the manifest's folder
    on_error: str = "raise"  # raise | skip


@dataclass
class SamplingConfig:
    """Which tasks a step holds in multi-input mode (every rank derives the same choice from seed and step)."""

    policy: str = "all"  # all | round_robin | weighted | temperature | mixed
    weights: str = "set"  # weighted: set (per_task.<task>.ratio) | size (proportional to each task's train set)
    temperature: float = 2.0  # temperature: p_t proportional to size_t ** (1 / temperature)


@dataclass
class QM9Config:
    """``data.source: qm9``: QM9's molecules as graphs, split as the papers split them (docs/qm9.md)."""

    root: str | None = None  # PyG's processed QM9 folder (holding processed/data_v3.pt); null: build from qm9pack
    cache_dir: str | None = None  # where the graphs built from qm9pack are cached; null: $XDG_CACHE_HOME/mtl/qm9
    molecules: int = 0  # read only QM9's first N molecules (the smallest ones): tests and quick tries; 0: all
    test_size: int = 10000  # the first molecules of the seeded shuffle are the test split
    val_size: int = 10000  # the next ones the validation split
    train_size: int = 0  # the rest is the training split; N > 0: only its first N molecules (a smaller run)
    split_seed: int | None = None  # the shuffle's seed; null: the run's seed
    graph: str = "complete"  # complete (every atom pair, the distance as a 5th edge feature: the papers') | bond


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | manifest | imagefolder | qm9
    batch_size: int = 32  # PER PROCESS: the global batch is batch_size * world_size
    eval_batch_size: int = 64
    num_workers: int = 0
    image_size: Any = 64  # pixels (square), or auto: the model folder's preprocessor_config.json size (hf_vision)
    on_error: str = "raise"  # raise | skip
    normalize: str = "auto"  # auto (the pretrained weights' mean/std; none without weights) | imagenet | none
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    qm9: QM9Config = field(default_factory=QM9Config)
    # user data (source: manifest | imagefolder)
    train_path: str | None = None  # manifest .jsonl, or an ImageFolder root
    val_path: str | None = None
    test_path: str | None = None  # optional held-out test split, evaluated beside val and logged as test_<metric>
    image_root: str | None = None  # base for relative image paths; default: the manifest's folder
    num_classes: int | None = None  # user data: number of classes (default: inferred from train labels)
    # multi-input: each task its own data set (task name -> its section); empty: every image serves every task
    # (each section's keys: TaskDataConfig, checked by mtl.config.checks like a task's options)
    per_task: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # training items held out for a bilevel method's meta-objective (weighting.method=autolambda ...): the LAST
    # heldout items of the training set, never trained on, drawn data.batch_size per process per meta update
    # (mtl/data/heldout.py); 0: none (every other method)
    heldout: int = 0


@dataclass
class TokenizerConfig:
    path: str | None = None  # a local tokenizer directory; null: train one from the training captions
    vocab_size: int = 512  # when training one


@dataclass
class BackboneConfig:
    name: str = "resnet18"  # any torchvision classification model of a supported family
    weights: str | None = None  # null | a torchvision weights name (e.g. IMAGENET1K_V1) | a local file
    norm: str = "batch"  # batch | group | frozen | sync  (group/frozen/sync are rank-independent)
    stages: int = 4  # ResNet/ConvNeXt: keep this many stages (fewer: smaller, higher-resolution map)
    # hf_vision: a local transformers vision-model folder; timm: a local safetensors file or model folder
    pretrained: str | None = None
    config: str | None = None  # hf_vision: random weights of the shape of this folder's config.json
    freeze_blocks: int = 0  # freeze the first N of the backbone's blocks (and what runs before them)
    options: dict[str, Any] = field(default_factory=dict)  # the backbone's own options (its Options dataclass)


@dataclass
class DecoderConfig:
    pretrained: str | None = None  # a local GPT-2 directory (config + weights); null: build from the sizes below
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    dropout: float = 0.1
    max_positions: int = 32


@dataclass
class ArchitectureConfig:
    name: str = "hps"  # how the features reach the heads: a file in mtl/architectures/ (hps, mmoe, cgc, ple, dselect_k, mtan, cross_stitch)
    options: dict[str, Any] = field(default_factory=dict)  # the architecture's own options (its Options dataclass)


@dataclass
class ModelConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    activation_checkpointing: bool = False  # recompute each backbone and decoder block in the backward pass
    compile: bool = False  # torch.compile each backbone and decoder block (regional compilation)


@dataclass
class DDPConfig:
    strategy: str = "feature_leaf"  # see docs/strategies.md
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    find_unused_parameters: bool | None = None  # null: what the strategy needs; set it only to override
    static_graph: bool = False
    bucket_cap_mb: int = 25
    timeout_s: int = 600  # collective timeout: a failed rank makes the others exit within this
    detach_owner: str = "cls"  # detach strategy: the task whose loss trains the backbone
    unsafe: bool = False  # allow flag combinations known to fail (to reproduce the failures); never in real runs
    replica_check_every: int = 100  # all-reduce a parameter checksum every N steps; 0: off
    nan_monitor: bool = False  # on a non-finite step, name the task and the first non-finite parameter


@dataclass
class ParallelConfig:
    engine: str = "ddp"  # ddp (DistributedDataParallel) | fsdp2 (fully_shard: sharded parameters, see docs/fsdp.md)


@dataclass
class WeightingConfig:
    method: str = "equal"
    weights: dict[str, float] = field(default_factory=dict)  # static: task name -> weight
    options: dict[str, Any] = field(default_factory=dict)  # the method's own options (its Options dataclass)
    source: str = "parameters"  # gradient-level methods: parameters (task_grads) | features (feature_leaf; a surrogate)


@dataclass
class PlateauConfig:
    """``optim.scheduler: plateau``: ReduceLROnPlateau on the validation Δm % against ``baselines`` (mtl/plateau.py)."""

    factor: float = 0.7  # the rate is multiplied by this when Δm has not improved for ``patience`` evaluations
    patience: int = 5
    min_lr: float = 1.0e-5
    # metric key (<task>_<metric>) -> its single-task value, for every metric of the run's tasks (e.g. QM9's
    # published single-task MAEs, configs/qm9.yaml)
    baselines: dict[str, float] = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd (momentum 0.9; the parity tests use it, see docs/strategies.md)
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # cosine | linear | constant (all with linear warmup, from transformers) | plateau (on the validation Δm: plateau)
    scheduler: str = "cosine"
    warmup_steps: int = 100
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    layer_decay: float = 1.0  # layer-wise lr decay (BEiT, MAE): a backbone block d blocks from the top gets lr * decay**d
    plateau: PlateauConfig = field(default_factory=PlateauConfig)


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    log_every: int = 10
    eval_every: int = 250  # and always at the end
    eval_max_batches: int = 0  # 0: the whole val split
    num_samples: int = 4  # greedy sample captions shown at each eval
    max_bad_steps: int = 5  # stop after this many consecutive non-finite steps
    poison: str | None = None  # testing: "STEP:TASK:RANK" makes TASK's loss NaN at STEP on RANK (RANK * = all)
    progress: bool = True  # rank 0's progress: a bar with ETA on a terminal; else (a log, a pipe) a line every log_every steps


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # and always at the end; 0: only at the end
    keep_last: int = 0  # 0: keep all


@dataclass
class Config:
    output_dir: str = "runs/default"
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda
    resume: str | None = None  # null | auto | a checkpoint directory
    # resume even where the resumed run cannot equal the interrupted one (another global batch; dropout with another
    # world size): the message that refuses such a resume says why (docs/reliability.md)
    resume_reshard: bool = False
    init_from: str | None = None  # warm start: a NEW run (step 0, fresh optimizer) from a checkpoint/export's weights
    # init_from: the heads of the tasks that read class labels start fresh, instead of carrying their rows over by
    # class name (class_names.json); needed when the two runs' classes have none in common
    init_from_fresh_class_head: bool = False
    overwrite: bool = False  # start over: delete output_dir's earlier checkpoints, tokenizer and logs first
    tasks: list[str] = field(default_factory=lambda: ["cls", "gen"])
    task_options: dict[str, Any] = field(default_factory=dict)  # task name -> that task's options (its Options)
    # task name -> {type: <a task type's kind>, <its arguments>}: named tasks made from one task type (e.g. QM9's
    # U0: {type: regression, field: y, column: 12}); ``tasks`` may list them (mtl/tasks/__init__.py)
    task_instances: dict[str, Any] = field(default_factory=dict)
    # more task files: dotted module names or .py paths (in a config file: from its folder; on the command line: from
    # the working directory)
    task_modules: list[str] = field(default_factory=list)
    weighting_modules: list[str] = field(default_factory=list)  # more weighting-method files (as task_modules)
    backbone_modules: list[str] = field(default_factory=list)  # more backbone files (as task_modules)
    architecture_modules: list[str] = field(default_factory=list)  # more architecture files (as task_modules)
    # task name -> factor on its training loss, before any weighting (1 when not given): a benchmark regime with
    # losses on different scales (docs/benchmark.md). Evaluation metrics are unchanged.
    loss_scale: dict[str, float] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    weighting: WeightingConfig = field(default_factory=WeightingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # the benchmark's section (python -m mtl.tools.bench declares and checks its keys: mtl/tools/bench/options.py);
    # train.py ignores it. Merged like task_options: a later file or the command line changes only the keys it names
    bench: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# loading

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


# ------------------------------------------------------------------ reading YAML: a user's config, and a saved one

USER_YAML_VALUES = 100_000  # a user's config: at most this many values (mappings, lists, scalars) once aliases expand
SAVED_YAML_FIX = "mtl writes config.yaml without anchors, aliases or repeated keys: it was edited after it was written"


class YamlRefusal(yaml.YAMLError):
    """YAML that parses but is refused: ``what`` is wrong, at 1-based ``line`` (None: the whole document)."""

    def __init__(self, line: int | None, what: str, first: int | None = None):
        where = f"lines {first} and {line}: " if first else f"line {line}: " if line else ""
        super().__init__(where + what)
        self.line, self.what = line, what


class _SavedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses every anchor and alias (at the event, before any node is built)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise YamlRefusal(event.start_mark.line + 1, f"an alias (*{event.anchor})")
        if getattr(event, "anchor", None) is not None:
            raise YamlRefusal(event.start_mark.line + 1, f"an anchor (&{event.anchor})")
        return super().compose_node(parent, index)


def load_user_yaml(stream):
    """A user's YAML (a config file or a command-line value) as plain data. Anchors and aliases are allowed, up to
    ``USER_YAML_VALUES`` values once expanded (counted on the node graph, never expanded); a key repeated in one
    mapping is refused (YAML would keep the last one silently). Raises YamlRefusal or yaml.YAMLError."""
    return _load(stream, yaml.SafeLoader, USER_YAML_VALUES)


def load_saved_yaml(stream):
    """A config.yaml mtl wrote (a checkpoint's or an export's) as plain data: an anchor, an alias or a repeated key is
    refused (YamlRefusal naming its line; mtl writes none), so nothing can make a reader expand it."""
    return _load(stream, _SavedLoader, None)


def _load(stream, loader_class, cap: int | None):
    loader = loader_class(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if cap is not None and _expanded_size(node, cap, {}, set()) > cap:
            raise YamlRefusal(None, f"it expands to more than {cap:,} values once its aliases (*name) are expanded "
                                    "(an alias repeats its anchor's whole value); write the values out, or use fewer "
                                    "aliases")
        _refuse_repeated_keys(node, set())
        return loader.construct_document(node)
    except RecursionError:
        raise YamlRefusal(None, "it is nested deeper than a config can be") from None
    finally:
        loader.dispose()


def _expanded_size(node, cap: int, sizes: dict, open_nodes: set) -> int:
    """The number of values ``node`` stands for once every alias is expanded, saturating at ``cap + 1``: each node of
    the graph is counted once (``sizes``), so a bomb costs its lines, not its expansion. A node inside itself (an
    alias within its own anchor) is infinite."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        return cap + 1
    open_nodes.add(id(node))
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total = min(cap + 1, total + _expanded_size(child, cap, sizes, open_nodes))
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def _refuse_repeated_keys(node, seen: set) -> None:
    """YamlRefusal for the first key that a mapping holds twice (a merge key ``<<`` is not a key: what it merges in
    may be overridden). ``seen``: the nodes already checked (an alias's node is checked once)."""
    if id(node) in seen or isinstance(node, yaml.ScalarNode):
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            _refuse_repeated_keys(child, seen)
        return
    lines: dict = {}
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            name, line = (key.tag, key.value), key.start_mark.line + 1
            if name in lines:
                raise YamlRefusal(line, f"key {key.value!r} appears twice in one mapping (YAML would silently keep "
                                        "the last); keep one", first=lines[name])
            lines[name] = line
        _refuse_repeated_keys(key, seen)
        _refuse_repeated_keys(value, seen)


def read_config_chain(path: str, seen: tuple = (), named_by: str | None = None) -> list[tuple[dict, str]]:
    """Return [(mapping, source)] for ``path`` and its ``base:`` chain, base first.

    ``named_by`` is the config file whose ``base:`` names ``path`` (None for the --config file).
    """
    if not os.path.isfile(path):
        if named_by is None:
            raise ConfigError(f"config file {path!r} does not exist (pass an existing file with --config)")
        raise ConfigError(
            f"config file {named_by!r}: its base file was not found at {path!r} ('base:' paths are relative to "
            f"the file that names them, here the folder {os.path.dirname(os.path.abspath(named_by))!r}) "
            "— copy the base file there too, or make 'base:' an absolute path or a path relative to that folder")
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"config file {path!r}: 'base:' files form a cycle")
    try:
        with open(path, encoding="utf-8") as f:
            data = load_user_yaml(f)
    except YamlRefusal as e:
        raise ConfigError(f"config file {path!r}: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys, not a {type(data).__name__}")
    plugin_paths_from_file(data, path)
    chain = []
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file name")
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        chain += read_config_chain(base_path, seen + (real,), named_by=path)
    chain.append((data, path))
    return chain


def plugin_paths_from_file(data: dict, path: str) -> None:
    """A relative ``.py`` path in a config file's ``task_modules``, ``backbone_modules`` or ``weighting_modules`` is
    read from that file's folder, as ``base:`` is (on the command line, from the working directory): made absolute
    here, in place, where the file is known. A path that exists only from the working directory is refused with
    the path to write instead."""
    folder = os.path.dirname(os.path.abspath(path))
    for key in PLUGIN_KEYS:
        specs = data.get(key)
        if not isinstance(specs, list):
            continue
        resolved = []
        for spec in specs:
            if isinstance(spec, str) and spec.endswith(".py") and not os.path.isabs(spec) and "${" not in spec:
                full = os.path.normpath(os.path.join(folder, spec))
                if not os.path.exists(full) and os.path.isfile(spec):
                    raise ConfigError(f"config file {path!r}: {key}: {spec!r} is read from this file's folder "
                                      f"{folder!r}, where it does not exist (it exists from the working directory): "
                                      f"write {os.path.relpath(os.path.abspath(spec), folder)!r}, or an absolute path")
                spec = full
            resolved.append(spec)
        data[key] = resolved


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


def _schema_node(schema_type, path: list[str]):
    """The dataclass type at ``path`` in the schema, or None if that path is a plain value."""
    return _schema_node_at(schema_type, tuple(path))


@functools.cache  # the schema's types do not change in a process: looked up once (a config load asks ~80 times)
def _schema_node_at(schema_type, path: tuple[str, ...]):
    t = schema_type
    for p in path:
        if not is_dataclass(t):
            return None
        f = {f.name: f for f in fields(t)}.get(p)
        if f is None:
            return None
        t = f.type if not isinstance(f.type, str) else _resolve(t, f.name)
    return t if is_dataclass(t) else None


@functools.cache
def _resolve(owner, name):
    # dataclass field types are strings under ``from __future__ import annotations``
    return typing.get_type_hints(owner)[name]


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


def _known_keys(path: list[str]) -> list[str]:
    node = _schema_node(Config, path) if path else Config
    return [f.name for f in fields(node)] if node is not None else []


def config_keys(schema=Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Every leaf key of the schema as (dotted name, type, default, comment), in schema order."""
    hints = typing.get_type_hints(schema)
    comments = _comments(schema)
    out = []
    for f in fields(schema):
        t = hints[f.name]
        if is_dataclass(t):
            out += config_keys(t, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append((prefix + f.name, _type_name(t), default, comments.get(f.name, "")))
    return out


def _comments(schema) -> dict[str, str]:
    """The documentation of each field in the schema's source: the ``# comment`` after it, else the comment lines
    right above it (joined)."""
    try:
        source = inspect.getsource(schema)
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in source.splitlines():
        if re.match(r"\s+#", line):
            above.append(line.strip().lstrip("#").strip())
            continue
        field_line = re.match(r"\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
        if field_line and (field_line.group(2) or above):
            out[field_line.group(1)] = (field_line.group(2) or " ".join(above)).strip()
        above = []
    return out


def _type_name(t) -> str:
    text = getattr(t, "__name__", None) if not typing.get_args(t) else None
    return text or str(t).replace("typing.", "").replace("NoneType", "None")


def suggest_key(dotted: str) -> str:
    """`` — did you mean 'x.y'?`` for a mistyped key: the nearest valid key beside it, or anywhere."""
    parent, _, leaf = dotted.rpartition(".")
    siblings = _known_keys(parent.split(".") if parent else [])
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f" — did you mean {(parent + '.' if parent else '') + close[0]!r}?"
    every = [k for k, *_ in config_keys()]
    sections = sorted({k.rsplit(".", 1)[0] for k in every if "." in k})
    same_leaf = [k for k in every + sections if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(dotted, every, n=1, cutoff=0.75)
    return f" — did you mean {close[0]!r}?" if close else ""


def keys_help() -> str:
    """The config keys with their types and defaults (for ``train.py --help``)."""
    rows = [(k, f"{t} = {_show(d)}", c) for k, t, d, c in config_keys()]
    width = max(len(k) for k, _, _ in rows)
    tw = max(len(t) for _, t, _ in rows if len(t) < 40)
    lines = [f"  {k:<{width}}  {t:<{tw}}" + (f"  # {c}" if c else "") for k, t, c in rows]
    return ("config keys (in the YAML file, or key=value on the command line; the schema is mtl/config/schema.py):\n"
            + "\n".join(line.rstrip() for line in lines))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=1_000).strip().removesuffix("\n...")


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

    Raises ConfigError listing every problem. ``mtl.config.checks.load_run_config`` adds the semantic checks.
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
    ``mtl.config.resume.saved_config`` reads it (mtl writes it resolved and whole). Nothing in it is resolved or read: a
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


def check_options(values, schema: type, key: str, errors: list[str]) -> dict:
    """A section whose keys a class declares (a task's or a weighting method's ``Options`` dataclass).

    ``values`` (a mapping from the YAML) is checked against ``schema`` like the rest of the config: each
    unknown name (with the nearest valid one) and each wrong type is appended to ``errors``, naming
    ``key.<name>``. Returns every option, the schema's defaults filled in, as a plain dict.
    """
    node = OmegaConf.structured(schema)
    OmegaConf.set_struct(node, True)
    if values is not None and not isinstance(values, (dict, DictConfig)):
        errors.append(f"{key}: needs a mapping of option names to values (got {values!r})")
        return OmegaConf.to_container(node)
    known = [f.name for f in fields(schema)]
    for name, value in (values or {}).items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
            hint = f" — did you mean {key + '.' + close[0]!r}?" if close else ""
            errors.append(f"{key}: unknown option {name!r}{hint} (known options: {', '.join(known) or 'none'})")
            continue
        try:
            OmegaConf.update(node, str(name), value, merge=False, force_add=False)
        except OmegaConfBaseException as e:
            errors.append(f"{key}.{name}: bad value {value!r}: {str(e).splitlines()[0]}")
    return OmegaConf.to_container(node, resolve=True)


def task_data(cfg, task: str) -> TaskDataConfig:
    """``data.per_task.<task>`` with its defaults filled in (checked: mtl.config.checks refuses bad sections)."""
    return options_of(TaskDataConfig, (cfg.data.get("per_task") or {}).get(task), f"data.per_task.{task}")


def multi_input(cfg) -> bool:
    """Multi-input mode: each task has its own data set (``data.per_task`` names the tasks)."""
    return bool(cfg.data.get("per_task"))


def options_of(schema: type, values, key: str):
    """An instance of the ``Options`` dataclass ``schema`` from ``values``; ConfigError names any bad key."""
    errors: list[str] = []
    filled = check_options(values, schema, key, errors)
    if errors:
        raise ConfigError(errors)
    return schema(**filled)


# A key the run does not read (``mtl.config.reads``) is marked on its node of the checked config with this flag: the
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


def _flat(node, prefix: str = "", empty: bool = False) -> dict[str, Any]:
    """{dotted key: value} of a plain nested mapping; ``empty``: an empty mapping is a value too (``x: {}``)."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and (v or not empty):
            out.update(_flat(v, f"{prefix}{k}.", empty))
        else:
            out[prefix + str(k)] = v
    return out


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
    if left:  # set in a config file before a later setting made them unread (mtl/config/reads.py)
        lines.append(f"  not read by this run, left out: {' '.join(left)}")
    return "\n".join(lines)
