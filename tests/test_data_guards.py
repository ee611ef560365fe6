"""Data that must not reach training or predict as it is (issue 36): a corrupt QM9 cache sidecar is rebuilt."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _qm9():
    pytest.importorskip("torch_geometric")
    pytest.importorskip("rdkit")
    if importlib.util.find_spec("qm9pack") is None:
        pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')")
    from mtl.data import qm9

    return qm9


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_corrupt_qm9_cache_sidecar_is_rebuilt_and_said(tmp_path, monkeypatch, damage):
    qm9 = _qm9()
    first = qm9.load_qm9pack(str(tmp_path), limit=3, log=lambda m: None)
    meta = first.path[:-3] + ".json"
    with open(meta, "r+b") as f:
        f.truncate(10 if damage == "truncated" else 0)
    built, said = [], []
    real = qm9.build_from_rows
    monkeypatch.setattr(qm9, "build_from_rows", lambda rows: built.append(1) or real(rows))
    again = qm9.load_qm9pack(str(tmp_path), limit=3, log=said.append)
    assert built == [1], "the cache was not rebuilt"
    assert "sidecar" in said[0] and meta in said[0] and "rebuilding" in said[0]
    assert torch.equal(again.y, first.y) and again.report == first.report
    with open(meta, encoding="utf-8") as f:
        assert f.read().startswith('{"key"')  # rewritten whole: the next load reads it
