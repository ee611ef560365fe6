"""A sweep read against numbers from elsewhere, and its cost by gradient source.

- ``bench.reference``: single-task metrics given in the config (a paper's single-task table): a second Δm column,
  against them, beside the Δm against our own single-task runs (``reference_values``);
- ``bench.published``: a paper's Δm per method, side by side with ours, with Spearman's rank correlation over the
  methods both have and its interval (``published_table``; ``stats.rank_correlation``);
- the step time and peak memory against ``equal`` of each gradient-level method on both gradient sources, side by
  side (``cost_table``): what the features source saves at the config's K.

Pure functions of the config's bench section and ``summarize``'s rows (no runs are read here).
"""

from __future__ import annotations

import math

from mtl.bench.entries import method_spec, without_source
from mtl.bench.options import BenchOptions
from mtl.bench.stats import rank_correlation


def reference_values(b: BenchOptions, specs: list) -> tuple[dict[str, float], list[str]]:
    """``({metric key: value}, errors)`` from ``bench.reference.metrics`` (task -> {metric: value}) for the metrics
    ``specs`` (``[(key, task, higher)]``). Empty without a reference. Every metric of ``specs`` needs a value (a
    Δm over part of them would be another quantity), each a finite number other than 0 (it divides)."""
    given = b.reference.metrics or {}
    if not given:
        return {}, []
    tasks = {t: [k for k, tt, _ in specs if tt == t] for _, t, _ in specs}
    out, errors = {}, []
    for task, metrics in given.items():
        where = f"bench.reference.metrics.{task}"
        if task not in tasks:
            errors.append(f"{where}: {task!r} is not a task of this config (tasks: {', '.join(tasks)})")
            continue
        if not isinstance(metrics, dict):
            example = tasks[task][0].removeprefix(task + "_")
            errors.append(f"{where}: needs a mapping of the task's metrics to values, e.g. {{{example}: 0.5}}")
            continue
        for metric, value in metrics.items():
            key = f"{task}_{metric}"
            if key not in tasks[task]:
                known = ", ".join(k.removeprefix(task + "_") for k in tasks[task])
                errors.append(f"{where}.{metric}: {task} declares no metric {metric!r} (its metrics: {known})")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
                errors.append(f"{where}.{metric}: {value!r} must be a finite number other than 0 (Δm divides by it)")
            else:
                out[key] = float(value)
    missing = [k for k, t, _ in specs if k not in out and not any(e.startswith(f"bench.reference.metrics.{t}")
                                                                   for e in errors)]
    if missing:
        errors.append(f"bench.reference.metrics: no value for {', '.join(missing)}: Δm against a reference needs every "
                      "metric that enters Δm (task: {metric: value})")
    return out, errors


def published_entries(b: BenchOptions) -> list[tuple[str, float, str | None]]:
    """``[(the paper's name, its Δm, our bench.methods entry or None)]`` in the config's order."""
    names = b.published.methods or {}
    return [(str(name), float(dm), names.get(name, name) if name in names else str(name))
            for name, dm in (b.published.dm or {}).items()]


def published_errors(b: BenchOptions, known_methods) -> list[str]:
    """Each published name whose entry is not a method mtl knows (``known_methods``: names), and each mapping of a
    name the table does not have."""
    errors = []
    for name, dm, entry in published_entries(b):
        where = f"bench.published.dm.{name}"
        if not math.isfinite(dm):
            errors.append(f"{where}: {dm} must be a finite Δm %")
        if entry is None:
            continue
        try:
            method = method_spec(entry)[0]
        except ValueError as e:
            errors.append(f"bench.published.methods.{name}: {entry!r}: {e}")
            continue
        if method not in known_methods:
            errors.append(f"{where}: {entry!r} is not a method of mtl; map the paper's name to one with "
                          f"bench.published.methods.{name}: <entry> (e.g. ls: equal), or null when mtl has none")
    for name in b.published.methods or {}:
        if name not in (b.published.dm or {}):
            errors.append(f"bench.published.methods.{name}: {name!r} is not in bench.published.dm")
    return errors


def side_by_side(b: BenchOptions, rows: list[dict]) -> dict:
    """The published Δm of each of the paper's methods beside ours (``rows``: one regime's, from ``summarize``):
    ``{"rows": [{name, entry, published, ours, ours_ci, ours_ref, ours_ref_ci}], "own": rank_correlation(...),
    "ref": rank_correlation(...)}``, the correlations over the methods with both numbers (``ref``: our Δm against
    ``bench.reference``, the paper's own baselines; nan without a reference)."""
    by_label = {r["method"]: r for r in rows if r["level"] != "single-task" and r["runs_ok"]}
    nan = float("nan")
    out = []
    for name, dm, entry in published_entries(b):
        r = by_label.get(entry) if entry is not None else None
        out.append({"name": name, "entry": entry, "published": dm,
                    "ours": r["delta_m"] if r else nan, "ours_ci": r["delta_m_ci"] if r else nan,
                    "ours_ref": r.get("delta_m_ref", nan) if r else nan,
                    "ours_ref_ci": r.get("delta_m_ref_ci", nan) if r else nan})
    return {"rows": out,
            "own": rank_correlation([x["ours"] for x in out], [x["published"] for x in out]),
            "ref": rank_correlation([x["ours_ref"] for x in out], [x["published"] for x in out])}


