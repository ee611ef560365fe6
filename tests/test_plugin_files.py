"""A model folder is self-contained and imports only its own code: every plug-in file a run loaded (task_modules,
backbone_modules, weighting_modules; a .py path or a module name outside mtl) travels in each checkpoint and export
as ``<key>/<file>``, listed with its SHA-256 in the folder's manifest, and loading the folder imports those copies and
nothing else. Relative plug-in paths in a config file are read from that file's folder, as ``base:`` is."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import pytest

from mtl.checkpoint.folder import write_manifest
from mtl.errors import CheckpointError, ConfigError
from mtl.inference import load_model
from mtl.registry import copy_names, plugin_files
from mtl.setup.checks import load_run_config
from mtl.tools import evaluate as evaluate_tool
from mtl.tools import export as export_tool
from mtl.tools import predict as predict_tool

from .conftest import ROOT, TINY
from .test_inference import _image, train_script

EXAMPLES = os.path.join(ROOT, "docs", "examples")
PLUGINS = {"task_modules": "dominant_colour.py", "backbone_modules": "small_cnn.py",
           "weighting_modules": "unit_gradients.py"}
RUN = ["tasks=[cls,gen,colour]", "model.backbone.name=small_cnn", "weighting.method=unit_gradients",
       "ddp.strategy=task_grads", "trainer.max_steps=2", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run whose task, backbone and method each come from a file in plugins/, which is then deleted; the
    run's last checkpoint and its export."""
    root = tmp_path_factory.mktemp("plugins")
    work = root / "work"
    (work / "plugins").mkdir(parents=True)
    for name in PLUGINS.values():
        shutil.copy(os.path.join(EXAMPLES, name), work / "plugins" / name)
    here = os.getcwd()
    os.chdir(work)  # the command line names the files by relative paths, as a user would
    try:
        assert train_script.main(["--config", TINY, "output_dir=run", *RUN] + [
            f"{key}=[plugins/{name}]" for key, name in PLUGINS.items()]) == 0
        step = work / "run" / "checkpoints" / "step_2"
        assert export_tool.main(["--checkpoint", str(step), "--out", str(root / "export")]) == 0
    finally:
        os.chdir(here)
    originals = {key: (work / "plugins" / name).read_bytes() for key, name in PLUGINS.items()}
    shutil.rmtree(work / "plugins")  # from here on only the model folders have the code
    return root, step, root / "export", originals


def test_every_plugin_file_travels_with_the_checkpoint_and_the_export(trained):
    root, step, export, originals = trained
    for folder in (step, export):
        listed = json.loads((folder / "manifest.json").read_text())["files"]
        for key, name in PLUGINS.items():
            assert (folder / key / name).read_bytes() == originals[key], (folder, key)
            assert f"{key}/{name}" in listed


def test_the_model_folders_alone_predict_and_evaluate_from_another_folder(trained, tmp_path, monkeypatch, capsys):
    root, step, export, _ = trained
    monkeypatch.chdir(tmp_path)
    image = _image(tmp_path)
    for folder in (export, step):
        capsys.readouterr()
        assert predict_tool.main(["--model", str(folder), image, "--out", "p.jsonl", "--trust-plugins"]) == 0
        err = capsys.readouterr().err
        assert "imports its plug-in code" in err and "backbone_modules/small_cnn.py" in err and "--trust-plugins" in err
        (row,) = [json.loads(line) for line in open("p.jsonl")]
        assert {"class", "caption", "colour"} <= set(row), row
        assert evaluate_tool.main(["--checkpoint", str(folder), "--max-batches", "1", "--trust-plugins"]) == 0


