"""A run's folder keeps what it holds (issue 36): a resume never writes over another run's checkpoints (36.1), a
non-finite streak neither prunes the checkpoint from before it nor forgets its length over a resume (36.4), a
refused run writes nothing (36.9), overwrite=true never follows a linked checkpoints folder (36.9), and a
curves.png that cannot be written costs a warning, not the run (36.8)."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil

import pytest
import torch

from mtl.checkpoint import folder as ckpt
from mtl.config.schema import to_yaml
from mtl.errors import CheckpointError, ConfigError, TrainingError
from mtl.parallel.dist import DistInfo
from mtl.run.run_folder import RUN_ID_FILE, RunFolder
from mtl.run.trainer import Trainer
from mtl.setup.checks import load_run_config

from .conftest import TINY
from .test_inference import train_script

QUICK = ("trainer.progress=false", "trainer.eval_every=100", "data.num_workers=0")


def config(out, *overrides):
    return load_run_config(TINY, [f"output_dir={out}", *QUICK, *overrides])


def decide(out, *overrides):
    """Start-up's decision and writes for ``out`` (a 1-process run), as the trainer's would be: the checkpoint to
    resume, or an error; the lock is released."""
    folder = RunFolder(config(out, *overrides), DistInfo())
    folder.lock()
    try:
        return folder.prepare()
    finally:
        folder.close()


def train(out, *overrides) -> Trainer:
    t = Trainer(config(out, *overrides), DistInfo())
    try:
        t.train()
    finally:
        t.close()
    return t


def snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (recursively, links as their target's path) with its bytes: what a refused run
    must leave as it was."""
    found = {}
    for dirpath, dirnames, names in os.walk(folder):
        for name in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[rel] = ("link -> " + os.readlink(path)).encode()
            else:
                with open(path, "rb") as f:
                    found[rel] = f.read()
    return found


