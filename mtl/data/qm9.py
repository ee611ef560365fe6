"""QM9 as the multi-task papers use it: one graph per molecule, built as PyG's ``datasets.QM9.process()`` builds it.

Two sources give the same graphs (``torch_geometric.data.Data``: ``x`` (N, 11), ``edge_index``, ``edge_attr`` (E, 4),
``y`` (1, 19), ``pos``, ``z``, ``idx``, ``name``):

- ``load_qm9pack()``: the CSV inside the ``qm9pack`` wheel (130,831 molecules: elements, DFT geometry, SMILES,
  properties). Bonds are perceived from the geometry with RDKit (``rdDetermineBonds``) and checked against the CSV's
  SMILES; a molecule whose perceived bonds disagree takes its bond orders from its SMILES (RDKit's
  ``AssignBondOrdersFromTemplate`` on the perceived connectivity), and one where that fails too keeps the
  geometry's bonds and is counted (``BuildReport``). Nothing is downloaded.
- ``load_pyg_root(root)``: PyG's own processed folder (``<root>/processed/data_v3.pt``), read directly (PyG's ``QM9``
  class would try to download the raw files when they are missing).

Node features, as PyG's processing makes them from the SDF (read with ``sanitize=False``): one-hot H/C/N/O/F, atomic
number, aromatic, sp, sp2, sp3, number of H neighbours. Unsanitised, RDKit sets neither aromaticity nor hybridisation,
so those four columns are 0 in PyG's data (pyg-team/pytorch_geometric#8370) and here; bonds are Kekulé
(single/double/triple; the aromatic one-hot is 0). Targets: PyG's 19 columns in PyG's units (eV for energies), the
atomisation energies from QM9's atom references exactly as the CSV PyG reads (kcal/mol, then PyG's factor to eV).

Processed graphs are cached (``cache_path``); the cache file's name holds a hash of everything the result depends
on (the CSV files' sizes and mtimes, the versions of qm9pack, RDKit, PyG and torch, and this module's source), so a
change to any of them builds a new file instead of reading a stale one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field

import torch

from mtl.errors import DataError

# PyG's 19 target columns (torch_geometric.datasets.QM9), in its order, with the unit each is in.
TARGETS = ("mu", "alpha", "homo", "lumo", "gap", "r2", "zpve", "U0", "U", "H", "G", "Cv",
           "U0_atom", "U_atom", "H_atom", "G_atom", "A", "B", "C")
UNITS = ("D", "a0^3", "eV", "eV", "eV", "a0^2", "eV", "eV", "eV", "eV", "eV", "cal/(mol K)",
         "eV", "eV", "eV", "eV", "GHz", "GHz", "GHz")
# The 11 tasks of Nash-MTL / LibMTL / FAMO (the gap is left out; U0, U, H, G are the atomisation energies), by
# task name -> PyG column, and the factor from PyG's unit to the unit the papers report (meV for energies).
PAPER_TASKS = {"mu": 0, "alpha": 1, "homo": 2, "lumo": 3, "r2": 5, "zpve": 6, "U0": 12, "U": 13, "H": 14, "G": 15,
               "Cv": 11}
PAPER_SCALE = {"homo": 1000.0, "lumo": 1000.0, "zpve": 1000.0, "U0": 1000.0, "U": 1000.0, "H": 1000.0, "G": 1000.0}
PAPER_UNITS = {t: ("meV" if t in PAPER_SCALE else UNITS[c]) for t, c in PAPER_TASKS.items()}

# PyG's conversions (torch_geometric/datasets/qm9.py).
HAR2EV = 27.211386246
KCALMOL2EV = 0.04336414
# QM9's atom reference energies (hartree; H, C, N, O, F) for U0, U, H, G: PyG's ``atomrefs`` are these times
# HAR2EV. The CSV PyG reads (MoleculeNet's gdb9.sdf.csv) has (E - sum of refs) * 627.509 kcal/mol.
ATOM_REFS_HARTREE = {
    "U0": (-0.500273, -37.846772, -54.583861, -75.064579, -99.718730),
    "U": (-0.498857, -37.845355, -54.582445, -75.063163, -99.717314),
    "H": (-0.497912, -37.844411, -54.581501, -75.062219, -99.716370),
    "G": (-0.510927, -37.861317, -54.598897, -75.079532, -99.733544),
}
HAR2KCALMOL = 627.509
ELEMENTS = ("H", "C", "N", "O", "F")
ATOMIC_NUMBER = {"H": 1, "C": 6, "N": 7, "O": 8, "F": 9}

# qm9pack's columns for PyG's 12 raw properties (mu .. Cv) and the rotational constants.
CSV_PROPERTIES = {
    "mu": "Dipole_debye", "alpha": "Polarizability_bohr3", "homo": "HOMO_au", "lumo": "LUMO_au",
    "gap": "HOMO_LUMO_gap_au", "r2": "R2_bohr2", "zpve": "ZPVE_au", "U0": "InternalEnergy_0K_au",
    "U": "InternalEnergy_298K_au", "H": "Enthalphy_298K_au", "G": "GibbsFreeEnergy_298K_au",
    "Cv": "Heatcapacity_Cv_cal_mol_K", "A": "RotA_GHz", "B": "RotB_GHz", "C": "RotC_GHz",
}
CSV_COLUMNS = ("Index", "SMILES", "Elements", "XYZ_Ang", *CSV_PROPERTIES.values())
CSV_FILES = ("qm9_part1.csv", "qm9_part2.csv", "qm9_part3.csv")
INSTALL_HINT = "pip install -e '.[qm9]' (qm9pack, torch-geometric, rdkit)"


# ---------------------------------------------------------------------------------------------------------------
# Targets


def raw_targets(props: dict, elements: list[str]) -> list[float]:
    """PyG's 19 raw values of one molecule, in the order and units of the CSV PyG reads (before its conversion):
    mu .. Cv as QM9 gives them (hartree for energies), atomisation energies in kcal/mol, A, B, C in GHz."""
    counts = [elements.count(e) for e in ELEMENTS]
    atom = [(props[t] - sum(n * r for n, r in zip(counts, ATOM_REFS_HARTREE[t]))) * HAR2KCALMOL
            for t in ("U0", "U", "H", "G")]
    return [props[t] for t in TARGETS[:12]] + atom + [props[t] for t in ("A", "B", "C")]


def pyg_conversion() -> torch.Tensor:
    """PyG's factors from the raw values (``raw_targets``) to its units (float32, as PyG multiplies)."""
    return torch.tensor([1., 1., HAR2EV, HAR2EV, HAR2EV, 1., HAR2EV, HAR2EV, HAR2EV, HAR2EV, HAR2EV, 1.,
                         KCALMOL2EV, KCALMOL2EV, KCALMOL2EV, KCALMOL2EV, 1., 1., 1.])


