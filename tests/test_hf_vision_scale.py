"""FSDP2 with an ``hf_vision`` backbone (a tiny ViT, configs/vit_gpt2.yaml, issue 33 §4): every strategy FSDP2 runs,
2 processes == 1 on the same global batch, with each ViT block and each GPT-2 block its own ``fully_shard`` unit;
a save/resume on 2 ranks bitwise; a 2-rank FSDP2 checkpoint resumed by one process within the parity bar (a ViT has
no BatchNorm and no dropout here: it reshards). ONE spawn of three workers (tests/conftest.py ``spawn_env``), the
overrides and helpers of tests/test_fsdp.py; the DDP parity with hf_vision is tests/test_hf_vision.py's.

float32 (the folders' dtype), SGD with momentum (per-parameter state that must reshard). The bar is the DDP hf_vision
test's: TOL of each tensor's largest entry, and at least 1e-7 (a ViT's attention key biases get a gradient that is 0
in exact arithmetic, so they hold rounding noise that differs in any summation order).
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from .conftest import spawn_env, spawn_parity_runs
from .test_fsdp import STRATEGIES, TOL, _full_params, _sharding_facts, overrides
from .test_hf_vision import VIT_GPT2

B = 4
STEPS = 3
DEADLINE_S = 300
DATA = ["data.synthetic.train_size=16", "data.synthetic.val_size=4", "trainer.num_samples=0",
        "checkpoint.every_steps=0", "data.num_workers=0"]


def _vit_facts(trainer) -> dict:
    """Each ViT block a ``fully_shard`` unit whose parameters are DTensor shards between passes."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    blocks = [m for _, m in trainer.bare.backbone.blocks()]
    return {"vit_blocks": len(blocks),
            "vit_blocks_are_units": [isinstance(m, FSDPModule) for m in blocks],
            "vit_block_params_sharded": [all(isinstance(p, DTensor) for p in m.parameters()) for m in blocks],
            **_sharding_facts(trainer)}


def _worker(index, port, out_dir, folders):
    world = spawn_env(index, port)
    from mtl.parallel import dist
    from mtl.run.trainer import Trainer

    torch.set_num_threads(1)
    results = {}

    def trainer(key, strategy, engine, batch, *extra):
        return Trainer.from_config(VIT_GPT2, [*folders, *DATA, *overrides(f"{out_dir}/{key}", batch, strategy, "equal",
                                                                           engine), *extra])

    def run(key, strategy, engine, batch):
        t = trainer(key, strategy, engine, batch)
        t.bare.train()
        norms = [t.step_once().grad_norm for _ in range(STEPS)]
        results[key] = {"params": _full_params(t), "grad_norms": norms,
                        "facts": _vit_facts(t) if world > 1 else {}}
        t.close()

    if world > 1:
        for strategy in STRATEGIES:
            run(f"fsdp2/{strategy}", strategy, "fsdp2", B)
        # save at step 2, two more steps; the same checkpoint resumed on 2 ranks: bitwise
        a = trainer("resume", "combined", "fsdp2", B)
        a.step_once()
        a.step_once()
        a.save()
        a.step_once()
        a.step_once()
        results["resume_end"] = _full_params(a)
        a.close()
        b = trainer("resume", "combined", "fsdp2", B, "resume=auto")
        results["resumed_at"] = b.step
        b.step_once()
        b.step_once()
        results["resumed_end"] = _full_params(b)
        b.close()
    else:
        for strategy, batch in (("combined", 2 * B), ("detach", 2 * B), ("combined", B)):
            run(f"single/{strategy}@{batch}", strategy, "ddp", batch)
        # the 2-rank FSDP2 checkpoint, resumed by one process on the same global batch
        path = f"{out_dir}/resume/checkpoints/step_2"
        deadline = time.time() + DEADLINE_S
        while not os.path.isfile(os.path.join(path, "manifest.json")):
            assert time.time() < deadline, f"{path} never appeared"
            time.sleep(0.2)
        c = trainer("reshard", "combined", "ddp", 2 * B, f"resume={path}")
        results["reshard_at"], results["reshard_notes"] = c.step, list(c.resume_notes)
        c.step_once()
        c.step_once()
        results["reshard_end"] = _full_params(c)
        c.close()
    torch.save(results, os.path.join(out_dir, f"rank{index}.pt" if world > 1 else "single.pt"))
    dist.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mtl.config.schema import load_config

    from .pretrained_folders import local_pretrained

    folders = local_pretrained(load_config(VIT_GPT2), tmp_path_factory.mktemp("pretrained"))
    return spawn_parity_runs(functools.partial(_worker, folders=folders), tmp_path_factory, "hf_vision_fsdp",
                             DEADLINE_S, "hf_vision FSDP2")


def _within_bar(ref: dict, got: dict, what) -> None:
    assert ref.keys() == got.keys()
    for k in ref:
        assert float((ref[k] - got[k]).abs().max()) <= TOL * max(float(ref[k].abs().max()), 1e-2), (what, k)


