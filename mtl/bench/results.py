"""The sweep's numbers, read back from its runs' folders: each run's curves, cost and selected evaluation
(``read_run``, ``select``), one regime's rows per method and baseline with Δm, the paired tests against ``equal``
with Holm's correction, the convergence verdict (``converged``) and the cost (``summarize``), and each method's change
between regimes (``regime_effects``)."""

from __future__ import annotations

import json
import math
import os
import statistics

from safetensors import safe_open

from mtl.bench.compare import reference_values
from mtl.bench.entries import method_spec
from mtl.bench.options import bench_options
from mtl.bench.record import read_record
from mtl.bench.regimes import heldout_for, strategy_for
from mtl.bench.stats import (
    convergence_verdict,
    holm,
    mark,
    mean_ci,
    min_detectable,
    paired_test,
    pooled_sd,
    slope_per_100,
    window_change,
)
from mtl.checkpoint.folder import list_checkpoints
from mtl.delta_m import delta, metric_specs  # the one Δm, in the core
from mtl.setup.build import run_method_types
from mtl.strategies import strategy_types


def read_run(run_dir: str, last_k: int, specs: list) -> dict | None:
    """One finished run's numbers: per metric its validation curve ``val[key] = [(step, value)]``, its test values by
    step ``test[key]`` (empty without a test split) and the slope of its last ``last_k`` validation evaluations (per
    100 steps); step time, peak memory, the method's maths time, its ``bench_run.json`` record."""
    if not os.path.isfile(os.path.join(run_dir, "final_metrics.json")):
        return None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "final_metrics.json")) as f:
        final = json.load(f)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    t0 = rows[0]["time"] - train[0].get("step_time_s", 0.0) if rows and train else 0.0
    out = {"wall_s": final.get("wall_time_s"), "train": train, "evals": evals, "t0": t0,
           "step_time_s": statistics.median(r["step_time_s"] for r in train[1:] or train) if train else float("nan"),
           "peak_mem_mb": max((r.get("peak_mem_mb") or 0.0 for r in train), default=float("nan")),
           "steps": max((r["step"] for r in rows), default=0), "record": read_record(run_dir),
           "eval_steps": sorted({e["step"] for e in evals}), "val": {}, "test": {}}
    combine = [r["combine_s"] for r in train if r.get("combine_s") is not None]
    out["combine_s"] = statistics.median(combine) if combine else 0.0
    for key, _, _ in specs:
        points = sorted((e["step"], e[key]) for e in evals if e.get(key) is not None)
        if points:
            out["val"][key] = points
            out[key + "_slope"] = slope_per_100(points, last_k)
            out[key + "_window"] = window_change(points, last_k)[0]
        test = {e["step"]: e["test_" + key] for e in evals if e.get("test_" + key) is not None}
        if test:
            out["test"][key] = test
    return out


def select(d: dict, specs: list, ref: dict, how: str, split: str) -> None:
    """Fill the run's reported metrics ``d[key]`` and ``d["selected_step"]``: the evaluation chosen on validation
    (``how="best"``: the lowest validation Δm against ``ref``, each run over the metrics it has; ``"last"``: the
    last), its values read on ``split`` ("test" or "validation")."""
    steps = [s for s in d["eval_steps"] if all(dict(d["val"][k]).get(s) is not None for k in d["val"])]
    if not steps:
        return
    chosen = steps[-1]
    if how == "best":  # the lowest validation Δm; a tie goes to the later evaluation; nan (no reference): the last
        scores = {s: delta({k: dict(pts)[s] for k, pts in d["val"].items()}, ref, specs, partial=True) for s in steps}
        finite = [s for s in steps if scores[s] == scores[s]]
        if finite:
            chosen = min(finite, key=lambda s: (scores[s], -s))
    d["selected_step"] = chosen
    for key, pts in d["val"].items():
        d[key] = d["test"][key].get(chosen, float("nan")) if split == "test" else dict(pts)[chosen]


def allreduce_bytes(run_dir: str, strategy: str, num_tasks: int, method: type | None = None, every: int = 1) -> int:
    """Bytes each process all-reduces per step with two or more processes (from the model's sizes): the strategy's,
    plus a bilevel ``method``'s whole-model gradients (``meta_allreduces``) once in ``every`` steps."""
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
    meta = method.meta_cost(num_tasks)["meta_allreduces"] * (shared + heads) * 4 // max(1, every) if method is not None else 0
    return strategy_types()[strategy].allreduce_bytes(num_tasks, shared, heads) + meta


