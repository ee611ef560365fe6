"""The ``hf_vision`` backbone (mtl/models/backbones/hf_vision.py): a transformers vision model from a local folder,
its token features through the heads, the folder's image processor, other image sizes, bad folders, and the step
strategies and the features gradient source on tokens. Tiny random folders (scripts/make_tiny_pretrained.py) in tmp."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

import train
from mtl.errors import ConfigError
from mtl.models.backbones.hf_vision import HFVisionBackbone

from .conftest import ROOT, spawn_parity_runs
from .pretrained_folders import local_pretrained, tiny_pretrained

VIT_GPT2 = os.path.join(ROOT, "configs", "vit_gpt2.yaml")
SMALL = ["data.batch_size=4", "data.eval_batch_size=4", "data.synthetic.train_size=8", "data.synthetic.val_size=4",
         "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_max_batches=1", "trainer.num_samples=0",
         "checkpoint.every_steps=2", "trainer.progress=false", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny ViT, DINOv2 and GPT-2 folders, and the overrides pointing configs/vit_gpt2.yaml at them."""
    from mtl.config.schema import load_config

    out = tmp_path_factory.mktemp("pretrained")
    return str(out), local_pretrained(load_config(VIT_GPT2), out)


def backbone_cfg(folder: str, image_size: int = 32, key: str = "pretrained"):
    other = {"pretrained": None, "config": None, key: folder}
    return OmegaConf.create({"model": {"backbone": {"name": "hf_vision", **other}}, "data": {"image_size": image_size}})


def _quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_features_are_the_models_own_last_hidden_state(folders, kind):
    from transformers import AutoModel

    _quiet()
    root, _ = folders
    folder = os.path.join(root, kind) if kind != "dinov2" else tiny_pretrained().write_dinov2(os.path.join(root, kind))
    backbone = HFVisionBackbone.build(backbone_cfg(folder)).eval()
    reference = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    x = torch.randn(2, 3, 32, 32)
    got = backbone(x)
    assert torch.equal(got, reference(pixel_values=x).last_hidden_state)
    assert got.shape == (2, 1 + 16, 64) and backbone.feature_shape(backbone_cfg(folder)) == (17, 64)
    assert backbone.pool == "cls"
    names = [n for n, _ in backbone.blocks()]
    assert len(names) == 2 and all(n.startswith("model.") for n in names)
    assert backbone.get_submodule(names[0]) is backbone.blocks()[0][1]
    # config: DIR gives random weights of the same shape
    random = HFVisionBackbone.build(backbone_cfg(folder, key="config"))
    assert [k for k in random.state_dict()] == [k for k in backbone.state_dict()]
    key = next(k for k, v in backbone.state_dict().items() if k.startswith(names[0]) and v.dim() == 2)
    assert not torch.equal(random.state_dict()[key], backbone.state_dict()[key])


def test_every_family_gives_tokens_with_its_pool_and_a_gradient_for_every_trainable_parameter(tmp_path):
    """CLIP (a full folder: its vision tower), SigLIP, Swin, ConvNeXt (a map, flattened), DeiT: the pool each uses,
    and no trainable parameter without a gradient (an unused pooler is frozen), which DDP requires."""
    from transformers import (
        CLIPConfig,
        CLIPModel,
        ConvNextConfig,
        ConvNextModel,
        DeiTConfig,
        DeiTModel,
        SiglipConfig,
        SiglipModel,
        SwinConfig,
        SwinModel,
    )

    _quiet()
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                 patch_size=8)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    models = {"clip": CLIPModel(CLIPConfig(vision_config=small, text_config=text)),
              "siglip": SiglipModel(SiglipConfig(vision_config=small, text_config=text)),
              "swin": SwinModel(SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                           window_size=4)),
              "convnext": ConvNextModel(ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
              "deit": DeiTModel(DeiTConfig(**small))}
    want = {"clip": ("CLIPVisionModel", "cls", (17, 32)), "siglip": ("SiglipVisionModel", "mean", (16, 32)),
            "swin": ("SwinModel", "mean", (16, 32)), "convnext": ("ConvNextModel", "mean", (16, 32)),
            "deit": ("DeiTModel", "cls", (18, 32))}
    frozen = {}
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
        b = HFVisionBackbone.build(backbone_cfg(str(tmp_path / name)))
        y = b(torch.randn(2, 3, 32, 32))
        assert (type(b.model).__name__, b.pool, tuple(y.shape[1:])) == want[name]
        assert len(b.blocks()) == 2
        y.sum().backward()
        assert [n for n, p in b.named_parameters() if p.requires_grad and p.grad is None] == [], name
        frozen[name] = b.frozen_unused
    assert frozen["clip"] == ["model.post_layernorm.weight", "model.post_layernorm.bias"]  # CLIP's pooler's norm
    assert frozen["convnext"] == ["model.layernorm.weight", "model.layernorm.bias"]


