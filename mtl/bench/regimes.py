"""The sweep's plan (``python -m mtl.tools.bench``): the methods of ``bench.methods`` and their overrides, the regimes
(``bench.regimes``, ``bench.architectures``) each loaded and checked as a run's config, the bench section's own
checks, every run of the sweep (``plan``) and what ``--plan`` prints of them (the protocol and the run list)."""

from __future__ import annotations

import copy
import json
import os
import re

import yaml
from omegaconf import OmegaConf

from mtl.bench.compare import published_entries, published_errors, reference_values
from mtl.bench.entries import entry_heads, method_spec
from mtl.bench.options import bench_option_errors, bench_options
from mtl.bench.stats import TESTS
from mtl.config.schema import check_options
from mtl.delta_m import metric_specs  # the one Δm, in the core
from mtl.errors import ConfigError
from mtl.setup.build import run_method_types
from mtl.setup.checks import architecture_source_errors, gradient_source_errors, heads_errors, load_run_config
from mtl.strategies import strategy_types

REGIME_KEYS = ("overrides", "methods", "baselines_from", "expect")
LAUNCHERS = ("local", "slurm")


# ---------------------------------------------------------------------------------------------- methods

def strategy_for(cfg, level: str, source: str) -> str:
    b = bench_options(cfg)
    if level != "grad":
        return b.loss_strategy
    return b.feature_strategy if source == "features" else b.grad_strategy