def targets_in_pyg_units(raw: list[float]) -> torch.Tensor:
    """(1, 19) float32, computed as PyG computes it (float32 values times float32 factors)."""
    return (torch.tensor([raw], dtype=torch.float) * pyg_conversion().view(1, -1))


# ---------------------------------------------------------------------------------------------------------------
# One molecule


@functools.cache  # once: RDLogger.DisableLog costs milliseconds, and this runs several times per molecule
def rdkit_modules():
    try:
        from rdkit import Chem, RDLogger
        from rdkit.Chem import AllChem, rdDetermineBonds
    except ImportError as e:
        raise DataError(f"QM9 needs RDKit, which is not installed ({e}) — {INSTALL_HINT}") from None
    RDLogger.DisableLog("rdApp.*")
    return Chem, AllChem, rdDetermineBonds


def xyz_block(elements: list[str], xyz: list[list[float]]) -> str:
    # fixed-point: RDKit's XYZ parser rejects exponents ("-7.7e-05"), which the CSV has
    return f"{len(elements)}\n\n" + "\n".join(f"{e} {x:.10f} {y:.10f} {z:.10f}" for e, (x, y, z) in zip(elements, xyz))


def canonical_smiles(mol) -> str:
    """Heavy-atom canonical SMILES without stereo: what the geometry's bonds and the CSV's SMILES are compared on."""
    Chem, _, _ = rdkit_modules()
    return Chem.MolToSmiles(Chem.RemoveAllHs(mol, sanitize=True), isomericSmiles=False)


