"""``data.source: qm9`` end to end: the papers' split, records and graph batches, the standardisation from the
training split, and configs/qm9.yaml training (a tiny subset: QM9's first molecules)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from .conftest import ROOT  # noqa: E402

QM9_YAML = os.path.join(ROOT, "configs", "qm9.yaml")
MOLECULES, TEST, VAL = 240, 40, 40


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache of QM9's first molecules for the module (built once: ~2 s)."""
    return str(tmp_path_factory.mktemp("qm9_cache"))


def small(cache_dir, tmp_path, *more):
    """configs/qm9.yaml on QM9's first MOLECULES molecules, with small batches."""
    return [f"output_dir={tmp_path / 'run'}", f"data.qm9.cache_dir={cache_dir}", f"data.qm9.molecules={MOLECULES}",
            f"data.qm9.test_size={TEST}", f"data.qm9.val_size={VAL}", "data.batch_size=8", "data.eval_batch_size=40",
            "data.num_workers=0",
            "trainer.progress=false", "trainer.log_every=1", *more]


def test_the_papers_split_records_and_graph_batches(cache_dir, tmp_path):
    from mtl.data import qm9
    from mtl.data.loader import build_test_dataset
    from mtl.setup.build import build_run_inputs
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(QM9_YAML, small(cache_dir, tmp_path, "seed=3"))
    inputs = build_run_inputs(cfg)
    train, val, test = inputs.train_ds, inputs.val_ds, build_test_dataset(cfg, inputs.train_ds)
    split = qm9.paper_split(MOLECULES, 3, TEST, VAL)  # the run's seed shuffles, test first, then val
    assert torch.equal(test.indices, split["test"]) and torch.equal(val.indices, split["val"])
    assert torch.equal(train.indices, split["train"]) and len(train) == MOLECULES - TEST - VAL
    record = train[0]
    g = train.graphs[int(train.indices[0])]
    n = g.num_nodes
    # the record holds the molecule's bonds and positions; the collate makes the complete graph (tests/test_qm9_loader.py)
    assert record["graph"].edge_attr.shape == (g.edge_index.shape[1], 4) and torch.equal(record["graph"].pos, g.pos)
    assert record["U0_atom"] == pytest.approx(float(g.y[0, 12])) and torch.equal(record["y"], g.y.view(-1))
    batch = inputs.collate([train[i] for i in range(4)])
    assert type(batch["graph"]).__name__ == "DataBatch" and batch["graph"].num_graphs == 4
    first = batch["graph"].get_example(0)  # the complete graph, the distance as 5th feature
    assert first.edge_attr.shape == (n * (n - 1), 5) and "pos" not in batch["graph"]
    assert batch["U0_target"].shape == (4,) and batch["index"].tolist() == [0, 1, 2, 3]
    # each head's mean and std are the training split's, in PyG's units
    y = train.graphs.y[train.indices].double()
    for task, column in (("U0", 12), ("mu", 0), ("Cv", 11)):
        head = inputs.model.heads[task]
        assert float(head.mean) == pytest.approx(float(y[:, column].mean()), rel=1e-6)
        assert float(head.std) == pytest.approx(float(y[:, column].std()), rel=1e-6)
    assert inputs.model.heads["U0"].scale == 1000 and inputs.model.heads["U0"].unit == "meV"
    features = inputs.model.backbone(batch["graph"])
    assert features.shape == (4, 64)
    cfg.data.qm9.graph = "bond"
    from mtl.data.qm9_source import qm9_splits

    bond = qm9_splits(cfg)["train"][0]["graph"]
    assert torch.equal(bond.edge_attr, g.edge_attr) and bond.edge_attr.shape[1] == 4


def test_sizes_that_do_not_fit_are_named(cache_dir, tmp_path):
    from mtl.errors import ConfigError, DataError
    from mtl.setup.build import build_run_inputs
    from mtl.setup.checks import load_run_config

    with pytest.raises(ConfigError, match=r"data.qm9.molecules=240: must exceed data.qm9.test_size \+ val_size"):
        load_run_config(QM9_YAML, small(cache_dir, tmp_path, "data.qm9.test_size=200"))
    with pytest.raises(DataError, match="data.qm9.train_size=500: only 160 molecules are left"):
        build_run_inputs(load_run_config(QM9_YAML, small(cache_dir, tmp_path, "data.qm9.train_size=500")))
    with pytest.raises(ConfigError) as e:
        load_run_config(QM9_YAML, small(cache_dir, tmp_path, "model.backbone.name=resnet18", "data.qm9.graph=full"))
    text = "\n".join(e.value.errors)
    assert "data.qm9.graph: 'full' is not one of complete, bond" in text
    assert "set model.backbone.name=mpnn" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qm9.yaml", "qm9_cpu.yaml"])
