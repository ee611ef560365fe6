"""The benchmark never reuses a finished run whose training configuration changed; each run records where it ran,
and a table says so when its runs come from different commits, versions or machines."""

import json
import os

import pytest

from .conftest import TINY

BASE = ["bench.methods=[equal]", "bench.seeds=[0]", "bench.baselines=false", "trainer.max_steps=4"]


def _finished(run, overrides, nproc=1, prov=None):
    """A run folder as a finished run leaves it: final_metrics.json and the record of what it trained with."""
    from mtl.bench.record import run_identity, write_record

    os.makedirs(run["dir"], exist_ok=True)
    with open(os.path.join(run["dir"], "final_metrics.json"), "w") as f:
        json.dump({"wall_time_s": 1.0}, f)
    config, code = run_identity(TINY, [*overrides, *run["overrides"]], nproc)
    write_record(run["dir"], config, prov or {"commit": "abc", "versions": "v", "hardware": "h", "threads": 1}, code)


def _sweep(tmp_path, monkeypatch, overrides, on_change="retrain"):
    """run_all over the plan of ``overrides``; returns the runs it would train (the launcher is not called)."""
    from mtl.bench import runs as bench_runs
    from mtl.bench.regimes import plan
    from mtl.setup.checks import load_run_config

    trained = []
    monkeypatch.setattr(bench_runs, "_drive", lambda cfg, cp, bo, pending, *a: trained.extend(pending))
    over = [f"output_dir={tmp_path}", *overrides]
    cfg = load_run_config(TINY, over)
    runs = plan(cfg)
    bench_runs.run_all(cfg, TINY, over, runs, on_change)
    return runs, trained


def test_a_changed_training_key_is_never_reused(tmp_path, monkeypatch, capsys):
    from mtl.errors import ConfigError

    runs, trained = _sweep(tmp_path, monkeypatch, BASE)
    assert len(runs) == 1 and trained == runs  # nothing finished yet
    _finished(runs[0], [f"output_dir={tmp_path}", *BASE])
    _, trained = _sweep(tmp_path, monkeypatch, BASE)
    assert trained == [] and "finished before with this configuration, skipped" in capsys.readouterr().out
    # an analysis-only key (bench.*) may differ: still reused
    _, trained = _sweep(tmp_path, monkeypatch, [*BASE, "bench.last_k=2", "bench.plateau_tol=0.1",
                                                "bench.published.dm={ls: 1.0}", "bench.protocol='in words'"])
    assert trained == []
    # optim.lr changed: trained again, saying which key changed and how
    _, trained = _sweep(tmp_path, monkeypatch, [*BASE, "optim.lr=0.5"])
    assert len(trained) == 1
    out = capsys.readouterr().out
    assert "its configuration changed: optim.lr: 0.003 -> 0.5: training it again" in out, out
    # ... or refused, before anything trains, naming the run, the key and the flag
    with pytest.raises(ConfigError) as e:
        _sweep(tmp_path, monkeypatch, [*BASE, "optim.lr=0.5"], on_change="refuse")
    text = "\n".join(e.value.errors)
    assert "--on-change retrain" in text and "optim.lr: 0.003 -> 0.5" in text and "natural equal seed 0" in text
    # the processes per run change the global batch: not reusable either
    _, trained = _sweep(tmp_path, monkeypatch, [*BASE, "bench.nproc=2"])
    assert len(trained) == 1 and "nproc: 1 -> 2" in capsys.readouterr().out


def test_a_finished_run_without_a_record_is_trained_again(tmp_path, monkeypatch, capsys):
    runs, _ = _sweep(tmp_path, monkeypatch, BASE)
    _finished(runs[0], [f"output_dir={tmp_path}", *BASE])
    os.remove(os.path.join(runs[0]["dir"], "bench_run.json"))
    _, trained = _sweep(tmp_path, monkeypatch, BASE)
    assert len(trained) == 1 and "no bench_run.json" in capsys.readouterr().out


def test_provenance_is_recorded_and_a_mixed_table_says_so():
    from mtl.bench.record import provenance, provenance_lines

    p = provenance(1)
    assert p["commit"] != "" and "torch" in p["versions"] and "CPUs" in p["hardware"] and p["threads"] == 1
    a = {"provenance": {"commit": "abc", "versions": "torch 1", "hardware": "cpu x 2 CPUs", "threads": 1}}
    b = {"provenance": {**a["provenance"], "hardware": "gpu box"}}
    one = provenance_lines([a, a])
    assert one == ["Runs: commit abc; torch 1; cpu x 2 CPUs; 1 threads per process."]
    mixed = provenance_lines([a, b, a, None])
    assert mixed[0].startswith("**Mixed runs**") and "hardware" in mixed[0] and "commit" in mixed[0]
    assert "- 2 runs: commit abc; torch 1; cpu x 2 CPUs" in mixed[1] and "- 1 runs: not recorded (no bench_run.json)" in mixed


def test_analyze_trains_nothing_and_marks_what_is_not_finished_with_this_configuration(tmp_path, monkeypatch, capsys):
    from mtl.bench import runs as bench_runs
    from mtl.bench.regimes import plan
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={tmp_path}", *BASE[:-1], "bench.seeds=[0,1,2]", "trainer.max_steps=4"]
    cfg = load_run_config(TINY, over)
    runs = plan(cfg)
    _finished(runs[0], over)
    _finished(runs[1], [*over, "optim.lr=0.5"])  # finished, but with another configuration
    monkeypatch.setattr(bench_runs, "_drive", lambda *a: pytest.fail("--analyze trained a run"))
    bench_runs.run_all(cfg, TINY, over, runs, train=False)
    assert [r["status"] for r in runs] == ["ok", "missing", "missing"]
    out = capsys.readouterr().out
    assert "seed 1: not analysed: its configuration changed: optim.lr: 0.5 -> 0.003" in out
    assert "seed 2: not finished (yet)" in out
