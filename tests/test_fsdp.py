"""``ddp.engine: fsdp2``, proven: 2 processes x batch B == 1 process x batch 2B, FSDP2 == DDP, the collectives
per step, the global gradient norm over shards, and an exact save/resume; plus the config-time refusals.

ONE spawn of three workers (as tests/test_weighting_ddp.py): workers 0 and 1 are a 2-rank gloo run (batch B
each), worker 2 has no process group and runs the references on batch 2B. In each rank, one ``Trainer`` per
(strategy, method) for every strategy whose class says it runs under FSDP2 (``Strategy.fsdp2_problem()`` is
None) and the loss-level methods ``equal`` and ``gls`` (nonlinear: each task's term is divided by its
rank-averaged loss), stepped 3 times with ``Trainer.step_once``; then the same runs under DDP.

float64, GroupNorm, SGD, for the reason tests/test_weighting_ddp.py gives: in float32 a 2-rank run's other
summation order can move a ReLU pre-activation within rounding of zero across the kink, and the 1e-5 bar would
then measure rounding, not the engine. The bar is the DDP parity tests' (max over tensors of max|a - b| / max|a|
<= 1e-5).

Collectives are counted with a ``TorchDispatchMode`` that sees every c10d op the step dispatches (FSDP2's
all-gathers and reduce-scatters, ``dist.all_reduce``, DTensor's functional collectives); DDP's reducer calls
the process group from C++ and is not seen, which is why DDP's gradient all-reduces are counted with a comm
hook in tests/test_allreduce_counts.py and not here.
"""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from mtl.errors import ConfigError
from mtl.strategies import strategy_types

from .conftest import TINY, free_port, spawn_env

B = 4
STEPS = 3
TOL = 1e-5
DTYPE = torch.float64
METHODS = ["equal", "gls"]
STRATEGIES = sorted(n for n, c in strategy_types().items() if not c.unsafe and c.fsdp2_problem() is None)
DDP_TOO = ["accumulate", "feature_leaf"]  # FSDP2 == DDP directly (DDP == 1 process is tests/test_strategies_ddp.py's)
DEADLINE_S = 400


def overrides(out_dir, batch, strategy, method, engine):
    return [f"output_dir={out_dir}", f"data.batch_size={batch}", "optim.name=sgd", "optim.lr=0.05",
            "optim.weight_decay=0", "optim.warmup_steps=0", "trainer.progress=false", "ddp.timeout_s=60",
            f"ddp.strategy={strategy}", f"weighting.method={method}", f"ddp.engine={engine}", "optim.grad_clip=1.0"]


def _counting_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if "c10d" in name:
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def _full_params(trainer) -> dict:
    from mtl.fsdp import full_model_state, is_sharded

    state = full_model_state(trainer.bare) if is_sharded(trainer.bare) else trainer.bare.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _worker(index, port, out_dir):
    world = spawn_env(index, port)
    from mtl import dist
    from mtl.runtime_checks import check_replicas
    from mtl.trainer import Trainer

    torch.set_num_threads(1)
    torch.set_default_dtype(DTYPE)
    results, timing = {}, {}

    def run(key, strategy, method, engine, batch):
        tic = time.perf_counter()
        trainer = Trainer.from_config(TINY, overrides(f"{out_dir}/{key}", batch, strategy, method, engine))
        steps, batches = [], trainer.batches()
        trainer.bare.train()
        for _ in range(STEPS):
            batch = {k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v
                     for k, v in next(batches)[1].items()}
            mode = _counting_mode()
            with mode:
                r = trainer.step_once(batch)
            steps.append({"counts": dict(mode.counts), "grad_norm": r.grad_norm, "losses": r.losses,
                          "stepped": r.stepped, "stats": {k: float(v) for k, v in r.stats.items()}})
            if world > 1:
                check_replicas(trainer.bare, trainer.step)
        results[key] = {"steps": steps, "params": _full_params(trainer)}
        trainer.close()
        timing[key] = time.perf_counter() - tic
        return trainer

    if world > 1:
        for strategy in STRATEGIES:
            for method in METHODS:
                run(f"fsdp2/{strategy}/{method}", strategy, method, "fsdp2", B)
        for strategy in DDP_TOO:
            for method in METHODS:
                run(f"ddp/{strategy}/{method}", strategy, method, "ddp", B)
        results["resume"] = _resume_exactly(out_dir, world)
    else:
        for strategy in ("combined", "detach"):
            for method in METHODS:
                run(f"single/{strategy}/{method}", strategy, method, "ddp", 2 * B)
    results["timing"] = timing
    torch.save(results, os.path.join(out_dir, f"worker{index}.pt"))
    dist.destroy()


