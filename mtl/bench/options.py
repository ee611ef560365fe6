"""The benchmark's own configuration: the keys of a config's ``bench:`` section, declared and checked here.

The core schema keeps ``bench:`` as an opaque mapping that train.py ignores (``mtl.config.schema.Config.bench``;
merged like ``task_options``: a file built on another, or the command line, changes only the keys it names).
``bench_options`` reads it into ``BenchOptions`` with the checker the plug-ins' options use
(``mtl.config.schema.check_options``: each unknown key with the nearest valid one, each wrong type), so a typo in
``bench.*`` is one message naming the key, and ``python -m mtl.tools.bench`` exits 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from mtl.config.schema import check_options, config_keys
from mtl.errors import ConfigError


@dataclass
class SlurmOptions:
    """``bench.launcher: slurm``: each run one Slurm job through submitit (docs/benchmark.md, "On a Slurm cluster")."""

    partition: str | None = None  # null: the cluster's default partition
    time_min: int = 60  # the job's time limit, minutes
    gpus_per_run: int = 0  # GPUs of each run's job (one node)
    cpus_per_run: int = 0  # CPUs of each run's job; 0: bench.nproc x bench.threads (at least bench.nproc)
    mem_gb: int = 0  # memory of each run's job; 0: the partition's default
    cluster: str = "slurm"  # slurm | local (submitit's local executor: the tests, a check without a cluster)
    extra: dict[str, Any] = field(default_factory=dict)  # more sbatch parameters (submitit's slurm_additional_parameters)
    # the upper estimate of the longest run, hours: sizes submitit's cap on time-limit requeues (2 x the jobs it
    # needs at time_min, at least 3 more requeues than those); 0: not sized (submitit's 3, unless max_requeues)
    longest_run_h: float = 0.0
    max_requeues: int = 0  # submitit's max_num_timeout outright; 0: derived from longest_run_h
    # the longest a run's checkpoint takes to save, seconds: the warning signal comes at least 2 x (the job's
    # start-up, measured at launch, + this) before the limit (and never later than submitit's 90 s; 30 s local)
    save_s: float = 10.0


@dataclass
class ReferenceOptions:
    """``bench.reference``: single-task metrics from elsewhere (a paper's table), for a second Δm column."""

    source: str = ""  # where the values come from, printed with the column (e.g. "Nash-MTL, Table 3, STL")
    # task -> {metric: value}: the metrics each task declares (``TaskHead.metrics``, e.g. mu: {mae: 0.0671}); every
    # metric that enters Δm must have one. Empty: no second column
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class PublishedOptions:
    """``bench.published``: a paper's Δm % per method, read side by side with ours (Spearman's rank correlation)."""

    source: str = ""  # the paper and table (e.g. "Nash-MTL (Navon et al. 2022), Table 3, QM9")
    dm: dict[str, float] = field(default_factory=dict)  # the paper's method name -> its Δm % (lower is better)
    # the paper's method name -> the bench.methods entry it is (e.g. ls: equal); a name not given here is its own
    # entry; null: mtl has no such method (listed, not compared)
    methods: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpreadOptions:
    """One entry of ``bench.design.spreads``: the spread over seeds of each method's Δm as a paper reports it."""

    source: str = ""  # the paper and table (e.g. "Nash-MTL (Navon et al. 2022), Table 1, QM9")
    kind: str = "sd"  # what the paper's ± is: sd | sem (the standard error of the mean: sd = sem x sqrt(seeds))
    seeds: int = 0  # the paper's seeds per method (converts an sem to an sd)
    # the paper's method name (bench.published's names) -> its ± on Δm, in Δm points
    dm_pm: dict[str, float] = field(default_factory=dict)
    note: str = ""  # how kind was read where the paper does not say, printed with it


SPREAD_KINDS = ("sd", "sem")


@dataclass
class DesignOptions:
    """``bench.design``: the design's assumptions, printed by ``--plan`` (docs/benchmark.md, "A design with power")."""

    sd: float = 0.0  # the assumed spread (sd) of the per-seed Δm differences of a comparison; 0: not said
    sd_source: str = ""  # where that spread was measured
    # the degrees of freedom of that estimate (the pooled sd's): --plan prints its 95% upper bound (chi-square);
    # 0: not said, no bound
    sd_df: int = 0
    # the papers' spreads, [{source, kind, seeds, dm_pm, note}, ...]: --plan prints each comparison's power under them
    spreads: list[Any] = field(default_factory=list)
    power: float = 0.8  # the power the design is sized for, at Holm's strictest level alpha / m
    sizing: str = ""  # how bench.slurm.time_min was sized (printed with it)
    gpu_hours: str = ""  # the estimated GPU-hours of the sweep, with their source


@dataclass
class BenchOptions:
    """``python -m mtl.tools.bench``: which methods to compare, over which seeds, and how to read them."""

    # any registered method (weighting_modules too), as name or name(option=value, ...); ``source=features`` in the
    # parentheses runs a gradient-level method on the shared features' gradients (weighting.source)
    methods: list[str] = field(default_factory=lambda: ["equal", "uw", "dwa", "rlw", "gls", "famo", "pcgrad", "mgda",
                                                        "cagrad", "nashmtl", "imtlg", "alignedmtl", "upgrad",
                                                        "gradnorm"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    nproc: int = 1  # processes per run: 1 runs train.py, more run it under torchrun (python -m mtl.tools.launch)
    parallel: int = 1  # runs at once (each its own process or torchrun)
    threads: int = 0  # OMP_NUM_THREADS of each run's processes; 0: the CPU count / (parallel x nproc), at least 1
    baselines: bool = True  # also train the single-task runs that delta-m needs (one per task of the config)
    last_k: int = 3  # the convergence window: each metric's change over the last k evaluations (fitted line)
    # over the window, against the one-sided 95% t bounds over seeds of a metric's improvement: converged when the
    # upper bound is below this, improving when the lower bound is above it, undetermined otherwise (not converged)
    plateau_tol: float = 0.005
    # false: the change in the metric's own units; true: in % of the metric's single-task baseline (the scale Δm
    # reads it on), for metrics in units such as meV where one absolute tolerance cannot fit every task
    plateau_relative: bool = False
    alpha: float = 0.05  # family-wise level of the marks against equal: paired t-test, Holm across a table's methods
    test: str = "t"  # the paired test: t (the paired t-test) | signflip (the exact sign-flip permutation test)
    # the pre-registered comparisons, [[a, b], ...] (bench.methods entries: a - b on the same seed), marked with
    # Holm across these only; empty: none (the table's "vs equal" column, Holm across its methods, stays)
    comparisons: list[Any] = field(default_factory=list)
    design: DesignOptions = field(default_factory=DesignOptions)  # what --plan says the seeds can detect
    # the evaluation a run reports: best (the best validation delta-m, as Nash-MTL's protocol) | last; its metrics are
    # read on the test split (data.synthetic.test_size / data.test_path) when the runs have one
    select: str = "best"
    launcher: str = "local"  # local (processes on this machine) | slurm (a job per run through submitit: bench.slurm)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    loss_strategy: str = "feature_leaf"  # ddp.strategy for loss-level methods
    grad_strategy: str = "task_grads"  # ddp.strategy for gradient-level methods (weighting.source=parameters)
    feature_strategy: str = "feature_leaf"  # ddp.strategy for gradient-level methods with source=features
    # data.heldout of a bilevel method's runs (its meta-objective's items, which it does not train on); 0: a tenth
    # of data.synthetic.train_size, rounded up to whole global batches (user data: set it)
    heldout: int = 0
    # name -> {overrides: [key=value, ...], methods: [...] (default: methods), baselines_from: <regime> (reuse that
    # regime's single-task runs), expect: "what this regime should show, stated before the run"}; empty: one
    # regime, "natural", with no overrides
    regimes: dict[str, Any] = field(default_factory=dict)
    # the architecture axis: each regime again with each of these model.architecture.name values, as the regime
    # <regime>+<architecture> (its single-task baselines the regime's own); empty: the config's architecture only
    architectures: list[str] = field(default_factory=list)
    reference: ReferenceOptions = field(default_factory=ReferenceOptions)  # a second Δm, against given baselines
    published: PublishedOptions = field(default_factory=PublishedOptions)  # a paper's Δm, read beside ours
    protocol: str = ""  # the protocol in words (printed by --plan and above the tables); the config is what runs


SECTIONS = {"slurm": SlurmOptions, "reference": ReferenceOptions, "published": PublishedOptions,
            "design": DesignOptions}


def bench_option_errors(cfg) -> tuple[BenchOptions, list[str]]:
    """``(the config's bench section as BenchOptions, the problems of its keys and types)``; a bad value keeps its
    default. Each problem names ``bench.<key>`` (with the nearest valid key for a typo)."""
    raw = cfg.get("bench") if isinstance(cfg, (dict, DictConfig)) else None
    raw = OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else raw
    errors: list[str] = []
    if raw is not None and not isinstance(raw, dict):
        errors.append(f"bench: needs a mapping of the benchmark's keys (got {raw!r})")
        raw = {}
    raw = dict(raw or {})
    sections = {}
    for name, schema in SECTIONS.items():  # the nested sections: checked key by key, as the top level
        section = raw.pop(name, None)
        spreads = section.pop("spreads", []) if name == "design" and isinstance(section, dict) else []
        sections[name] = schema(**check_options(section, schema, f"bench.{name}", errors))
        if name == "design":
            sections[name].spreads = _spreads(spreads, errors)
    top = check_options(raw, BenchOptions, "bench", errors)
    top.update(sections)
    options = BenchOptions(**top)
    errors += _finite(options, "bench")
    return options, errors


def _spreads(values, errors: list[str]) -> list[SpreadOptions]:
    """``bench.design.spreads``: each entry's keys checked as a section's (an unknown key named, with the nearest),
    its kind one of ``SPREAD_KINDS``, an sem with the seeds that convert it, each ± a positive finite number."""
    if not isinstance(values, list):
        errors.append(f"bench.design.spreads: needs a list of {{source, kind, seeds, dm_pm, note}} (got {values!r})")
        return []
    out = []
    for i, value in enumerate(values):
        key = f"bench.design.spreads[{i}]"
        spread = SpreadOptions(**check_options(value, SpreadOptions, key, errors))
        if spread.kind not in SPREAD_KINDS:
            errors.append(f"{key}.kind: {spread.kind!r} must be one of {', '.join(SPREAD_KINDS)} (what the paper's ± is)")
        if spread.kind == "sem" and spread.seeds < 2:
            errors.append(f"{key}.seeds: {spread.seeds}: an sem needs the paper's seed count (>= 2) to become an sd")
        errors += [f"{key}.dm_pm.{k}: {v!r} must be a positive finite ± in Δm points" for k, v in spread.dm_pm.items()
                   if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)]
        out.append(spread)
    return out


def _finite(options, prefix: str) -> list[str]:
    """NaN and inf in a number of the section: refused (NaN passes every range check; YAML reads ``nan`` as a
    string, which only the typed check above makes a float)."""
    errors = []
    for f in fields(options):
        value = getattr(options, f.name)
        if is_dataclass(value):
            errors += _finite(value, f"{prefix}.{f.name}")
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{prefix}.{f.name}: must be finite (got {value})")
        elif isinstance(value, dict):
            errors += [f"{prefix}.{f.name}.{k}: must be finite (got {v})" for k, v in value.items()
                       if isinstance(v, float) and not math.isfinite(v)]
    return errors


def bench_options(cfg) -> BenchOptions:
    """The config's ``bench:`` section, checked (``bench_option_errors``); ConfigError lists every problem."""
    options, errors = bench_option_errors(cfg)
    if errors:
        raise ConfigError(errors)
    return options



def keys_help() -> str:
    """The bench section's keys with their types, defaults and comments (for ``python -m mtl.tools.bench --help``)."""
    rows = [(k, f"{t} = {_show(d)}", c) for k, t, d, c in config_keys(BenchOptions, "bench.")]
    width = max(len(k) for k, _, _ in rows)
    tw = max(len(t) for _, t, _ in rows if len(t) < 40)
    return ("bench keys (the config's bench: section, or bench.<key>=value; train.py ignores them; "
            "mtl/bench/options.py):\n" + "\n".join(
                f"  {k:<{width}}  {t:<{tw}}".rstrip() + (f"  # {c}" if c else "") for k, t, c in rows))


def _show(value: Any) -> str:
    return "null" if value is None else yaml.safe_dump(value, default_flow_style=True, width=1_000).strip().removesuffix(
        "\n...")
