"""The design of a sweep, stated before it runs and read back with its results: the pre-registered comparisons
(``bench.comparisons``: pairs of ``bench.methods`` entries, a - b on the same seed, Holm across these only), what
its seeds can detect at Holm's level from an assumed paired spread (``bench.design``), and the table of those
comparisons. ``--plan`` prints ``describe_design``; the results print ``comparisons_table`` first.

Power is read at Holm's strictest level alpha / m (``stats.power_holm``): a lower bound for each comparison.
"""

from __future__ import annotations

from mtl.bench.compare import published_entries
from mtl.bench.options import BenchOptions, bench_options
from mtl.bench.slurm_sizing import describe_slurm_sizing
from mtl.bench.stats import (
    holm,
    mark,
    min_detectable,
    min_detectable_holm,
    paired_test,
    pooled_sd,
    power_holm,
    seeds_needed,
)

MARK = {1: "▲", -1: "▼", 0: ""}


def family(b: BenchOptions) -> list[tuple[str, str]]:
    """The comparisons a table's marks are corrected across: ``bench.comparisons``, else every method against
    ``equal`` (the table's "vs equal" column)."""
    if b.comparisons:
        return [(str(a), str(c)) for a, c in b.comparisons]
    return [(m, "equal") for m in b.methods if m != "equal"]


def published_gap(b: BenchOptions, a: str, c: str) -> float:
    """The published Δm of entry ``a`` minus that of ``c`` (``bench.published``), nan where either has none."""
    dm = {entry: value for _, value, entry in published_entries(b) if entry is not None}
    return dm.get(a, float("nan")) - dm.get(c, float("nan"))


def describe_design(cfg) -> str:
    """The design in words and numbers (``--plan``): the seeds, the comparisons Holm corrects across, the assumed
    paired spread, the difference detectable at Holm's level, each comparison's published gap with its power and the
    seeds it needs, whether the sign-flip test can reach Holm's level, the jobs' time limit and the GPU-hours."""
    b = bench_options(cfg)
    d, n, pairs = b.design, len(b.seeds), family(b)
    m, a = max(1, len(pairs)), b.alpha
    lines = ["design (bench.seeds, bench.comparisons, bench.design; docs/benchmark.md, \"A design with power\"):",
             f"  seeds: {n} {list(b.seeds)}; paired test: {b.test}; Holm across the m = {len(pairs)} "
             + ("pre-registered comparisons (bench.comparisons)" if b.comparisons else "methods against equal (no "
                "bench.comparisons)") + f": family-wise α = {a:g}, Holm's strictest level α/m = {a / m:.4g}"]
    if d.sd > 0:
        mde, mde_a = min_detectable_holm(d.sd, n, a, m, d.power), min_detectable(d.sd, n, a, d.power)
        lines += [f"  assumed paired spread: sd {d.sd:g} Δm points" + (f" ({d.sd_source})" if d.sd_source else ""),
                  f"  detectable with {d.power:.0%} power at Holm's level α/m: {mde:.2f} Δm points "
                  f"(unadjusted, at α: {mde_a:.2f}); no mark means not detectable by this design, not equal"]
    else:
        lines.append("  assumed paired spread: not given (bench.design.sd): no power computed")
    lines.append("  comparisons (a - b on the same seed):")
    for x, y in pairs:
        gap = published_gap(b, x, y)
        text = f"    {x} - {y}"
        if gap == gap:
            text += f": published gap {gap:+.1f}"
            if d.sd > 0:
                need = seeds_needed(gap, d.sd, a, m, d.power)
                text += (f"; power at Holm's level with {n} seeds {power_holm(abs(gap), d.sd, n, a, m):.2f}; seeds "
                         f"for {d.power:.0%}: " + (str(need) if need else "more than 200"))
        else:
            text += ": no published gap"
        lines.append(text)
    smallest = 2 / 2 ** n if n else 1.0
    lines.append(f"  sign-flip test (bench.test: signflip): smallest p-value 2/2^{n} = {smallest:.4g}, "
                 + ("below" if smallest < a / m else "NOT below") + f" Holm's level {a / m:.4g}"
                 + ("" if smallest < a / m else ": it could never mark the first comparison"))
    s = b.slurm
    lines.append(f"  time limit per job: bench.slurm.time_min = {s.time_min} min ("
                 + (d.sizing or "not sized: bench.design.sizing says how it was") + ")")
    lines.append(f"  each run's job (bench.slurm, with bench.launcher=slurm): {s.time_min} min, {s.gpus_per_run} GPU(s), "
                 f"{s.cpus_per_run or 'bench.nproc x bench.threads'} CPUs, "
                 + (f"{s.mem_gb} GB" if s.mem_gb else "the partition's memory")
                 + "; at its time limit or a preemption it checkpoints, is requeued and resumes")
    lines += describe_slurm_sizing(b)
    lines.append("  GPU-hours: " + (d.gpu_hours or "not estimated (bench.design.gpu_hours)"))
    return "\n".join(lines)


