"""The best checkpoint (``checkpoint.best_metric``: ``checkpoints/best/``) and early stopping
(``trainer.early_stopping``), mtl/run/best.py: best/ holds the best evaluation's step and survives ``keep_last``
pruning; a crash and a resume (with an interrupted re-save of best/ on disk) keep best/ and its value, and early
stopping stops at the same evaluation as the uninterrupted run; the tools read best/; an unknown metric is refused at
start; 2 processes stop and keep the same best as 1 (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from mtl.checkpoint import folder as ckpt
from mtl.errors import ConfigError
from mtl.inference import load_model
from mtl.run.trainer import Trainer
from mtl.setup.checks import load_run_config

from .conftest import PY, ROOT, TINY, run_train

# cls only (fast); an evaluation every step, a checkpoint every 2 keeping 1. On these seeds: cls_loss (max, to keep an
# early step) is best at step 3, and cls_acc stops improving after step 3: early stopping (patience 3) at step 6
WATCHED = ["tasks=[cls]", "trainer.max_steps=16", "trainer.eval_every=1", "checkpoint.every_steps=2",
           "checkpoint.keep_last=1", "checkpoint.best_metric=cls_loss", "checkpoint.best_mode=max",
           "trainer.early_stopping.metric=cls_acc", "trainer.early_stopping.patience=3"]


def train(out, *overrides) -> None:
    tr = Trainer.from_config(TINY, [f"output_dir={out}", *WATCHED, *overrides])
    try:
        tr.train()
    finally:
        tr.close()


def evaluations(out) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r for r in map(json.loads, f) if r.get("kind") == "eval"}


def best_of(out) -> dict:
    with open(os.path.join(out, "checkpoints", "best", "best.json"), encoding="utf-8") as f:
        return json.load(f)


def final(out) -> dict:
    with open(os.path.join(out, "final_metrics.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    train(out)
    return out


def test_best_holds_the_best_evaluation_and_survives_keep_last_pruning(uninterrupted):
    out = uninterrupted
    evals = evaluations(out)
    values = [evals[s]["cls_loss"] for s in sorted(evals)]
    step = sorted(evals)[values.index(max(values))]  # the first evaluation with the highest cls_loss (mode max)
    assert step < final(out)["step"] - 1  # an early one: its step_<N> is long pruned (keep_last=1)
    assert sorted(os.listdir(out / "checkpoints")) == ["best", f"step_{final(out)['step']}"]
    best = out / "checkpoints" / "best"
    assert best_of(out) == {"metric": "cls_loss", "mode": "max", "value": max(values), "step": step}
    state = ckpt.verify_checkpoint(str(best))  # a complete checkpoint: every file in its manifest, checked
    assert state["step"] == step and "best.json" in ckpt.manifest_files(str(best))
    assert state["watch"]["best"]["value"] == max(values)
    # resume=auto and the tools' "newest checkpoint" never pick best/
    assert ckpt.find_resumable(str(out))[0] == ckpt.latest_checkpoint(str(out)) == str(out / "checkpoints" /
                                                                                       f"step_{final(out)['step']}")


def test_early_stopping_stops_at_an_evaluation_writes_a_checkpoint_and_records_why(uninterrupted):
    out = uninterrupted
    evals, done = evaluations(out), final(out)
    acc = [evals[s]["cls_acc"] for s in sorted(evals)]
    top = sorted(evals)[acc.index(max(acc))]
    stop = top + 3  # patience 3: three evaluations without an improvement
    assert done["step"] == stop < 16 and sorted(evals)[-1] == stop  # no evaluation after the stop
    assert done["stopped_early"] == {"step": stop, "metric": "cls_acc", "mode": "max", "patience": 3,
                                     "min_delta": 0.0, "best": max(acc), "best_step": top}
    assert (out / "checkpoints" / f"step_{stop}" / "manifest.json").is_file()  # the final checkpoint


def test_a_crash_and_a_resume_keep_best_and_stop_at_the_same_evaluation(uninterrupted, tmp_path):
    """Crash at step 5 (after best/ at step 3 and the checkpoint at step 4), with best/ caught in an interrupted
    re-save (moved aside to .best.old, a half-written .best.tmp): the resume puts best/ back, keeps its value (the
    evaluation at step 5 is worse: best/ is not rewritten) and the early-stopping counter, and stops at step 6."""
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crashes at step 5"):
        train(out, "trainer.poison=5:crash:0")
    root = out / "checkpoints"
    assert sorted(os.listdir(root)) == ["best", "step_4"] and best_of(out)["step"] == 3
    written = (root / "best" / "model.safetensors").read_bytes()
    os.rename(root / "best", root / ".best.old")
    (root / ".best.tmp").mkdir()
    train(out, "resume=auto")
    assert best_of(out) == best_of(uninterrupted)
    assert (root / "best" / "model.safetensors").read_bytes() == written  # not rewritten after the resume
    assert sorted(os.listdir(root)) == [".best.tmp", "best", "step_6"]  # a half-written folder is left, as ever
    ours, theirs = final(out), final(uninterrupted)
    assert ours["stopped_early"] == theirs["stopped_early"]
    assert {k: v for k, v in ours.items() if k != "wall_time_s"} == {k: v for k, v in theirs.items()
                                                                      if k != "wall_time_s"}
    # resumed again, the stopped run does nothing
    train(out, "resume=auto")
    assert sorted(os.listdir(root)) == [".best.tmp", "best", "step_6"] and final(out)["stopped_early"] == theirs["stopped_early"]


@pytest.mark.slow  # a subprocess: not in the fast tier
def test_a_sigkill_inside_a_save_of_best_then_a_resume_ends_as_the_uninterrupted_run(uninterrupted, tmp_path):
    """The run (train.py, its own process group) is SIGKILLed while it is inside the save of best/ that follows a step
    checkpoint (its files written to .best.tmp, the save lingering: MTL_TEST_SLOW_SAVE). The kill is checked: the
    process died of SIGKILL, the half-written .best.tmp is on disk and best/ is still the earlier best, complete. A
    resume=auto ends with the uninterrupted run's best step and value and stops early at the same evaluation."""
    import signal
    import time

    from .proctree import kill_tree

    out = tmp_path / "run"
    root = out / "checkpoints"
    proc = subprocess.Popen([PY, os.path.join(ROOT, "train.py"), "--config", TINY, *WATCHED, f"output_dir={out}"],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "MTL_TEST_SLOW_SAVE": "0.5"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while not ((root / "step_2").is_dir() and (root / ".best.tmp" / "trainer_state.pt").is_file()):
        assert proc.poll() is None and time.time() < deadline, "the run ended before a save of best/ after step_2"
        time.sleep(0.01)
    kill_tree(proc.pid)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(evaluations(out))  # the evaluation whose best/ was being written
    assert (root / ".best.tmp").is_dir() and best_of(out)["step"] < killed_at
    assert ckpt.verify_checkpoint(str(root / "best"))["step"] == best_of(out)["step"]  # complete, as written
    train(out, "resume=auto")
    ours, theirs = best_of(out), best_of(uninterrupted)
    assert ours["step"] == theirs["step"] and ours["value"] == pytest.approx(theirs["value"], rel=1e-5)
    assert final(out)["stopped_early"]["step"] == final(uninterrupted)["stopped_early"]["step"]
    assert ckpt.list_checkpoints(str(out))[-1][0] == final(uninterrupted)["stopped_early"]["step"]


@pytest.mark.slow  # subprocesses: not in the fast tier
def test_the_tools_read_best(uninterrupted):
    out = uninterrupted
    best = load_file(str(out / "checkpoints" / "best" / "model.safetensors"))
    for path in (f"{out}@best", str(out / "checkpoints" / "best")):
        model = load_model(path)
        assert model.files.folder == str(out / "checkpoints" / "best")
        state = model.model.state_dict()
        assert all(torch.equal(state[k].cpu(), v) for k, v in best.items())
    newest = load_model(str(out)).model.state_dict()  # the run's folder alone: its newest checkpoint, not best/
    assert not all(torch.equal(newest[k].cpu(), v) for k, v in best.items())
    export = subprocess.run([PY, "-m", "mtl.tools.export", "--checkpoint", f"{out}@best", "--out",
                             str(out / "export")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    assert load_file(str(out / "export" / "model.safetensors")).keys() == best.keys()
    shutil.rmtree(out / "export")


def test_best_named_where_a_run_keeps_none_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(Exception, match="holds no best checkpoint"):
        load_model(f"{tmp_path}@best")


@pytest.mark.slow  # subprocesses: not in the fast tier
def test_an_unknown_metric_and_keys_without_their_metric_are_refused_at_start(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"output_dir={tmp_path}", "checkpoint.best_metric=cls_accuracy",
                               "trainer.early_stopping.metric=gen_bleu", "trainer.early_stopping.mode=up"])
    text = "\n".join(e.value.errors)
    assert "checkpoint.best_metric: 'cls_accuracy' is not a metric this run logs — did you mean 'cls_acc'?" in text
    assert "trainer.early_stopping.metric: 'gen_bleu' is not a metric" in text
    assert "(it logs: cls_acc, cls_loss, gen_bleu4, gen_chrf, gen_exact, gen_ppl, gen_loss)" in text
    assert "trainer.early_stopping.mode: 'up' is not one of max, min" in text
    with pytest.raises(ConfigError, match="checkpoint.best_mode: set .* but not read: checkpoint.best_metric is null"):
        load_run_config(TINY, [f"output_dir={tmp_path}", "checkpoint.best_mode=min"])
    with pytest.raises(ConfigError, match="trainer.early_stopping.patience: set .* not read"):
        load_run_config(TINY, [f"output_dir={tmp_path}", "trainer.early_stopping.patience=2"])
    # the command line's exit code: 2, before anything is written
    proc = subprocess.run([PY, os.path.join(ROOT, "train.py"), "--config", TINY, f"output_dir={tmp_path / 'x'}",
                           "checkpoint.best_metric=nope"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "checkpoint.best_metric: 'nope'" in proc.stdout + proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # a 3-step run: not in the fast tier
def test_a_task_s_watchable_numbers_outside_its_declared_metrics_may_be_watched(tmp_path):
    """The caption task's exact-match rate and perplexity are logged but not quality metrics (not in Δm): a best
    checkpoint and early stopping may watch them (Task.watchable), in the direction the user names."""
    cfg = load_run_config(TINY, [f"output_dir={tmp_path}", "checkpoint.best_metric=gen_ppl", "checkpoint.best_mode=min",
                                 "trainer.early_stopping.metric=gen_exact"], announce=False)
    assert cfg.checkpoint.best_metric == "gen_ppl"
    with pytest.raises(ConfigError, match="'cls_ppl' is not a metric this run logs"):
        load_run_config(TINY, [f"output_dir={tmp_path}", "checkpoint.best_metric=cls_ppl"], announce=False)
    tr = Trainer.from_config(TINY, [f"output_dir={tmp_path / 'run'}", "trainer.max_steps=3", "trainer.eval_every=1",
                                    "checkpoint.every_steps=0", "checkpoint.best_metric=gen_ppl", "checkpoint.best_mode=min"])
    try:
        tr.train()
    finally:
        tr.close()
    ppl = {step: r["gen_ppl"] for step, r in evaluations(tmp_path / "run").items()}
    best = best_of(tmp_path / "run")
    assert best["metric"] == "gen_ppl" and best["value"] == min(ppl.values()) and ppl[best["step"]] == best["value"]


@pytest.mark.slow
def test_two_processes_keep_the_same_best_and_stop_at_the_same_evaluation_after_a_crash(tmp_path):
    """2 processes at the same global batch (4 each) and on the whole validation split: rank 1 crashes at step 5;
    resume=auto on 2 processes ends as the uninterrupted 1-process run: the same best/ step and value, the same early
    stop. The 2-process runs log to every tracker: only rank 0 writes, and the resume continues the same runs."""
    args = ["--config", TINY, *WATCHED, "trainer.eval_max_batches=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*args, f"output_dir={one}"])
    tracked = ["logging.trackers=[tensorboard,csv,mlflow,wandb]", "data.batch_size=4"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    crashed = run_train([*args, f"output_dir={two}", *tracked, "trainer.poison=5:crash:1"], nproc=2, check=False,
                        env=env)
    assert crashed.returncode != 0 and "best" in os.listdir(two / "checkpoints")
    assert not (two / "final_metrics.json").exists()
    ids = json.loads((two / "trackers.json").read_text())
    run_train([*args, f"output_dir={two}", *tracked, "resume=auto"], nproc=2, env=env)
    _check_trackers_of_rank_0_alone(two, ids)
    assert best_of(two)["step"] == best_of(one)["step"]
    assert best_of(two)["value"] == pytest.approx(best_of(one)["value"], rel=1e-4)
    assert final(two)["stopped_early"]["step"] == final(one)["stopped_early"]["step"]
    assert final(two)["world_size"] == 2 and sorted(os.listdir(two / "checkpoints")) == sorted(
        os.listdir(one / "checkpoints"))


def _check_trackers_of_rank_0_alone(out, ids: dict) -> None:
    """Each evaluation of metrics.jsonl is in the CSV and in MLflow once (a second writer would double them, or open a
    second run), in the one W&B run and the one MLflow run that the crashed attempt opened and the resume continued."""
    import csv

    from mlflow.tracking import MlflowClient

    assert json.loads((out / "trackers.json").read_text()) == ids
    evals = sorted(evaluations(out))
    with open(out / "metrics.csv", encoding="utf-8", newline="") as f:
        rows = [(int(r["step"]), r["name"]) for r in csv.DictReader(f)]
    acc = [step for step, name in rows if name == "eval/cls_acc"]
    assert acc == evals and len(rows) == len(set(rows))
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("mtl").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "eval/cls_acc")) == evals
    folders = os.listdir(out / "wandb")
    assert folders and all(f.endswith(ids["wandb"]) for f in folders if f.startswith("offline-run-")), folders