def test_the_processor_settings_are_used_unless_overridden(folders, tmp_path):
    from mtl.data.images import IMAGENET_MEAN, IMAGENET_STD, image_normalization, normalization_text

    root, _ = folders
    folder = tmp_path / "vit"
    tiny_pretrained().write_vit(str(folder))
    p = json.loads((folder / "preprocessor_config.json").read_text())
    p["image_mean"], p["image_std"] = [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]
    (folder / "preprocessor_config.json").write_text(json.dumps(p))
    cfg = OmegaConf.merge(backbone_cfg(str(folder)), {"data": {"normalize": "auto"}, "model": {"backbone": {
        "weights": None}}})
    assert image_normalization(cfg) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    text = normalization_text(cfg)
    assert "mean (0.1, 0.2, 0.3) std (0.4, 0.5, 0.6)" in text and "preprocessor_config.json" in text
    assert "the model folder's processor: 32" in text
    cfg.data.normalize = "imagenet"
    assert image_normalization(cfg) == (IMAGENET_MEAN, IMAGENET_STD) and "data.normalize=imagenet" in \
        normalization_text(cfg)
    cfg.data.normalize = "none"
    assert image_normalization(cfg) is None


def test_another_image_size_interpolates_where_the_model_can_and_is_refused_where_not(folders, tmp_path):
    from transformers import AutoModel, LevitConfig, LevitModel

    _quiet()
    root, _ = folders
    vit = os.path.join(root, "vit")
    b = HFVisionBackbone.build(backbone_cfg(vit, image_size=48)).eval()
    x = torch.randn(1, 3, 48, 48)
    want = AutoModel.from_pretrained(vit, local_files_only=True).eval()(pixel_values=x, interpolate_pos_encoding=True)
    assert b.interpolate and torch.equal(b(x), want.last_hidden_state) and b(x).shape == (1, 1 + 36, 64)
    # LeViT has fixed attention biases per position and no interpolation: refused by name at another size
    LevitModel(LevitConfig(image_size=32, patch_size=16, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                           depths=[1, 1, 1], key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2])
               ).save_pretrained(tmp_path / "levit")
    HFVisionBackbone.build(backbone_cfg(str(tmp_path / "levit"), image_size=32))  # its own size: fine
    with pytest.raises(ConfigError) as e:
        HFVisionBackbone.build(backbone_cfg(str(tmp_path / "levit"), image_size=48))
    assert "data.image_size: 48" in str(e.value) and "(32)" in str(e.value) and "set data.image_size: 32" in str(e.value)


