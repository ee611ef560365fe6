"""``data.source: hf`` in real runs (slow tier): 2 processes x batch B == 1 process x batch 2B on an HF data set
(the parity harness of tests/test_strategies_ddp.py), and a run SIGKILLed part-way and resumed ends bitwise equal
to the uninterrupted run (the resume harness of tests/test_reliability.py), its rows read by loader workers."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from .conftest import TINY, parity_worker, run_train, spawn_parity_runs
from .hf_data import CLASSES, save_dict
from .resume_check import check_resume, snapshot
from .test_reliability import FAST, kill_job, model_bytes, start, wait_for_step

pytest.importorskip("datasets")

B, STEPS, TOL = 4, 3, 1e-5
COMMON = ["optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0", "optim.warmup_steps=0", "trainer.max_steps=3",
          "trainer.eval_every=3", "trainer.eval_max_batches=1", "checkpoint.every_steps=0", "data.image_size=16",
          "ddp.strategy=feature_leaf", "trainer.progress=false", "ddp.timeout_s=60"]


def _hf_runs(path: str, world: int, out_dir: str) -> dict:
    """One rank of two (batch B) or the single process (batch 2B, and B alone: the bar is not trivial)."""
    from mtl.run.trainer import Trainer

    results = {}
    for batch in ([B] if world > 1 else [2 * B, B]):
        trainer = Trainer.from_config(TINY, [*COMMON, "data.source=hf", f"data.hf.path={path}",
                                             f"output_dir={os.path.join(out_dir, f'w{world}-{batch}')}",
                                             f"data.batch_size={batch}"])
        assert trainer.dist.world_size == world
        trainer.bare.train()
        for _ in range(STEPS):
            trainer.step_once()
        results[batch] = {k: v.detach().clone() for k, v in trainer.bare.state_dict().items() if v.is_floating_point()}
        trainer.close()
    return results


@pytest.mark.slow
def test_two_processes_equal_one_process_on_an_hf_dataset(tmp_path_factory):
    path = save_dict(tmp_path_factory.mktemp("hfparity") / "ds")
    worker = functools.partial(parity_worker, functools.partial(_hf_runs, path))
    runs = spawn_parity_runs(worker, tmp_path_factory, "hf_ddp", 300, "hf DDP")
    got, other, ref = runs["rank0"][B], runs["rank1"][B], runs["single"][2 * B]
    assert all(torch.equal(got[k], other[k]) for k in got), "the two ranks' replicas differ"
    rel = lambda a, b: max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)  # noqa: E731
    assert rel(ref, got) <= TOL
    assert rel(ref, runs["single"][B]) > 1e-3  # one process on half the batch misses the bar


@pytest.mark.slow
def test_sigkill_then_resume_on_an_hf_dataset_is_bitwise_identical(tmp_path):
    """Loader workers (data.num_workers=2) read the memory-mapped rows; a caption list per image (one per epoch)
    and augmentation (drawn from seed, epoch and index) make the data order's every part count."""
    path = save_dict(tmp_path / "ds", train=40)
    args = ["--config", TINY, "trainer.max_steps=10", "model.decoder.dropout=0.1", *FAST, "data.source=hf",
            f"data.hf.path={path}", "data.image_size=16", "data.batch_size=8", "data.num_workers=2",
            "data.augment.hflip=true"]
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"])
    proc = start([*args, f"output_dir={cut}"])
    wait_for_step(proc, cut, 5)  # past the step-4 checkpoint (mid-epoch: 5 batches an epoch), before step 8's
    kill_job(proc)
    before = snapshot(cut)
    assert 0 < before.step < 10
    run_train([*args, f"output_dir={cut}"])
    check_resume(cut, before, last_step=10)
    assert model_bytes(ref, 10) == model_bytes(cut, 10)
    with open(os.path.join(ref, "class_names.json")) as f:
        assert json.load(f) == CLASSES  # the ClassLabel's names, as the other sources write theirs


@pytest.mark.slow
def test_bad_hf_input_exits_2_with_one_message_and_writes_nothing(tmp_path):
    path = save_dict(tmp_path / "ds", train=12, val=4)
    out = tmp_path / "run"
    proc = run_train(["--config", TINY, "data.source=hf", f"data.hf.path={path}", "data.hf.caption_column=text",
                      f"output_dir={out}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.hf.caption_column: split 'train' of" in proc.stderr and "no column 'text'" in proc.stderr
    assert not out.exists()
