"""``mtl.tools.evaluate`` on a multi-input model (data.per_task): each task is scored on its own validation set,
through the trainer's own evaluation, and gives exactly the run's last evaluation; nothing falls back to other data."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from mtl.tools import evaluate as evaluate_tool

from .conftest import TINY
from .test_inference import train_script


def image_folder(root, classes=3, per_class=4):
    for c in range(classes):
        os.makedirs(root / f"class{c}")
        for i in range(per_class):
            Image.new("RGB", (36, 30), (80 * c, 50 * i, 40 + 20 * c)).save(root / f"class{c}" / f"{i}.png")
    return root


def caption_manifest(folder, n=6):
    os.makedirs(folder)
    lines = []
    for i in range(n):
        Image.new("RGB", (30, 40), (20, 40 * i, 200 - 20 * i)).save(folder / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "caption": f"a blue picture number {i % 3}"}))
    (folder / "c.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "c.jsonl"


@pytest.fixture(scope="module")
def mi_run(tmp_path_factory):
    """A multi-input run as configs/multi_input_user_data.yaml lays it out: an ImageFolder (3 classes, no captions)
    for cls, a captions-only manifest of OTHER images for gen."""
    tmp = tmp_path_factory.mktemp("mi_eval")
    folder, captions = image_folder(tmp / "folder"), caption_manifest(tmp / "cap")
    out = tmp / "run"
    overrides = [f"output_dir={out}", "trainer.max_steps=3", "trainer.eval_every=3", "trainer.eval_max_batches=0",
                 "checkpoint.every_steps=0", "data.eval_batch_size=5",
                 "data.per_task.cls.source=imagefolder", f"data.per_task.cls.train_path={folder}",
                 f"data.per_task.cls.val_path={folder}", "data.per_task.cls.batch_size=4",
                 "data.per_task.gen.source=manifest", f"data.per_task.gen.train_path={captions}",
                 f"data.per_task.gen.val_path={captions}", "data.per_task.gen.batch_size=2"]
    assert train_script.main(["--config", TINY, *overrides]) == 0
    return {"out": str(out), "folder": str(folder), "captions": str(captions)}


def test_evaluate_equals_the_runs_last_evaluation_per_task(mi_run, tmp_path):
    final = json.loads(open(os.path.join(mi_run["out"], "final_metrics.json")).read())
    last = [json.loads(line) for line in open(os.path.join(mi_run["out"], "metrics.jsonl"))]
    last_eval = [r for r in last if r.get("kind") == "eval"][-1]
    ckpt = os.path.join(mi_run["out"], "checkpoints", "step_3")
    out = tmp_path / "m.json"
    assert evaluate_tool.main(["--checkpoint", ckpt, "--device", "cpu", f"--out={out}"]) == 0
    got = json.loads(out.read_text())
    assert got["images"] == {"cls": 12, "gen": 6}  # each task's own set, whole
    keys = [k for k in final if k.startswith(("cls_", "gen_"))]
    assert {"cls_acc", "cls_loss", "gen_loss", "gen_ppl", "gen_bleu4"} <= set(keys)
    for k in keys:
        assert got[k] == pytest.approx(final[k], rel=1e-9, abs=1e-12), k
        assert got[k] == pytest.approx(last_eval[k], rel=1e-6, abs=1e-9), k


def test_a_missing_task_set_names_the_task_and_key_and_nothing_else_is_scored(mi_run, tmp_path, capsys):
    ckpt = os.path.join(mi_run["out"], "checkpoints", "step_3")
    out = tmp_path / "m.json"
    code = evaluate_tool.main(["--checkpoint", ckpt, "--device", "cpu", f"--out={out}",
                               f"data.per_task.gen.val_path={tmp_path / 'gone.jsonl'}"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "data.per_task.gen.val_path (task gen)" in err and "gone.jsonl" in err
    assert not out.exists()
    code = evaluate_tool.main(["--checkpoint", ckpt, "--device", "cpu", f"--out={out}",
                               "data.per_task.cls.val_path=null"])
    err = capsys.readouterr().err
    assert code == 3 and "data.per_task.cls.val_path: task cls's validation set is not set" in err, err
    assert not out.exists()
