"""Checkpoints and the run folder, in-process.

Faults are injected where they happen (a rename that never comes because the process dies, a write that
finds the disk full, a read-only mount, a flipped bit), and each test asserts that its fault really fired.
Most tests drive the ``RunFolder`` alone (``lock`` and ``prepare``), the code every run takes at start-up (lock,
recovery, choosing the checkpoint), without data or a model; one test trains for real, in this process.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from mtl import files as files_module
from mtl.checkpoint import folder as ckpt
from mtl.config.schema import to_yaml
from mtl.errors import CheckpointError, ConfigError
from mtl.parallel.dist import DistInfo
from mtl.run import logger as logger_module
from mtl.run import runlock
from mtl.run.run_folder import RunFolder
from mtl.run.trainer import Trainer
from mtl.setup.checks import load_run_config

from .conftest import ROOT, TINY


def config(out, *overrides):
    return load_run_config(TINY, [f"output_dir={out}", *overrides])


def prepare(out, *overrides):
    """Run start-up's output_dir handling as a 1-process run would; return (checkpoint to resume or None,
    the RunFolder holding the lock: close() it)."""
    t = RunFolder(config(out, *overrides), DistInfo())
    t.lock()
    return t.prepare(), t


def decide(out, *overrides):
    path, t = prepare(out, *overrides)
    t.close()
    return path


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def save(out, step, net=None, keep_last=0, extra=None):
    """A checkpoint of ``out``'s run, as the trainer writes it (its config is the one ``config(out)`` loads)."""
    state = {"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1}
    return ckpt.save_checkpoint(str(out), step, net or model(step), state, to_yaml(config(out)), 0, keep_last,
                                extra)


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


class FullDisk:
    """A replacement for ``open`` that lets writes to files named ``name`` reach the disk up to ``room`` bytes,
    then fails them with ENOSPC, as a full disk does (the partial file is really on disk)."""

    def __init__(self, name, room=64):
        self.name, self.room, self.fired = name, room, 0

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if os.path.basename(str(path)).startswith(self.name) and ("w" in mode or "a" in mode):
            return _Filling(f, self)
        return f


class _Filling:
    """Once full, the disk stays full: a later write, flush or close of this file fails too (a real buffered
    file keeps the bytes it could not write and tries again at close)."""

    def __init__(self, f, disk):
        self._f, self._disk, self._written, self._full = f, disk, 0, False

    def _fail(self):
        self._full = True
        self._disk.fired += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, data):
        if self._full:
            self._fail()
        if self._written + len(data) > self._disk.room:
            self._f.write(data[: max(0, self._disk.room - self._written)])
            self._f.flush()
            self._fail()
        self._written += len(data)
        return self._f.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        if self._full:
            self._fail()
        self._f.flush()

    def close(self):
        if not self._f.closed:
            self._f.close()
            if self._full:
                self._fail()

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Killed(BaseException):
    """The process dies here (nothing after this point runs; no except clause catches it)."""


# ------------------------------------------------------------------ checksums and extra files (defect 13)


def test_a_checkpoint_carries_a_manifest_and_extra_files(tmp_path):
    extra = {"class_names.json": b'["circle", "square"]', "tokenizer/tokenizer.json": b'{"model": {}}'}
    path = save(tmp_path, 2, extra=extra)
    with open(os.path.join(path, ckpt.MANIFEST)) as f:
        files = json.load(f)["files"]
    assert set(files) == {"model.safetensors", "trainer_state.pt", "config.yaml", "rng_rank0.pt", *extra}
    assert file_bytes(os.path.join(path, "tokenizer", "tokenizer.json")) == extra["tokenizer/tokenizer.json"]
    assert ckpt.verify_checkpoint(path)["step"] == 2
    with pytest.raises(ValueError, match="not a free relative name"):
        save(tmp_path, 3, extra={"../escape.txt": b"x"})


