"""The benchmark read against numbers from elsewhere, on hand-made runs with known numbers: a single-task baseline
for every task of the config, Δm against reference single-task metrics beside Δm against our own baselines, a
paper's Δm side by side with ours and Spearman's rank correlation with its interval, and the cost of both gradient
sources against equal."""

import csv
import math

import pytest

from .conftest import TINY
from .test_bench import _fake_run

TASKS = "tasks=[cls,gen,count]"
METHODS = "bench.methods=[equal, uw, mgda, 'mgda(source=features)']"
REFERENCE = ("bench.reference={source: 'a paper, Table 1', "
             "metrics: {cls: {acc: 0.8}, gen: {bleu4: 0.5, chrf: 0.5}, count: {acc: 0.4}}}")
# the reported metrics of each label (constant over steps and seeds, so every number below is exact)
METRICS = {"equal": {"cls_acc": 0.6, "gen_bleu4": 0.5, "gen_chrf": 0.5, "count_acc": 0.3},
           "uw": {"cls_acc": 0.9, "gen_bleu4": 0.5, "gen_chrf": 0.5, "count_acc": 0.6},
           "mgda": {"cls_acc": 0.6, "gen_bleu4": 0.4, "gen_chrf": 0.4, "count_acc": 0.3},
           "mgda(source=features)": {"cls_acc": 0.6, "gen_bleu4": 0.4, "gen_chrf": 0.4, "count_acc": 0.3},
           "single_cls": {"cls_acc": 0.9}, "single_gen": {"gen_bleu4": 0.5, "gen_chrf": 0.5},
           "single_count": {"count_acc": 0.6}}
STEP_TIME = {"equal": 0.1, "mgda": 0.3, "mgda(source=features)": 0.12}
PEAK = {"equal": 400.0, "mgda": 600.0, "mgda(source=features)": 440.0}


def test_every_task_gets_a_baseline_and_delta_m_is_also_read_against_the_reference(tmp_path):
    from mtl.bench.regimes import plan, regime_configs
    from mtl.bench.results import summarize
    from mtl.bench.tables import write_results
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={tmp_path}", TASKS, METHODS, "bench.seeds=[0, 1, 2]", REFERENCE]
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    assert errors == []
    runs = plan(cfg, loaded=loaded)
    assert sorted({r["label"] for r in runs if r["label"].startswith("single_")}) == \
        ["single_cls", "single_count", "single_gen"]  # one per task of the config, not only cls and gen
    assert "tasks=[count]" in next(r for r in runs if r["label"] == "single_count")["overrides"]
    for r in runs:
        _fake_run(r["dir"], [(s, METRICS[r["label"]]) for s in (100, 200)], step_time=STEP_TIME.get(r["label"], 0.1),
                  peak=PEAK.get(r["label"], 400.0))
        r["status"] = "ok"
    spec, rcfg = loaded["natural"]
    mine = [r for r in runs if not r["label"].startswith("single_")]
    rows, base = summarize(cfg, "natural", spec, rcfg, mine, [r for r in runs if r["label"].startswith("single_")])
    assert base == {"cls_acc": 0.9, "gen_bleu4": 0.5, "gen_chrf": 0.5, "count_acc": 0.6}
    by = {r["method"]: r for r in rows}
    # equal against our baselines: cls -(0.6 - 0.9) / 0.9 = +33.33, gen 0, count -(0.3 - 0.6) / 0.6 = +50 -> 27.78;
    # against the reference: cls -(0.6 - 0.8) / 0.8 = +25, gen 0, count -(0.3 - 0.4) / 0.4 = +25 -> 16.67
    assert by["equal"]["delta_m"] == pytest.approx((100 / 3 + 0 + 50) / 3)
    assert by["equal"]["delta_m_ref"] == pytest.approx((25 + 0 + 25) / 3)
    # uw equals our baselines (Δm 0) and beats the reference: cls -12.5, count -50 -> -20.83
    assert by["uw"]["delta_m"] == pytest.approx(0.0) and by["uw"]["delta_m_ref"] == pytest.approx((-12.5 - 50) / 3)
    # mgda: gen 20% worse on both metrics -> +20 for gen in both columns
    assert by["mgda"]["delta_m_ref"] == pytest.approx((25 + 20 + 25) / 3)
    # a baseline against the reference: its own task only (our single_cls 0.9 against the paper's 0.8)
    assert by["single_cls"]["delta_m_ref"] == pytest.approx(-12.5)
    assert by["single_count"]["delta_m_ref"] == pytest.approx(-50.0)
    text = write_results(cfg, {"natural": (rcfg, rows, base)}, {"regimes": {"natural": spec}})
    header = next(ln for ln in text.splitlines() if ln.startswith("| method |"))
    assert "| Δm % (lower is better) | Δm % vs reference | vs equal (Δm) |" in header
    line = next(ln for ln in text.splitlines() if ln.startswith("| `equal` |"))
    assert line.count("|") == header.count("|")
    cells = [c.strip() for c in line.split("|")]
    assert cells[header.split("|").index(" Δm % vs reference ")] == "16.67 ± 0.00"
    assert "the single-task metrics of a paper, Table 1 (cls_acc 0.8, gen_bleu4 0.5, gen_chrf 0.5, count_acc 0.4)" in text
    assert "single_cls -12.50 ± 0.00" in text
    with open(tmp_path / "results.csv") as f:
        csv_rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(csv_rows["uw"]["delta_m_ref"]) == pytest.approx((-12.5 - 50) / 3)
    with open(tmp_path / "runs.csv") as f:
        assert all(r["delta_m_ref"] not in ("", "nan") for r in csv.DictReader(f))
    # (d) the cost of both sources at K = 3: mgda 3x equal's step on the parameters, 1.2x on the features
    cost = text.split("### Cost by gradient source in `natural` (K = 3 tasks)")[1]
    assert "| `mgda` | 3.00x | 1.20x | 1.50x | 1.10x | 2.50x | 1.36x |" in cost
    # a published table is read beside the first regime only
    published = "bench.published={source: 'a paper', dm: {ls: 30.0, uw: 1.0, mgda: 40.0}, methods: {ls: equal}}"
    cfg = load_run_config(TINY, [*over, published])
    text = write_results(cfg, {"natural": (rcfg, rows, base), "again": (rcfg, rows, base)},
                         {"regimes": {"natural": spec, "again": {**spec, "baselines_from": "natural"}}})
    assert text.count("beside a paper") == 1 and "### Regime `natural` beside a paper" in text
    assert "| ls | `equal` | 30.00 | 27.78 ± 0.00 | 16.67 ± 0.00 |" in text


