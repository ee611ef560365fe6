"""The code in README.md, docs/*.md and an export's README.md is run or checked (tests/doc_blocks.py says how each
block is treated), so a doc that drifts from the code fails here."""

from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import subprocess
import sys

import pytest
import yaml

from mtl.errors import ConfigError
from mtl.setup.checks import load_run_config

from .conftest import PY, ROOT
from .doc_blocks import blocks, checkpoint_steps, commands, missing_excerpt_lines, model_paths_read, paths_made, target, undefined_names
from .pretrained_folders import tiny_pretrained

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
ALL = [b for doc in DOCS for b in blocks(os.path.join(ROOT, doc))]
for _b in ALL:
    _b.path = os.path.relpath(_b.path, ROOT)


def _of(kind: str, lang: str | None = None) -> list:
    chosen = [b for b in ALL if b.kind == kind and (lang is None or b.lang == lang)]
    return [pytest.param(b, id=b.where) for b in chosen]


def test_every_block_says_what_it_is():
    bad = [f"{b.where}: ```{b.lang}: no doc-test kind" for b in ALL if b.kind == "unknown"]
    bad += [f"{b.where}: skip without a reason" for b in ALL if b.kind == "skip" and not b.arg]
    bad += [f"{b.where}: excerpt of a file that does not exist: {b.arg!r}" for b in ALL
            if b.kind in ("excerpt", "api") and not os.path.isfile(os.path.join(ROOT, b.arg))]
    assert not bad, "\n".join(bad)
    assert len([b for b in ALL if b.kind != "text"]) > 30  # the parser found the docs' code


@pytest.mark.parametrize("block", _of("excerpt"))
def test_an_excerpt_matches_its_source(block):
    missing = missing_excerpt_lines(block, ROOT)
    assert not missing, f"{block.where}: not in {block.arg} (in this order): {missing}"


@pytest.mark.parametrize("block", _of("api"))
def test_an_interface_summary_names_what_its_source_defines(block):
    missing = undefined_names(block, ROOT)
    assert not missing, f"{block.where}: not defined in {block.arg}: {missing}"


