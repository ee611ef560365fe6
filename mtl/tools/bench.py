"""Benchmark task-weighting methods: quality and cost in one table. ``make bench``.

    python -m mtl.tools.bench --config configs/bench.yaml [key=value ...]

Trains every method in ``bench.methods`` for every seed in ``bench.seeds``, plus one single-task
baseline per task (``tasks=[cls]``, ``tasks=[gen]``, ...) that delta-m needs, each in
``output_dir/runs/<method>/seed<k>/``. Loss-level methods run with ``bench.loss_strategy``
(default ``feature_leaf``), gradient-level ones with ``bench.grad_strategy`` (``task_grads``).

Writes into ``output_dir``: ``results.csv`` and ``results.md`` (mean +- std over seeds), PNG plots,
``runs.jsonl`` (one status line per run, failures with their error) and TensorBoard hparams under
``tb/``. A run that crashes is recorded as failed and the sweep goes on; a re-run skips the runs
that finished (their ``final_metrics.json`` exists).

Metrics and their definitions:
- quality: the mean of the last ``bench.last_k`` evaluations (the table) and the best evaluation
  (results.csv) of each task's declared metrics (``TaskHead.metrics``, with whether higher is better;
  e.g. ``cls_acc``, ``gen_bleu4``, ``gen_chrf`` for the default tasks); every table, plot and delta
  loops over the configured tasks, so a new task's metrics appear with no edit here;
- delta-m % (Maninis et al. 2019, as in Nash-MTL and FAMO): the mean over all M metrics of
  ``(-1)^l_i (M_i - B_i) / B_i * 100`` against the single-task baselines B (l_i = 1 if lower is better);
- delta-p % (LibMTL): the same relative change averaged within each task first, then across tasks;
- mean rank: each method's rank per metric (1 = best), averaged over the metrics;
- cost: step time (the median over seeds of each run's median step) and peak memory as ratios to
  ``equal`` measured in the same sweep, the
  method's own maths (``combine_s``, gradient-level methods), bytes all-reduced per step with two or
  more processes, and wall time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback


def metric_specs(cfg) -> list[tuple[str, str, bool]]:
    """``[(metric key, task, higher is better)]``: what each of the config's tasks declares (``TaskHead.metrics``;
    the tasks of ``task_modules`` too)."""
    from mtl.tasks import task_types

    types = task_types(cfg.get("task_modules") or ())
    return [(key, t, higher) for t in cfg.tasks for key, higher in types[t].metric_keys()]


# ---------------------------------------------------------------------------------------------- methods

_ENTRY = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$")


def parse_method(entry: str) -> tuple[str, dict]:
    """``"cagrad(c=0.2, rescale=false)"`` -> ``("cagrad", {"c": 0.2, "rescale": False})``; values are YAML.
    A plain name has no options. Raises ValueError for anything else."""
    import yaml

    m = _ENTRY.match(str(entry))
    if not m:
        raise ValueError("needs a method name, optionally with options: name(key=value, ...)")
    options = {}
    for part in (m.group(2) or "").split(","):
        if not part.strip():
            continue
        key, eq, raw = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"{part.strip()!r} is not key=value")
        try:
            options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            options[key.strip()] = raw.strip()
    return m.group(1), options


def method_errors(cfg) -> list[str]:
    """Every problem of ``bench.methods``, each naming the entry: unknown or repeated entries, and the
    options checked as ``weighting.options`` is for a run (names and types by ``check_options``, ranges
    by the method's ``check``)."""
    import copy

    from mtl.config import check_options
    from mtl.weighting import weighting_types

    types, errors, seen = weighting_types(), [], set()
    for i, entry in enumerate(cfg.bench.methods):
        where = f"bench.methods[{i}] {entry!r}"
        try:
            name, options = parse_method(entry)
        except ValueError as e:
            errors.append(f"{where}: {e}")
            continue
        if name not in types:
            errors.append(f"{where}: unknown method {name!r} (known: {', '.join(types)})")
            continue
        if entry in seen:
            errors.append(f"{where}: listed twice")
        seen.add(entry)
        found: list[str] = []
        check_options(options, types[name].Options, "weighting.options", found)
        run_cfg = copy.deepcopy(cfg)
        run_cfg.weighting.method, run_cfg.weighting.options = name, options
        found += [e for e in types[name].check(run_cfg) if e.startswith("weighting.options")]
        errors += [f"{where}: {e}" for e in found]
    return errors


def method_overrides(entry: str) -> list[str]:
    """The run overrides of one ``bench.methods`` entry: the method and each of its options."""
    import yaml

    name, options = parse_method(entry)
    shown = {k: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip() for k, v in options.items()}
    return [f"weighting.method={name}", *(f"weighting.options.{k}={v}" for k, v in shown.items())]


def run_folder(label: str) -> str:
    """A folder name for a label: ``cagrad(c=0.2)`` -> ``cagrad_c=0.2``."""
    return re.sub(r"[^\w.=+-]+", "_", label).strip("_")


# ---------------------------------------------------------------------------------------------- runs

def plan(cfg) -> list[dict]:
    from mtl.weighting import weighting_types

    types = weighting_types()
    runs = []
    labels = list(cfg.bench.methods)
    if cfg.bench.baselines:
        labels += [f"single_{t}" for t in cfg.tasks]
    for label in labels:
        for seed in cfg.bench.seeds:
            if label.startswith("single_"):
                task = label.split("_", 1)[1]
                over = [f"tasks=[{task}]", "weighting.method=equal", f"ddp.strategy={cfg.bench.loss_strategy}"]
            else:
                level = types[parse_method(label)[0]].level
                strategy = cfg.bench.grad_strategy if level == "grad" else cfg.bench.loss_strategy
                over = [*method_overrides(label), f"ddp.strategy={strategy}"]
            out = os.path.join(cfg.output_dir, "runs", run_folder(label), f"seed{seed}")
            runs.append({"label": label, "seed": seed, "dir": out,
                         "overrides": [*over, f"seed={seed}", f"output_dir={out}", "trainer.progress=false",
                                       "resume=null"]})
    return runs


def _run_in_process(config: str, overrides: list[str]) -> None:
    from mtl.trainer import Trainer

    trainer = Trainer.from_config(config, overrides)
    try:
        trainer.train()
    finally:
        trainer.close()


def _run_torchrun(config: str, overrides: list[str], nproc: int, log_path: str) -> None:
    cmd = [sys.executable, "-m", "mtl.tools.launch", "--standalone", f"--nproc_per_node={nproc}", "train.py",
           "--config", config, *overrides]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"exit code {proc.returncode}: {tail.strip()}")