def heldout_for(cfg) -> int:
    """``data.heldout`` for a bilevel method's runs (``needs_heldout_batch``): ``bench.heldout``, else a tenth of the
    synthetic training set rounded up to whole global batches (0 on user data: the method's check then asks)."""
    b = bench_options(cfg)
    if b.heldout:
        return int(b.heldout)
    if cfg.data.source != "synthetic":
        return 0
    glob = int(cfg.data.batch_size) * max(1, int(b.nproc))
    return -(-int(cfg.data.synthetic.train_size) // 10 // glob) * glob


def method_errors(cfg, entries=None, where_prefix: str = "bench.methods") -> list[str]:
    """Every problem of a list of methods (default ``bench.methods``), each naming the entry: unknown or repeated
    entries, the options checked as ``weighting.options`` is for a run (names and types by ``check_options``, ranges
    by the method's ``check``), and the gradient source against the method (as ``weighting.source``)."""
    types, strategies, errors, seen = run_method_types(cfg), strategy_types(), [], set()
    for i, entry in enumerate(bench_options(cfg).methods if entries is None else entries):
        where = f"{where_prefix}[{i}] {entry!r}"
        try:
            name, options, source = method_spec(entry)
        except ValueError as e:
            errors.append(f"{where}: {e}")
            continue
        if name not in types:
            errors.append(f"{where}: unknown method {name!r} (known: {', '.join(types)}; a method file outside "
                          "mtl/weighting goes in weighting_modules)")
            continue
        if entry in seen:
            errors.append(f"{where}: listed twice")
        seen.add(entry)
        found: list[str] = []
        check_options(options, types[name].Options, "weighting.options", found)
        run_cfg = copy.deepcopy(cfg)
        run_cfg.weighting.method, run_cfg.weighting.options, run_cfg.weighting.source = name, options, source
        run_cfg.ddp.strategy = strategy_for(cfg, types[name].level, source)
        if types[name].needs_heldout_batch:  # the tool gives it its held-out items; what else it refuses, it says
            run_cfg.data.heldout = heldout_for(cfg)
            found += [e if e.startswith("weighting.options") else e.replace("data.heldout:", "bench.heldout:", 1)
                      for e in types[name].check(run_cfg)]
        else:
            found += [e for e in types[name].check(run_cfg) if e.startswith("weighting.options")]
        found += gradient_source_errors(run_cfg, strategies.get(run_cfg.ddp.strategy), types[name], strategies)
        if entry_heads(entry) is not None:
            found += heads_errors(entry_heads(entry), types[name])
        found += architecture_source_errors(run_cfg, types[name])
        errors += [f"{where}: {e}" for e in found]
    return errors


def method_overrides(entry: str) -> list[str]:
    """The run overrides of one ``bench.methods`` entry: the method, its source and each of its options."""
    name, options, source = method_spec(entry)
    shown = {k: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip() for k, v in options.items()}
    heads = [] if entry_heads(entry) is None else [f"weighting.heads={entry_heads(entry)}"]
    return [f"weighting.method={name}", f"weighting.source={source}", *heads,
            *(f"weighting.options.{k}={v}" for k, v in shown.items())]


def run_folder(label: str) -> str:
    """A folder name for a label: ``cagrad(c=0.2)`` -> ``cagrad_c=0.2``."""
    return re.sub(r"[^\w.=+-]+", "_", label).strip("_")


# ---------------------------------------------------------------------------------------------- regimes

def regimes(cfg) -> dict[str, dict]:
    """``{name: {overrides, methods, baselines_from, expect}}`` with defaults filled, in the config's order."""
    b = bench_options(cfg)
    raw = dict(b.regimes or {})
    if not raw:
        raw = {"natural": {}}
    out = {}
    for name, spec in raw.items():
        spec = dict(spec or {})
        out[str(name)] = {"overrides": [str(o) for o in spec.get("overrides") or []],
                          "methods": list(spec.get("methods") or b.methods),
                          "baselines_from": spec.get("baselines_from"), "expect": spec.get("expect") or "",
                          "_unknown": [k for k in spec if k not in REGIME_KEYS]}
    return {**out, **architecture_regimes(out, b.architectures)}


def architecture_regimes(specs: dict, architectures: list) -> dict[str, dict]:
    """``bench.architectures``, the sweep's architecture axis: each regime again with each architecture
    (``model.architecture.name``), as the regime ``<regime>+<architecture>``: the same methods and overrides, its
    single-task baselines those of the regime it repeats (an architecture shares a network between tasks, so a
    single task's baseline is the plain network's), so its Δm and the "Between regimes" column compare it with the
    same methods on the config's own architecture."""
    out = {}
    for arch in architectures:
        for name, spec in specs.items():
            expect = f"{spec['expect']} " if spec["expect"] else ""
            out[f"{name}+{arch}"] = {
                **spec, "overrides": [*spec["overrides"], f"model.architecture.name={arch}"],
                "baselines_from": spec["baselines_from"] or name,
                "expect": f"{expect}(the regime {name} with model.architecture.name={arch})"}
    return out


def bench_errors(cfg) -> list[str]:
    """Problems of the bench section's own keys (each naming the key and the fix): unknown keys and wrong types
    (``bench_option_errors``), then their values."""
    b, errors = bench_option_errors(cfg)
    if not 0 < b.alpha < 1:
        errors.append(f"bench.alpha: {b.alpha} must lie in (0, 1) (the family-wise level of the marks, e.g. 0.05)")
    if b.select not in ("best", "last"):
        errors.append(f"bench.select: {b.select!r} must be best (the best validation Δm) or last")
    elif b.select == "best" and not b.baselines and not any(
            (spec or {}).get("baselines_from") for spec in (b.regimes or {}).values()):
        errors.append("bench.select=best selects on validation Δm, which needs the single-task baselines: set "
                      "bench.baselines=true, or bench.select=last")
    if b.launcher not in LAUNCHERS:
        errors.append(f"bench.launcher: {b.launcher!r} must be one of {', '.join(LAUNCHERS)}")
    if b.launcher == "slurm" and b.slurm.cluster not in ("slurm", "local"):
        errors.append(f"bench.slurm.cluster: {b.slurm.cluster!r} must be slurm or local (submitit's local executor)")
    for key in ("longest_run_h", "max_requeues", "save_s"):
        if getattr(b.slurm, key) < 0:
            errors.append(f"bench.slurm.{key}: {getattr(b.slurm, key)} must be >= 0")
    if not b.last_k >= 2:
        errors.append(f"bench.last_k: {b.last_k}: the convergence slope needs at least 2 evaluations")
    if b.test not in TESTS:
        errors.append(f"bench.test: {b.test!r} must be one of {', '.join(TESTS)} (the paired t-test, or the exact "
                      "sign-flip permutation test)")
    if not 0 < b.design.power < 1:
        errors.append(f"bench.design.power: {b.design.power} must lie in (0, 1) (e.g. 0.8)")
    if b.design.sd < 0:
        errors.append(f"bench.design.sd: {b.design.sd} must be >= 0 (0: not said)")
    for i, pair in enumerate(b.comparisons):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)) \
                or pair[0] == pair[1]:
            errors.append(f"bench.comparisons[{i}]: {pair!r} must be a pair of two different bench.methods entries, "
                          "[a, b] (a - b on the same seed)")
        elif any(x not in b.methods for x in pair):
            errors.append(f"bench.comparisons[{i}]: {', '.join(x for x in pair if x not in b.methods)} is not in "
                          "bench.methods (a comparison is between two of the sweep's entries, as written there)")
    return errors