def fake_checkpoint(out, step, run_id=None):
    """A checkpoint of ``out``'s run as save_checkpoint writes it; ``run_id`` None: one from before run ids."""
    torch.manual_seed(step)
    state = {"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1}
    if run_id:
        state["run_id"] = run_id
    return ckpt.save_checkpoint(str(out), step, torch.nn.Linear(2, 2), state, to_yaml(config(out)), 0)


# ------------------------------------------------------------------ 36.1: a resume never writes over another run


@pytest.mark.slow  # five short runs in this process (~15 s)
def test_resuming_another_folders_checkpoint_over_a_run_is_refused_and_a_new_folder_continues_it(tmp_path):
    """The issue's reproduction: A (seed 0) and B (seed 1) finish; resuming B's step_1 with output_dir=A used to
    replace A's step_2 and splice the two runs' metrics.jsonl and config.yaml, with exit 0. Now: refused (exit 2),
    A unchanged to the byte, and the message says how to continue in a new folder; that command works and ends
    on B's own final model; A's own run still resumes (by name: test_which_checkpoints_a_resume_may_write_over)."""
    steps = ("trainer.max_steps=2", "checkpoint.every_steps=1")
    a, b, new = tmp_path / "A", tmp_path / "B", tmp_path / "new"
    train(a, "seed=0", *steps)
    train(b, "seed=1", *steps)
    ids = {ckpt.checkpoint_run_id(str(p / "checkpoints" / f"step_{s}")) for p in (a, b) for s in (1, 2)}
    assert len(ids) == 2 and None not in ids  # each run's id, in every checkpoint it wrote
    assert json.loads((a / RUN_ID_FILE).read_text())["run_id"] == ckpt.checkpoint_run_id(str(a / "checkpoints/step_2"))
    before = snapshot(a)
    theirs = str(b / "checkpoints" / "step_1")
    with pytest.raises(ConfigError) as e:
        Trainer(config(a, "seed=1", *steps, f"resume={theirs}"), DistInfo())
    assert e.value.exit_code == 2
    assert f"holds checkpoints (step_1, step_2) of another run than resume={theirs!r}" in e.value.message
    assert f"output_dir=<new folder> resume={theirs}" in e.value.message and "resume=auto" in e.value.message
    assert snapshot(a) == before  # nothing replaced, nothing spliced, no lock left

    forked = train(new, "seed=1", *steps, f"resume={theirs}")  # the way out the message gives
    assert forked.step == 2
    assert (new / "checkpoints/step_2/model.safetensors").read_bytes() == (
        b / "checkpoints/step_2/model.safetensors").read_bytes()
    identity = json.loads((new / RUN_ID_FILE).read_text())
    assert identity["resumed_from"] == theirs and identity["run_id"] not in ids  # a new run, from B's checkpoint
    assert ckpt.checkpoint_run_id(str(new / "checkpoints/step_2")) == identity["run_id"]

    assert train(a, "seed=0", "trainer.max_steps=3", "checkpoint.every_steps=1", "resume=auto").step == 3  # its own
    assert {ckpt.checkpoint_run_id(str(a / "checkpoints" / f"step_{s}")) for s in (1, 2, 3)} == {
        json.loads((a / RUN_ID_FILE).read_text())["run_id"]}  # still A's one run


def test_which_checkpoints_a_resume_may_write_over(tmp_path):
    """The rule, on checkpoints written as the trainer writes them: a folder's own checkpoint resumes (with an id or
    from before ids); one from another folder resumes into a folder without checkpoints, or one that holds its
    own run's (a copy), and is refused over any other, or over checkpoints of unknown run."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    fake_checkpoint(a, 2, "run-a")
    mine = fake_checkpoint(a, 4, "run-a")
    theirs = fake_checkpoint(b, 2, "run-b")
    assert decide(a, f"resume={mine}") == mine
    assert decide(a, "resume=auto") == mine
    with pytest.raises(ConfigError, match="this folder's run run-a; the checkpoint's run run-b"):
        decide(a, f"resume={theirs}")
    copy = str(tmp_path / "backup" / "step_4")
    shutil.copytree(mine, copy)
    assert decide(a, f"resume={copy}") == copy  # a copy of the folder's own run
    assert decide(c, f"resume={theirs}") == theirs  # a new folder: a new run from it
    assert json.loads((c / RUN_ID_FILE).read_text())["run_id"] not in ("run-a", "run-b")

    legacy = tmp_path / "legacy"
    old = fake_checkpoint(legacy, 3)  # written before run ids
    assert decide(legacy, f"resume={old}") == old  # its own folder's: resumes as before
    assert ckpt.checkpoint_run_id(old) is None
    with pytest.raises(ConfigError, match="written before mtl saved run ids"):
        decide(legacy, f"resume={theirs}")
    with pytest.raises(ConfigError, match="written before mtl saved run ids"):
        decide(a, f"resume={old}")
    assert decide(tmp_path / "fresh", f"resume={old}") == old


# ------------------------------------------------------------------ 41.4: a resume cannot splice two histories


def test_a_linked_checkpoint_of_another_run_is_not_taken_for_the_folder_s_own(tmp_path):
    """The issue's first splice: ``ln -s B/checkpoints/step_3 A2/checkpoints/fromB`` then ``resume=A2/checkpoints/fromB
    output_dir=A2`` used to pass as A2's own checkpoint (only the link's parent folder was resolved): B's run would
    replace A2's checkpoints, run.json, config.yaml and metrics.jsonl. The link is followed: refused, nothing moves."""
    a2, b = tmp_path / "A2", tmp_path / "B"
    fake_checkpoint(a2, 6, "run-a")
    theirs = fake_checkpoint(b, 3, "run-b")
    link = a2 / "checkpoints" / "fromB"
    os.symlink(theirs, link)
    before = snapshot(a2)
    with pytest.raises(ConfigError) as e:
        decide(a2, f"resume={link}")
    assert e.value.exit_code == 2 and "this folder's run run-a; the checkpoint's run run-b" in e.value.message
    assert snapshot(a2) == before


def test_a_fork_of_the_folder_s_own_run_is_refused_and_an_identical_copy_resumes(tmp_path):
    """The issue's second splice: two copies of one run (``cp -r A A2``) go on separately (another trainer.max_steps
    each, an allowed change), then A's step_6 is resumed into A2. Both carry the one run id, so it used to pass as
    a copy of A2's own run, and A2 ended up holding two histories. A resume from outside the folder must be
    byte-identical (its manifest) to the folder's own checkpoint of that step: A's step_4, from before the fork,
    still resumes into A2; A's step_6 is refused, naming both checkpoints and the ways out."""
    a, a2 = tmp_path / "A", tmp_path / "A2"
    fake_checkpoint(a, 2, "run-a")
    shared = fake_checkpoint(a, 4, "run-a")
    shutil.copytree(a, a2)  # cp -r A A2
    theirs = fake_checkpoint(a, 6, "run-a")  # each copy goes on its own way
    fake_checkpoint(a2, 6, "run-a")
    assert ckpt.checkpoint_run_id(theirs) == ckpt.checkpoint_run_id(str(a2 / "checkpoints/step_6"))
    assert decide(a2, f"resume={shared}") == shared  # byte-identical to A2's own step_4
    before = snapshot(a2)
    with pytest.raises(ConfigError) as e:
        decide(a2, f"resume={theirs}")
    message = e.value.message
    assert e.value.exit_code == 2 and f"resume={theirs!r} is not one of {str(a2)!r}'s own checkpoints" in message
    assert str(a2 / "checkpoints" / "step_6") in message and "two histories" in message
    assert f"output_dir=<new folder> resume={theirs}" in message and "resume=auto" in message
    assert snapshot(a2) == before
    (a2 / "checkpoints" / "step_6").rename(a2 / "checkpoints" / "step_8")  # no own step_6 to compare with: refused too
    with pytest.raises(ConfigError, match="is not one of"):
        decide(a2, f"resume={theirs}")


