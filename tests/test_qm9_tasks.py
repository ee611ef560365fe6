"""The regression task type: many named instances of one type (QM9's 11 targets), MSE on standardised targets, MAE in
the reported unit, options per instance, and nothing registered behind a config's back."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mtl.errors import ConfigError
from mtl.tasks import BuildInfo, DataInfo, task_types
from mtl.tasks.regression import RegressionHead

from .conftest import TINY

# QM9's 11 tasks as the papers report them: name -> (column of PyG's y, factor to the reported unit, unit).
# (The same table as mtl.data.qm9.PAPER_TASKS / PAPER_SCALE / PAPER_UNITS; spelled out so this test needs no PyG.)
QM9 = {"mu": (0, 1, "D"), "alpha": (1, 1, "a0^3"), "homo": (2, 1000, "meV"), "lumo": (3, 1000, "meV"),
       "r2": (5, 1, "a0^2"), "zpve": (6, 1000, "meV"), "U0": (12, 1000, "meV"), "U": (13, 1000, "meV"),
       "H": (14, 1000, "meV"), "G": (15, 1000, "meV"), "Cv": (11, 1, "cal/(mol K)")}


def qm9_cfg():
    return OmegaConf.create({"task_options": {t: {"unit": u, "scale": s} for t, (_, s, u) in QM9.items()}})


def info(cfg, channels=16):
    return BuildInfo(cfg=cfg, feature_channels=channels, feature_hw=(1, 1), num_classes=0, class_names=[],
                     tokenizer=None)


def test_one_type_many_named_instances():
    classes = {t: RegressionHead.instance(t, field="y", column=c) for t, (c, _, _) in QM9.items()}
    assert [cls.name for cls in classes.values()] == list(QM9)
    assert all(cls.requires == ("y",) and issubclass(cls, RegressionHead) for cls in classes.values())
    assert RegressionHead.instance("U0", field="y", column=12) is classes["U0"]  # the same arguments, the same class
    assert RegressionHead.instance("U0", field="y", column=7) is not classes["U0"]
    heads = {t: cls.build(info(qm9_cfg())) for t, cls in classes.items()}
    assert heads["U0"].unit == "meV" and heads["U0"].scale == 1000 and heads["mu"].scale == 1
    # the type and its instances are not built-in tasks: a config names them (see the module's doc)
    names = task_types()
    assert "" not in names and not set(QM9) & set(names)
    with pytest.raises(ValueError, match="identifier"):
        RegressionHead.instance("not a name")


def test_item_fields_read_a_column_or_a_scalar():
    y = torch.arange(19, dtype=torch.float).view(1, 19) / 10
    u0 = RegressionHead.instance("U0", field="y", column=12)
    assert u0.item_fields({"y": y}, DataInfo(cfg=qm9_cfg(), num_classes=0, class_names=[], tokenizer=None)) == {
        "U0_target": pytest.approx(1.2)}
    plain = RegressionHead.instance("age")
    assert plain.requires == ("age",) and plain.item_fields({"age": 41}, None) == {"age_target": 41.0}
    batch = plain.collate_fields([{"age_target": 41.0}, {"age_target": 7.5}], None)
    assert torch.equal(batch["age_target"], torch.tensor([41.0, 7.5]))


def test_options_are_checked_per_instance():
    cls = RegressionHead.instance("homo", field="y", column=2)
    assert cls.check(OmegaConf.create({"task_options": {"homo": {"scale": 0.0}}})) == [
        "task_options.homo.scale=0.0: must be > 0 (the factor from the data's unit to the reported one, 1 to keep it)"]
    with pytest.raises(ConfigError, match="task_options.homo"):
        cls.options_from(OmegaConf.create({"task_options": {"homo": {"scael": 2.0}}}))


def test_mse_on_standardised_targets_and_mae_in_reported_units():
    torch.manual_seed(0)
    head = RegressionHead.instance("homo", field="y", column=2).build(info(qm9_cfg(), channels=8))
    mean, std = -6.5, 0.6  # eV
    head.set_standardisation(mean, std)
    features = torch.randn(10, 8)
    y = torch.randn(10) * 0.5 + mean
    batch = {"homo_target": y}
    z_pred = head.fc(features).squeeze(-1).detach()
    assert float(head(features, batch).detach()) == pytest.approx(float(((z_pred - (y - mean) / std) ** 2).mean()), rel=1e-5)
    pred_ev = z_pred * std + mean
    expected_mae_mev = float((pred_ev - y).abs().mean()) * 1000
    parts = [head.eval_batch(features[:4], {"homo_target": y[:4]}), head.eval_batch(features[4:], {"homo_target": y[4:]})]
    out = head.eval_reduce(parts)
    assert out["mae"] == pytest.approx(expected_mae_mev, rel=1e-5)
    assert out["loss"] == pytest.approx(float(head(features, batch).detach()), rel=1e-5)
    assert [p["value"] for p in head.predict(features)] == pytest.approx((pred_ev * 1000).tolist(), rel=1e-5)
    assert head.predict(features)[0]["unit"] == "meV"
    # the standardisation travels with the head's weights (a saved run evaluates with the training split's)
    state = head.state_dict()
    assert float(state["mean"]) == mean and float(state["std"]) == pytest.approx(std)
    fresh = RegressionHead.instance("homo", field="y", column=2).build(info(qm9_cfg(), channels=8))
    fresh.load_state_dict(state)
    assert fresh.eval_reduce([fresh.eval_batch(features, batch)])["mae"] == pytest.approx(expected_mae_mev, rel=1e-5)
    with pytest.raises(ValueError, match="std"):
        head.set_standardisation(0.0, 0.0)


def test_standardising_makes_the_loss_independent_of_the_targets_scale():
    """The point of standardising: a target in other units (x1000, shifted) with its own mean/std gives the same
    loss and gradients."""
    torch.manual_seed(0)
    a = RegressionHead.instance("r2", field="y", column=5).build(info(qm9_cfg(), channels=4))
    b = RegressionHead.instance("r2", field="y", column=5).build(info(qm9_cfg(), channels=4))
    b.load_state_dict(a.state_dict())
    features, y = torch.randn(6, 4), torch.randn(6) * 3 + 10
    a.set_standardisation(10.0, 3.0)
    b.set_standardisation(10.0 * 1000 - 5, 3.0 * 1000)
    la, lb = a(features, {"r2_target": y}), b(features, {"r2_target": y * 1000 - 5})
    la.backward()
    lb.backward()
    assert float(la.detach()) == pytest.approx(float(lb.detach()), rel=1e-5)
    torch.testing.assert_close(a.fc.weight.grad, b.fc.weight.grad, rtol=1e-4, atol=1e-6)


def test_a_feature_map_is_mean_pooled():
    head = RegressionHead.instance("mu", field="y", column=0).build(info(qm9_cfg(), channels=3))
    fmap = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(head.standardised_prediction(fmap), head.standardised_prediction(fmap.mean((2, 3))))


# ----------------------------------------------------------------------------- task_instances: named tasks in a config

TINY_OVERRIDES = ["trainer.progress=false", "data.synthetic.train_size=64", "data.synthetic.val_size=16"]


def tiny_config(tmp_path, *overrides):
    from mtl.setup.checks import load_run_config

    return load_run_config(TINY, [f"output_dir={tmp_path / 'run'}", *TINY_OVERRIDES, *overrides])


def test_a_config_declares_named_tasks_of_one_type_and_the_build_standardises_them(tmp_path):
    """Two regression tasks on the synthetic records' ``radius`` and ``background[1]``, beside a built-in task: the
    builder makes them, fits each head's mean and std on the training split, and a step trains them."""
    from mtl.run.trainer import Trainer
    from mtl.setup.build import build_run_inputs

    over = ["tasks=[cls, radius, green]", "task_instances.radius={type: regression, field: radius}",
            "task_instances.green={type: regression, field: background, column: 1}",
            "task_options.radius={unit: px}"]
    cfg = tiny_config(tmp_path, *over)
    inputs = build_run_inputs(cfg)
    heads = inputs.model.heads
    assert type(heads["radius"]).name == "radius" and heads["radius"].unit == "px"
    radius = torch.tensor([float(inputs.train_ds[i]["radius"]) for i in range(len(inputs.train_ds))], dtype=torch.float64)
    green = torch.tensor([float(inputs.train_ds[i]["background"][1]) for i in range(len(inputs.train_ds))],
                         dtype=torch.float64)
    assert float(heads["radius"].mean) == pytest.approx(float(radius.mean()), rel=1e-6)
    assert float(heads["radius"].std) == pytest.approx(float(radius.std()), rel=1e-6)
    assert float(heads["green"].mean) == pytest.approx(float(green.mean()), rel=1e-6)
    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path / 'run'}", *TINY_OVERRIDES, *over])
    try:
        result = trainer.step_once()
        assert set(result.losses) == {"cls", "radius", "green"}
        metrics = trainer.run_eval()
        assert metrics["radius_mae"] > 0 and metrics["green_mae"] > 0
    finally:
        trainer.close()