def run_all(cfg, config_path: str, base_overrides: list[str]) -> list[dict]:
    runs = plan(cfg)
    status_path = os.path.join(cfg.output_dir, "runs.jsonl")
    os.makedirs(cfg.output_dir, exist_ok=True)
    durations = []
    for i, r in enumerate(runs, 1):
        done = os.path.isfile(os.path.join(r["dir"], "final_metrics.json"))
        left = len(runs) - i + 1
        eta = statistics.mean(durations) * left if durations else None
        head = f"[{i}/{len(runs)}] {r['label']} seed {r['seed']}"
        if done:
            print(f"{head}: finished before, skipped", flush=True)
            r["status"] = "ok"
            continue
        print(f"{head}: training" + (f" (ETA for the sweep {eta / 60:.1f} min)" if eta else ""), flush=True)
        if os.path.isdir(os.path.join(r["dir"], "checkpoints")):
            import shutil

            shutil.rmtree(r["dir"])  # an unfinished earlier attempt: start it again from scratch
        tic = time.time()
        try:
            overrides = [*base_overrides, *r["overrides"]]
            if cfg.bench.nproc > 1:
                os.makedirs(r["dir"], exist_ok=True)
                _run_torchrun(config_path, overrides, cfg.bench.nproc, os.path.join(r["dir"], "log.txt"))
            else:
                _run_in_process(config_path, overrides)
            r["status"], r["error"] = "ok", None
        except Exception as e:  # a crashed run is recorded and the sweep goes on
            r["status"] = "failed"
            r["error"] = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
            print(f"{head}: FAILED: {r['error']}", flush=True)
            with open(os.path.join(cfg.output_dir, "errors.log"), "a") as f:
                f.write(f"== {r['label']} seed {r['seed']}\n{traceback.format_exc()}\n")
        r["wall_s"] = round(time.time() - tic, 1)
        durations.append(r["wall_s"])
        with open(status_path, "a") as f:
            f.write(json.dumps({k: r.get(k) for k in ("label", "seed", "status", "error", "wall_s")}) + "\n")
    return runs


# ------------------------------------------------------------------------------------------ analysis

