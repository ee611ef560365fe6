"""The design of the QM9 benchmark (issue 35.3-4, 6): the authors'-settings table of docs/benchmark.md against the
`qm9` preset, the preset's assumed spread recomputed from the committed CPU runs, the pre-registered comparisons
(checked, tabled with Holm across them only, printed by --plan), and the statements docs/benchmark.md makes about the
committed CPU results' convergence."""

import csv
import math
import os
import re
import statistics

import pytest
import yaml

from .conftest import ROOT

DOC = os.path.join(ROOT, "docs", "benchmark.md")
PRESET = os.path.join(ROOT, "configs", "bench_qm9.yaml")
CPU_PRESET = os.path.join(ROOT, "configs", "bench_qm9_cpu.yaml")
CPU_RUNS = os.path.join(ROOT, "results", "qm9_cpu", "runs.csv")


def _bench(path):
    with open(path) as f:
        return yaml.safe_load(f)["bench"]


def _settings_rows():
    """The rows of docs/benchmark.md's table "The `qm9` preset: the authors' settings"."""
    text = open(DOC).read()
    section = text.split("### The `qm9` preset: the authors' settings", 1)[1].split("\n### ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `") or ln.startswith("| every")]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]


def test_the_authors_settings_table_matches_the_qm9_preset():
    from mtl.bench.entries import entry_heads, method_spec
    from mtl.setup.build import run_method_types
    from mtl.setup.checks import load_run_config

    bench = _bench(PRESET)
    entries = {e: method_spec(e) for e in bench["methods"]}
    types = run_method_types(load_run_config(PRESET))
    rows = _settings_rows()
    assert rows and all(r[3] in ("same", "deviation") for r in rows), rows
    checked = 0
    for method, theirs, ours, status, _source in rows:
        if status != "same" or method.startswith("every"):
            continue
        entry = re.match(r"`([^`]+)`", ours).group(1)
        assert entry in entries, f"{entry!r} (docs/benchmark.md) is not an entry of configs/bench_qm9.yaml"
        name, options, source = entries[entry]
        assert source == "parameters" and method == f"`{name}`"
        defaults = types[name].Options()
        # their setting: the entry's option (or heads, weighting.heads) or our default
        given = {**options, "heads": entry_heads(entry) or "unweighted"}
        for key, value in re.findall(r"`(\w+)=([^`]+)`", theirs):
            want = yaml.safe_load(value)
            got = given[key] if key in given else getattr(defaults, key)
            assert got == want, (entry, key, got, want)
            checked += 1
    # uw's lr, mgda's normalization and heads, pcgrad's reduction, cagrad's c and rescale, imtlg's heads, nashmtl's
    # max_norm, update_every, optim_niter and heads
    assert checked >= 11
    listed = " ".join(r[2] for r in rows)
    assert all(f"`{e}`" in listed for e in bench["methods"]), "an entry of the qm9 preset has no row"


def test_the_authors_settings_check_catches_a_drift(tmp_path, monkeypatch):
    """The check above fails when the preset loses an authors' setting (nashmtl without its iteration)."""
    entry = '"nashmtl(max_norm=1.0, optim_niter=20, heads=weighted)"'
    assert entry in open(PRESET).read()
    text = open(PRESET).read().replace(entry, '"nashmtl(max_norm=1.0, heads=weighted)"')
    path = tmp_path / "bench_qm9.yaml"
    path.write_text(text.replace("base: qm9.yaml", f"base: {os.path.join(ROOT, 'configs', 'qm9.yaml')}"))
    monkeypatch.setattr(f"{__name__}.PRESET", str(path))
    with pytest.raises(AssertionError):
        test_the_authors_settings_table_matches_the_qm9_preset()


def _cpu_delta_m():
    dm = {}
    with open(CPU_RUNS) as f:
        for r in csv.DictReader(f):
            if r["regime"] == "natural":
                dm.setdefault(r["method"], {})[int(r["seed"])] = float(r["delta_m"])
    return dm


# the 8 pairs bench.design.sd was pooled over (its sd_source: the former design's comparisons, in paper names)
SD_PAIRS = [("uw", "ls"), ("mgda", "ls"), ("pcgrad", "ls"), ("cagrad", "ls"), ("imtlg", "ls"), ("nashmtl", "ls"),
            ("nashmtl", "imtlg"), ("imtlg", "uw")]


