"""Tests of the tests: the resume check of the kill-and-resume tests (``tests/resume_check.py``, used by
test_chaos.py, test_reliability.py and test_train.py) must fail on a copy of the package that does not really resume,
and pass on the real one.

Each mutant is a copy of ``mtl/`` and ``train.py`` under tmp_path with one line of ``mtl/run/trainer.py`` changed (the
substitution must match exactly once, so a changed trainer.py fails here instead of testing nothing), run as
``python <copy>/train.py`` from the copy (its ``mtl`` comes first on sys.path). One run is SIGKILLed at a fixed point
(it stops itself before step 4: ``trainer.poison=4:stop:0``; checkpoint step_2 and the records of steps 1-3 are on
disk), and copies of its folder are resumed by the real code and by each mutant.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from .conftest import PY, ROOT, TINY
from .proctree import kill_tree, state
from .resume_check import check_resume, model_bytes, snapshot

pytestmark = pytest.mark.slow

TRAINER = os.path.join("mtl", "run", "trainer.py")
# the one statement that takes the step from the checkpoint: "self.step, ... = self.folder.load(...)" on one line
LOAD = re.compile(r"^(?P<indent>[ \t]+)self\.step\b[^\n=]*=[ \t]*self\.folder\.load\([^\n]*\)[ \t]*$", re.M)
MUTANTS = {
    # issue 36.3: the checkpoint is loaded (weights, optimizer, data position), then the step count starts at 0 again
    "step_0_after_load": lambda m: f"{m[0]}\n{m['indent']}self.step, self.resume_notes = 0, []  # mutant",
    # the load skipped: a fresh start behind the "resuming from" line, ending with the uninterrupted run's weights
    "load_skipped": lambda m: f"{m['indent']}self.step, self.resume_notes = 0, []  # mutant",
}
MAX_STEPS = 5
ARGS = ["--config", TINY, f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_steps=2", "trainer.eval_every=1000",
        "trainer.num_samples=0", "trainer.log_every=1", "resume=auto"]


def mutant_copy(dest, name: str) -> str:
    """``mtl/`` and ``train.py`` copied to ``dest`` with mutant ``name`` applied; returns ``dest``."""
    shutil.copytree(os.path.join(ROOT, "mtl"), dest / "mtl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "train.py"), dest / "train.py")
    path = dest / TRAINER
    text, count = LOAD.subn(MUTANTS[name], path.read_text())
    assert count == 1, (f"{TRAINER}: {count} lines match {LOAD.pattern!r}, expected the one that takes the step from "
                        "self.folder.load: update LOAD and MUTANTS to the new code")
    path.write_text(text)
    return str(dest)


def train(package: str, out: str, *extra: str, wait: bool = True):
    """train.py of ``package`` (the real one: ROOT) on ``out``, its own ``mtl`` first on sys.path."""
    cmd = [PY, os.path.join(package, "train.py"), *ARGS, *extra, f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": package}
    if not wait:
        return subprocess.Popen(cmd, cwd=package, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    proc = subprocess.run(cmd, cwd=package, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def killed_run(out: str) -> None:
    """A run SIGKILLed while it stands (stopped) before step 4."""
    proc = train(ROOT, out, "trainer.poison=4:stop:0", wait=False)
    try:
        deadline = time.time() + 240
        while state(proc.pid) != "T":
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, "timed out waiting for the run to stop itself before step 4"
            time.sleep(0.05)
    finally:
        kill_tree(proc.pid)
        proc.communicate(timeout=60)
    assert proc.returncode == -9  # the kill, not an error, ended it


def test_the_resume_check_fails_on_runs_that_restart_from_step_0(tmp_path):
    packages = {name: mutant_copy(tmp_path / name, name) for name in MUTANTS}
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    train(ROOT, ref)
    killed_run(cut)
    before = snapshot(cut)
    assert before.step == 2 and [r["step"] for r in before.records] == [1, 2, 3], before  # where the kill landed

    real = str(tmp_path / "real")
    shutil.copytree(cut, real)
    train(ROOT, real)
    assert check_resume(real, before, last_step=MAX_STEPS) == [3, 4, 5]  # the check passes on the real code
    assert model_bytes(real, MAX_STEPS) == model_bytes(ref, MAX_STEPS)

    for name, package in packages.items():
        run = str(tmp_path / f"run_{name}")
        shutil.copytree(cut, run)
        proc = train(package, run)  # the mutant runs to the end, exit 0 ...
        assert "resuming from" in proc.stdout and "step_2" in proc.stdout  # ... and says what a real resume says
        with pytest.raises(AssertionError, match="did not continue from its checkpoint step_2"):
            check_resume(run, before, last_step=MAX_STEPS)  # ... but the check sees it start again
    # the skipped load even ends with the uninterrupted run's weights: only the records tell
    assert model_bytes(str(tmp_path / "run_load_skipped"), MAX_STEPS) == model_bytes(ref, MAX_STEPS)
