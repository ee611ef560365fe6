"""The MPNN: its edge network computed once per forward equals PyG's NNConv recomputing it per step (outputs and
every gradient), it is computed once, the papers' sizes, and the papers' complete graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from torch_geometric.loader import DataLoader  # noqa: E402

from mtl.data import qm9  # noqa: E402
from mtl.models.backbones.mpnn import MPNN, EdgeNetConv  # noqa: E402


@pytest.fixture(scope="module")
def molecules():
    graphs, _ = qm9.build_from_rows(qm9.read_csv_rows(qm9.qm9pack_folder(), limit=24))
    return graphs


def batch_of(graphs, complete: bool):
    t = qm9.CompleteGraph() if complete else None
    return next(iter(DataLoader([t(g) if t else g for g in graphs], batch_size=len(graphs))))


@pytest.mark.parametrize("complete", [True, False])
def test_edge_network_once_equals_pyg_nnconv_per_step(molecules, complete):
    batch = batch_of(molecules[4:16], complete)
    torch.manual_seed(0)
    ours = MPNN(edge_features=batch.edge_attr.shape[1], dim=32)  # smaller than the papers' 64: the fast tier
    pyg = MPNN(edge_features=batch.edge_attr.shape[1], dim=32, reuse_edge_network=False)
    assert isinstance(ours.conv, EdgeNetConv) and type(pyg.conv).__name__ == "NNConv"
    pyg.load_state_dict(ours.state_dict())  # the same keys: a checkpoint of one loads into the other
    calls = {"ours": 0, "pyg": 0}
    ours.conv.nn.register_forward_hook(lambda *a: calls.__setitem__("ours", calls["ours"] + 1))
    pyg.conv.nn.register_forward_hook(lambda *a: calls.__setitem__("pyg", calls["pyg"] + 1))
    f_ours, f_pyg = ours(batch), pyg(batch)
    assert calls == {"ours": 1, "pyg": 3}  # the saving: one edge-network pass instead of three
    assert f_ours.shape == (12, 32)
    torch.testing.assert_close(f_ours, f_pyg, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(f_ours)
    (f_ours * weights).sum().backward()
    (f_pyg * weights).sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), pyg.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_the_papers_sizes():
    """Nash-MTL's Net (dim 64, edge net 5 -> 128 -> 64x64, GRU, Set2Set(3), lin1 128 -> 64): its shared parameters."""
    m = MPNN()
    d, e = 64, 5
    expected = (11 * d + d  # lin0
                + e * 128 + 128 + 128 * d * d + d * d  # edge network
                + d * d + d  # NNConv root weight (no bias) and bias
                + 2 * (3 * d * d + 3 * d)  # GRU
                + 4 * d * (2 * d + d) + 2 * 4 * d  # Set2Set's LSTM (input 2d, hidden d)
                + 2 * d * d + d)  # lin1
    assert sum(p.numel() for p in m.parameters()) == expected
    assert m.set2set.processing_steps == 3 and m.steps == 3 and m.feature_dim == 64


def test_complete_graph(molecules):
    g = molecules[8]
    c = qm9.CompleteGraph()(g)
    n = g.num_nodes
    assert c.edge_index.shape == (2, n * (n - 1)) and c.edge_attr.shape == (n * (n - 1), 5)
    assert bool((c.edge_index[0] != c.edge_index[1]).all())
    pairs = {(int(i), int(j)): a for (i, j), a in zip(c.edge_index.t(), c.edge_attr)}
    assert len(pairs) == n * (n - 1)
    bonds = {(int(i), int(j)): a for (i, j), a in zip(g.edge_index.t(), g.edge_attr)}
    for (i, j), a in pairs.items():
        assert torch.equal(a[:4], bonds.get((i, j), torch.zeros(4))), (i, j)
        assert float(a[4]) == pytest.approx(float((g.pos[i] - g.pos[j]).norm()), abs=1e-5)
    assert torch.equal(g.edge_attr, molecules[8].edge_attr) and g.edge_attr.shape[1] == 4  # the input is untouched


@pytest.mark.slow
def test_the_edge_network_benchmark_tool(tmp_path, capsys):
    """Seconds: the papers' 64-wide model on complete graphs, both ways."""
    import json

    from mtl.tools import qm9_edge_network

    out = tmp_path / "edge.json"
    assert qm9_edge_network.main(["--molecules", "8", "--batch-size", "4", "--repeats", "1", "--device", "cpu",
                                  "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["graph"] == "complete" and result["batches"] == 2 and result["ratio_pyg_over_ours"] > 0
    assert f"{result['ratio_pyg_over_ours']:.2f}x" in capsys.readouterr().out


def test_the_mpnn_is_a_backbone_plug_in_with_options(molecules):
    """``model.backbone.name: mpnn`` finds it; its options are ``model.backbone.options``; it reads ``graph`` and its
    features are (dim,) per molecule, as ``feature_shape`` says."""
    from omegaconf import OmegaConf

    from mtl.config.schema import Config
    from mtl.models.backbones import backbone_types, build_backbone

    assert backbone_types()["mpnn"] is MPNN and MPNN.consumes == "graph"
    cfg = OmegaConf.structured(Config)
    cfg.data.source, cfg.model.backbone.name = "qm9", "mpnn"
    cfg.model.backbone.options = {"dim": 16, "steps": 2, "set2set_steps": 1}
    net = build_backbone(cfg)
    assert net.steps == 2 and net.set2set.processing_steps == 1 and net.feature_shape(cfg) == (16,)
    assert net(batch_of(molecules[:5], complete=True)).shape == (5, *net.feature_shape(cfg))
    cfg.model.backbone.options = {"dim": 0}
    assert "model.backbone.options.dim: must be >= 1 (got 0)" in MPNN.check(cfg)
    cfg.data.source = "synthetic"
    assert any("set data.source=qm9" in e for e in MPNN.check(cfg))


@pytest.mark.slow
def test_discovering_the_backbones_does_not_import_pyg():
    """An image run neither needs the qm9 extra nor pays PyG's import: the plug-in imports it when it is built. (A
    fresh interpreter: ~10 s here, the slow tier; tests/test_layout.py checks the same rule on the source.)"""
    import subprocess
    import sys

    from .conftest import ROOT

    code = ("import sys; from mtl.models.backbones import backbone_types; import mtl.setup.checks; "
            "assert 'mpnn' in backbone_types(); print('torch_geometric' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_missing_pyg_names_the_install(monkeypatch):
    import sys

    from mtl.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torch_geometric.nn", None)  # an import of it now raises ImportError
    with pytest.raises(ConfigError, match=r"model.backbone.name=mpnn needs torch_geometric.*pip install -e '.\[qm9\]'"):
        MPNN()
