"""Which config keys a run reads, as rules on plain data (docs/config.md): ``READS``, next to the schema, declares every
key that some runs do not read and the condition under which it is read; ``not_read`` and ``unread_errors`` judge a
config against a ``RunShape`` (its sources, mode, scheduler, optimizer, tasks and the keys its plug-ins declare in
their ``reads``). The shape of a run is read from its plug-ins by ``mtl.setup.reads.run_shape``, above them; the rule,
the exceptions and the tools' use of it are told there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import OmegaConf

IMAGE_FILES = ("manifest", "imagefolder")


@dataclass(frozen=True)
class RunShape:
    """What decides which keys a run reads."""

    multi_input: bool  # data.per_task names the tasks: each its own data set
    source: str  # data.source (one data set)
    task_sources: dict  # multi-input mode: task -> data.per_task.<task>.source
    policy: str  # data.sampling.policy
    sampling_weights: str  # data.sampling.weights
    scheduler: str
    optimizer: str
    tasks: tuple[str, ...]
    heldout: bool | None  # the method reads a held-out batch (None: the method is unknown)
    # plug-in family -> (its name in the config, the keys it declares in ``reads``), or None where it is unknown
    plugins: dict
    tool: str = "train"  # train | evaluate
    init_from: bool = False  # a warm start (init_from is set)
    engine: str = "ddp"  # parallel.engine
    best_metric: bool = False  # checkpoint.best_metric is set (a best checkpoint is kept)
    early_stopping: bool = False  # trainer.early_stopping.metric is set
    trackers: tuple[str, ...] = ()  # logging.trackers
    peft: bool = False  # model.peft.method is set (LoRA adapters)

    @property
    def sources(self) -> set[str]:
        """Every data source the run reads."""
        return set(self.task_sources.values()) if self.multi_input else {self.source}


# A rule's condition: (shape, the task's name for a "*" key or None, the rule's key) -> None when the key is read,
# else (why, fix): what makes it unread and what to do ("{key}" in the fix is the key's name).
When = Callable[[RunShape, "str | None", str], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Reads:
    keys: tuple[str, ...]  # dotted keys; "*" a task's name (in task_options, data.per_task ...); "x." a section
    when: When
    by: tuple[str, ...]  # the keys whose values decide (the order of precedence compares them with the key's)
    training_only: bool = False  # read by training, not by evaluation (python -m mtl.tools.evaluate)
    off: tuple = ()  # values that ask for nothing: a key set to one is left out where unread, but not an error


MULTI = ("multi-input mode (data.per_task) gives each task its own data set and reads data.per_task.<task> instead",
         "give each task's data in data.per_task.<task>, or remove {key}")


def one_set(*sources: str) -> When:
    """Read with one data set (no data.per_task) from one of ``sources``."""
    def when(s, t, key=None):
        if s.multi_input:
            return MULTI
        if s.source not in sources:
            return (f"data.source is {s.source}", f"set data.source={' or '.join(sources)}, or remove {{key}}")
        return None
    return when


def any_set(*sources: str) -> When:
    """Read when the data set, or one task's in multi-input mode, comes from one of ``sources``."""
    def when(s, t, key=None):
        if s.sources & set(sources):
            return None
        now = (f"data.per_task's sources are {', '.join(sorted(s.sources))}" if s.multi_input
               else f"data.source is {s.source}")
        return now, f"set data.source={' or '.join(sources)} (or a task's data.per_task.<task>.source), or remove {{key}}"
    return when


def images(s, t, key=None):
    if s.sources == {"qm9"}:
        return "data.source is qm9 (molecule graphs, no images)", "remove {key}"
    return None


def task_source(*sources: str) -> When:
    """``data.per_task.<task>.*``: read when that task's source is one of ``sources``."""
    def when(s, t, key=None):
        have = s.task_sources.get(t)
        if have is None or have in sources:
            return None
        return (f"data.per_task.{t}.source is {have}",
                f"set data.per_task.{t}.source={' or '.join(sources)}, or remove {{key}}")
    return when


def batch_size(s, t, key=None):
    if s.multi_input and s.policy != "mixed":
        return (f"multi-input mode with data.sampling.policy={s.policy} reads each task's "
                "data.per_task.<task>.batch_size", "set data.per_task.<task>.batch_size, or remove {key}")
    return None


def task_batch_size(s, t, key=None):
    if s.policy == "mixed":
        return ("data.sampling.policy=mixed draws data.batch_size rows over every task",
                "set data.batch_size, or remove {key}")
    return None


def sampling(s, t, key=None):
    return None if s.multi_input else (
        "one data set for every task (no data.per_task): multi-input sampling does not apply",
        "give each task its own data set in data.per_task.<task>, or remove {key}")


