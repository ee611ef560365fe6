"""The config's keys as plain data: the typed schema (dataclasses, their defaults, and each key's documentation in
the comment beside or above it), the lookups on it (a key's section, the nearest valid key to a typo), the help text
of ``train.py --help``, and the options a plug-in class declares (``check_options``, ``options_of``).

Nothing here reads a file or knows a plug-in: the checks that know the plug-ins live in ``mtl.setup.checks``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtl.errors import ConfigError


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
class HFConfig:
    """``data.source: hf``: a Hugging Face ``datasets`` data set, memory-mapped, read by row (docs/data.md)."""

    path: str | None = None  # a save_to_disk folder (a DatasetDict), or the folder of the files `builder` reads
    builder: str | None = None  # null: path is a save_to_disk folder | parquet | arrow | json | csv | imagefolder
    # the builder's files: a pattern, a list, or {split: pattern(s)}, relative to path; null: all of path's files
    data_files: Any = None
    train_split: str = "train"
    val_split: str = "validation"
    test_split: str | None = None  # a held-out test split, evaluated beside val (test_<metric>); null: none
    image_column: str = "image"  # an Image feature, or bytes of image files
    label_column: str | None = None  # an integer or ClassLabel column; null: "label" where the split has one
    caption_column: str | None = None  # a string or a list of strings per row; null: "caption" or "captions" if any
    verify: bool = True  # decode every image once before training (bad ones: data.on_error); false: trust the cells
    cache_dir: str | None = None  # where a builder writes its Arrow files; null: datasets' own (HF_DATASETS_CACHE)


@dataclass
class TaskDataConfig:
    """One task's own data set in multi-input mode (``data.per_task.<task>``; docs/multi-input.md)."""

    source: str = "synthetic"  # synthetic | manifest | imagefolder | hf
    batch_size: int = 8  # PER PROCESS, in a step that holds this task (sampling.policy=mixed: data.batch_size)
    ratio: float = 1.0  # sampling.policy=weighted with sampling.weights=set: this task's share of the steps
    train_size: int = 512  # synthetic: this task's own images (a stream of its own: no image is another task's)
    val_size: int = 128  # synthetic
    train_path: str | None = None  # manifest .jsonl, or an ImageFolder root
    val_path: str | None = None
    image_root: str | None = None  # base for relative image paths; default: the manifest's folder
    on_error: str = "raise"  # raise | skip
    hf: dict[str, Any] = field(default_factory=dict)  # source hf: this task's data set, the keys of data.hf


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
class WebDatasetConfig:
    """``data.source: webdataset``: tar shards streamed by every rank and loader worker (docs/data.md)."""

    train_shards: str | None = None  # brace pattern (train-{000000..000127}.tar), several joined by ::, or a .txt list
    val_shards: str | None = None  # the same for the validation split (streamed in order, every sample once)
    class_names: str | None = None  # JSON list (or .txt, a name a line); null: class_names.json beside train shards
    shuffle_buffer: int = 1000  # samples in each worker's seeded shuffle buffer (training)
    verify_images: bool = True  # decode every image once at start (data.on_error applies); false: only read labels


@dataclass
class HFStreamConfig:
    """``data.source: hf_stream``: Parquet files streamed through datasets' IterableDataset (docs/data.md)."""

    train_files: str | None = None  # a glob (data/train-*.parquet), several joined by ::, or a .txt list
    val_files: str | None = None  # the same for the validation split
    image_column: str = "image"  # an Image feature (or image bytes)
    label_column: str | None = "label"  # a ClassLabel (its names are the class names); null: none
    caption_column: str | None = "caption"  # a string, or a list of strings; null: none
    shuffle_buffer: int = 1000  # rows in each worker's seeded shuffle buffer (training)
    verify_images: bool = True  # decode every image once at start (data.on_error applies); false: only read labels


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | manifest | imagefolder | qm9 | hf | webdataset | hf_stream
    batch_size: int = 32  # PER PROCESS: the global batch is batch_size * world_size
    eval_batch_size: int = 64
    num_workers: int = 0
    image_size: Any = 64  # pixels (square), or auto: the model folder's preprocessor_config.json size (hf_vision)
    on_error: str = "raise"  # raise | skip
    # auto (the pretrained weights' mean/std: the model's own image processor or timm config; none without weights)
    # | imagenet | none | {mean: [r, g, b], std: [r, g, b]} (explicit statistics)
    normalize: Any = "auto"
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    qm9: QM9Config = field(default_factory=QM9Config)
    hf: HFConfig = field(default_factory=HFConfig)  # source: hf (a Hugging Face datasets data set)
    webdataset: WebDatasetConfig = field(default_factory=WebDatasetConfig)
    hf_stream: HFStreamConfig = field(default_factory=HFStreamConfig)
    # user data (source: manifest | imagefolder)
    train_path: str | None = None  # manifest .jsonl, or an ImageFolder root
    val_path: str | None = None
    test_path: str | None = None  # optional held-out test split, evaluated beside val and logged as test_<metric>
    image_root: str | None = None  # base for relative image paths; default: the manifest's folder
    num_classes: int | None = None  # user data: number of classes (default: inferred from train labels)
    # multi-input: each task its own data set (task name -> its section); empty: every image serves every task
    # (each section's keys: TaskDataConfig, checked by mtl.setup.checks like a task's options)
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
    # freeze the whole backbone (a linear probe: its final norm too, which freeze_blocks=all leaves training); the
    # heads and an architecture's own modules train
    freeze: bool = False
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
class PeftConfig:
    """Parameter-efficient fine-tuning through the peft library (extra `peft`; docs/pretrained.md#lora)."""

    method: str | None = None  # null: off (every weight trains) | lora: the base frozen, LoRA adapters trained
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # LoRA's scale numerator (the update is alpha / r * B A)
    dropout: float = 0.0  # dropout on the adapters' input
    # the layers adapted, by name or name tail (peft's rule); auto: the attention's query and value projections
    # (q_proj/v_proj, query/value, timm's qkv, GPT-2's c_attn); each adapted model must match one
    target_modules: Any = "auto"
    per_task: bool = False  # one adapter per task on the encoder, active only in its task's forward (K encoder forwards)
    shared: bool = False  # with per_task: a task-agnostic adapter beside them, active in every forward (MTLoRA)