def test_the_qm9_configs_train_their_first_steps_and_learn(cache_dir, tmp_path, name):
    """configs/qm9.yaml and qm9_cpu.yaml as they are (their 11 tasks, MPNN, graph, optimizer and schedule), on the
    tiny subset: every step sees the same 8 training molecules, so the summed loss must fall; the run evaluates on
    val and test, in the reported units, and the plateau reads the validation Δm. (10-20 s each here: slow tier.)"""
    import json

    import train

    out = tmp_path / "run"
    code = train.main(["--config", os.path.join(ROOT, "configs", name),
                       *small(cache_dir, tmp_path, "data.qm9.train_size=8", "trainer.max_steps=6",
                              "trainer.eval_every=6", "checkpoint.every_steps=0"), f"output_dir={out}"])
    assert code == 0
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["step"] == 6
    tasks = ["mu", "alpha", "homo", "lumo", "r2", "zpve", "U0", "U", "H", "G", "Cv"]
    assert all(f"{t}_mae" in final and f"test_{t}_mae" in final for t in tasks)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    # equal weighting descends the sum of the 11 losses at every step (a single task's may stall while the others
    # pull: U0's stayed within 0.1% over these steps on qm9_cpu.yaml; the sum's fall over the 6 steps is ~1% at
    # width 16, qm9_cpu's, and more at the papers' 64)
    total = [sum(r[f"loss_{t}"] for t in tasks) for r in steps]
    assert all(b < a for a, b in zip(total, total[1:])), total
    # an untrained model's U0 error is of the order of the split's spread: hundreds of meV, not a fraction of an eV
    assert final["U0_mae"] > 50
    # the plateau schedule read the validation Δm against the published MAEs (an untrained model: far above 0)
    assert final["plateau_delta_m"] > 100


@pytest.mark.slow
def test_the_plateau_state_survives_a_resume(cache_dir, tmp_path):
    """The rate the plateau lowered, and its count of evaluations without improvement, come back with the run."""
    from mtl.run.trainer import Trainer

    over = small(cache_dir, tmp_path, "trainer.eval_every=1", "optim.plateau.patience=0", "optim.lr=0.05",
                 "checkpoint.every_steps=0", "data.eval_batch_size=80")
    first = Trainer.from_config(QM9_YAML, [*over, "trainer.max_steps=3"])
    try:
        first.train()
    finally:
        first.close()
    state, lr = first.scheduler.state_dict(), first.scheduler.get_last_lr()
    assert first.scheduler.inner.best < float("inf") and state["last_delta_m"] is not None
    resumed = Trainer.from_config(QM9_YAML, [*over, "trainer.max_steps=4", "resume=auto"])
    try:
        assert resumed.step == 3
        assert resumed.scheduler.state_dict() == state and resumed.scheduler.get_last_lr() == lr
    finally:
        resumed.close()


def _load_on_two_ranks(rank, port, folder, results):
    """One rank of a 2-process gloo group loading QM9 into an empty cache; ``folder/fail`` makes rank 0's qm9pack
    lookup fail. Reports (rank, how many times this rank built the graphs, the error it raised or None)."""
    import datetime

    import torch.distributed as dist

    from mtl.data import qm9
    from mtl.data.qm9_source import load_graphs
    from mtl.errors import DataError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    builds = []
    real = qm9.build_from_rows
    qm9.build_from_rows = lambda rows: builds.append(len(rows)) or real(rows)
    if rank == 0 and os.path.exists(os.path.join(folder, "fail")):
        def missing():
            raise DataError("QM9: the package 'qm9pack' is not installed — pip install -e '.[qm9]'")
        qm9.qm9pack_folder = missing
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data": {"qm9": {"root": None, "cache_dir": os.path.join(folder, "cache"),
                                             "molecules": 30}}})
    try:
        graphs = load_graphs(cfg)
        results.put((rank, builds, None, len(graphs)))
    except DataError as e:
        results.put((rank, builds, e.message, 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True])
def test_rank_0_builds_the_cache_and_its_failure_stops_every_rank(tmp_path, fail):
    """Under a process group rank 0 builds the graphs while rank 1 waits, then rank 1 reads the cache (it builds
    nothing); when rank 0 cannot load QM9, both ranks raise its message, within seconds, instead of waiting."""
    from .conftest import spawn_ranks

    if fail:
        (tmp_path / "fail").write_text("")
    got = spawn_ranks(_load_on_two_ranks, tmp_path, timeout_s=120)
    if not fail:
        assert got[0] == ([30], None, 30) and got[1] == ([], None, 30)
    else:
        assert got[0][1] == "QM9: the package 'qm9pack' is not installed — pip install -e '.[qm9]'"
        assert got[1][1] == "QM9 could not be loaded on rank 0: " + got[0][1]


@pytest.mark.slow
def test_the_loader_benchmark_measures_each_graph_path_and_worker_count(cache_dir, tmp_path):
    """``python -m mtl.tools.bench.qm9_loader`` (docs/qm9.md, "The loader"), on QM9's first molecules and a narrow
    model: a row per graph, records path, number of workers and way of sending the batch, each with the loader's rate, the step and their
    product (the batches the loader makes in one step's time)."""
    import json

    from mtl.tools.bench.qm9_loader import main

    out = tmp_path / "rows.json"
    over = [o for o in small(cache_dir, tmp_path) if not o.startswith(("output_dir=", "trainer."))]
    assert main(["--config", QM9_YAML, "--workers", "0,1", "--steps", "1", "--json", str(out), *over,
                 "model.backbone.options.dim=8", "model.backbone.options.edge_hidden=8"]) == 0
    rows = json.loads(out.read_text())
    # with a worker, the batch sent tensor by tensor (before) and packed as one buffer (mtl/data/packing.py)
    assert [(r["graph"], r["path"], r["workers"], r["packed"]) for r in rows] == [
        (g, p, w, k) for g in ("bond", "complete") for p in ("per_item", "batched")
        for w, k in ((0, False), (1, False), (1, True))]
    for r in rows:
        assert r["batches_per_s"] > 0 and r["first_pass_batches_per_s"] > 0 and r["step_s"] > 0, r
        assert r["ratio"] == r["batches_per_s"] * r["step_s"] and r["batch_size"] == 8, r