def policy_is(*policies: str, weights: str | None = None) -> When:
    """Read in multi-input mode under one of ``policies`` (and with ``data.sampling.weights=weights``, if given)."""
    def when(s, t, key=None):
        if s.multi_input and s.policy in policies and weights in (None, s.sampling_weights):
            return None
        want = f"data.sampling.policy={' or '.join(policies)}" + (
            f" with data.sampling.weights={weights}" if weights else "")
        have = (f"data.sampling.policy is {s.policy}" + (f", data.sampling.weights {s.sampling_weights}" if weights else "")
                if s.multi_input else "one data set for every task (no data.per_task)")
        return f"only {want} reads it, and {have}", f"set {want}, or remove {{key}}"
    return when


def in_tasks(s, t, key=None):
    if t in s.tasks:
        return None
    return f"{t!r} is not one of the run's tasks ({', '.join(s.tasks)})", f"add {t} to tasks, or remove {{key}}"


def heldout(s, t, key=None):
    if s.heldout is False:
        return (f"weighting.method={s.plugins['method'][0]} reads no held-out batch",
                "use a bilevel method (e.g. weighting.method=autolambda), or remove {key}")
    return None


def warm_start(s, t, key=None):
    if s.init_from:
        return None
    return ("init_from is not set: a run that starts fresh has no earlier head to keep",
            "set init_from=<model folder>, or remove {key}")


def watching(flag: str, key: str) -> When:
    """Read when ``key`` (the metric a best checkpoint or early stopping watches) is set: ``flag``, RunShape's."""
    def when(s, t, k=None):
        return None if getattr(s, flag) else (f"{key} is null", f"set {key}=<metric>, or remove {{key}}")
    return when


def tracker_listed(name: str) -> When:
    """Read when ``logging.trackers`` lists ``name``."""
    def when(s, t, k=None):
        return None if name in s.trackers else (f"logging.trackers does not list {name}",
                                                f"add {name} to logging.trackers, or remove {{key}}")
    return when


def peft_on(s, t, key=None):
    """Read when model.peft.method is set."""
    return None if s.peft else ("model.peft.method is null (no adapters)", "set model.peft.method=lora, or remove {key}")


def choice_is(field: str, key: str, name: str) -> When:
    """Read when the choice ``key`` (RunShape's ``field``) is ``name``."""
    def when(s, t, k=None):
        now = getattr(s, field)
        return None if now == name else (f"{key} is {now}", f"set {key}={name}, or remove {{key}}")
    return when


def scheduler_is(name: str) -> When:
    return choice_is("scheduler", "optim.scheduler", name)


def optimizer_is(name: str) -> When:
    return choice_is("optimizer", "optim.name", name)


def engine_is(name: str) -> When:
    return choice_is("engine", "parallel.engine", name)


def declared(family: str, choose: str) -> When:
    """Read when the run's plug-in of ``family`` declares the key in its ``reads`` (a section: its prefix).
    ``choose``: the key that picks that plug-in."""
    def when(s, t, key=None):
        plugin = s.plugins.get(family)
        if plugin is None:  # unknown (its own error says so): not judged
            return None
        name, reads, others = plugin
        if any(_covers(r, key) for r in reads):
            return None
        readers = [n for n, r in others.items() if any(_covers(x, key) for x in r)]
        some = ", ".join(readers[:3]) + (" ..." if len(readers) > 3 else "")
        if family == "task":
            return (f"no task of this run ({', '.join(s.tasks)}) reads it",
                    f"add a task that does ({some}) to tasks, or remove {{key}}")
        fix = (f"set {choose}={readers[0]}" if len(readers) == 1 else f"set {choose} to one that does ({some})"
               if readers else f"no {family} reads it: remove {{key}}")
        return f"{choose}={name} does not read it", f"{fix}, or remove {{key}}" if readers else fix
    return when


def _covers(declared_key: str, key: str) -> bool:
    return key == declared_key or key.startswith(declared_key if declared_key.endswith(".") else declared_key + ".")


backbone = declared("backbone", "model.backbone.name")
task = declared("task", "tasks")
method = declared("method", "weighting.method")
strategy = declared("strategy", "ddp.strategy")
DATA = ("data.source", "data.per_task")

