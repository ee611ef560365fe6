"""Per-block settings for transformer encoders (docs/scale.md): FSDP2 units per block, activation checkpointing,
layer-wise lr decay, freezing the first N blocks, regional torch.compile. In one process; 2 processes == 1 with
checkpointing, freezing and lr decay on is tests/test_fsdp.py's ``test_per_block_settings_two_processes_...``."""

from __future__ import annotations

import pytest
import torch

from mtl.errors import ConfigError
from mtl.strategies import strategy_types

from .conftest import TINY


def _vit_backbone(layers: int = 3):
    from transformers import ViTConfig, ViTModel

    from mtl.models.backbones.hf_vision import HFVisionBackbone

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8, hidden_dropout_prob=0.1)
    return HFVisionBackbone(ViTModel(config, add_pooling_layer=False))


def _tiny_model(*overrides, backbone=None):
    from mtl.data.tokenizer import train_tokenizer
    from mtl.setup.build import build_model
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(TINY, list(overrides), announce=False)
    torch.manual_seed(0)
    model = build_model(cfg, 4, list("abcd"), train_tokenizer(["a b c"], 64))
    if backbone is not None:  # a ViT in place of the ResNet (the heads read its tokens: rebuilt for them)
        import mtl.setup.build as b

        orig = b.build_backbone
        b.build_backbone = lambda cfg: backbone
        try:
            torch.manual_seed(0)
            model = build_model(cfg, 4, list("abcd"), train_tokenizer(["a b c"], 64))
        finally:
            b.build_backbone = orig
    return cfg, model


# ------------------------------------------------------------------ FSDP2 units


def test_fsdp2_shards_each_vit_block_then_what_is_left():
    from mtl.parallel.fsdp import shard_units

    _, model = _tiny_model(backbone=_vit_backbone())
    names = [n for n, _ in shard_units(model)]
    assert names[:5] == ["backbone.model.embeddings", "backbone.model.layers.0", "backbone.model.layers.1",
                         "backbone.model.layers.2", "backbone.model.layernorm"]
    assert names[5:] == ["heads.cls", "heads.gen.decoder.lm.transformer.h.0", "heads.gen"]
    units = dict(shard_units(model))
    for name, block in model.backbone.blocks():
        assert units[f"backbone.{name}"] is block
    owned = [id(p) for n, m in shard_units(model) if n.startswith("backbone.") for p in m.parameters()]
    assert sorted(owned) == sorted({*owned})  # each backbone parameter in one unit
    assert {id(p) for p in model.backbone.parameters()} == set(owned)  # nothing of the backbone left to the root


# ------------------------------------------------------------------ layer-wise lr decay


