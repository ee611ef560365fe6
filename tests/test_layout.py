"""The house rules of docs/architecture.md, checked on the source: the core never imports the tools, and a
tool uses the trainer only to build and run a run (``Trainer``), never to borrow one of its helpers."""

from __future__ import annotations

import ast
import os

from .conftest import ROOT

PACKAGE = os.path.join(ROOT, "mtl")


def imports(path: str) -> list[tuple[str, list[str]]]:
    """(module, names) for every ``import m`` and ``from m import a, b`` in the file (relative ones resolved)."""
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    package = rel.rsplit(".", 1)[0] if not rel.endswith("__init__") else rel[: -len(".__init__")]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def modules(folder: str = PACKAGE):
    for dirpath, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, ROOT), imports(path)


def test_the_core_never_imports_the_tools():
    bad = [(path, mod) for path, found in modules() if not path.startswith(os.path.join("mtl", "tools"))
           for mod, names in found
           if mod.startswith("mtl.tools") or (mod == "mtl" and "tools" in names)]
    assert not bad, bad


def test_only_the_trainer_and_the_tools_use_the_trainer_and_only_to_run_a_run():
    bad = []
    for path, found in modules():
        for mod, names in found:
            if mod != "mtl.run.trainer":
                continue
            in_tools = path.startswith(os.path.join("mtl", "tools"))
            if not in_tools or set(names) - {"Trainer"}:
                bad.append((path, names))
    assert not bad, bad


def test_the_rule_checker_sees_imports():
    """The two rules above would pass on a tree the checker cannot read: make sure it reads this one."""
    found = dict(modules())
    assert ("mtl.run.trainer", ["Trainer"]) in found[os.path.join("mtl", "tools", "bench", "strategies.py")]
    assert any(mod == "mtl.run.step" for mod, _ in found[os.path.join("mtl", "run", "trainer.py")])


def test_the_data_code_names_no_task():
    """Data sets give raw records and the collate asks the tasks (TaskHead.item_fields / collate_fields): nothing in
    mtl/data imports a task or model, or spells a field that only a task makes."""
    task_made = {"input_ids", "attention_mask", "target_ids", "references", "colour_label"}
    bad = []
    for path, found in modules(os.path.join(PACKAGE, "data")):
        bad += [(path, mod) for mod, _ in found if mod.startswith(("mtl.tasks", "mtl.models", "mtl.build"))]
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        bad += [(path, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in task_made]
    assert not bad, bad


OPTIONAL = ("torch_geometric", "rdkit", "qm9pack")  # the qm9 extra (pip install -e '.[qm9]')
QM9_FILES = {os.path.join("mtl", "data", "qm9.py"), os.path.join("mtl", "data", "qm9_source.py"),
             os.path.join("mtl", "models", "backbones", "mpnn.py"), os.path.join("mtl", "tools", "qm9_bonds.py"),
             os.path.join("mtl", "tools", "qm9_edge_network.py")}


def optional_imports(path: str) -> list[tuple[str, bool]]:
    """(module, at module level?) for every import of the qm9 extra's packages in the file. Module level: a
    statement of the file's body (or inside a top-level if/try/with), run when the module is imported."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    top = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        top.add(id(node))
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                      *[s for h in getattr(node, "handlers", []) for s in h.body]]
    out = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        out += [(n, id(node) in top) for n in names if n.split(".")[0] in OPTIONAL]
    return out


def test_only_the_qm9_files_import_the_qm9_extra_and_only_when_they_need_it():
    """torch_geometric, RDKit and qm9pack are an optional extra: only the QM9 modules import them, and only inside
    the functions that need them, so that importing any mtl module (the backbone registry imports mpnn.py for every
    run) works, and costs nothing, without the extra."""
    found = {os.path.relpath(os.path.join(d, n), ROOT): optional_imports(os.path.join(d, n))
             for d, _, names in os.walk(PACKAGE) for n in names if n.endswith(".py")}
    outside = {p: mods for p, mods in found.items() if mods and p not in QM9_FILES}
    eager = {p: [m for m, top in mods if top] for p, mods in found.items() if any(top for _, top in mods)}
    assert not outside, outside
    assert not eager, eager
    lazy = {os.path.join("mtl", "data", "qm9.py"), os.path.join("mtl", "models", "backbones", "mpnn.py")}
    assert all(found[p] for p in lazy), "the rule checker no longer sees the QM9 files' imports"
    tests = {n: optional_imports(os.path.join(ROOT, "tests", n)) for n in os.listdir(os.path.join(ROOT, "tests"))
             if n.endswith(".py")}
    assert not {n for n, mods in tests.items() if mods and not n.startswith("test_qm9_")}
