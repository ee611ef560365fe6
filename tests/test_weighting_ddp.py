"""Every weighting method, proven under DDP: 2 processes x batch B == 1 process x batch 2B, after 3 steps.

In-process (no train.py): ONE spawn of 2 gloo workers runs every method in sequence, building a
``Trainer`` and stepping it with ``train_step``; the 1-process reference runs every method in one more
spawned process without RANK in its environment (so ``init_distributed`` starts no process group).
fp32, GroupNorm (rank-independent), SGD (see tests/test_strategies_ddp.py for why not Adam). Gradient-level
methods run under ``ddp.strategy=task_grads``; loss-level methods under ``feature_leaf``.

The parity holds only if each task's gradient is averaged over the ranks *before* the method combines
them. ``test_combining_before_averaging_misses_the_bar`` shows the 1e-5 bar would catch the opposite order:
it takes the two ranks' LOCAL task-gradient matrices of a real 2-rank step and combines them per rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from mtl.weighting import weighting_types

from .conftest import TINY, free_port

B = 4
STEPS = 3
TOL = 1e-5
SEED = int(os.environ.get("WDDP_SEED", "0"))
METHODS = sorted(weighting_types())
EXTRA = {"static": ["weighting.weights.cls=1.0", "weighting.weights.gen=0.5"]}
CAPTURE = "pcgrad"  # the method whose step-0 task-gradient matrices are kept for the negative control
DEADLINE_S = 240  # every spawned process is killed after this (the collectives time out after 60 s)


def overrides(method: str, out_dir: str, batch: int) -> list[str]:
    level = weighting_types()[method].level
    return [f"output_dir={out_dir}", f"seed={SEED}", f"data.batch_size={batch}", "optim.name=sgd", "optim.lr=0.05",
            "optim.weight_decay=0", "optim.warmup_steps=0", "trainer.progress=false", "ddp.timeout_s=60",
            f"ddp.strategy={'task_grads' if level == 'grad' else 'feature_leaf'}", f"weighting.method={method}",
            *EXTRA.get(method, [])]


def _worker(index, port, out_dir):
    """index 0 and 1: the two ranks; index 2: the single process (no RANK: no process group)."""
    world = 2 if index < 2 else 1
    env = {"OMP_NUM_THREADS": "1"}
    if world > 1:
        env.update({"RANK": str(index), "WORLD_SIZE": str(world), "LOCAL_RANK": str(index),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    else:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key, None)
    os.environ.update(env)
    import time

    import torch

    import mtl.strategies.task_grads as task_grads
    from mtl import dist
    from mtl.evaluate import to_device
    from mtl.step import train_step
    from mtl.trainer import Trainer
    from mtl.validate import load_run_config

    torch.set_num_threads(1)
    label = f"rank{index}" if world > 1 else "single"
    results, captured = {}, {}
    original = task_grads.all_reduce_mean
    try:
        for method in METHODS:
            tic = time.time()
            cfg = load_run_config(TINY, overrides(method, os.path.join(out_dir, f"world{world}", method), B * 2 // world))
            trainer = Trainer(cfg, dist.init_distributed(cfg))
            assert trainer.dist.world_size == world and trainer.dist.distributed == (world > 1)
            if method == CAPTURE:
                def capture(buf, _k=len(trainer.tasks)):
                    if "local" not in captured:  # step 0: [G (K x P, this rank's own), head grads, losses]
                        captured["local"] = buf.detach().clone()
                    out = original(buf)
                    captured.setdefault("averaged", out.detach().clone())
                    return out

                task_grads.all_reduce_mean = capture
            tb = time.time()
            batches = trainer.batches()
            trainer.bare.train()
            for _ in range(STEPS):
                train_step(trainer, to_device(next(batches)[1], trainer.device))
                trainer.step += 1
            task_grads.all_reduce_mean = original
            shared = sum(p.numel() for p in trainer.bare.backbone.parameters() if p.requires_grad)
            results[method] = {
                "model": {k: v.detach().clone() for k, v in trainer.bare.state_dict().items()},
                "weighting": trainer.weighting.state_dict(),
                "weights": trainer.weighting.weights(),
                "shared": shared,
            }
            trainer.close()
            print(f"TIMING {label} {method} build {tb - tic:.2f} steps {time.time() - tb:.2f}", flush=True)
        torch.save({"results": results, "captured": captured}, os.path.join(out_dir, f"{label}.pt"))
    finally:
        task_grads.all_reduce_mean = original
        dist.destroy()


def _spawn(out_dir):
    """The two ranks and the single process, side by side (the ranks often wait for each other)."""
    deadline = time.monotonic() + DEADLINE_S
    ctx = mp.start_processes(_worker, args=(free_port(), out_dir), nprocs=3, start_method="spawn", join=False)
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("weighting_ddp")
    t0 = time.monotonic()
    _spawn(str(out))
    print(f"TIMING spawn {time.monotonic() - t0:.1f}")
    return {label: torch.load(out / f"{label}.pt", weights_only=False) for label in ("rank0", "rank1", "single")}


def _leaves(obj, prefix=""):
    """(key, float64 tensor) for every number in a (nested) state: tensors, floats, lists, dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj.detach().double().reshape(-1)
    elif isinstance(obj, (int, float, bool)) or (isinstance(obj, (list, tuple)) and obj):
        yield prefix, torch.as_tensor(obj, dtype=torch.float64).reshape(-1)
    elif obj is not None and not (isinstance(obj, (list, tuple)) and not obj):
        raise TypeError(f"{prefix}: cannot compare {type(obj).__name__}")