@contextlib.contextmanager
def quiet_c_stderr(quiet: bool):
    """Hückel connectivity (YAeHMOP) prints "Distance between atoms ... is suspicious" from C for ordinary O-H bonds,
    thousands of lines over QM9: send the C library's stderr to /dev/null for that call (its failures are
    exceptions, which pass)."""
    if not quiet:
        yield
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@dataclass
class Perceived:
    mol: object  # RDKit Mol, Kekulé bonds, atoms in the CSV's (geometry's) order
    how: str  # which step of ``perceive`` found the bonds: one of PERCEIVE_STEPS


# How ``perceive`` finds a molecule's bonds, in order: the geometry (rdDetermineBonds), the geometry with Hückel
# connectivity (strained small rings, where covalent radii join bridgeheads), the SMILES' bond orders on the
# geometry's connectivity; if none agrees with the SMILES, the geometry's bonds are kept; and if RDKit finds no
# bond orders for the geometry at all and the SMILES does not fit its connectivity (a strained cage where the
# geometry has one bond more than the SMILES), the connectivity with single bonds. The last two are counted and
# listed (BuildReport) so that the data set keeps every molecule, as PyG's does.
PERCEIVE_STEPS = ("geometry", "geometry_hueckel", "smiles", "geometry_disagrees", "connectivity_only")


def perceive(elements: list[str], xyz: list[list[float]], smiles: str, where: str, strict: bool = False) -> Perceived:
    """The molecule's bonds from its geometry, checked against its SMILES (``PERCEIVE_STEPS``). ``where`` names
    the molecule in errors. Raises DataError when RDKit cannot read the geometry, or finds no bond at all in it,
    or (``strict``) finds no bond orders that make a neutral molecule and the SMILES does not fit either."""
    Chem, AllChem, rdDetermineBonds = rdkit_modules()
    mol = Chem.MolFromXYZBlock(xyz_block(elements, xyz))
    if mol is None:
        raise DataError(f"{where}: RDKit cannot read its geometry (elements {elements})")
    parsed = Chem.MolFromSmiles(smiles)
    reference = None if parsed is None else Chem.MolToSmiles(parsed, isomericSmiles=False)
    fallback = None
    for how, hueckel in (("geometry", False), ("geometry_hueckel", True)):
        geometry = Chem.Mol(mol)
        try:
            with quiet_c_stderr(hueckel):
                rdDetermineBonds.DetermineBonds(geometry, charge=0, useHueckel=hueckel)
        except Exception:  # noqa: BLE001 - RDKit raises several types when no bond orders fit
            continue
        if reference is not None and canonical_smiles(geometry) == reference:
            return Perceived(kekule(geometry), how)
        fallback = fallback or geometry
    if parsed is not None:
        template = Chem.AddHs(parsed)
        for hueckel in (False, True):
            try:
                connected = Chem.Mol(mol)
                with quiet_c_stderr(hueckel):
                    rdDetermineBonds.DetermineConnectivity(connected, charge=0, useHueckel=hueckel)
                assigned = AllChem.AssignBondOrdersFromTemplate(template, connected)
                Chem.SanitizeMol(assigned)
            except Exception:  # noqa: BLE001 - the connectivity does not match the SMILES
                continue
            if canonical_smiles(assigned) == reference:
                return Perceived(kekule(assigned), "smiles")
    if fallback is not None:
        return Perceived(kekule(fallback), "geometry_disagrees")
    if not strict:
        connected = Chem.Mol(mol)
        rdDetermineBonds.DetermineConnectivity(connected, charge=0)
        if connected.GetNumBonds():
            return Perceived(connected, "connectivity_only")
    raise DataError(f"{where}: RDKit finds no bonds for its geometry that make a neutral molecule, and its "
                    f"SMILES {smiles!r} does not fit the geometry's connectivity")


