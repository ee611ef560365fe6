"""bench.slurm sized to the run (issue 44 §2): submitit's cap on time-limit requeues derived from the longest run,
the warning signal's lead from the job's measured start-up and a checkpoint's save, both set on submitit's executor
and printed by --plan; a run at the cap is named unfinished (not failed), for the next bench invocation to resume."""

import os

import pytest
from omegaconf import OmegaConf

from mtl.errors import ConfigError


def _cfg(tmp_path, launcher="slurm", **slurm):
    return OmegaConf.create({"output_dir": str(tmp_path / "bench"), "bench": {"launcher": launcher, "slurm": {
        "cluster": "local", "cpus_per_run": 1, **slurm}}})


@pytest.fixture
def startup(monkeypatch):
    """The job's start-up as if measured: a fixed figure, not this machine's."""
    import mtl.bench.launch as launch
    import mtl.bench.slurm_sizing as sizing

    def fixed(seconds):
        monkeypatch.setattr(launch, "measure_startup", lambda: seconds)
        monkeypatch.setattr(sizing, "measure_startup", lambda: seconds)

    fixed(4.0)
    return fixed


def test_the_requeue_cap_is_derived_from_the_longest_run_and_set_on_the_executor(tmp_path, startup, monkeypatch):
    """The qm9 preset's sizing: 9.2 h at 240 min a job is 3 jobs. A run 1.75x slower (16.1 h) needs 5 jobs, 4
    requeues: past submitit's default 3 ("timed-out too many times"), within the derived cap of 6."""
    pytest.importorskip("submitit")
    from mtl.bench.launch import SlurmLauncher
    from mtl.bench.options import bench_options
    from mtl.bench.slurm_sizing import DEFAULT_REQUEUES, planned_jobs

    cfg = _cfg(tmp_path, time_min=240, longest_run_h=9.2)
    launcher = SlurmLauncher(cfg, {}, 1)
    assert launcher.max_requeues == 6 and launcher.executor._executor.max_num_timeout == 6
    slower = bench_options(_cfg(tmp_path, time_min=240, longest_run_h=9.2 * 1.75)).slurm
    needed = planned_jobs(slower, launcher.delay_s) - 1
    assert needed == 4 and DEFAULT_REQUEUES < needed <= launcher.max_requeues
    # set outright, it wins; not sized at all, submitit's own 3 (and --plan says it is not sized)
    assert SlurmLauncher(_cfg(tmp_path, max_requeues=9, longest_run_h=9.2), {}, 1).executor._executor.max_num_timeout == 9
    assert SlurmLauncher(_cfg(tmp_path), {}, 1).executor._executor.max_num_timeout == DEFAULT_REQUEUES
    from mtl.bench.regimes import bench_errors

    assert "bench.slurm.max_requeues: -1 must be >= 0" in bench_errors(_cfg(tmp_path, max_requeues=-1))
    # on Slurm too (submitit's SlurmExecutor, built where it finds an srun: a stand-in that is never run)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    slurm = SlurmLauncher(_cfg(tmp_path, cluster="slurm", time_min=240, longest_run_h=9.2), {}, 1)
    assert slurm.executor._executor.max_num_timeout == 6
    assert slurm.executor._executor.parameters["signal_delay_s"] == 90


