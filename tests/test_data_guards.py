"""Data that must not reach training or predict as it is (issue 36): a corrupt QM9 cache sidecar is rebuilt."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _qm9():
    pytest.importorskip("torch_geometric")
    pytest.importorskip("rdkit")
    if importlib.util.find_spec("qm9pack") is None:
        pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')")
    from mtl.data import qm9

    return qm9


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_corrupt_qm9_cache_sidecar_is_rebuilt_and_said(tmp_path, monkeypatch, damage):
    qm9 = _qm9()
    first = qm9.load_qm9pack(str(tmp_path), limit=3, log=lambda m: None)
    meta = first.path[:-3] + ".json"
    with open(meta, "r+b") as f:
        f.truncate(10 if damage == "truncated" else 0)
    built, said = [], []
    real = qm9.build_from_rows
    monkeypatch.setattr(qm9, "build_from_rows", lambda rows: built.append(1) or real(rows))
    again = qm9.load_qm9pack(str(tmp_path), limit=3, log=said.append)
    assert built == [1], "the cache was not rebuilt"
    assert "sidecar" in said[0] and meta in said[0] and "rebuilding" in said[0]
    assert torch.equal(again.y, first.y) and again.report == first.report
    with open(meta, encoding="utf-8") as f:
        assert f.read().startswith('{"key"')  # rewritten whole: the next load reads it


# ---------------------------------------------------------------------------------------------
# 36.7: a training set with items of one class is refused, however many classes it declares


TINY = "configs/tiny.yaml"


def _png(path, colour=(200, 10, 10), size=(16, 16)):
    path.parent.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    Image.new("RGB", size, colour).save(path)
    return path


def _folder_with_an_empty_class(root):
    """An ImageFolder tree: class a with 10 images, class b an empty folder (no captions file)."""
    for i in range(10):
        _png(root / "a" / f"{i}.png", (20 * i, 10, 10))
    (root / "b").mkdir()
    return root


def _train(argv, tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, *argv, f"output_dir={tmp_path / 'run'}"])
    return code, capsys.readouterr().err


ONE_CLASS = {
    "image folder with an empty class folder": (
        lambda p: ["data.source=imagefolder", "tasks=[cls]", f"data.train_path={_folder_with_an_empty_class(p / 'f')}",
                   f"data.val_path={p / 'f'}"],
        ["1 class (a)", "class b has no training item", "image folder", "at least 2"]),
    "manifest with label 0 only and data.num_classes=3": (
        lambda p: ["data.source=manifest", "tasks=[cls]", "data.num_classes=3",
                   f"data.train_path={_manifest(p, 0)}", f"data.val_path={p / 'm.jsonl'}"],
        ["1 class (0)", "classes 1, 2 have no training item", "m.jsonl", "at least 2"]),
    "multi-input per_task.cls with an empty class folder": (
        lambda p: ["tasks=[cls]", "data.per_task.cls.source=imagefolder", "data.per_task.cls.batch_size=4",
                   f"data.per_task.cls.train_path={_folder_with_an_empty_class(p / 'f')}",
                   f"data.per_task.cls.val_path={p / 'f'}"],
        ["1 class (a)", "class b has no training item", "image folder", "at least 2"]),
}


def _manifest(p, label):
    import json

    _png(p / "ok.png")
    path = p / "m.jsonl"
    path.write_text("".join(json.dumps({"image": "ok.png", "label": label, "caption": "x"}) + "\n" for _ in range(10)))
    return path


@pytest.mark.parametrize("case", list(ONE_CLASS))
def test_a_training_set_with_items_of_one_class_is_refused(tmp_path, capsys, case):
    make_args, needles = ONE_CLASS[case]
    code, err = _train(make_args(tmp_path), tmp_path, capsys)
    assert code == 3, err
    assert "Traceback" not in err and "task 'cls' learns to tell classes apart" in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "run" / "checkpoints").exists()