def test_a_flipped_bit_is_refused_and_resume_auto_falls_back_with_a_warning(tmp_path, capsys):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    weights = os.path.join(newest, "model.safetensors")
    data = bytearray(file_bytes(weights))
    data[-5] ^= 0x10  # one bit in the last tensor's data: the file still parses
    with open(weights, "wb") as f:
        f.write(data)
    ckpt.load_checkpoint(newest, model(4), 0)  # the fault: the bad file still loads without a checksum
    with pytest.raises(CheckpointError) as e:
        decide(tmp_path, f"resume={newest}")
    assert e.value.exit_code == 4 and "model.safetensors does not match its SHA-256 checksum" in e.value.message
    assert decide(tmp_path, "resume=auto") == os.path.join(tmp_path, "checkpoints", "step_2")
    out = capsys.readouterr().out
    assert "skipping broken checkpoint step_4: model.safetensors does not match its SHA-256 checksum" in out


# ------------------------------------------------------------------ resume=auto's one rule (defect 9)


def _no_trainer_state(path):
    os.remove(os.path.join(path, "trainer_state.pt"))


def _truncated_model(path):
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)


def _no_rng(path):
    os.remove(os.path.join(path, "rng_rank0.pt"))


def _no_manifest(path):  # a folder from an mtl without checksums, or a copy that lost it
    os.remove(os.path.join(path, ckpt.MANIFEST))


@pytest.mark.parametrize("damage, reason", [
    (_no_trainer_state, "trainer_state.pt is missing"),
    (_truncated_model, "model.safetensors has"),
    (_no_rng, "rng_rank0.pt is missing"),
    (_no_manifest, "manifest.json is missing"),
])
def test_resume_auto_skips_a_broken_newest_checkpoint_naming_it(tmp_path, capsys, damage, reason):
    save(tmp_path, 2)
    damage(save(tmp_path, 4))
    assert decide(tmp_path, "resume=auto") == os.path.join(tmp_path, "checkpoints", "step_2")
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "skipping" in line]
    assert len(warnings) == 1 and "step_4" in warnings[0] and reason in warnings[0], out
    assert "resuming from " + os.path.join(str(tmp_path), "checkpoints", "step_2") in out


def test_resume_auto_refuses_when_every_checkpoint_is_broken(tmp_path):
    _truncated_model(save(tmp_path, 2))
    with pytest.raises(CheckpointError) as e:
        decide(tmp_path, "resume=auto")
    assert "no complete checkpoint" in e.value.message and "step_2" in e.value.message
    assert "overwrite=true" in e.value.message and "use resume=auto" not in e.value.message  # no circular advice


# ------------------------------------------------------------------ a missing RNG file (defect 6)


def test_a_missing_rng_file_is_refused_naming_it(tmp_path):
    path = save(tmp_path, 2)
    _no_rng(path)
    with pytest.raises(CheckpointError, match="rng_rank0.pt is missing"):
        ckpt.load_checkpoint(path, model(2), 0)
    with pytest.raises(CheckpointError) as e:
        decide(tmp_path, f"resume={path}")
    assert e.value.exit_code == 4 and "rng_rank0.pt is missing" in e.value.message


# ------------------------------------------------------------------ re-saving a step (defect 4)


def test_a_kill_while_a_step_is_re_saved_leaves_a_complete_checkpoint(tmp_path, monkeypatch, capsys):
    first = save(tmp_path, 3, keep_last=1)
    old_weights = file_bytes(os.path.join(first, "model.safetensors"))
    real_replace = os.replace
    renames = []

    def dies_before_publishing(src, dst):
        if str(src).endswith(".step_3.tmp"):
            renames.append(src)
            raise Killed()
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_before_publishing)
    with pytest.raises(Killed):
        save(tmp_path, 3, net=model(99), keep_last=1)  # e.g. SIGTERM on a checkpoint step, keep_last=1
    monkeypatch.setattr(os, "replace", real_replace)
    assert renames, "the kill did not land between the two renames"
    found = ckpt.list_checkpoints(str(tmp_path))
    assert len(found) == 1 and ckpt.verify_checkpoint(found[0][1])["step"] == 3  # complete, on disk
    assert decide(tmp_path, "resume=auto") == os.path.join(tmp_path, "checkpoints", "step_3")
    assert "restored step_3 from .step_3.old" in capsys.readouterr().out
    assert file_bytes(os.path.join(tmp_path, "checkpoints", "step_3", "model.safetensors")) == old_weights