# ------------------------------------------------------------------ 36.4: a non-finite streak


BLOW_UP = ("optim.lr=1e8", "optim.warmup_steps=100000", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
           "trainer.max_bad_steps=3")
ADVICE = ("3 consecutive non-finite steps", "every checkpoint from step 2 on holds the weights that gave the first "
          "non-finite step (3): if they blew up, resume from a checkpoint before step 2")


def _steps(out):
    return [os.path.basename(p) for _, p in ckpt.list_checkpoints(str(out))]


@pytest.mark.slow  # two short runs that blow up, and a resume (~10 s)
def test_a_non_finite_streak_keeps_the_checkpoint_before_it_and_a_resume_ends_it_where_it_would(tmp_path):
    """lr=1e8: steps 1-2 are finite, their weights blow up, steps 3-5 are not. The saves during the streak used to
    prune step_1 with keep_last=2, so the checkpoint the advice names did not exist; now none is written in a
    streak. And a run stopped mid-streak (a stop signal at step 4) saves the streak's length: its resume stops at
    step 5 with the same advice, where it used to start counting again and run on."""
    whole = tmp_path / "whole"
    with pytest.raises(TrainingError) as e:
        train(whole, *BLOW_UP)
    assert all(part in e.value.message for part in ADVICE) and e.value.exit_code == 5
    assert _steps(whole) == ["step_1", "step_2"]  # step_1: the one "before step 2"

    stopped = tmp_path / "stopped"
    t = Trainer(config(stopped, *BLOW_UP), DistInfo())
    after_step = t.steplog.after_step

    def stop_after_step_3(step, *args, **kwargs):
        after_step(step, *args, **kwargs)
        if step == 3:
            t.stop_requested = True  # as SIGTERM's handler does: step 4 is taken, saved, and the run ends

    t.steplog.after_step = stop_after_step_3
    try:
        t.train()
    finally:
        t.close()
    assert t.step == 4 and t.steplog.bad_steps == 2  # stopped mid-streak
    assert _steps(stopped) == ["step_1", "step_2", "step_4"]  # keep_last deleted nothing in the streak
    assert ckpt.read_trainer_state(str(stopped / "checkpoints/step_4"))["bad_steps"] == 2
    with pytest.raises(TrainingError) as resumed:
        train(stopped, *BLOW_UP, "resume=auto")
    assert all(part in resumed.value.message for part in ADVICE)  # step 5, as the uninterrupted run
    assert _steps(stopped) == ["step_1", "step_2", "step_4"]


# ------------------------------------------------------------------ 36.9: a refused run writes nothing


@pytest.fixture(scope="module")
def batchnorm_run(tmp_path_factory):
    """A finished 2-step run with BatchNorm (checkpoints step_1, step_2), to copy."""
    out = tmp_path_factory.mktemp("bn") / "run"
    train(out, "model.backbone.norm=batch", "trainer.max_steps=2", "checkpoint.every_steps=1")
    return out


def _as_if_two_processes_wrote(checkpoint):
    """The checkpoint as 2 processes would have written it (world size 2, rank 1's RNG file; manifest refreshed)."""
    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)
    torch.save({**state, "world_size": 2}, os.path.join(checkpoint, "trainer_state.pt"))
    shutil.copy(os.path.join(checkpoint, "rng_rank0.pt"), os.path.join(checkpoint, "rng_rank1.pt"))
    ckpt.write_manifest(checkpoint)


@pytest.mark.slow  # builds three runs that are refused (~6 s)
def test_a_refused_resume_or_init_from_leaves_output_dir_as_it_was(tmp_path, batchnorm_run):
    """A resume refused once the model is built (BatchNorm on another world size), and an init_from whose weights do
    not fit, used to leave config.yaml, class_names.json and tokenizer/ written (and metrics.jsonl cut back):
    now the folder is byte for byte as it was, and a new folder is not even made."""
    run = tmp_path / "run"
    shutil.copytree(batchnorm_run, run)
    step_1 = str(run / "checkpoints" / "step_1")
    _as_if_two_processes_wrote(step_1)
    (run / "tokenizer" / "tokenizer.json").write_text("{}")  # a damaged run copy: the resume would restore it
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="BatchNorm"):
        Trainer(config(run, "model.backbone.norm=batch", "trainer.max_steps=3", f"resume={step_1}"), DistInfo())
    assert snapshot(run) == before

    new = tmp_path / "new"
    with pytest.raises(CheckpointError, match="BatchNorm"):
        Trainer(config(new, "model.backbone.norm=batch", f"resume={step_1}"), DistInfo())
    assert not new.exists()

    weights = str(batchnorm_run / "checkpoints" / "step_2")
    with pytest.raises(CheckpointError, match="the weights do not fit this model"):
        Trainer(config(new, "model.backbone.stages=3", f"init_from={weights}"), DistInfo())
    assert not new.exists()
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="the weights do not fit this model"):
        Trainer(config(run, "model.backbone.stages=3", f"init_from={weights}", "overwrite=true"), DistInfo())
    assert snapshot(run) == before  # overwrite=true deleted nothing either


