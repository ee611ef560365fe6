"""The sweep's tables: ``results.md`` (per regime its quality, tests, cost and convergence, the pre-registered
comparisons, the published table, the cost of both gradient sources, the change between regimes), ``results.csv``,
``runs.csv`` and the TensorBoard hparams (``tb/``), from ``summarize``'s rows (mtl/bench/results.py)."""

from __future__ import annotations

import csv
import os

from torch.utils import tensorboard

from mtl.bench.compare import cost_table, published_table, reference_values
from mtl.bench.design import comparisons_table
from mtl.bench.options import bench_options
from mtl.bench.record import provenance_lines
from mtl.bench.results import detectable, regime_effects
from mtl.bench.stats import VERDICTS, mean_ci
from mtl.delta_m import metric_specs  # the one Δm, in the core

MARK = {1: "▲", -1: "▼", 0: ""}


def _pm(v: float, ci: float, digits: int = 3) -> str:
    if v != v:
        return "n/a"
    return f"{v:.{digits}f}" + (f" ± {ci:.{digits}f}" if ci == ci else "")


def _interval(mean: float, lo: float, hi: float, sig: int, p: float, digits: int = 2) -> str:
    """``mean [lo, hi] mark (p_Holm)``: the mark only where the Holm-adjusted p is below the table's alpha."""
    if mean != mean:
        return ""
    if lo != lo:
        return f"{mean:+.{digits}f} (too few seeds for a test)"
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] {MARK[sig]} (p_Holm {p:.3f})".replace("  ", " ")


def quality_sentence(cfg, rows: list[dict]) -> str:
    """How each run's reported evaluation was chosen and on which split it is read."""
    split = next((r["split"] for r in rows if r.get("split")), "validation")
    how = ("the evaluation with the best (lowest) validation Δm (bench.select=best; a run's Δm on validation against "
           "the baselines' last validation values)" if bench_options(cfg).select == "best" else
           "the last evaluation (bench.select=last)")
    where = ("read on the held-out test split, which nothing selected on" if split == "test" else
             "read on the same validation split it was chosen on (the runs have no test split: set "
             "data.synthetic.test_size or data.test_path), so it is optimistic")
    return f"Quality: per run {how}, {where}."


def eval_window(rows: list[dict], last_k: int) -> tuple[int, list[int]]:
    """(the evaluations the slope is read over, their steps): ``last_k``, or fewer where the runs have fewer."""
    steps = [d["eval_steps"] for r in rows for d in r["_seeds"].values() if d.get("eval_steps")]
    if not steps:
        return 0, []
    shortest = min(steps, key=len)
    return min(last_k, len(shortest)), shortest[-last_k:]