# Every key that some runs do not read, with when it is read. A key no rule names is read by every run.
READS: tuple[Reads, ...] = (
    Reads(("data.source",), lambda s, t, key=None: MULTI if s.multi_input else None, ("data.per_task",)),
    Reads(("data.val_path",), one_set(*IMAGE_FILES), DATA),
    Reads(("data.on_error",), one_set(*IMAGE_FILES, "hf", "webdataset", "hf_stream"), DATA),
    Reads(("data.train_path", "data.test_path"), one_set(*IMAGE_FILES), DATA, training_only=True),
    Reads(("data.num_classes",), one_set(*IMAGE_FILES, "hf"), DATA, training_only=True),
    Reads(("data.hf.",), one_set("hf"), DATA),  # mtl/data/hf_source.py
    Reads(("data.webdataset.",), one_set("webdataset"), DATA),  # mtl/data/streamed.py
    Reads(("data.hf_stream.",), one_set("hf_stream"), DATA),  # mtl/data/parquet_stream.py
    Reads(("data.image_root",), one_set("manifest"), DATA),
    Reads(("data.synthetic.val_size", "data.synthetic.val_seed_offset"), one_set("synthetic"), DATA),
    Reads(("data.synthetic.train_size", "data.synthetic.train_seed_offset", "data.synthetic.test_size",
           "data.synthetic.test_seed_offset"), one_set("synthetic"), DATA, training_only=True),
    Reads(("data.synthetic.num_classes", "data.synthetic.max_count", "data.synthetic.noise", "data.synthetic.clutter"),
          any_set("synthetic"), DATA),
    Reads(("data.qm9.root", "data.qm9.cache_dir", "data.qm9.molecules", "data.qm9.test_size", "data.qm9.val_size",
           "data.qm9.split_seed", "data.qm9.graph"), one_set("qm9"), DATA),
    Reads(("data.qm9.train_size",), one_set("qm9"), DATA, training_only=True),
    Reads(("data.image_size", "data.normalize"), images, DATA),
    Reads(("data.augment.",), any_set(*IMAGE_FILES, "hf", "webdataset", "hf_stream"), DATA, training_only=True),
    Reads(("data.batch_size",), batch_size, ("data.per_task", "data.sampling.policy"), training_only=True),
    Reads(("data.sampling.policy",), sampling, ("data.per_task",), training_only=True),
    # mixed draws each row's task by the weights too (mtl/data/multi_input.py, SamplingPlan.from_config)
    Reads(("data.sampling.weights",), policy_is("weighted", "mixed"), ("data.per_task", "data.sampling.policy"),
          training_only=True),
    Reads(("data.sampling.temperature",), policy_is("temperature"), ("data.per_task", "data.sampling.policy"),
          training_only=True),
    Reads(("data.heldout",), heldout, ("weighting.method", "weighting_modules"), training_only=True),
    Reads(("data.per_task.*.val_size",), task_source("synthetic"), ("data.per_task.*.source",)),
    Reads(("data.per_task.*.train_size",), task_source("synthetic"), ("data.per_task.*.source",), training_only=True),
    Reads(("data.per_task.*.val_path",), task_source(*IMAGE_FILES), ("data.per_task.*.source",)),
    Reads(("data.per_task.*.on_error",), task_source(*IMAGE_FILES, "hf"), ("data.per_task.*.source",)),
    Reads(("data.per_task.*.hf",), task_source("hf"), ("data.per_task.*.source",)),
    Reads(("data.per_task.*.train_path",), task_source(*IMAGE_FILES), ("data.per_task.*.source",), training_only=True),
    Reads(("data.per_task.*.image_root",), task_source("manifest"), ("data.per_task.*.source",)),
    Reads(("data.per_task.*.batch_size",), task_batch_size, ("data.sampling.policy",), training_only=True),
    Reads(("data.per_task.*.ratio",), policy_is("weighted", "mixed", weights="set"),
          ("data.per_task", "data.sampling.policy", "data.sampling.weights"), training_only=True),
    Reads(("task_options.*", "task_instances.*", "loss_scale.*"), in_tasks, ("tasks",)),
    # read where a plug-in of the run declares them in its ``reads``
    Reads(("tokenizer.", "model.decoder."), task, ("tasks", "task_modules", "task_instances")),
    Reads(("model.backbone.weights", "model.backbone.norm", "model.backbone.stages", "model.backbone.pretrained",
           "model.backbone.config", "model.backbone.freeze_blocks"), backbone,
          ("model.backbone.name", "backbone_modules")),
    Reads(("weighting.weights",), method, ("weighting.method", "weighting_modules")),
    Reads(("weighting.heads",), method, ("weighting.method", "weighting_modules"), off=("unweighted",)),
    Reads(("ddp.detach_owner",), strategy, ("ddp.strategy",)),
    Reads(("ddp.bucket_cap_mb",), engine_is("ddp"), ("parallel.engine",), training_only=True),  # FSDP2: no reducer
    # sample captions at each evaluation (the caption task declares it); 0 asks for none
    Reads(("trainer.num_samples",), task, ("tasks", "task_modules", "task_instances"), off=(0,)),
    Reads(("optim.plateau.",), scheduler_is("plateau"), ("optim.scheduler",)),
    Reads(("model.peft.r", "model.peft.alpha", "model.peft.dropout", "model.peft.target_modules", "model.peft.per_task",
           "model.peft.shared"), peft_on, ("model.peft.method",), off=(False,)),
    Reads(("optim.betas",), optimizer_is("adamw"), ("optim.name",)),
    Reads(("init_from_fresh_class_head",), warm_start, ("init_from",), training_only=True),
    Reads(("logging.",), lambda s, t, key=None: None, (), training_only=True),  # the trackers: training only
    Reads(("logging.mlflow_dir",), tracker_listed("mlflow"), ("logging.trackers",), training_only=True),
    Reads(("checkpoint.best_mode",), watching("best_metric", "checkpoint.best_metric"), ("checkpoint.best_metric",),
          training_only=True),
    Reads(("trainer.early_stopping.patience", "trainer.early_stopping.min_delta", "trainer.early_stopping.mode"),
          watching("early_stopping", "trainer.early_stopping.metric"), ("trainer.early_stopping.metric",),
          training_only=True),
)


