"""bench.launcher: slurm, end to end under submitit's local executor (no Slurm needed): each run one job, a failed
job recorded with its error while the sweep goes on, a re-run skipping the finished runs, the analysis at the end."""

import json
import os
import subprocess

import pytest

from .conftest import PY, ROOT, TINY

ARGS = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=1", "checkpoint.every_steps=0",
        "bench.seeds=[0]", "bench.last_k=2", "bench.methods=[equal,static]", "bench.baselines=false",
        "bench.select=last", "bench.launcher=slurm", "bench.slurm.cluster=local", "bench.slurm.cpus_per_run=1",
        "bench.parallel=2"]


def bench(out):
    return subprocess.run([PY, "-m", "mtl.tools.bench.sweep", "--config", TINY, f"output_dir={out}", *ARGS], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _jobs(out) -> set:
    """The ids of the jobs submitit's local executor ran: its files in output_dir/slurm are <job id>_<...>."""
    return {f.split("_")[0] for f in os.listdir(out / "slurm") if f.endswith("_result.pkl")}


def _status(out):
    with open(out / "runs.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_sweep_through_submitit_records_a_failed_job_and_skips_finished_runs_again(tmp_path):
    pytest.importorskip("submitit")
    out = tmp_path / "bench"
    proc = bench(out)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "natural equal seed 0: training (slurm)" in proc.stdout and "FAILED" in proc.stdout
    status = {r["label"]: r for r in _status(out)}
    assert status["equal"]["status"] == "ok"
    # the job of static without weights ran and failed (its own config error): recorded with the error and job id
    assert status["static"]["status"] == "failed" and "weighting.weights" in status["static"]["error"]
    assert status["static"]["error"].startswith("job ")
    assert len(_jobs(out)) == 2, os.listdir(out / "slurm")
    run = out / "runs" / "natural" / "equal" / "seed0"
    record = json.loads((run / "bench_run.json").read_text())  # written by the job itself, where it ran
    assert record["provenance"]["threads"] == 1 and "submitit" in " ".join(record["argv"])
    assert json.loads((run / "final_metrics.json").read_text())["step"] == 4
    md = (out / "results.md").read_text()
    assert "| `equal` |" in md and "- `static` seed 0: failed" in md
    first = (run / "final_metrics.json").stat().st_mtime
    again = bench(out)  # a re-run: the finished run is skipped, the failed one tried again (and fails again)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "natural equal seed 0: finished before with this configuration, skipped" in again.stdout
    assert "natural static seed 0: training (slurm)" in again.stdout
    assert (run / "final_metrics.json").stat().st_mtime == first
    assert sorted(r["label"] for r in _status(out)) == ["equal", "static", "static"]
    assert len(_jobs(out)) == 3  # one more job only
    assert not (out / "slurm" / "%j").exists()


def test_sigterm_to_the_sweep_stops_every_run_in_flight():
    """scancel of a driver job sends SIGTERM: the launcher's stop (terminate a process, cancel a job) runs for every
    run in flight, and the signal's previous handler is back afterwards."""
    import signal
    import threading

    from mtl.bench.launch import drive

    stopped, started = [], []

    class Never:
        name = "fake"

        def start(self, run, command, record):
            started.append(run["i"])
            return run["i"]

        def poll(self, handle, run):
            return None  # never finishes

        def stop(self, handle):
            stopped.append(handle)

    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(SystemExit) as e:
        drive(Never(), [{"i": k} for k in range(3)], 2, lambda r: (["true"], lambda: None), lambda r, o: None,
              poll_s=0.05)
    assert e.value.code == 143 and started == [0, 1] and sorted(stopped) == [0, 1]
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow
def test_the_local_executor_leaves_no_folder_named_after_the_job_id_pattern(tmp_path):
    """submitit's local job process makes its folder as given: a folder ``slurm/%j`` was left empty beside the
    jobs' files (issue 32.8). The local executor gets ``output_dir/slurm`` itself; Slurm still gets ``%j``."""
    pytest.importorskip("submitit")
    import sys
    import time

    from omegaconf import OmegaConf

    from mtl.bench.launch import SlurmLauncher, job_folder

    assert job_folder("o", "slurm") == os.path.join("o", "slurm", "%j")
    out = tmp_path / "bench"
    cfg = OmegaConf.create({"output_dir": str(out), "bench": {"launcher": "slurm",
                                                              "slurm": {"cluster": "local", "cpus_per_run": 1}}})
    launcher = SlurmLauncher(cfg, {"OMP_NUM_THREADS": "1"}, 1)
    run = {"dir": str(tmp_path / "run"), "config": {}, "code": None}
    job = launcher.start(run, [sys.executable, "-c", "print('trained')"], None)
    deadline = time.time() + 300
    while (outcome := launcher.poll(job, run)) is None and time.time() < deadline:
        time.sleep(0.2)
    assert outcome is True, outcome
    assert (tmp_path / "run" / "log.txt").read_text().strip() == "trained"  # the job really ran
    assert _jobs(out) == {str(job.job_id)}, os.listdir(out / "slurm")
    assert not [f for f in os.listdir(out / "slurm") if "%" in f], os.listdir(out / "slurm")


# The jobs' time limit in the timing tests: under 10 minutes submitit takes every USR2 for the time limit, and 9
# minutes keeps the local controller's own warning (at 9 min - signal_delay_s) out of a test on a loaded machine,
# where it came during a run's start-up or between the test's signals (an extra requeue, or a job killed before
# submitit's handler); the tests send the warning themselves, on events (a checkpoint written, an attempt resumed).
LIMIT_MIN = 9
HUNG_S = 480  # a hung test's end, not a timing: below LIMIT_MIN, so no warning of the controller's comes first


def _reference_and_job(tmp_path, steps: int, time_min: int, **slurm):
    """An uninterrupted run of ``steps`` steps in ``tmp_path/reference``, then the same run started as a job of
    submitit's local executor (``bench.slurm.time_min``): (the bench folder, the run's folder, the launcher, the
    run, the job)."""
    from omegaconf import OmegaConf

    from mtl.bench.launch import SlurmLauncher
    from mtl.bench.runs import run_command

    over = [f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", "trainer.log_every=1",
            "checkpoint.every_steps=4", "trainer.num_samples=0", "trainer.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = subprocess.run([PY, os.path.join(ROOT, "train.py"), "--config", TINY, *over,
                                f"output_dir={tmp_path / 'reference'}"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out, run_dir = tmp_path / "bench", tmp_path / "run"
    run_dir.mkdir()
    cfg = OmegaConf.create({"output_dir": str(out), "bench": {"launcher": "slurm", "slurm": {
        "cluster": "local", "cpus_per_run": 1, "time_min": time_min, **slurm}}})
    launcher = SlurmLauncher(cfg, {"OMP_NUM_THREADS": "1"}, 1)
    run = {"dir": str(run_dir), "config": {}, "code": None}
    job = launcher.start(run, run_command(TINY, [*over, f"output_dir={run_dir}", "resume=null"], 1), None)
    return out, run_dir, launcher, run, job


@pytest.mark.slow
def test_a_job_stopped_at_its_time_limit_is_requeued_and_ends_with_the_uninterrupted_model(tmp_path):
    """bench.slurm: a run's job at its time limit (submitit's warning signal, USR2, sent to the job's process as
    submitit's local controller sends it signal_delay_s before the limit) checkpoints, is requeued, and the new
    attempt resumes from the newest checkpoint: the final model is the uninterrupted run's, byte for byte."""
    pytest.importorskip("submitit")
    import re
    import signal
    import time

    from mtl.bench.launch import REQUEUED

    from .proctree import children
    from .resume_check import metrics_records

    # under 10 minutes, submitit counts any USR2 as the time limit (not a preemption); 9 minutes: the local
    # controller's own warning (8.5 minutes in) never comes on a loaded machine, only the one sent below, once the
    # run has saved its first checkpoint (events, not wall time: the deadline only stops a hung test)
    out, run_dir, launcher, run, job = _reference_and_job(tmp_path, 40, time_min=LIMIT_MIN)
    deadline = time.time() + HUNG_S
    while not (run_dir / "checkpoints" / "step_4" / "manifest.json").exists() and time.time() < deadline:
        assert launcher.poll(job, run) is None, (run_dir / "log.txt").read_text()[-3000:]
        time.sleep(0.05)
    tasks = children(int(job.job_id))  # the local controller's task: the job's own process (submitit's _submit)
    assert len(tasks) == 1, tasks
    os.kill(tasks[0], signal.SIGUSR2)
    while (outcome := launcher.poll(job, run)) is None and time.time() < deadline:
        time.sleep(0.2)
    log = (run_dir / "log.txt").read_text()
    assert outcome is True, f"{outcome}\n{log[-3000:]}"
    # the kill happened: submitit took it for the time limit and requeued the job, and the run was stopped mid-way
    submitit_log = "".join(p.read_text() for p in (out / "slurm").glob(f"{job.job_id}_0_log.*"))
    assert "this job is timed-out" in submitit_log and f"Requeued job {job.job_id}" in submitit_log, submitit_log
    resumed = [int(s) for s in re.findall(r"resume=auto: resuming from \S*step_(\d+)", log)]
    assert log.count(REQUEUED) == len(resumed) == 1 and 4 <= resumed[0] < 40, log[-3000:]
    assert submitit_log.count(f"Requeued job {job.job_id}") == 1, submitit_log
    # each step trained once, in order, across the two attempts; the same final model as without the stop
    steps = [r["step"] for r in metrics_records(str(run_dir)) if r.get("kind") == "train"]
    assert steps == list(range(1, 41)), steps
    final = os.path.join("checkpoints", "step_40", "model.safetensors")
    assert (run_dir / final).read_bytes() == (tmp_path / "reference" / final).read_bytes()


def _job_process(job) -> int:
    """The job's own process under submitit's local controller (its task: submitit's _submit, running RunJob)."""
    from .proctree import children

    tasks = children(int(job.job_id))
    assert len(tasks) == 1, tasks
    return tasks[0]


@pytest.mark.slow
def test_stop_signals_that_reach_the_run_itself_requeue_its_job_and_end_with_the_uninterrupted_model(tmp_path):
    """Slurm signals every process of the job step, not only submitit's: (1) its warning signal (USR2, at the time
    limit) reaches the run too, whose default action for it is to die at once without saving; (2) a SIGTERM (a
    preemption, the hard time limit) makes the run save and exit 0 without its final metrics, which RunJob counted
    as a failed run. Both sent as Slurm sends them (to the job's process and the run's): each time the run saves its
    step, the job is requeued, the next attempt resumes, nothing is recorded as failed, and the final model is the
    uninterrupted run's, byte for byte."""
    pytest.importorskip("submitit")
    import re
    import signal
    import time

    from mtl.bench.launch import REQUEUED

    from .proctree import children
    from .resume_check import metrics_records

    out, run_dir, launcher, run, job = _reference_and_job(tmp_path, 60, time_min=LIMIT_MIN)
    deadline = time.time() + HUNG_S  # only stops a hung test: each wait below is on an event
    log = run_dir / "log.txt"

    def wait_for(what, ready):
        while not ready():
            assert launcher.poll(job, run) is None, f"ended while waiting for {what}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, what
            time.sleep(0.05)

    def newest():
        return max((int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
                    if (p / "manifest.json").exists()), default=0)

    def signal_job(sig):  # as Slurm does: every process of the step, the job's own and the run's
        proc = _job_process(job)
        (trainer,) = children(proc)
        for pid in (proc, trainer):
            os.kill(pid, sig)

    wait_for("the first checkpoint", lambda: newest() >= 4)
    signal_job(signal.SIGUSR2)
    def resumed_from():
        found = re.findall(r"resume=auto: resuming from \S*step_(\d+)", log.read_text())
        return int(found[-1]) if found else None

    wait_for("the second attempt's first checkpoint", lambda: (s := resumed_from()) is not None and newest() > s)
    signal_job(signal.SIGTERM)
    while (outcome := launcher.poll(job, run)) is None and time.time() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert outcome is True, f"{outcome}\n{text[-3000:]}"
    # both stops happened mid-run and each time the run saved its step (not killed by the warning signal)
    saved = [int(s) for s in re.findall(r"step (\d+): stop signal received", text)]
    resumed = [int(s) for s in re.findall(r"resume=auto: resuming from \S*step_(\d+)", text)]
    assert len(saved) == 2 and resumed == saved and all(4 <= s < 60 for s in saved), text[-3000:]
    assert text.count(REQUEUED) == 2 and "requeuing its job" in text, text[-3000:]
    submitit_log = "".join(p.read_text() for p in (out / "slurm").glob(f"{job.job_id}_0_log.*"))
    assert submitit_log.count(f"Requeued job {job.job_id}") == 2, submitit_log
    steps = [r["step"] for r in metrics_records(str(run_dir)) if r.get("kind") == "train"]
    assert steps == list(range(1, 61)), steps
    final = os.path.join("checkpoints", "step_60", "model.safetensors")
    assert (run_dir / final).read_bytes() == (tmp_path / "reference" / final).read_bytes()


def test_a_run_stopped_after_the_sweep_cancelled_its_job_is_not_requeued(tmp_path):
    """Slurm's cancel (the sweep's ``stop``: scancel) sends the run SIGTERM too, and the run saves and exits 0 as at a
    preemption: RunJob requeues such a job through submitit's handler, unless the sweep marked the folder first; a
    run killed by SIGTERM is requeued too."""
    import signal
    import sys

    from mtl.bench.launch import CANCELLED, RunJob, warning_signal

    calls = []

    def checkpoint_and_try_requeue(signum, frame):  # stands for submitit's handler in a job's process
        calls.append(signum)
        raise SystemExit(-1)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{}")  # it started training; exits 0 without final_metrics.json: stopped
    stopped = [sys.executable, "-c", "pass"]
    previous = signal.signal(warning_signal(), checkpoint_and_try_requeue)
    try:
        with pytest.raises(SystemExit):
            RunJob()(stopped, str(run_dir), {}, ROOT)
        assert calls == [warning_signal()] and "requeuing its job" in (run_dir / "log.txt").read_text()
        (run_dir / CANCELLED).write_text("")
        with pytest.raises(RuntimeError, match="the sweep cancelled its job"):
            RunJob()(stopped, str(run_dir), {}, ROOT)
        assert calls == [warning_signal()]
        # a run that dies of SIGTERM (before the trainer's handler is installed, even before it wrote run.json) is
        # requeued too: what it saved is kept, and a run that saved nothing starts again
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        with pytest.raises(SystemExit):
            RunJob()([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], str(fresh),
                     {}, ROOT)
        assert calls == [warning_signal()] * 2
    finally:
        signal.signal(warning_signal(), previous)


def test_the_sweeps_cancel_marks_the_run_folder_before_it_cancels_the_job(tmp_path):
    """``SlurmLauncher.stop`` (the sweep interrupted) writes ``CANCELLED`` in the run's folder before the cancel, whose
    SIGTERM the job's RunJob then reads as the sweep's, not a preemption's."""
    pytest.importorskip("submitit")
    from omegaconf import OmegaConf

    from mtl.bench.launch import CANCELLED, SlurmLauncher

    cfg = OmegaConf.create({"output_dir": str(tmp_path / "bench"), "bench": {"launcher": "slurm",
                                                                              "slurm": {"cluster": "local"}}})
    launcher = SlurmLauncher(cfg, {}, 1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    seen = []

    class Job:
        job_id = "7"

        def cancel(self, check=True):
            seen.append((run_dir / CANCELLED).exists())

    launcher._dirs["7"] = str(run_dir)
    launcher.stop(Job())
    assert seen == [True]


@pytest.mark.slow
def test_a_job_past_its_requeue_cap_is_unfinished_and_a_new_job_resumes_it_to_the_uninterrupted_model(tmp_path):
    """bench.slurm.max_requeues=1: the job's second time limit is past submitit's cap ("timed-out too many times"),
    the run is left unfinished with its checkpoints; the outcome says so (not a failure), and the next job of the
    run (the next bench invocation's) resumes it from its newest checkpoint to the uninterrupted run's model."""
    pytest.importorskip("submitit")
    import re
    import signal
    import time

    from mtl.bench.launch import AT_CAP

    from .resume_check import metrics_records

    out, run_dir, launcher, run, job = _reference_and_job(tmp_path, 60, time_min=LIMIT_MIN, max_requeues=1)
    assert launcher.executor._executor.max_num_timeout == 1
    deadline = time.time() + HUNG_S  # only stops a hung test: each wait below is on an event
    log = run_dir / "log.txt"

    def newest():
        return max((int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
                    if (p / "manifest.json").exists()), default=0)

    def resumed_from():
        found = re.findall(r"resume=auto: resuming from \S*step_(\d+)", log.read_text() if log.exists() else "")
        return int(found[-1]) if found else None

    def wait_for(what, ready):
        while not ready():
            assert launcher.poll(job, run) is None, f"ended while waiting for {what}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, what
            time.sleep(0.05)

    wait_for("the first checkpoint", lambda: newest() >= 4)
    os.kill(_job_process(job), signal.SIGUSR2)  # the time limit: requeued (1 of 1)
    wait_for("the second attempt's first checkpoint", lambda: (s := resumed_from()) is not None and newest() > s)
    os.kill(_job_process(job), signal.SIGUSR2)  # the time limit again: past the cap
    while (outcome := launcher.poll(job, run)) is None and time.time() < deadline:
        time.sleep(0.2)
    submitit_log = "".join(p.read_text() for p in (out / "slurm").glob(f"{job.job_id}_0_log.*"))
    assert "timed-out too many times" in submitit_log, submitit_log
    assert isinstance(outcome, str) and outcome.startswith(AT_CAP), outcome
    assert not (run_dir / "final_metrics.json").exists()
    stopped_at = newest()
    assert 4 < stopped_at < 60
    again = launcher.start(run, job.submission().args[0], None)  # the run's next job: its folder's checkpoints
    while (outcome := launcher.poll(again, run)) is None and time.time() < deadline:
        time.sleep(0.2)
    assert outcome is True, f"{outcome}\n{log.read_text()[-3000:]}"
    assert resumed_from() == stopped_at
    steps = [r["step"] for r in metrics_records(str(run_dir)) if r.get("kind") == "train"]
    assert steps == list(range(1, 61)), steps
    final = os.path.join("checkpoints", "step_60", "model.safetensors")
    assert (run_dir / final).read_bytes() == (tmp_path / "reference" / final).read_bytes()