def kekule(mol):
    Chem, _, _ = rdkit_modules()
    mol = Chem.Mol(mol)
    Chem.Kekulize(mol, clearAromaticFlags=True)
    return mol


def graph_of(mol, y: torch.Tensor, idx: int, name: str):
    """The PyG graph of a Kekulé molecule, built as ``torch_geometric.datasets.QM9.process()`` builds it from its
    unsanitised SDF (so no aromaticity and no hybridisation: those columns are 0)."""
    from torch_geometric.data import Data
    from torch_geometric.utils import one_hot, scatter
    Chem, _, _ = rdkit_modules()
    bond_index = {Chem.BondType.SINGLE: 0, Chem.BondType.DOUBLE: 1, Chem.BondType.TRIPLE: 2,
                  Chem.BondType.AROMATIC: 3}
    n = mol.GetNumAtoms()
    symbols = [a.GetSymbol() for a in mol.GetAtoms()]
    z = torch.tensor([ATOMIC_NUMBER[s] for s in symbols], dtype=torch.long)
    rows, cols, types = [], [], []
    for bond in mol.GetBonds():
        a, b = bond.GetBeginAtomIdx(), bond.GetEndAtomIdx()
        rows += [a, b]
        cols += [b, a]
        types += 2 * [bond_index[bond.GetBondType()]]
    edge_index = torch.tensor([rows, cols], dtype=torch.long).view(2, -1)
    edge_type = torch.tensor(types, dtype=torch.long)
    perm = (edge_index[0] * n + edge_index[1]).argsort()
    edge_index, edge_type = edge_index[:, perm], edge_type[perm]
    num_hs = scatter((z == 1).float()[edge_index[0]], edge_index[1], dim_size=n, reduce="sum")
    zeros = torch.zeros(n)  # aromatic, sp, sp2, sp3: unset in an unsanitised molecule, as in PyG's processing
    x = torch.cat([one_hot(torch.tensor([ELEMENTS.index(s) for s in symbols]), num_classes=5),
                   torch.stack([z.float(), zeros, zeros, zeros, zeros, num_hs], dim=1)], dim=-1)
    # 4 decimals, as in the SDF PyG reads (gdb9.sdf, written by Open Babel)
    pos = torch.tensor(mol.GetConformer().GetPositions(), dtype=torch.float64).round(decimals=4).float()
    return Data(x=x, z=z, pos=pos, edge_index=edge_index, edge_attr=one_hot(edge_type, num_classes=4),
                y=y, name=name, idx=idx)


# ---------------------------------------------------------------------------------------------------------------
# The qm9pack source