@pytest.mark.parametrize("block", _of("config"))
def test_a_yaml_block_loads_as_config(block, tmp_path, monkeypatch):
    """On top of configs/tiny.yaml, from a folder that has the repository's docs/ and configs/ (a relative plug-in
    path in the snippet is read from there, as from the repository's root)."""
    for name in ("docs", "configs"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    data = yaml.safe_load(block.text)
    bench = data.pop("bench", None)
    config = tmp_path / "snippet.yaml"
    config.write_text(yaml.safe_dump({"base": "configs/tiny.yaml", **data}))
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(str(config))
    if bench is not None:  # the benchmark's own section, checked by the benchmark's options
        from mtl.bench.options import bench_options

        cfg.bench = bench
        bench_options(cfg)


class _Parsed(Exception):
    pass


def _check_tool(module: str, args: list[str], where: str, monkeypatch) -> None:
    """``python -m module args``: the arguments parse with the tool's own parser (nothing runs after parsing)."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        original(self, argv, namespace)
        raise _Parsed

    def refuse(self, message):
        raise AssertionError(f"{where}: python -m {module} {' '.join(args)}: {message}")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(argparse.ArgumentParser, "error", refuse)
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed:
        pass
    except SystemExit as e:  # --help
        assert e.code == 0, f"{where}: python -m {module} {' '.join(args)}: exit {e.code}"
    else:
        raise AssertionError(f"{where}: python -m {module} parsed no arguments")
    monkeypatch.undo()


def _check_train(args: list[str], where: str, monkeypatch):
    """``train.py --config C key=value ...``: the config and its overrides load and pass every check, on this CPU
    or, for a command the docs give for GPUs, as on a machine with 8 CUDA devices."""
    assert args[0] == "--config", f"{where}: train.py without --config first: {args}"
    # a model folder an earlier command makes is not here: whether it would be is the question of
    # test_every_model_folder_a_readme_command_reads_exists_after_the_commands_before_it
    overrides = [a for a in args[2:] if "=" in a and not (a.startswith(("init_from=", "resume=")) and a.split("=", 1)[1]
                                                          not in ("auto", "null") and not os.path.exists(a.split("=", 1)[1]))]
    try:
        return load_run_config(args[1], overrides)
    except ConfigError:
        import torch

        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "device_count", lambda: 8)
            return load_run_config(args[1], overrides)


def _check_command(argv: list[str], where: str, monkeypatch) -> None:
    while argv and "=" in argv[0] and not argv[0].startswith("-"):  # VAR=value before the command
        argv = argv[1:]
    head = argv[0]
    if head in ("python", "python3", "torchrun"):
        rest = argv[1:]
        if head == "torchrun":  # its own options, then the script or -m module
            while rest and rest[0].startswith("--") and rest[0] != "-m":
                rest = rest[1:]
        if rest[0] == "-m" and rest[1] == "mtl.tools.launch" and "train.py" in rest:
            _check_tool("mtl.tools.launch", rest[2:], where, monkeypatch)
            return _check_train(rest[rest.index("train.py") + 1:], where, monkeypatch)
        if rest[0] == "-m":
            return _check_tool(rest[1], rest[2:], where, monkeypatch)
        if rest[0] == "train.py":
            return _check_train(rest[1:], where, monkeypatch)
        assert os.path.isfile(os.path.join(ROOT, rest[0])), f"{where}: no script {rest[0]}"
        if rest[0] == TINY_SCRIPT:  # the block's next commands read what it writes: run it, in a scratch root
            _tiny_pretrained_root(monkeypatch)
        return None
    if head == "make":
        with open(os.path.join(ROOT, "Makefile")) as f:
            targets = {line.split(":")[0] for line in f if line[:1].isalpha() and ":" in line}
        for target in (a for a in argv[1:] if "=" not in a):
            assert target in targets, f"{where}: make {target}: no such target"
        return None
    if head in ("docker", "sbatch"):  # a container or a cluster: the files it names exist
        for a in argv[1:]:
            if "/" in a and not a.startswith(("-", "$")) and ":" not in a and os.path.splitext(a)[1]:
                assert os.path.exists(os.path.join(ROOT, a)), f"{where}: {a} does not exist"
        return None
    raise AssertionError(f"{where}: {' '.join(argv)}: a command this test does not know; mark the block "
                         "<!-- doc-test: skip: WHY --> or teach tests/test_docs_code.py")


TINY_SCRIPT = "scripts/make_tiny_pretrained.py"


def _tiny_pretrained_root(monkeypatch) -> None:
    """What the script writes (runs/pretrained/*), in a scratch folder that also has the repository's configs/ and
    docs/; the block's later commands run from there. Written once per test session."""
    import tempfile

    global _TINY_ROOT
    if _TINY_ROOT is None:
        root = tempfile.mkdtemp(prefix="doc_tiny_")
        for name in ("configs", "docs", "mtl"):
            os.symlink(os.path.join(ROOT, name), os.path.join(root, name))
        tiny_pretrained().write_all(os.path.join(root, "runs", "pretrained"))
        _TINY_ROOT = root
    monkeypatch.chdir(_TINY_ROOT)


_TINY_ROOT = None


@pytest.mark.parametrize("block", _of("commands"))
def test_a_shell_block_names_real_configs_keys_and_options(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    found = commands(block.text)
    assert found, f"{block.where}: no command in the block"
    for argv in found:
        _check_command(argv, block.where, monkeypatch)


def _makefile_defaults() -> dict[str, str]:
    """The Makefile's ``NAME ?= value`` variables (``CONFIG``, ``RUN_DIR`` ...)."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        return {m.group(1): m.group(2).strip() for m in re.finditer(r"^(\w+)\s*\?=\s*(.*)$", f.read(), re.M)}


def _in_clone(path: str) -> bool:
    """A file or folder of a fresh clone (runs/ is what commands write, never part of it)."""
    return not path.split(os.sep)[0] == "runs" and os.path.exists(os.path.join(ROOT, path))


def test_every_model_folder_a_readme_command_reads_exists_after_the_commands_before_it(monkeypatch):
    """A reader runs README's first shell block (the two commands), then the shell blocks of one section in order:
    every checkpoint, model, ``init_from`` or ``resume`` folder a command there reads is in the clone or left by an
    earlier command of that path (a run's output_dir and the checkpoints its trainer.max_steps and
    checkpoint.every_steps keep, an export's --out, the tiny pretrained folders)."""
    monkeypatch.chdir(ROOT)
    readme = [b for b in ALL if b.path == "README.md" and b.lang == "bash" and b.kind in ("run", "commands")]
    makefile = _makefile_defaults()

    def run_folder(config, overrides):
        cfg = _check_train(["--config", config, *overrides], config, monkeypatch)
        ck = cfg.checkpoint
        return cfg.output_dir, checkpoint_steps(int(cfg.trainer.max_steps), int(ck.every_steps), int(ck.keep_last))

    def follow(block, state: list[str], problems: list[str]) -> list[str]:
        for argv in commands(block.text):
            problems += [f"{block.where} ({block.section}): {' '.join(argv)}: reads {path}, which neither the clone "
                         f"nor a command before it has; there: {sorted(set(state))}"
                         for path in model_paths_read(argv) if path not in state and not _in_clone(path)]
            kind, args = target(argv)
            if kind == "script" and args[0] == TINY_SCRIPT:
                _tiny_pretrained_root(monkeypatch)
            state = state + paths_made(argv, run_folder, makefile)
        return state

    problems: list[str] = []
    after_first = follow(readme[0], [], problems)
    assert os.path.join(makefile["RUN_DIR"], "checkpoints") in " ".join(after_first), after_first  # make train's run
    states: dict[str, list[str]] = {}
    for block in readme[1:]:
        states[block.section] = follow(block, states.get(block.section, after_first), problems)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ blocks that run


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder as the README's examples assume it, after its two commands: the repository's configs/, docs/ and
    train.py, the run `make train` leaves (runs/default, from configs/default.yaml: its model, 6 steps on a small
    data set, enough to caption), two images (photos/a.png, cat.jpg) and a manifest of them (test.jsonl)."""
    from PIL import Image

    ws = tmp_path_factory.mktemp("docs_ws")
    for name in ("configs", "docs", "train.py"):
        os.symlink(os.path.join(ROOT, name), ws / name)
    (ws / "photos").mkdir()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(ws / "photos" / "a.png")
    Image.new("RGB", (40, 40), (30, 30, 200)).save(ws / "cat.jpg")
    (ws / "test.jsonl").write_text('{"image": "photos/a.png", "label": 0, "captions": ["one big red circle"]}\n'
                                   '{"image": "cat.jpg", "label": 1, "captions": ["two small blue squares"]}\n')
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([PY, "train.py", "--config", "configs/default.yaml", "trainer.max_steps=6", "optim.warmup_steps=0",
                    "checkpoint.every_steps=0", "data.synthetic.train_size=256", "data.synthetic.val_size=32",
                    "data.eval_batch_size=32", "trainer.eval_max_batches=1", "trainer.num_samples=2"],
                   cwd=ws, env=env, check=True, capture_output=True, timeout=600)
    return ws


def _run_block(block, ws) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    if block.lang == "python":
        script = ws / f"block_{block.line}.py"
        script.write_text(block.text)
        argvs = [[PY, str(script)]]
    else:
        argvs = [[PY if a in ("python", "python3") else a for a in argv] for argv in commands(block.text)]
    for argv in argvs:
        done = subprocess.run(argv, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{block.where}: {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", _of("run"))
def test_a_runnable_block_runs(block, workspace):
    _run_block(block, workspace)


@pytest.mark.slow
def test_the_export_readme_runs_without_mtl_and_agrees_with_mtl(workspace, tmp_path):
    """The README.md an export writes: its Python blocks, in order, as written, in a process that cannot import mtl,
    from the export folder, on a batch of images: the classes and captions are mtl's own for those images."""
    import json

    import torch

    from mtl.inference import load_model
    from mtl.inference.interop import README_TITLE

    export = tmp_path / "export"
    subprocess.run([PY, "-m", "mtl.tools.export", "--checkpoint", "runs/default", "--out", str(export)],
                   cwd=workspace, check=True, capture_output=True, timeout=600)
    readme = (export / "README.md").read_text()
    assert readme.startswith(README_TITLE)
    code = [b.text for b in blocks(str(export / "README.md"), readme) if b.lang == "python"]
    assert len(code) == 3, "the program, the torchvision backbone and the decoder"
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(images, tmp_path / "images.pt")
    predicted = load_model(str(export)).predict(images)
    assert any(p["caption"] for p in predicted), "an empty caption would make the comparison meaningless"
    script = tmp_path / "from_readme.py"
    script.write_text(
        "import sys\nsys.modules['mtl'] = None  # importing mtl fails in this process\nimport json, torch\n"
        f"images = torch.load({str(tmp_path / 'images.pt')!r})\n" + "\n".join(code)
        + "\nprint(json.dumps({'classes': classes, 'captions': captions}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([PY, str(script)], cwd=export, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"classes": [p["class"] for p in predicted], "captions": [p["caption"] for p in predicted]}


@pytest.mark.slow  # one training step of configs/user_data.yaml's ResNet-18 on 8 small images, in this process (~5 s)
def test_readme_s_own_images_block_trains_on_the_folders_its_comment_describes(tmp_path, monkeypatch):
    """README's "Train on your own images": its command, as written, from a folder holding what its comment
    describes (class folders of .jpg images, a captions.jsonl in each split), trains; the overrides added only make
    it one short step."""
    import json

    from PIL import Image

    import train

    (block,) = [b for b in ALL if b.path == "README.md" and b.section == "Train on your own images" and b.lang == "bash"
                and "data.source=imagefolder" in b.text]  # the section's other blocks: the other sources
    (argv,) = commands(block.text)
    kind, args = target(argv)
    assert kind == "train", argv
    given = dict(a.split("=", 1) for a in args[2:])
    for split in ("data.train_path", "data.val_path"):
        root, lines = tmp_path / given[split], []
        for c, name in enumerate(("dog", "cat")):
            (root / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), (200 * c, 60, 40 * i)).save(root / name / f"{i:04d}.jpg")
                lines.append(json.dumps({"image": f"{name}/{i:04d}.jpg", "captions": [f"a {name} on a sofa"]}))
        (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    short = ["trainer.max_steps=1", "data.image_size=32", "data.batch_size=4", "data.num_workers=0",
             "trainer.eval_max_batches=1", "trainer.num_samples=0", "checkpoint.every_steps=0"]
    assert train.main(args + short) == 0
    assert os.path.isdir(tmp_path / given["output_dir"] / "checkpoints" / "step_1")