def test_re_saving_a_step_replaces_it_and_leaves_no_copy(tmp_path):
    save(tmp_path, 3)
    path = save(tmp_path, 3, net=model(99))
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_3"]
    net = model(0)
    state, _ = ckpt.load_checkpoint(path, net, 0)
    assert torch.equal(net[0].weight, model(99)[0].weight) and state["step"] == 3  # the new save's weights


TWO_STEPS = ("trainer.max_steps=2", "checkpoint.every_steps=2", "optim.warmup_steps=1")  # the cosine ends at lr 0


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run of tiny.yaml (checkpoint step_2), trained through train.py in this process, to copy."""
    import train

    out = tmp_path_factory.mktemp("two_steps") / "run"
    assert train.main(["--config", TINY, f"output_dir={out}", *TWO_STEPS]) == 0
    return out


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
def test_a_resume_with_nothing_left_to_do_does_not_rewrite_its_checkpoint(tmp_path, capsys, two_step_run):
    """Every re-save is a window (short, and covered by the aside copy) in which step_N is being replaced:
    a run that already holds the step it would save (a resume with nothing left to do; a stop signal on a
    checkpoint step) writes nothing, and its summary says it had nothing to do (it used to say "2 steps in 0 s").
    A resume from another folder's checkpoint still saves its own."""
    import train

    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    args = ["--config", TINY, f"output_dir={out}", *TWO_STEPS]
    model_file = out / "checkpoints" / "step_2" / "model.safetensors"
    before = os.stat(model_file)
    capsys.readouterr()
    assert train.main([*args, "resume=auto"]) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and done[0].startswith("done: nothing to do (step 2, trainer.max_steps 2)"), done
    assert "steps in" not in done[0]
    after = os.stat(model_file)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    other = tmp_path / "other"
    assert train.main(["--config", TINY, f"output_dir={other}", *TWO_STEPS,
                       f"resume={out / 'checkpoints' / 'step_2'}"]) == 0
    assert (other / "checkpoints" / "step_2" / "manifest.json").is_file()  # its own copy, written


@pytest.mark.slow  # builds one run in this process (~3 s), trains nothing
def test_a_resume_with_another_max_steps_announces_the_new_schedule(tmp_path, capsys, two_step_run):
    """trainer.max_steps may change on resume, and with a cosine schedule that moves the learning rate: the 2-step
    run ended at rate 0, and resumed with max_steps=4 it rises again (the issue: silently, from 0 to 3e-5). Start-up
    says so in one line (old and new end step, the rate at the resumed step on both schedules), and from the resumed
    step on the new schedule holds: the next step's rate is the new schedule's at step 2, not the old one's 0."""
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    capsys.readouterr()
    t = Trainer(config(out, *TWO_STEPS, "trainer.max_steps=4", "resume=auto"), DistInfo())
    try:
        new_rate = 3e-3 * 0.75  # optim.lr x the cosine schedule of 4 steps (1 of warmup) at step 2: a third of the way
        lines = [line for line in capsys.readouterr().out.splitlines() if "schedule" in line]
        assert lines == [f"resume: trainer.max_steps changed from 2 to 4: the cosine learning-rate schedule now ends "
                         f"at step 4 instead of 2, from the resumed step 2 on: the learning rate at step 2 is "
                         f"{new_rate:.4g} (it was 0 on the old schedule)"], lines
        assert t.optimizer.param_groups[0]["lr"] == pytest.approx(new_rate)  # what step 3 will use
        assert t.scheduler.get_last_lr()[0] == pytest.approx(new_rate)
    finally:
        t.close()
    capsys.readouterr()
    Trainer(config(out, *TWO_STEPS, "resume=auto"), DistInfo()).close()  # unchanged: no such line
    assert "schedule" not in capsys.readouterr().out