def regime_table(cfg, rcfg, regime: str, spec: dict, rows: list[dict], base: dict, shares_baselines: str | None) -> str:
    b = bench_options(cfg)
    specs = metric_specs(rcfg)
    keys = [k for k, _, _ in specs]
    has_ref = bool(b.reference.metrics)
    methods = [r for r in rows if r["level"] != "single-task"]
    lines = [f"### Regime `{regime}`" + (f" (overrides: `{' '.join(spec['overrides'])}`)" if spec["overrides"] else ""),
             "", detectable_lead(cfg, methods) + (" The \"vs equal\" column is exploratory: the pre-registered "
                                                  "comparisons are the table above." if b.comparisons else ""), ""]
    if spec["expect"]:
        lines += [f"Expected (stated before the run): {spec['expect'].strip()}", ""]
    tasks = list(dict.fromkeys(t for _, t, _ in specs))
    per_task = "; ".join(f"{t}: {', '.join(k for k, tt, _ in specs if tt == t)}" for t in tasks)
    lines += [f"Mean ± 95% t-interval over seeds {list(b.seeds)}. {quality_sentence(cfg, rows)} Δm %: lower "
              f"is better (as Nash-MTL and FAMO report it); per task the mean relative change of its metrics against "
              f"the single-task baseline ({per_task}), then the mean over the {len(tasks)} tasks, so each task weighs "
              "the same. Single-task baselines"
              + (f" (from regime `{shares_baselines}`)" if shares_baselines else "") + ": "
              + ", ".join(f"{k} {base[k]:.3f}" for k in keys) + ". " + reference_sentence(b, specs, rows)
              + test_sentence(cfg, methods) + " Peak memory: "
              "the run's own process (peak RSS on the CPU, max allocated on a GPU).", "",
              *provenance_lines([d.get("record") for r in rows for d in r["_seeds"].values()]), "",
              "| method | level | source | " + " | ".join(keys) + " | Δm % (lower is better) "
              + ("| Δm % vs reference " if has_ref else "") + "| vs equal (Δm) "
              "| seeds better | mean rank | step time vs equal | peak mem MB (vs equal) | method maths (ms) "
              "| MB all-reduced/step | wall (s) |",
              "|---|---|---|" + "---|" * (len(keys) + has_ref) + "---|---|---|---|---|---|---|---|---|"]
    for r in sorted(methods, key=lambda r: (r["delta_m"] != r["delta_m"], r["delta_m"] if r["delta_m"] == r["delta_m"]
                                            else 0)):
        failed = _not_ok_note(r)
        if not r["runs_ok"]:
            lines.append(f"| `{r['method']}`{failed} | {r['level']} | {r['source']} | "
                         + " | ".join("n/a" for _ in range(len(keys) + 9 + has_ref)) + " |")
            continue
        mem = "n/a" if r["peak_mem_mb"] != r["peak_mem_mb"] else f"{r['peak_mem_mb']:.0f} ({r['mem_vs_equal']:.2f}x)"
        lines.append(
            f"| `{r['method']}`{failed} | {r['level']} | {r['source']} | "
            + " | ".join(_pm(r[k], r[k + "_ci"]) for k in keys)
            + f" | {_pm(r['delta_m'], r['delta_m_ci'], 2)} "
            + (f"| {_pm(r['delta_m_ref'], r['delta_m_ref_ci'], 2)} " if has_ref else "")
            + f"| {_interval(r['vs_equal'], r['vs_equal_lo'], r['vs_equal_hi'], r['vs_equal_sig'], r['vs_equal_p_holm'])} "
            f"| {r['seeds_better']} | {r['mean_rank']:.1f} "
            f"| {r['time_vs_equal']:.2f}x | {mem} | {r['combine_s'] * 1e3:.2f} | {r['allreduce_mb']:.1f} "
            f"| {r['wall_s']:.0f} |")
    lines += ["", *convergence_lines(cfg, regime, rows, base, keys)]
    notes = [f"- `{r['method']}`: {r['meta_cost']}" for r in methods if r.get("meta_cost")]
    if notes:
        lines += ["", "Bilevel methods: what each meta update adds to a step (declared by the class, "
                      "``Weighting.meta_cost``; the step time and memory above are measured):", *notes]
    failures = [f"- `{r['method']}` {x}" for r in rows for x in r["failed"]]
    if failures:
        lines += ["", "Failed or missing runs (the errors: runs.jsonl, errors.log; missing: not finished with this "
                      "configuration when analysed):", *failures]
    return "\n".join(lines)


def convergence_lines(cfg, regime: str, rows: list[dict], base: dict, keys: list[str]) -> list[str]:
    """The convergence table of one regime: each run's change of each metric over the window, its verdict
    (``results.converged``), and how many runs and metrics each verdict holds."""
    b = bench_options(cfg)
    window, steps = eval_window(rows, b.last_k)
    unit = " %" if b.plateau_relative else ""
    tol = f"{b.plateau_tol:g}{unit}"
    shown = [r for r in rows if r["runs_ok"]]  # the failed runs are listed under the failed runs
    lines = [f"Convergence in `{regime}`: the change of each validation metric over the last {window} evaluations"
             + (f" (steps {', '.join(map(str, steps))})" if steps else "") + " (its least-squares slope times the "
             f"window's span; mean ± 95% t-interval over seeds{'; in % of the single-task baseline' if b.plateau_relative else ''}"
             "; negative: falling). Each metric's verdict, from the one-sided 95% t bounds over seeds of its "
             "improvement over the window (the change, negated where lower is better): **converged** where the upper "
             f"bound is below {tol} (shown to improve by less than {tol}), **improving** where the lower bound is "
             f"above {tol}, **undetermined** where neither (these seeds and this noise cannot tell: not converged). "
             "A run converged when all its metrics did, is improving when any metric is, undetermined otherwise. The "
             "selected evaluation's step is the median over seeds.", "", verdict_counts(shown), "",
             "| run | steps | selected step | " + " | ".join(f"{k} change{unit} over the window" for k in keys)
             + " | verdict |", "|---|---|---|" + "---|" * len(keys) + "---|"]
    for r in shown:
        steps_run = max((d["steps"] for d in r["_seeds"].values()), default=0)
        sel = "" if r["selected_step"] != r["selected_step"] else f"{r['selected_step']:.0f}"
        lines.append(f"| `{r['method']}` | {steps_run} | {sel} | "
                     + " | ".join(_pm(r[k + "_window"], r[k + "_window_ci"], 3) if k in base and r[k] == r[k] else "—"
                                  for k in keys)
                     + f" | {verdict_cell(r)} |")
    return lines


