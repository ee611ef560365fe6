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

    from mtl.tools.bench.launch import drive

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

    from mtl.tools.bench.launch import SlurmLauncher, job_folder

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


@pytest.mark.slow
def test_a_job_stopped_at_its_time_limit_is_requeued_and_ends_with_the_uninterrupted_model(tmp_path):
    """bench.slurm: a run's job at its time limit (submitit's warning signal, USR2, sent to the job's process as
    submitit's local controller sends it signal_delay_s before the limit) checkpoints, is requeued, and the new
    attempt resumes from the newest checkpoint: the final model is the uninterrupted run's, byte for byte."""
    pytest.importorskip("submitit")
    import re
    import signal
    import time

    from omegaconf import OmegaConf

    from mtl.tools.bench.launch import REQUEUED, SlurmLauncher
    from mtl.tools.bench.sweep import run_command

    from .proctree import children
    from .resume_check import metrics_records

    over = ["trainer.max_steps=40", "trainer.eval_every=40", "trainer.log_every=1", "checkpoint.every_steps=4",
            "trainer.num_samples=0", "trainer.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = subprocess.run([PY, os.path.join(ROOT, "train.py"), "--config", TINY, *over,
                                f"output_dir={tmp_path / 'reference'}"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out, run_dir = tmp_path / "bench", tmp_path / "run"
    run_dir.mkdir()
    # a 1-minute limit: submitit counts a USR2 this close to it as the time limit (not a preemption)
    cfg = OmegaConf.create({"output_dir": str(out), "bench": {"launcher": "slurm", "slurm": {
        "cluster": "local", "cpus_per_run": 1, "time_min": 1}}})
    launcher = SlurmLauncher(cfg, {"OMP_NUM_THREADS": "1"}, 1)
    run = {"dir": str(run_dir), "config": {}, "code": None}
    job = launcher.start(run, run_command(TINY, [*over, f"output_dir={run_dir}", "resume=null"], 1), None)
    deadline = time.time() + 300
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
    # (a machine so loaded that an attempt outlives the minute's own warning at 30 s is requeued once more)
    resumed = [int(s) for s in re.findall(r"resume=auto: resuming from \S*step_(\d+)", log)]
    assert log.count(REQUEUED) == len(resumed) >= 1 and all(4 <= s < 40 for s in resumed), log[-3000:]
    # each step trained once, in order, across the two attempts; the same final model as without the stop
    steps = [r["step"] for r in metrics_records(str(run_dir)) if r.get("kind") == "train"]
    assert steps == list(range(1, 41)), steps
    final = os.path.join("checkpoints", "step_40", "model.safetensors")
    assert (run_dir / final).read_bytes() == (tmp_path / "reference" / final).read_bytes()