def meta_cost_note(method: type, options: dict, heldout: int, num_tasks: int) -> str:
    """What a bilevel method's meta update costs, in words (empty for any other method)."""
    if not method.needs_heldout_batch:
        return ""
    c, every = method.meta_cost(num_tasks), int(options.get("update_every", 1))
    return (f"+{c['meta_forwards']} forwards and +{c['meta_backwards']} backward passes over the whole model, "
            f"{c['meta_allreduces']} whole-model gradient all-reduces and ~{c['meta_param_copies']} parameter-sized "
            f"vectors held, {'every step' if every == 1 else f'once every {every} steps'}; trains on all but the "
            f"{heldout} held-out items (data.heldout)")


def per_seed(runs: list[dict], last_k: int, specs: list) -> dict:
    """``{label: {seed: data or None}}`` of one regime's runs (data: ``read_run``; None for a failed run)."""
    out: dict = {}
    for r in runs:
        d = read_run(r["dir"], last_k, specs) if r.get("status") == "ok" else None
        if d is not None:
            d["delta_m"] = float("nan")
        out.setdefault(r["label"], {})[r["seed"]] = d
    return out


def report_split(datas: list[dict]) -> str:
    """"test" when every run evaluated a test split, else "validation"."""
    return "test" if datas and all(d["test"] for d in datas) else "validation"


def _not_ok(status: str | None) -> str:
    """A run's status in the list of runs without results."""
    if status == "unfinished":  # its job reached the requeue cap (launch.AT_CAP)
        return "unfinished at the requeue cap of its Slurm job (resubmitted by the next bench invocation)"
    return status or "failed"


def summarize(cfg, regime: str, spec: dict, rcfg, runs: list[dict], baseline_runs: list[dict]) -> tuple[list, dict]:
    """One regime's rows (one per method, then one per baseline) and its baselines ``{metric: mean}``."""
    b = bench_options(cfg)
    specs = metric_specs(rcfg)
    status = {(r["label"], r["seed"]): r.get("status") for r in [*runs, *baseline_runs]}
    data, bdata, base, split = read_regime(b, specs, runs, baseline_runs)
    eq = data.get("equal", {})
    rows = []
    labels = list(spec["methods"]) + [f"single_{t}" for t in rcfg.tasks if f"single_{t}" in bdata]
    for label in labels:
        seeds = (bdata if label.startswith("single_") else data).get(label, {})
        row = method_row(cfg, rcfg, label, seeds, eq, baseline_runs if label.startswith("single_") else runs)
        rows.append({"regime": regime, **row, "split": split,
                     "failed": [f"seed {s}: {_not_ok(status.get((label, s)))}" for s, d in seeds.items() if not d]})
    adjust(rows, "vs_equal", b.alpha)
    eqrow = next((r for r in rows if r["method"] == "equal"), None)
    for r in rows:
        r["time_vs_equal"] = r["step_time_s"] / eqrow["step_time_s"] if eqrow else float("nan")
        r["mem_vs_equal"] = r["peak_mem_mb"] / eqrow["peak_mem_mb"] if eqrow else float("nan")
    methods = [r for r in rows if r["level"] != "single-task"]
    for key, _, higher in specs:  # mean rank over the metrics (1 = best), methods only
        order = sorted((r for r in methods if r[key] == r[key]), key=lambda r: -r[key] if higher else r[key])
        for i, r in enumerate(order, 1):
            r.setdefault("_ranks", []).append(i)
    for r in rows:
        r["mean_rank"] = statistics.mean(r.pop("_ranks", [float("nan")]))
    return rows, base


def read_regime(b, specs: list, runs: list[dict], baseline_runs: list[dict]) -> tuple[dict, dict, dict, str]:
    """``(data, baseline data, baselines {metric: mean}, split)`` of one regime: every finished run read
    (``per_seed``), its evaluation selected (``select``, on the baselines' last validation values) and its Δm
    against the baselines (and against ``bench.reference``), its convergence window in % of the baseline with
    ``bench.plateau_relative``; ``split``: the one its metrics are read on."""
    data = per_seed(runs, b.last_k, specs)
    bdata = per_seed(baseline_runs, b.last_k, specs)
    bruns = {key: [d for d in bdata.get(f"single_{task}", {}).values() if d] for key, task, _ in specs}
    # the scale the evaluations are selected on: the baselines' last validation values (mean over seeds)
    ref = {key: mean_ci(d["val"][key][-1][1] for d in bruns[key] if key in d["val"])[0] for key, _, _ in specs}
    every = [d for group in (data, bdata) for seeds in group.values() for d in seeds.values() if d]
    split = report_split(every)
    for d in every:
        select(d, specs, ref, b.select, split)
    base = {key: mean_ci(d.get(key) for d in bruns[key])[0] for key, _, _ in specs}
    given = reference_values(b, specs)[0]  # bench.reference: a second Δm, against single-task metrics from elsewhere
    for d in every:
        d["delta_m"] = delta(d, base, specs)
        if b.plateau_relative:  # the slope in % of the baseline per 100 steps (nan where the baseline is 0 or nan)
            for key, _, _ in specs:
                scale = 100 / abs(base[key]) if base[key] == base[key] and base[key] else float("nan")
                for suffix in ("_slope", "_window"):
                    if key + suffix in d:
                        d[key + suffix] *= scale
        d["delta_m_ref"] = delta(d, given, specs, partial=True) if given else float("nan")
    return data, bdata, base, split