def compare_pairs(b: BenchOptions, rows: list[dict]) -> list[dict]:
    """The pre-registered comparisons measured on one regime's rows (``summarize``'s): per pair the per-seed Δm
    differences a - b, the paired test (``bench.test``), Holm across the pairs, the mark and the published gap."""
    by = {r["method"]: r.get("_seeds") or {} for r in rows}
    out = []
    for x, y in (family(b) if b.comparisons else []):
        sx, sy = by.get(x, {}), by.get(y, {})
        diffs = [sx[s]["delta_m"] - sy[s]["delta_m"] for s in sx if s in sy]
        t = paired_test(diffs, b.alpha, b.test)
        out.append({"a": x, "b": y, "diff": t["mean"], "lo": t["lo"], "hi": t["hi"], "p": t["p"], "_diffs": diffs,
                    "n": t["n"], "published": published_gap(b, x, y)})
    for e, p in zip(out, holm([e["p"] for e in out])):
        e["p_holm"], e["sig"] = p, mark(e["diff"], p, b.alpha)
    return out


def comparisons_table(cfg, regime: str, rows: list[dict]) -> str:
    """The pre-registered comparisons of one regime, led by the difference their seeds detect at Holm's level;
    empty without ``bench.comparisons``."""
    b = bench_options(cfg)
    pairs = compare_pairs(b, rows)
    if not pairs:
        return ""
    m, a = len(pairs), b.alpha
    sd, n = pooled_sd([e["_diffs"] for e in pairs if len(e["_diffs"]) >= 3])
    mde = min_detectable_holm(sd, n, a, m, b.design.power)
    lead = (f"**Detectable here ({b.design.power:.0%} power at Holm's level α/{m} = {a / m:.4g}): "
            f"{mde:.2f} Δm points** (the paired spread of these comparisons, sd {sd:.2f} over {n} seeds)"
            if mde == mde else "**Detectable here: not said (fewer than 3 seeds)**")
    lines = [f"### Regime `{regime}`: the pre-registered comparisons", "", lead + ".", "",
             f"Each a − b: Δm(a) − Δm(b) on the same seed, mean [{100 * (1 - a):g}% t-interval], two-sided "
             + ("paired t-test" if b.test == "t" else "exact sign-flip permutation test")
             + f", Holm across these {m} comparisons only (chosen before the run: bench.comparisons); ▼ / ▲ where "
             f"p_Holm < {a:g} (▼: a has the lower Δm). The false-mark bound α holds for about normal per-seed "
             "differences (docs/benchmark.md). Power: at Holm's strictest level, a lower bound.", "",
             "| a − b | published gap | ours | seeds | power at Holm's level (published gap, this spread) |",
             "|---|---|---|---|---|"]
    for e in pairs:
        ours = (f"{e['diff']:+.2f} [{e['lo']:+.2f}, {e['hi']:+.2f}] {MARK[e['sig']]} (p_Holm {e['p_holm']:.3f})"
                .replace("  ", " ") if e["lo"] == e["lo"] else
                (f"{e['diff']:+.2f} (too few seeds for a test)" if e["diff"] == e["diff"] else "n/a"))
        gap = e["published"]
        pw = power_holm(abs(gap), sd, n, a, m) if gap == gap and sd == sd and n >= 3 else float("nan")
        lines.append(f"| `{e['a']}` − `{e['b']}` | {'—' if gap != gap else f'{gap:+.1f}'} | {ours} | {e['n']} "
                     f"| {'—' if pw != pw else f'{pw:.2f}'} |")
    return "\n".join(lines)