def _names(cfg, pattern: str) -> list[str]:
    """The concrete keys of ``pattern`` in ``cfg``: its "*" replaced by each name its section holds."""
    if "*" not in pattern:
        return [pattern]
    head, _, tail = pattern.partition(".*")
    node = cfg
    for part in head.split("."):
        node = node.get(part) if hasattr(node, "get") else None
    return [f"{head}.{name}{tail}" for name in (node or {})]


def not_read(cfg, shape: RunShape, setters: dict | None = None) -> list[tuple[str, str, str, Reads]]:
    """Every key (a section with its dot) the run does not read: ``(key, why, fix, rule)``. The "*" of a rule is each
    name its section holds in ``cfg`` and in ``setters`` (keys set, for the tasks a checked config dropped)."""
    out = []
    for rule in READS:
        for pattern in rule.keys:
            names = _names(cfg, pattern)
            if setters is not None and "*" in pattern:
                head = pattern.partition(".*")[0] + "."
                names += [head + k[len(head):].split(".")[0] + pattern.partition("*")[2]
                          for k in setters if k.startswith(head)]
            for key in dict.fromkeys(names):
                task_name = key[len(pattern.partition("*")[0]):].split(".")[0] if "*" in pattern else None
                if rule.training_only and shape.tool != "train":
                    out.append((key, f"python -m mtl.tools.{shape.tool} does not read it (only training does)",
                                "remove {key}", rule))
                    continue
                found = rule.when(shape, task_name, pattern)
                if found is not None:
                    out.append((key, found[0], found[1], rule))
    return out


def _position(setters: dict, key: str) -> int:
    """The latest position in the precedence order at which the user set ``key`` or a key inside it; -1: never."""
    base = key.rstrip(".")
    return max((p for k, (p, _) in setters.items() if k == base or k.startswith(base + ".")), default=-1)


def unread_errors(cfg, shape: RunShape, setters: dict, named: set | frozenset = frozenset(),
                  only: tuple[str, ...] | None = None) -> tuple[list[str], list[str]]:
    """``(errors, unread)``: an error for each group of keys the user set (``setters``: ``mtl.config.load.user_set``) that the
    run does not read, where a key was set as late as, or later than, the keys that decide it (one set earlier was
    made unread by a later choice: left out, and listed by the start-up summary). ``named``: keys another check
    already refused (not said twice); ``only``: the key prefixes a tool takes (others are not judged). ``unread``:
    every key the run does not read, for ``mtl.config.effective.mark_unread``."""
    order = {k: i for i, k in enumerate(setters)}
    errors: dict[tuple, list[str]] = {}
    unread = []
    for key, why, fix, rule in not_read(cfg, shape, setters):
        unread.append(key)
        base = key.rstrip(".")
        mine = [k for k in setters if (k == base or k.startswith(base + ".")) and (only is None or k.startswith(only))
                and not any(k == n or k.startswith(n + ".") for n in named)]
        by = [b.replace("*", key.split(".")[2]) if "*" in b else b for b in rule.by]
        decided = max((_position(setters, b) for b in by), default=-1)
        for k in mine:
            position, where = setters[k]
            if position >= decided and not (rule.off and OmegaConf.select(cfg, k) in rule.off):
                errors.setdefault((why, fix, where), []).append(k)
    lines = [f"{', '.join(sorted(keys, key=order.get))}: set ({where}) but not read: {why}. " + _fix(fix, keys)
             for (why, fix, where), keys in errors.items()]
    return lines, unread


def _fix(fix: str, keys: list[str]) -> str:
    text = fix.format(key=keys[0] if len(keys) == 1 else "them")
    return text[0].upper() + text[1:]