def method_row(cfg, rcfg, label: str, seeds: dict, eq: dict, runs: list[dict]) -> dict:
    """One method's (or baseline's) row of a regime from its runs ``{seed: data or None}``: each metric, its slope and
    window (mean and 95% t-interval over seeds), the convergence verdict, Δm, the paired test against ``equal``'s
    runs ``eq`` (Holm's correction comes after, across the table), the cost; ``runs``: the planned runs it is among."""
    b = bench_options(cfg)
    specs, types = metric_specs(rcfg), run_method_types(rcfg)
    ok = {s: d for s, d in seeds.items() if d}
    single = label.startswith("single_")
    name, options, source = ("equal", {}, "") if single else method_spec(label)
    level = "single-task" if single else types[name].level
    row = {"method": label, "level": level, "source": source if level == "grad" else "",
           "runs_ok": len(ok), "runs": len(seeds)}
    for key in [k for k, _, _ in specs]:
        row[key], row[key + "_ci"] = mean_ci(d.get(key) for d in ok.values())
        row[key + "_slope"], row[key + "_slope_ci"] = mean_ci(d.get(key + "_slope") for d in ok.values())
        row[key + "_window"], row[key + "_window_ci"] = mean_ci(d.get(key + "_window") for d in ok.values())
    row["plateau"], row["verdicts"] = converged(row, ok, specs, b.plateau_tol)
    row["moving"] = [k for k, v in row["verdicts"].items() if v == "improving"]
    row["delta_m"], row["delta_m_ci"] = mean_ci(d.get("delta_m") for d in ok.values())
    row["delta_m_ref"], row["delta_m_ref_ci"] = mean_ci(d.get("delta_m_ref") for d in ok.values())
    row["selected_step"] = statistics.median(d["selected_step"] for d in ok.values() if "selected_step" in d) \
        if any("selected_step" in d for d in ok.values()) else float("nan")
    diffs = [ok[s]["delta_m"] - eq[s]["delta_m"] for s in ok if eq.get(s) and not single and label != "equal"]
    test = paired_test(diffs, b.alpha, b.test)
    row["vs_equal"], row["vs_equal_lo"], row["vs_equal_hi"], row["vs_equal_p"] = (
        test["mean"], test["lo"], test["hi"], test["p"])
    row["_diffs"] = diffs
    row["seeds_better"] = f"{sum(x < 0 for x in diffs)}/{len(diffs)}" if diffs and label != "equal" else ""
    for key in ("peak_mem_mb", "wall_s", "combine_s"):
        row[key], row[key + "_ci"] = mean_ci(d[key] for d in ok.values())
    # the median over seeds of each run's median step time: one run slowed by a busy machine does not count
    row["step_time_s"] = statistics.median(d["step_time_s"] for d in ok.values()) if ok else float("nan")
    strategy = b.loss_strategy if single else strategy_for(cfg, level, source)
    row["strategy"] = strategy
    first = next(iter(ok), None)
    row["allreduce_mb"] = (allreduce_bytes(_run_dir(runs, label, first), strategy, 1 if single else len(rcfg.tasks),
                                           types[name], int(options.get("update_every", 1))) / 2**20
                           if first is not None else float("nan"))
    row["meta_cost"] = meta_cost_note(types[name], options, heldout_for(rcfg), len(rcfg.tasks)) if not single else ""
    row["_seeds"] = ok
    return row


