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