@pytest.mark.parametrize("override,message", [
    ("task_instances.radius={type: regresion, field: radius}",
     "task_instances.radius.type: unknown task type 'regresion' — did you mean 'regression'?"),
    ("task_instances.radius={type: regression, feild: radius}",
     "task_instances.radius: unknown key 'feild' — did you mean 'task_instances.radius.field'?"),
    ("task_instances.radius={type: regression, field: radius, column: -1}",
     "task_instances.radius: column: the target's index in the field's vector, an integer >= 0 (got -1)"),
    ("task_instances.radius={field: radius}", "task_instances.radius: needs a mapping with 'type'"),
    ("task_instances.cls={type: regression, field: radius}", "task_instances.cls: 'cls' is already a task"),
])
def test_a_bad_instance_is_named_with_the_fix(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "tasks=[cls, radius]", override)
    assert any(message in m for m in e.value.errors), e.value.errors


def test_a_task_name_that_is_not_declared_gets_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "tasks=[cls, radios]", "task_instances.radius={type: regression, field: radius}")
    assert any("unknown task 'radios' — did you mean 'radius' for 'radios'?" in m for m in e.value.errors), e.value.errors


def test_a_missing_field_is_refused_before_training(tmp_path):
    from mtl.errors import DataError
    from mtl.setup.build import build_run_inputs

    cfg = tiny_config(tmp_path, "tasks=[cls, mass]", "task_instances.mass={type: regression, field: mass}")
    with pytest.raises(DataError, match="task 'mass' needs the field 'mass'"):
        build_run_inputs(cfg)


