"""The MPNN of Gilmer et al. (2017) as the multi-task papers run it on QM9 (Nash-MTL's and LibMTL's ``Net``): the
backbone ``model.backbone.name: mpnn``, reading the molecule graphs of ``data.source: qm9`` (``consumes = "graph"``).

A linear embedding of the 11 atom features, then ``steps`` (3) message-passing steps of NNConv (an edge network maps
each edge's features to a ``dim x dim`` matrix; messages are averaged) each followed by a GRU, Set2Set pooling with
``set2set_steps`` (3) steps, and a shared linear layer of width ``dim`` (64) with ReLU: its output, one row per
molecule (``feature_shape`` = (dim,)), is the shared feature the task heads read (one linear layer per task, in the
task type). Its options (``model.backbone.options``) are the ``MPNNOptions`` fields.

The edge network's input (the edge features) is the same at every step, so ``reuse_edge_network=True`` (default)
computes its matrices once per forward and reuses them across the steps (``EdgeNetConv``); PyG's ``NNConv``
recomputes them at each step. Both have the same parameters (the same ``state_dict`` keys), and
tests/test_qm9_model.py proves them equal to float round-off; on the papers' complete graph, where the edge network
dominates the cost, ``python -m mtl.tools.qm9_edge_network`` measures the saving.

PyG is imported when the network is built, not when the backbones are discovered: a run of another backbone needs
neither the ``qm9`` extra nor the seconds its import takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtl.data.qm9 import INSTALL_HINT
from mtl.errors import ConfigError
from mtl.models.backbones.base import Backbone

GRAPHS = {"complete": 5, "bond": 4}  # data.qm9.graph -> edge features (the 4 bond one-hots, and the distance)


def _pyg():
    try:
        from torch_geometric.nn import NNConv
        from torch_geometric.nn.aggr import Set2Set
    except ImportError as e:

        raise ConfigError(f"model.backbone.name=mpnn needs torch_geometric, which is not installed ({e}) — "
                          f"{INSTALL_HINT}") from None
    return NNConv, Set2Set


@functools.cache
def edge_net_conv() -> type:
    """``EdgeNetConv``: PyG's NNConv whose edge-network matrices are computed by the caller (``edge_weights``), once
    for many calls. The same parameters as NNConv (``nn``, ``lin``, ``bias``) and the same maths; only the message
    takes the precomputed (E, in, out) matrices instead of the edge features. (Made on first use, so that PyG is
    imported only then.)"""
    NNConv, _ = _pyg()

    class EdgeNetConv(NNConv):
        def edge_weights(self, edge_attr: torch.Tensor) -> torch.Tensor:
            return self.nn(edge_attr).view(-1, self.in_channels_l, self.out_channels)

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            # PyG compiles ``propagate`` from this signature (else it would take NNConv's, with edge_attr)
            # propagate_type: (x: OptPairTensor, weight: Tensor)
            out = self.propagate(edge_index, x=(x, x), weight=weight, size=None)
            if self.root_weight:
                out = out + self.lin(x)
            if self.bias is not None:
                out = out + self.bias
            return out

        def message(self, x_j: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return torch.matmul(x_j.unsqueeze(1), weight).squeeze(1)

    return EdgeNetConv


def __getattr__(name: str):  # ``from mtl.models.backbones.mpnn import EdgeNetConv``, made on first use
    if name == "EdgeNetConv":
        return edge_net_conv()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class MPNNOptions:
    dim: int = 64  # the width of the atom states, of the shared layer and so of the features (the papers': 64)
    steps: int = 3  # message-passing steps (NNConv + GRU)
    set2set_steps: int = 3  # Set2Set's processing steps
    edge_hidden: int = 128  # the edge network's hidden width (edge features -> edge_hidden -> dim x dim)
    reuse_edge_network: bool = True  # compute the edge network once per forward (false: PyG's NNConv, per step)


class MPNN(Backbone):
    """Graph batch (``x``, ``edge_index``, ``edge_attr``, ``batch``) -> shared features (num_graphs, ``dim``)."""

    name = "mpnn"
    consumes = "graph"
    Options = MPNNOptions

    def __init__(self, num_features: int = 11, edge_features: int = 5, dim: int = 64, steps: int = 3,
                 set2set_steps: int = 3, edge_hidden: int = 128, reuse_edge_network: bool = True):
        super().__init__()
        NNConv, Set2Set = _pyg()
        self.dim, self.steps, self.reuse_edge_network = dim, steps, reuse_edge_network
        self.lin0 = nn.Linear(num_features, dim)
        edge_net = nn.Sequential(nn.Linear(edge_features, edge_hidden), nn.ReLU(), nn.Linear(edge_hidden, dim * dim))
        self.conv = (edge_net_conv() if reuse_edge_network else NNConv)(dim, dim, edge_net, aggr="mean")
        self.gru = nn.GRU(dim, dim)
        self.set2set = Set2Set(dim, processing_steps=set2set_steps)
        self.lin1 = nn.Linear(2 * dim, dim)

    @classmethod
    def build(cls, cfg) -> MPNN:
        o = cls.options_from(cfg)
        return cls(edge_features=GRAPHS[_graph(cfg)], dim=o.dim, steps=o.steps, set2set_steps=o.set2set_steps,
                   edge_hidden=o.edge_hidden, reuse_edge_network=o.reuse_edge_network)

    @classmethod
    def check(cls, cfg) -> list[str]:
        o, errors = cls.options_from(cfg), []
        if cfg.data.source != "qm9":
            errors.append(f"model.backbone.name=mpnn reads molecule graphs, and data.source={cfg.data.source} gives "
                          "images; set data.source=qm9 (or an image backbone, e.g. model.backbone.name=resnet18)")
        for key in ("dim", "steps", "set2set_steps", "edge_hidden"):
            if getattr(o, key) < 1:
                errors.append(f"model.backbone.options.{key}: must be >= 1 (got {getattr(o, key)})")
        return errors

    @property
    def feature_dim(self) -> int:
        return self.dim

    def feature_shape(self, cfg) -> tuple[int, ...]:
        return (self.dim,)

    def forward(self, data) -> torch.Tensor:
        out = F.relu(self.lin0(data.x))
        h = out.unsqueeze(0)
        weight = self.conv.edge_weights(data.edge_attr) if self.reuse_edge_network else None
        for _ in range(self.steps):
            if self.reuse_edge_network:
                m = F.relu(self.conv(out, data.edge_index, weight))
            else:
                m = F.relu(self.conv(out, data.edge_index, data.edge_attr))
            out, h = self.gru(m.unsqueeze(0), h)
            out = out.squeeze(0)
        pooled = self.set2set(out, data.batch, dim_size=int(data.num_graphs))
        return F.relu(self.lin1(pooled))


def _graph(cfg) -> str:
    """``data.qm9.graph`` (complete | bond)."""
    qm9 = cfg.data.get("qm9") or {}
    return qm9.get("graph", "complete") if hasattr(qm9, "get") else "complete"
