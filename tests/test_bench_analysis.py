"""The benchmark's analysis and interface: each run's evaluation selected on validation and reported on a held-out
test split (which the trainer evaluates beside validation), Δm's sign, the bench keys' checks, plots, --plan and --help."""

import json
import os
import statistics
import subprocess

import pytest

from .conftest import PY, ROOT, TINY

SPECS = [("cls_acc", "cls", True), ("gen_bleu4", "gen", True), ("gen_chrf", "gen", True)]


def _run(val: dict, test: dict) -> dict:
    """A run as read_run returns it: validation curves and test values by step."""
    steps = sorted(next(iter(val.values())))
    return {"eval_steps": steps, "val": {k: sorted(v.items()) for k, v in val.items()},
            "test": {k: dict(v) for k, v in test.items()}}


def test_the_best_validation_evaluation_is_reported_on_test():
    from mtl.bench.results import select
    from mtl.delta_m import delta

    ref = {"cls_acc": 0.8, "gen_bleu4": 0.5, "gen_chrf": 0.5}
    # validation peaks at step 200 (cls 0.75, the same gen), the test split peaks elsewhere (step 300): the
    # report is step 200's test values, never the test split's own best
    val = {"cls_acc": {100: 0.5, 200: 0.75, 300: 0.7}, "gen_bleu4": {100: 0.4, 200: 0.4, 300: 0.4},
           "gen_chrf": {100: 0.4, 200: 0.4, 300: 0.4}}
    test = {"cls_acc": {100: 0.45, 200: 0.6, 300: 0.9}, "gen_bleu4": {100: 0.3, 200: 0.35, 300: 0.5},
            "gen_chrf": {100: 0.3, 200: 0.36, 300: 0.5}}
    d = _run(val, test)
    select(d, SPECS, ref, "best", "test")
    assert d["selected_step"] == 200 and (d["cls_acc"], d["gen_bleu4"], d["gen_chrf"]) == (0.6, 0.35, 0.36)
    select(d, SPECS, ref, "last", "test")
    assert d["selected_step"] == 300 and d["cls_acc"] == 0.9
    select(d, SPECS, ref, "best", "validation")  # no test split: the chosen evaluation itself (optimistic)
    assert d["selected_step"] == 200 and d["cls_acc"] == 0.75
    # a single-task baseline is selected on its own task's metrics
    b = _run({"cls_acc": {100: 0.9, 200: 0.7}}, {"cls_acc": {100: 0.85, 200: 0.95}})
    select(b, SPECS, ref, "best", "test")
    assert b["selected_step"] == 100 and b["cls_acc"] == 0.85
    # Δm: lower is better, per task then over tasks: cls 0.6 vs 0.8 = +25, gen (-30 - 28) / 2 = +29 -> +27
    assert abs(delta({"cls_acc": 0.6, "gen_bleu4": 0.35, "gen_chrf": 0.36}, ref, SPECS) - 27.0) < 1e-9
    assert abs(delta({"cls_acc": 1.0, "gen_bleu4": 0.5, "gen_chrf": 0.5}, ref, SPECS) + 12.5) < 1e-9  # better: < 0
    assert delta({"cls_acc": 0.6}, ref, SPECS) != delta({"cls_acc": 0.6}, ref, SPECS)  # a missing metric: nan
    assert abs(delta({"cls_acc": 0.6}, ref, SPECS, partial=True) - 25.0) < 1e-9