def test_the_design_spread_is_the_cpu_runs_spread_of_its_pairs():
    """bench.design.sd of the qm9 preset: the pooled sd of the per-seed Δm differences of the 8 pairs its sd_source
    names, each paper name mapped to its entry in the CPU preset, in results/qm9_cpu/runs.csv; sd_df is their
    degrees of freedom (the 95% upper bound --plan prints is computed from it)."""
    from mtl.bench.stats import pooled_sd

    gpu, cpu = _bench(PRESET), _bench(CPU_PRESET)
    to_cpu = lambda name: cpu["published"]["methods"].get(name, name)  # noqa: E731
    dm = _cpu_delta_m()
    groups = [[dm[to_cpu(a)][s] - dm[to_cpu(b)][s] for s in dm["equal"]] for a, b in SD_PAIRS]
    assert len(groups) == 8 and all(len(g) == 3 for g in groups)
    sd, n = pooled_sd(groups)
    assert round(sd, 2) == gpu["design"]["sd"] and n == 3
    assert gpu["design"]["sd_df"] == sum(len(g) - 1 for g in groups) == 16


def test_the_statements_on_the_cpu_runs_convergence():
    """docs/benchmark.md: equal's slope intervals exclude 0 for homo, U, H and G only; no single-task baseline's
    does. The three verdicts (5% of the baseline over the window, two one-sided 95% bounds) on the same runs:
    `equal` converged on r2 only, its 6 metrics still improving by 8-11% over the window undetermined, never
    converged (the former rule, converged unless shown improving, called all 11 converged); uw improving on homo,
    lumo, zpve, U0, U and H, gls on homo and lumo, IMTL-G, Nash-MTL and FAMO on lumo, CAGrad on Cv;
    every single-task baseline undetermined."""
    from mtl.bench.stats import convergence_verdict, mean_ci, window_bounds

    slopes = {}
    with open(CPU_RUNS) as f:
        for r in csv.DictReader(f):
            if r["regime"] == "natural":
                for k, v in r.items():
                    if k.endswith("_mae_slope") and v:
                        slopes.setdefault(r["method"], {}).setdefault(k[:-len("_mae_slope")], []).append(float(v))
    span = 1320 - 1023  # the last 10 evaluations of qm9_cpu: 33 steps apart
    excl = {m: [k for k, v in d.items() if abs(mean_ci(v)[0]) > mean_ci(v)[1]] for m, d in slopes.items()}
    assert excl["equal"] == ["homo", "U", "H", "G"]
    assert all(not excl[m] for m in slopes if m.startswith("single_"))
    tol = _bench(CPU_PRESET)["plateau_tol"]
    gains = {m: {k: [-x * span / 100 for x in v] for k, v in d.items()} for m, d in slopes.items()}
    verdict = {m: {k: convergence_verdict(v, tol) for k, v in d.items()} for m, d in gains.items()}

    def having(m, which):
        return [k for k, v in verdict[m].items() if v == which]

    big = [k for k, v in gains["equal"].items() if mean_ci(v)[0] >= 8.0]
    assert big == ["alpha", "homo", "U0", "U", "H", "G"]
    assert having("equal", "converged") == ["r2"] and not having("equal", "improving")
    assert all(window_bounds(gains["equal"][k])[0] <= tol for k in gains["equal"])  # the former rule: all converged
    assert having("uw", "improving") == ["homo", "lumo", "zpve", "U0", "U", "H"]
    assert having("gls", "improving") == ["homo", "lumo"]
    assert all(having(m, "improving") == ["lumo"] for m in ("imtlg(source=features)", "nashmtl(source=features)", "famo"))
    assert having("cagrad(source=features)", "improving") == ["Cv"]
    assert all(having(m, "undetermined") == list(verdict[m]) for m in slopes if m.startswith("single_"))


def test_comparisons_are_checked_and_tabled_with_holm_across_them_only(tmp_path):
    """bench.comparisons: a pair outside bench.methods is refused naming it; the table measures a - b per seed,
    Holm across the pairs only, and opens with the Holm-level detectable difference."""
    from mtl.bench.design import compare_pairs, comparisons_table
    from mtl.bench.options import bench_options
    from mtl.bench.regimes import bench_errors
    from mtl.bench.stats import holm, paired_test
    from mtl.setup.checks import load_run_config

    from .conftest import TINY

    base = [f"output_dir={tmp_path}", "bench.methods=[equal, uw, mgda]"]
    cfg = load_run_config(TINY, [*base, "bench.comparisons=[[uw, equal], [mgda, dwa]]"])
    assert any(e.startswith("bench.comparisons[1]: dwa is not in bench.methods") for e in bench_errors(cfg))
    cfg = load_run_config(TINY, [*base, "bench.comparisons=[[uw, equal], [mgda, uw]]"])
    assert bench_errors(cfg) == []
    seeds = {"equal": [10.0, 11.0, 12.0, 13.0], "uw": [7.0, 8.5, 8.0, 10.0], "mgda": [10.0, 9.0, 12.5, 13.0]}
    rows = [{"method": m, "_seeds": {s: {"delta_m": v} for s, v in enumerate(vals)}} for m, vals in seeds.items()]
    pairs = compare_pairs(bench_options(cfg), rows)
    d1 = [a - b for a, b in zip(seeds["uw"], seeds["equal"])]
    d2 = [a - b for a, b in zip(seeds["mgda"], seeds["uw"])]
    p = holm([paired_test(d1)["p"], paired_test(d2)["p"]])
    assert [e["diff"] for e in pairs] == [statistics.mean(d1), statistics.mean(d2)]
    assert [e["p_holm"] for e in pairs] == p
    text = comparisons_table(cfg, "natural", rows)
    lead = text.splitlines()[2]
    assert lead.startswith("**Detectable here (80% power at Holm's level α/2 = 0.025)")
    assert "| `uw` − `equal` |" in text and "Holm across these 2 comparisons only" in text


