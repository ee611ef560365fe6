"""Exit codes that scripts can trust: every ``python -m mtl.tools.X`` entry point, found by reading the files (a
module under mtl/tools with an ``if __name__ == "__main__":`` block, or a package with ``__main__.py``), passes
``main()``'s exit code to the shell, and a bad argument gives a non-zero exit (2-5) with a message and no traceback.

The entry points run in this process through ``runpy``, the machinery of ``python -m`` itself (one interpreter
start, not one per tool); a new tool is run with an unknown option unless ``BAD`` gives it a better bad argument
(one that gets past argparse into its own checks)."""

import ast
import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
import warnings

import pytest

from .conftest import ROOT, TINY

TOOLS = os.path.join(ROOT, "mtl", "tools")


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)):
            return node
    return None


def entry_points() -> dict[str, str]:
    """{module name for ``python -m``: the file whose ``__main__`` block runs}, for everything under mtl/tools."""
    out = {}
    for folder, dirs, files in os.walk(TOOLS):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                if _main_block(ast.parse(f.read())) is None:
                    continue
            out[package if name == "__main__.py" else f"{package}.{name[:-3]}"] = path
    return out


def _passes_exit_code(block: ast.If) -> bool:
    """``sys.exit(main())``, ``raise SystemExit(main())`` or ``exit_process(main())`` (mtl/run/signals.py): main's
    return value reaches the shell."""
    def is_main_call(node):
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "main"

    for node in ast.walk(block):
        call = node.exc if isinstance(node, ast.Raise) else node
        if not isinstance(call, ast.Call) or not call.args or not is_main_call(call.args[0]):
            continue
        f = call.func
        if (isinstance(f, ast.Name) and f.id in ("SystemExit", "exit_process")) or (
                isinstance(f, ast.Attribute) and f.attr == "exit" and isinstance(f.value, ast.Name) and f.value.id == "sys"):
            return True
    return False


def bad_arguments(tmp: str) -> dict[str, list[str]]:
    """Per tool, a bad argument that its own checks (not only argparse) refuse."""
    missing = os.path.join(tmp, "missing")
    config_error = ["--config", TINY, "no_such_key=1"]
    return {
        "mtl.tools.bench": ["--config", TINY, "bench.seedz=3"],
        "mtl.tools.bench.sweep": ["--on-change", "refuse", "--config", TINY, "bench.seedz=3"],
        "mtl.tools.bench.sampling": ["--config", TINY, "--", "no_such_key=1"],
        "mtl.tools.bench.strategies": config_error,
        "mtl.tools.bench.toy": ["--methods", "no_such_method"],
        "mtl.tools.doctor": config_error,
        "mtl.tools.evaluate": ["--checkpoint", missing],
        "mtl.tools.export": ["--checkpoint", missing, "--out", os.path.join(tmp, "export")],
        "mtl.tools.predict": ["--model", missing, missing + ".png"],
        "mtl.tools.fsdp_memory": config_error,
        "mtl.tools.launch": ["--standalone", "--nproc_per_node=1", os.path.join(ROOT, "train.py"), *config_error],
        "mtl.tools.profile_strategies": ["--config", TINY, "--nproc", "1", "combined", "no_such_key=1"],
        "mtl.tools.qm9_bonds": ["--seed", "not_a_number"],
        "mtl.tools.qm9_edge_network": ["--molecules", "0"],
        "mtl.tools.throughput": config_error,
    }


def run_as_main(module: str, args: list[str]) -> tuple[object, str]:
    """``python -m module args`` in this process: (the exit code, stderr); an exception that escapes is a
    traceback in stderr, as the interpreter would print it."""
    from mtl.run import signals

    err, argv, exit_process = io.StringIO(), sys.argv, signals.exit_process
    sys.argv = [module, *args]
    signals.exit_process = sys.exit  # its os._exit would end this process: the code as SystemExit, as python -m sees it
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": the tests imported it before
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code
            except BaseException:
                code = 1
                err.write(traceback.format_exc())
    finally:
        sys.argv, signals.exit_process = argv, exit_process
    return code, err.getvalue()


def test_every_tool_passes_mains_exit_code_to_the_shell():
    tools = entry_points()
    assert {"mtl.tools.bench", "mtl.tools.evaluate", "mtl.tools.bench.toy"} <= set(tools), tools  # found
    dropped = []
    for module, path in tools.items():
        with open(path, encoding="utf-8") as f:
            if not _passes_exit_code(_main_block(ast.parse(f.read()))):
                dropped.append(f"{module} ({os.path.relpath(path, ROOT)})")
    assert not dropped, f"these __main__ blocks drop main()'s exit code (write sys.exit(main())): {dropped}"


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_every_tool_refuses_a_bad_argument_with_a_message_and_no_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a tool might write lands in the checkout
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    tools, bad = entry_points(), bad_arguments(str(tmp_path))
    assert set(bad) <= set(tools), f"BAD names tools that are gone: {set(bad) - set(tools)}"
    wrong = []
    for module in tools:
        args = bad.get(module, ["--no-such-option"])
        code, err = run_as_main(module, args)
        if code not in (2, 3, 4, 5) or "Traceback" in err or not err.strip():
            wrong.append(f"python -m {module} {' '.join(args)}: exit {code!r}, stderr:\n{err[-1500:]}")
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.slow
def test_the_benchmark_exits_2_on_a_config_error_as_a_shell_sees_it():
    """The reported case, through a real ``python -m``: a mistyped bench key printed its message and exited 0."""
    proc = subprocess.run([sys.executable, "-m", "mtl.tools.bench", "--config", TINY, "bench.seedz=3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "did you mean 'bench.seeds'" in proc.stderr and "Traceback" not in proc.stderr
