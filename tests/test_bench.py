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
    return subprocess.run([PY, "-m", "mtl.tools.bench", "--config", TINY, f"output_dir={out}", *FAST, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_bench_writes_results_records_failures_and_skips_finished_runs(tmp_path):
    out = tmp_path / "bench"
    # static without weighting.weights is a config error for that run only: recorded, the sweep goes on
    # a method twice, once with an option: its own row and folder, labelled as written
    proc = bench(out, "bench.methods=[equal,pcgrad,'pcgrad(reduction=mean)',static]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/6] equal seed 0: training" in proc.stdout and "FAILED" in proc.stdout
    with open(out / "runs.jsonl") as f:
        status = {(r["label"], r["seed"]): r for r in map(json.loads, f)}
    assert status[("static", 0)]["status"] == "failed" and "weighting.weights" in status[("static", 0)]["error"]
    assert all(status[(m, 0)]["status"] == "ok" for m in ("equal", "pcgrad", "single_cls", "single_gen"))
    with open(out / "results.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"equal", "pcgrad", "pcgrad(reduction=mean)", "static"}
    assert rows["pcgrad(reduction=mean)"]["runs_ok"] == "1" and rows["pcgrad(reduction=mean)"]["level"] == "grad"
    assert (out / "runs" / "pcgrad_reduction=mean" / "seed0" / "final_metrics.json").is_file()
    assert "reduction: mean" in (out / "runs" / "pcgrad_reduction=mean" / "seed0" / "config.yaml").read_text()
    assert rows["static"]["runs_ok"] == "0"
    for key in ("cls_acc", "gen_bleu4", "gen_chrf", "delta_m", "delta_p", "mean_rank", "time_vs_equal"):
        assert rows["equal"][key] not in ("", "nan"), key
    assert float(rows["equal"]["time_vs_equal"]) == 1.0
    assert float(rows["pcgrad"]["combine_s"]) > 0 and float(rows["equal"]["combine_s"]) == 0
    assert float(rows["pcgrad"]["allreduce_mb"]) > float(rows["equal"]["allreduce_mb"])  # K rows of the backbone
    for png in ("metrics_vs_step.png", "metrics_vs_wall.png", "task_weights.png", "gradient_cosine.png"):
        assert (out / png).stat().st_size > 10_000
    assert "| `equal` |" in (out / "results.md").read_text()
    assert "| `pcgrad(reduction=mean)` |" in (out / "results.md").read_text()
    assert any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(out / "tb") for f in fs)
    again = bench(out, "bench.methods=[equal,pcgrad,'pcgrad(reduction=mean)',static]")
    assert "equal seed 0: finished before, skipped" in again.stdout and "pcgrad seed 0: finished before" in again.stdout


@pytest.mark.slow
def test_bench_runs_under_torchrun_when_configured(tmp_path):
    out = tmp_path / "bench"
    proc = bench(out, "bench.methods=[equal]", "bench.baselines=false", "bench.nproc=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "runs" / "equal" / "seed0" / "final_metrics.json") as f:
        assert json.load(f)["world_size"] == 2


def test_a_method_may_appear_with_options_labelled_by_its_values(capsys):
    """bench.methods entries name(key=value, ...): parsed into the method and its weighting.options, checked
    like weighting.options (errors name the entry and the key), one folder and one row label per entry."""
    from mtl.config_check import load_run_config
    from mtl.tools.bench import main, method_errors, parse_method, plan

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
    assert runs["cagrad(c=0.2)"]["dir"].endswith(os.path.join("runs", "cagrad_c=0.2", "seed0"))
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
