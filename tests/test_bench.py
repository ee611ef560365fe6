"""The weighting benchmark end to end on the tiny config: tables, plots, failures recorded, re-runs skip."""

import csv
import json
import os
import subprocess

import pytest

from .conftest import PY, ROOT, TINY

FAST = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=1", "checkpoint.every_steps=0",
        "bench.seeds=[0]", "bench.last_k=2"]


def bench(out, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # mlflow's local store, as by default
    return subprocess.run([PY, "-m", "mtl.tools.bench.sweep", "--config", TINY, f"output_dir={out}", *FAST, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_bench_writes_results_records_failures_and_skips_finished_runs(tmp_path):
    """One small sweep, each run its own process, two at a time: two regimes (the second scales gen's loss by 100 and
    borrows the first's baselines), a method with an option, a Gram method on the features source, a user's method
    from one file, and static without weights (a config error for that run only: recorded, the sweep goes on)."""
    out = tmp_path / "bench"
    user = USER_METHOD
    methods = "bench.methods=[equal,'pcgrad(reduction=mean)','unit_gradients(source=features)',static]"
    regimes = ("bench.regimes={natural: {expect: 'the reference'}, scaled: {overrides: [loss_scale.gen=100], "
               "baselines_from: natural, methods: [equal], expect: 'equal loses cls'}}")
    args = [methods, regimes, f"weighting_modules=[{user}]", "bench.parallel=2", "logging.trackers=[tensorboard,mlflow]"]
    proc = bench(out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "7 runs" in proc.stdout and "[1/7] natural equal seed 0: training" in proc.stdout and "FAILED" in proc.stdout
    with open(out / "runs.jsonl") as f:
        status = {(r["regime"], r["label"], r["seed"]): r for r in map(json.loads, f)}
    assert status[("natural", "static", 0)]["status"] == "failed"
    assert "weighting.weights" in status[("natural", "static", 0)]["error"]
    assert all(r["status"] == "ok" for k, r in status.items() if k[1] != "static"), status
    with open(out / "results.csv") as f:
        rows = {(r["regime"], r["method"]): r for r in csv.DictReader(f)}
    nat = {m: r for (g, m), r in rows.items() if g == "natural"}
    assert set(nat) == {"equal", "pcgrad(reduction=mean)", "unit_gradients(source=features)", "static",
                        "single_cls", "single_gen"}
    assert nat["pcgrad(reduction=mean)"]["runs_ok"] == "1" and nat["pcgrad(reduction=mean)"]["level"] == "grad"
    user_row = nat["unit_gradients(source=features)"]  # the docs' user method joined the sweep, on the features
    assert user_row["runs_ok"] == "1" and user_row["source"] == "features" and user_row["strategy"] == "feature_leaf"
    assert "source: features" in (out / "runs" / "natural" / "unit_gradients_source=features" / "seed0" /
                                  "config.yaml").read_text()
    assert "reduction: mean" in (out / "runs" / "natural" / "pcgrad_reduction=mean" / "seed0" / "config.yaml").read_text()
    assert nat["static"]["runs_ok"] == "0"
    for key in ("cls_acc", "gen_bleu4", "gen_chrf", "delta_m", "selected_step", "mean_rank", "time_vs_equal",
                "cls_acc_slope", "peak_mem_mb", "mem_vs_equal"):
        assert nat["equal"][key] not in ("", "nan"), key
    assert float(nat["equal"]["time_vs_equal"]) == 1.0 and float(nat["equal"]["mem_vs_equal"]) == 1.0
    for m in ("equal", "pcgrad(reduction=mean)", "unit_gradients(source=features)", "single_cls"):
        assert float(nat[m]["peak_mem_mb"]) > 100, m  # each run's own process: python + torch, never n/a
    assert float(nat["pcgrad(reduction=mean)"]["combine_s"]) > 0 and float(nat["equal"]["combine_s"]) == 0
    assert float(nat["pcgrad(reduction=mean)"]["allreduce_mb"]) > float(nat["equal"]["allreduce_mb"])
    assert set(m for g, m in rows if g == "scaled") == {"equal", "single_cls", "single_gen"}
    _check_one_mlflow_store(out, status)

    # the regime reached its run: same seed, same first batch and initial weights, gen's loss 100 x at step 1

    def first_loss(regime):
        with open(out / "runs" / regime / "equal" / "seed0" / "metrics.jsonl") as f:
            first = next(r for r in map(json.loads, f) if r["kind"] == "train")
        return first["step"], first["loss_gen"], first["loss_cls"]

    (s1, gen_n, cls_n), (s2, gen_s, cls_s) = first_loss("natural"), first_loss("scaled")
    assert s1 == s2 == 1 and abs(gen_s / gen_n - 100) < 1e-3 and abs(cls_s - cls_n) < 1e-5 * cls_n
    for png in ("metrics_vs_step.png", "metrics_vs_wall.png", "task_weights.png", "gradient_cosine.png"):
        assert (out / "natural" / png).stat().st_size > 10_000
    md = (out / "results.md").read_text()
    assert "### Regime `natural`" in md and "### Regime `scaled` (overrides: `loss_scale.gen=100`)" in md
    assert "Expected (stated before the run): equal loses cls" in md and "### Between regimes" in md
    assert "| `pcgrad(reduction=mean)` |" in md and "| `unit_gradients(source=features)` |" in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| method |"))
    static = next(ln for ln in md.splitlines() if ln.startswith("| `static` (1 of 1 failed) |"))
    assert static.count("|") == header.count("|")  # a failed method's row has the table's columns
    assert any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(out / "tb") for f in fs)
    again = bench(out, *args)
    assert "natural equal seed 0: finished before with this configuration, skipped" in again.stdout
    assert "scaled equal seed 0: finished before with this configuration, skipped" in again.stdout


@pytest.mark.slow
def test_bench_runs_under_torchrun_when_configured(tmp_path):
    out = tmp_path / "bench"
    proc = bench(out, "bench.methods=[equal]", "bench.baselines=false", "bench.select=last", "bench.nproc=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "runs" / "natural" / "equal" / "seed0" / "final_metrics.json") as f:
        assert json.load(f)["world_size"] == 2
    with open(out / "results.csv") as f:
        assert float(next(csv.DictReader(f))["peak_mem_mb"]) > 100  # rank 0's own process


def test_a_method_may_appear_with_options_labelled_by_its_values(capsys):
    """bench.methods entries name(key=value, ...): parsed into the method and its weighting.options, checked
    like weighting.options (errors name the entry and the key), one folder and one row label per entry."""
    from mtl.bench.entries import parse_method
    from mtl.bench.regimes import method_errors, plan
    from mtl.bench.sweep import main
    from mtl.setup.checks import load_run_config

    assert parse_method("equal") == ("equal", {})
    assert parse_method(" cagrad( c=0.2 , rescale=false) ") == ("cagrad", {"c": 0.2, "rescale": False})
    cfg = load_run_config(TINY, ["bench.methods=[equal, 'cagrad(c=0.2)', 'cagrad(c=0.5, rescale=false)', "
                                 "'pcgrad(reduction=mean)']", "bench.seeds=[0]", "bench.baselines=false"])
    assert method_errors(cfg) == []
    runs = {r["label"]: r for r in plan(cfg)}
    assert list(runs) == ["equal", "cagrad(c=0.2)", "cagrad(c=0.5, rescale=false)", "pcgrad(reduction=mean)"]
    over = runs["cagrad(c=0.5, rescale=false)"]["overrides"]
    assert {"weighting.method=cagrad", "weighting.options.c=0.5", "weighting.options.rescale=false",
            "ddp.strategy=task_grads"} <= set(over)
    assert runs["cagrad(c=0.2)"]["dir"].endswith(os.path.join("runs", "natural", "cagrad_c=0.2", "seed0"))
    assert len({r["dir"] for r in runs.values()}) == 4
    # the run's own config check accepts what the entry turns into, and the option arrives
    run_cfg = load_run_config(TINY, over)
    assert run_cfg.weighting.options == {"c": 0.5, "rescale": False}
    bad = load_run_config(TINY, ["bench.methods=[nope, 'cagrad(cc=0.2)', 'cagrad(c=-1)', 'cagrad(c=[1])', "
                                 "'pcgrad(reduction=avg)', 'cagrad(c=0.2', equal, equal, 'static']"])
    errs = method_errors(bad)
    assert any(e.startswith("bench.methods[0] 'nope': unknown method 'nope'") for e in errs), errs
    assert any(e.startswith("bench.methods[1] 'cagrad(cc=0.2)': weighting.options: unknown option 'cc'")
               and "did you mean 'weighting.options.c'" in e for e in errs), errs
    assert any(e.startswith("bench.methods[2] 'cagrad(c=-1)': weighting.options.c: must be >= 0") for e in errs), errs
    assert any(e.startswith("bench.methods[3] 'cagrad(c=[1])': weighting.options.c: bad value") for e in errs), errs
    assert any(e.startswith("bench.methods[4] 'pcgrad(reduction=avg)': weighting.options.reduction") for e in errs), errs
    assert any(e.startswith("bench.methods[5] 'cagrad(c=0.2': needs a method name") for e in errs), errs
    assert any(e.startswith("bench.methods[7] 'equal': listed twice") for e in errs), errs
    assert len(errs) == 7, errs  # static's missing weighting.weights is its run's error, not the list's
    assert main(["--config", TINY, "bench.methods=['cagrad(cc=0.2)']"]) == 2
    assert "weighting.options: unknown option 'cc'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ regimes

def test_loss_scale_multiplies_one_tasks_loss_and_its_gradient():
    """The regime option: loss_scale.gen=100 makes gen's training loss (and its gradient at the shared features)
    exactly 100 x, and leaves cls's as it was; a bad value is a config error naming the key."""
    import torch

    from mtl.data.tokenizer import train_tokenizer
    from mtl.errors import ConfigError
    from mtl.setup.build import build_model
    from mtl.setup.checks import load_run_config

    from .conftest import make_collate

    tok = train_tokenizer(["one small red object in the centre", "two large blue objects"], 64)
    items = [{"image": torch.rand(3, 32, 32), "label": i % 4, "captions": ["two large blue objects"], "count": 2,
              "index": i} for i in range(3)]
    batch = make_collate(tok, 10, tasks=["cls", "gen"])(items)
    model = build_model(load_run_config(TINY, ["loss_scale.gen=100"]), 4, ["a", "b", "c", "d"], tok)
    assert model.loss_scale == {"gen": 100.0}  # the config reached the model
    out = {}
    for scale in (None, 100):
        model.loss_scale = {"gen": 100.0} if scale else {}  # the same weights, scaled and not
        res = model(batch, feature_leaf=True)
        grad = torch.autograd.grad(res["losses"]["gen"], res["leaf"])[0]
        out[scale] = ({k: v.detach() for k, v in res["losses"].items()}, grad)
    (plain, g_plain), (scaled, g_scaled) = out[None], out[100]
    torch.testing.assert_close(scaled["gen"], 100 * plain["gen"])
    torch.testing.assert_close(scaled["cls"], plain["cls"])
    torch.testing.assert_close(g_scaled, 100 * g_plain)
    assert g_plain.abs().sum() > 0
    for bad, msg in (("loss_scale.gen=0", "loss_scale.gen: must be a number > 0"),
                     ("loss_scale.gne=2", "loss_scale.gne: 'gne' is not a task")):
        with pytest.raises(ConfigError) as e:
            load_run_config(TINY, [bad])
        assert any(m.startswith(msg) for m in e.value.errors), e.value.errors


REGIMES = ("bench.regimes={natural: {expect: 'nothing moves'}, scaled: {overrides: [loss_scale.gen=100], "
           "baselines_from: natural, methods: [equal, uw], expect: 'equal loses cls'}}")


def test_the_architecture_axis_repeats_every_regime_with_each_architecture():
    """bench.architectures: each regime again as <regime>+<architecture>, its runs built with that architecture, the
    single-task baselines the regime's own (planned once); a name that is not an architecture, or a source it cannot
    serve, is refused naming the regime."""
    from mtl.bench.regimes import plan, regime_configs
    from mtl.setup.checks import load_run_config

    over = [REGIMES, "bench.methods=[equal, 'mgda(source=features)']", "bench.seeds=[0]",
            "bench.architectures=[mmoe, cross_stitch]"]
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    # cross_stitch has no shared tensor: the features source is refused in its regime, by name
    assert errors and all("+cross_stitch" in e and "weighting.source: features cannot serve" in e for e in errors)
    over[-1] = "bench.architectures=[mmoe]"
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    assert errors == [] and list(loaded) == ["natural", "scaled", "natural+mmoe", "scaled+mmoe"]
    runs = plan(cfg, loaded=loaded)
    by = {(r["regime"], r["label"]): r for r in runs}
    assert ("natural+mmoe", "single_cls") not in by and ("natural", "single_cls") in by  # baselines once
    assert "model.architecture.name=mmoe" in by[("natural+mmoe", "mgda(source=features)")]["overrides"]
    assert "loss_scale.gen=100" in by[("scaled+mmoe", "uw")]["overrides"]
    assert not any("architecture" in o for o in by[("natural", "equal")]["overrides"])
    assert loaded["natural+mmoe"][1].model.architecture.name == "mmoe"
    bad = [REGIMES, "bench.architectures=[mmo]"]
    _, errors = regime_configs(load_run_config(TINY, bad), TINY, bad)
    assert any(e.startswith("bench.regimes.natural+mmo.overrides") and "unknown architecture 'mmo'" in e
               for e in errors), errors


def test_regimes_and_gradient_sources_plan_the_right_runs():
    """Each regime's overrides reach its runs; a regime with baselines_from plans no baselines of its own; an
    entry's source=features becomes weighting.source with the features strategy; bad entries are refused."""
    from mtl.bench.regimes import describe_plan, plan, regime_configs
    from mtl.setup.checks import load_run_config

    over = [REGIMES, "bench.methods=[equal, mgda, 'mgda(source=features)', 'cagrad(c=0.2, source=features)']",
            "bench.seeds=[0, 1]"]
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    assert errors == []
    runs = plan(cfg, loaded=loaded)
    by = {(r["regime"], r["label"], r["seed"]): r for r in runs}
    assert len(runs) == 2 * (4 + 2) + 2 * 2
    assert ("scaled", "single_cls", 0) not in by and ("natural", "single_gen", 1) in by
    assert "loss_scale.gen=100" in by[("scaled", "uw", 1)]["overrides"]
    assert not any("loss_scale" in o for o in by[("natural", "equal", 0)]["overrides"])
    feat = by[("natural", "mgda(source=features)", 0)]["overrides"]
    assert {"weighting.method=mgda", "weighting.source=features", "ddp.strategy=feature_leaf"} <= set(feat)
    assert {"weighting.source=parameters", "ddp.strategy=task_grads"} <= set(by[("natural", "mgda", 0)]["overrides"])
    assert {"weighting.options.c=0.2", "weighting.source=features"} <= set(
        by[("natural", "cagrad(c=0.2, source=features)", 0)]["overrides"])
    assert by[("natural", "mgda(source=features)", 0)]["dir"].endswith(
        os.path.join("runs", "natural", "mgda_source=features", "seed0"))
    run_cfg = load_run_config(TINY, by[("scaled", "uw", 1)]["overrides"])  # what the run itself will load
    assert run_cfg.loss_scale == {"gen": 100.0} and run_cfg.seed == 1
    assert "natural: 2 loss, 2 grad, 4 grad (source=features), 4 single-task" in describe_plan(runs)
    bad = [REGIMES.replace("baselines_from: natural", "baselines_from: nat"),
           "bench.methods=[equal, 'equal(source=features)', 'graddrop(source=features)', 'mgda(source=bogus)']"]
    _, errors = regime_configs(load_run_config(TINY, bad), TINY, bad)
    assert any(e.startswith("bench.regimes.scaled.baselines_from: 'nat' is not a regime") for e in errors), errors
    assert any(e.startswith("bench.regimes.natural.methods[1] 'equal(source=features)': weighting.source: features "
                            "applies to gradient-level methods only") for e in errors), errors
    assert any(e.startswith("bench.regimes.natural.methods[2] 'graddrop(source=features)'") and "needs the rows" in e
               for e in errors), errors
    assert any(e.startswith("bench.regimes.natural.methods[3] 'mgda(source=bogus)': weighting.source: 'bogus'")
               for e in errors), errors
    bad = ["bench.regimes={odd: {overrides: [loss_scale.gen=-1], expected: x}}"]
    _, errors = regime_configs(load_run_config(TINY, bad), TINY, bad)
    assert any(e.startswith("bench.regimes.odd: unknown key(s) expected") for e in errors), errors
    assert any(e.startswith("bench.regimes.odd.overrides ['loss_scale.gen=-1']: loss_scale.gen: must be") for e in
               errors), errors


# ------------------------------------------------------------------------------------------ the table

def _fake_run(run_dir, evals, step_time=0.1, peak=500.0, combine=None):
    """A finished run's files as the trainer writes them: train rows (step time, peak memory) and eval rows."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step, metrics in evals:
            f.write(json.dumps({"step": step, "kind": "train", "time": 1000.0 + step, "step_time_s": step_time,
                                "peak_mem_mb": peak, "combine_s": combine, "weight_cls": 1.0, "weight_gen": 1.0})
                    + "\n")
            f.write(json.dumps({"step": step, "kind": "eval", "time": 1000.5 + step, **metrics}) + "\n")
    with open(os.path.join(run_dir, "final_metrics.json"), "w") as f:
        json.dump({"wall_time_s": 12.0}, f)


def test_the_table_from_known_runs(tmp_path, monkeypatch):
    """summarize + write_results on hand-made runs with known numbers: Δm and its t-interval, the paired
    bootstrap marks against equal (▲ for a method better on every seed, none for one better on some), the slope
    and plateau columns, peak memory per run (never n/a), and the between-regimes table."""
    from mtl.bench.regimes import plan, regime_configs
    from mtl.bench.results import summarize
    from mtl.bench.tables import write_results
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={tmp_path}", "bench.methods=[equal, uw, dwa, rlw]", "bench.seeds=[0, 1, 2, 3, 4]", REGIMES,
            "bench.last_k=3"]
    cfg = load_run_config(TINY, over)
    loaded, errors = regime_configs(cfg, TINY, over)
    assert errors == []
    runs = plan(cfg, loaded=loaded)
    noise = [0.01, -0.01, 0.02, -0.02, 0.0]
    for r in runs:
        s = r["seed"]
        if r["label"] == "rlw":  # every rlw run failed: no files
            r["status"] = "failed"
            continue
        acc = {"single_cls": 0.8, "single_gen": 0.5, "equal": 0.6, "uw": 0.7, "dwa": 0.6 + 5 * noise[s]}[r["label"]]
        if r["regime"] == "scaled" and r["label"] == "equal":
            acc = 0.4  # the regime costs equal its classification
        rising = r["label"] == "dwa"  # still climbing at the end: not on a plateau
        evals = [(step, {"cls_acc": acc - (0.1 * (600 - step) / 600 if rising else 0) + noise[s] / 10,
                         "gen_bleu4": 0.5, "gen_chrf": 0.5}) for step in range(100, 700, 100)]
        if r["label"].startswith("single_"):  # a baseline evaluates its own task only
            task = r["label"].split("_", 1)[1]
            evals = [(step, {k: v for k, v in m.items() if k.startswith(task)}) for step, m in evals]
        _fake_run(r["dir"], evals, step_time=0.2 if r["label"] == "uw" else 0.1, peak=400.0 + 10 * s
                  + (100 if r["label"] == "uw" else 0))
        r["status"] = "ok"
    per_regime = {}
    for name, (spec, rcfg) in loaded.items():
        mine = [r for r in runs if r["regime"] == name and not r["label"].startswith("single_")]
        base_runs = [r for r in runs if r["regime"] == "natural" and r["label"].startswith("single_")]
        rows, base = summarize(cfg, name, spec, rcfg, mine, base_runs)
        per_regime[name] = (rcfg, rows, base)
    rows = {r["method"]: r for r in per_regime["natural"][1]}
    assert abs(per_regime["natural"][2]["cls_acc"] - 0.8) < 1e-9
    # equal: cls 0.6 vs 0.8 (25% worse: +25 in the literature's sign), gen's bleu and chrf at the baseline (0%); per
    # task, then over the two tasks: Δm = +12.5 % (+ the seed noise / 10), not (25 + 0 + 0) / 3
    assert abs(rows["equal"]["delta_m"] - 12.5) < 0.05 and rows["equal"]["split"] == "validation"
    assert rows["equal"]["delta_m_ci"] > 0 and rows["equal"]["vs_equal_sig"] == 0 and rows["equal"]["seeds_better"] == ""
    assert rows["uw"]["vs_equal_sig"] == -1 and rows["uw"]["seeds_better"] == "5/5"  # +0.1 acc on every seed: lower Δm
    assert abs(rows["uw"]["vs_equal"] + 0.1 / 0.8 * 100 / 2) < 1e-6 and rows["uw"]["vs_equal_p_holm"] < 0.05
    assert rows["dwa"]["vs_equal_sig"] == 0  # better on some seeds, worse on others
    assert rows["dwa"]["selected_step"] == 600  # still rising: its best validation evaluation is the last
    assert rows["equal"]["plateau"] == rows["uw"]["plateau"] == "converged" and rows["dwa"]["plateau"] == "improving"
    assert rows["dwa"]["moving"] == ["cls_acc"] and abs(rows["dwa"]["cls_acc_slope"] - 0.1 / 6) < 1e-3
    assert rows["equal"]["peak_mem_mb"] == 420.0 and rows["uw"]["mem_vs_equal"] == 520.0 / 420.0
    assert rows["uw"]["time_vs_equal"] == 2.0
    assert rows["single_cls"]["level"] == "single-task" and rows["single_cls"]["plateau"] == "converged"  # its own metric only
    assert rows["single_cls"]["gen_bleu4"] != rows["single_cls"]["gen_bleu4"]
    text = write_results(cfg, per_regime, {"regimes": {k: v[0] for k, v in loaded.items()}})
    assert "Expected (stated before the run): equal loses cls" in text
    natural = text.split("### Regime `scaled`")[0]
    line = {ln.split("|")[1].strip(): ln for ln in natural.splitlines() if ln.startswith("| `") and ln.count("|") > 12}
    assert "▼ (p_Holm 0.000)" in line["`uw`"].split("|")[8] and "5/5" in line["`uw`"]
    assert "▲" not in line["`dwa`"] and "▼" not in line["`dwa`"]
    assert "420 (1.00x)" in line["`equal`"] and "520 (1.24x)" in line["`uw`"]
    assert "n/a" not in line["`uw`"]
    assert "| `single_cls` | 600 | 600 |" in text and "| improving: cls_acc |" in natural
    assert ("Verdicts: 5 methods and baselines (each over its seeds), 4 converged, 1 improving, 0 undetermined; "
            "12 metrics, 11 converged, 1 improving, 0 undetermined.") in natural
    assert "Detectable here (80% power" in natural and "Runs: not recorded (no bench_run.json)." in natural
    assert "read on the same validation split it was chosen on" in natural and "last 3 evaluations (steps 400, 500, 600)" in natural
    header = next(ln for ln in natural.splitlines() if ln.startswith("| method |"))
    assert line["`rlw` (5 of 5 failed)"].count("|") == header.count("|") and "- `rlw` seed 4: failed" in natural
    assert "| `rlw` |" not in natural  # no convergence row for a method with no finished run
    scaled = {r["method"]: r for r in per_regime["scaled"][1]}
    assert scaled["uw"]["vs_equal_sig"] == -1 and abs(scaled["equal"]["delta_m"] - 25) < 0.05
    # between regimes: equal's Δm rose (worse) by 12.5 on every seed (▲), uw's did not move
    effects = [ln for ln in text.splitlines() if ln.startswith("| `scaled` vs `natural`")]
    assert any("`equal`" in ln and "+12.50" in ln and "▲" in ln for ln in effects), effects
    assert any("`uw`" in ln and "+0.00 [+0.00, +0.00]" in ln and "▲" not in ln for ln in effects), effects
    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert {(r["regime"], r["method"]) for r in csv_rows} >= {("natural", "uw"), ("scaled", "equal"),
                                                               ("natural", "single_gen")}
    with open(tmp_path / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == len([r for r in runs if r["status"] == "ok"])  # the finished runs
    # the TensorBoard hparams view: one entry per finished run, from the rows summarize read (no run read again)
    from mtl.bench.tables import write_hparams

    entries = []

    class Writer:
        def __init__(self, logdir):
            pass

        def add_hparams(self, hparams, metrics, run_name):
            entries.append((hparams, metrics))

        def close(self):
            pass

    monkeypatch.setattr("torch.utils.tensorboard.SummaryWriter", Writer)
    monkeypatch.setattr("mtl.bench.results.read_run", lambda *a: pytest.fail("write_hparams read a run again"))
    write_hparams(cfg, per_regime, {k: v[0] for k, v in loaded.items()})
    assert sorted((h["regime"], h["method"], h["seed"]) for h, _ in entries) == \
        sorted((r["regime"], r["label"], r["seed"]) for r in runs if r["status"] == "ok")
    uw = next(m for h, m in entries if (h["regime"], h["method"], h["seed"]) == ("natural", "uw", 0))
    assert uw["hparam/step_time_s"] == 0.2 and uw["hparam/peak_mem_mb"] == 500.0
    assert abs(uw["hparam/cls_acc"] - 0.701) < 1e-9 and uw["hparam/gen_bleu4"] == 0.5
    assert abs(uw["hparam/delta_m"] - (0.8 - 0.701) / 0.8 * 100 / 2) < 1e-9  # lower is better, as in the table


# ------------------------------------------------------------------------------------------ a user's method

USER_METHOD = os.path.join(ROOT, "docs", "examples", "unit_gradients.py")  # the worked example of the docs


def test_a_users_method_in_one_file_joins_the_sweep(tmp_path):
    """The docs' worked example: weighting_modules names the .py file; its method is then a bench.methods entry
    like any built-in one, with options and either gradient source (checked, planned, its run config builds it);
    without weighting_modules the entry is an unknown method."""
    import shutil

    import torch

    from mtl.bench.regimes import method_errors, plan
    from mtl.setup.build import build_weighting
    from mtl.setup.checks import load_run_config

    path = tmp_path / "unit_gradients.py"  # a file outside the package, as a user's would be
    shutil.copy(USER_METHOD, path)
    over = [f"weighting_modules=[{path}]", "bench.methods=[equal, unit_gradients, 'unit_gradients(source=features)', "
            "'unit_gradients(eps=0.001)']", "bench.seeds=[0]", "bench.baselines=false"]
    cfg = load_run_config(TINY, over)
    assert method_errors(cfg) == []
    runs = {r["label"]: r for r in plan(cfg)}
    assert {"weighting.method=unit_gradients", "ddp.strategy=task_grads"} <= set(runs["unit_gradients"]["overrides"])
    assert {"weighting.source=features", "ddp.strategy=feature_leaf"} <= set(
        runs["unit_gradients(source=features)"]["overrides"])
    run_cfg = load_run_config(TINY, [*over, *runs["unit_gradients(eps=0.001)"]["overrides"]])
    w = build_weighting(run_cfg)
    assert type(w).__name__ == "UnitGradients" and w.level == "grad" and w.options.eps == 0.001
    gram = torch.tensor([[4.0, 1.0], [1.0, 100.0]], dtype=torch.float64)
    torch.testing.assert_close(w.weights_for_gram(gram), 1 / torch.sqrt(torch.tensor([4.001, 100.001],
                                                                                        dtype=torch.float64)))
    errs = method_errors(load_run_config(TINY, [*over[1:], f"weighting_modules=[{path}]",
                                                "bench.methods=['unit_gradients(epsilon=1)']"]))
    assert len(errs) == 1 and "unknown option 'epsilon'" in errs[0], errs
    errs = method_errors(load_run_config(TINY, ["bench.methods=[equal, unit_gradients]"]))
    assert len(errs) == 1 and "unknown method 'unit_gradients'" in errs[0] and "weighting_modules" in errs[0]


def _check_one_mlflow_store(out, status) -> None:
    """The sweep's runs (two at a time) logged to one MLflow store in the sweep's folder, one experiment named after
    it, one MLflow run per benchmark run that trained; no run folder has a store of its own."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bench")
    runs = client.search_runs([experiment.experiment_id])
    trained = [r for r in status.values() if r["status"] == "ok"]
    assert len(runs) == len(trained) == 6, (len(runs), len(trained))
    assert {r.data.tags["mtl.group"] for r in runs} == {"bench"}
    assert len({r.data.tags["mtl.output_dir"] for r in runs}) == 6
    for r in runs:  # each finished, with its evaluations (a single-task baseline has its own task's metrics alone)
        assert r.info.status == "FINISHED", (r.info.run_name, r.info.status)
        assert {"eval/cls_acc", "eval/gen_bleu4"} & set(r.data.metrics), (r.info.run_name, sorted(r.data.metrics))
    assert not list(out.glob("runs/**/mlflow.db"))
