"""How many times each strategy all-reduces the gradients per step, counted with a DDP comm hook."""

import json
import os

import pytest
import torch.multiprocessing as mp

from .conftest import TINY, free_port

STRATEGIES = ["combined", "feature_leaf", "detach", "accumulate", "find_unused", "placeholder", "task_grads"]
EXPECTED = {"combined": 1, "feature_leaf": 1, "detach": 1, "accumulate": 1, "find_unused": 2, "placeholder": 2,
            "task_grads": 1}


def _worker(rank, port, out_dir):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import mtl.strategies.task_grads as task_grads
    from mtl import dist
    from mtl.evaluate import to_device
    from mtl.step import train_step
    from mtl.trainer import Trainer
    from mtl.validate import load_run_config

    torch.set_num_threads(1)
    results = {}
    for name in STRATEGIES:
        cfg = load_run_config(TINY, [f"output_dir={out_dir}/{name}", "data.batch_size=4", f"ddp.strategy={name}",
                                     "trainer.progress=false"])
        trainer = Trainer(cfg, dist.init_distributed(cfg))
        counts = {"rounds": 0, "bytes": 0, "manual": 0}

        def hook(state, bucket):
            counts["rounds"] += bucket.index() == 0
            counts["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(None, bucket)

        trainer.model.register_comm_hook(None, hook)
        original = task_grads.all_reduce_mean

        def counting(t):
            counts["manual"] += 1
            counts["bytes"] += t.numel() * t.element_size()
            return original(t)

        task_grads.all_reduce_mean = counting
        batches = trainer.batches()
        per_step = []
        for _ in range(3):
            before = dict(counts)
            train_step(trainer, to_device(next(batches)[1], trainer.device))
            trainer.step += 1
            per_step.append({k: counts[k] - before[k] for k in counts})
        task_grads.all_reduce_mean = original
        trainer.close()
        results[name] = per_step
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy()


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("counts")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    with open(out / "rank0.json") as f0, open(out / "rank1.json") as f1:
        r0, r1 = json.load(f0), json.load(f1)
    assert r0 == r1
    return r0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_allreduces_per_step(counts, strategy):
    for step in counts[strategy]:  # every step, including the first (before DDP rebuilds its buckets)
        assert step["rounds"] + step["manual"] == EXPECTED[strategy], (strategy, step)
    if strategy == "task_grads":  # all by hand, in one coalesced collective; DDP reduces nothing itself
        assert all(s["rounds"] == 0 and s["manual"] == 1 for s in counts[strategy])


@pytest.mark.slow
def test_bytes_per_step_follow_the_rounds(counts):
    one = counts["combined"][-1]["bytes"]
    assert counts["feature_leaf"][-1]["bytes"] == one
    assert counts["find_unused"][-1]["bytes"] == 2 * one
    assert counts["placeholder"][-1]["bytes"] == 2 * one
    assert counts["task_grads"][-1]["bytes"] > one  # K rows of the shared gradient + the heads
