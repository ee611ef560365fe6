"""The benchmark's guards: one sweep per output_dir (a second is refused naming the first's PID; a dead sweep's lock is
taken over), and a finished run is reused only with the same code (the hashes of its method's, strategy's,
backbone's and tasks' files, plug-ins too), not only the same configuration."""

import json
import os
import socket
import subprocess

import pytest

from .conftest import TINY
from .test_bench_reuse import _sweep  # run_all over a plan, the launcher not called

BASE = ["bench.seeds=[0]", "bench.baselines=false", "bench.select=last", "trainer.max_steps=4"]
PLUGIN = '''from mtl.weighting.base import LossWeighting


class Mine(LossWeighting):
    name = "mine"

    def weigh(self, task, loss):
        return loss * {scale}
'''


def _main(monkeypatch, sweeps, *overrides, flags=()):
    """``python -m mtl.tools.bench`` in-process, with the sweep's work (training and tables) replaced by
    ``sweeps.append``; returns the exit code."""
    from mtl.bench import sweep as bench

    monkeypatch.setattr(bench, "sweep", lambda cfg, *a, **k: sweeps.append(cfg.output_dir))
    return bench.main([*flags, "--config", TINY, *BASE, "bench.methods=[equal]", *overrides])


def test_a_second_sweep_on_an_output_dir_in_use_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):
    from mtl.bench import sweep as bench
    from mtl.run.runlock import LOCK_NAME

    lock, seen = tmp_path / LOCK_NAME, {"calls": 0}

    def first_sweep(cfg, *a, **k):  # while the first sweep trains, a second one starts on the same output_dir
        seen["calls"] += 1
        if seen["calls"] > 1:
            return  # the second sweep got through
        seen["holder"] = json.loads(lock.read_text()) if lock.exists() else None
        seen["code"] = bench.main(["--config", TINY, *BASE, "bench.methods=[equal]", f"output_dir={tmp_path}"])

    monkeypatch.setattr(bench, "sweep", first_sweep)
    assert bench.main(["--config", TINY, *BASE, "bench.methods=[equal]", f"output_dir={tmp_path}"]) == 0
    assert seen["holder"]["pid"] == os.getpid() and seen["calls"] == 1  # the second never reached the sweep
    assert seen["code"] == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error") and err.count("config error") == 1 and "Traceback" not in err, err
    assert f"is in use by another run: PID {os.getpid()} on host {socket.gethostname()}" in err, err
    assert "one sweep per output_dir" in err and str(lock) in err
    assert not lock.exists()  # released when the first sweep ended
    # --plan and --analyze train nothing: they never take the lock (--analyze reads a sweep in progress)
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": 0}))
    sweeps: list = []
    assert _main(monkeypatch, sweeps, f"output_dir={tmp_path}", flags=["--analyze"]) == 0 and len(sweeps) == 1
    assert _main(monkeypatch, sweeps, f"output_dir={tmp_path}", flags=["--plan"]) == 0


def test_a_dead_sweeps_lock_is_taken_over_and_a_live_ones_is_not(tmp_path, monkeypatch, capsys):
    from mtl.run.runlock import LOCK_NAME, _start_time

    lock, me, sweeps = tmp_path / LOCK_NAME, socket.gethostname(), []
    # held by another live process on this host (our parent): refused, naming it, and nothing written
    parent = os.getppid()
    lock.write_text(json.dumps({"pid": parent, "host": me, "start": _start_time(parent), "since": 0}))
    assert _main(monkeypatch, sweeps, f"output_dir={tmp_path}") == 2 and sweeps == []
    assert f"PID {parent} on host {me}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    # left by a sweep that died (its PID is gone): taken over, said, and released at the end
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(dead.pid, 0)  # the holder really is gone
    lock.write_text(json.dumps({"pid": dead.pid, "host": me, "start": "1", "since": 0}))
    assert _main(monkeypatch, sweeps, f"output_dir={tmp_path}") == 0 and sweeps == [str(tmp_path)]
    assert f"took over the stale lock {lock} (PID {dead.pid} on {me} is gone)" in capsys.readouterr().out
    assert not lock.exists()


# ---------------------------------------------------------------------------------------------- code in a run's identity


def _plugin(tmp_path, scale):
    path = tmp_path / "mine.py"
    path.write_text(PLUGIN.format(scale=scale))
    return str(path)