ATTRIBUTE_TYPE = '''
"""A CelebA-style binary attribute: one task type, any number of named attributes (one file)."""
import torch
import torch.nn.functional as F
from torch import nn

from mtl.tasks.base import TaskHead


class Attribute(TaskHead):
    kind = "attribute"
    metrics = {"acc": True}

    @classmethod
    def instance(cls, name, field, column, above=0.5):
        return type(f"Attribute_{name}", (cls,), {"name": name, "field": field, "column": column, "above": above,
                                                   "requires": (field,)})

    @classmethod
    def item_fields(cls, record, info):
        return {f"{cls.name}_on": float(torch.as_tensor(record[cls.field]).reshape(-1)[cls.column] > cls.above)}

    def __init__(self, info):
        super().__init__()
        self.fc = nn.Linear(info.feature_channels, 1)

    def logits(self, features):
        return self.fc(features.mean(dim=(2, 3))).squeeze(-1).float()

    def forward(self, features, batch):
        return F.binary_cross_entropy_with_logits(self.logits(features), batch[f"{self.name}_on"])

    @torch.no_grad()
    def eval_batch(self, features, batch):
        right = ((self.logits(features) > 0).float() == batch[f"{self.name}_on"]).sum()
        return {"right": int(right), "n": len(batch[f"{self.name}_on"])}

    def eval_reduce(self, parts):
        return {"acc": sum(p["right"] for p in parts) / max(1, sum(p["n"] for p in parts))}
'''