@dataclass
class ArchitectureConfig:
    name: str = "hps"  # how the features reach the heads: a file in mtl/architectures/ (hps, mmoe, cgc, ple, dselect_k, mtan, cross_stitch)
    options: dict[str, Any] = field(default_factory=dict)  # the architecture's own options (its Options dataclass)


@dataclass
class ModelConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters on the encoder and a pretrained decoder
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
    # Gram methods (update w^T G): unweighted (head t gets its loss's gradient) | weighted (w_t times it, as a weighted
    # loss's backward gives: the Nash-MTL authors' code)
    heads: str = "unweighted"


@dataclass
class PlateauConfig:
    """``optim.scheduler: plateau``: ReduceLROnPlateau on the validation Δm % against ``baselines`` (mtl/optim/plateau.py)."""

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
class EarlyStoppingConfig:
    """``trainer.early_stopping``: stop the run at an evaluation, on every rank, once ``metric`` has not improved by
    more than ``min_delta`` for ``patience`` evaluations in a row (the counter survives a resume: mtl/run/best.py)."""

    metric: str | None = None  # an evaluation metric as the run logs it (cls_acc, gen_bleu4, ...); null: off
    patience: int = 5  # evaluations without an improvement before the run stops
    min_delta: float = 0.0  # an improvement is a change of more than this in the direction of `mode`
    mode: str = "max"  # max | min: whether a higher or a lower value of `metric` is better


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
    # stop at an evaluation once `metric` has not improved for `patience` evaluations (docs/reliability.md)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # and always at the end; 0: only at the end
    keep_last: int = 0  # 0: keep all
    # keep the checkpoint of the best evaluation by this metric (cls_acc, gen_bleu4, ...) as checkpoints/best/, which
    # pruning never removes (mtl/run/best.py); null: none
    best_metric: str | None = None
    best_mode: str = "max"  # max | min: whether a higher or a lower value of best_metric is better
    # model.peft runs: checkpoints hold the trained parameters (adapters, heads) alone, the frozen base named by its
    # folder and hash (model.backbone.pretrained, model.decoder.pretrained); resume, predict and export read that base
    trainable_only: bool = False


@dataclass
class LoggingConfig:
    """Where rank 0 logs a run's scalars, its resolved config and its sample captions (docs/config.md, Trackers)."""

    # any of tensorboard (output_dir/tb), wandb, mlflow (pip install -e '.[trackers]') and csv (output_dir/metrics.csv)
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    group: str | None = None  # wandb's run group and mlflow's experiment (a benchmark sweep sets its name); null: none
    # the folder of the local MLflow store (mlflow.db, mlartifacts/) where MLFLOW_TRACKING_URI is unset; null:
    # output_dir. A benchmark sweep sets its own folder, so all its runs are one experiment in one store
    mlflow_dir: str | None = None


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # trackers: TensorBoard, W&B, MLflow, CSV
    # the benchmark's section (python -m mtl.tools.bench declares and checks its keys: mtl/bench/options.py);
    # train.py ignores it. Merged like task_options: a later file or the command line changes only the keys it names
    bench: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ the schema's keys and their documentation

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
    return ("config keys (in the YAML file, or key=value on the command line; the schema is mtl/config/keys.py):\n"
            + "\n".join(line.rstrip() for line in lines))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=1_000).strip().removesuffix("\n...")


# ------------------------------------------------------------------ a plug-in's options; sections of a config

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
    """``data.per_task.<task>`` with its defaults filled in (checked: mtl.setup.checks refuses bad sections)."""
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


def _flat(node, prefix: str = "", empty: bool = False) -> dict[str, Any]:
    """{dotted key: value} of a plain nested mapping; ``empty``: an empty mapping is a value too (``x: {}``)."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and (v or not empty):
            out.update(_flat(v, f"{prefix}{k}.", empty))
        else:
            out[prefix + str(k)] = v
    return out