def _finish(run, commit="0123456789"):
    """Make ``run`` look finished as the sweep leaves it: final_metrics.json and its record (code hashes included)."""
    from mtl.bench.record import write_record

    os.makedirs(run["dir"], exist_ok=True)
    with open(os.path.join(run["dir"], "final_metrics.json"), "w") as f:
        json.dump({"wall_time_s": 1.0}, f)
    write_record(run["dir"], run["config"], {"commit": commit, "versions": "v", "hardware": "h", "threads": 1},
                 run["code"])


def test_a_run_whose_plugin_method_file_changed_is_trained_again(tmp_path, monkeypatch, capsys):
    from mtl.bench.record import provenance
    from mtl.errors import ConfigError

    out = tmp_path / "sweep"
    path = _plugin(tmp_path, 1.0)
    over = [*BASE, f"weighting_modules=[{path}]", "bench.methods=[mine]"]
    runs, trained = _sweep(out, monkeypatch, over)
    assert trained == runs and len(runs) == 1
    code = runs[0]["code"]
    assert path in code and "mtl/strategies/base.py" in code and "mtl/tasks/classification.py" in code, code
    assert "mtl/weighting/base.py" in code and "mtl/models/backbones/torchvision_cnn.py" in code, code
    _finish(runs[0])
    # the same file, and another commit (the record says 0123456789): reused; the commit is provenance only
    assert provenance()["commit"] != "0123456789"
    _, trained = _sweep(out, monkeypatch, over)
    assert trained == [] and "finished before with this configuration, skipped" in capsys.readouterr().out
    # the method's own file changed (its loss scaled 100x), its configuration did not: trained again, naming the file
    _plugin(tmp_path, 100.0)
    _, trained = _sweep(out, monkeypatch, over)
    assert len(trained) == 1
    text = capsys.readouterr().out
    assert f"its code changed: {path} changed (sha256 " in text and "training it again" in text, text
    assert "configuration changed" not in text
    # ... or refused before anything trains, naming the run and the file
    with pytest.raises(ConfigError) as e:
        _sweep(out, monkeypatch, over, on_change="refuse")
    message = "\n".join(e.value.errors)
    assert "mine seed 0" in message and f"{path} changed" in message and "--on-change retrain" in message
    # ... which the command line turns into exit code 2, the message said once, no traceback
    from mtl.bench import runs
    from mtl.bench import sweep as bench

    monkeypatch.setattr(runs, "_drive", lambda *a: pytest.fail("--on-change refuse trained a run"))
    assert bench.main(["--on-change", "refuse", "--config", TINY, f"output_dir={out}", *over]) == 2
    err = capsys.readouterr().err
    assert err.count("--on-change refuse: 1 finished run(s)") == 1 and f"{path} changed" in err, err
    assert "Traceback" not in err


def test_a_record_without_code_hashes_is_not_reused_and_says_why(tmp_path, monkeypatch, capsys):
    runs, _ = _sweep(tmp_path, monkeypatch, [*BASE, "bench.methods=[equal]"])
    _finish(runs[0])
    record = os.path.join(runs[0]["dir"], "bench_run.json")
    with open(record) as f:
        old = json.load(f)
    old.pop("code")  # as an older mtl wrote it
    with open(record, "w") as f:
        json.dump(old, f)
    _, trained = _sweep(tmp_path, monkeypatch, [*BASE, "bench.methods=[equal]"])
    assert len(trained) == 1
    assert "its bench_run.json has no code hashes (written by an older mtl)" in capsys.readouterr().out


def test_a_built_in_file_of_the_run_counts_and_a_file_it_does_not_load_does_not(tmp_path, monkeypatch):
    from mtl.bench.record import reuse_problem

    runs, _ = _sweep(tmp_path, monkeypatch, [*BASE, "bench.methods=[equal]"])
    _finish(runs[0])
    code = runs[0]["code"]
    assert reuse_problem(runs[0]["dir"], runs[0]["config"], code) is None
    edited = {**code, "mtl/weighting/equal.py": "0" * 64}
    assert "mtl/weighting/equal.py changed" in reuse_problem(runs[0]["dir"], runs[0]["config"], edited)
    assert "mtl/weighting/cagrad.py" not in code  # another method's file is not this run's code
    more = {**code, "extra.py": "1" * 64}
    assert "extra.py: loaded now, not before" in reuse_problem(runs[0]["dir"], runs[0]["config"], more)


def test_provenance_without_git_says_unknown(monkeypatch):
    from mtl.bench import record

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(record.subprocess, "run", no_git)
    p = record.provenance(1)
    assert p["commit"] == "unknown" and p["versions"].startswith("mtl ")