def test_many_binary_attributes_are_one_task_file_and_one_config_section(tmp_path):
    """The CelebA pattern: a type of kind ``attribute`` in a file outside mtl (task_modules), three attributes
    declared in task_instances, trained together for a step and evaluated."""
    from mtl.run.trainer import Trainer

    path = tmp_path / "attribute.py"
    path.write_text(ATTRIBUTE_TYPE)
    over = [f"task_modules=[{path}]", "tasks=[red, green, blue]",
            *(f"task_instances.{c}={{type: attribute, field: background, column: {i}, above: 0.4}}"
              for i, c in enumerate(("red", "green", "blue")))]
    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path / 'run'}", *TINY_OVERRIDES, *over])
    try:
        assert [type(h).__name__ for h in trainer.bare.heads.values()] == [
            "Attribute_red", "Attribute_green", "Attribute_blue"]
        assert set(trainer.step_once().losses) == {"red", "green", "blue"}
        assert set(trainer.run_eval()) == {"red_acc", "green_acc", "blue_acc"}
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- the plateau schedule on the val Δm

def test_the_plateau_scheduler_follows_the_validation_delta_m():
    """Δm % against the baselines (lower is better), and ReduceLROnPlateau on it: the rate drops by ``factor`` after
    ``patience`` evaluations without improvement, never below ``min_lr``, and its state round-trips."""
    from mtl.optim.plateau import PlateauOnDeltaM

    specs = [("mu_mae", "mu", False), ("U0_mae", "U0", False)]
    base = {"mu_mae": 0.0671, "U0_mae": 58.838}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    s = PlateauOnDeltaM(opt, specs, base, factor=0.7, patience=2, min_lr=4e-4)
    s.step()  # a training step: nothing moves
    dm = s.evaluated({"mu_mae": 0.0671 * 2, "U0_mae": 58.838 * 1.5, "test_mu_mae": 9.0})
    assert dm == pytest.approx((100 + 50) / 2) and s.get_last_lr() == [1e-3]
    for _ in range(2):  # patience 2: two evaluations no better, the rate stays
        s.evaluated({"mu_mae": 0.0671 * 2, "U0_mae": 58.838 * 1.5})
        assert s.get_last_lr() == [1e-3]
    s.evaluated({"mu_mae": 0.0671 * 2, "U0_mae": 58.838 * 1.5})  # the third: x0.7
    assert s.get_last_lr() == [pytest.approx(7e-4)]
    state = s.state_dict()
    for _ in range(6):
        s.evaluated({"mu_mae": 1.0, "U0_mae": 100.0})
    assert s.get_last_lr() == [pytest.approx(4e-4)]  # min_lr
    fresh = PlateauOnDeltaM(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=7e-4), specs, base, 0.7, 2, 4e-4)
    fresh.load_state_dict(state)
    assert fresh.inner.num_bad_epochs == state["inner"]["num_bad_epochs"] and fresh.last_delta_m == pytest.approx(75)


def test_the_plateau_needs_a_baseline_for_every_metric(tmp_path):
    over = ["tasks=[cls, radius]", "task_instances.radius={type: regression, field: radius}",
            "optim.scheduler=plateau", "optim.warmup_steps=0", "optim.plateau.baselines={cls_acc: 0.9, radios_mae: 1}"]
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, *over)
    text = "\n".join(e.value.errors)
    assert "optim.plateau.baselines.radius_mae: needs the single-task value of radius_mae" in text
    assert "optim.plateau.baselines.radios_mae: not a metric of the run's tasks — did you mean 'radius_mae'?" in text
    cfg = tiny_config(tmp_path, *over[:-1], "optim.plateau.baselines={cls_acc: 0.9, radius_mae: 1.5}")
    from mtl.setup.build import build_scheduler

    sched = build_scheduler(cfg, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3))
    # accuracy: higher is better, so Δm counts its drop as a loss; the MAE's rise likewise
    assert sched.evaluated({"cls_acc": 0.45, "radius_mae": 3.0}) == pytest.approx((50 + 100) / 2)