_PLANS: dict[tuple, str] = {}  # the qm9 plan (756 runs: seconds to print) made once per set of extra arguments


def _qm9_plan(capsys, *extra) -> str:
    from mtl.bench.sweep import main

    if extra not in _PLANS:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            assert main(["--preset", "qm9", "--plan", *extra]) == 0
        finally:
            os.chdir(cwd)
        _PLANS[extra] = capsys.readouterr().out
    return _PLANS[extra]


def test_qm9_plan_prints_the_design(capsys):
    """--preset qm9 --plan: the seeds, the 3 pre-registered comparisons with their published gaps, the Holm-level
    detectable difference, and the places for the jobs' time limit and the GPU-hours."""
    out = _qm9_plan(capsys)
    assert f"seeds: 36 {list(range(36))}" in out
    assert "Holm across the m = 3 pre-registered comparisons" in out and "α/m = 0.01667" in out
    assert "nashmtl(max_norm=1.0, optim_niter=20, heads=weighted) - imtlg(heads=weighted): published gap -15.2" in out
    assert "famo(gamma=0.001) - nashmtl(max_norm=1.0, optim_niter=20, heads=weighted): published gap -3.5" in out
    assert "seeds for 80% power of every comparison under the papers' spreads: 36; bench.seeds has 36\n" in out
    assert "time limit per job: bench.slurm.time_min" in out and "GPU-hours:" in out


def _paper_sd(bench, entry):
    """The largest sd any spread of the preset gives the entry (its ± x sqrt(seeds) for an sem), recomputed here."""
    to_paper = {v: k for k, v in bench["published"]["methods"].items() if v}
    name = to_paper.get(entry, entry)
    return max(pm * (math.sqrt(sp["seeds"]) if sp["kind"] == "sem" else 1.0)
               for sp in bench["design"]["spreads"] for k, pm in sp["dm_pm"].items() if k == name)


def _gap(bench, a, b):
    to_paper = {v: k for k, v in bench["published"]["methods"].items() if v}
    dm = bench["published"]["dm"]
    return dm[to_paper.get(a, a)] - dm[to_paper.get(b, b)]


def test_no_preregistered_comparison_is_one_that_cannot_fail():
    """The comparisons rank methods the papers place close together: none is against equal (LS), and no published
    gap exceeds 40 Δm points (against LS they were 52-116: certain to be marked whatever the seeds)."""
    bench = _bench(PRESET)
    assert bench["comparisons"]
    for a, b in bench["comparisons"]:
        assert "equal" not in (a, b), (a, b)
        assert abs(_gap(bench, a, b)) <= 40.0, (a, b, _gap(bench, a, b))


def test_each_comparison_has_power_under_the_papers_spreads():
    """Every pre-registered comparison has >= bench.design.power at Holm's level with the preset's seeds under the
    papers' spreads (the paired sd sqrt(sd_a^2 + sd_b^2), each sd recomputed here from the preset's ±), and the seeds
    are the fewest that give it (the design's sizing, mtl.bench.design.seeds_for_papers)."""
    from mtl.bench.design import seeds_for_papers
    from mtl.bench.options import bench_options
    from mtl.bench.stats import power_holm
    from mtl.setup.checks import load_run_config

    bench = _bench(PRESET)
    n, m, alpha = len(bench["seeds"]), len(bench["comparisons"]), 0.05
    powers = [power_holm(abs(_gap(bench, a, b)), math.hypot(_paper_sd(bench, a), _paper_sd(bench, b)), n, alpha, m)
              for a, b in bench["comparisons"]]
    assert min(powers) >= bench["design"]["power"], powers
    assert seeds_for_papers(bench_options(load_run_config(PRESET))) == n
    fewer = [power_holm(abs(_gap(bench, a, b)), math.hypot(_paper_sd(bench, a), _paper_sd(bench, b)), n - 1, alpha, m)
             for a, b in bench["comparisons"]]
    assert min(fewer) < bench["design"]["power"]  # one seed fewer is not enough: the seeds were sized, not padded