def _resume_exactly(out_dir, world):
    """FSDP2, float32, AdamW (per-parameter state: sharded): 2 steps, save, 2 more; and a resume of that
    checkpoint, 2 more. Returns whether the two ends are bitwise equal, and the checkpoint's model file keys."""
    from safetensors.torch import load_file

    from mtl.trainer import Trainer

    torch.set_default_dtype(torch.float32)

    # 33 validation images in batches of 8: rank 0 evaluates 3 batches, rank 1 2 (a collective per batch would hang)
    args = [f"output_dir={out_dir}/resume", f"data.batch_size={B}", "trainer.progress=false", "ddp.engine=fsdp2",
            "ddp.timeout_s=60", "optim.name=adamw", "checkpoint.every_steps=0", "data.synthetic.val_size=33",
            "data.eval_batch_size=8", "trainer.eval_max_batches=0", "trainer.num_samples=0"]
    a = Trainer.from_config(TINY, args)
    a.step_once()
    a.step_once()
    path = a.save()
    evaluated = a.run_eval()  # draws no training randomness: the run below stays bitwise comparable
    a.step_once()
    a.step_once()
    end_a = _full_params(a)
    replica = _replica_check_sees_a_buffer(a, world)
    a.close()
    b = Trainer.from_config(TINY, [*args, "resume=auto"])
    resumed_at = b.step
    b.step_once()
    b.step_once()
    end_b = _full_params(b)
    b.close()
    saved = load_file(os.path.join(path, "model.safetensors"))
    same = all(torch.equal(end_a[k], end_b[k]) for k in end_a) if end_a else None
    return {"resumed_at": resumed_at, "bitwise": same, "eval": evaluated, "replica": replica,
            "keys": sorted(saved)}


def _replica_check_sees_a_buffer(trainer, world):
    """Under FSDP2 every tiny.yaml parameter is sharded and it has no buffer: nothing replicated to compare. Give
    the backbone a float buffer, equal on both ranks (the check passes), then different (it names the buffer)."""
    from mtl.errors import TrainingError
    from mtl.runtime_checks import check_replicas, replicated

    before = [n for n, _ in replicated(trainer.bare)]
    trainer.bare.backbone.register_buffer("probe", torch.ones(3))
    check_replicas(trainer.bare, trainer.step)
    trainer.bare.backbone.probe.fill_(float(int(os.environ["RANK"])))
    try:
        check_replicas(trainer.bare, trainer.step)
        caught = None
    except TrainingError as e:
        caught = str(e)
    del trainer.bare.backbone.probe
    return {"before": before, "caught": caught}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    tic = time.perf_counter()
    ctx = mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=3, start_method="spawn", join=False)
    while not ctx.join(timeout=5):
        if time.perf_counter() - tic > DEADLINE_S:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"the FSDP2 workers did not finish within {DEADLINE_S} s")
    w = [torch.load(out / f"worker{i}.pt", weights_only=False) for i in range(3)]
    return {"rank0": w[0], "rank1": w[1], "single": w[2], "wall_s": time.perf_counter() - tic}


