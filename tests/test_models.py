"""Model pieces: backbone shapes and norms, the decoder interface and generate(), the multi-task forward."""

import pytest
import torch

from mtl.data.tokenizer import train_tokenizer
from mtl.errors import ConfigError
from mtl.models.backbones.torchvision_cnn import build_torchvision_backbone as build_backbone
from mtl.models.decoder import CaptionDecoder
from mtl.setup.build import build_model
from mtl.setup.checks import load_run_config

from .conftest import TINY


@pytest.mark.parametrize("name, stages, channels", [("resnet18", 2, 128), ("resnet18", 4, 512),
                                                    ("resnet50", 3, 1024), ("convnext_tiny", 2, 192)])
def test_backbone_feature_map(name, stages, channels):
    torch.manual_seed(0)
    net = build_backbone(name, None, "group", stages)
    out = net(torch.randn(2, 3, 64, 64))
    assert out.shape[:2] == (2, channels) and net.out_channels == channels


def test_norm_conversion_is_rank_independent():
    from torchvision.ops import FrozenBatchNorm2d

    for norm, kind in (("group", torch.nn.GroupNorm), ("frozen", FrozenBatchNorm2d), ("sync", torch.nn.SyncBatchNorm)):
        net = build_backbone("resnet18", None, norm, 2)
        assert not any(type(m) is torch.nn.BatchNorm2d for m in net.modules())
        assert any(isinstance(m, kind) for m in net.modules())
    # group norm: a sample's features do not depend on the rest of the batch (unlike BatchNorm)
    net = build_backbone("resnet18", None, "group", 2).train()
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(net(x)[:1], net(x[:1]), rtol=1e-5, atol=1e-5)


def test_backbone_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.backbone.name"):
        build_backbone("resnet9", None)
    with pytest.raises(ConfigError, match="model.backbone.weights.*known"):
        build_backbone("resnet18", "NOT_A_WEIGHTS_NAME")
    with pytest.raises(ConfigError, match="does not exist"):
        build_backbone("resnet18", str(tmp_path / "missing.pth"))


def test_backbone_loads_a_local_weights_file(tmp_path):
    import torchvision

    torch.manual_seed(1)
    full = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(full.state_dict(), path)
    net = build_backbone("resnet18", str(path), "batch", 4)
    torch.testing.assert_close(net.stem[0].weight, full.conv1.weight)
    torch.save({"junk": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ConfigError, match="does not fit"):
        build_backbone("resnet18", str(tmp_path / "bad.pth"))


def _decoder():
    torch.manual_seed(0)
    return CaptionDecoder(vocab_size=20, bos_id=1, eos_id=2, pad_id=0, n_layer=1, n_embd=16, n_head=2,
                          dropout=0.0, max_positions=16).eval()


def test_generate_matches_a_hand_written_greedy_loop():
    dec = _decoder()
    memory = torch.randn(3, 5, 16)
    got = dec.generate(memory, max_new_tokens=6)
    for b in range(3):
        ids = torch.tensor([[1]])
        out = []
        for _ in range(6):
            nxt = int(dec(ids, torch.ones_like(ids), memory[b:b + 1])[0, -1].argmax())
            if nxt == 2:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert got[b] == out
    beams = dec.generate(memory, max_new_tokens=6, num_beams=3)
    assert len(beams) == 3 and all(len(r) <= 6 and 2 not in r for r in beams)


def test_decoder_reads_the_memory():
    dec = _decoder()
    ids = torch.tensor([[1, 5, 6]])
    a = dec(ids, torch.ones_like(ids), torch.zeros(1, 5, 16))
    b = dec(ids, torch.ones_like(ids), torch.randn(1, 5, 16))
    assert a.shape == (1, 3, 20) and not torch.allclose(a, b)  # cross-attention is wired in


def test_multitask_forward_modes():
    cfg = load_run_config(TINY)
    tok = train_tokenizer(["one small red object in the centre", "two large blue objects"], 64)
    model = build_model(cfg, 4, ["a", "b", "c", "d"], tok)
    from .conftest import make_collate

    items = [{"image": torch.rand(3, 32, 32), "label": i % 4, "captions": ["two large blue objects"], "count": 2,
              "index": i} for i in range(3)]
    batch = make_collate(tok, 10, tasks=cfg.tasks)(items)
    out = model(batch)
    assert set(out["losses"]) == {"cls", "gen"} and all(v.ndim == 0 for v in out["losses"].values())
    assert out["features"].shape[:2] == (3, 128) and out["leaf"] is None
    only = model(batch, tasks=["gen"])["losses"]
    assert list(only) == ["gen"]
    leafy = model(batch, feature_leaf=True)
    assert leafy["leaf"].is_leaf and leafy["leaf"].requires_grad
    torch.testing.assert_close(leafy["losses"]["cls"], out["losses"]["cls"])
    # detach: the gen loss does not reach the backbone
    det = model(batch, detach=["gen"])["losses"]["gen"]
    grads = torch.autograd.grad(det, list(model.backbone.parameters()), allow_unused=True)
    assert all(g is None for g in grads)


def test_a_poisoned_loss_comes_from_a_hook_installed_only_with_trainer_poison():
    """trainer.poison (the reliability tests' fault) is a forward hook of mtl/run/faults.py, not a branch of the model."""
    from mtl.run.faults import poison

    from .conftest import make_collate

    tok = train_tokenizer(["one small red object in the centre", "two large blue objects"], 64)
    items = [{"image": torch.rand(3, 32, 32), "label": i % 4, "captions": ["two large blue objects"], "count": 2,
              "index": i} for i in range(3)]
    for spec in (None, "3:gen:*"):
        cfg = load_run_config(TINY, [] if spec is None else [f"trainer.poison={spec}"])
        model = build_model(cfg, 4, ["a", "b", "c", "d"], tok)
        batch = make_collate(tok, 10, tasks=cfg.tasks)(items)
        poison(batch, "3:gen:*", 3, 0)  # what the trainer does at step 3: the batch names the task
        assert batch["poison"] == "gen"
        losses = model(batch)["losses"]
        assert torch.isfinite(losses["cls"])
        assert torch.isfinite(losses["gen"]) == (spec is None)  # NaN only where the hook was installed
        assert bool(model._forward_hooks) == (spec is not None)