def converged(row: dict, seeds: dict, specs: list, tol: float) -> tuple[str | None, dict[str, str]]:
    """(the row's verdict, each metric's): per metric ``stats.convergence_verdict`` of its per-seed improvements over
    the window (``<key>_window`` with the sign that makes an improvement positive) against ``tol``: "converged",
    "improving" or "undetermined". The row is "converged" when every metric is, "improving" when any metric is,
    "undetermined" otherwise (never read as converged). None: not decided (fewer than two seeds, or fewer than two
    evaluations). Metrics the row does not have (a baseline's other task) do not count."""
    have = [(k, higher) for k, _, higher in specs if row[k] == row[k]]
    per_metric = {k: convergence_verdict([(1 if higher else -1) * d[k + "_window"] for d in seeds.values()
                                          if d.get(k + "_window") is not None], tol) for k, higher in have}
    if not have or any(v is None for v in per_metric.values()):
        return None, {}
    found = set(per_metric.values())
    return ("improving" if "improving" in found else "converged" if found == {"converged"} else "undetermined",
            per_metric)


def adjust(rows: list[dict], key: str, alpha: float) -> None:
    """Holm's correction across the rows of one table: ``<key>_p_holm`` and the mark ``<key>_sig`` of each row
    (rows without a test, e.g. equal itself and the baselines, get nan and no mark)."""
    for r, p in zip(rows, holm([r.get(key + "_p", float("nan")) for r in rows])):
        r[key + "_p_holm"] = p
        r[key + "_sig"] = mark(r[key], p, alpha)


def detectable(rows: list[dict], alpha: float) -> dict:
    """What one table's seeds can detect: from the pooled spread of its paired differences (``_diffs``), the
    smallest true difference the paired t-test finds with 80% power, at ``alpha`` and at Holm's strictest level
    ``alpha / m`` (m: the methods tested)."""
    groups = [r["_diffs"] for r in rows if len(r.get("_diffs") or []) >= 3]
    sd, n = pooled_sd(groups)
    m = max(1, len(groups))
    return {"sd": sd, "n": n, "m": m, "mde": min_detectable(sd, n, alpha), "mde_holm": min_detectable(sd, n, alpha / m)}


def _run_dir(runs: list[dict], label: str, seed) -> str:
    return next(r["dir"] for r in runs if r["label"] == label and r["seed"] == seed)


def _trained_steps(seeds: dict) -> int:
    """The steps a method's runs trained (the longest over its seeds)."""
    return max((d.get("steps", 0) for d in seeds.values()), default=0)


def regime_effects(cfg, all_rows: dict[str, list]) -> list[dict]:
    """For each regime after the first and each method in both: its delta-m there minus its delta-m in the first
    regime, seed by seed (the paired t-test): did the regime change what the method reaches? Only the seeds finished
    in both regimes count, in the test and in the two Δm beside it (``seeds``: those seeds where the two regimes'
    finished seeds differ, else None), so the change is the difference of the two Δm shown. Where the method's runs
    trained a different number of steps in the two regimes (e.g. a short regime read for its cost only), the
    difference measures the training length, not the regime: it is given without a test or a mark (``untested``:
    the two lengths) and does not count in Holm's m."""
    alpha = bench_options(cfg).alpha
    names = list(all_rows)
    if len(names) < 2:
        return []
    ref = {r["method"]: r for r in all_rows[names[0]] if r["level"] != "single-task"}
    out = []
    for name in names[1:]:
        for r in all_rows[name]:
            if r["level"] == "single-task" or r["method"] not in ref:
                continue
            a, b = ref[r["method"]]["_seeds"], r["_seeds"]
            both = [s for s in b if s in a]  # the seeds finished in both regimes: every number below reads these
            diffs = [b[s]["delta_m"] - a[s]["delta_m"] for s in both]
            nan = float("nan")
            entry = {"regime": name, "reference": names[0], "method": r["method"],
                     "delta_m_ref": statistics.mean(a[s]["delta_m"] for s in both) if both else nan,
                     "delta_m": statistics.mean(b[s]["delta_m"] for s in both) if both else nan,
                     "seeds": both if set(both) != set(a) | set(b) else None}  # None: the same seeds in both
            lengths = (_trained_steps(a), _trained_steps(b))
            if lengths[0] != lengths[1]:  # a change of training length, not of the regime: no test, no mark
                out.append({**entry, "change": statistics.mean(diffs) if diffs else nan, "change_lo": nan,
                            "change_hi": nan, "change_p": nan, "_diffs": [], "untested": lengths})
                continue
            t = paired_test(diffs, alpha, bench_options(cfg).test)
            out.append({**entry, "change": t["mean"], "change_lo": t["lo"], "change_hi": t["hi"], "change_p": t["p"],
                        "_diffs": diffs})
    for name in names[1:]:  # Holm across the methods of each regime's comparison
        adjust([e for e in out if e["regime"] == name], "change", alpha)
    return out