def max_rel_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def test_the_supported_strategies_are_the_ones_the_docs_name():
    assert STRATEGIES == ["accumulate", "combined", "detach", "feature_leaf", "find_unused"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp2_two_processes_equal_one_process_on_the_global_batch(runs, strategy, method):
    got = runs["rank0"][f"fsdp2/{strategy}/{method}"]
    ref = runs["single"][f"single/{'detach' if strategy == 'detach' else 'combined'}/{method}"]
    assert max_rel_diff(ref["params"], got["params"]) <= TOL
    # the gradient norm the finite check and the clipping use is the global one, over both ranks' shards
    # (1e-6: gls divides by float32 rank-averaged losses, whose rounding reaches the gradient; equal: ~1e-15)
    for s, r in zip(got["steps"], ref["steps"]):
        assert s["stepped"] and abs(s["grad_norm"] - r["grad_norm"]) <= 1e-6 * r["grad_norm"], (s, r)
    assert max(r["grad_norm"] for r in ref["steps"]) > 1.0  # so clipping at 1.0 took part
    if strategy == "detach":  # and the detached objective really is another objective
        assert max_rel_diff(runs["single"][f"single/combined/{method}"]["params"], got["params"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", DDP_TOO)
def test_fsdp2_equals_ddp_on_the_same_run(runs, strategy, method):
    a, b = runs["rank0"][f"fsdp2/{strategy}/{method}"], runs["rank0"][f"ddp/{strategy}/{method}"]
    assert max_rel_diff(b["params"], a["params"]) <= 1e-12
    for x, y in zip(a["steps"], b["steps"]):
        assert x["losses"] == pytest.approx(y["losses"], rel=1e-12)
        assert x["stats"] == pytest.approx(y["stats"], rel=1e-12)  # feature_leaf's per-task feature-gradient norms
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-12)
    if strategy == "feature_leaf":
        assert {"feat_grad_norm/cls", "feat_grad_norm/gen"} <= set(a["steps"][0]["stats"])


# per step on tiny.yaml (3 backbone units: stem, layer1, layer2; 2 heads; U = 5). All-gathers: one per unit for
# each forward through it and one for each backward, 2 (P * 3 + 2) with P backbone passes per step; feature_leaf
# and detach gather one unit once more (measured: their head-only backward passes end before the backbone's, and
# FSDP2 gathers the last backbone stage again for that pass; most likely its backward prefetch, resharded at
# the end of the head pass). Reduce-scatters: one per unit per backward pass that reduces it.
ALL_GATHERS = {"combined": 10, "feature_leaf": 11, "detach": 11, "accumulate": 16, "find_unused": 16}
# the DDP run's all-reduces beyond the small ones: its gradient bucket (tiny.yaml fits one), and for accumulate
# (find_unused_parameters=True) the map of the parameters used in the step
DDP_EXTRA = {"feature_leaf": 1, "accumulate": 2}
REDUCE_SCATTERS = {"combined": 5, "feature_leaf": 5, "detach": 5, "accumulate": 5, "find_unused": 8}


def test_the_counts_cover_every_supported_strategy():
    assert set(ALL_GATHERS) == set(REDUCE_SCATTERS) == set(STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_step(runs, strategy, method):
    """FSDP2 reduce-scatters the gradients and never all-reduces them: its all-reduces are the step's own small
    ones (the caption-token count, the losses with the stop flag, and gls's per-task loss averages), one fewer
    than the DDP run dispatches, whose one more is its gradient all-reduce. (The global gradient norm's
    collective runs inside DTensor and is not seen by the dispatch mode; that the norm is global is tested by
    comparing it with the single process's above.)"""
    small = 2 + (2 if method == "gls" else 0)
    for i, step in enumerate(runs["rank0"][f"fsdp2/{strategy}/{method}"]["steps"]):
        c = step["counts"]
        assert c.get("c10d._allgather_base_", 0) == ALL_GATHERS[strategy], (strategy, c)
        assert c.get("c10d._reduce_scatter_base_", 0) == REDUCE_SCATTERS[strategy], (strategy, c)
        assert c.get("c10d.allreduce_", 0) == small, (strategy, c)
        if f"ddp/{strategy}/{method}" in runs["rank0"]:
            d = runs["rank0"][f"ddp/{strategy}/{method}"]["steps"][i]["counts"]
            assert d.get("c10d.allreduce_", 0) == small + DDP_EXTRA[strategy] and "c10d._reduce_scatter_base_" not in d, d


@pytest.mark.slow
def test_fsdp2_save_and_resume_is_bitwise_exact_the_model_file_is_full_and_eval_runs_on_unequal_shards(runs):
    r = runs["rank0"]["resume"]
    assert r["resumed_at"] == 2 and r["bitwise"] is True
    assert 0.0 <= r["eval"]["cls_acc"] <= 1.0 and r["eval"] == runs["rank1"]["resume"]["eval"]  # unequal shards
    from mtl.build import build_model
    from mtl.config_check import load_run_config
    from mtl.data.tokenizer import train_tokenizer

    cfg = load_run_config(TINY, [])
    model = build_model(cfg, 4, list("abcd"), train_tokenizer(["a b c"], 64))
    assert r["keys"] == sorted(model.state_dict())  # every key, unsharded (the shapes are checked on resume)


@pytest.mark.slow
def test_the_replica_check_under_fsdp2_compares_what_the_ranks_replicate(runs):
    r = runs["rank0"]["resume"]["replica"]
    assert r["before"] == []  # tiny.yaml: every parameter sharded, no buffer
    assert r["caught"] and "'backbone.probe'" in r["caught"], r


@pytest.mark.slow
def test_report_the_time(runs):
    print(f"\nFSDP2 spawn: {runs['wall_s']:.1f} s; per run (rank 0): "
          + ", ".join(f"{k} {v:.1f}" for k, v in runs["rank0"]["timing"].items()))


# ---------------------------------------------------------------------------- refusals (in-process, fast)

REFUSED = [
    (["ddp.strategy=placeholder"], "ddp.strategy: placeholder does not run with ddp.engine=fsdp2"),
    (["ddp.strategy=task_grads", "weighting.method=pcgrad"], "not yet supported"),
    (["precision=fp16"], "precision: fp16 is not supported with ddp.engine=fsdp2"),
    (["ddp.find_unused_parameters=true"], "ddp.find_unused_parameters: a DistributedDataParallel option"),
    (["ddp.static_graph=true"], "ddp.static_graph: a DistributedDataParallel option"),
    (["ddp.nan_monitor=true"], "ddp.nan_monitor: not supported with ddp.engine=fsdp2"),
    (["model.backbone.norm=batch"], "model.backbone.norm: batch keeps per-rank running statistics"),
    (["ddp.engine=fsdp"], "ddp.engine: 'fsdp' is not one of ddp, fsdp2"),
]


@pytest.mark.parametrize("extra, says", REFUSED)
def test_refused_combinations_are_one_config_error_naming_the_key(tmp_path, extra, says):
    from mtl.config_check import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"output_dir={tmp_path}", "ddp.engine=fsdp2", *extra])
    errors = e.value.errors
    assert sum(says in m for m in errors) == 1, errors
    assert len(errors) == 1, errors


def test_a_refusal_exits_2_through_train_py(tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, f"output_dir={tmp_path}", "ddp.engine=fsdp2", "precision=fp16"])
    assert code == 2
    assert "precision: fp16 is not supported with ddp.engine=fsdp2" in capsys.readouterr().err
