"""A diverged model is never kept as good: a non-finite weight after a step is a bad step that ends
the run, no checkpoint holds a NaN/inf weight or optimizer value, and a run whose final evaluation is non-finite
does not succeed. (NaN/inf in the config:
tests/test_config.py.)"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from mtl.checkpoint import folder as ckpt
from mtl.checkpoint import train_state as ts
from mtl.checkpoint.finite import first_blown_up, first_nonfinite, nonfinite_eval, params_finite
from mtl.errors import TrainingError

from .conftest import TINY
from .test_trust import _parts, config, to_yaml

RUN = ["trainer.max_steps=4", "checkpoint.every_steps=1", "trainer.eval_every=1000", "data.num_workers=0"]


def _checkpoints(out):
    return sorted(os.listdir(os.path.join(out, "checkpoints")))


def test_a_state_holding_nan_is_never_saved(tmp_path):
    net, weighting, opt = _parts(1)
    with torch.no_grad():
        next(iter(opt.state.values()))["exp_avg_sq"][0] = float("inf")  # the optimizer's, not the model's
    with pytest.raises(TrainingError) as e:
        ckpt.save_checkpoint(str(tmp_path), 1, net, {"step": 1, "world_size": 1}, to_yaml(config(tmp_path)), 0,
                             sharded=ts.sharded_state(net, weighting, opt))
    assert e.value.exit_code == 5 and "exp_avg_sq" in e.value.message and "not written" in e.value.message
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))  # nothing started: no folder, no .tmp


def test_the_weights_check_refuses_nan_inf_and_weights_blown_past_float32():
    ok = {"a": torch.ones(3), "b": torch.full((4,), 1e18)}
    assert params_finite(list(ok.values()), sharded=False) and first_blown_up(ok) is None
    for bad in (math.nan, math.inf, 1e36):  # 1e36: finite, but its square overflows: the model has blown up
        weights = {**ok, "c": torch.tensor([0.5, bad])}
        assert not params_finite(list(weights.values()), sharded=False) and first_blown_up(weights) == "c"


def test_first_nonfinite_names_the_path_and_the_eval_check_tells_divergence_from_nothing_to_score():
    assert first_nonfinite({"a": torch.ones(2), "b": [1.0, {"c": torch.tensor([0.0, math.nan])}]}) == "b.1.c"
    assert first_nonfinite({"a": torch.ones(2), "n": torch.tensor([1, 2])}) is None
    # a counting task with no known count scores nothing (both NaN): not a divergence; a NaN loss beside a number is
    assert nonfinite_eval({"count_acc": math.nan, "count_loss": math.nan, "cls_acc": 0.5, "cls_loss": 1.0},
                          ["cls", "count"]) == []
    assert nonfinite_eval({"cls_acc": 0.25, "cls_loss": math.nan, "gen_loss": math.inf}, ["cls", "gen"]) == [
        "cls_loss", "gen_loss"]


@pytest.mark.slow  # in-process runs, seconds long
def test_a_step_that_makes_a_weight_nonfinite_ends_the_run_and_is_never_saved(tmp_path, monkeypatch, capsys):
    """Finite gradients, and yet the optimizer step writes a NaN (injected where it happens, in AdamW.step at the
    second step): a bad step; the run stops (exit 5) naming the parameter, and step_2 is never written."""
    import train

    real, calls = torch.optim.AdamW.step, []

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out = tmp_path / "run"
    assert train.main(["--config", TINY, *RUN, f"output_dir={out}"]) == 5
    assert len(calls) == 2  # the fault happened, at step 2
    err = capsys.readouterr().err
    assert "step 2: the optimizer step made the weights non-finite" in err and "backbone." in err
    assert _checkpoints(out) == ["step_1"]
    with open(out / "metrics.jsonl") as f:
        bad = [json.loads(line) for line in f if '"bad_step"' in line]
    assert [(b["step"], b["nonfinite"]) for b in bad] == [(2, "weights")]


@pytest.mark.slow
def test_a_learning_rate_that_blows_the_weights_up_stops_at_that_step_with_no_checkpoint(tmp_path, capsys):
    """The issue's run: optim.lr=1e36 made every weight about 1e36 (finite), the next steps were skipped as
    non-finite, and step_1 to step_3 were kept as good checkpoints of the blown-up model. Now step 1 itself is the
    bad step: exit 5, and no checkpoint at all."""
    import train

    out = tmp_path / "run"
    assert train.main(["--config", TINY, "optim.lr=1e36", "optim.warmup_steps=0", "checkpoint.every_steps=1",
                       "trainer.max_bad_steps=3", "trainer.max_steps=6", "data.num_workers=0",
                       f"output_dir={out}"]) == 5
    err = capsys.readouterr().err
    assert "step 1: the optimizer step made the weights non-finite or blew them up" in err
    assert not os.path.isdir(out / "checkpoints") or _checkpoints(out) == []


@pytest.mark.slow
def test_a_run_whose_final_evaluation_is_nonfinite_fails_and_keeps_no_final_checkpoint(tmp_path, monkeypatch, capsys):
    import train
    from mtl.run import trainer as trainer_module

    real, calls = trainer_module.evaluate_run, []

    def diverged(*args, **kwargs):
        metrics = real(*args, **kwargs)
        calls.append(1)
        metrics["cls"]["loss"] = math.nan  # as a model with inf logits scores (its accuracy still a number)
        return metrics

    monkeypatch.setattr(trainer_module, "evaluate_run", diverged)
    out = tmp_path / "run"
    assert train.main(["--config", TINY, *RUN, "trainer.max_steps=2", f"output_dir={out}"]) == 5
    assert calls  # the final evaluation ran
    err = capsys.readouterr().err
    assert "final evaluation at step 2 is non-finite (cls_loss=nan)" in err and "step_1" in err
    assert _checkpoints(out) == ["step_1"]
    assert not os.path.exists(out / "final_metrics.json")