def regime_configs(cfg, config_path: str, base_overrides: list[str]) -> tuple[dict, list[str]]:
    """``({regime: (spec, its run config)}, errors)``: each regime's overrides loaded and checked as a run's, and
    its method list checked (every error names the regime and the key)."""
    out, errors = {}, bench_errors(cfg)
    if bench_option_errors(cfg)[1]:  # a key or a type: the rest reads the section
        return out, errors
    specs, raw_regimes = regimes(cfg), bench_options(cfg).regimes
    for name, spec in specs.items():
        key = f"bench.regimes.{name}"
        if spec["_unknown"]:
            errors.append(f"{key}: unknown key(s) {', '.join(spec['_unknown'])} (known: {', '.join(REGIME_KEYS)})")
        if spec["baselines_from"] is not None and spec["baselines_from"] not in specs:
            errors.append(f"{key}.baselines_from: {spec['baselines_from']!r} is not a regime (known: {', '.join(specs)})")
        if not re.fullmatch(r"[\w.+-]+", name):
            errors.append(f"{key}: a regime name is a folder name: letters, digits, '_', '.', '+', '-'")
        try:
            rcfg = load_run_config(config_path, [*base_overrides, *spec["overrides"]])
        except ConfigError as e:
            errors += [f"{key}.overrides {spec['overrides']}: {m}" for m in e.errors]
            continue
        errors += method_errors(rcfg, spec["methods"], f"{key}.methods" if raw_regimes else "bench.methods")
        errors += reference_values(bench_options(cfg), metric_specs(rcfg))[1]
        out[name] = (spec, rcfg)
    if out:
        errors += published_errors(bench_options(cfg), run_method_types(next(iter(out.values()))[1]))
    return out, list(dict.fromkeys(errors))  # a problem every regime shares, once


# ---------------------------------------------------------------------------------------------- the plan

def plan(cfg, loaded: dict | None = None) -> list[dict]:
    """Every run of the sweep: ``{regime, label, seed, dir, overrides, level}``; the baselines as ``single_<task>``
    (in a regime with ``baselines_from``, the other regime's baseline runs stand in: not planned twice). ``loaded``:
    ``regime_configs``' regimes (default: every regime with ``cfg`` itself)."""
    b = bench_options(cfg)
    if loaded is None:
        loaded = {name: (spec, cfg) for name, spec in regimes(cfg).items()}
    runs = []
    for regime, (spec, rcfg) in loaded.items():
        types = run_method_types(rcfg)
        labels = list(spec["methods"])
        if b.baselines and spec["baselines_from"] is None:
            labels += [f"single_{t}" for t in rcfg.tasks]
        for label in labels:  # a label's overrides are the same for every seed: worked out once
            if label.startswith("single_"):
                task = label.split("_", 1)[1]
                level, over = "loss", [f"tasks=[{task}]", "weighting.method=equal",
                                       f"ddp.strategy={b.loss_strategy}", *plateau_baselines_of(rcfg, task)]
            else:
                name, _, source = method_spec(label)
                level = types[name].level
                over = [*method_overrides(label), f"ddp.strategy={strategy_for(cfg, level, source)}"]
                if types[name].needs_heldout_batch:
                    over.append(f"data.heldout={heldout_for(rcfg)}")
            for seed in b.seeds:
                out = os.path.join(cfg.output_dir, "runs", regime, run_folder(label), f"seed{seed}")
                runs.append({"regime": regime, "label": label, "seed": seed, "dir": out, "level": level,
                             "overrides": [*spec["overrides"], *over, f"seed={seed}", f"output_dir={out}",
                                           "trainer.progress=false", "resume=null"]})
    return runs


def plateau_baselines_of(rcfg, task: str) -> list[str]:
    """A single-task run's ``optim.plateau.baselines``: only its task's metrics (the config check refuses a baseline
    of a task the run does not have); none without the plateau schedule."""
    baselines = rcfg.optim.plateau.baselines
    if rcfg.optim.scheduler != "plateau" or not baselines:
        return []
    own = {key: baselines[key] for key, t, _ in metric_specs(rcfg) if t == task and key in baselines}
    return [f"optim.plateau.baselines={json.dumps(own)}"]


