"""Data that must not reach training or predict as it is (issue 36): a thin image (1 x 1,000,000) is skipped and
counted, never resized whole; a training set with items of one class is refused; a corrupt QM9 cache sidecar is
rebuilt."""

from __future__ import annotations

import importlib.util
import json
import os

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


# ---------------------------------------------------------------------------------------------
# 36.5: a thin image (1 x 1,000,000) is skipped and counted, never resized whole; normal images crop as before


def _old_centre_crop(path, size):
    """The crop as mtl did it before the aspect limit: resize the short side, then cut the centre square."""
    import numpy as np
    from PIL import Image, ImageOps

    with Image.open(path) as raw:
        img = ImageOps.exif_transpose(raw).convert("RGB")
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    arr = np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.uint8).copy()
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


def _noise_png(path, size, seed=0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return str(path)


def test_normal_images_crop_bit_identically_to_before(tmp_path):
    from mtl.data.images import Augment, load_image

    sizes = [(64, 64), (37, 23), (23, 400), (17, 17 * 20), (300, 200), (9, 5)]  # 17 x 340: at the 20:1 limit
    for i, size in enumerate(sizes):
        path = _noise_png(tmp_path / f"{i}.png", size, seed=i)
        for s in (16, 32):
            assert torch.equal(load_image(path, s), _old_centre_crop(path, s)), (size, s)
        # hflip alone crops the centre square too, then maybe flips it
        flipped = load_image(path, 32, augment=Augment(hflip=True), key=(i, 0))
        old = _old_centre_crop(path, 32)
        assert torch.equal(flipped, old) or torch.equal(flipped, old.flip(-1)), size


@pytest.fixture
def resize_bound(monkeypatch):
    """Every PIL resize must make at most ``limit`` pixels; a larger one is recorded and raises MemoryError at once
    (what the real one did under a 5 GB limit), without allocating it."""
    from PIL import Image

    real, big = Image.Image.resize, []

    def bounded(self, size, *args, **kwargs):
        if size[0] * size[1] > bounded.limit:
            big.append(tuple(size))
            raise MemoryError(f"resize to {size}")
        return real(self, size, *args, **kwargs)

    bounded.limit, bounded.big = 0, big
    monkeypatch.setattr(Image.Image, "resize", bounded)
    return bounded


def _thin_png(path, length=1_000_000):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (1, length), (90, 120, 30)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import train

    out = tmp_path_factory.mktemp("guards") / "run"
    assert train.main(["--config", TINY, f"output_dir={out}", "trainer.max_steps=1", "trainer.eval_max_batches=0",
                       "checkpoint.every_steps=0", "tasks=[cls]", "trainer.num_samples=0"]) == 0
    return str(out)


def test_a_thin_image_is_refused_by_its_header_naming_it(tmp_path, resize_bound):
    """What predict reads an image with (``mtl.inference.read_image``): a DataError (predict's skip-and-count path)
    that says what is wrong with the file, and no resize of it at all."""
    from mtl.errors import DataError
    from mtl.inference import read_image

    resize_bound.limit = 64 * 32 * 32
    with pytest.raises(DataError, match=r"'.*thin.png' is 1 x 1,000,000 pixels \(1,000,000:1\).*20:1"):
        read_image(_thin_png(tmp_path / "thin.png"), 32)
    wide = _noise_png(tmp_path / "wide.png", (21 * 5, 5))  # just past the limit, the other way round
    with pytest.raises(DataError, match=r"105 x 5 pixels \(21:1\)"):
        read_image(wide, 32)
    assert resize_bound.big == []


@pytest.mark.slow  # trains a 1-step model (~13 s here); the read itself is tested above
def test_predict_skips_a_thin_image_counts_it_and_predicts_the_one_beside_it(tiny_model, tmp_path, capsys,
                                                                             resize_bound):
    from mtl.tools import predict as predict_tool

    size = 32  # configs/tiny.yaml's data.image_size
    resize_bound.limit = 64 * size * size  # a crop's intermediate image: bounded by the output size
    thin, good = _thin_png(tmp_path / "thin.png"), _noise_png(tmp_path / "good.png", (40, 30))
    assert os.path.getsize(thin) < 10_000  # a few kB on disk, as the 3,961 bytes
    out = tmp_path / "preds.jsonl"
    code = predict_tool.main(["--model", tiny_model, thin, good, "--out", str(out)])
    err = capsys.readouterr().err
    assert resize_bound.big == [], f"resized whole: {resize_bound.big}"
    assert code == 0, err
    assert [json.loads(line)["image"] for line in out.read_text().splitlines()] == [good]
    assert "warning: skipped:" in err and "thin.png" in err and "1 x 1,000,000 pixels" in err, err
    assert "1 prediction(s)" in err and "1 image(s) skipped" in err, err
    assert "Traceback" not in err


def test_training_data_checks_refuse_or_skip_a_thin_image(tmp_path, resize_bound):
    from mtl.data.manifest import ImageFolderCaptions, ManifestDataset
    from mtl.errors import DataError

    resize_bound.limit = 64 * 32 * 32
    _thin_png(tmp_path / "thin.png")
    _png(tmp_path / "ok.png")
    lines = [{"image": "thin.png", "label": 0, "caption": "x"}, {"image": "ok.png", "label": 1, "caption": "y"}]
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError, match=r"line 1: image 'thin.png' .* 1 x 1,000,000 pixels .*on_error=skip"):
        ManifestDataset(str(m), image_size=32)
    ds = ManifestDataset(str(m), image_size=32, num_classes=2, on_error="skip")
    assert len(ds) == 1 and ds.skipped == 1 and "thin.png" in ds.skip_reasons[0]
    assert ds[0]["image"].shape == (3, 32, 32)
    # an ImageFolder's scan is the same check
    root = tmp_path / "folder"
    _thin_png(root / "a" / "thin.png")
    _png(root / "a" / "ok.png")
    _png(root / "b" / "ok.png")
    folder = ImageFolderCaptions(str(root), image_size=32, on_error="skip")
    assert len(folder) == 2 and folder.skipped == 1 and "thin.png" in folder.skip_reasons[0]
    with pytest.raises(DataError, match="thin.png"):
        ImageFolderCaptions(str(root), image_size=32)
    assert resize_bound.big == []