@pytest.mark.parametrize("bad", ["gpt2", "both"])
def test_a_folder_that_is_not_a_vision_model_is_refused_and_nothing_is_written(folders, tmp_path, capsys, bad):
    root, overrides = folders
    out = tmp_path / "run"
    wrong = ([f"model.backbone.pretrained={os.path.join(root, 'gpt2')}"] if bad == "gpt2"
             else [f"model.backbone.config={os.path.join(root, 'vit')}"])
    code = train.main(["--config", VIT_GPT2, *overrides, *SMALL, *wrong, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "model.backbone.pretrained" in err and "Traceback" not in err
    assert ("holds a 'gpt2' model, not a vision model" in err) if bad == "gpt2" else ("exactly one of them" in err)


def test_the_caption_memory_is_the_tokens_projected_only_where_the_widths_differ(folders):
    from mtl.tasks.base import BuildInfo
    from mtl.tasks.captioning import CaptioningHead

    root, overrides = folders
    from mtl.data.tokenizer import CaptionTokenizer
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(VIT_GPT2, overrides)
    tok = CaptionTokenizer.load(os.path.join(root, "gpt2"))

    def head(shape):
        return CaptioningHead(BuildInfo(cfg=cfg, feature_channels=shape[-1] if len(shape) == 2 else shape[0],
                                        feature_hw=tuple(shape[1:]) if len(shape) == 3 else (), num_classes=2,
                                        class_names=["a", "b"], tokenizer=tok, feature_shape=shape, pool="cls"))

    same, other, cnn = head((17, 64)), head((17, 48)), head((128, 4, 4))
    assert isinstance(same.proj, torch.nn.Identity) and not hasattr(same, "pos")
    assert isinstance(other.proj, torch.nn.Linear) and other.proj.in_features == 48 and not hasattr(other, "pos")
    tokens = torch.randn(2, 17, 64)
    assert torch.equal(same.memory(tokens), tokens)
    # a feature map keeps its projection and learned positions: the state dict of existing checkpoints
    assert {"proj.weight", "proj.bias", "pos"} <= set(cnn.state_dict()) and cnn.pos.shape == (16, 64)
    assert not any(k.startswith(("proj.", "pos")) for k in same.state_dict())


@pytest.fixture(scope="module")
def trainers(folders, tmp_path_factory):
    """Single-process trainers on the tiny ViT + GPT-2: equal weighting, and MGDA on the features source."""
    from mtl.run.trainer import Trainer

    _, overrides = folders
    made = {}
    for name, extra in (("equal", []), ("features", ["weighting.method=mgda", "weighting.source=features"])):
        made[name] = Trainer.from_config(VIT_GPT2, [*overrides, *SMALL, *extra, "optim.name=sgd", "optim.lr=0.05",
                                                    f"output_dir={tmp_path_factory.mktemp(name)}"])
    yield made
    for t in made.values():
        t.close()


def test_one_step_of_cls_and_gen_on_tokens_under_each_strategy(trainers):
    """Every exact strategy gives the combined loss's gradient on token features; detach trains the backbone on
    its owner's loss alone."""
    from mtl.parallel.dist import all_reduce_sum
    from mtl.run.step import StepInputs
    from mtl.strategies import strategy_types

    from .test_strategies_ddp import STRATEGIES

    tr = trainers["equal"]
    assert tr.bare.backbone.name == "hf_vision" and tr.bare.backbone.pool == "cls"
    batch = dict(next(tr.batches())[1])
    for head in tr.bare.heads.values():
        head.prepare(batch, all_reduce_sum)
    grads = {}
    for strategy in STRATEGIES:
        tr.bare.zero_grad(set_to_none=True)
        w = type(tr.weighting)(tr.cfg, tr.tasks)
        strategy_types()[strategy](tr.cfg).forward_backward(StepInputs(
            model=tr.model, batch=dict(batch), tasks=tr.tasks, weigh=w.weigh, scale=lambda x: x, **w.grad_hooks()))
        grads[strategy] = {n: p.grad.clone() for n, p in tr.bare.named_parameters() if p.grad is not None}
    ref = grads["combined"]
    assert any(n.startswith("backbone.model.") for n in ref) and any(n.startswith("heads.gen.") for n in ref)
    assert all(torch.isfinite(g).all() for g in ref.values())
    scale = max(float(g.abs().max()) for g in ref.values())
    for strategy in STRATEGIES:
        if strategy_types()[strategy].changes_objective:
            assert any(not torch.allclose(grads[strategy][n], ref[n], rtol=1e-3, atol=1e-7)
                       for n in ref if n.startswith("backbone."))
            continue
        assert set(grads[strategy]) == set(ref), strategy
        # 1e-5 of each tensor's largest entry, plus 1e-6 of the largest gradient: a gradient that is 0 in exact
        # arithmetic (attention key biases: softmax ignores a shift) is rounding noise in any summation order
        for n, g in ref.items():
            bar = 1e-5 * float(g.abs().max()) + 1e-6 * scale
            assert float((grads[strategy][n] - g).abs().max()) <= bar, (strategy, n)


def test_the_features_source_on_tokens_is_the_weighted_sum_of_the_token_gradients(trainers):
    from .test_gradient_source import _step_grads

    w, got_shared, want_shared, got_heads, want_heads = _step_grads(trainers["features"], "feature_leaf", "features")
    assert (w - w.mean()).abs().max() > 1e-3 * w.abs().max()  # weights that are not all equal: a real test
    for got, want in zip(got_shared, want_shared):
        torch.testing.assert_close(got, want.reshape(-1), rtol=1e-5, atol=1e-9)


def test_the_doctor_reads_token_features(folders):
    from mtl.setup.checks import load_run_config
    from mtl.tools.doctor import examine

    _, overrides = folders
    report = examine(load_run_config(VIT_GPT2, [*overrides, *SMALL]), batches=2)
    assert report["params"]["shared"] > 0 and report["cosine"]["cls/gen"]["batches"] == 2
    assert all(v == v for v in report["grad_norms"].values())  # finite, not NaN
    assert any(row for row in json.dumps(report["reach"]).split("backbone")[1:])


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_a_model_folder_needs_no_pretrained_folder(folders, tmp_path, capsys):
    """The checkpoint carries backbone/config.json and the processor: predict and export work with the ViT folder
    gone, with the same normalisation and the same predictions."""
    import shutil

    from mtl.inference import export_model, load_model

    root, _ = folders
    vit = tmp_path / "vit"
    shutil.copytree(os.path.join(root, "vit"), vit)
    p = json.loads((vit / "preprocessor_config.json").read_text())
    p["image_mean"] = [0.2, 0.3, 0.4]
    (vit / "preprocessor_config.json").write_text(json.dumps(p))
    out = tmp_path / "run"
    _, overrides = folders
    assert train.main(["--config", VIT_GPT2, *overrides, *SMALL, f"model.backbone.pretrained={vit}",
                       f"output_dir={out}"]) == 0
    assert "mean (0.2, 0.3, 0.4) std (0.5, 0.5, 0.5)" in capsys.readouterr().out
    ckpt = out / "checkpoints" / "step_2"
    image = torch.rand(1, 3, 32, 32)
    before = load_model(str(ckpt)).predict(image)
    shutil.rmtree(vit)
    predictor = load_model(str(ckpt))
    assert predictor.normalization == ((0.2, 0.3, 0.4), (0.5, 0.5, 0.5))
    assert predictor.predict(image) == before
    exported = export_model(str(ckpt), str(tmp_path / "export"))
    assert sorted(os.listdir(os.path.join(exported, "backbone"))) == ["config.json", "preprocessor_config.json"]
    assert load_model(exported).predict(image) == before


# ------------------------------------------------------------------ DDP: 2 processes == 1 process


@pytest.fixture(scope="module")
def ddp_runs(folders, tmp_path_factory):
    from .test_strategies_ddp import DEADLINE_S, _runs, parity_worker

    _, overrides = folders
    run = functools.partial(_runs, config=VIT_GPT2, extra=[*overrides, "data.synthetic.train_size=16",
                                                           "data.synthetic.val_size=4", "trainer.num_samples=0"])
    return spawn_parity_runs(functools.partial(parity_worker, run), tmp_path_factory, "hf_vision_ddp", DEADLINE_S,
                             "hf_vision DDP")


@pytest.mark.slow
def test_two_processes_equal_one_process_with_hf_vision_for_every_strategy(ddp_runs):
    from .test_strategies_ddp import assert_every_strategy_matches

    assert_every_strategy_matches(ddp_runs, "backbone.model.")


def test_an_image_size_the_model_cannot_take_through_train_exits_2_and_writes_nothing(folders, tmp_path, capsys):
    """LeViT (no position-embedding interpolation) at another size: one message naming data.image_size and the fix."""
    from transformers import LevitConfig, LevitModel

    _quiet()
    _, overrides = folders
    LevitModel(LevitConfig(image_size=32, patch_size=16, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
                           depths=[1, 1, 1], key_dim=[8, 8, 8], mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2])
               ).save_pretrained(tmp_path / "levit")
    out = tmp_path / "run"
    code = train.main(["--config", VIT_GPT2, *overrides, *SMALL, f"model.backbone.pretrained={tmp_path / 'levit'}",
                       "data.image_size=48", "data.normalize=imagenet", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "Traceback" not in err, err
    assert "data.image_size: 48" in err and "set data.image_size: 32" in err
