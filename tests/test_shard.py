"""``python -m mtl.tools.shard``: a user's manifest or ImageFolder written as WebDataset shards (open_clip/timm keys)
or as an HF dataset (ClassLabel, caption lists) that ``data.source: hf`` reads; the chosen shard size; every sample
read back and compared; bad input one message, exit 2, nothing written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from mtl.config.schema import Config
from mtl.data import build_datasets
from mtl.tools import shard

pytest.importorskip("datasets")
pytest.importorskip("webdataset")


@pytest.fixture
def src(tmp_path):
    """A manifest of 10 images (5 cats, 5 dogs; PNG and JPEG), 1 or 2 captions each, and a 4-line val manifest."""
    rng = np.random.default_rng(0)
    lines = []
    for c in ("cat", "dog"):
        for i in range(5):
            rel = f"img/{c}/{i}.{'jpg' if i % 2 else 'png'}"
            os.makedirs(tmp_path / "img" / c, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (10, 14, 3), dtype=np.uint8)).save(tmp_path / rel)
            lines.append({"image": rel, "label": c, "captions": [f"a {c}", f"one {c} {i}"][: 1 + i % 2]})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(x) for x in lines[3:7]))
    return tmp_path


def _run(*argv) -> int:
    return shard.main([str(a) for a in argv])


def test_a_manifest_as_webdataset_shards_of_the_chosen_size(src, capsys):
    import webdataset as wds

    out = src / "wds"
    assert _run("--train", src / "train.jsonl", "--val", src / "val.jsonl", "--to", "webdataset", "--out", out,
                "--shard-size", 3) == 0
    assert "read back and compared: 14 samples" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["class_names.json", *[f"train-00000{i}.tar" for i in range(4)],
                                       "validation-000000.tar", "validation-000001.tar"]
    assert json.loads((out / "class_names.json").read_text()) == ["cat", "dog"]
    got = list(wds.WebDataset([str(out / f"train-00000{i}.tar") for i in range(4)], shardshuffle=False))
    assert [s["__key__"] for s in got] == [f"{i:08d}" for i in range(10)]
    assert [int(s["cls"]) for s in got] == [0] * 5 + [1] * 5
    assert [("jpg" in s, "png" in s) for s in got[:2]] == [(False, True), (True, False)]  # the file's own bytes
    assert (src / "img/cat/1.jpg").read_bytes() == got[1]["jpg"]
    assert got[0]["txt"] == b"a cat" and "json" not in got[0]  # one caption: txt
    assert json.loads(got[1]["json"]) == ["a cat", "one cat 1"] and got[1]["txt"] == b"a cat"  # several: json too


def test_a_manifest_as_an_hf_dataset_that_data_source_hf_reads(src, capsys):
    out = src / "hf"
    assert _run("--train", src / "train.jsonl", "--val", src / "val.jsonl", "--to", "hf", "--out", out,
                "--shard-size", 4) == 0
    assert len([f for f in os.listdir(out / "train") if f.endswith(".arrow")]) == 3  # 10 rows, 4 a shard
    cfg = OmegaConf.structured(Config)
    cfg.data.source, cfg.data.image_size, cfg.data.hf.path = "hf", 8, str(out)
    train, val = build_datasets(cfg)
    assert (len(train), len(val), train.class_names) == (10, 4, ["cat", "dog"])
    assert [train[i]["label"] for i in range(10)] == [0] * 5 + [1] * 5
    assert sorted(val[0]["captions"]) == ["a cat", "one cat 3"] and val[3]["label"] == 1
    assert sorted(train[1]["captions"]) == ["a cat", "one cat 1"]


def test_an_image_folder_without_captions_as_hf(tmp_path):
    rng = np.random.default_rng(1)
    for part in ("train", "val"):
        for c in ("a", "b"):
            os.makedirs(tmp_path / part / c)
            for i in range(2):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / part / c / f"{i}.bmp")
    out = tmp_path / "hf"
    assert _run("--train", tmp_path / "train", "--val", tmp_path / "val", "--to", "hf", "--out", out) == 0
    cfg = OmegaConf.structured(Config)
    cfg.data.source, cfg.data.image_size, cfg.data.hf.path = "hf", 8, str(out)
    train, _ = build_datasets(cfg)
    assert train.class_names == ["a", "b"] and "captions" not in train.provides  # BMP re-encoded as PNG


def test_bad_input_is_one_message_exit_2_and_nothing_written(src, capsys):
    with open(src / "train.jsonl", "a") as f:
        f.write('\n{"image": "img/cat/9.png", "label": "cat", "caption": "gone"}')
    out = src / "out"
    assert _run("--train", src / "train.jsonl", "--to", "hf", "--out", out) == 2
    err = capsys.readouterr().err
    assert err.count("\n  - ") == 1 and "--train: manifest" in err and "line 11" in err and "not found" in err
    assert "or set --on-error skip" in err
    assert not out.exists() and not [f for f in os.listdir(src) if f.startswith(".shard-")]
    # skipped and counted instead
    assert _run("--train", src / "train.jsonl", "--to", "webdataset", "--out", out, "--on-error", "skip") == 0
    assert "1 bad line(s) skipped" in capsys.readouterr().out
    # an --out that holds something is refused
    assert _run("--train", src / "train.jsonl", "--to", "hf", "--out", out) == 2
    assert "--out:" in capsys.readouterr().err


def test_the_round_trip_check_finds_a_sample_that_did_not_come_back(src, monkeypatch, capsys):
    write = shard.write_webdataset

    def lossy(sets, tmp, size):
        shards = write(sets, tmp, size)
        os.remove(os.path.join(tmp, shards["train"].pop()))
        return shards

    monkeypatch.setattr(shard, "write_webdataset", lossy)
    out = src / "wds"
    assert _run("--train", src / "train.jsonl", "--to", "webdataset", "--out", out, "--shard-size", 4) == 3
    assert "round-trip check: sample 00000008 of train was not read back" in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_library_names_the_extra_and_writes_nothing(src, monkeypatch, capsys):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **kw: (_ for _ in ()).throw(ImportError(name))
                        if name == "webdataset" else real(name, *a, **kw))
    out = src / "wds"
    assert _run("--train", src / "train.jsonl", "--to", "webdataset", "--out", out) == 2
    err = capsys.readouterr().err
    assert "the webdataset library, which is not installed; install the data extra (pip install -e '.[data]'" in err
    assert not out.exists()