def test_the_reference_is_checked_against_the_tasks_and_their_metrics():
    from mtl.bench.regimes import regime_configs
    from mtl.setup.checks import load_run_config

    bad = [TASKS, "bench.methods=[equal]", "bench.reference.metrics={cls: {accuracy: 0.8}, gen: {bleu4: 0}, "
           "colour: {acc: 1}}"]
    _, errors = regime_configs(load_run_config(TINY, bad), TINY, bad)
    assert any(e.startswith("bench.reference.metrics.cls.accuracy: cls declares no metric 'accuracy' (its metrics: "
                            "acc)") for e in errors), errors
    assert any(e.startswith("bench.reference.metrics.gen.bleu4: 0 must be a finite number other than 0")
               for e in errors), errors
    assert any(e.startswith("bench.reference.metrics.colour: 'colour' is not a task") for e in errors), errors
    assert any(e.startswith("bench.reference.metrics: no value for count_acc") for e in errors), errors


# the published Δm of Nash-MTL's QM9 table, and ours in the same order but for one swap (mgda and pcgrad)
PUBLISHED = {"ls": 177.6, "si": 77.8, "uw": 108.0, "mgda": 120.5, "pcgrad": 125.7, "cagrad": 112.8, "imtlg": 77.2,
             "nashmtl": 62.0}
OURS = {"equal": 90.0, "uw": 50.0, "mgda": 70.0, "pcgrad": 60.0, "cagrad": 55.0, "imtlg": 40.0, "nashmtl": 30.0}


def _options(reference=None, **published):
    from mtl.bench.options import BenchOptions, PublishedOptions, ReferenceOptions

    return BenchOptions(published=PublishedOptions(**published),
                        reference=ReferenceOptions(source="the paper's single-task runs", metrics=reference or {}))


def _rows(values: dict, ref: dict | None = None) -> list[dict]:
    nan = float("nan")
    return [{"method": m, "level": "grad", "runs_ok": 3, "delta_m": v, "delta_m_ci": 1.0,
             "delta_m_ref": (ref or {}).get(m, nan), "delta_m_ref_ci": nan} for m, v in values.items()]