def qm9pack_folder() -> str:
    """The folder of qm9pack's CSV files (found without importing qm9pack, which imports pandas and setuptools)."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"QM9: the package 'qm9pack' is not installed — {INSTALL_HINT}")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    for name in CSV_FILES:
        if not os.path.isfile(os.path.join(folder, name)):
            raise DataError(f"QM9: {os.path.join(folder, name)} is missing from the installed qm9pack — reinstall "
                            f"it ({INSTALL_HINT})")
    return folder


def read_csv_rows(folder: str, limit: int | None = None) -> list[dict]:
    """qm9pack's molecules (the columns this module reads), sorted by their QM9 index (PyG's order)."""
    try:
        import pandas as pd
    except ImportError as e:
        raise DataError(f"QM9: reading qm9pack's CSV needs pandas ({e}) — {INSTALL_HINT}") from None
    frames = []
    for name in CSV_FILES:
        path = os.path.join(folder, name)
        try:
            frames.append(pd.read_csv(path, usecols=list(CSV_COLUMNS), nrows=limit))
        except ValueError as e:  # a missing column
            raise DataError(f"QM9: {path}: {e} — this qm9pack's CSV lacks columns QM9 needs "
                            f"({', '.join(CSV_COLUMNS)})") from None
        if limit is not None and sum(len(f) for f in frames) >= limit:
            break
    df = pd.concat(frames, ignore_index=True).sort_values("Index", kind="stable")
    if limit is not None:
        df = df.iloc[:limit]
    return df.to_dict("records")


BARE_POINT = re.compile(r"\.(?=[,\]])")


def parse_row(row: dict) -> tuple[list[str], list[list[float]], dict]:
    where = f"qm9pack molecule Index={row['Index']}"
    try:
        elements = json.loads(row["Elements"].replace("'", '"'))
        xyz = json.loads(BARE_POINT.sub(".0", row["XYZ_Ang"]))  # the CSV writes "1." and "0."
    except (ValueError, AttributeError) as e:
        raise DataError(f"{where}: its Elements/XYZ_Ang cannot be read ({e})") from None
    bad = sorted(set(elements) - set(ELEMENTS))
    if bad or len(xyz) != len(elements) or any(len(p) != 3 for p in xyz):
        raise DataError(f"{where}: Elements {elements} and XYZ_Ang ({len(xyz)} rows) do not describe a QM9 molecule"
                        + (f" (elements {bad} are not H, C, N, O, F)" if bad else ""))
    props = {t: float(row[c]) for t, c in CSV_PROPERTIES.items()}
    return elements, xyz, props


@dataclass
class BuildReport:
    """How the bonds of each molecule were found (``perceive``): counts, and the QM9 indices of the rest."""

    molecules: int = 0
    geometry: int = 0  # rdDetermineBonds' bonds, equal to the SMILES'
    geometry_hueckel: int = 0  # the same with Hückel connectivity
    smiles: int = 0  # bond orders from the SMILES on the geometry's connectivity
    geometry_disagrees: int = 0  # none of them: the geometry's bonds are kept
    connectivity_only: int = 0  # no bond orders found: the geometry's connectivity, single bonds
    smiles_indices: list = field(default_factory=list)  # QM9 indices (1-based) of the last three kinds
    disagree_indices: list = field(default_factory=list)
    connectivity_indices: list = field(default_factory=list)

    def agreement(self) -> float:
        """The share of molecules whose bonds perceived from the geometry alone agree with the SMILES."""
        return (self.geometry + self.geometry_hueckel) / max(1, self.molecules)


def build_from_rows(rows: list[dict]):
    """Graphs and the BuildReport from qm9pack rows (``read_csv_rows``)."""
    report, graphs = BuildReport(), []
    for row in rows:
        elements, xyz, props = parse_row(row)
        index = int(row["Index"])
        found = perceive(elements, xyz, str(row["SMILES"]), f"qm9pack molecule Index={index}")
        report.molecules += 1
        setattr(report, found.how, getattr(report, found.how) + 1)
        if found.how == "smiles":
            report.smiles_indices.append(index)
        elif found.how == "geometry_disagrees":
            report.disagree_indices.append(index)
        elif found.how == "connectivity_only":
            report.connectivity_indices.append(index)
        y = targets_in_pyg_units(raw_targets(props, elements))
        graphs.append(graph_of(found.mol, y, idx=index - 1, name=f"gdb_{index}"))
    return graphs, report


def processing_digest() -> str:
    """A hash of this module's source: any change to the processing makes a new cache."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_key(folder: str, limit: int | None) -> str:
    """A hash of everything the processed graphs depend on."""
    parts = {"processing": processing_digest(), "limit": limit}
    for name in CSV_FILES:
        st = os.stat(os.path.join(folder, name))
        parts[name] = [st.st_size, st.st_mtime_ns]
    for package in ("qm9pack", "rdkit", "torch_geometric", "torch"):
        try:
            parts[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            parts[package] = None
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtl", "qm9")


def cache_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"qm9pack_{key}.pt")