def max_rel_diff(a, b) -> float:
    """max over leaves of max|a - b| / max|a| (a leaf with max|a| = 0 must match to 1e-12 absolute)."""
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys(), sorted(set(la) ^ set(lb))
    worst = 0.0
    for k, x in la.items():
        y = lb[k]
        assert x.shape == y.shape, k
        if x.numel():
            worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp(min=1e-12)))
    return worst


def bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_two_processes_equal_one_process_on_the_global_batch(runs, method):
    r0, r1, single = (runs[k]["results"][method] for k in ("rank0", "rank1", "single"))
    for part in ("model", "weighting", "weights"):  # the ranks are replicas, bit for bit
        assert bitwise_equal(r0[part], r1[part]), (method, part)
    model = max_rel_diff(single["model"], r0["model"])
    state = max_rel_diff(single["weighting"], r0["weighting"])
    weights = max_rel_diff(single["weights"], r0["weights"])
    print(f"{method}: model {model:.2e}, weighting state {state:.2e}, weights {weights:.2e}")
    assert model <= TOL and state <= TOL and weights <= TOL, (method, model, state, weights)


@pytest.mark.slow
def test_combining_before_averaging_misses_the_bar(runs):
    """PCGrad on the rank-averaged task gradients (what task_grads does) matches the 1-process run to 1e-5;
    averaging each rank's PCGrad of its LOCAL task gradients (the classic mistake) misses it by far."""
    from mtl.weighting.pcgrad import pcgrad

    k, n = 2, runs["single"]["results"][CAPTURE]["shared"]
    local = [runs[r]["captured"]["local"][: k * n].view(k, n) for r in ("rank0", "rank1")]
    averaged = runs["rank0"]["captured"]["averaged"][: k * n].view(k, n)
    reference = runs["single"]["captured"]["local"][: k * n].view(k, n)  # the global batch's task gradients

    def rel(a, b):
        return float((a - b).abs().max() / a.abs().max())

    assert rel(reference, (local[0] + local[1]) / 2) <= TOL  # the rows themselves are linear in the batch
    right = pcgrad(averaged)
    wrong = (pcgrad(local[0]) + pcgrad(local[1])) / 2
    truth = pcgrad(reference)
    # the control is only meaningful if the local gradients conflict differently from the averaged ones
    cos = [float(torch.nn.functional.cosine_similarity(g[0], g[1], dim=0)) for g in (*local, averaged)]
    print(f"cos(g_cls, g_gen): rank0 {cos[0]:+.3f}, rank1 {cos[1]:+.3f}, averaged {cos[2]:+.3f}; "
          f"right {rel(truth, right):.2e}, wrong {rel(truth, wrong):.2e}")
    assert rel(truth, right) <= TOL
    assert rel(truth, wrong) > 1e3 * TOL, cos