def _with_marker(folder, dst, marker):
    """A copy of ``folder`` whose task plug-in also writes ``marker`` when imported, its manifest refreshed."""
    bad = _copy_folder(folder, dst)
    with open(bad / "task_modules" / "dominant_colour.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    write_manifest(str(bad))
    return bad


def test_carried_code_runs_only_with_trust_plugins(trained, tmp_path, capsys):
    """Plug-in code a folder carries, with no identical file at its recorded path here: every tool refuses it with
    exit 2 naming each file, its SHA-256 and the flag, and imports nothing; --trust-plugins loads it."""
    _, step, export, _ = trained
    marker = tmp_path / "plugin_ran"
    image = _image(tmp_path)
    for folder in (step, export):
        bad = _with_marker(folder, tmp_path / f"marked_{folder.name}", marker)
        capsys.readouterr()
        codes = [predict_tool.main(["--model", str(bad), image]),
                 evaluate_tool.main(["--checkpoint", str(bad), "--max-batches", "1"]),
                 export_tool.main(["--checkpoint", str(bad), "--out", str(tmp_path / "refused")])]
        err = capsys.readouterr().err
        assert codes == [2, 2, 2], (folder, codes, err)
        assert "Traceback" not in err and err.count("--trust-plugins") == 3, err
        for key, name in PLUGINS.items():
            digest = hashlib.sha256((bad / key / name).read_bytes()).hexdigest()
            assert f"{key}/{name} (SHA-256 {digest})" in err, err
        assert not marker.exists() and not (tmp_path / "refused").exists()
        with pytest.raises(ConfigError, match="trust_plugins=True"):
            load_model(str(bad))
        assert not marker.exists()
        assert predict_tool.main(["--model", str(bad), image, "--trust-plugins"]) == 0
        assert marker.exists()
        marker.unlink()
    out = tmp_path / "onward"
    assert export_tool.main(["--checkpoint", str(bad), "--out", str(out), "--trust-plugins"]) == 0
    assert (out / "task_modules" / "dominant_colour.py").read_bytes() == (bad / "task_modules" / "dominant_colour.py"
                                                                           ).read_bytes()
    assert load_model(str(out), trust_plugins=True).tasks == ["cls", "gen", "colour"]


def test_a_folder_whose_code_is_identical_at_its_recorded_paths_needs_no_flag(trained, monkeypatch, capsys):
    """Your own run's code: each copy byte-identical to the file at the path its config.yaml records (here relative,
    read from the working directory as the run read it) loads without --trust-plugins; one changed source makes its
    copy untrusted again, and only that one is named."""
    root, step, export, originals = trained
    work = root / "work"
    monkeypatch.chdir(work)
    (work / "plugins").mkdir()
    try:
        for key, name in PLUGINS.items():
            (work / "plugins" / name).write_bytes(originals[key])
        for folder in (step, export):
            assert load_model(str(folder)).tasks == ["cls", "gen", "colour"]
            assert "identical to" in capsys.readouterr().err
        with open(work / "plugins" / PLUGINS["backbone_modules"], "a") as f:
            f.write("# edited since the run\n")
        with pytest.raises(ConfigError) as refused:
            load_model(str(step))
        assert "backbone_modules/small_cnn.py" in str(refused.value) and "task_modules/" not in str(refused.value)
        assert load_model(str(step), trust_plugins=True).tasks == ["cls", "gen", "colour"]
    finally:
        shutil.rmtree(work / "plugins")


def _escaping_spec(target):
    """A module-name spec (no .py) whose copy name ``task_modules/<spec>.py`` climbs out to ``target`` (a .py)."""
    return "../" * 30 + str(target)[:-len(".py")].lstrip("/")


def test_a_plugin_spec_that_leaves_the_folder_is_refused_unimported(trained, tmp_path, capsys):
    """config.yaml (manifest refreshed) naming a copy that resolves outside ``folder/<key>/``, and a carried copy
    that is a symlink to a file outside: exit 4 in every tool, --trust-plugins or not; nothing imported."""
    _, step, export, _ = trained
    marker = tmp_path / "pwned"
    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "pwn.py").write_text(open(os.path.join(EXAMPLES, "dominant_colour.py")).read()
                                    + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    image = _image(tmp_path)
    for folder in (step, export):
        escaping = _copy_folder(folder, tmp_path / f"escaping_{folder.name}")
        config = escaping / "config.yaml"
        config.write_text(config.read_text().replace("task_modules:", f"task_modules:\n- {_escaping_spec(outside / 'pwn.py')}", 1))
        write_manifest(str(escaping))
        linked = _copy_folder(folder, tmp_path / f"linked_{folder.name}")
        os.remove(linked / "task_modules" / "dominant_colour.py")
        os.symlink(outside / "pwn.py", linked / "task_modules" / "dominant_colour.py")
        write_manifest(str(linked))
        for bad, why in ((escaping, "outside"), (linked, "symbolic link")):
            capsys.readouterr()
            codes = [predict_tool.main(["--model", str(bad), image, "--trust-plugins"]),
                     evaluate_tool.main(["--checkpoint", str(bad), "--max-batches", "1"]),
                     export_tool.main(["--checkpoint", str(bad), "--out", str(tmp_path / "out"), "--trust-plugins"])]
            err = capsys.readouterr().err
            assert codes == [4, 4, 4], (bad, codes, err)
            assert "task_modules" in err and why in err and "Traceback" not in err, err
            with pytest.raises(CheckpointError, match=why):
                load_model(str(bad), trust_plugins=True)
            assert not marker.exists(), f"{bad} ran code from outside it"


def _copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_tampered_plugin_copy_is_refused_like_a_tampered_weight(trained, tmp_path):
    _, step, export, _ = trained
    for folder in (step, export):
        bad = _copy_folder(folder, tmp_path / f"bad_{folder.name}")
        with open(bad / "backbone_modules" / "small_cnn.py", "a") as f:
            f.write("\nraise SystemExit('tampered code ran')\n")
        with pytest.raises(CheckpointError, match="backbone_modules/small_cnn.py"):
            load_model(str(bad))


def test_code_named_outside_the_folder_is_refused_unread(trained, tmp_path, capsys):
    """An edited config.yaml (manifest refreshed) that names a file outside the folder: every tool refuses it by name,
    and the file is never imported (it would leave a marker)."""
    _, step, export, _ = trained
    marker = tmp_path / "evil_ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "evil_mod.py").write_text(evil.read_text())
    sys.path.insert(0, str(module_dir))
    try:
        for key, spec in (("backbone_modules", str(evil)), ("task_modules", str(evil)),
                          ("weighting_modules", "evil_mod")):
            for folder in (step, export):
                bad = _copy_folder(folder, tmp_path / f"{key}_{folder.name}")
                config = bad / "config.yaml"
                text = config.read_text()
                assert f"{key}:" in text
                config.write_text(text.replace(f"{key}:", f"{key}:\n- {spec}", 1))
                write_manifest(str(bad))  # the attacker refreshes the checksums
                capsys.readouterr()
                codes = [predict_tool.main(["--model", str(bad), _image(tmp_path)]),
                         evaluate_tool.main(["--checkpoint", str(bad), "--max-batches", "1"]),
                         export_tool.main(["--checkpoint", str(bad), "--out", str(tmp_path / f"out_{key}")])]
                err = capsys.readouterr().err
                assert codes == [4, 4, 4], (key, folder, codes, err)
                assert f"{key}: {spec!r} has no copy" in err and "never a file or module from outside" in err, err
                assert not marker.exists(), f"{spec} was imported from {bad}"
                shutil.rmtree(bad)
    finally:
        sys.path.remove(str(module_dir))


def test_a_module_name_outside_mtl_is_carried_too(tmp_path, monkeypatch):
    (tmp_path / "my_tasks_mod.py").write_text(open(os.path.join(EXAMPLES, "dominant_colour.py")).read())
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_run_config(TINY, ["task_modules=[my_tasks_mod, mtl.tasks.classification]", "tasks=[cls,gen,colour]"])
    assert copy_names("task_modules", cfg.task_modules) == {"my_tasks_mod": "task_modules/my_tasks_mod.py"}
    assert plugin_files(cfg) == {"task_modules/my_tasks_mod.py": (tmp_path / "my_tasks_mod.py").read_bytes()}


def test_plugin_paths_in_a_config_file_are_read_from_its_folder(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "plugins").mkdir(parents=True)
    shutil.copy(os.path.join(EXAMPLES, "small_cnn.py"), project / "plugins" / "small_cnn.py")
    config = project / "mine.yaml"
    config.write_text(f"base: {TINY}\nbackbone_modules: [plugins/small_cnn.py]\n"
                      "model: {backbone: {name: small_cnn}}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the config's folder: the path still means project/plugins/small_cnn.py
    cfg = load_run_config(str(config))
    assert list(cfg.backbone_modules) == [str(project / "plugins" / "small_cnn.py")]
    # on the command line a relative path is read from the working directory
    monkeypatch.chdir(project)
    cfg = load_run_config(TINY, ["backbone_modules=[plugins/small_cnn.py]", "model.backbone.name=small_cnn"])
    assert list(cfg.backbone_modules) == ["plugins/small_cnn.py"]
    # a file-relative path that exists only from the working directory: refused, with the path to write
    (project / "configs").mkdir()
    moved = project / "configs" / "mine.yaml"
    moved.write_text(config.read_text())
    with pytest.raises(ConfigError, match=r"write '\.\./plugins/small_cnn\.py'"):
        load_run_config(str(moved))
