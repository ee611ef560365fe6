"""The real train.py, in one process and under torchrun with gloo: outputs, precisions, strategies, resume."""

import json
import math
import os
import shutil

import pytest
import yaml
from safetensors.torch import load_file

from .conftest import TINY, run_train
from .resume_check import check_resume, snapshot


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_run_outputs(run_dir, last_step):
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["trainer"]["max_steps"] == last_step
    rows = metrics(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    for r in train:
        assert {"step", "loss_cls", "loss_gen", "lr", "samples_per_s"} <= set(r)
        assert math.isfinite(r["loss_cls"]) and math.isfinite(r["loss_gen"])
    assert evals and evals[-1]["step"] == last_step
    assert {"cls_acc", "gen_bleu4", "gen_chrf", "gen_loss"} <= set(evals[-1])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tb")))
    weights = load_file(os.path.join(run_dir, "checkpoints", f"step_{last_step}", "model.safetensors"))
    assert weights and not any(k.startswith("module.") for k in weights)  # the bare model, no DDP prefix
    assert any(k.startswith("heads.gen.decoder.") for k in weights) and any(k.startswith("backbone.") for k in weights)
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", f"step_{last_step}", "trainer_state.pt"))
    return train


@pytest.mark.slow
def test_one_process_run_learns_and_writes_its_outputs(tmp_path):
    out = tmp_path / "run"
    proc = run_train(["--config", TINY, f"output_dir={out}", "trainer.max_steps=20", "trainer.eval_every=20",
                      "checkpoint.every_steps=10", "data.batch_size=16", "optim.lr=1e-3"])
    assert "resolved config:" in proc.stdout
    train = assert_run_outputs(str(out), 20)

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    for key in ("loss_cls", "loss_gen"):  # both losses fall (means of 5 steps: single batches are noisy)
        assert mean(key, train[-5:]) < mean(key, train[:5]), key
    assert mean("loss_gen", train[-5:]) < 0.9 * mean("loss_gen", train[:5])
    assert os.path.isfile(out / "curves.png") and os.path.isfile(out / "tokenizer" / "tokenizer.json")
    assert sorted(os.listdir(out / "checkpoints")) == ["step_10", "step_20"]


# bf16 and fp16 under torchrun with 2 processes, with a single-forward, a per-task-forward, a no_sync
# and the per-task-gradient strategy (every strategy runs at 2 ranks in fp32 in test_strategies_ddp.py).
@pytest.mark.slow
@pytest.mark.parametrize("strategy, precision", [
    ("feature_leaf", "bf16"), ("placeholder", "fp16"), ("accumulate", "bf16"), ("task_grads", "fp16"),
])
def test_torchrun_two_processes(tmp_path, strategy, precision):
    out = tmp_path / "run"
    run_train(["--config", TINY, f"output_dir={out}", f"ddp.strategy={strategy}", f"precision={precision}"],
              nproc=2)
    train = assert_run_outputs(str(out), 6)
    assert train[-1]["loss_gen"] < train[0]["loss_gen"]
    if precision == "fp16":
        assert all("loss_scale" in r for r in train)


@pytest.mark.slow
def test_resume_auto_continues_where_the_run_stopped(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(["--config", TINY, f"output_dir={full}"])
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_6")  # as if the run had died after step 5
    shutil.copytree(part / "checkpoints" / "step_3", part / "checkpoints" / ".step_6.tmp")  # a half-written save
    before = snapshot(str(part))
    assert before.step == 3
    proc = run_train(["--config", TINY, f"output_dir={part}", "resume=auto"])
    assert "resuming from" in proc.stdout and "step_3" in proc.stdout
    assert check_resume(str(part), before, last_step=6) == [4, 5, 6]  # its own steps: after step_3's, once each
    a = load_file(str(full / "checkpoints" / "step_6" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_6" / "model.safetensors"))
    assert all(a[k].equal(b[k]) for k in a)  # same batches, same RNG: bitwise the same parameters


@pytest.mark.slow
def test_refuses_to_write_over_another_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    run_train(["--config", TINY, f"output_dir={out}", "trainer.max_steps=3"])
    before = sorted(os.listdir(out / "checkpoints"))
    proc = run_train(["--config", TINY, f"output_dir={out}"], check=False)
    assert proc.returncode == 2
    assert "already holds checkpoints" in proc.stderr and "resume=auto" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(out / "checkpoints")) == before


def test_the_progress_bar_moves_every_step_not_every_log_every(tmp_path, capsys):
    """A 3-step run logging every 10 steps ends its progress at 3/3 (it used to stop where the last log line was);
    without a terminal (captured here) as a plain line (tests/test_help_and_messages.py)."""
    import train

    code = train.main(["--config", TINY, f"output_dir={tmp_path / 'run'}", "trainer.max_steps=3",
                       "trainer.log_every=10", "trainer.eval_every=100", "trainer.progress=true",
                       "checkpoint.every_steps=0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "progress: step 3/3" in out, out[-2000:]
