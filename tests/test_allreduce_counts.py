"""How many times each strategy all-reduces the gradients per step, counted with a DDP comm hook (plus the
strategy's own collectives, counted by the ``CountingComm`` the step hands it); and the bytes each strategy
says it all-reduces (``Strategy.allreduce_bytes``) equal the bytes counted."""

import json
import os

import pytest
import torch.multiprocessing as mp

from mtl.strategies import strategy_types

from .conftest import TINY, free_port

STRATEGIES = [n for n, cls in strategy_types().items() if not cls.unsafe]
# runs with a gradient-level method: (strategy, weighting.source); the method is MGDA
GRAD_RUNS = {"task_grads+mgda": ("task_grads", "parameters"), "feature_leaf+mgda@features": ("feature_leaf", "features")}
RUNS = STRATEGIES + list(GRAD_RUNS)
EXPECTED = {"combined": 1, "feature_leaf": 1, "detach": 1, "accumulate": 1, "find_unused": 2, "placeholder": 2,
            "task_grads": 2, "task_grads+mgda": 2, "feature_leaf+mgda@features": 2}
# of which by hand (StepInputs.comm): task_grads all-reduces K - 1 = 1 row (with the losses) itself, DDP the last row
# and the heads; the features source all-reduces one K x K Gram matrix (with the losses) itself
MANUAL = {"task_grads": 1, "task_grads+mgda": 1, "feature_leaf+mgda@features": 1}


def _worker(rank, port, out_dir):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    from mtl.parallel import dist
    from mtl.run.trainer import Trainer
    from mtl.tools.bench.strategies import count_communication

    torch.set_num_threads(1)
    results = {}
    for name in RUNS:
        strategy, source = GRAD_RUNS.get(name, (name, None))
        grad = [] if source is None else ["weighting.method=mgda", f"weighting.source={source}"]
        trainer = Trainer.from_config(TINY, [f"output_dir={out_dir}/{name}", "data.batch_size=4",
                                             f"ddp.strategy={strategy}", "trainer.progress=false", *grad])
        counts = {"rounds": 0, "bytes": 0, "manual": 0}
        count_communication(trainer, counts)  # a DDP comm hook, and a CountingComm for the strategy's own
        per_step = []
        for _ in range(3):
            before = dict(counts)
            trainer.step_once()
            per_step.append({k: counts[k] - before[k] for k in counts})
        trainer.close()
        shared = sum(p.numel() for p in trainer.bare.backbone.parameters() if p.requires_grad)
        heads = sum(p.numel() for p in trainer.bare.heads.parameters() if p.requires_grad)
        results[name] = {"steps": per_step, "tasks": len(trainer.tasks), "shared": shared, "heads": heads}
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
@pytest.mark.parametrize("strategy", RUNS)
def test_allreduces_per_step(counts, strategy):
    for step in counts[strategy]["steps"]:  # every step, including the first (before DDP rebuilds its buckets)
        assert step["rounds"] + step["manual"] == EXPECTED[strategy], (strategy, step)
        assert step["manual"] == MANUAL.get(strategy, 0), (strategy, step)
    if strategy in STRATEGIES:  # the class states its rounds: DDP's and its own together
        assert strategy_types()[strategy].cost(counts[strategy]["tasks"])["allreduces"] == EXPECTED[strategy]


@pytest.mark.slow
def test_bytes_per_step_follow_the_rounds(counts):
    one = counts["combined"]["steps"][-1]["bytes"]
    assert counts["feature_leaf"]["steps"][-1]["bytes"] == one
    assert counts["find_unused"]["steps"][-1]["bytes"] == 2 * one
    assert counts["placeholder"]["steps"][-1]["bytes"] == 2 * one
    assert counts["task_grads"]["steps"][-1]["bytes"] > one  # K rows of the shared gradient + the heads
    k = counts["combined"]["tasks"]  # features source: one K x K Gram matrix and the K losses, in float64
    assert counts["feature_leaf+mgda@features"]["steps"][-1]["bytes"] == one + (k * k + k) * 8


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [*STRATEGIES, "task_grads+mgda"])
def test_each_strategy_states_the_bytes_it_all_reduces(counts, strategy):
    c = counts[strategy]
    stated = strategy_types()[GRAD_RUNS.get(strategy, (strategy,))[0]].allreduce_bytes(c["tasks"], c["shared"], c["heads"])
    assert c["steps"][-1]["bytes"] == stated, (strategy, c["steps"][-1]["bytes"], stated)