class QM9Graphs:
    """The processed graphs (PyG's InMemoryDataset storage): ``len``, ``[i]`` -> Data, ``y`` (n, 19), ``report``
    (a BuildReport, or None for PyG's folder) and ``path`` (the file they were read from)."""

    def __init__(self, dataset, report: BuildReport | None, path: str):
        self.dataset, self.report, self.path = dataset, report, path

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    @property
    def y(self) -> torch.Tensor:
        return self.dataset._data.y


def _in_memory(path: str):
    """PyG's storage file at ``path`` as an InMemoryDataset (no root: it never downloads or processes)."""
    from torch_geometric.data import InMemoryDataset

    stored = InMemoryDataset(None)
    stored.load(path)
    return stored


def _read_sidecar(meta: str, log) -> dict | None:
    """The cache's sidecar (its key and build report), or None, said, when it is truncated, empty or not a JSON
    object (a killed write, a full disk): the cache is then rebuilt, as for a truncated ``.pt``."""
    try:
        with open(meta, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        log(f"QM9: the cache's sidecar {meta} cannot be read ({type(e).__name__}: {e}); rebuilding the cache")
        return None
    if not isinstance(stored, dict):
        log(f"QM9: the cache's sidecar {meta} is not a JSON object; rebuilding the cache")
        return None
    return stored


def load_qm9pack(cache_dir: str | None = None, limit: int | None = None, log=print) -> QM9Graphs:
    """QM9 from qm9pack's CSV (``limit``: only the first molecules, for tests), built once and cached in
    ``cache_dir`` (default ``$XDG_CACHE_HOME/mtl/qm9`` or ``~/.cache/mtl/qm9``)."""
    try:
        from torch_geometric.data import InMemoryDataset
    except ImportError as e:
        raise DataError(f"QM9 needs torch_geometric, which is not installed ({e}) — {INSTALL_HINT}") from None
    folder = qm9pack_folder()
    cache_dir = cache_dir or default_cache_dir()
    key = cache_key(folder, limit)
    path = cache_path(cache_dir, key)
    meta = path[:-3] + ".json"
    stored = _read_sidecar(meta, log) if os.path.isfile(path) and os.path.isfile(meta) else None
    if stored is not None and stored.get("key") == key:
        try:
            return QM9Graphs(_in_memory(path), BuildReport(**stored["report"]), path)
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt cache file: say so and rebuild it
            log(f"QM9: the cache {path} cannot be read ({type(e).__name__}: {e}); rebuilding it")
    log(f"QM9: building the graphs from qm9pack's CSV ({folder}) into {path} (once; a few minutes for all of it)")
    rdkit_modules()
    graphs, report = build_from_rows(read_csv_rows(folder, limit))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    InMemoryDataset.save(graphs, tmp)
    os.replace(tmp, path)
    with open(meta + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"key": key, "report": asdict(report)}, f)
    os.replace(meta + ".tmp", meta)
    return QM9Graphs(_in_memory(path), report, path)