@pytest.mark.slow
def test_hf_vision_under_fsdp2_per_block_two_processes_equal_one_and_its_checkpoints_resume_and_reshard(runs):
    single = runs["single"]
    for strategy in STRATEGIES:
        got = runs["rank0"][f"fsdp2/{strategy}"]
        f = got["facts"]
        assert f["vit_blocks"] == 2 and all(f["vit_blocks_are_units"]) and all(f["vit_block_params_sharded"]), f
        assert all(f["blocks_are_units"]) and f["tied"], f  # the GPT-2 blocks too, and its tied weight stays one
        assert any(k.startswith("backbone.model.") for k in got["params"])
        ref = single[f"single/{'detach' if strategy == 'detach' else 'combined'}@{2 * B}"]
        _within_bar(ref["params"], got["params"], strategy)
        for s, r in zip(got["grad_norms"], ref["grad_norms"]):  # the global norm over both ranks' shards
            assert abs(s - r) <= 1e-5 * r, (strategy, s, r)
    # the bar is not trivial: one process on half the batch misses it, and detach is another objective
    combined = single[f"single/combined@{2 * B}"]["params"]
    for other in (f"single/combined@{B}", f"single/detach@{2 * B}"):
        assert any(float((combined[k] - single[other]["params"][k]).abs().max())
                   > 1e-3 * float(combined[k].abs().max()) for k in combined), other
    # resume on 2 ranks: bitwise; the same checkpoint on one process: within the bar, and it says it is not bitwise
    r0 = runs["rank0"]
    assert r0["resumed_at"] == 2 and all(torch.equal(r0["resume_end"][k], r0["resumed_end"][k])
                                         for k in r0["resume_end"])
    assert single["reshard_at"] == 2 and any("not bitwise" in n for n in single["reshard_notes"])
    _within_bar(r0["resume_end"], single["reshard_end"], "2 ranks (FSDP2) -> 1 process")


# ------------------------------------------------------------------ the reshard rule on each backbone kind


def _backbone(kind, tmp_path):
    from transformers import ConvNextConfig, ConvNextModel

    from mtl.models.backbones.hf_vision import HFVisionBackbone

    from .pretrained_folders import tiny_pretrained
    from .test_hf_vision import backbone_cfg

    if kind == "vit":
        return HFVisionBackbone.build(backbone_cfg(tiny_pretrained().write_vit(str(tmp_path / "vit"))))
    if kind == "convnext":
        ConvNextModel(ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)).save_pretrained(
            tmp_path / "convnext")
        return HFVisionBackbone.build(backbone_cfg(str(tmp_path / "convnext")))
    pytest.importorskip("timm")
    from mtl.models.backbones.timm_models import TimmBackbone

    from .test_timm_backbone import cfg_for

    return TimmBackbone.build(cfg_for("resnet18", norm="batch"))


@pytest.mark.slow  # seconds (builds three backbones)
@pytest.mark.parametrize("kind, exact", [("vit", True), ("convnext", True), ("timm_resnet_batchnorm", False)])
def test_the_reshard_rule_on_a_vit_a_convnext_and_a_timm_batchnorm_resnet(kind, exact, tmp_path):
    """A 2-process checkpoint resumed by 1 process on the same global batch is exact where no layer mixes the samples
    of a process's batch (or draws random numbers): a ViT (LayerNorm per token) and a ConvNeXt (LayerNorm per pixel)
    do not, and resume with a note; a timm ResNet with BatchNorm does, and is refused naming its layers and the key.
    The rule's input is checked against the model itself: in training mode, each sample's features on the first half
    of the batch equal its features on the whole batch exactly where the rule finds nothing."""
    from mtl.setup.resume import batch_statistics_layers, random_layers, reshard_problems

    from .test_reshard import V2_STATE, _checkpoint_dir, _now

    torch.manual_seed(0)
    backbone = _backbone(kind, tmp_path).train()
    x = torch.rand(6, 3, 32, 32)
    with torch.no_grad():
        mixes = not torch.allclose(backbone(x[:3]), backbone(x)[:3], rtol=1e-5, atol=1e-6)
    flagged = batch_statistics_layers(backbone)
    assert mixes == bool(flagged) == (not exact) and random_layers(backbone) == []
    problems, note = reshard_problems(_checkpoint_dir(tmp_path, 4), V2_STATE, _now(8), 1, "ddp",
                                      random_layers(backbone), flagged)
    if exact:
        assert problems == [] and "not bitwise" in note
    else:
        (why,) = problems
        assert "BatchNorm" in why and flagged[0] in why and "model.backbone.norm=group" in why and note == ""


# ------------------------------------------------------------------ SIGKILL, then resume


@pytest.mark.slow
def test_sigkill_then_resume_with_hf_vision_under_fsdp2_is_bitwise_identical(tmp_path):
    """tests/test_reliability.py's kill test on the ViT + GPT-2 (decoder dropout on: the RNG state is restored too),
    2 ranks under FSDP2 (the sharded DCP state): the whole job SIGKILLed past its step-4 checkpoint, then resumed;
    it continues from that checkpoint and ends byte for byte where the uninterrupted run ends."""
    from mtl.config.schema import load_config

    from .conftest import run_train
    from .pretrained_folders import local_pretrained
    from .resume_check import check_resume, snapshot
    from .test_reliability import FAST, kill_job, model_bytes, start, wait_for_step

    folders = local_pretrained(load_config(VIT_GPT2), tmp_path / "pretrained")
    args = ["--config", VIT_GPT2, *folders, "trainer.max_steps=12", "model.decoder.dropout=0.1", "parallel.engine=fsdp2",
            "data.batch_size=4", "data.synthetic.train_size=64", "data.synthetic.val_size=4", "trainer.num_samples=0",
            "data.num_workers=0", *FAST]
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"], nproc=2)
    proc = start([*args, f"output_dir={cut}"], nproc=2)
    wait_for_step(proc, cut, 5)  # past the step-4 checkpoint
    assert len(kill_job(proc)) >= 3  # the launcher and both workers, all gone
    before = snapshot(cut)
    assert 0 < before.step < 12  # a real resume, from before the end
    run_train([*args, f"output_dir={cut}"], nproc=2)
    check_resume(cut, before, last_step=12)
    assert model_bytes(ref, 12) == model_bytes(cut, 12)
