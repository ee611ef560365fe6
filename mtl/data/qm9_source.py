"""``data.source: qm9``: the train / val / test splits of QM9 as data sets of records, and their graph collate.

The graphs come from ``mtl.data.qm9`` (qm9pack's CSV through RDKit, cached; or PyG's processed folder,
``data.qm9.root``). The split is the papers' (``paper_split``): a shuffle seeded with ``data.qm9.split_seed`` (null:
the run's seed), the first ``test_size`` molecules for test, the next ``val_size`` for validation, the rest (or its
first ``train_size``) for training. ``molecules`` reads only QM9's first N molecules (the smallest: for tests and
quick tries, whose cache builds in seconds).

A record is ``graph`` (a PyG ``Data`` with ``x``, ``edge_index``, ``edge_attr``: the molecule's bond graph; with
``graph: complete`` also its atoms' ``pos``), ``index``, ``y`` (PyG's 19 targets in PyG's units) and each target by
its PyG name (``mu`` ... ``U0_atom`` ... ``C``), which is what a task reads (``task_instances.U0: {type:
regression, field: U0_atom}``). ``batch_graphs`` collates the graphs into one PyG ``Batch`` under ``graph`` (the key
the ``mpnn`` backbone consumes); graphs with ``pos`` are made the papers' complete graph there, the whole batch at
once (``complete_batch``: PyG's ``to_dense_batch``, ``to_dense_adj``, ``dense_to_sparse`` and ``Distance``), equal
bit for bit to the per-molecule transform (``qm9.CompleteGraph``) collated, which is what ``__getitem__`` did per
item and epoch before (``QM9Split(..., batched=False)`` keeps that path: the reference of the test and of ``python
-m mtl.tools.bench.qm9_loader``). The loader's workers (``data.num_workers``) run the collate.

This module (kept apart from ``mtl.data.qm9``, whose source is part of the cache key) is only imported for
``data.source: qm9``, and imports PyG only through ``mtl.data.qm9``'s loaders and the collate.
"""

from __future__ import annotations

import copy

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

    def __init__(self, graphs: qm9.QM9Graphs, indices: torch.Tensor, graph: str, split: str, batched: bool = True):
        if graph not in GRAPHS:
            raise DataError(f"data.qm9.graph: {graph!r} is not one of {', '.join(GRAPHS)}")
        self.graphs, self.indices, self.graph = graphs, indices.long(), graph
        # batched (the loaders'): the complete graph is made per batch by the collate (complete_batch); False: per
        # item here, with the per-molecule transform (the former path: the reference the batched one is tested on)
        self.batched = batched
        self.transform = qm9.CompleteGraph() if graph == "complete" and not batched else None
        self.source = f"QM9's {split} split (data.source=qm9)"
        # each item's graph, made on its first read and kept (views of the stored tensors): a PyG Data costs ~40 us
        # to make, a batch of 120 of them 5 ms, more than the rest of the record
        self._graphs: list = [None] * len(self.indices) if batched else []

    def __len__(self) -> int:
        return len(self.indices)

    def _graph(self, g):
        """The record's graph of the stored molecule ``g``."""
        from torch_geometric.data import Data

        if self.transform is not None:
            g = self.transform(g)
        if self.graph == "complete" and self.batched:  # its positions: the collate makes the complete graph
            return Data(x=g.x, edge_index=g.edge_index, edge_attr=g.edge_attr, pos=g.pos)
        return Data(x=g.x, edge_index=g.edge_index, edge_attr=g.edge_attr)

    def __getitem__(self, i: int) -> dict:
        j = int(self.indices[i])
        if not self.batched:  # the former path as it was: the graph made per item, each target read on its own
            g = self.graphs[j]
            y = g.y.view(-1)
            return {"graph": self._graph(g), "index": int(i), "y": y,
                    **{t: float(y[c]) for c, t in enumerate(qm9.TARGETS)}}
        graph = self._graphs[i]
        if graph is None:
            graph = self._graphs[i] = self._graph(self.graphs[j])
        y = self.graphs.y[j]
        return {"graph": graph, "index": int(i), "y": y, **dict(zip(qm9.TARGETS, y.tolist()))}

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
    """The input fields of a batch of QM9 records: their graphs as one PyG ``Batch`` (``graph``); records whose graph
    has positions (``graph: complete``) as the papers' complete graph (``complete_batch``)."""
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([r["graph"] for r in records])
    return {"graph": complete_batch(batch) if "pos" in batch else batch}


def complete_batch(batch):
    """The papers' complete graph (``qm9.CompleteGraph``: every ordered pair of distinct atoms, the bond's 4 one-hots,
    zeros where there is no bond, and the distance) of every molecule of a PyG ``Batch`` of bond graphs with ``pos``,
    at once: the same ``Batch`` as the per-molecule transform's graphs collated, bit for bit (edges in the same order,
    per molecule row-major; without ``pos``, as those graphs had none). A new ``Batch``; ``batch`` is left as it is."""
    from torch_geometric.transforms import Distance
    from torch_geometric.utils import dense_to_sparse, to_dense_adj, to_dense_batch

    _, atoms = to_dense_batch(batch.pos, batch.batch)  # (molecules, most atoms): which slots hold an atom
    pairs = atoms.unsqueeze(2) & atoms.unsqueeze(1)
    pairs.diagonal(dim1=1, dim2=2).fill_(False)  # no self-loops
    bonds = to_dense_adj(batch.edge_index, batch.batch, batch.edge_attr, max_num_nodes=atoms.shape[1])
    out = copy.copy(batch)  # the same tensors, its own attributes
    out.edge_index, _ = dense_to_sparse(pairs, atoms)  # row-major over (molecule, i, j), the batch's atom numbers
    out.edge_attr = bonds[pairs]  # the same order: the bond's one-hots, zeros for a pair without a bond
    out = Distance(norm=False)(out)
    del out.pos
    # the Batch's per-molecule bookkeeping (to_data_list, get_example) for the new edges
    counts = atoms.sum(dim=1)
    edges = torch.cat([counts.new_zeros(1), torch.cumsum(counts * (counts - 1), dim=0)])
    out._slice_dict = {k: v for k, v in batch._slice_dict.items() if k != "pos"}
    out._inc_dict = {k: v for k, v in batch._inc_dict.items() if k != "pos"}
    out._slice_dict["edge_index"] = out._slice_dict["edge_attr"] = edges
    return out


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
