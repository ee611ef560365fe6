"""The design of a sweep, stated before it runs and read back with its results: the pre-registered comparisons
(``bench.comparisons``: pairs of ``bench.methods`` entries, a - b on the same seed, Holm across these only), what
its seeds can detect at Holm's level from an assumed paired spread (``bench.design``), and the table of those
comparisons. ``--plan`` prints ``describe_design``; the results print ``comparisons_table`` first.

Power is read at Holm's strictest level alpha / m (``stats.power_holm``): a lower bound for each comparison. It is
printed under three spreads: the assumed one (``bench.design.sd``), its 95% upper bound (``bench.design.sd_df``), and
the papers' (``bench.design.spreads``: each method's ± as a paper reports it, an SEM turned into an sd with the
paper's seeds; the paired sd of a - b taken as sqrt(sd_a^2 + sd_b^2), the two methods' seeds independent, which is
conservative when a and b correlate positively on the same seed). The seeds are sized on the papers' spreads
(``seeds_for_papers``).
"""

from __future__ import annotations

import math
import os

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
    sd_upper_bound,
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


def spread_sd(spread, pm: float) -> float:
    """A paper's ± as an sd: an sem times sqrt(the paper's seeds), an sd as it is."""
    return pm * math.sqrt(spread.seeds) if spread.kind == "sem" else pm


def paper_sds(b: BenchOptions) -> dict[str, tuple[float, object, str, float]]:
    """``{bench.methods entry: (sd, the spread entry, the paper's name, its ±)}`` from ``bench.design.spreads``, each
    paper name mapped to its entry as ``bench.published.methods`` maps it; where two papers give a method's ±, the
    larger sd."""
    names = b.published.methods or {}
    out: dict = {}
    for spread in b.design.spreads:
        for name, pm in spread.dm_pm.items():
            entry = names.get(name, name) if name in names else name
            sd = spread_sd(spread, pm)
            if entry is not None and (entry not in out or sd > out[entry][0]):
                out[entry] = (sd, spread, name, pm)
    return out


def paired_papers_sd(b: BenchOptions, a: str, c: str) -> float:
    """The papers' paired sd of a - b: sqrt(sd_a^2 + sd_b^2) (independent seeds); nan where a paper gives neither."""
    sds = paper_sds(b)
    return math.hypot(sds[a][0], sds[c][0]) if a in sds and c in sds else float("nan")


def seeds_for_papers(b: BenchOptions) -> int:
    """The fewest seeds at which every comparison with a published gap and the papers' spreads has ``power`` at
    Holm's level (0 when one needs more than 200; 3 with none to size)."""
    pairs = family(b)
    needs = [seeds_needed(gap, sd, b.alpha, len(pairs), b.design.power)
             for gap, sd in ((published_gap(b, x, y), paired_papers_sd(b, x, y)) for x, y in pairs)
             if gap == gap and sd == sd]
    return 0 if 0 in needs else max(needs, default=3)