def verdict_cell(row: dict) -> str:
    """"converged", "improving: homo, lumo; undetermined: mu", "undetermined: mu" or "not decided (...)"."""
    if row["plateau"] is None:
        return "not decided (one seed or one evaluation)"
    if row["plateau"] == "converged":
        return "converged"
    named = {v: [k for k, x in row["verdicts"].items() if x == v] for v in ("improving", "undetermined")}
    return "; ".join(f"{v}: {', '.join(ks)}" for v, ks in named.items() if ks)


def verdict_counts(rows: list[dict]) -> str:
    """How many rows (a method or baseline over its seeds) and metrics (row x metric) each verdict holds."""
    runs = [r["plateau"] for r in rows]
    metrics = [v for r in rows for v in (r.get("verdicts") or {}).values()]
    undecided = sum(v is None for v in runs)
    return (f"Verdicts: {len(runs)} methods and baselines (each over its seeds), " + ", ".join(f"{runs.count(v)} {v}" for v in VERDICTS)
            + (f", {undecided} not decided" if undecided else "") + f"; {len(metrics)} metrics, "
            + ", ".join(f"{metrics.count(v)} {v}" for v in VERDICTS) + ".")


def _not_ok_note(row: dict) -> str:
    """" (1 of 3 failed)", " (3 of 3 missing)", " (1 of 3 failed, 1 missing)" or "": a row's runs without results."""
    missing = sum(x.endswith(": missing") for x in row["failed"])
    failed = row["runs"] - row["runs_ok"] - missing
    parts = [f"{failed} failed"] * bool(failed) + [f"{missing} missing"] * bool(missing)
    if not parts:
        return ""
    return f" ({parts[0].split()[0]} of {row['runs']} {parts[0].split()[1]}" + "".join(f", {p}" for p in parts[1:]) + ")"


def reference_sentence(b, specs: list, rows: list[dict]) -> str:
    """With ``bench.reference``: its values, and each of our single-task runs' Δm against them (its own task's);
    empty without one."""
    given = reference_values(b, specs)[0]
    if not given:
        return ""
    singles = ", ".join(f"{r['method']} {_pm(r['delta_m_ref'], r['delta_m_ref_ci'], 2)}" for r in rows
                        if r["level"] == "single-task")
    return (f"Δm % vs reference: the same Δm against the single-task metrics of {b.reference.source or 'bench.reference'} "
            f"(" + ", ".join(f"{k} {v:g}" for k, v in given.items()) + "); our single-task runs against them: "
            + (singles or "none") + ". ")


def detectable_lead(cfg, rows: list[dict]) -> str:
    """The line that opens a table: the smallest difference its seeds detect with 80% power at Holm's strictest
    level (``detectable``)."""
    if not rows:
        return "**Detectable here: not said (no difference in this table is tested).**"
    a = bench_options(cfg).alpha
    d = detectable(rows, a)
    if d["mde_holm"] != d["mde_holm"]:
        return "**Detectable here: not said (fewer than 3 seeds).**"
    return (f"**Detectable here (80% power at Holm's level α/{d['m']} = {a / d['m']:.4g}): {d['mde_holm']:.2f} Δm "
            f"points** (paired spread sd {d['sd']:.2f} over {d['n']} seeds).")