def test_the_published_table_side_by_side_with_the_rank_correlation_and_its_interval():
    from mtl.bench.compare import published_table, side_by_side

    b = _options(source="Nash-MTL, Table 3", dm=PUBLISHED, methods={"ls": "equal", "si": None})
    s = side_by_side(b, _rows(OURS))
    assert [(x["name"], x["entry"]) for x in s["rows"]][:2] == [("ls", "equal"), ("si", None)]
    # 7 methods in common; the ranks differ by one swap: sum d^2 = 2, rho = 1 - 6 * 2 / (7 * 48)
    rho = 1 - 6 * 2 / (7 * (7 ** 2 - 1))
    z, se = math.atanh(rho), math.sqrt(1.06 / (7 - 3))
    assert s["own"]["n"] == 7 and s["own"]["rho"] == pytest.approx(rho)
    assert s["own"]["lo"] == pytest.approx(math.tanh(z - 1.959964 * se), abs=1e-6)
    assert s["own"]["hi"] == pytest.approx(math.tanh(z + 1.959964 * se), abs=1e-6)
    assert 0 < s["own"]["p"] < 0.01
    assert s["ref"]["n"] == 0 and s["ref"]["rho"] != s["ref"]["rho"]  # no reference column: no correlation
    text = published_table(b, "natural", _rows(OURS))
    assert "| si | (not in mtl) | 77.80 | — |" in text and "| ls | `equal` | 177.60 | 90.00 ± 1.00 |" in text
    assert f"ρ = +{rho:.2f} over 7 methods" in text and "Fieller–Hartley–Pearson" in text
    # against the reference too; a method the sweep did not run is listed and left out
    ours = {k: v for k, v in OURS.items() if k != "cagrad"}
    b = _options(reference={"t": {"mae": 1.0}}, source="Nash-MTL, Table 3", dm=PUBLISHED,
                 methods={"ls": "equal", "si": None})
    s = side_by_side(b, _rows(ours, ref={k: v + 1 for k, v in ours.items()}))
    assert s["ref"]["n"] == 6 and s["ref"]["rho"] == pytest.approx(1 - 6 * 2 / (6 * 35))
    text = published_table(b, "natural", _rows(ours, ref={k: v + 1 for k, v in ours.items()}))
    assert "| cagrad | `cagrad` (not run) | 112.80 | — | — |" in text and "our Δm % (reference)" in text
    # a perfect agreement has no Fisher-z interval (z is infinite), and says so
    s = side_by_side(b, _rows({k: PUBLISHED[k] for k in ("uw", "mgda", "pcgrad", "imtlg")}))
    assert s["own"]["rho"] == pytest.approx(1.0) and s["own"]["lo"] != s["own"]["lo"]
    assert "ρ = ±1, where Fisher's z is infinite" in published_table(b, "natural", _rows(
        {k: PUBLISHED[k] for k in ("uw", "mgda", "pcgrad", "imtlg")}))


def test_published_names_must_map_to_methods_of_mtl():
    from mtl.bench.compare import published_errors

    known = {"equal", "uw", "mgda"}
    errors = published_errors(_options(dm={"ls": 1.0, "si": 2.0, "uw": 3.0}, methods={"ls": "equal", "x": "mgda"}),
                              known)
    assert any(e.startswith("bench.published.dm.si: 'si' is not a method of mtl; map the paper's name")
               for e in errors), errors
    assert any(e.startswith("bench.published.methods.x: 'x' is not in bench.published.dm") for e in errors), errors
    assert len(errors) == 2
    assert published_errors(_options(dm={"ls": 1.0, "si": 2.0}, methods={"ls": "equal", "si": None}), known) == []


def test_the_cost_table_pairs_each_method_s_two_sources():
    from mtl.bench.compare import cost_pairs, cost_table

    def row(method, level, t, m):
        return {"method": method, "level": level, "runs_ok": 2, "step_time_s": t, "peak_mem_mb": m,
                "time_vs_equal": t / 0.1, "mem_vs_equal": m / 400.0}

    rows = [row("equal", "loss", 0.1, 400.0), row("cagrad(c=0.2)", "grad", 0.5, 800.0),
            row("cagrad(c=0.2, source=features)", "grad", 0.2, 500.0), row("pcgrad", "grad", 0.3, 600.0),
            row("cagrad", "grad", 0.4, 700.0)]
    pairs = {p["method"]: p for p in cost_pairs(rows)}
    assert set(pairs) == {"cagrad(c=0.2)", "pcgrad", "cagrad"}
    assert pairs["cagrad(c=0.2)"]["features"]["method"] == "cagrad(c=0.2, source=features)"
    text = cost_table("natural", rows, 11)
    assert "(K = 11 tasks)" in text
    assert "| `cagrad(c=0.2)` | 5.00x | 2.00x | 2.00x | 1.25x | 2.50x | 1.60x |" in text
    assert "`pcgrad`" not in text and "| `cagrad` |" not in text  # on one source only: no pair
    assert cost_table("natural", rows[:1] + rows[3:], 11) == ""