# ------------------------------------------------------------------ 36.9: overwrite=true and a linked checkpoints


def test_overwrite_refuses_a_linked_checkpoints_folder_and_leaves_no_stale_link(tmp_path):
    """overwrite=true with output_dir/checkpoints a symbolic link used to rename the link, fail to delete it with a
    'cannot write ... choose a writable output_dir' message, and leave the renamed link behind. It is refused
    naming the link, its target and the fix; nothing moves, on either side of the link."""
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    fake_checkpoint(elsewhere, 2, "run-x")
    out.mkdir()
    os.symlink(elsewhere / "checkpoints", out / "checkpoints")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before, theirs = snapshot(out), snapshot(elsewhere)
    with pytest.raises(ConfigError) as e:
        decide(out, "overwrite=true")
    message = e.value.message
    assert "is a symbolic link" in message and str(out / "checkpoints") in message and str(elsewhere) in message
    assert f"rm {out / 'checkpoints'}" in message and "cannot write" not in message
    assert snapshot(out) == before and snapshot(elsewhere) == theirs
    assert not os.path.lexists(out / ".checkpoints.deleting")

    os.symlink(elsewhere / "checkpoints", out / ".checkpoints.deleting")  # what an earlier mtl left behind
    os.remove(out / "checkpoints")
    assert decide(out, "overwrite=true") is None
    assert not os.path.lexists(out / ".checkpoints.deleting") and snapshot(elsewhere) == theirs  # unlinked, unfollowed


# ------------------------------------------------------------------ 36.8: curves.png on a full disk


@pytest.mark.slow  # one short run (~3 s)
def full_disk_for(name: str, monkeypatch) -> list[str]:
    """Every write to a file whose path holds ``name`` fails with ENOSPC (a full disk); returns the paths it hit."""
    real_open, fired = builtins.open, []

    def full_disk(path, mode="r", *args, **kwargs):
        if name in str(path) and ("w" in mode or "a" in mode):
            fired.append(str(path))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    return fired


def test_a_full_disk_for_curves_png_is_one_warning_and_the_run_ends_well(tmp_path, monkeypatch, capsys):
    """The loss curves are a convenience: a full disk when they are written (after the final checkpoint and
    final_metrics.json) used to end the run in an ENOSPC traceback, exit 1. Now one warning line names the file and
    the cause, the run returns its metrics, and its results are intact; no partial curves.png is left."""
    fired = full_disk_for("curves.png", monkeypatch)
    t = train(tmp_path, "trainer.max_steps=1", "checkpoint.every_steps=0")
    monkeypatch.undo()
    assert fired and t.step == 1  # the write really failed, and the run ended normally
    lines = [line for line in capsys.readouterr().out.splitlines() if "curves.png" in line]
    assert len(lines) == 1 and f"could not write {tmp_path / 'curves.png'}: no space left on device" in lines[0]
    assert json.loads((tmp_path / "final_metrics.json").read_text())["step"] == 1
    ckpt.verify_checkpoint(str(tmp_path / "checkpoints" / "step_1"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("curves.png")]


@pytest.mark.slow  # a 1-step run through train.py (~4 s)
def test_a_full_disk_for_final_metrics_is_one_message_with_the_metrics_printed(tmp_path, monkeypatch, capsys):
    """final_metrics.json that cannot be written (after the final checkpoint): one message and exit 4 (was an ENOSPC
    traceback), the metrics printed instead, no partial file left, the checkpoint intact."""
    fired = full_disk_for("final_metrics.json", monkeypatch)
    code = train_script.main(["--config", TINY, f"output_dir={tmp_path}", "trainer.max_steps=1",
                              "checkpoint.every_steps=0"])
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert fired and code == 4, (fired, code)
    assert f"cannot write {tmp_path / 'final_metrics.json'}: no space left on device" in captured.err
    assert "Traceback" not in captured.err
    printed = [line for line in captured.out.splitlines() if "final metrics (not saved)" in line]
    assert len(printed) == 1 and '"step": 1' in printed[0]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("final_metrics")]
    ckpt.verify_checkpoint(str(tmp_path / "checkpoints" / "step_1"))
