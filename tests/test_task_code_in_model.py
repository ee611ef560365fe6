"""A model with a ``task_modules`` task carries the task's file (checkpoint and export: ``task_modules/<file>``)
and loads from that copy anywhere, with a note that loading runs it."""

from __future__ import annotations

import json
import os
import shutil

from mtl.tools import export as export_tool
from mtl.tools import predict as predict_tool

from .conftest import ROOT, TINY
from .test_inference import _image, train_script

EXAMPLE = os.path.join(ROOT, "docs", "examples", "dominant_colour.py")


def test_a_task_file_travels_with_the_checkpoint_and_the_export(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "plugins").mkdir(parents=True)
    shutil.copy(EXAMPLE, work / "plugins" / "my_colour.py")
    monkeypatch.chdir(work)  # the config names the file by a relative path, as a user would
    assert train_script.main(["--config", TINY, "output_dir=run", "task_modules=[plugins/my_colour.py]",
                              "tasks=[cls,gen,colour]", "trainer.max_steps=2", "checkpoint.every_steps=0"]) == 0
    step = work / "run" / "checkpoints" / "step_2"
    assert (step / "task_modules" / "my_colour.py").read_bytes() == (work / "plugins" / "my_colour.py").read_bytes()
    assert "task_modules/my_colour.py" in json.loads((step / "manifest.json").read_text())["files"]
    assert export_tool.main(["--checkpoint", str(step), "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "task_modules" / "my_colour.py").is_file()
    # elsewhere, with the original file gone: the model folders alone are enough
    shutil.rmtree(work / "plugins")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    image = _image(elsewhere)
    capsys.readouterr()
    for folder in (tmp_path / "export", step):
        assert predict_tool.main(["--model", str(folder), image, "--out", "p.jsonl"]) == 0
        err = capsys.readouterr().err
        assert "carries task code (my_colour.py)" in err and "runs it" in err, err
        (row,) = [json.loads(line) for line in open("p.jsonl")]
        assert {"class", "caption", "colour"} <= set(row), row