def test_plan_prints_each_papers_spread_with_its_source_and_kind(capsys):
    """--plan prints each spread of the preset with its source, what its ± is (an SEM over the paper's seeds) and each
    method's ± turned into an sd; and the assumed sd's 95% upper bound, scipy's chi-square with sd_df."""
    from scipy import stats

    bench = _bench(PRESET)
    out = _qm9_plan(capsys)
    assert len(bench["design"]["spreads"]) == 2
    for sp in bench["design"]["spreads"]:
        assert sp["kind"] == "sem" and sp["seeds"] == 3
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(sp["source"] + ":"))
        assert "± is an SEM over 3 seeds: sd = ± x sqrt(3)" in line
        for k, pm in sp["dm_pm"].items():
            assert f"{k} ±{pm:g} -> sd {pm * math.sqrt(3):.2f}" in line
    d = bench["design"]
    upper = d["sd"] * math.sqrt(d["sd_df"] / stats.chi2.ppf(0.05, d["sd_df"]))
    assert f"its 95% upper bound: sd {upper:.2f} (chi-square with bench.design.sd_df = 16" in out
    assert round(upper, 2) == 7.50
    for a, b in bench["comparisons"]:
        block = out.split(f"    {a} - {b}: published gap", 1)[1]
        assert "the papers' spread: sd_a" in block.splitlines()[1] and f"its 95% upper bound {upper:.2f}" in block


def test_the_runs_and_gpu_hours_agree_with_the_plan():
    """The run count in bench.design.gpu_hours and in docs/benchmark.md's presets table is the plan's."""
    from mtl.bench.regimes import plan, regime_configs
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(PRESET)
    loaded, errors = regime_configs(cfg, PRESET, [])
    assert errors == []
    runs = len(plan(cfg, loaded=loaded))
    bench = _bench(PRESET)
    assert runs == len(bench["seeds"]) * (len(bench["methods"]) + 11) == 756
    assert f"for the {runs} runs" in bench["design"]["gpu_hours"]
    row = next(ln for ln in open(DOC).read().splitlines() if ln.startswith("| `qm9` ("))
    assert row.rstrip().endswith(f"| {runs} |") and f"| {len(bench['seeds'])} |" in row


def test_design_spreads_keys_are_checked():
    """bench.design.spreads: an unknown key in an entry is refused naming it, so is a kind other than sd / sem, an
    sem without the paper's seeds and a ± that is not a positive number."""
    from mtl.bench.options import bench_option_errors

    bad = {"bench": {"design": {"spreads": [{"sourc": "x", "kind": "se", "dm_pm": {"a": -1.0}},
                                            {"source": "y", "kind": "sem", "seeds": 1, "dm_pm": {"b": 2.0}}]}}}
    errors = bench_option_errors(bad)[1]
    assert any("bench.design.spreads[0]: unknown option 'sourc'" in e and "spreads[0].source" in e for e in errors)
    assert any(e.startswith("bench.design.spreads[0].kind: 'se'") for e in errors)
    assert any(e.startswith("bench.design.spreads[0].dm_pm.a: -1.0") for e in errors)
    assert any(e.startswith("bench.design.spreads[1].seeds: 1") for e in errors)
    good = {"bench": {"design": {"spreads": [{"source": "y", "kind": "sem", "seeds": 3, "dm_pm": {"b": 2.0}}]}}}
    options, errors = bench_option_errors(good)
    assert errors == [] and options.design.spreads[0].dm_pm == {"b": 2.0}


def test_qm9_plan_prints_a_pilot_whose_command_is_valid(capsys):
    """--plan prints a one-seed, one-epoch pilot of every method and baseline: its command, run here with --plan
    (the real loader and checks, no training), plans exactly that; and it says the pilot measures no seed spread."""
    import shlex

    out = _qm9_plan(capsys)
    block = out.split("\npilot (", 1)[1]
    line = next(ln for ln in block.splitlines() if ln.strip().startswith("python -m mtl.tools.bench"))
    args = shlex.split(line.split("(add", 1)[0])[3:]
    assert args == ["--preset", "qm9", "bench.seeds=[0]", "trainer.max_steps=923", "output_dir=runs/bench_qm9_pilot"]
    assert "it does not measure the seed spread" in block and "step time" in block and "results/" in block
    pilot = _qm9_plan(capsys, *args[2:])
    bench = _bench(PRESET)
    assert pilot.startswith(f"{len(bench['methods']) + 11} runs\n")
    assert "seeds: 1 [0];" in pilot and "trainer: max_steps=923 " in pilot and "power none (fewer than 2 seeds" in pilot