def test_sentence(cfg, rows: list[dict], what: str = "vs equal: Δm − Δm(equal) on the same seed") -> str:
    """How one table's marks are made and what its seeds can detect (``detectable``)."""
    b = bench_options(cfg)
    a, d = b.alpha, detectable(rows, b.alpha)
    test = "paired t-test" if b.test == "t" else "exact sign-flip permutation test"
    text = (f"{what}: mean [{100 * (1 - a):g}% t-interval], two-sided {test} over seeds; ▲ / ▼ where Holm's "
            f"adjusted p (p_Holm, across the {d['m']} comparison{'s' if d['m'] != 1 else ''} of this table) is below "
            f"{a:g}: ▼ a lower Δm "
            "(better), ▲ a higher one (worse); the chance of any false mark is at most "
            f"{a:g} when the per-seed differences are about normal (not for skewed ones: docs/benchmark.md).")
    if d["mde"] == d["mde"]:
        return text + (f" Detectable here (80% power, paired spread sd {d['sd']:.2f} over {d['n']} seeds): a "
                       f"difference of {d['mde']:.2f} at α = {a:g}, {d['mde_holm']:.2f} at Holm's strictest level "
                       f"α/{d['m']}; no mark means not detectable by this design, not equal.")
    return text + " Too few seeds (fewer than 3) to test or to say what is detectable."


def effects_table(cfg, effects: list[dict]) -> str:
    if not effects:
        return ""
    tested = [e for e in effects if not e.get("untested")]
    what = ("Each method's Δm in a regime minus its Δm in the reference regime, on the same seeds: both Δm columns "
            "are means over the seeds finished in both regimes (named where some finished in one only)")
    sentence = test_sentence(cfg, tested, what) if tested else what + "."
    if len(tested) < len(effects):
        sentence += (" Not tested where the method's runs trained a different number of steps in the two regimes: "
                     "the difference is then the training length's, not the regime's.")
    lines = ["### Between regimes", "", detectable_lead(cfg, tested), "", sentence, "",
             "| regime | method | Δm % in reference | Δm % in regime | change |", "|---|---|---|---|---|"]
    for e in effects:
        if e.get("untested"):
            ref_steps, steps = e["untested"]
            change = (f"{e['change']:+.2f} (not tested: {steps} steps against {ref_steps})" if e["change"] == e["change"]
                      else f"not tested: {steps} steps against {ref_steps}")
        else:
            change = _interval(e["change"], e["change_lo"], e["change_hi"], e["change_sig"], e["change_p_holm"])
        only = ("" if e.get("seeds") is None else f" (seeds {', '.join(map(str, e['seeds']))}: those finished in both)"
                if e["seeds"] else " (no seed finished in both)")
        lines.append(f"| `{e['regime']}` vs `{e['reference']}` | `{e['method']}`{only} | {_pm(e['delta_m_ref'], float('nan'), 2)} "
                     f"| {_pm(e['delta_m'], float('nan'), 2)} | {change} |")
    return "\n".join(lines)


CSV_FIXED = ["regime", "method", "level", "source", "strategy", "runs_ok", "runs"]
CSV_TAIL = ["split", "selected_step", "delta_m", "delta_m_ci", "delta_m_ref", "delta_m_ref_ci",
            "vs_equal", "vs_equal_lo", "vs_equal_hi", "vs_equal_p",
            "vs_equal_p_holm", "vs_equal_sig", "seeds_better", "mean_rank", "plateau", "time_vs_equal", "mem_vs_equal",
            "combine_s", "allreduce_mb", "step_time_s", "peak_mem_mb", "wall_s"]