def test_plan_prints_the_protocol_from_the_config(capsys):
    """--plan: the protocol the runs follow, read from the config (tasks and Δm's metrics, data, batch, optimizer,
    steps, selection, seeds, baselines) with the reference and the published table it will be read against."""
    from mtl.bench.sweep import main

    published = ("bench.published={source: 'a paper', dm: {ls: 2.0, si: 1.0, uw: 1.5}, methods: {ls: equal, si: null,"
                 " uw: uw}}")
    assert main(["--config", TINY, TASKS, "bench.methods=[equal]", "bench.seeds=[0, 1]", REFERENCE, published,
                 "bench.protocol='as the paper says'", "optim.lr=0.002", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "8 runs" in out and "in words: as the paper says" in out
    assert "tasks (K = 3): cls, gen, count; Δm over cls_acc (higher is better)" in out
    assert "batch 8 per process x 1 process(es) = 8" in out and "lr=0.002" in out and "max_steps=6" in out
    assert "single-task baselines: single_cls, single_gen, single_count" in out and "seeds: [0, 1]" in out
    assert "Δm also against a paper, Table 1: cls_acc 0.8, gen_bleu4 0.5, gen_chrf 0.5, count_acc 0.4" in out
    # uw is in mtl and mapped, but this sweep does not run it
    assert "read beside a paper: ls 2 (ours: equal), si 1 (ours: not in mtl), uw 1.5 (ours: uw, not run here)" in out


@pytest.mark.parametrize("preset", ["full", "quick", pytest.param("gpu", marks=pytest.mark.slow), "qm9", "qm9_cpu"])  # gpu: 290 runs, ~8 s
def test_every_preset_plans(preset, capsys):
    """Each preset's config checks and plans (``--plan``: the protocol and every run). The QM9 presets are built on
    configs/qm9.yaml and qm9_cpu.yaml (the QM9 data source and its tasks)."""
    import os

    from mtl.bench.sweep import main

    from .conftest import ROOT

    base = {"qm9": "qm9.yaml", "qm9_cpu": "qm9_cpu.yaml"}.get(preset)
    if base and not os.path.isfile(os.path.join(ROOT, "configs", base)):
        pytest.skip(f"configs/{base} (the QM9 configs) is not in this checkout")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the presets are paths from the repository's root, as make runs them
    try:
        assert main(["--preset", preset, "--plan"]) == 0, capsys.readouterr().err
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "protocol (from the config" in out
    if preset.startswith("qm9"):
        assert "tasks (K = 11)" in out and "single_Cv" in out and "read beside Nash-MTL" in out


def test_a_single_task_run_of_a_plateau_preset_keeps_only_its_task_s_baseline():
    """configs/qm9.yaml's plateau schedule names a baseline for each of its 11 tasks; a single-task run of the QM9
    presets narrows them to its task's, so that its config passes the check."""
    import os

    from mtl.bench.regimes import plan
    from mtl.setup.checks import load_run_config

    from .conftest import ROOT

    path = os.path.join(ROOT, "configs", "bench_qm9_cpu.yaml")
    if not os.path.isfile(path):
        pytest.skip("configs/bench_qm9_cpu.yaml (the QM9 presets) is not in this checkout")
    runs = {(r["label"], r["seed"]): r for r in plan(load_run_config(path, ["bench.seeds=[0]"]))}
    single = load_run_config(path, runs[("single_U0", 0)]["overrides"])
    assert list(single.tasks) == ["U0"]
    assert dict(single.optim.plateau.baselines) == {"U0_mae": 58.838}
    equal = load_run_config(path, runs[("equal", 0)]["overrides"])
    assert len(equal.optim.plateau.baselines) == 11


@pytest.mark.parametrize("relative, tol, converged", [(False, 0.005, False), (False, 0.007, True), (True, 0.8, False),
                                                     (True, 1.2, True)])
def test_the_plateau_rule_reads_the_change_over_the_window_in_the_metrics_units_or_in_percent_of_its_baseline(
        tmp_path, relative, tol, converged):
    """equal's count_acc still rises 0.003 per 100 steps, 0.006 over the window of 3 evaluations 100 steps apart:
    more than an absolute 0.005, less than 0.007; in % of its single-task baseline (0.6) 1.0 % over the window, so
    bench.plateau_relative with 0.8 % calls it improving and with 1.2 % converged (the seeds agree exactly: both
    bounds are the mean)."""
    from mtl.bench.regimes import plan, regime_configs
    from mtl.bench.results import summarize
    from mtl.bench.tables import write_results
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={tmp_path}", TASKS, "bench.methods=[equal]", "bench.seeds=[0, 1, 2]", "bench.last_k=3",
            f"bench.plateau_relative={str(relative).lower()}", f"bench.plateau_tol={tol}"]
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    assert errors == []
    runs = plan(cfg, loaded=loaded)
    for r in runs:
        drift = 0.003 if r["label"] == "equal" else 0.0
        _fake_run(r["dir"], [(s, {k: v + (drift * s / 100 if k == "count_acc" else 0.0)
                                  for k, v in METRICS[r["label"]].items()}) for s in (100, 200, 300)])
        r["status"] = "ok"
    spec, rcfg = loaded["natural"]
    rows, base = summarize(cfg, "natural", spec, rcfg, [r for r in runs if r["label"] == "equal"],
                           [r for r in runs if r["label"].startswith("single_")])
    eq = next(r for r in rows if r["method"] == "equal")
    assert eq["count_acc_slope"] == pytest.approx(0.5 if relative else 0.003)
    assert eq["count_acc_window"] == pytest.approx(1.0 if relative else 0.006)
    assert eq["plateau"] == ("converged" if converged else "improving")
    assert eq["moving"] == ([] if converged else ["count_acc"])
    assert all(r["plateau"] == "converged" for r in rows if r["method"].startswith("single_"))  # flat, either scale
    text = write_results(cfg, {"natural": (rcfg, rows, base)}, {"regimes": {"natural": spec}})
    assert ("in % of the single-task baseline" in text) is relative
    assert ("count_acc change % over the window" in text) is relative


def test_an_undetermined_metric_is_never_read_as_converged_and_the_verdicts_are_counted():
    """``results.converged`` on per-seed windows: a metric whose seeds disagree widely (mean improvement 9, the
    former rule's "converged") is undetermined, and so is its run; one improving metric makes the run improving; the
    table's cell names both kinds and the line above it counts rows and metrics."""
    from mtl.bench.results import converged
    from mtl.bench.tables import verdict_cell, verdict_counts

    specs = [("a", "t", False), ("b", "t", False)]  # two error metrics (lower is better): a fall is an improvement
    row = {"a": 1.0, "b": 1.0}
    wide = {s: {"a_window": -w, "b_window": -0.1} for s, w in enumerate((1.0, 25.0, 1.0))}  # a: mean 9, sd 13.9
    steady = {s: {"a_window": -20.0 - s, "b_window": -0.1} for s in range(3)}  # a: 20-22 on every seed
    flat = {s: {"a_window": -0.1 * s, "b_window": 0.0} for s in range(3)}
    rows = []
    for seeds, want, per in ((wide, "undetermined", {"a": "undetermined", "b": "converged"}),
                             (steady, "improving", {"a": "improving", "b": "converged"}),
                             (flat, "converged", {"a": "converged", "b": "converged"})):
        verdict, per_metric = converged(row, seeds, specs, 5.0)
        assert (verdict, per_metric) == (want, per)
        rows.append({"plateau": verdict, "verdicts": per_metric})
    assert converged(row, {0: wide[0]}, specs, 5.0) == (None, {})  # one seed decides nothing
    assert [verdict_cell(r) for r in rows] == ["undetermined: a", "improving: a", "converged"]
    rows.append({"plateau": None, "verdicts": {}})
    assert verdict_cell(rows[-1]) == "not decided (one seed or one evaluation)"
    assert verdict_counts(rows) == ("Verdicts: 4 methods and baselines (each over its seeds), 1 converged, "
                                    "1 improving, 1 undetermined, 1 not decided; 6 metrics, 4 converged, "
                                    "1 improving, 1 undetermined.")
