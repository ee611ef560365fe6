"""A backbone really is one file: docs/examples/small_cnn.py, copied outside the package and named in the config's
``backbone_modules``, is found by ``model.backbone.name``, has its options checked, builds the heads for the
feature shape it declares, and trains under 2 processes, with no other edit."""

import json

import pytest
import torch
from safetensors import safe_open

from mtl.errors import ConfigError
from mtl.models.backbones import backbone_types
from mtl.setup.build import build_run_inputs
from mtl.setup.checks import load_run_config

from .conftest import TINY, example_outside, run_train

backbone_file = example_outside("small_cnn.py", "my_backbone.py")  # the example, copied where no mtl code is


def test_the_new_backbone_is_found_by_name_and_the_heads_fit_its_declared_feature_shape(backbone_file, tmp_path):
    cfg = load_run_config(TINY, [f"backbone_modules=[{backbone_file}]", "model.backbone.name=small_cnn",
                                 "model.backbone.options.width=8", f"output_dir={tmp_path / 'run'}"])
    assert cfg.model.backbone.options == {"width": 8, "blocks": 2}  # its typed section, filled and checked
    run = build_run_inputs(cfg)
    backbone = run.model.backbone
    assert type(backbone).__name__ == "SmallCNN" and backbone.feature_shape(cfg) == (16, 8, 8)
    batch = next(iter(run.train_loader()))
    out = run.model(batch)
    assert tuple(out["features"].shape[1:]) == backbone.feature_shape(cfg)  # what it declared is what it gives
    assert set(out["losses"]) == {"cls", "gen"} and all(torch.isfinite(v) for v in out["losses"].values())
    assert run.model.heads["cls"].fc.in_features == 16  # the heads are built for the declared channels
    assert any(k.startswith("backbone.body.0.") for k in run.model.state_dict())
    assert "small_cnn" not in backbone_types()  # only the config that names the file sees it


def test_the_new_backbone_s_name_options_and_module_are_checked(backbone_file):
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"backbone_modules=[{backbone_file}]", "model.backbone.name=small_cnn",
                               "model.backbone.options.widht=8", "optim.lr=-1"])
    assert "did you mean 'model.backbone.options.width'" in str(e.value)
    assert "optim.lr" in str(e.value)  # with every other error, in one message
    with pytest.raises(ConfigError, match="width and blocks must be > 0"):
        load_run_config(TINY, [f"backbone_modules=[{backbone_file}]", "model.backbone.name=small_cnn",
                               "model.backbone.options.blocks=0"])
    with pytest.raises(ConfigError, match="backbone_modules: cannot import 'no_such_module_xyz'"):
        load_run_config(TINY, ["backbone_modules=[no_such_module_xyz]"])
    with pytest.raises(ConfigError, match="model.backbone.name: unknown backbone 'small_cnn'"):
        load_run_config(TINY, ["model.backbone.name=small_cnn"])  # without its file, no such backbone


def test_a_backbone_file_may_not_take_a_built_in_name(tmp_path):
    path = tmp_path / "clash.py"
    path.write_text("from mtl.models.backbones import Backbone\n\n\nclass Mine(Backbone):\n    name = 'resnet18'\n")
    with pytest.raises(ConfigError, match="backbone 'resnet18' of .* is also a built-in backbone"):
        load_run_config(TINY, [f"backbone_modules=[{path}]"])


@pytest.mark.slow
def test_the_new_backbone_trains_under_two_processes(backbone_file, tmp_path):
    out = tmp_path / "run"
    run_train(["--config", TINY, f"output_dir={out}", f"backbone_modules=[{backbone_file}]",
               "model.backbone.name=small_cnn", "trainer.max_steps=4", "trainer.eval_every=4",
               "checkpoint.every_steps=0"], nproc=2)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and all(r["loss_cls"] > 0 and r["loss_gen"] > 0 for r in train)
    assert json.loads((out / "final_metrics.json").read_text())["world_size"] == 2
    with safe_open(str(out / "checkpoints" / "step_4" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "backbone.body.0.weight" in keys and not any(k.startswith("backbone.stem") for k in keys)