def load_pyg_root(root: str) -> QM9Graphs:
    """PyG's processed QM9 (``<root>/processed/data_v3.pt``, as ``torch_geometric.datasets.QM9(root)`` writes it)."""
    path = os.path.join(root, "processed", "data_v3.pt")
    if not os.path.isdir(root):
        raise DataError(f"data.qm9.root: {root!r} is not a folder — give the root of PyG's QM9 (the folder holding "
                        "processed/data_v3.pt), or leave it empty to build QM9 from qm9pack")
    if not os.path.isfile(path):
        raise DataError(f"data.qm9.root: {path} does not exist — give the folder torch_geometric.datasets.QM9(root) "
                        "processed into (it writes processed/data_v3.pt), or leave it empty to build QM9 from qm9pack")
    try:
        stored = _in_memory(path)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise DataError(f"data.qm9.root: {path} cannot be read as PyG's QM9 ({type(e).__name__}: {e})") from None
    y = stored._data.y
    if y is None or y.dim() != 2 or y.shape[1] != len(TARGETS) or stored._data.x.shape[1] != 11:
        raise DataError(f"data.qm9.root: {path} is not PyG's QM9 (expected x with 11 features and y with "
                        f"{len(TARGETS)} columns)")
    return QM9Graphs(stored, None, path)


# ---------------------------------------------------------------------------------------------------------------
# The papers' complete graph


class CompleteGraph:
    """The papers' graph (Nash-MTL's ``Complete`` then ``T.Distance(norm=False)``): an edge for every ordered pair
    of distinct atoms, whose features are the bond's 4 type one-hots (zeros where there is no bond) and the
    distance in Å (5 features). A transform: ``CompleteGraph()(data)`` returns a new graph."""

    def __init__(self):
        from torch_geometric.transforms import Distance

        self.distance = Distance(norm=False)

    def __call__(self, data):
        from torch_geometric.utils import remove_self_loops

        data = data.clone()
        n = data.num_nodes
        full = torch.stack([torch.arange(n).repeat_interleave(n), torch.arange(n).repeat(n)])
        attr = data.edge_attr.new_zeros(n * n, data.edge_attr.shape[1])
        attr[data.edge_index[0] * n + data.edge_index[1]] = data.edge_attr
        data.edge_index, data.edge_attr = remove_self_loops(full, attr)
        return self.distance(data)


# ---------------------------------------------------------------------------------------------------------------
# The papers' split and standardisation


def paper_split(n: int, seed: int, test: int = 10_000, val: int = 10_000) -> dict[str, torch.Tensor]:
    """A seeded shuffle: the first ``test`` molecules for test, the next ``val`` for validation, the rest train."""
    if n <= test + val:
        raise DataError(f"QM9 split: {n} molecules cannot give {test} test and {val} validation ones and a training set")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return {"test": perm[:test], "val": perm[test:test + val], "train": perm[test + val:]}


@dataclass
class Standardiser:
    """Targets standardised with the training split's mean and std (as the papers); metrics back in report units."""

    mean: torch.Tensor  # (k,)
    std: torch.Tensor  # (k,)

    @classmethod
    def fit(cls, y_train: torch.Tensor) -> Standardiser:
        y = y_train.double()
        std = y.std(dim=0)
        if bool((std == 0).any()) or y.shape[0] < 2:
            raise DataError("QM9 standardisation: a target is constant on the training split (std 0), or the split "
                            "has fewer than 2 molecules")
        return cls(y.mean(dim=0).float(), std.float())

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        return (y - self.mean.to(y)) / self.std.to(y)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.std.to(z) + self.mean.to(z)

    def mae(self, pred_z: torch.Tensor, y_z: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Per-column MAE in original units (times ``scale``, e.g. 1000 for meV) of standardised predictions."""
        err = ((pred_z - y_z).abs() * self.std.to(pred_z)).mean(dim=0)
        return err if scale is None else err * scale.to(err)


def paper_columns(tasks=tuple(PAPER_TASKS)) -> tuple[list[int], torch.Tensor]:
    """The PyG columns of ``tasks`` and the factors to the papers' report units."""
    unknown = [t for t in tasks if t not in PAPER_TASKS]
    if unknown:
        raise DataError(f"QM9: unknown target(s) {unknown}; the tasks are {', '.join(PAPER_TASKS)}")
    return [PAPER_TASKS[t] for t in tasks], torch.tensor([PAPER_SCALE.get(t, 1.0) for t in tasks])
