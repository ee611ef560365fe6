"""mtl.tools.bench.solve_cost: the references it times compute what ours computes (so the ratio compares like with
like), and the tool prints its table. The timings themselves are the benchmark's (docs/benchmark.md), not a test's."""

from __future__ import annotations

import pytest
import torch

from mtl.tools.bench import solve_cost as sc
from mtl.weighting.base import gram_matrix


def _ours(method: str, rows: torch.Tensor) -> torch.Tensor:
    m = sc.build(method, rows.shape[0])
    m.begin_step(0)
    k = rows.shape[0]
    return m.weights_for_gram(gram_matrix(rows), torch.ones(k, dtype=torch.float64), torch.float64)


def test_the_references_compute_our_weights():
    for kind in ("random", "ill"):
        rows = sc.rows_for(kind, 2, 0)
        gram = gram_matrix(rows)
        # PCGrad at K = 2 has one order: TorchJD's weights and LibMTL's summed rows are ours exactly (to round-off)
        ours = _ours("pcgrad", rows)
        assert torch.allclose(sc.torchjd_pcgrad(gram, rows), ours, rtol=1e-12, atol=1e-12)
        assert torch.allclose(sc.libmtl_pcgrad(gram, rows), ours @ rows, rtol=1e-10, atol=1e-10)
    for k in (2, 11):
        rows = sc.rows_for("random", k, 1)
        gram = gram_matrix(rows)
        # CAGrad: LibMTL's SLSQP reaches the dual's optimum to its own tolerance; the update directions agree
        ours, ref = _ours("cagrad", rows) @ rows, torch.as_tensor(sc.libmtl_cagrad(gram, rows)) @ rows
        assert float((ours - ref).norm() / ours.norm()) < 1e-3, k


def test_torchjds_own_cagrad_computes_our_weights():
    """TorchJD 0.18's CAGrad (the library itself, the dev extra) solves the same dual with Clarabel: on random and
    ill-conditioned rows, in float32 and float64, its update is ours to its interior-point solver's tolerance."""
    pytest.importorskip("torchjd")
    assert sc.torchjd_installed(), "the dev extra installs torchjd[cagrad] (cvxpy, clarabel)"
    assert "TorchJD 0.18 (Clarabel)" in sc.REFERENCES["cagrad"]
    for kind in ("random", "ill"):
        for k in (2, 11):
            for dtype in (torch.float32, torch.float64):
                rows = sc.rows_for(kind, k, 0).to(dtype)
                gram = gram_matrix(rows)
                ours = sc.build("cagrad", k)
                ours.begin_step(0)
                d = ours.weights_for_gram(gram, None, dtype) @ rows.double()
                ref = sc.update(sc.torchjd_cagrad(gram.to(dtype), rows), rows)
                assert sc.ref_error("cagrad", d, ref) < 2e-3, (kind, k, dtype)


def test_the_tool_prints_a_row_per_case(capsys):
    assert sc.main(["--k", "2", "3", "--methods", "pcgrad", "nashmtl", "--kinds", "ill", "--dtypes", "float64",
                    "--rounds", "1", "--seeds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| pcgrad") or line.startswith("| nashmtl")]
    assert len(rows) == 6  # PCGrad: a row per reference (LibMTL, TorchJD) at each K; Nash-MTL: one, unreferenced
    pcgrad = [r for r in rows if r.startswith("| pcgrad")]
    assert sorted(r.split("|")[6].strip() for r in pcgrad) == ["LibMTL (rows)"] * 2 + ["TorchJD (Gram)"] * 2
    assert all(float(r.split("|")[-2]) > 0 and r.split("|")[-3].strip() == "-" for r in pcgrad)  # random order: no error
    assert all(r.rstrip().endswith("| none | - | - | - |") for r in rows if r.startswith("| nashmtl"))


def test_the_mgda_imtlg_and_alignedmtl_references_agree_with_ours():
    """LibMTL's IMTL-G and Aligned-MTL are exact solves: their updates are ours to round-off. MGDA's references stop
    early (TorchJD at tol 1e-3, LibMTL at an l1 move of 1e-5): their ||d|| is never below ours (certified the minimum)
    and within a few percent of it on random rows; the tool reports how far above as ``ref error``."""
    for k in (3, 11):
        rows = sc.rows_for("random", k, 2)
        gram = gram_matrix(rows)
        for method, ref in (("imtlg", sc.libmtl_imtl), ("alignedmtl", sc.libmtl_alignedmtl)):
            ours = _ours(method, rows) @ rows
            assert sc.ref_error(method, ours, sc.update(ref(gram, rows), rows)) < 1e-8, (method, k)
        ours = _ours("mgda", rows) @ rows
        for ref in (sc.torchjd_mgda, sc.libmtl_mgda):
            err = sc.ref_error("mgda", ours, sc.update(ref(gram, rows), rows))
            assert -1e-9 < err < 0.05, (ref.__name__, k, err)