# ------------------------------------------------------------------ full disk, read-only folder (defect 10)


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state.pt", "rng_rank0.pt", "manifest.json"])
def test_a_full_disk_during_a_save_is_one_message_and_leaves_no_partial_folder(tmp_path, monkeypatch, victim):
    previous = save(tmp_path, 2)
    disk = FullDisk(victim)
    monkeypatch.setattr(ckpt, "open", disk, raising=False)
    with pytest.raises(CheckpointError) as e:
        save(tmp_path, 4)
    assert disk.fired, "the disk never filled up"
    assert e.value.exit_code == 4
    assert "no space left on device" in e.value.message and victim in e.value.message
    assert "iostream" not in e.value.message
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_2"]  # no .step_4.tmp
    assert ckpt.verify_checkpoint(previous)["step"] == 2  # the last checkpoint is intact


def test_a_full_disk_at_a_resume_leaves_metrics_as_they_were_and_no_tmp_file(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in range(1, 9)))
    before = metrics.read_bytes()
    disk = FullDisk("metrics.jsonl.", room=0)  # the rewrite's temporary file (mtl/files.py write_atomic)
    monkeypatch.setattr(files_module, "open", disk, raising=False)
    with pytest.raises(OSError) as e:
        logger_module.RunLogger(str(tmp_path), True, 10, False, start_step=4).close()
    assert disk.fired and e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no 0-byte metrics.jsonl.tmp
    assert metrics.read_bytes() == before


def test_a_full_disk_while_logging_is_one_message_naming_the_file(tmp_path, monkeypatch):
    from mtl.errors import TrainingError

    disk = FullDisk("metrics.jsonl", room=100)
    monkeypatch.setattr(logger_module, "open", disk, raising=False)
    log = logger_module.RunLogger(str(tmp_path), True, 10, False)
    with pytest.raises(TrainingError) as e:
        for step in range(1, 10):
            log.record(step, {"loss": 1.0})
    log.close()  # train.py closes the logger on the way out: no second error, no traceback
    assert disk.fired >= 2 and e.value.exit_code == 5
    assert f"cannot write {tmp_path / 'metrics.jsonl'}: no space left on device" in e.value.message


def test_a_full_disk_at_start_up_is_one_message_naming_the_path(tmp_path, monkeypatch):
    save(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    disk = FullDisk("metrics.jsonl.", room=0)  # the rewrite's temporary file (mtl/files.py write_atomic)
    monkeypatch.setattr(files_module, "open", disk, raising=False)
    with pytest.raises(ConfigError) as e:
        decide(tmp_path, "resume=auto")
    assert disk.fired
    assert "no space left on device" in e.value.message and "metrics.jsonl" in e.value.message
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("metrics")) == ["metrics.jsonl"]  # no temporary file
    assert not (tmp_path / runlock.LOCK_NAME).exists()


def test_a_read_only_output_dir_is_one_message_and_the_checkpoint_stays(tmp_path):
    previous = save(tmp_path, 2)
    os.chmod(tmp_path, 0o555)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as root: chmod does not make the folder read-only")
        with pytest.raises(ConfigError) as e:
            decide(tmp_path, "resume=auto")
        assert "permission denied" in e.value.message and str(tmp_path) in e.value.message
    finally:
        os.chmod(tmp_path, 0o755)
    assert ckpt.verify_checkpoint(previous)["step"] == 2


