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
    jobs = [j for j in os.listdir(out / "slurm") if j.isdigit()]  # submitit's folder per job id, with its result
    assert len(jobs) == 2, jobs
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
    assert len([j for j in os.listdir(out / "slurm") if j.isdigit()]) == 3  # one more job only


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
