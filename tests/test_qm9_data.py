"""QM9 from qm9pack's CSV equals what PyG's own ``QM9.process()`` makes of the same molecules; the targets' units and
atom references; the cache; the papers' split and standardisation; bad input."""

from __future__ import annotations

import importlib.util
import os
import socket
import urllib.request

import pytest
import torch

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from mtl.data import qm9  # noqa: E402
from mtl.errors import DataError  # noqa: E402

# A handful of molecules covering each case: methane, ammonia, water, acetylene (its CSV writes "1." and "0."),
# HCN (triple bond), a fluorine molecule, a ring RDKit perceives as aromatic (kekulised), a strained bicycle whose
# bonds need Hückel connectivity, and the one of the first 3,000 whose bond orders come from its SMILES.
INDICES = (1, 2, 3, 4, 5, 105, 184, 889, 1642)


@pytest.fixture(scope="module")
def rows():
    return [r for r in qm9.read_csv_rows(qm9.qm9pack_folder(), limit=max(INDICES)) if r["Index"] in INDICES]


@pytest.fixture(scope="module")
def ours(rows):
    graphs, report = qm9.build_from_rows(rows)
    return graphs, report


def write_pyg_raw(raw_dir, rows, graphs):
    """The three raw files PyG's ``QM9.process()`` reads, for the molecules of ``rows`` at their QM9 positions:
    the other positions up to the largest index hold a filler molecule listed in uncharacterized.txt (so PyG skips
    them, as it skips QM9's 3,054 uncharacterised molecules), which keeps PyG's ``idx`` the QM9 index - 1."""
    from rdkit import Chem

    os.makedirs(raw_dir)
    by_index = {int(r["Index"]): (r, g) for r, g in zip(rows, graphs)}
    filler = Chem.AddHs(Chem.MolFromSmiles("C"))
    from rdkit.Chem import AllChem

    AllChem.EmbedMolecule(filler, randomSeed=0)
    n = max(by_index)
    sdf, csv, skip = [], ["mol_id,A,B,C,mu,alpha,homo,lumo,gap,r2,zpve,u0,u298,h298,g298,cv,"
                          "u0_atom,u298_atom,h298_atom,g298_atom"], []
    for index in range(1, n + 1):
        if index not in by_index:
            block, values = Chem.MolToMolBlock(filler), [0.0] * 19
            skip.append(index)
        else:
            row, _ = by_index[index]
            elements, xyz, props = qm9.parse_row(row)
            mol = qm9.perceive(elements, xyz, row["SMILES"], f"Index={index}").mol
            block = Chem.MolToMolBlock(mol)  # Kekulé, coordinates to 4 decimals, as gdb9.sdf
            counts = [elements.count(e) for e in qm9.ELEMENTS]
            # MoleculeNet's gdb9.sdf.csv: A, B, C first, energies in hartree, atomisation energies in kcal/mol
            atom = [(props[t] - sum(c * r for c, r in zip(counts, qm9.ATOM_REFS_HARTREE[t]))) * 627.509
                    for t in ("U0", "U", "H", "G")]
            values = [props[t] for t in ("A", "B", "C", "mu", "alpha", "homo", "lumo", "gap", "r2", "zpve",
                                         "U0", "U", "H", "G", "Cv")] + atom
        sdf.append(f"gdb_{index}" + block[block.index("\n"):] + "$$$$\n")
        csv.append(",".join([f"gdb_{index}"] + [repr(float(v)) for v in values]))
    with open(os.path.join(raw_dir, "gdb9.sdf"), "w") as f:
        f.write("".join(sdf))
    with open(os.path.join(raw_dir, "gdb9.sdf.csv"), "w") as f:
        f.write("\n".join(csv) + "\n")
    with open(os.path.join(raw_dir, "uncharacterized.txt"), "w") as f:
        f.write("".join(f"header {i}\n" for i in range(9)))
        f.write("".join(f"  {i}  filler\n" for i in skip))
        f.write("footer\n")


@pytest.fixture
def no_network(monkeypatch):
    """Every way out of the machine raises and is recorded."""
    tried = []

    def refuse(*args, **kwargs):
        tried.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    import torch_geometric.datasets.qm9 as pyg_qm9

    monkeypatch.setattr(pyg_qm9, "download_url", refuse)
    return tried


