"""The house rules of docs/architecture.md, checked on the source: imports point one way (down the layers below),
the core never imports the tools, a tool uses the trainer only to build and run a run (``Trainer``), and an import
of an mtl module inside a function says why it is there."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

PACKAGE = os.path.join(ROOT, "mtl")

# The layers, bottom first: each a folder of mtl/ or a flat module (docs/architecture.md draws them, from this list and
# the code's imports). A module imports from its own folder and from the layers below its own; groups that share a
# layer are independent of each other. A module belongs to the longest group that names it ("mtl" is the package's
# __init__ alone).
LAYERS: list[tuple[str, ...]] = [
    ("mtl", "mtl.errors", "mtl.files"),  # nothing of mtl
    ("mtl.registry",),  # the one-file plug-in mechanism
    ("mtl.config",),  # the keys, their types and documentation, YAML and overrides: plain data
    ("mtl.parallel",),  # processes, DDP/FSDP2, AMP
    ("mtl.data",),  # raw records (a data set built once, by rank 0 first, waits on the ranks: parallel.dist)
    ("mtl.models",),  # backbones (plug-ins), the decoder, backbone + heads
    ("mtl.architectures",),  # how the features reach the heads (plug-ins): trunk + towers around a backbone
    ("mtl.tasks", "mtl.weighting"),  # task heads; weighting methods
    ("mtl.strategies",),  # how the per-task backward passes meet DDP (they call a weighting method)
    ("mtl.delta_m",),  # the tasks' metrics against baselines, in the papers' sign
    ("mtl.optim",),  # the learning rate that follows the validation delta-m; per-layer lr groups
    ("mtl.checkpoint",),  # what a run writes and reads back: checkpoint folders, the sharded state
    ("mtl.setup",),  # a config checked against the plug-ins; the run's pieces built from it
    ("mtl.run",),  # the run: step, loop, logs, signals, evaluation
    ("mtl.inference",),  # a trained model's use: load, predict, evaluate, export (and other libraries' layouts)
    ("mtl.bench",),  # the task-weighting benchmark: design, statistics, records, sweeps, launchers
    ("mtl.tools",),  # the command lines: nothing below imports them
]

# Imports that go against the layers, each with its reason (none today). Nothing else may.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _groups() -> dict[str, int]:
    """group -> its layer (a group of several modules is spelled with spaces between them)."""
    out = {}
    for i, layer in enumerate(LAYERS):
        for group in layer:
            out[group] = i
    return out


def group_of(module: str) -> str | None:
    """The group a dotted module name belongs to (the longest group naming it), or None."""
    best = None
    for group in _groups():
        for name in group.split():
            if (module == name or (name != "mtl" and module.startswith(name + "."))) and (best is None or len(name) > best[1]):
                best = (group, len(name))
    return best[0] if best else None


def module_name(path: str, root: str = ROOT) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


@functools.cache
def parsed(path: str) -> tuple[ast.Module, list[str]]:
    """A file's syntax tree and its lines (each file is read once per test session)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return ast.parse(text, path), text.splitlines()


@functools.cache
def imports(path: str, root: str = ROOT) -> list[tuple[str, list[str], ast.stmt, bool]]:
    """(module, names, node, inside a function) for every ``import m`` and ``from m import a, b`` in the file
    (relative ones resolved; ``from package import module`` gives ``package.module``)."""
    name = module_name(path, root)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    tree = parsed(path)[0]
    out = []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, [], child, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                subs = [a.name for a in child.names
                        if os.path.exists(os.path.join(root, *base.split("."), a.name + ".py"))
                        or os.path.isdir(os.path.join(root, *base.split("."), a.name))]
                out.extend((f"{base}.{s}", [], child, in_function) for s in subs)
                rest = [a.name for a in child.names if a.name not in subs]
                if rest or not subs:
                    out.append((base, rest, child, in_function))
            walk(child, inside)

    walk(tree, False)
    return out


def modules(folder: str = PACKAGE, root: str = ROOT):
    for dirpath, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield path, imports(path, root)