def test_layer_decay_follows_maes_rule_and_freeze_takes_the_first_blocks_and_what_runs_before():
    """MAE's param_groups_lrd / BEiT: embeddings decay**(L+1), block i decay**(L-i), after the last block and the
    heads decay**0. freeze_blocks=1: the embeddings and block 0 get no gradient and are in no group."""
    from mtl.setup.build import build_optimizer
    from mtl.weighting import weighting_types

    decay = 0.5
    cfg, model = _tiny_model(f"optim.layer_decay={decay}", backbone=_vit_backbone(3))
    weighting = weighting_types()["equal"](cfg, list(cfg.tasks))
    scale = {id(p): g["lr_scale"] for g in build_optimizer(cfg, model, weighting).param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        want = (decay ** 4 if name.startswith("backbone.model.embeddings.") else
                decay ** (3 - int(name.split(".")[3])) if name.startswith("backbone.model.layers.") else 1.0)
        assert scale[id(p)] == want, name
    assert any(g["lr"] == cfg.optim.lr * decay ** 4 for g in build_optimizer(cfg, model, weighting).param_groups)

    from mtl.models.blockwise import freeze

    frozen = freeze(model, 1)
    assert frozen and all(n.startswith(("model.embeddings.", "model.layers.0.")) for n in frozen)
    assert {n for n, p in model.backbone.named_parameters() if not p.requires_grad} >= set(frozen)
    assert all(p.requires_grad for n, p in model.backbone.named_parameters() if n.startswith("model.layers.1."))
    in_groups = {id(p) for g in build_optimizer(cfg, model, weighting).param_groups for p in g["params"]}
    assert not any(id(p) in in_groups for p in model.backbone.model.embeddings.parameters())


@pytest.mark.parametrize("scheduler", ["cosine", "plateau"])
def test_the_schedulers_keep_each_groups_ratio(scheduler):
    """transformers' schedules multiply each group's own initial lr; the plateau floor is scaled per group, so a
    group reaching it keeps its ratio too."""
    from mtl.setup.build import build_optimizer, build_scheduler
    from mtl.weighting import weighting_types

    over = ["optim.layer_decay=0.5", f"optim.scheduler={scheduler}", "optim.warmup_steps=2"]
    if scheduler == "plateau":
        over += ["optim.warmup_steps=0", "optim.plateau.patience=0", "optim.plateau.factor=0.1",
                 "optim.plateau.min_lr=1e-4", "tasks=[cls]", "optim.plateau.baselines={cls_acc: 0.5}"]
    cfg, model = _tiny_model(*over)
    opt = build_optimizer(cfg, model, weighting_types()["equal"](cfg, list(cfg.tasks)))
    sched = build_scheduler(cfg, opt)
    assert len({g["lr_scale"] for g in opt.param_groups}) == 4  # stem, layer1, layer2, the rest
    for i in range(5):
        opt.step()
        sched.step()
        if scheduler == "plateau":
            sched.evaluated({"cls_acc": 0.1})  # worse every time: the rate falls to the floor
        base = opt.param_groups[-1]["lr"] / opt.param_groups[-1]["lr_scale"]
        assert base > 0
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(base * g["lr_scale"], rel=1e-12), (i, g["lr_scale"])
    if scheduler == "plateau":
        assert opt.param_groups[-1]["lr"] == pytest.approx(1e-4)  # the floor reached


def test_a_resume_restores_the_groups_exactly(tmp_path):
    from mtl.run.trainer import Trainer

    common = [f"output_dir={tmp_path}", "optim.layer_decay=0.7", "model.backbone.freeze_blocks=1",
              "trainer.max_steps=4", "trainer.progress=false"]
    a = Trainer.from_config(TINY, common)
    for _ in range(2):
        a.step_once()
    a.save()
    want = [{k: v for k, v in g.items() if k != "params"} for g in a.optimizer.param_groups]
    a.step_once()
    after = [g["lr"] for g in a.optimizer.param_groups]
    a.close()
    b = Trainer.from_config(TINY, [*common, "resume=auto"])
    assert b.step == 2
    assert [{k: v for k, v in g.items() if k != "params"} for g in b.optimizer.param_groups] == want
    assert [len(g["params"]) for g in b.optimizer.param_groups] == [len(g["params"]) for g in a.optimizer.param_groups]
    b.step_once()
    assert [g["lr"] for g in b.optimizer.param_groups] == after
    b.close()


# ------------------------------------------------------------------ activation checkpointing

SAFE = sorted(n for n, c in strategy_types().items() if not c.unsafe)


def _saved_bytes(step):
    """Bytes of the tensors autograd saves for the backward pass during ``step()`` (saved-tensor hooks)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return total[0], out


@pytest.mark.parametrize("strategy", SAFE)
def test_activation_checkpointing_gives_the_same_losses_and_weights_for_every_strategy(tmp_path, strategy):
    """One process, 2 steps of the same batches with and without ``model.activation_checkpointing`` (dropout on:
    the recomputation must replay the forward's RNG): the same losses and weights; and it saves fewer bytes."""
    from mtl.run.trainer import Trainer

    method = "pcgrad" if strategy == "task_grads" else "equal"
    common = ["trainer.progress=false", f"ddp.strategy={strategy}", f"weighting.method={method}",
              "model.decoder.dropout=0.1", "model.decoder.n_layer=2"]
    out = {}
    for ac in (False, True):
        t = Trainer.from_config(TINY, [*common, f"output_dir={tmp_path}/{ac}", f"model.activation_checkpointing={ac}"])
        batches, saved, losses = t.batches(), [], []
        for _ in range(2):
            batch = next(batches)[1]
            n, r = _saved_bytes(lambda: t.step_once(batch))
            saved.append(n)
            losses.append(r.losses)
        out[ac] = (saved, losses, {k: v.clone() for k, v in t.bare.state_dict().items()})
        t.close()
    (s0, l0, w0), (s1, l1, w1) = out[False], out[True]
    assert l1 == l0
    assert max(float((w0[k] - w1[k]).abs().max()) for k in w0) <= 1e-6
    assert s1[0] < s0[0], (s1, s0)


def test_the_per_block_keys_are_refused_where_they_cannot_apply(monkeypatch):
    from mtl.setup.checks import load_run_config

    qm9 = ["data.source=qm9", "model.backbone.name=mpnn", "tasks=[mu]"]
    for extra, says in ((["optim.layer_decay=0"], "optim.layer_decay: 0"),
                        (["optim.layer_decay=1.5"], "optim.layer_decay: 1.5"),
                        (["model.backbone.freeze_blocks=-1"], "model.backbone.freeze_blocks: -1"),
                        ([*qm9, "model.activation_checkpointing=true"], "model.activation_checkpointing: the backbone 'mpnn'"),
                        ([*qm9, "model.compile=true"], "model.compile: the backbone 'mpnn'")):
        with pytest.raises(ConfigError) as e:
            load_run_config(TINY, extra, announce=False)
        assert any(m.startswith(says) for m in e.value.errors), (says, e.value.errors)
    with pytest.raises(ConfigError, match="model.backbone.freeze_blocks: 3 is more than the 2 blocks"):
        _tiny_model("model.backbone.freeze_blocks=3")

    import shutil

    from mtl.models import blockwise

    _, model = _tiny_model()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="model.compile: torch.compile's inductor backend needs a C.. compiler"):
        blockwise.compile_blocks(model)


# ------------------------------------------------------------------ regional compilation


@pytest.mark.slow
def test_compiled_blocks_with_dropout_draw_the_eager_masks():
    """Training mode, dropout 0.1 in every block, the same seed: the compiled blocks' outputs and gradients are
    eager's (inductor's own random numbers would give other masks: a difference of the outputs' own size)."""
    from mtl.models import blockwise

    compiled_model = _tiny_model(backbone=_vit_backbone(2))[1]
    eager = _tiny_model(backbone=_vit_backbone(2))[1]
    eager.load_state_dict(compiled_model.state_dict())
    blockwise.compile_blocks(compiled_model)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = []
    for m in (eager, compiled_model):
        m.train()
        torch.manual_seed(5)
        y = m.backbone(images)
        y.square().mean().backward()
        out.append(y.detach())
    assert float((out[0] - out[1]).abs().max()) <= 1e-5 * float(out[0].abs().max())
    ga = dict(compiled_model.backbone.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in eager.backbone.parameters() if p.grad is not None)
    for n, p in eager.backbone.named_parameters():
        if p.grad is not None:
            assert float((ga[n].grad - p.grad).abs().max()) <= 1e-4 * largest, n


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_losses_and_gradients():
    """inductor with this machine's g++, one ViT + GPT-2 model, one forward and backward: losses within 1e-5 and
    gradients within 1e-4 of the largest gradient entry (inductor fuses and reorders float32 sums); the names and state dict as
    eager's, and the same graph reused in every block (one compile per block class, not per block)."""
    from mtl.models import blockwise

    compiled_model = _tiny_model(backbone=_vit_backbone(2))[1]
    eager = _tiny_model(backbone=_vit_backbone(2))[1]
    eager.load_state_dict(compiled_model.state_dict())
    names = blockwise.compile_blocks(compiled_model)
    assert names[:2] == ["backbone.model.layers.0", "backbone.model.layers.1"] and len(names) == 3
    assert list(compiled_model.state_dict()) == list(eager.state_dict())
    torch.manual_seed(1)
    images = torch.randn(2, 3, 32, 32)
    for m in (compiled_model, eager):
        m.eval()  # no dropout (with dropout: test_compiled_blocks_with_dropout_draw_the_eager_masks)
    a, b = compiled_model.backbone(images), eager.backbone(images)
    assert float((a - b).detach().abs().max()) <= 1e-5 * float(b.detach().abs().max())
    a.square().mean().backward()
    b.square().mean().backward()
    ga = dict(compiled_model.backbone.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in eager.backbone.parameters() if p.grad is not None)
    for n, p in eager.backbone.named_parameters():
        if p.grad is not None:
            assert float((ga[n].grad - p.grad).abs().max()) <= 1e-4 * largest, n