# ---------------------------------------------------------------------------------------------- --plan

def describe_plan(runs: list[dict]) -> str:
    """How many runs of which kind, per regime (``--plan``): what a sweep estimate multiplies."""
    counts: dict = {}
    for r in runs:
        kind = "single-task" if r["label"].startswith("single_") else r["level"]
        if "weighting.source=features" in r["overrides"]:
            kind = "grad (source=features)"
        counts.setdefault(r["regime"], {}).setdefault(kind, 0)
        counts[r["regime"]][kind] += 1
    lines = [f"{len(runs)} runs"]
    for regime, kinds in counts.items():
        lines.append(f"  {regime}: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    return "\n".join(lines)


def _flat(node, prefix: str = "") -> list[str]:
    """``key=value`` for every leaf of a (nested) mapping."""
    out = []
    for k, v in (node or {}).items():
        if isinstance(v, dict) and v:
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True, width=1_000).strip().removesuffix('...').strip()}")
    return out


def describe_protocol(cfg, loaded: dict) -> str:
    """The protocol the runs follow, read from the config (``--plan``): the tasks and the metrics Δm takes, the data
    and its splits, the batch, the optimizer and schedule, the steps and evaluations, the selection and the split
    reported, the seeds, and what Δm and the published table are read against. ``bench.protocol`` (the protocol in
    words) comes first when given; the lines below are what runs."""
    b = bench_options(cfg)
    rcfg = next(iter(loaded.values()))[1] if loaded else cfg
    c = OmegaConf.to_container(rcfg, resolve=True)
    specs = metric_specs(rcfg)
    data = c["data"]
    source_section = data.get(data["source"]) if isinstance(data.get(data["source"]), dict) else None
    lines = ["protocol (from the config; the runs use exactly this):"]
    if b.protocol.strip():
        lines.append(f"  in words: {b.protocol.strip()}")
    lines += [f"  tasks (K = {len(c['tasks'])}): {', '.join(c['tasks'])}; Δm over "
              + ", ".join(f"{k} ({'higher' if h else 'lower'} is better)" for k, _, h in specs),
              f"  data: source={data['source']}" + (f" {' '.join(_flat(source_section))}" if source_section else "")
              + f"; batch {data['batch_size']} per process x {b.nproc} process(es) = {data['batch_size'] * b.nproc}",
              f"  model: {' '.join(_flat(c['model']['backbone']))}",
              f"  optimizer: {' '.join(_flat(c['optim']))}",
              f"  trainer: {' '.join(_flat({k: v for k, v in c['trainer'].items() if k not in ('progress', 'poison')}))}",
              f"  selection: bench.select={b.select} ("
              + ("the evaluation with the best validation Δm against our single-task runs" if b.select == "best"
                 else "the last evaluation") + "), its metrics read on the test split when the runs evaluate one",
              f"  seeds: {list(b.seeds)}; single-task baselines: "
              + (", ".join(f"single_{t}" for t in c["tasks"]) if b.baselines else "none (bench.baselines=false)")]
    given, _ = reference_values(b, specs)
    if given:
        lines.append(f"  Δm also against {b.reference.source or 'bench.reference'}: "
                     + ", ".join(f"{k} {v:g}" for k, v in given.items()))
    if b.published.dm:
        def ours(entry):
            return "not in mtl" if entry is None else entry if entry in b.methods else f"{entry}, not run here"

        lines.append(f"  read beside {b.published.source or 'bench.published'}: "
                     + ", ".join(f"{name} {dm:g} (ours: {ours(entry)})" for name, dm, entry in published_entries(b)))
    return "\n".join(lines)


def list_runs(runs: list[dict]) -> str:
    """Every planned run (``--plan``), one line each: its regime, label, seed, folder and the overrides it trains
    with beyond the config (the seed and the folder aside)."""
    lines = []
    for i, r in enumerate(runs, 1):
        over = [o for o in r["overrides"] if not o.startswith(("seed=", "output_dir=", "trainer.progress=", "resume="))]
        lines.append(f"[{i}/{len(runs)}] {r['regime']} {r['label']} seed {r['seed']}: {r['dir']}  {' '.join(over)}")
    return "\n".join(lines)