def layer_violations(folder: str = PACKAGE, root: str = ROOT) -> list[str]:
    """Every import of an mtl module that goes up the layers or sideways to another group of the same layer, and
    every module that belongs to no group."""
    layer = _groups()
    bad = []
    for path, found in modules(folder, root):
        me = module_name(path, root)
        mine = group_of(me)
        if mine is None:
            bad.append(f"{me}: in no layer of tests/test_layout.py (place it)")
            continue
        for mod, _, node, _ in found:
            if not (mod == "mtl" or mod.startswith("mtl.")):
                continue
            theirs = group_of(mod)
            if theirs is None or theirs == mine or (me, mod) in EXCEPTIONS:
                continue
            if layer[theirs] > layer[mine]:
                bad.append(f"{me}:{node.lineno} imports {mod}, a layer above it")
            elif layer[theirs] == layer[mine]:
                bad.append(f"{me}:{node.lineno} imports {mod}, another group of its layer")
    return bad


def test_imports_point_one_way():
    bad = layer_violations()
    assert not bad, "\n".join(bad)


def test_every_exception_is_still_needed():
    seen = {(module_name(path), mod) for path, found in modules() for mod, *_ in found}
    stale = [pair for pair in EXCEPTIONS if pair not in seen]
    assert not stale, f"exceptions no import needs any more (remove them): {stale}"


def test_the_layer_checker_sees_real_imports(tmp_path):
    """The rules above would pass on a tree the checker cannot read: it must see this tree's imports, and find an
    import up, one sideways and a module in no layer in a tree that has them."""
    found = {module_name(path): [mod for mod, *_ in f] for path, f in modules()}
    assert "mtl.run.step" in found["mtl.run.trainer"]
    assert "mtl.parallel.dist" in found["mtl.weighting.bilevel"]
    assert "mtl.registry" in found["mtl.strategies"]
    assert sum(len(v) for v in found.values()) > 200
    pkg = tmp_path / "mtl"
    for sub in ("data", "weighting", "tasks", "run"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "loader.py").write_text("def f():\n    from mtl.run import trainer\n")
    (pkg / "weighting" / "x.py").write_text("from ..tasks import base\n")
    (pkg / "tasks" / "base.py").write_text("")
    (pkg / "run" / "trainer.py").write_text("from mtl.data import loader\n")
    (pkg / "newroom.py").write_text("")
    bad = sorted(layer_violations(str(pkg), str(tmp_path)))
    assert bad == ["mtl.data.loader:2 imports mtl.run.trainer, a layer above it",
                   "mtl.newroom: in no layer of tests/test_layout.py (place it)",
                   "mtl.weighting.x:1 imports mtl.tasks.base, another group of its layer"], bad


def test_the_core_never_imports_the_tools():
    bad = [(path, mod) for path, found in modules() if not module_name(path).startswith("mtl.tools")
           for mod, names, *_ in found
           if mod.startswith("mtl.tools") or (mod == "mtl" and "tools" in names)]
    assert not bad, bad


def test_only_the_tools_use_the_trainer_and_only_to_run_a_run():
    bad = []
    for path, found in modules():
        for mod, names, *_ in found:
            if mod == "mtl.run.trainer" and (not module_name(path).startswith("mtl.tools") or set(names) - {"Trainer"}):
                bad.append((path, names))
    assert not bad, bad
    found = {module_name(path): [(mod, names) for mod, names, *_ in f] for path, f in modules()}
    assert ("mtl.run.trainer", ["Trainer"]) in found["mtl.tools.bench.strategies"]  # the checker sees them


