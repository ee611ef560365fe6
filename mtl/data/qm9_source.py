"""``data.source: qm9``: the train / val / test splits of QM9 as data sets of records, and their graph collate.

The graphs come from ``mtl.data.qm9`` (qm9pack's CSV through RDKit, cached; or PyG's processed folder,
``data.qm9.root``). The split is the papers' (``paper_split``): a shuffle seeded with ``data.qm9.split_seed`` (null:
the run's seed), the first ``test_size`` molecules for test, the next ``val_size`` for validation, the rest (or its
first ``train_size``) for training. ``molecules`` reads only QM9's first N molecules (the smallest: for tests and
quick tries, whose cache builds in seconds).

A record is ``graph`` (a PyG ``Data`` with ``x``, ``edge_index``, ``edge_attr``: the bond graph, or with
``graph: complete`` the papers' complete graph with the distance as a 5th edge feature), ``index``, ``y`` (PyG's 19
targets in PyG's units) and each target by its PyG name (``mu`` ... ``U0_atom`` ... ``C``), which is what a task
reads (``task_instances.U0: {type: regression, field: U0_atom}``). ``batch_graphs`` collates the graphs into one
PyG ``Batch`` under ``graph`` (the key the ``mpnn`` backbone consumes).

This module (kept apart from ``mtl.data.qm9``, whose source is part of the cache key) is only imported for
``data.source: qm9``, and imports PyG only through ``mtl.data.qm9``'s loaders and the collate.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from mtl.data import qm9
from mtl.errors import DataError
from mtl.parallel.dist import broadcast_object

GRAPHS = ("complete", "bond")
_LOADED: dict[tuple, qm9.QM9Graphs] = {}  # the graphs of this process, read once for the three splits


class QM9Split(Dataset):
    """One split of QM9: the molecules ``indices`` of ``graphs``, as records (see the module's doc)."""

    num_classes = 0
    class_names: list = []
    normalization = None  # no image normalisation: the loaders pass the batch through
    provides = frozenset({"graph", "index", "y", *qm9.TARGETS})

    def __init__(self, graphs: qm9.QM9Graphs, indices: torch.Tensor, graph: str, split: str):
        if graph not in GRAPHS:
            raise DataError(f"data.qm9.graph: {graph!r} is not one of {', '.join(GRAPHS)}")
        self.graphs, self.indices, self.graph = graphs, indices.long(), graph
        self.transform = qm9.CompleteGraph() if graph == "complete" else None
        self.source = f"QM9's {split} split (data.source=qm9)"

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        g = self.graphs[int(self.indices[i])]
        if self.transform is not None:
            g = self.transform(g)
        from torch_geometric.data import Data

        y = g.y.view(-1)
        return {"graph": Data(x=g.x, edge_index=g.edge_index, edge_attr=g.edge_attr), "index": int(i), "y": y,
                **{t: float(y[c]) for c, t in enumerate(qm9.TARGETS)}}

    def field_values(self, field: str) -> torch.Tensor:
        """Every item's value of ``field`` (``y`` or a target's name) at once, without building the graphs."""
        y = self.graphs.y[self.indices]
        if field == "y":
            return y
        if field not in qm9.TARGETS:
            raise DataError(f"QM9 has no field {field!r}: {self.how_to_provide(field)}")
        return y[:, qm9.TARGETS.index(field)]

    @staticmethod
    def how_to_provide(field: str) -> str:
        return (f"QM9's records have graph, index, y (PyG's 19 targets) and each target by name "
                f"({', '.join(qm9.TARGETS)}); name one of those as the task's field")


def batch_graphs(records: list[dict]) -> dict:
    """The input fields of a batch of QM9 records: their graphs as one PyG ``Batch`` (``graph``)."""
    from torch_geometric.data import Batch

    return {"graph": Batch.from_data_list([r["graph"] for r in records])}


def load_graphs(cfg) -> qm9.QM9Graphs:
    """The graphs of ``data.qm9``: PyG's folder (``root``), or qm9pack's CSV through the cache. Under a process
    group, rank 0 builds the cache first while the others wait, then they read it; an error on rank 0 (a missing
    package, a bad file) is raised on every rank, so none waits for a peer that has stopped."""
    q = cfg.data.qm9
    key = (q.root, q.cache_dir, int(q.molecules))
    if key in _LOADED:
        return _LOADED[key]
    if q.root:
        graphs = qm9.load_pyg_root(q.root)
    else:
        import torch.distributed as dist

        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        limit = int(q.molecules) or None
        failure, error = None, None
        if main:
            try:
                graphs = qm9.load_qm9pack(q.cache_dir, limit)
            except Exception as e:  # noqa: BLE001 - said on every rank below
                error, failure = e, (e.message if isinstance(e, DataError) else f"{type(e).__name__}: {e}")
        failure = broadcast_object(failure)  # also the barrier: the others read the cache only once it is written
        if error is not None:
            raise error
        if failure is not None:
            raise DataError(f"QM9 could not be loaded on rank 0: {failure}")
        if not main:
            graphs = qm9.load_qm9pack(q.cache_dir, limit, log=lambda *_: None)
    _LOADED[key] = graphs
    return graphs


def qm9_splits(cfg) -> dict[str, QM9Split]:
    """{"train", "val", "test"}: the papers' split of ``data.qm9`` (see the module's doc). DataError when the sizes
    do not fit the molecules read."""
    q = cfg.data.qm9
    graphs = load_graphs(cfg)
    n = len(graphs)
    if n <= q.test_size + q.val_size:
        raise DataError(f"data.qm9: {n} molecules cannot give test_size={q.test_size} and val_size={q.val_size} and a "
                        "training set; lower them (with data.qm9.molecules, the sizes must fit in it)")
    split = qm9.paper_split(n, cfg.seed if q.split_seed is None else q.split_seed, q.test_size, q.val_size)
    train = split["train"]
    if q.train_size:
        if q.train_size > len(train):
            raise DataError(f"data.qm9.train_size={q.train_size}: only {len(train)} molecules are left for training "
                            f"({n} read, {q.test_size} test, {q.val_size} validation); lower it or set 0 (all)")
        train = train[:q.train_size]
    return {"train": QM9Split(graphs, train, q.graph, "training"), "val": QM9Split(graphs, split["val"], q.graph,
                                                                                    "validation"),
            "test": QM9Split(graphs, split["test"], q.graph, "test")}