def _num(v: float, ci: float = float("nan")) -> str:
    if v != v:
        return "—"
    return f"{v:.2f}" + (f" ± {ci:.2f}" if ci == ci else "")


def _rho(c: dict) -> str:
    if c["rho"] != c["rho"]:
        return f"n/a ({c['n']} methods in common; at least 3 needed)"
    text = f"ρ = {c['rho']:+.2f} over {c['n']} methods (p = {c['p']:.3f}"
    if c["lo"] == c["lo"]:
        return text + f"; 95% interval [{c['lo']:+.2f}, {c['hi']:+.2f}])"
    return text + "; no interval: " + ("fewer than 4 methods)" if c["n"] < 4 else "ρ = ±1, where Fisher's z is infinite)")


def published_table(b: BenchOptions, regime: str, rows: list[dict]) -> str:
    """The side by side of one regime with ``bench.published`` (empty when the config gives none)."""
    if not b.published.dm:
        return ""
    s = side_by_side(b, rows)
    has_ref = bool(b.reference.metrics)
    lines = [f"### Regime `{regime}` beside {b.published.source or 'the published table'}", "",
             "Δm % (lower is better) as published, and ours: against our own single-task runs"
             + (f", and against the reference single-task metrics ({b.reference.source or 'bench.reference'}), "
                "the baselines the published Δm is taken against" if has_ref else "") + ". Spearman's rank correlation "
             "(`scipy.stats.spearmanr`) between the published order and ours, over the methods both have; its 95% "
             "interval through Fisher's z with the Fieller–Hartley–Pearson standard error √(1.06 / (n − 3)), which "
             "treats both orders as exact (our seed noise is not in it). A method mtl lacks, or one this sweep did "
             "not run, is listed and left out.", "",
             "| published method | our entry | published Δm % | our Δm % (own baselines) |"
             + (" our Δm % (reference) |" if has_ref else ""), "|---|---|---|---|" + ("---|" if has_ref else "")]
    for x in s["rows"]:
        entry = "(not in mtl)" if x["entry"] is None else f"`{x['entry']}`" + ("" if x["ours"] == x["ours"] else
                                                                                " (not run)")
        lines.append(f"| {x['name']} | {entry} | {x['published']:.2f} | {_num(x['ours'], x['ours_ci'])} |"
                     + (f" {_num(x['ours_ref'], x['ours_ref_ci'])} |" if has_ref else ""))
    lines += ["", f"- Rank correlation, our Δm against our own baselines: {_rho(s['own'])}."]
    if has_ref:
        lines.append(f"- Rank correlation, our Δm against the reference: {_rho(s['ref'])}.")
    return "\n".join(lines)


def cost_pairs(rows: list[dict]) -> list[dict]:
    """Each gradient-level method (with its options) on both gradient sources: ``[{method, parameters: row or None,
    features: row or None}]`` in the rows' order, from one regime's ``summarize`` rows."""
    pairs: dict[str, dict] = {}
    for r in rows:
        if r["level"] != "grad":
            continue
        key = without_source(r["method"])
        pairs.setdefault(key, {"method": key, "parameters": None, "features": None})
        pairs[key][method_spec(r["method"])[2]] = r
    return list(pairs.values())


def cost_table(regime: str, rows: list[dict], num_tasks: int) -> str:
    """Step time and peak memory against ``equal``, the parameters source beside the features source, for every
    gradient-level method the regime ran (empty when none ran on both sources)."""
    pairs = [p for p in cost_pairs(rows) if p["parameters"] and p["features"]]
    if not pairs:
        return ""

    def ratio(r, key):
        return "n/a" if r is None or not r["runs_ok"] or r[key] != r[key] else f"{r[key]:.2f}x"

    def saving(p, key):
        a, f = p["parameters"], p["features"]
        if not (a["runs_ok"] and f["runs_ok"]) or a[key] != a[key] or f[key] != f[key] or not f[key]:
            return "n/a"
        return f"{a[key] / f[key]:.2f}x"

    lines = [f"### Cost by gradient source in `{regime}` (K = {num_tasks} tasks)", "",
             "Step time (median over seeds of each run's median step) and peak memory (the run's own process), as "
             "ratios to `equal` in this regime: the parameters source (one backward pass per task through the "
             "shared parameters) beside the features source (the tasks' gradients at the shared features; a "
             "surrogate, docs/strategies.md). The last columns: parameters over features.", "",
             "| method | step time, parameters | step time, features | peak mem, parameters | peak mem, features "
             "| time saved by features | memory saved by features |", "|---|---|---|---|---|---|---|"]
    for p in pairs:
        a, f = p["parameters"], p["features"]
        lines.append(f"| `{p['method']}` | {ratio(a, 'time_vs_equal')} | {ratio(f, 'time_vs_equal')} "
                     f"| {ratio(a, 'mem_vs_equal')} | {ratio(f, 'mem_vs_equal')} | {saving(p, 'step_time_s')} "
                     f"| {saving(p, 'peak_mem_mb')} |")
    return "\n".join(lines)