def test_the_data_code_names_no_task():
    """Data sets give raw records and the collate asks the tasks (TaskHead.item_fields / collate_fields): nothing in
    mtl/data imports a task or model, or spells a field that only a task makes."""
    task_made = {"input_ids", "attention_mask", "target_ids", "references", "colour_label"}
    bad = []
    for path, found in modules(os.path.join(PACKAGE, "data")):
        bad += [(path, mod) for mod, *_ in found if mod.startswith(("mtl.tasks", "mtl.models", "mtl.setup.build"))]
        bad += [(path, n.value) for n in ast.walk(parsed(path)[0]) if isinstance(n, ast.Constant) and n.value in task_made]
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
# Files whose imports inside functions are not yet sorted (each is to move to the top or get its reason): how many
# they hold at most (none today). The numbers may only fall.
UNSORTED_IN_FUNCTION: dict[str, int] = {}
REASON = "# import here:"  # then why: the cycle it breaks, the optional dependency it guards, or the start-up it spares


def in_function_imports(folder: str = PACKAGE, root: str = ROOT) -> dict[str, list[tuple[int, bool]]]:
    """path (relative to root) -> (line, has its reason) of each import of an mtl module inside a function. The
    reason is a ``# import here: why`` comment on the import's first line or the line above it."""
    out: dict[str, list[tuple[int, bool]]] = {}
    for path, found in modules(folder, root):
        lines = parsed(path)[1]
        seen = set()
        for mod, _, node, in_function in found:
            if not in_function or not (mod == "mtl" or mod.startswith("mtl.")) or node.lineno in seen:
                continue
            seen.add(node.lineno)
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            said = any(REASON in text and text.split(REASON, 1)[1].strip() != ""
                       for text in (lines[node.lineno - 1], above if above.startswith("#") else ""))
            out.setdefault(os.path.relpath(path, root).replace(os.sep, "/"), []).append((node.lineno, said))
    return out


def test_an_import_inside_a_function_says_why():
    """An import inside a function hides an arrow from a reader: one is there only to break a cycle, to guard an
    optional dependency or to keep a thin tool's --help from loading torch, and says which (``# import here: ...``)."""
    bad = []
    for path, found in in_function_imports().items():
        unsaid = [line for line, said in found if not said]
        if path in UNSORTED_IN_FUNCTION:
            if len(unsaid) > UNSORTED_IN_FUNCTION[path]:
                bad.append(f"{path}: {len(unsaid)} imports inside functions without a reason, at most "
                           f"{UNSORTED_IN_FUNCTION[path]} allowed (lines {unsaid})")
        else:
            bad += [f"{path}:{line}: an import inside a function, without '{REASON} <why>'" for line in unsaid]
    assert not bad, "\n".join(bad)


def test_the_thin_tools_answer_help_without_loading_torch():
    """evaluate, predict and export import the model code only once their arguments parse (their reason above): their
    --help and usage errors take a tenth of a second, not the seconds torch and transformers take to load."""
    code = ("import sys, mtl.tools.evaluate, mtl.tools.predict, mtl.tools.export; "
            "print(sorted(m for m in ('torch', 'transformers', 'mtl.inference') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_the_in_function_checker_sees_them(tmp_path):
    found = in_function_imports()
    assert len(found["mtl/run/step_log.py"]) >= 1  # the tree's own (curves_png: matplotlib at the end of a run only)
    pkg = tmp_path / "mtl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef f():\n    from mtl import b\n    import json\n\n\n"
                              "def g():\n    # import here: mtl.b imports this module\n    from mtl.b import h\n"
                              "    from mtl.b import k  # import here:\n")
    (pkg / "b.py").write_text("")
    assert in_function_imports(str(pkg), str(tmp_path)) == {"mtl/a.py": [(5, False), (11, True), (12, False)]}


# check* functions that still raise, each with why it is not yet a verify_* (the count may only fall).
CHECKS_THAT_RAISE: dict[tuple[str, str], str] = {}


def raising_checks(folder: str = PACKAGE, root: str = ROOT) -> set[tuple[str, str]]:
    """(path, name) of every function named ``check``, ``check_*`` or ``_check_*`` with a ``raise`` of its own (not
    one in a function nested in it)."""
    out = set()
    for path, _ in modules(folder, root):
        for node in ast.walk(parsed(path)[0]):
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and re.fullmatch(r"_?check(_\w+)?", node.name)):
                continue
            stack = list(node.body)
            while stack:
                child = stack.pop()
                if isinstance(child, ast.Raise):
                    out.add((os.path.relpath(path, root).replace(os.sep, "/"), node.name))
                    break
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    stack.extend(ast.iter_child_nodes(child))
    return out