def read_run(run_dir: str, last_k: int, specs: list) -> dict | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(os.path.join(run_dir, "final_metrics.json")):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "final_metrics.json")) as f:
        final = json.load(f)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    t0 = rows[0]["time"] - train[0].get("step_time_s", 0.0) if rows else 0.0
    out = {"wall_s": final.get("wall_time_s"), "step_time_s": statistics.median(r["step_time_s"] for r in train[1:]
                                                                                  or train),
           "peak_mem_mb": max(r.get("peak_mem_mb", 0.0) for r in train), "train": train, "evals": evals, "t0": t0}
    combine = [r["combine_s"] for r in train if r.get("combine_s") is not None]
    out["combine_s"] = statistics.median(combine) if combine else 0.0
    for key, _, higher in specs:
        values = [e[key] for e in evals if e.get(key) is not None]
        if values:
            out[key] = statistics.mean(values[-last_k:])
            out[key + "_best"] = max(values) if higher else min(values)
    return out


def allreduce_bytes(run_dir: str, strategy: str, num_tasks: int) -> int:
    """Bytes each process all-reduces per step with two or more processes (from the model's sizes)."""
    from safetensors import safe_open

    from mtl.checkpoint import list_checkpoints
    from mtl.strategies import strategy_types

    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        return 0
    shared = heads = 0
    with safe_open(os.path.join(ckpts[-1][1], "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = math.prod(f.get_slice(k).get_shape())
            if k.startswith("backbone."):
                shared += n
            elif not k.endswith("transformer.wte.weight"):  # tied to lm_head.weight: one parameter, counted once
                heads += n
    return strategy_types()[strategy].allreduce_bytes(num_tasks, shared, heads)


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(cfg, runs: list[dict]) -> tuple[list[dict], dict]:
    from mtl.weighting import weighting_types

    types = weighting_types()
    specs = metric_specs(cfg)
    per_label: dict[str, list] = {}
    for r in runs:
        data = read_run(r["dir"], cfg.bench.last_k, specs) if r.get("status") == "ok" else None
        per_label.setdefault(r["label"], []).append((r, data))
    base = {}
    for key, task, _ in specs:
        vals = [d[key] for _, d in per_label.get(f"single_{task}", []) if d and key in d]
        base[key] = statistics.mean(vals) if vals else float("nan")
    rows = []
    for label in cfg.bench.methods:
        pairs = per_label.get(label, [])
        ok = [d for _, d in pairs if d]
        row = {"method": label, "level": types[parse_method(label)[0]].level, "runs_ok": len(ok), "runs": len(pairs),
               "failed": [f"seed {r['seed']}: {r.get('error')}" for r, d in pairs if not d]}
        for key, _, _ in specs:
            row[key], row[key + "_std"] = _mean_std([d.get(key) for d in ok])
            row[key + "_best"], _ = _mean_std([d.get(key + "_best") for d in ok])
        dm, dp = [], []
        for d in ok:
            rel = {key: (1 if higher else -1) * (d[key] - base[key]) / base[key] * 100
                   for key, _, higher in specs if key in d and base[key] == base[key] and base[key] != 0}
            if len(rel) == len(specs):
                dm.append(statistics.mean(rel.values()))
                tasks = sorted({t for _, t, _ in specs})
                dp.append(statistics.mean(statistics.mean(rel[k] for k, t, _ in specs if t == task) for task in tasks))
        row["delta_m"], row["delta_m_std"] = _mean_std(dm)
        row["delta_p"], row["delta_p_std"] = _mean_std(dp)
        for key in ("step_time_s", "peak_mem_mb", "wall_s", "combine_s"):
            row[key], row[key + "_std"] = _mean_std([d[key] for d in ok])
        if ok:  # the median over seeds of each run's median step time: one run slowed by a busy machine does not count
            row["step_time_s"] = statistics.median(d["step_time_s"] for d in ok)
        strategy = cfg.bench.grad_strategy if row["level"] == "grad" else cfg.bench.loss_strategy
        row["strategy"] = strategy
        row["allreduce_mb"] = allreduce_bytes(pairs[0][0]["dir"], strategy, len(cfg.tasks)) / 2**20 if ok else float("nan")
        rows.append(row)
    eq = next((r for r in rows if r["method"] == "equal"), None)
    # In one process on the CPU the runs share the process, whose peak RSS only grows: no per-run peak.
    # (bench.nproc > 1 runs each under its own torchrun; on CUDA the trainer logs max_memory_allocated.)
    import torch

    mem_ok = cfg.bench.nproc > 1 or (torch.cuda.is_available() and cfg.device != "cpu")
    for r in rows:
        r["time_vs_equal"] = r["step_time_s"] / eq["step_time_s"] if eq else float("nan")
        r["mem_vs_equal"] = r["peak_mem_mb"] / eq["peak_mem_mb"] if eq and mem_ok else float("nan")
    for key, _, higher in specs:  # mean rank over the metrics (1 = best)
        order = sorted((r for r in rows if r[key] == r[key]), key=lambda r: -r[key] if higher else r[key])
        for i, r in enumerate(order, 1):
            r.setdefault("_ranks", []).append(i)
    for r in rows:
        r["mean_rank"] = statistics.mean(r.pop("_ranks", [float("nan")]))
    return rows, base


def write_tables(cfg, rows: list[dict], base: dict, meta: dict) -> str:
    out = cfg.output_dir
    specs = metric_specs(cfg)
    fields = ["method", "level", "strategy", "runs_ok", "runs"] + [k for m, _, _ in specs for k in (m, m + "_std",
                                                                                                      m + "_best")]
    fields += ["delta_m", "delta_m_std", "delta_p", "delta_p_std", "mean_rank", "time_vs_equal", "mem_vs_equal",
               "combine_s", "allreduce_mb", "step_time_s", "peak_mem_mb", "wall_s"]
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)

    def ratio(v):
        return "n/a" if v != v else f"{v:.2f}x"

    def pm(r, k, scale=1.0, digits=3):
        v, s = r[k] * scale, r[k + "_std"] * scale
        return "n/a" if v != v else f"{v:.{digits}f} ± {s:.{digits}f}"

    keys = [k for k, _, _ in specs]
    lines = [f"Mean ± std over seeds {list(cfg.bench.seeds)}; quality is the mean of the last {cfg.bench.last_k} "
             f"evaluations (the best evaluation is in results.csv). Single-task baselines: "
             + ", ".join(f"{k} {base[k]:.3f}" for k in keys) + ".", "",
             "| method | level | " + " | ".join(keys) + " | Δm % | Δp % | mean rank | step time vs equal "
             "| peak mem vs equal | method maths (ms) | MB all-reduced/step | wall (s) |",
             "|---|---|" + "---|" * len(keys) + "---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mean_rank"] != r["mean_rank"], r["mean_rank"])):
        failed = f" ({r['runs'] - r['runs_ok']} failed)" if r["runs_ok"] < r["runs"] else ""
        lines.append(
            f"| `{r['method']}`{failed} | {r['level']} | " + " | ".join(pm(r, k) for k in keys)
            + f" | {pm(r, 'delta_m', digits=2)} | {pm(r, 'delta_p', digits=2)} | {r['mean_rank']:.1f} "
            f"| {r['time_vs_equal']:.2f}x | {ratio(r['mem_vs_equal'])} "
            f"| {r['combine_s'] * 1e3:.2f} "
            f"| {r['allreduce_mb']:.1f} | {r['wall_s']:.0f} |")
    f_ms, b_ms = meta.get("forward_s", float("nan")) * 1e3, meta.get("backward_s", float("nan")) * 1e3
    if all(r["mem_vs_equal"] != r["mem_vs_equal"] for r in rows):
        lines += ["", "Peak memory: n/a here, because every run shared one CPU process (whose peak RSS only grows); run "
                  "with bench.nproc=2 (each run its own torchrun) or on CUDA for per-run peaks. What a method adds is its "
                  "strategy's memory (task_grads holds the K x P matrix of task gradients), measured by "
                  "`make bench-strategies`."]
    lines += ["", f"Measured F = {f_ms:.0f} ms, B = {b_ms:.0f} ms (one process, the bench model), so "
              f"(F + 2B) / (F + B) = {(f_ms + 2 * b_ms) / (f_ms + b_ms):.2f}: the step-time goal for gradient-level "
              "methods, before their own maths."]
    failures = [f"- `{r['method']}` {x}" for r in rows for x in r["failed"]]
    if failures:
        lines += ["", "Failed runs:", *failures]
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def write_plots(cfg, runs: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = metric_specs(cfg)
    data: dict[str, list] = {}
    for r in runs:
        d = read_run(r["dir"], cfg.bench.last_k, specs) if r.get("status") == "ok" else None
        if d:
            data.setdefault(r["label"], []).append(d)
    labels = [m for m in cfg.bench.methods if m in data]
    cmap = plt.get_cmap("tab20")
    colour = {m: cmap(i % 20) for i, m in enumerate(labels + [f"single_{t}" for t in cfg.tasks])}
    paths = []

    def mean_curve(runs_, key, x="step"):
        steps = sorted({e["step"] for d in runs_ for e in d["evals"] if e.get(key) is not None})
        xs, ys = [], []
        for s in steps:
            vals = [(e[key], e["time"] - d["t0"]) for d in runs_ for e in d["evals"] if e["step"] == s and e.get(key)
                    is not None]
            if vals:
                ys.append(statistics.mean(v for v, _ in vals))
                xs.append(s if x == "step" else statistics.mean(t for _, t in vals))
        return xs, ys

    for x, unit in (("step", "optimizer step"), ("wall", "wall time since start (s)")):
        fig, axes = plt.subplots(1, len(specs), figsize=(5 * len(specs), 4), squeeze=False)
        axes = axes[0]
        for ax, (key, task, _) in zip(axes, specs):
            for m in labels + [f"single_{task}"]:
                if m in data:
                    xs, ys = mean_curve(data[m], key, x)
                    ax.plot(xs, ys, label=m, color=colour[m], ls="--" if m.startswith("single") else "-")
            ax.set_xlabel(unit)
            ax.set_ylabel(f"validation {key} (0-1, mean over seeds)")
            ax.set_title(key)
        axes[-1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = os.path.join(cfg.output_dir, f"metrics_vs_{x}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    def train_curve(runs_, key):
        by_step: dict[int, list] = {}
        for d in runs_:
            for r in d["train"]:
                if r.get(key) is not None:
                    by_step.setdefault(r["step"], []).append(r[key])
        xs = sorted(by_step)
        return xs, [statistics.mean(by_step[s]) for s in xs]

    tasks = list(cfg.tasks)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    axes = axes[0]
    for ax, t in zip(axes, tasks):
        for m in labels:
            xs, ys = train_curve(data[m], f"weight_{t}")
            ax.plot(xs, ys, label=m, color=colour[m])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"loss weight of {t} (mean over seeds)")
        ax.set_title(f"weight_{t}")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = os.path.join(cfg.output_dir, "task_weights.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)

    pairs = [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]]
    if pairs:  # one panel per pair of tasks
        fig, axes = plt.subplots(1, len(pairs), figsize=(7 * len(pairs), 4), squeeze=False)
        for ax, (a, b) in zip(axes[0], pairs):
            for m in labels:
                for key, what in ((f"grad_cos/{a}_{b}", "shared parameters"), (f"feat_grad_cos/{a}_{b}", "features")):
                    xs, ys = train_curve(data[m], key)
                    if xs:
                        ax.plot(xs, ys, label=f"{m} ({what})", color=colour[m], ls="-" if what.startswith("shared")
                                else ":")
            ax.axhline(0, color="grey", lw=0.5)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(f"cosine(grad {a}, grad {b})")
            ax.set_title(f"gradient conflict {a} / {b} (mean over seeds)")
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = os.path.join(cfg.output_dir, "gradient_cosine.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def write_hparams(cfg, runs: list[dict]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    specs = metric_specs(cfg)
    writer = SummaryWriter(os.path.join(cfg.output_dir, "tb"))
    for r in runs:
        d = read_run(r["dir"], cfg.bench.last_k, specs) if r.get("status") == "ok" else None
        if d:
            metrics = {f"hparam/{k}": d[k] for k, _, _ in specs if k in d}
            metrics["hparam/step_time_s"] = d["step_time_s"]
            writer.add_hparams({"method": r["label"], "seed": r["seed"]}, metrics, run_name=f"{r['label']}-seed{r['seed']}")
    writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtl.tools.bench", description="benchmark task-weighting methods")
    p.add_argument("--config", default="configs/bench.yaml")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    def go():
        from mtl.config_check import load_run_config
        from mtl.errors import ConfigError
        from mtl.tools.doctor import examine

        cfg = load_run_config(a.config, a.overrides)
        errors = method_errors(cfg)
        if errors:
            raise ConfigError(errors)
        tic = time.time()
        runs = run_all(cfg, a.config, a.overrides)
        rows, base = summarize(cfg, runs)
        report = examine(cfg, batches=1)  # F and B of the bench model, one process
        text = write_tables(cfg, rows, base, {"forward_s": report["forward_s"], "backward_s": report["backward_s"]})
        write_plots(cfg, runs)
        write_hparams(cfg, runs)
        print(text)
        print(f"\nbench: {len(runs)} runs, {time.time() - tic:.0f} s this invocation; results in {cfg.output_dir}")

    from mtl.error_report import run_guarded

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