def test_our_graphs_equal_pyg_processing_of_the_same_molecules(tmp_path, rows, ours, no_network):
    from torch_geometric.datasets import QM9

    graphs, report = ours
    assert [r["Index"] for r in rows] == list(INDICES)
    write_pyg_raw(tmp_path / "pyg" / "raw", rows, graphs)
    pyg = QM9(str(tmp_path / "pyg"))
    assert no_network == [], "PyG tried the network"
    assert os.path.isfile(tmp_path / "pyg" / "processed" / "data_v3.pt"), "PyG did not process the raw files"
    assert len(pyg) == len(graphs) == len(INDICES)
    for mine, theirs in zip(graphs, pyg):
        assert mine.name == theirs.name and int(mine.idx) == int(theirs.idx)
        assert torch.equal(mine.x, theirs.x), mine.name
        assert torch.equal(mine.z, theirs.z), mine.name
        assert torch.equal(mine.edge_index, theirs.edge_index), mine.name
        assert torch.equal(mine.edge_attr, theirs.edge_attr), mine.name
        assert torch.equal(mine.y, theirs.y), (mine.name, mine.y - theirs.y)
        torch.testing.assert_close(mine.pos, theirs.pos, rtol=0, atol=1e-6)
    # the molecules cover each way of finding the bonds (a test that exercised only the easy path proves little)
    assert (report.geometry, report.geometry_hueckel, report.smiles) == (7, 1, 1)
    assert report.smiles_indices == [1642]
    # the cases are what the comment says: a triple bond, an F, a kekulised aromatic ring (double bonds in a ring)
    by_name = {g.name: g for g in graphs}
    assert by_name["gdb_4"].edge_attr[:, 2].sum() == 2 and by_name["gdb_5"].edge_attr[:, 2].sum() == 2
    assert by_name["gdb_184"].x[:, 4].sum() > 0
    assert by_name["gdb_889"].edge_attr[:, 1].sum() >= 4
    # PyG's folder reads back as the same graphs (for users who already have it)
    stored = qm9.load_pyg_root(str(tmp_path / "pyg"))
    assert len(stored) == len(graphs) and torch.equal(stored.y, torch.cat([g.y for g in graphs]))
    assert no_network == []


def test_atom_references_are_pygs_and_moleculenets():
    """Our hartree atom references are PyG's eV ones over one conversion factor (20 values), and give methane's
    atomisation energies as MoleculeNet's gdb9.sdf.csv has them (kcal/mol, its first line)."""
    from torch_geometric.datasets.qm9 import atomrefs

    ratios = torch.tensor([a / r for t, k in zip((7, 8, 9, 10), ("U0", "U", "H", "G"))
                           for a, r in zip(atomrefs[t], qm9.ATOM_REFS_HARTREE[k])], dtype=torch.float64)
    assert float((ratios.max() - ratios.min()) / ratios.mean()) < 1e-9
    methane = {"U0": -40.47893, "U": -40.476062, "H": -40.475117, "G": -40.498597, "A": 157.7118, "B": 157.70997,
               "C": 157.70699}
    props = {t: 0.0 for t in qm9.CSV_PROPERTIES} | methane
    raw = qm9.raw_targets(props, ["C", "H", "H", "H", "H"])
    moleculenet = [-395.999594594, -398.643290011, -401.014646522, -372.471772148]
    assert raw[12:16] == pytest.approx(moleculenet, abs=1e-8)
    assert raw[16:] == [157.7118, 157.70997, 157.70699]


def test_pyg_units_and_paper_columns():
    """PyG's conversion is its own (read from the installed package), and the 11 tasks are Nash-MTL's columns."""
    from torch_geometric.datasets.qm9 import conversion

    assert torch.equal(qm9.pyg_conversion(), conversion)
    columns, scale = qm9.paper_columns()
    assert columns == [0, 1, 2, 3, 5, 6, 12, 13, 14, 15, 11]
    assert [qm9.PAPER_UNITS[t] for t in qm9.PAPER_TASKS] == ["D", "a0^3", "meV", "meV", "a0^2", "meV", "meV", "meV",
                                                             "meV", "meV", "cal/(mol K)"]
    assert scale.tolist() == [1, 1, 1000, 1000, 1, 1000, 1000, 1000, 1000, 1000, 1]


def test_the_cache_is_read_the_second_time_and_rebuilt_when_its_inputs_change(tmp_path, monkeypatch):
    first = qm9.load_qm9pack(str(tmp_path), limit=20, log=lambda m: None)
    assert len(first) == 20 and os.path.isfile(first.path)
    built = []
    real = qm9.build_from_rows
    monkeypatch.setattr(qm9, "build_from_rows", lambda rows: built.append(1) or real(rows))
    again = qm9.load_qm9pack(str(tmp_path), limit=20, log=lambda m: None)
    assert built == [] and again.path == first.path and torch.equal(again.y, first.y)
    assert again.report == first.report
    monkeypatch.setattr(qm9, "processing_digest", lambda: "edited")  # as an edit of mtl/data/qm9.py would
    rebuilt = qm9.load_qm9pack(str(tmp_path), limit=20, log=lambda m: None)
    assert built == [1] and rebuilt.path != first.path


def test_a_cache_whose_key_does_not_match_is_not_read(tmp_path, monkeypatch):
    first = qm9.load_qm9pack(str(tmp_path), limit=5, log=lambda m: None)
    meta = first.path[:-3] + ".json"
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:
        f.write(text.replace('"key": "', '"key": "stale'))
    built = []
    real = qm9.build_from_rows
    monkeypatch.setattr(qm9, "build_from_rows", lambda rows: built.append(1) or real(rows))
    qm9.load_qm9pack(str(tmp_path), limit=5, log=lambda m: None)
    assert built == [1]


