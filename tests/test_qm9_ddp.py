"""QM9 under DDP: 2 processes x batch B == 1 process x batch 2B after 3 steps, for ``feature_leaf`` with ``equal``
and a gradient-level method (``imtlg``) on both gradient sources (``parameters`` through ``task_grads``,
``features`` through ``feature_leaf``).

Graph batches vary in size (atoms, edges), but every task's loss is a mean over the rank's molecules, and every
rank holds as many molecules (``drop_last``), so DDP's average over ranks is the mean over the global batch; the
message passing and Set2Set are per molecule. This proves it on configs/qm9.yaml itself (its 11 regression tasks,
the 64-wide MPNN, the complete graph), on QM9's first molecules. As in tests/test_weighting_ddp.py: one spawn of three
workers (two ranks and a single process), float64 (so the bar measures the order of averaging, not which side of a
ReLU kink a rounding fell), SGD (Adam turns rounding noise in zero gradients into full steps).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from .conftest import ROOT, parity_worker, spawn_parity_runs  # noqa: E402
from .test_weighting_ddp import bitwise_equal, max_rel_diff  # noqa: E402

QM9_YAML = os.path.join(ROOT, "configs", "qm9.yaml")
B, STEPS, TOL = 4, 3, 1e-5
DTYPE = torch.float64
DEADLINE_S = 400
RUNS = {"equal": ["ddp.strategy=feature_leaf", "weighting.method=equal"],
        "imtlg@parameters": ["ddp.strategy=task_grads", "weighting.method=imtlg", "weighting.source=parameters"],
        "imtlg@features": ["ddp.strategy=feature_leaf", "weighting.method=imtlg", "weighting.source=features"]}


def overrides(out_dir: str, cache_dir: str, batch: int) -> list[str]:
    return [f"output_dir={out_dir}", f"data.qm9.cache_dir={cache_dir}", "data.qm9.molecules=120",
            "data.qm9.test_size=20", "data.qm9.val_size=20", f"data.batch_size={batch}", "data.num_workers=0",
            "optim.name=sgd",
            "optim.lr=0.05", "trainer.progress=false", "ddp.timeout_s=60"]


def to_dtype(batch: dict) -> dict:
    out = {k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    graph = out["graph"]
    graph.x, graph.edge_attr = graph.x.to(DTYPE), graph.edge_attr.to(DTYPE)
    return out


def _runs(world: int, out_dir: str) -> dict:
    """Each run's end state on this process (``parity_worker`` saves it): the model, the weights, the atoms per step."""
    from mtl.run.trainer import Trainer

    torch.set_default_dtype(DTYPE)
    results = {}
    for name, extra in RUNS.items():
        trainer = Trainer.from_config(QM9_YAML, [*overrides(os.path.join(out_dir, f"w{world}", name),
                                                            os.path.join(out_dir, "cache"), 2 * B // world), *extra])
        assert trainer.dist.world_size == world
        initial = {k: v.detach().clone() for k, v in trainer.bare.state_dict().items()}
        batches = trainer.batches()
        trainer.bare.train()
        sizes = []
        for _ in range(STEPS):
            batch = to_dtype(next(batches)[1])
            sizes.append(int(batch["graph"].num_nodes))
            trainer.step_once(batch)
        results[name] = {"model": {k: v.detach().clone() for k, v in trainer.bare.state_dict().items()},
                         "weights": trainer.weighting.weights(), "atoms": sizes, "initial": initial}
        trainer.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn_parity_runs(functools.partial(parity_worker, _runs), tmp_path_factory, "qm9_ddp", DEADLINE_S,
                             "QM9 DDP")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_equal_one_process_on_the_global_batch(runs, name):
    r0, r1, single = (runs[k][name] for k in ("rank0", "rank1", "single"))
    assert bitwise_equal(r0["model"], r1["model"]) and bitwise_equal(r0["weights"], r1["weights"])
    # the ranks' graph batches differ in size, and together they hold the single process's molecules
    assert r0["atoms"] != r1["atoms"]
    assert [a + b for a, b in zip(r0["atoms"], r1["atoms"])] == single["atoms"]
    assert next(iter(r0["model"].values())).dtype == DTYPE
    model, weights = max_rel_diff(single["model"], r0["model"]), max_rel_diff(single["weights"], r0["weights"])
    print(f"{name}: parameters {model:.1e}, weights {weights:.1e}")
    assert model <= TOL and weights <= TOL, (name, model, weights)
    assert max_rel_diff(single["initial"], single["model"]) > 1e-3  # the steps moved the parameters
