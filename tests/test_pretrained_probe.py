"""A pretrained backbone, used as practitioners use one: a linear probe (``model.backbone.freeze: true`` freezes the
whole backbone, its final layernorm too), a full CLIP or SigLIP folder whose unused text tower is counted at start-up,
and a folder that is missing or of a model type transformers does not know refused in one line (exit 2)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import train
from mtl.errors import ConfigError
from mtl.models.backbones.hf_vision import HFVisionBackbone
from mtl.models.blockwise import frozen_note

from .conftest import ROOT
from .pretrained_folders import local_pretrained
from .test_model_transforms import _hf_folder

VIT_GPT2 = os.path.join(ROOT, "configs", "vit_gpt2.yaml")
SMALL = ["data.batch_size=4", "data.eval_batch_size=4", "data.synthetic.train_size=8", "data.synthetic.val_size=4",
         "trainer.max_steps=1", "trainer.eval_every=100", "trainer.eval_max_batches=1", "trainer.num_samples=0",
         "trainer.progress=false", "optim.warmup_steps=0", "optim.name=sgd", "optim.lr=0.1"]


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    from mtl.config.schema import load_config

    return local_pretrained(load_config(VIT_GPT2), tmp_path_factory.mktemp("pretrained"))


def _trainer(overrides, tmp_path, *extra):
    from mtl.run.trainer import Trainer

    return Trainer.from_config(VIT_GPT2, [*overrides, *SMALL, *extra, f"output_dir={tmp_path}"])


def test_freeze_makes_a_linear_probe_and_freeze_blocks_all_leaves_the_final_norm_training(overrides, tmp_path):
    t = _trainer(overrides, tmp_path / "probe", "model.backbone.freeze=true")
    try:
        bare = t.parts.bare
        before = {k: v.clone() for k, v in bare.state_dict().items()}
        assert not any(p.requires_grad for p in bare.backbone.parameters())
        assert frozen_note(bare)[-1].startswith(
            f"model.backbone.freeze: {len(list(bare.backbone.parameters()))} backbone parameter tensors frozen")
        t.step_once()
        after = bare.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("backbone."))
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("heads.cls."))
    finally:
        t.close()
    # what freeze fixes: freezing every block leaves the layernorm after them training
    t = _trainer(overrides, tmp_path / "blocks", "model.backbone.freeze_blocks=2")
    try:
        trainable = [n for n, p in t.parts.bare.backbone.named_parameters() if p.requires_grad]
        assert trainable == ["model.layernorm.weight", "model.layernorm.bias"]
    finally:
        t.close()


@pytest.mark.slow  # two start-ups and a step: not in the fast tier
def test_a_probe_on_a_batchnorm_backbone_needs_frozen_statistics(tmp_path):
    """freeze: true on a BatchNorm backbone (resnet18, norm=batch) is refused in one line naming norm=frozen: training
    mode would go on updating the running statistics under the probe. With norm=frozen nothing of the backbone moves,
    its statistics included."""
    from mtl.run.trainer import Trainer

    from .conftest import TINY

    small = ["trainer.max_steps=1", "trainer.eval_every=100", "trainer.num_samples=0", "model.backbone.freeze=true"]
    with pytest.raises(ConfigError, match=r"BatchNorm layer\(s\).*set model.backbone.norm=frozen"):
        Trainer.from_config(TINY, [*small, "model.backbone.norm=batch", f"output_dir={tmp_path / 'batch'}"])
    assert not (tmp_path / "batch").exists()
    import torchvision

    weights = tmp_path / "resnet18.pth"  # frozen statistics are a pretrained network's: a weights file of its own
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    t = Trainer.from_config(TINY, [*small, "model.backbone.norm=frozen", f"model.backbone.weights={weights}",
                                   f"output_dir={tmp_path / 'frozen'}"])
    try:
        before = {k: v.clone() for k, v in t.parts.bare.state_dict().items() if k.startswith("backbone.")}
        t.step_once()
        after = t.parts.bare.state_dict()
        assert any("running_mean" in k for k in before) and all(torch.equal(v, after[k]) for k, v in before.items())
    finally:
        t.close()


@pytest.mark.parametrize("extra, says", [
    (["model.backbone.freeze_blocks=1"], "model.backbone.freeze_blocks: 1 with model.backbone.freeze: true"),
    (["model.architecture.name=cross_stitch", "model.backbone.name=resnet18", "model.backbone.pretrained=null"],
     "model.backbone.freeze: not with model.architecture.name=cross_stitch"),
    (["weighting.method=mgda", "weighting.source=parameters", "ddp.strategy=task_grads"],
     "weighting.source: parameters takes each task's gradient of the shared backbone parameters")])
def test_freeze_with_what_it_cannot_go_with_is_one_message(overrides, tmp_path, extra, says):
    from mtl.setup.checks import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config(VIT_GPT2, [*overrides, *SMALL, "model.backbone.freeze=true", *extra], announce=False)
    assert any(m.startswith(says) for m in e.value.errors), e.value.errors


@pytest.mark.parametrize("kind, text_tensors", [("clip", "text_model 20"), ("siglip", "text_model 22")])
def test_a_full_clip_or_siglip_folder_counts_its_unused_tensors_at_start_up(tmp_path, kind, text_tensors):
    from safetensors import safe_open

    folder = _hf_folder(kind, str(tmp_path / kind))
    cfg = OmegaConf.create({"model": {"backbone": {"name": "hf_vision", "pretrained": folder, "config": None}},
                            "data": {"image_size": 32}})
    backbone = HFVisionBackbone.build(cfg)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        in_file = len(list(f.keys()))
    unused = in_file - len(backbone.model.state_dict())  # every tensor the vision tower holds came from the file
    assert unused > 20
    note = frozen_note(SimpleNamespace(backbone=backbone))
    assert note == [note[0]] and note[0].startswith(
        f"model.backbone.pretrained: {unused} tensors of {folder!r} unused (its text tower is not loaded): ")
    assert text_tensors in note[0]


def test_a_vision_only_folder_has_no_text_tower_note(tmp_path):
    folder = _hf_folder("dinov2", str(tmp_path / "dinov2"))
    cfg = OmegaConf.create({"model": {"backbone": {"name": "hf_vision", "pretrained": folder, "config": None}},
                            "data": {"image_size": 32}})
    assert frozen_note(SimpleNamespace(backbone=HFVisionBackbone.build(cfg))) == []


def _unknown_type(tmp_path) -> str:
    folder = tmp_path / "future"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit_from_the_future", "hidden_size": 8}))
    return str(folder)


@pytest.mark.parametrize("case", ["missing", "unknown_type"])
def test_a_missing_folder_or_an_unknown_model_type_is_one_line_exit_2(overrides, tmp_path, capsys, case):
    folder = str(tmp_path / "nowhere") if case == "missing" else _unknown_type(tmp_path)
    out = tmp_path / "run"
    code = train.main(["--config", VIT_GPT2, *overrides, *SMALL, f"model.backbone.pretrained={folder}",
                       f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    lines = [line for line in err.splitlines() if "model.backbone.pretrained" in line]
    assert len(lines) == 1, err
    want = (f"model.backbone.pretrained: the folder {folder!r} does not exist; point it at" if case == "missing" else
            f"model.backbone.pretrained: {folder!r}/config.json names model_type 'vit_from_the_future', which "
            "transformers")
    assert want in lines[0], err
    assert "config.json" not in lines[0] if case == "missing" else "pip install --upgrade" not in err
    assert "Traceback" not in err