def test_the_warning_signal_comes_after_the_start_up_and_leaves_time_to_save(tmp_path, startup):
    """The warning's lead is at least 2 x (start-up + save_s), set as submitit's signal_delay_s (RunJob waits for its
    run that much longer); a limit whose warning would come before the start-up has ended is refused; --plan says
    both."""
    pytest.importorskip("submitit")
    from mtl.bench.design import describe_design
    from mtl.bench.launch import GRACE_S, SlurmLauncher

    startup(50.0)
    launcher = SlurmLauncher(_cfg(tmp_path, time_min=9, save_s=10), {}, 1)
    assert launcher.delay_s == 120 and launcher.executor._executor.parameters["signal_delay_s"] == 120
    assert launcher.grace_s == GRACE_S["local"] + 120 - 30
    plan = describe_design(_cfg(tmp_path, time_min=9, save_s=10))
    assert "warning signal (submitit's signal_delay_s, USR2): 120 s before the limit" in plan
    assert "50.0 s measured here" in plan and "bench.slurm.save_s = 10 s" in plan
    # a 1-minute limit: the warning would come before the job's handler exists; the job would die, not requeue
    with pytest.raises(ConfigError, match="before 2 x its start-up"):
        SlurmLauncher(_cfg(tmp_path, time_min=1, save_s=10), {}, 1)
    assert "warning signal: REFUSED: bench.slurm.time_min=1" in describe_design(_cfg(tmp_path, time_min=1))
    # a short start-up: submitit's own lead stays the floor
    startup(2.0)
    assert SlurmLauncher(_cfg(tmp_path, time_min=9, save_s=1), {}, 1).delay_s == 30
    # without bench.launcher=slurm nothing is measured: the rule is stated
    local = describe_design(_cfg(tmp_path, launcher="local", time_min=240, longest_run_h=9.2))
    assert "measured at launch" in local and "at most 6" in local


def test_a_job_at_the_requeue_cap_is_unfinished_and_named_not_failed(tmp_path, startup):
    """submitit's refusal at the cap (its own UncompletedJobError) is the run's outcome "unfinished at the requeue
    cap", kept apart from a failure, and the summary names it as resubmitted by the next bench invocation."""
    pytest.importorskip("submitit")
    from submitit.core.utils import UncompletedJobError

    from mtl.bench.launch import AT_CAP, SlurmLauncher
    from mtl.bench.results import _not_ok

    launcher = SlurmLauncher(_cfg(tmp_path, max_requeues=2), {}, 1)

    class Job:
        job_id = "7"

        def __init__(self, error):
            self.error = error

        def done(self):
            return True

        def result(self):
            raise self.error

    outcome = launcher.poll(Job(UncompletedJobError("Job not requeued because: timed-out too many times.")), {})
    assert outcome.startswith(AT_CAP) and "3 times (2 requeues" in outcome and "next bench" in outcome
    other = launcher.poll(Job(UncompletedJobError("Job not requeued because: timed-out and not checkpointable.")), {})
    assert other.startswith("job 7 failed")
    assert "resubmitted by the next bench invocation" in _not_ok("unfinished") and _not_ok(None) == "failed"


def test_the_sweep_records_a_run_at_the_cap_as_unfinished_and_names_it(tmp_path, monkeypatch, capsys):
    """runs._drive with a launcher whose job reached the cap: the run is ``unfinished`` in runs.jsonl (not failed,
    not in errors.log), named in the sweep's output, and left for the next invocation (no final metrics: run_all
    trains it again, resuming from its checkpoints)."""
    import json

    import mtl.bench.runs as runs
    from mtl.bench.launch import AT_CAP

    class AtCap:
        name = "slurm"

        def start(self, run, command, record):
            return run

        def poll(self, handle, run):
            return f"{AT_CAP}: job 7 reached its time limit 4 times"

        def stop(self, handle):
            raise AssertionError("nothing is in flight to stop")

    monkeypatch.setattr(runs, "make_launcher", lambda cfg, env, threads: AtCap())
    cfg = OmegaConf.create({"output_dir": str(tmp_path / "bench"), "bench": {"launcher": "slurm"}})
    (tmp_path / "bench").mkdir()
    run = {"index": 1, "regime": "natural", "label": "nashmtl", "seed": 0, "dir": str(tmp_path / "run"),
           "overrides": [], "config": {}, "code": None}
    status = tmp_path / "bench" / "runs.jsonl"
    runs._drive(cfg, "configs/tiny.yaml", [], [run], 1, str(status))
    out = capsys.readouterr().out
    assert "[1/1] natural nashmtl seed 0: UNFINISHED: unfinished at the requeue cap" in out
    assert "1 run(s) unfinished at the requeue cap" in out and "natural nashmtl seed 0" in out.splitlines()[-1]
    record = json.loads(status.read_text())
    assert record["status"] == "unfinished" and record["error"].startswith(AT_CAP)
    assert not (tmp_path / "bench" / "errors.log").exists()
