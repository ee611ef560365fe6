"""The regression task type: many named instances of one type (QM9's 11 targets), MSE on standardised targets, MAE in
the reported unit, options per instance, and nothing registered behind a config's back."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from mtl.errors import ConfigError
from mtl.tasks import BuildInfo, DataInfo, task_types
from mtl.tasks.regression import RegressionHead

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