def test_missing_package_wrong_root_and_a_molecule_rdkit_rejects(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="data.qm9.root: .*is not a folder"):
        qm9.load_pyg_root(str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="processed/data_v3.pt does not exist"):
        qm9.load_pyg_root(str(tmp_path))
    (tmp_path / "processed").mkdir()
    (tmp_path / "processed" / "data_v3.pt").write_bytes(b"not a torch file")
    with pytest.raises(DataError, match="cannot be read as PyG's QM9"):
        qm9.load_pyg_root(str(tmp_path))
    # two carbons 5 Å apart with no hydrogens: no neutral molecule, and the SMILES does not fit
    with pytest.raises(DataError, match="Index=7: RDKit finds no bonds"):
        qm9.perceive(["C", "C"], [[0, 0, 0], [5, 0, 0]], "CC", "qm9pack molecule Index=7")
    with pytest.raises(DataError, match="Index=9: Elements .* do not describe"):
        qm9.parse_row({"Index": 9, "Elements": "['C','Xe']", "XYZ_Ang": "[[0,0,0],[1,0,0]]"})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataError, match="'qm9pack' is not installed .*pip install"):
        qm9.load_qm9pack(str(tmp_path), limit=1)


def test_paper_split_is_seeded_disjoint_and_sized():
    split = qm9.paper_split(130_831, seed=0)
    assert [len(split[k]) for k in ("test", "val", "train")] == [10_000, 10_000, 110_831]
    together = torch.cat([split["test"], split["val"], split["train"]])
    assert torch.equal(together.sort().values, torch.arange(130_831))
    assert torch.equal(qm9.paper_split(130_831, seed=0)["test"], split["test"])
    assert not torch.equal(qm9.paper_split(130_831, seed=1)["test"], split["test"])
    with pytest.raises(DataError, match="cannot give"):
        qm9.paper_split(20_000, seed=0)


def test_standardiser_uses_the_training_split_and_reports_original_units():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(500, 3, generator=g) * torch.tensor([2.0, 0.01, 300.0]) + torch.tensor([5.0, -1.0, 1e4])
    train, test = y[:400], y[400:]
    s = qm9.Standardiser.fit(train)
    torch.testing.assert_close(s.mean, train.mean(0))
    torch.testing.assert_close(s.std, train.std(0))
    z = s.encode(train)
    torch.testing.assert_close(z.mean(0), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(s.decode(s.encode(test)), test, rtol=1e-6, atol=1e-3)
    pred = test + torch.tensor([0.1, 0.002, -3.0])  # a known error per column, in original units
    mae = s.mae(s.encode(pred), s.encode(test), scale=torch.tensor([1.0, 1000.0, 1.0]))
    torch.testing.assert_close(mae, torch.tensor([0.1, 2.0, 3.0]), rtol=1e-3, atol=0)
    with pytest.raises(DataError, match="constant"):
        qm9.Standardiser.fit(torch.ones(10, 2))


@pytest.mark.slow
def test_the_bond_report_tool_on_a_sample(capsys):
    """Reads all of qm9pack's CSV (seconds): the sample's counts add up and the agreement line is printed."""
    from mtl.tools import qm9_bonds

    assert qm9_bonds.main(["--sample", "40", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    counts = [int(line.split()[1]) for line in out.splitlines()[1:1 + len(qm9.PERCEIVE_STEPS)]]
    assert sum(counts) == 40 and "agree with the SMILES" in out


def test_a_corrupt_cache_file_is_rebuilt_and_said(tmp_path):
    first = qm9.load_qm9pack(str(tmp_path), limit=3, log=lambda m: None)
    with open(first.path, "r+b") as f:
        f.truncate(100)
    said = []
    again = qm9.load_qm9pack(str(tmp_path), limit=3, log=said.append)
    assert "cannot be read" in said[0] and "rebuilding" in said[0]
    assert torch.equal(again.y, first.y) and len(again) == 3


def test_a_molecule_without_bond_orders_keeps_its_connectivity_and_is_listed():
    """As QM9's Index 133831 (a strained cage whose geometry has a bond more than its SMILES): here a carbon with
    five hydrogens. The build keeps it with single bonds and lists it; ``strict`` refuses it, naming it."""
    xyz = [[0, 0, 0], [1.09, 0, 0], [-1.09, 0, 0], [0, 1.09, 0], [0, -1.09, 0], [0, 0, 1.09]]
    found = qm9.perceive(["C"] + ["H"] * 5, xyz, "C", "qm9pack molecule Index=3")
    assert found.how == "connectivity_only" and found.mol.GetNumBonds() == 5
    graph = qm9.graph_of(found.mol, torch.zeros(1, 19), idx=2, name="gdb_3")
    assert graph.edge_attr[:, 0].sum() == 10 and graph.x[0, 10] == 5  # single bonds both ways, 5 H neighbours
    with pytest.raises(DataError, match="Index=3: RDKit finds no bonds"):
        qm9.perceive(["C"] + ["H"] * 5, xyz, "C", "qm9pack molecule Index=3", strict=True)