def test_check_returns_messages_and_verify_raises():
    """docs/extending.md's naming rule: ``check*`` returns its problems as messages (a list, or appended to the
    ``errors`` list it is given) and raises nothing; a function that raises on a problem is a ``verify_*``."""
    bad = sorted(raising_checks() - set(CHECKS_THAT_RAISE))
    assert not bad, f"check* functions that raise (return the messages, or name it verify_*): {bad}"


def test_the_check_convention_checker_sees_a_raise(tmp_path):
    pkg = tmp_path / "mtl"
    pkg.mkdir()
    (pkg / "a.py").write_text("def check(cfg):\n    def inner():\n        raise ValueError\n    return []\n\n\n"
                              "def _check_x(v):\n    if v:\n        raise ValueError(v)\n\n\n"
                              "def checkpoint():\n    raise OSError\n")
    assert raising_checks(str(pkg), str(tmp_path)) == {("mtl/a.py", "_check_x")}
    assert set(CHECKS_THAT_RAISE) <= raising_checks()  # each allowed one still raises: remove it once it does not


# ------------------------------------------------------------------ the house's size and shape (docs/architecture.md)

MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_FLAT_MODULES, MAX_TRAINER_LINES = 600, 80, 6, 200


def test_no_module_over_600_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for path, _ in modules():
        tree, lines = parsed(path)
        rel = os.path.relpath(path, ROOT)
        if len(lines) > MAX_MODULE_LINES:
            long_modules.append(f"{rel}: {len(lines)} lines")
        long_functions += [f"{rel}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
                           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long_modules + long_functions, "split by responsibility:\n" + "\n".join(long_modules + long_functions)


def test_at_most_six_modules_sit_flat_in_mtl_and_the_trainer_reads_as_the_loop():
    flat = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py") and n != "__init__.py")
    assert len(flat) <= MAX_FLAT_MODULES, flat
    tree = parsed(os.path.join(PACKAGE, "run", "trainer.py"))[0]
    (trainer,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    assert trainer.end_lineno - trainer.lineno + 1 <= MAX_TRAINER_LINES


def module_graph(folder: str = PACKAGE, root: str = ROOT) -> dict[str, set[str]]:
    """{module: the mtl modules it imports when it is imported} (imports at module level; one inside a function runs
    later and says why: test_an_import_inside_a_function_says_why)."""
    known = {module_name(path, root) for path, _ in modules(folder, root)}
    graph: dict[str, set[str]] = {}
    for path, found in modules(folder, root):
        me = module_name(path, root)
        graph[me] = {mod for mod, _, _, in_function in found if not in_function and mod in known and mod != me}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other in a loop (the strongly connected components of more than one
    module, or one that imports itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert not circles(module_graph()), circles(module_graph())


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert len(module_graph()) > 100 and any(module_graph().values())  # it reads this tree's imports


@pytest.mark.slow  # a fresh interpreter importing every moved module: not in the fast tier
def test_every_moved_module_still_imports_by_its_old_name_with_a_warning():
    """A module that moved (mtl.MOVED) imports by its old name for one release: the very module of its new name, and
    a DeprecationWarning naming where it went (in a fresh interpreter: a warning is said once per module)."""
    import mtl

    assert mtl.MOVED, "nothing has moved: this test would check nothing"
    code = ("import importlib, json, sys, warnings\nimport mtl\nout = {}\n"
            "for old, new in mtl.MOVED.items():\n"
            "    with warnings.catch_warnings(record=True) as said:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    out[old] = [module is importlib.import_module(new), [str(w.message) for w in said\n"
            "               if issubclass(w.category, DeprecationWarning) and old in str(w.message)]]\n"
            "print(json.dumps(out))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    import json

    found = json.loads(run.stdout.strip().splitlines()[-1])
    bad = {old: got for old, got in found.items() if not (got[0] and any(mtl.MOVED[old] in m for m in got[1]))}
    assert not bad, bad
    stale = [old for old in mtl.MOVED if os.path.exists(os.path.join(ROOT, *old.split("."))) or
             os.path.exists(os.path.join(ROOT, *old.split(".")) + ".py")]
    assert not stale, f"old names that are files again (they would hide the move): {stale}"


# ------------------------------------------------------------------ the picture in docs/architecture.md

PICTURE_BEGIN, PICTURE_END = "<!-- imports:begin -->", "<!-- imports:end -->"
ARCHITECTURE_MD = os.path.join(ROOT, "docs", "architecture.md")


def folder_arrows(folder: str = PACKAGE, root: str = ROOT) -> dict[str, set[str]]:
    """{group of LAYERS: the groups its modules import}, from the code's imports (inside functions too)."""
    arrows: dict[str, set[str]] = {g: set() for layer in LAYERS for g in layer}
    for path, found in modules(folder, root):
        mine = group_of(module_name(path, root))
        for mod, *_ in found:
            theirs = group_of(mod) if mod == "mtl" or mod.startswith("mtl.") else None
            if mine and theirs and theirs != mine:
                arrows[mine].add(theirs)
    return arrows


def picture() -> str:
    """The layers and the imports between them as a Mermaid flowchart (GitHub draws it): the top layer first, an
    arrow from each group to each group it imports."""
    ids = {g: g.replace("mtl.", "").replace("mtl", "init") for layer in LAYERS for g in layer}
    label = {g: "mtl/__init__.py" if g == "mtl" else "mtl/" + g[4:].replace(".", "/") +
             (".py" if os.path.isfile(os.path.join(ROOT, *g.split(".")) + ".py") else "/") for g in ids}
    lines = ["```mermaid", "flowchart TD"]
    for i, layer in reversed(list(enumerate(LAYERS))):
        lines.append(f"  subgraph L{i + 1}[\"layer {i + 1}\"]")
        lines += [f"    {ids[g]}[\"{label[g]}\"]" for g in layer]
        lines.append("  end")
    arrows, ground = folder_arrows(), set(LAYERS[0])  # every folder may import layer 1: those arrows are not drawn
    for g in (g for layer in reversed(LAYERS) for g in layer):
        lines += [f"  {ids[g]} --> {ids[t]}" for t in sorted(arrows[g] - ground, key=lambda t: (-_groups()[t], t))]
    return "\n".join(lines + ["```"])


def _doc_picture() -> str:
    with open(ARCHITECTURE_MD, encoding="utf-8") as f:
        text = f.read()
    return text.split(PICTURE_BEGIN, 1)[1].split(PICTURE_END, 1)[0].strip() if PICTURE_BEGIN in text else ""


def write_picture() -> None:
    with open(ARCHITECTURE_MD, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(PICTURE_BEGIN, 1)
    tail = rest.split(PICTURE_END, 1)[1]
    with open(ARCHITECTURE_MD, "w", encoding="utf-8") as f:
        f.write(f"{head}{PICTURE_BEGIN}\n{picture()}\n{PICTURE_END}{tail}")


def test_the_architecture_picture_is_the_code_s_imports():
    """docs/architecture.md's picture is drawn from the code: a new import between folders, or a new folder, changes
    it, and this test says how to redraw it."""
    assert _doc_picture() == picture(), ("docs/architecture.md's picture differs from the code's imports: redraw it "
                                         "with `.venv/bin/python -m tests.test_layout --draw`")
    assert picture().count("-->") >= 20  # drawn from real imports


if __name__ == "__main__":
    if sys.argv[1:] == ["--draw"]:
        write_picture()
        print(f"drew {ARCHITECTURE_MD}'s picture from the code's imports")
    else:
        sys.exit("usage: python -m tests.test_layout --draw")
