"""SIGTERM at each phase of a run, hit for sure (not by timing): ``MTL_TEST_SIGTERM_AT=<phase>`` makes the run send
itself SIGTERM when it enters that phase (mtl/run/faults.py). In start-up the run ends at once (exit 143, one line,
run.lock released); later it saves and exits 0. In-process and one process: the phases are the same under torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import train

from .conftest import ROOT, TINY
from .resume_check import metrics_records

# two steps, an evaluation with its sample figure and a periodic save at step 2; a stop there is saved at step 3
RUN = ["--config", TINY, "trainer.max_steps=4", "trainer.eval_every=2", "checkpoint.every_steps=2", "trainer.log_every=1"]


@pytest.fixture
def sigterm_guard():
    """A SIGTERM no handler of the run catches lands here and is counted, instead of ending the test process."""
    caught = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    yield caught
    signal.signal(signal.SIGTERM, previous)


def run_with_sigterm_at(phase, tmp_path, capsys, monkeypatch) -> tuple[int, str, str, str]:
    monkeypatch.setenv("MTL_TEST_SIGTERM_AT", phase)
    out = str(tmp_path / "run")
    capsys.readouterr()
    code = train.main([*RUN, f"output_dir={out}"])
    stdout, err = capsys.readouterr()
    return code, stdout, err, out


def checkpoints(out) -> list[int]:
    root = os.path.join(out, "checkpoints")
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []


def test_sigterm_while_the_run_builds_ends_it_at_once_with_the_lock_released(tmp_path, capsys, monkeypatch,
                                                                             sigterm_guard):
    code, stdout, err, out = run_with_sigterm_at("build", tmp_path, capsys, monkeypatch)
    assert sigterm_guard == []  # the run's own handler took it
    assert code == 143, (stdout[-2000:], err[-2000:])  # 128 + SIGTERM: nothing was trained or saved
    lines = [line for line in err.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1 and "during start-up (build)" in lines[0], err[-2000:]
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(out, "run.lock"))  # released: the next run starts without a stale lock
    assert checkpoints(out) == [] and "step 1" not in stdout


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
@pytest.mark.parametrize("phase", ["evaluation", "sample figure", "save"])
def test_sigterm_in_training_saves_and_exits_zero_whatever_the_run_is_doing(phase, tmp_path, capsys, monkeypatch,
                                                                            sigterm_guard):
    code, stdout, err, out = run_with_sigterm_at(phase, tmp_path, capsys, monkeypatch)
    assert sigterm_guard == []
    assert code == 0, (stdout[-2000:], err[-2000:])
    # it arrived in that phase (at step 2), and the next step, agreed by every rank, is saved
    assert f"step 3: stop signal received (SIGTERM, during the {phase} at step 2); saving a checkpoint" in stdout, \
        stdout[-2000:]
    assert checkpoints(out) == [2, 3] and "done:" not in stdout
    assert not os.path.exists(os.path.join(out, "run.lock"))
    # a periodic evaluation a stop signal lands in is cut short, so that the save comes within the grace torchrun
    # and Slurm give (30 s) however long the evaluation; a cut evaluation is not recorded (nor stepped on)
    evals = [r["step"] for r in metrics_records(out) if r["kind"] == "eval"]
    if phase == "evaluation":
        assert evals == [] and "step 2: evaluation cut short by a stop signal" in stdout, stdout[-2000:]
    else:
        assert evals == [2]


def test_a_failed_rank_torn_down_by_torchrun_keeps_its_own_exit_code():
    """Once a rank has failed, its peers exit and torchrun sends SIGTERM to whoever is left, which can be the failed
    rank itself, still exiting: it must end with its own code (4 here), not be killed (-15), or the launcher names the
    wrong cause."""
    code = ("import os, signal, sys, time\nfrom mtl.run.signals import keep_exit_code\n"
            "if sys.argv[1] == 'keep':\n    keep_exit_code(4)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    runs = {how: subprocess.run([sys.executable, "-c", code, how], cwd=ROOT, capture_output=True, timeout=60)
            for how in ("default", "keep")}
    assert runs["default"].returncode == -signal.SIGTERM  # the fault: killed, its code lost
    assert runs["keep"].returncode == 4, runs["keep"].stderr