def _power_at(gap: float, sd: float, n: int, a: float, m: int, target: float) -> str:
    need = seeds_needed(gap, sd, a, m, target)
    now = f"{power_holm(abs(gap), sd, n, a, m):.2f}" if n >= 2 else "none (fewer than 2 seeds: no test)"
    return f"power {now}, seeds for {target:.0%}: " + (str(need) if need else "more than 200")


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
    upper = sd_upper_bound(d.sd, d.sd_df) if d.sd > 0 and d.sd_df > 0 else float("nan")
    if d.sd > 0:
        mde, mde_a = min_detectable_holm(d.sd, n, a, m, d.power), min_detectable(d.sd, n, a, d.power)
        lines += [f"  assumed paired spread: sd {d.sd:g} Δm points" + (f" ({d.sd_source})" if d.sd_source else ""),
                  f"  detectable with {d.power:.0%} power at Holm's level α/m: {mde:.2f} Δm points "
                  f"(unadjusted, at α: {mde_a:.2f}); no mark means not detectable by this design, not equal"]
        if upper == upper:
            lines.append(f"  its 95% upper bound: sd {upper:.2f} (chi-square with bench.design.sd_df = {d.sd_df} degrees "
                         f"of freedom: sd x sqrt(df / chi2.ppf(0.05, df))); detectable at Holm's level under it: "
                         f"{min_detectable_holm(upper, n, a, m, d.power):.2f} Δm points")
    else:
        lines.append("  assumed paired spread: not given (bench.design.sd): no power computed")
    sds = paper_sds(b)
    if d.spreads:
        lines.append("  the papers' spreads (bench.design.spreads): each method's ± on Δm as its paper reports it, an "
                     "SEM made an sd with the paper's seeds (sd = SEM x sqrt(seeds)); a comparison's paired sd is "
                     "sqrt(sd_a^2 + sd_b^2), assuming the two methods' seeds independent (conservative when they "
                     "correlate positively on the same seed)")
        for spread in d.spreads:
            kind = (f"an SEM over {spread.seeds} seeds: sd = ± x sqrt({spread.seeds})" if spread.kind == "sem" else
                    f"an sd over {spread.seeds or 'its'} seeds, as it is")
            lines.append(f"    {spread.source}: ± is {kind}" + (f" ({spread.note})" if spread.note else "") + "; "
                         + ", ".join(f"{k} ±{v:g} -> sd {spread_sd(spread, v):.2f}" for k, v in spread.dm_pm.items()))
    lines.append("  comparisons (a - b on the same seed; power at Holm's level α/m with "
                 f"{n} seeds, and the seeds each spread needs for {d.power:.0%}):")
    for x, y in pairs:
        gap = published_gap(b, x, y)
        text = f"    {x} - {y}"
        if gap != gap:
            lines.append(text + ": no published gap")
            continue
        lines.append(text + f": published gap {gap:+.1f}")
        paper = paired_papers_sd(b, x, y)
        if paper == paper:
            lines.append(f"      the papers' spread: sd_a {sds[x][0]:.2f} ({sds[x][2]}, {sds[x][1].source}), sd_b "
                         f"{sds[y][0]:.2f} ({sds[y][2]}, {sds[y][1].source}), paired sd {paper:.2f}: "
                         + _power_at(gap, paper, n, a, m, d.power))
        elif d.spreads:
            lines.append("      the papers' spread: no paper gives both methods' ± (bench.design.spreads)")
        if d.sd > 0:
            lines.append(f"      the assumed sd {d.sd:g}: " + _power_at(gap, d.sd, n, a, m, d.power))
        if upper == upper:
            lines.append(f"      its 95% upper bound {upper:.2f}: " + _power_at(gap, upper, n, a, m, d.power))
    if d.spreads:
        need = seeds_for_papers(b)
        lines.append(f"  seeds for {d.power:.0%} power of every comparison under the papers' spreads: "
                     + (str(need) if need else "more than 200") + f"; bench.seeds has {n}"
                     + ("" if need and n >= need else ": TOO FEW"))
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


def pilot_overrides(cfg) -> list[str]:
    """The overrides that make the sweep its pilot: the first seed, one evaluation period (``trainer.eval_every``
    steps: one epoch where the config evaluates once an epoch), every method and baseline, its own output_dir."""
    b = bench_options(cfg)
    seed = b.seeds[0] if b.seeds else 0
    steps = int(cfg.trainer.eval_every or cfg.trainer.max_steps)
    return [f"bench.seeds=[{seed}]", f"trainer.max_steps={steps}", f"output_dir={cfg.output_dir}_pilot"]


def describe_pilot(cfg, launch: str) -> str:
    """``--plan``'s pilot: the command that runs it (``launch``: how this sweep was named, --preset or --config),
    what it measures and what it cannot, and where its figures go."""
    b = bench_options(cfg)
    overrides = pilot_overrides(cfg)
    return "\n".join([
        f"pilot (run it first, on the sweep's hardware): every method of bench.methods ({len(b.methods)}) and every "
        f"single-task baseline, 1 seed, {overrides[1].split('=')[1]} steps (one evaluation period, trainer.eval_every):",
        f"  python -m mtl.tools.bench {launch} " + " ".join(f"'{o}'" if "[" in o else o for o in overrides)
        + "  (add bench.launcher=slurm on a cluster)",
        "  it measures each method's step time and peak memory on that hardware (results.md's cost columns, "
        "runs.csv's step_time_s and wall_s: what bench.design.gpu_hours and bench.slurm.time_min estimate now), and a sanity Δm "
        "after one evaluation period (every run finite and learning; not converged, and no ranking)",
        "  it does not measure the seed spread: with 1 seed, the spread of Δm across methods is the methods' "
        "differences, not noise. The paired spread the design assumes (bench.design) is measured from the first "
        "seeds of the full sweep: --analyze on them prints the pre-registered comparisons' paired sd (the lead of "
        "their table) against the papers' spreads above",
        f"  its figures: commit its results.md and runs.csv under results/ (e.g. results/{os.path.basename(cfg.output_dir)}"
        "_pilot/), and replace bench.design.gpu_hours and bench.design.sizing with its step times",
    ])


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
