"""Chaos: SIGKILL the whole job (launcher and workers, as a lost node would) at random points, again and
again in one run, resuming with ``resume=auto`` after each kill; the final model must be byte-for-byte the
model of an uninterrupted run. For 1 and 2 processes, with decoder dropout on (so every RNG matters).

The kill points come from a seeded plan (``SEED``), so a failure reproduces (up to the machine's timing).
Each kill waits for a trigger: a delay after launch (start-up), a step's metrics record (mid-step, or the
evaluation that follows an evaluation step), or a checkpoint's files appearing (save). Every job must have continued
from the newest complete checkpoint on disk (read by the test itself), as its own records in metrics.jsonl show
(tests/resume_check.py: it kept the records up to that step and trained the next steps, none twice), so a resume that
silently starts over, from scratch or from step 0 with the checkpoint's weights, or picks an older checkpoint, fails
here even where the run would still end identical. Where a kill really landed is read from the run's own output when
the job is frozen just before the kill, and printed.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import threading
import time
from collections import Counter

import pytest

from .conftest import PY, ROOT, TINY, free_port, run_train
from .proctree import kill_tree
from .resume_check import check_resume, metrics_records, model_bytes, snapshot

pytestmark = pytest.mark.slow

SEED = 1130
KILLS_PER_WORLD_SIZE = 5
MAX_STEPS, EVAL_EVERY, CKPT_EVERY = 12, 3, 2
ARGS = ["--config", TINY, f"trainer.max_steps={MAX_STEPS}", f"trainer.eval_every={EVAL_EVERY}",
        "trainer.eval_max_batches=1", "trainer.num_samples=0", "trainer.log_every=1",
        f"checkpoint.every_steps={CKPT_EVERY}", "model.decoder.dropout=0.1", "resume=auto"]
SLOW_SAVE = {"MTL_TEST_SLOW_SAVE": "0.3"}  # rank 0 lingers inside each save, so a save can be hit
PHASES = ("start-up", "mid-step", "evaluation", "save")
BANNER = re.compile(r"^mtl: \d+ process\(es\) on")


class Job:
    """One launch of train.py (under mtl.tools.launch for 2 processes), its stdout collected line by line."""

    def __init__(self, nproc: int, out: str):
        cmd = [PY, os.path.join(ROOT, "train.py")] if nproc == 1 else [
            PY, "-m", "mtl.tools.launch", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", os.path.join(ROOT, "train.py")]
        self.started = time.time()
        self.proc = subprocess.Popen([*cmd, *ARGS, f"output_dir={out}"], cwd=ROOT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **SLOW_SAVE},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, into: list) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def started_training(self) -> bool:
        return any(BANNER.match(line) for line in self.lines)

    def resume_step(self) -> int:
        for line in self.lines:
            m = re.search(r"resuming from \S*step_(\d+)", line)
            if m:
                return int(m.group(1))
        return 0

    def tail(self) -> str:
        return "\n".join(self.lines[-20:] + self.err[-40:])


def phase_of(job: Job, out: str) -> str:
    """Where the frozen job is, from its own output: the banner, metrics.jsonl and its checkpoint lines."""
    time.sleep(0.2)  # let the reader threads drain what the job wrote before it was frozen
    if not job.started_training():
        return "start-up"  # imports, data, tokenizer, model, DDP, loading the checkpoint
    recs = metrics_records(out)
    trained = [r["step"] for r in recs if r["kind"] == "train"]
    step = max(trained, default=job.resume_step())
    evaluated = any(r["kind"] == "eval" and r["step"] == step for r in recs)
    if step % EVAL_EVERY == 0 and step < MAX_STEPS and step in trained and not evaluated:
        return "evaluation"
    if step % CKPT_EVERY == 0 and step in trained and not any(f"step {step}: checkpoint" in line for line in job.lines):
        return "save"
    return "mid-step"


def wait(job: Job, condition, what: str, timeout: float = 300) -> bool:
    """Wait for ``condition()``; False if the job ended first."""
    deadline = time.time() + timeout
    while not condition():
        if job.proc.poll() is not None:
            return False
        assert time.time() < deadline, f"timed out waiting for {what}\n{job.tail()}"
        time.sleep(0.01)
    return True


def trigger(job: Job, out: str, kind: str, rng: random.Random) -> bool:
    """Wait for the planned moment; False if the job finished or died before it."""
    if kind == "start-up":
        delay = rng.uniform(0.3, 3.0)  # importing torch alone takes about that long
        return wait(job, lambda: time.time() - job.started > delay, "a start-up delay")
    if not wait(job, job.started_training, "the start of training"):
        return False
    first = job.resume_step() + 1
    wanted = {"mid-step": lambda s: s % EVAL_EVERY and s % CKPT_EVERY,
              "evaluation": lambda s: s % EVAL_EVERY == 0,
              "save": lambda s: s % CKPT_EVERY == 0}[kind]
    steps = [s for s in range(first, MAX_STEPS) if wanted(s)]
    if not steps:  # too close to the end for this kind: a random moment instead
        delay = rng.uniform(0.0, 0.5)
        return wait(job, lambda: time.time() - job.started > delay, "a delay")
    step = rng.choice(steps[:2])
    if kind == "save":  # rank 0 has written its files and lingers before the rename
        tmp = os.path.join(out, "checkpoints", f".step_{step}.tmp", "trainer_state.pt")

        def writing() -> bool:  # by this job, not left over from a save an earlier kill cut short
            try:
                return os.path.getmtime(tmp) >= job.started
            except OSError:
                return False

        return wait(job, writing, f"the step-{step} save")
    if not wait(job, lambda: any(r["kind"] == "train" and r["step"] == step for r in metrics_records(out)), f"step {step}"):
        return False
    if kind == "mid-step":
        time.sleep(rng.uniform(0.0, 0.1))
    return True


def check_resumed(job: Job, out: str, before, checked: list, last_step: int | None = None) -> None:
    """The job continued from the newest complete checkpoint (``resume=auto``'s rule), not from an older one, from
    step 0 or from scratch: its records in metrics.jsonl say so (``check_resume``), and so does its console line."""
    try:
        own = check_resume(out, before, last_step)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{job.tail()}") from None
    if job.started_training():
        assert job.resume_step() == before.step, f"resumed from step {job.resume_step()}, expected {before.step}\n{job.tail()}"
    if before.step and own:
        checked.append(before.step)  # a real resume, and its first steps were checked


def chaos(nproc: int, out: str, rng: random.Random) -> Counter:
    """Kill, resume, kill again ... KILLS_PER_WORLD_SIZE times, then let the run finish."""
    plan = list(PHASES) + [rng.choice(PHASES) for _ in range(KILLS_PER_WORLD_SIZE - len(PHASES))]
    rng.shuffle(plan)
    landed: Counter = Counter()
    checked: list[int] = []  # the checkpoint step of each job seen training on from a checkpoint
    for kind in plan:
        before = snapshot(out)
        job = Job(nproc, out)
        try:
            if not trigger(job, out, kind, rng):
                job.proc.wait(timeout=300)
                raise AssertionError(f"the run ended before the planned {kind} kill\n{job.tail()}")
        except BaseException:
            kill_tree(job.proc.pid)  # leave nothing running behind a failed test
            raise
        where: list[str] = []
        kill_tree(job.proc.pid, while_frozen=lambda: where.append(phase_of(job, out)))  # verifies all are gone
        job.proc.wait(timeout=60)
        assert job.proc.returncode == -9, job.tail()  # the kill, not an error, ended it
        landed[where[0]] += 1
        check_resumed(job, out, before, checked)
    before = snapshot(out)
    done = Job(nproc, out)
    try:
        done.proc.wait(timeout=300)
    except BaseException:
        kill_tree(done.proc.pid)
        raise
    for t in done._readers:
        t.join(timeout=10)
    assert done.proc.returncode == 0, done.tail()
    check_resumed(done, out, before, checked, last_step=MAX_STEPS)
    assert before.step > 0 and len(checked) >= 2, checked  # real resumes were checked
    return landed


def test_random_kills_of_the_whole_job_then_resume_end_bitwise_identical(tmp_path):
    rng = random.Random(SEED)
    total: Counter = Counter()
    report = []
    for nproc in (1, 2):
        ref, cut = str(tmp_path / f"ref{nproc}"), str(tmp_path / f"chaos{nproc}")
        run_train([*ARGS, f"output_dir={ref}"], nproc=nproc)
        landed = chaos(nproc, cut, rng)
        assert model_bytes(ref, MAX_STEPS) == model_bytes(cut, MAX_STEPS), f"{nproc} process(es): kills {dict(landed)}"
        total += landed
        report.append(f"{nproc} process(es): " + ", ".join(f"{p} {landed[p]}" for p in PHASES))
    print(f"\nchaos: {sum(total.values())} kills, each followed by resume=auto; bitwise identical at the end. "
          f"Landed: {', '.join(f'{p} {total[p]}' for p in PHASES)} ({'; '.join(report)})")
    assert sum(total.values()) >= 10
    assert all(total[p] for p in PHASES), total  # the triggers reached every phase