@pytest.mark.slow  # a short training run with two evaluations (~10 s): the fast tier keeps its 2 minutes
def test_the_trainer_evaluates_a_test_split_beside_validation(tmp_path):
    """data.synthetic.test_size: another stream of images (seed + test_seed_offset), evaluated at every evaluation
    and logged as test_<metric>; without it nothing changes."""
    from mtl.data.loader import build_datasets, build_test_dataset
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(TINY, ["data.synthetic.test_size=16"])
    train, val = build_datasets(cfg)
    test = build_test_dataset(cfg, train)
    assert len(test) == 16 and test.normalization == val.normalization
    assert not (test[0]["image"] == val[0]["image"]).all()  # not the validation images
    assert build_test_dataset(load_run_config(TINY, []), train) is None
    out = tmp_path / "run"
    proc = subprocess.run([PY, "train.py", "--config", TINY, f"output_dir={out}", "trainer.max_steps=2",
                           "trainer.eval_every=2", "checkpoint.every_steps=0", "data.synthetic.test_size=16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "metrics.jsonl") as f:
        ev = [r for r in map(json.loads, f) if r["kind"] == "eval"][-1]
    assert {"cls_acc", "gen_bleu4", "test_cls_acc", "test_gen_bleu4", "test_gen_chrf"} <= set(ev)


@pytest.mark.parametrize("extra, error", [
    (["bench.baselines=false"], "bench.select=best selects on validation"),
    (["bench.alpha=1.5"], "bench.alpha: 1.5 must lie in (0, 1)"),
    (["bench.select=first"], "bench.select: 'first' must be best"),
    (["bench.launcher=pbs"], "bench.launcher: 'pbs' must be one of local, slurm"),
])
def test_bench_keys_are_checked(tmp_path, extra, error):
    from mtl.bench.regimes import regime_configs
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={tmp_path}", *extra]
    _, errors = regime_configs(load_run_config(TINY, over), TINY, over)
    assert any(e.startswith(error) for e in errors), errors
    assert os.listdir(tmp_path) == []


def test_plots_show_every_baseline_in_the_legend_in_its_own_colour_with_bands(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtl.bench.plots import write_plots
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(TINY, [])
    methods = [f"m{i}" for i in range(21)]  # more methods than the palette's 20 colours

    def run(seed, task=None):
        metrics = {"cls_acc": 0.5 + seed / 100, "gen_bleu4": 0.3, "gen_chrf": 0.3}
        if task:
            metrics = {k: v for k, v in metrics.items() if k.startswith(task)}
        return {"t0": 0.0, "evals": [{"step": s, "time": float(s), **metrics} for s in (10, 20)],
                "train": [{"step": s, "weight_cls": 1.0, "weight_gen": 1.0} for s in (10, 20)]}

    data = {m: [run(0), run(1), run(2)] for m in methods}
    data.update({"single_cls": [run(s, "cls") for s in range(3)], "single_gen": [run(s, "gen") for s in range(3)]})
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, path, **k: figures.append((os.path.basename(path), self)))
    write_plots(cfg, SPECS, data, str(tmp_path), methods)
    fig = dict(figures)["metrics_vs_step.png"]
    handles = {t.get_text(): h for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    assert {"single_cls", "single_gen", "m0", "m20"} <= set(handles)
    method_colours = {matplotlib.colors.to_hex(handles[m].get_color()) for m in methods}
    for b in ("single_cls", "single_gen"):
        assert matplotlib.colors.to_hex(handles[b].get_color()) not in method_colours
    bands = [c for ax in fig.axes for c in ax.collections]  # fill_between: one band per line
    assert len(bands) == sum(len(ax.lines) for ax in fig.axes) and len(bands) > 0


def test_plan_lists_every_run_and_help_names_overrides_and_outputs(capsys):
    from mtl.bench.sweep import main

    assert main(["--config", TINY, "bench.methods=[equal,'cagrad(c=0.2)']", "bench.seeds=[0,1]", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "8 runs" in out
    assert "[3/8] natural cagrad(c=0.2) seed 0: runs/tiny/runs/natural/cagrad_c=0.2/seed0  weighting.method=cagrad " \
           "weighting.source=parameters weighting.options.c=0.2 ddp.strategy=task_grads" in out.replace(os.sep, "/")
    assert "[8/8] natural single_gen seed 1:" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for words in ("key=value", "bench.seeds=[0,1,2]", "results.md", "runs.jsonl", "bench_run.json", "--on-change",
                  "--analyze"):
        assert words in text, words


def test_the_bench_section_is_the_tools_own_and_checked_by_it(tmp_path, capsys):
    """The core schema keeps ``bench:`` as a mapping that train.py ignores; the tool checks it against its own
    dataclasses: a mistyped key is one message with the nearest key (exit 2), a wrong type names the key. A config
    built on another (``base:``) and the command line change only the bench keys they name, at every depth."""
    from mtl.bench.options import bench_option_errors, bench_options
    from mtl.bench.sweep import main
    from mtl.setup.checks import load_run_config

    assert load_run_config(TINY, ["bench.seedz=[0]"]).bench == {"seedz": [0]}  # train.py's loader lets it pass
    assert main(["--config", TINY, "bench.seedz=[0]", "bench.slurm.partiton=gpu", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "bench: unknown option 'seedz' — did you mean 'bench.seeds'?" in err, err
    assert "bench.slurm: unknown option 'partiton' — did you mean 'bench.slurm.partition'?" in err, err
    _, errors = bench_option_errors(load_run_config(TINY, ["bench.alpha=often", "bench.published.dm.ls=high"]))
    assert any(e.startswith("bench.alpha: bad value 'often'") for e in errors), errors
    assert any(e.startswith("bench.published.dm: bad value") and "'high'" in e for e in errors), errors
    base = tmp_path / "base.yaml"
    base.write_text(f"base: {TINY}\nbench:\n  seeds: [3, 4]\n  slurm: {{partition: gpu, time_min: 30}}\n"
                    "  regimes: {natural: {expect: kept}}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nbench:\n  slurm: {time_min: 90}\n  regimes: {scaled: {overrides: [loss_scale.gen=2]}}\n")
    b = bench_options(load_run_config(str(child), ["bench.parallel=2"]))
    assert (b.seeds, b.parallel, b.slurm.partition, b.slurm.time_min) == ([3, 4], 2, "gpu", 90)
    assert b.regimes == {"natural": {"expect": "kept"}, "scaled": {"overrides": ["loss_scale.gen=2"]}}
    assert bench_options(load_run_config(TINY, [])).methods[0] == "equal"  # the tool's defaults
    # NaN passes every range check: refused in every number of the section
    _, errors = bench_option_errors(load_run_config(TINY, ["bench.plateau_tol=nan", "bench.published.dm.ls=inf"]))
    assert "bench.plateau_tol: must be finite (got nan)" in errors and "bench.published.dm.ls: must be finite (got inf)" \
        in errors, errors


def test_a_row_says_which_of_its_runs_failed_and_which_are_only_missing():
    """A run still training (or not yet started) when the tables are read is missing, not failed."""
    from mtl.bench.tables import _not_ok_note

    assert _not_ok_note({"runs": 3, "runs_ok": 2, "failed": ["seed 2: missing"]}) == " (1 of 3 missing)"
    assert _not_ok_note({"runs": 3, "runs_ok": 0, "failed": ["seed 0: failed", "seed 1: missing",
                                                            "seed 2: missing"]}) == " (1 of 3 failed, 2 missing)"
    assert _not_ok_note({"runs": 5, "runs_ok": 0, "failed": [f"seed {i}: failed" for i in range(5)]}) == \
        " (5 of 5 failed)"
    assert _not_ok_note({"runs": 3, "runs_ok": 3, "failed": []}) == ""


def test_between_regimes_marks_only_runs_of_the_same_length():
    """A short regime read for its cost only (40 steps against 1320) is not tested against the reference regime:
    its row in "Between regimes" gives the difference without a ▲ / ▼ and without counting in Holm's m; a regime of
    the same length is still tested and marked (issue 32.8)."""
    from omegaconf import OmegaConf

    from mtl.bench.results import regime_effects
    from mtl.bench.tables import effects_table

    def row(method, delta_m, steps, shift):
        seeds = {s: {"delta_m": delta_m + shift * s, "steps": steps} for s in range(3)}
        return {"method": method, "level": "loss", "delta_m": delta_m, "_seeds": seeds}

    rows = {"natural": [row("equal", 30.0, 1320, 0.1), row("uw", 31.0, 1320, 0.2)],
            "cost": [row("equal", 170.0, 40, 0.3), row("uw", 175.0, 40, 0.1)],
            "scaled": [row("equal", 60.0, 1320, 0.2), row("uw", 32.0, 1320, 0.3)]}
    cfg = OmegaConf.create({"bench": {"alpha": 0.05}})
    effects = regime_effects(cfg, rows)
    text = effects_table(cfg, effects)
    cost = [line for line in text.splitlines() if line.startswith("| `cost`")]
    scaled = [line for line in text.splitlines() if line.startswith("| `scaled`")]
    assert len(cost) == 2 and all("▲" not in line and "▼" not in line and "not tested: 40 steps against 1320" in line
                                  for line in cost), text
    assert "+140.20 (not tested" in cost[0], cost[0]
    assert "▲" in scaled[0], text  # the same length: tested, and equal's +30 on every seed is marked
    assert "across the 2 comparisons" in text, text  # Holm's m: the tested rows only
    # only the short regime: nothing is tested, and the lead says so (not "fewer than 3 seeds": there are 3)
    text = effects_table(cfg, regime_effects(cfg, {k: rows[k] for k in ("natural", "cost")}))
    assert "**Detectable here: not said (no difference in this table is tested).**" in text, text
    assert "fewer than 3 seeds" not in text, text


def test_between_regimes_reads_only_the_seeds_finished_in_both():
    """A run that failed in one regime (seed 2 of `scaled`) leaves its seed out of the comparison, the test and both
    Δm printed beside the change, so the change is their difference (issue 44, 6); the seeds are named. A method
    finished on the same seeds in both gets no note."""
    from omegaconf import OmegaConf

    from mtl.bench.results import regime_effects
    from mtl.bench.tables import effects_table

    def row(method, values):
        seeds = {s: {"delta_m": v, "steps": 100} for s, v in values.items()}
        return {"method": method, "level": "loss", "delta_m": statistics.mean(values.values()), "_seeds": seeds}

    rows = {"natural": [row("equal", {0: 30.0, 1: 32.0, 2: 60.0}), row("uw", {0: 30.0, 1: 31.0, 2: 32.0})],
            "scaled": [row("equal", {0: 31.0, 1: 33.5}), row("uw", {0: 31.0, 1: 32.0, 2: 33.0})]}
    cfg = OmegaConf.create({"bench": {"alpha": 0.05}})
    effects = {e["method"]: e for e in regime_effects(cfg, rows)}
    eq = effects["equal"]
    assert (eq["delta_m_ref"], eq["delta_m"], eq["change"]) == (31.0, 32.25, 1.25)  # formerly 40.67 beside 1.25
    assert eq["seeds"] == [0, 1]
    assert effects["uw"]["seeds"] is None and effects["uw"]["delta_m_ref"] == 31.0
    text = effects_table(cfg, list(effects.values()))
    line = next(ln for ln in text.splitlines() if "`equal`" in ln)
    assert "`equal` (seeds 0, 1: those finished in both) | 31.00 | 32.25 | +1.25" in line, line
    assert "| `uw` | 31.00 | 32.00 | +1.00 [" in text, text
