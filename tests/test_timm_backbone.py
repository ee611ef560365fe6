"""The ``timm`` backbone (mtl/models/backbones/timm_models.py): features == timm's own forward_features on weights
loaded from a local file, blocks() in order, gradients for every parameter, and bad input refused (exit 2)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from omegaconf import OmegaConf

import train
from mtl.errors import ConfigError
from mtl.models.backbones.timm_models import INSTALL, TimmBackbone

from .conftest import ROOT

timm = pytest.importorskip("timm")

KINDS = {"resnet18": {}, "vit_tiny_patch16_224": {"img_size": 32, "patch_size": 8, "depth": 2}}
SMALL = ["data.batch_size=4", "data.eval_batch_size=4", "data.synthetic.train_size=8", "data.synthetic.val_size=4",
         "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_max_batches=1", "trainer.num_samples=0",
         "trainer.progress=false", "optim.warmup_steps=0", "data.image_size=32"]


def cfg_for(name, pretrained=None, norm="batch"):
    return OmegaConf.create({"model": {"backbone": {"name": "timm", "pretrained": pretrained, "norm": norm,
                                                    "options": {"model": name, **KINDS.get(name, {})}}},
                             "data": {"image_size": 32}})


def reference(tmp_path, name):
    """A random timm model with its head, saved as safetensors; returns (model, file)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, **KINDS[name]).eval()
    path = str(tmp_path / f"{name}.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    return ref, path


@pytest.mark.parametrize("name", list(KINDS))
def test_features_are_timms_forward_features_and_blocks_cover_the_parameters(tmp_path, name):
    ref, path = reference(tmp_path, name)
    bb = TimmBackbone.build(cfg_for(name, path)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(bb(x), ref.forward_features(x))
    assert bb.pool == ("cls" if name.startswith("vit") else "mean")
    names = [n for n, _ in bb.blocks()]
    assert len(names) == (2 if name.startswith("vit") else 4), names
    in_blocks = [id(p) for _, m in bb.blocks() for p in m.parameters()]
    order = [id(p) for p in bb.parameters() if id(p) in set(in_blocks)]
    assert in_blocks == order  # blocks in forward (registration) order
    bb.train()
    bb(x).float().sum().backward()
    assert [n for n, p in bb.named_parameters() if p.grad is None] == []  # nothing unused under DDP


def test_norm_group_frozen_and_sync_leave_no_per_rank_batch_statistics_and_batch_is_refused_on_reshard():
    """A timm ResNet's BatchNorm follows model.backbone.norm; the reshard rule (mtl/setup/resume.py) refuses a
    resume on another world size exactly when batch_statistics_layers finds a layer."""
    from mtl.setup.resume import batch_statistics_layers

    assert batch_statistics_layers(TimmBackbone.build(cfg_for("resnet18", norm="batch")))
    for norm in ("group", "frozen", "sync"):
        assert batch_statistics_layers(TimmBackbone.build(cfg_for("resnet18", norm=norm))) == [], norm


def test_bad_input_is_one_message(tmp_path, monkeypatch):
    _, path = reference(tmp_path, "resnet18")
    with pytest.raises(ConfigError, match="did you mean 'resnet18'"):
        TimmBackbone.build(cfg_for("resnet18x"))
    with pytest.raises(ConfigError, match=f"{path}.*is not a"):
        TimmBackbone.build(cfg_for("vit_tiny_patch16_224", path))
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ConfigError) as e:
        TimmBackbone.build(cfg_for("resnet18"))
    assert INSTALL in str(e.value)


@pytest.mark.parametrize("bad", ["name", "weights"])
def test_bad_input_through_train_exits_2_and_writes_nothing(tmp_path, capsys, bad):
    _, path = reference(tmp_path, "vit_tiny_patch16_224")
    out = tmp_path / "run"
    extra = (["model.backbone.options.model=resnet18x"] if bad == "name"
             else ["model.backbone.options.model=resnet18", f"model.backbone.pretrained={path}"])
    code = train.main(["--config", os.path.join(ROOT, "configs", "default.yaml"), "model.backbone.name=timm",
                       *SMALL, *extra, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "Traceback" not in err, err
    assert ("did you mean" in err) if bad == "name" else (path in err)


# ------------------------------------------------------------------ DDP: 2 processes == 1 process


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    import functools

    from .conftest import TINY, spawn_parity_runs
    from .test_strategies_ddp import DEADLINE_S, _runs, parity_worker

    extra = ["model.backbone.name=timm", "model.backbone.options.model=resnet18", "model.backbone.norm=group"]
    run = functools.partial(_runs, config=TINY, extra=extra)
    return spawn_parity_runs(functools.partial(parity_worker, run), tmp_path_factory, "timm_ddp", DEADLINE_S,
                             "timm DDP")


@pytest.mark.slow
def test_two_processes_equal_one_process_with_a_timm_resnet_for_every_strategy(ddp_runs):
    from .test_strategies_ddp import assert_every_strategy_matches

    assert_every_strategy_matches(ddp_runs, "backbone.model.layer1")


def test_a_timm_save_pretrained_folder_loads(tmp_path):
    from timm.models._hub import save_for_hf

    ref, _ = reference(tmp_path, "resnet18")
    save_for_hf(ref, str(tmp_path / "folder"))
    bb = TimmBackbone.build(cfg_for("resnet18", str(tmp_path / "folder"))).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(bb(x), ref.forward_features(x))


@pytest.mark.parametrize("name", list(KINDS))
def test_one_training_step_of_cls_and_gen_on_each_kind(tmp_path, capsys, name):
    _, path = reference(tmp_path, name)
    opts = [f"model.backbone.options.{k}={v}" for k, v in KINDS[name].items()]
    code = train.main(["--config", os.path.join(ROOT, "configs", "default.yaml"), "model.backbone.name=timm",
                       f"model.backbone.options.model={name}", *opts, f"model.backbone.pretrained={path}", *SMALL,
                       "checkpoint.every_steps=1", f"output_dir={tmp_path / 'run'}"])
    assert code == 0, capsys.readouterr().err


def test_timm_missing_through_train_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # as if timm were not installed
    out = tmp_path / "run"
    code = train.main(["--config", os.path.join(ROOT, "configs", "default.yaml"), "model.backbone.name=timm",
                       "model.backbone.options.model=resnet18", *SMALL, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "Traceback" not in err, err
    assert INSTALL in err and "model.backbone.name" in err