def write_results(cfg, per_regime: dict, meta: dict) -> str:
    """results.md, results.csv (one row per regime and method or baseline) and runs.csv (one per run)."""
    out = cfg.output_dir
    all_keys = list(dict.fromkeys(k for rcfg, rows, _ in per_regime.values() for k, _, _ in metric_specs(rcfg)))
    fields = CSV_FIXED + [k + s for k in all_keys for s in ("", "_ci", "_slope", "_slope_ci", "_window",
                                                          "_window_ci")] + CSV_TAIL
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for _, rows, _ in per_regime.values():
            for r in rows:
                w.writerow(r)
    run_fields = ["regime", "method", "seed", "selected_step", "delta_m", "delta_m_ref", "steps", "step_time_s",
                  "peak_mem_mb", "combine_s", "wall_s"] + [k + s for k in all_keys for s in ("", "_slope", "_window")]
    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=run_fields, extrasaction="ignore")
        w.writeheader()
        for regime, method, seed, d in finished_runs(per_regime, meta["regimes"]):
            w.writerow({**d, "regime": regime, "method": method, "seed": seed})
    opts = bench_options(cfg)
    blocks = [f"Protocol: {opts.protocol.strip()}"] if opts.protocol.strip() else []
    for regime, (rcfg, rows, base) in per_regime.items():
        spec = meta["regimes"][regime]
        first = regime == next(iter(per_regime))  # the published table is read beside the first regime only
        if first and opts.comparisons:  # the pre-registered comparisons lead: they are what the design is for
            blocks.append(comparisons_table(cfg, regime, rows))
        blocks.append(regime_table(cfg, rcfg, regime, spec, rows, base, spec["baselines_from"]))
        blocks += [t for t in (published_table(opts, regime, rows) if first else "",
                               cost_table(regime, rows, len(rcfg.tasks))) if t]
    effects = regime_effects(cfg, {k: v[1] for k, v in per_regime.items()})
    if effects:
        blocks.append(effects_table(cfg, effects))
    f_ms, b_ms = meta.get("forward_s", float("nan")) * 1e3, meta.get("backward_s", float("nan")) * 1e3
    if f_ms == f_ms:
        blocks.append(goal_text(f_ms, b_ms, meta.get("step_goals") or []))
    text = "\n\n".join(blocks)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def goal_text(f_ms: float, b_ms: float, goals: list[float]) -> str:
    """The step-time goal of gradient-level methods on the parameters, (F + 2B) / (F + B), with its noise: the mean
    and 95% t-interval (``stats.mean_ci``) over ``goals``, repeated measurements on this machine; with fewer than
    3, no goal is printed (one measurement moved from 1.64 to 1.41 between two runs minutes apart)."""
    head = f"Measured F = {f_ms:.0f} ms, B = {b_ms:.0f} ms (one process, the bench model, best of 3)"
    if len(goals) < 3:
        return head + f"; the step-time goal (F + 2B) / (F + B) is not given: {len(goals)} measurement(s) of it, " \
                      "fewer than 3 (one measurement is too noisy to read)."
    mean, half = mean_ci(goals)
    return (head + f". The step-time goal for gradient-level methods with source=parameters, before their own "
            f"maths, (F + 2B) / (F + B): {mean:.2f} [{mean - half:.2f}, {mean + half:.2f}] (mean and 95% t-interval "
            f"over {len(goals)} measurements of F and B here, each the best of 3; their range "
            f"{min(goals):.2f}-{max(goals):.2f}).")


def finished_runs(per_regime: dict, regime_specs: dict) -> list[tuple[str, str, int, dict]]:
    """(regime, method, seed, its data) of every finished run, from the rows ``summarize`` read them into, once each:
    a baseline borrowed from another regime (baselines_from) is that regime's run."""
    out, seen = [], set()
    for regime, (_, rows, _) in per_regime.items():
        for r in rows:
            home = (regime_specs[regime].get("baselines_from") or regime) if r["level"] == "single-task" else regime
            for seed, d in r["_seeds"].items():
                if (home, r["method"], seed) not in seen:
                    seen.add((home, r["method"], seed))
                    out.append((home, r["method"], seed, d))
    return out


def write_hparams(cfg, per_regime: dict, regime_specs: dict) -> None:
    """The TensorBoard hparams view (``tb/``): one entry per finished run, from ``summarize``'s rows."""
    writer = tensorboard.SummaryWriter(os.path.join(cfg.output_dir, "tb"))
    for regime, method, seed, d in finished_runs(per_regime, regime_specs):
        metrics = {f"hparam/{k}": d[k] for k, _, _ in metric_specs(per_regime[regime][0]) if k in d}
        metrics["hparam/delta_m"] = d["delta_m"]  # lower is better, as in the tables
        metrics["hparam/step_time_s"] = d["step_time_s"]
        metrics["hparam/peak_mem_mb"] = d["peak_mem_mb"]
        writer.add_hparams({"regime": regime, "method": method, "seed": seed}, metrics,
                           run_name=f"{regime}-{method}-seed{seed}")
    writer.close()
