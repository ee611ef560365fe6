"""QM9's records off the critical path: the complete graph made per batch by the collate (``complete_batch``) equals,
bit for bit, the per-molecule transform (``qm9.CompleteGraph``) the records used to carry, collated; each item's
graph is kept after its first read; loader workers give the same batches."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from mtl.data import qm9  # noqa: E402
from mtl.data.qm9_source import QM9Split, batch_graphs, complete_batch  # noqa: E402

from .conftest import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """QM9's first 14 molecules (3 to 11 atoms) and 6 of its last file's (19 to 23 atoms), stored as the cache
    stores them (PyG's InMemoryDataset file)."""
    import pandas as pd
    from torch_geometric.data import InMemoryDataset

    folder = qm9.qm9pack_folder()
    rows = qm9.read_csv_rows(folder, limit=14)
    rows += pd.read_csv(os.path.join(folder, qm9.CSV_FILES[-1]), usecols=list(qm9.CSV_COLUMNS),
                        nrows=6).to_dict("records")
    built, _ = qm9.build_from_rows(rows)
    path = str(tmp_path_factory.mktemp("qm9_loader") / "graphs.pt")
    InMemoryDataset.save(built, path)
    return qm9.QM9Graphs(qm9._in_memory(path), None, path)


def assert_same_batch(a, b):
    assert sorted(a.keys()) == sorted(b.keys())
    for key in b.keys():
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for x, y in zip(a.to_data_list(), b.to_data_list(), strict=True):  # the per-molecule bookkeeping too
        assert sorted(x.keys()) == sorted(y.keys()) and all(torch.equal(x[k], y[k]) for k in y.keys())


@pytest.mark.parametrize("graph", ["complete", "bond"])
def test_the_batched_graphs_equal_the_per_item_ones_bit_for_bit(graphs, graph):
    n = len(graphs)
    sizes = sorted({int(graphs[i].num_nodes) for i in range(n)})
    assert sizes[0] <= 5 and sizes[-1] >= 20  # molecules of many sizes in one batch: the padding is exercised
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    batched, per_item = (QM9Split(graphs, order, graph, "training", batched=b) for b in (True, False))
    assert per_item.transform is not None if graph == "complete" else per_item.transform is None
    for take in (range(n), range(3, 4), range(5, 12)):  # the whole set, one molecule, a slice
        ours = batch_graphs([batched[i] for i in take])["graph"]
        theirs = batch_graphs([per_item[i] for i in take])["graph"]
        assert_same_batch(ours, theirs)
    if graph == "complete":  # and the papers' graph, molecule by molecule: N(N - 1) edges, 5 features
        ours = batch_graphs([batched[i] for i in range(n)])["graph"].to_data_list()
        for i, g in enumerate(ours):
            reference = qm9.CompleteGraph()(graphs[int(order[i])])
            k = reference.num_nodes
            assert g.edge_attr.shape == (k * (k - 1), 5) and torch.equal(g.edge_index, reference.edge_index)
            assert torch.equal(g.edge_attr, reference.edge_attr)
    for i in range(n):  # the targets the tasks read: the same values and types
        a, b = batched[i], per_item[i]
        assert torch.equal(a["y"], b["y"]) and a["index"] == b["index"]
        assert all(type(a[t]) is float and a[t] == b[t] for t in qm9.TARGETS)
    assert batched[2]["graph"] is batched[2]["graph"]  # kept after the first read


def test_the_runs_collate_gives_the_same_batch_on_both_paths(graphs):
    """Through the run's own collate (the 11 tasks' targets and the graph), as the loader calls it."""
    from mtl.setup.build import build_collate
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(os.path.join(ROOT, "configs", "qm9.yaml"), ["data.qm9.molecules=20", "data.qm9.test_size=2",
                                                                      "data.qm9.val_size=2"])
    collate = build_collate(cfg, 0, [], None)
    order = torch.arange(len(graphs)).flip(0)
    a, b = (collate([QM9Split(graphs, order, "complete", "training", batched=x)[i] for i in range(8)])
            for x in (True, False))
    assert sorted(a) == sorted(b) and "U0_target" in a
    assert_same_batch(a["graph"], b["graph"])
    assert all(torch.equal(a[k], b[k]) for k in a if k != "graph")


def test_a_batch_without_positions_is_left_as_the_bond_graph(graphs):
    from torch_geometric.data import Batch, Data

    g = graphs[5]
    batch = Batch.from_data_list([Data(x=g.x, edge_index=g.edge_index, edge_attr=g.edge_attr)])
    out = batch_graphs([{"graph": batch.get_example(0)}])["graph"]
    assert torch.equal(out.edge_index, g.edge_index) and out.edge_attr.shape[1] == 4
    with_pos = Batch.from_data_list([Data(x=g.x, edge_index=g.edge_index, edge_attr=g.edge_attr, pos=g.pos)])
    out = complete_batch(with_pos)
    assert out.edge_attr.shape == (12, 5) and "pos" not in out
    assert torch.equal(with_pos.edge_attr, g.edge_attr) and "pos" in with_pos  # the input is left as it was


@pytest.mark.slow
def test_loader_workers_give_the_same_batches(graphs):
    """data.num_workers=2 (the collate, complete graph included, in the workers; each batch sent packed as one buffer,
    mtl/data/packing.py): the batches of 0 workers, in order, and every tensor of a batch a view of one storage."""
    from mtl.data.loader import build_train_loader
    from mtl.setup.build import build_collate
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(os.path.join(ROOT, "configs", "qm9.yaml"), ["data.qm9.molecules=20", "data.qm9.test_size=2",
                                                                      "data.qm9.val_size=2"])
    ds = QM9Split(graphs, torch.arange(len(graphs)), "complete", "training")
    runs = []
    for workers in (0, 2):
        loader = build_train_loader(ds, build_collate(cfg, 0, [], None), 4, 0, 1, 7, num_workers=workers)
        loader.sampler.set_epoch(1)
        runs.append(list(loader))
    assert len(runs[0]) == 5 and len(runs[1]) == 5
    for a, b in zip(*runs):
        assert_same_batch(a["graph"], b["graph"])
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a if k != "graph")
        sent = [b[k] for k in b if k != "graph"] + [b["graph"][k] for k in b["graph"].keys()]
        assert len({t.untyped_storage().data_ptr() for t in sent}) == 1  # one storage received, not one a tensor