def test_a_read_only_mount_is_one_message_at_start_up_and_at_a_save(tmp_path, monkeypatch):
    previous = save(tmp_path, 2)
    real_open, real_makedirs = os.open, os.makedirs
    fired = []

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and (len(args) < 1 or args[0] & (os.O_WRONLY | os.O_CREAT)):
            fired.append(path)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    def no_mkdir(path, *args, **kwargs):
        if not os.path.isdir(path):
            fired.append(path)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(os, "makedirs", no_mkdir)
    with pytest.raises(ConfigError) as e:
        decide(tmp_path, "resume=auto")
    assert fired and "read-only file system" in e.value.message and runlock.LOCK_NAME in e.value.message
    with pytest.raises(CheckpointError) as e:
        save(tmp_path, 4)
    assert "read-only file system" in e.value.message and ".step_4.tmp" in e.value.message
    monkeypatch.undo()
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_2"]
    assert ckpt.verify_checkpoint(previous)["step"] == 2


# ------------------------------------------------------------------ the run lock (defect 3)


def _holder(out):
    """Another live process that holds ``out``'s lock."""
    code = ("import sys, time; from mtl.run.runlock import RunLock; RunLock.acquire(sys.argv[1]); print('locked', "
            "flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    save(tmp_path, 2)
    holder = _holder(tmp_path)
    try:
        tic = time.monotonic()
        with pytest.raises(ConfigError) as e:
            decide(tmp_path, "resume=auto")
        assert time.monotonic() - tic < 5  # at once, not after a timeout
        assert f"PID {holder.pid} on host {socket.gethostname()}" in e.value.message
        assert "in use by another run" in e.value.message and e.value.exit_code == 2
    finally:
        holder.kill()
        holder.wait()
    # that run died without releasing its lock: a resume takes the stale lock over
    assert decide(tmp_path, "resume=auto") == os.path.join(tmp_path, "checkpoints", "step_2")
    assert f"took over the stale lock {tmp_path / runlock.LOCK_NAME} (PID {holder.pid}" in capsys.readouterr().out
    assert not (tmp_path / runlock.LOCK_NAME).exists()  # released at close


def test_the_lock_is_held_while_the_run_lives_and_released_at_close(tmp_path):
    _, t = prepare(tmp_path)
    lock = tmp_path / runlock.LOCK_NAME
    record = json.loads(lock.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match="in use by another run"):
        decide(tmp_path, "resume=auto")  # a second run object in this same process
    assert lock.exists()  # the refused run did not release the holder's lock
    t.close()
    assert not lock.exists()


def test_stale_locks_a_reused_pid_and_an_earlier_attempt_of_the_same_job(tmp_path, monkeypatch):
    lock = tmp_path / runlock.LOCK_NAME
    me = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # the PID lives, but it is another process than the one that wrote the lock
        lock.write_text(json.dumps({"pid": alive.pid, "host": me, "start": "1", "since": 0}))
        runlock.RunLock.acquire(str(tmp_path)).release()
        # the same PID and start time: a live run
        lock.write_text(json.dumps({"pid": alive.pid, "host": me, "start": runlock._start_time(alive.pid)}))
        with pytest.raises(runlock.LockHeld, match=f"PID {alive.pid}"):
            runlock.RunLock.acquire(str(tmp_path))
    finally:
        alive.kill()
        alive.wait()
    # another host: cannot be checked, unless it is an earlier attempt of this job (a Slurm requeue)
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "job": "SLURM_JOB_ID=77"}))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(runlock.LockHeld, match=f"delete {lock}"):
        runlock.RunLock.acquire(str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    taken = runlock.RunLock.acquire(str(tmp_path))
    assert "earlier attempt of this job" in taken.note
    taken.release()
    assert not lock.exists()


# ------------------------------------------------------------------ a crafted checkpoint config (defect 11)


def test_a_checkpoint_config_resolves_no_interpolation(tmp_path, monkeypatch):
    from mtl.setup.resume import verify_resume_config

    monkeypatch.setenv("MY_API_TOKEN", "s3cret-token-value")
    path = save(tmp_path, 2)
    crafted = file_bytes(os.path.join(path, "config.yaml")).decode().replace("seed: 0", "seed: ${oc.env:MY_API_TOKEN}")
    assert "${oc.env:MY_API_TOKEN}" in crafted
    with open(os.path.join(path, "config.yaml"), "w") as f:
        f.write(crafted)
    with pytest.raises(CheckpointError) as e:
        verify_resume_config(path, config(tmp_path))
    assert "seed: checkpoint '${oc.env:MY_API_TOKEN}', now 0" in e.value.message
    assert "s3cret" not in e.value.message
    # a user's own config is trusted: there the resolvers work (README, mtl/config/schema.py)
    monkeypatch.setenv("MTL_TEST_SEED", "7")
    cfg = config(tmp_path, "seed=${oc.env:MTL_TEST_SEED}")
    assert cfg.seed == 7 and "seed: 7" in to_yaml(cfg)


def test_a_key_added_to_the_schema_since_the_checkpoint_counts_as_its_default(tmp_path):
    """A checkpoint written before ``data.normalize`` / ``data.augment`` existed lacks those keys: at their
    defaults the resume goes on (the run is the same run); set otherwise, it is refused naming the key."""
    import yaml

    from mtl.setup.resume import verify_resume_config

    path = save(tmp_path, 2)
    with open(os.path.join(path, "config.yaml")) as f:
        old = yaml.safe_load(f)
    old["data"].pop("normalize"), old["data"].pop("augment", None)  # augment: not read on synthetic data, not saved
    with open(os.path.join(path, "config.yaml"), "w") as f:
        yaml.safe_dump(old, f)
    verify_resume_config(path, config(tmp_path))  # nothing differs
    with pytest.raises(CheckpointError) as e:
        verify_resume_config(path, config(tmp_path, "data.normalize=imagenet"))
    assert "data.normalize: checkpoint 'auto', now 'imagenet'" in e.value.message
    assert "data.augment" not in e.value.message


# ------------------------------------------------------------------ starting over


def test_a_re_run_is_refused_with_a_way_to_start_over(tmp_path, capsys):
    save(tmp_path, 2)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as e:
        decide(tmp_path)
    assert "already holds checkpoints (step_2)" in e.value.message and "overwrite=true" in e.value.message
    assert decide(tmp_path, "overwrite=true") is None
    assert "overwrite=true: deleted the earlier run's checkpoints, tokenizer" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "notes.txt", "run.json"]  # what the run did not write stays
    with pytest.raises(ConfigError, match="overwrite: true starts over, resume=auto continues"):
        config(tmp_path, "overwrite=true", "resume=auto")
    with pytest.raises(ConfigError, match="overwrite"):
        config(tmp_path, "overwrite=maybe")
    from mtl.setup.resume import differing_keys

    assert differing_keys({"overwrite": True, "seed": 0}, {"overwrite": False, "seed": 0}) == []


