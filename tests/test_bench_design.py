"""The design of the QM9 benchmark (issue 35.3-4, 6): the authors'-settings table of docs/benchmark.md against the
`qm9` preset, the preset's assumed spread recomputed from the committed CPU runs, the pre-registered comparisons
(checked, tabled with Holm across them only, printed by --plan), and the statements docs/benchmark.md makes about the
committed CPU results' convergence."""

import csv
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
    from mtl.bench.entries import method_spec
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
        for key, value in re.findall(r"`(\w+)=([^`]+)`", theirs):  # their setting: the entry's option or our default
            want = yaml.safe_load(value)
            got = options[key] if key in options else getattr(defaults, key)
            assert got == want, (entry, key, got, want)
            checked += 1
    assert checked >= 6  # uw's lr, mgda's normalization, pcgrad's reduction, cagrad's c and rescale, nashmtl's two
    listed = " ".join(r[2] for r in rows)
    assert all(f"`{e}`" in listed for e in bench["methods"]), "an entry of the qm9 preset has no row"


def test_the_authors_settings_check_catches_a_drift(tmp_path, monkeypatch):
    """The check above fails when the preset loses an authors' setting (nashmtl without its clip)."""
    text = open(PRESET).read().replace('"nashmtl(max_norm=1.0)"', "nashmtl")
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


def test_the_design_spread_is_the_cpu_runs_spread_of_the_same_comparisons():
    """bench.design.sd of the qm9 preset: the pooled sd of the per-seed Δm differences of its 8 comparisons, each
    method mapped (through the published names) to its entry in the CPU preset, in results/qm9_cpu/runs.csv."""
    from mtl.bench.stats import pooled_sd

    gpu, cpu = _bench(PRESET), _bench(CPU_PRESET)
    to_paper = {v: k for k, v in gpu["published"]["methods"].items() if v}
    to_cpu = lambda e: cpu["published"]["methods"].get(to_paper.get(e, e), to_paper.get(e, e))  # noqa: E731
    dm = _cpu_delta_m()
    groups = [[dm[to_cpu(a)][s] - dm[to_cpu(b)][s] for s in dm["equal"]] for a, b in gpu["comparisons"]]
    assert len(groups) == 8 and all(len(g) == 3 for g in groups)
    sd, n = pooled_sd(groups)
    assert round(sd, 2) == gpu["design"]["sd"] and n == 3


def test_the_statements_on_the_cpu_runs_convergence():
    """docs/benchmark.md: equal's slope intervals exclude 0 for homo, U, H and G only; no single-task baseline's
    does. The three verdicts (5% of the baseline over the window, two one-sided 95% bounds) on the same runs:
    `equal` converged on r2 only, its 6 metrics still improving by 8-11% over the window undetermined, never
    converged (the former rule, converged unless shown improving, called all 11 converged); uw improving on homo,
    lumo, zpve, U0, U and H; every single-task baseline undetermined."""
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


def test_qm9_plan_prints_the_design(capsys):
    """--preset qm9 --plan: the seeds, the 8 pre-registered comparisons with their published gaps, the Holm-level
    detectable difference, and the places for the jobs' time limit and the GPU-hours."""
    from mtl.bench.sweep import main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["--preset", "qm9", "--plan"]) == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "seeds: 10 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in out
    assert "Holm across the m = 8 pre-registered comparisons" in out and "α/m = 0.00625" in out
    assert "detectable with 80% power at Holm's level α/m: 6.81 Δm points" in out
    assert "nashmtl(max_norm=1.0) - imtlg: published gap -15.2;" in out and "seeds for 80%: 5" in out
    assert "time limit per job: bench.slurm.time_min" in out and "GPU-hours:" in out