# ------------------------------------------------------------------ a real run in this process (defect 13b)


@pytest.mark.slow  # seconds-long in-process runs: the full suite, not the fast tier
def test_checkpoints_carry_the_tokenizer_and_class_names_and_a_resume_uses_them(tmp_path):
    def run(*overrides):
        t = Trainer(config(tmp_path, "trainer.progress=false", "trainer.eval_every=100", "checkpoint.every_steps=0",
                           *overrides), DistInfo())
        try:
            t.train()
        finally:
            t.close()
        return t

    first = run("trainer.max_steps=1")
    step_1 = os.path.join(tmp_path, "checkpoints", "step_1")
    ckpt.verify_checkpoint(step_1)
    assert json.loads(file_bytes(os.path.join(step_1, "class_names.json"))) == list(first.train_ds.class_names)
    run_copy = tmp_path / "tokenizer" / "tokenizer.json"
    good = run_copy.read_bytes()
    assert file_bytes(os.path.join(step_1, "tokenizer", "tokenizer.json")) == good
    assert not (tmp_path / runlock.LOCK_NAME).exists()
    run_copy.write_bytes(good[: len(good) // 3])  # the run's own copy is truncated
    second = run("trainer.max_steps=2", "resume=auto")
    assert second.step == 2 and run_copy.read_bytes() == good  # the checkpoint's tokenizer was used


# ------------------------------------------------------------------ the lock with real processes (defect 3)


@pytest.mark.slow
def test_a_second_run_under_torchrun_is_refused_at_once(tmp_path):
    """Rank 0 of a 2-process run finds the folder in use; both ranks follow its one decision: one message,
    exit 2, no hang (a rank left waiting would hit run_train's timeout); with a data error too, one message naming
    both. The holder is then SIGKILLed: its
    stale lock does not block the resume."""
    import signal

    from .conftest import PY, run_train

    out = tmp_path / "run"
    args = ["--config", TINY, "trainer.max_steps=2", "checkpoint.every_steps=1", "trainer.eval_every=100",
            "resume=auto", f"output_dir={out}"]
    first = subprocess.Popen([PY, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MTL_TEST_SLOW_SAVE": "300"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        saving = out / "checkpoints" / ".step_1.tmp" / "trainer_state.pt"
        deadline = time.time() + 240
        while not saving.exists():  # the first run is inside its (slowed) save, holding the lock
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        second = run_train(args, nproc=2, check=False, timeout=240)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("in use by another run") == 1
        assert f"PID {first.pid} on host {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr
        # busy and a data error at once: every rank knows the folder's error, so the one message is said once
        missing = tmp_path / "none.jsonl"
        third = run_train([*args, "data.source=manifest", f"data.train_path={missing}", f"data.val_path={missing}"],
                          nproc=2, check=False, timeout=240)
        assert third.returncode == 3, third.stderr[-3000:]
        assert third.stderr.count("in use by another run") == 1 and third.stderr.count("data.train_path") == 1, \
            third.stderr[-3000:]
        assert "Traceback" not in third.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert (out / runlock.LOCK_NAME).exists()  # the killed run could not release it
    third = run_train(args)
    assert f"took over the stale lock {out / runlock.LOCK_NAME} (PID {first.pid}" in third.stdout
    assert os.path.isdir(out / "checkpoints" / "step_2") and not (out / runlock.LOCK_NAME).exists()


def _saving_rank(rank, port, out, results):
    import datetime

    import torch.distributed as tdist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    tdist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    state = {"step": 4, "epoch": 0, "batch_in_epoch": 4, "world_size": 2}
    try:
        ckpt.save_checkpoint(out, 2, model(2), {**state, "step": 2}, "seed: 0\n", rank)
        if rank == 1:  # the disk fills up while rank 1 writes its RNG file
            ckpt.open = FullDisk("rng_rank1.pt")
        ckpt.save_checkpoint(out, 4, model(4), state, "seed: 0\n", rank)
        results.put((rank, "saved", None))
    except CheckpointError as e:
        results.put((rank, "CheckpointError", e.message))
    except Exception as e:  # a hang shows as gloo's timeout here
        results.put((rank, type(e).__name__, str(e)[:300]))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_a_full_disk_on_one_rank_is_the_same_message_on_every_rank(tmp_path):
    """Without agreement, the failing rank raised alone and rank 0 waited in the save's barrier."""
    from .conftest import spawn_ranks

    got = spawn_ranks(_saving_rank, tmp_path, 120)
    assert got[0] == got[1] and got[0][0] == "CheckpointError", got
    assert "rng_rank1.pt (rank 1): no space left on device" in got[0][1]
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_2"]
    assert ckpt.verify_checkpoint(os.path.join(tmp_path, "checkpoints", "step_2"))["world_size"] == 2
