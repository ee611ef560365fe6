"""``data.source: hf_stream`` (mtl/data/parquet_stream.py): Parquet files streamed through datasets'
``IterableDataset`` and ``split_dataset_by_node``, with the webdataset source's plan: every row once per epoch when
the files divide evenly, exact resume part-way into an epoch, refusals by name. Files are written here."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from omegaconf import OmegaConf

from mtl.config.keys import Config
from mtl.data.loader import build_datasets
from mtl.errors import ConfigError

from .conftest import TINY, run_train
from .resume_check import check_resume, snapshot
from .test_webdataset import collate, epoch, indices
from .webdataset_shards import CLASSES, write_parquet

pytest.importorskip("datasets")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """datasets' cache (streaming writes its lock files there) inside the test's folder, never the user's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def config(folder, train_sizes, val_sizes=(5, 5)):
    cfg = OmegaConf.structured(Config)
    cfg.data.source, cfg.data.image_size = "hf_stream", 16
    cfg.data.hf_stream.train_files = write_parquet(str(folder), list(train_sizes))
    cfg.data.hf_stream.val_files = write_parquet(str(folder), list(val_sizes), "val", start=10_000)
    return cfg


@pytest.mark.parametrize("workers", [0, 2])
def test_every_row_once_per_epoch_and_a_resumed_epoch_gives_the_same_batches(tmp_path, workers):
    train, val = build_datasets(config(tmp_path, [6] * 8))
    assert train.class_names == CLASSES and train.provides == {"image", "index", "label", "captions"}
    two = indices(epoch(train, 0, 2, workers, 3, 1)) + indices(epoch(train, 1, 2, workers, 3, 1))
    assert sorted(two) == list(range(48))  # every row once across 2 ranks x workers
    assert collections.Counter(indices(epoch(train, 0, 1, workers, 6, 1))) == collections.Counter(two)
    full = epoch(train, 1, 2, workers, 3, e=2)
    for k in (1, 3, 4):  # part-way: the same batches (odd k: the loader's first worker plays another's part)
        rest = epoch(train, 1, 2, workers, 3, e=2, start=k)
        assert [b["index"].tolist() for b in rest] == [b["index"].tolist() for b in full[k:]]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(full[k:], rest))


def test_files_that_do_not_divide_over_the_workers_are_refused(tmp_path):
    from mtl.data.loader import build_train_loader

    train, _ = build_datasets(config(tmp_path, [6] * 6))
    with pytest.raises(ConfigError, match="6 Parquet file.*2 process.*2 loader worker.*multiple of 4"):
        build_train_loader(train, collate, 3, 0, 2, seed=0, num_workers=2)


def test_a_label_column_without_class_names_is_refused(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"image": [{"bytes": b"x", "path": None}], "label": [1], "caption": [["a"]]},
                               features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64"),
                                                           "caption": datasets.Sequence(datasets.Value("string"))})
                               ).to_parquet(str(tmp_path / "t.parquet"))
    cfg = config(tmp_path, [4])
    cfg.data.hf_stream.train_files, cfg.data.hf_stream.verify_images = str(tmp_path / "t.parquet"), False
    with pytest.raises(ConfigError, match="data.hf_stream.label_column: 'label' is not a ClassLabel"):
        build_datasets(cfg)


def test_an_undecodable_image_follows_on_error(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    good = config(tmp_path, [4])
    table = pq.read_table(good.data.hf_stream.train_files.replace("*", "00"))
    rows = table.to_pydict()
    rows["image"][2] = {"bytes": b"\xff\xd8\xff not a jpeg", "path": None}
    features = datasets.Features.from_arrow_schema(table.schema)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "bad.parquet"))
    good.data.hf_stream.train_files = str(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match="bad.parquet row 2: its image cannot be decoded.*on_error=skip"):
        build_datasets(good)
    good.data.on_error = "skip"
    train, _ = build_datasets(good)
    assert train.skipped == 1 and len(train) == 3 and train.shards[0].keys == ["0", "1", "3"]


@pytest.mark.slow
def test_a_killed_hf_stream_run_resumes_bitwise_identical(tmp_path):
    """As tests/test_webdataset.py's, with 2 loader workers: 8 files of 6 rows, batch 8, 6 steps an epoch."""
    from .test_reliability import kill_job, model_bytes, start, wait_for_step

    folder = str(tmp_path / "files")
    args = ["--config", TINY, "data.source=hf_stream", f"data.hf_stream.train_files={write_parquet(folder, [6] * 8)}",
            f"data.hf_stream.val_files={write_parquet(folder, [8, 8], 'val', start=10_000)}", "data.num_workers=2",
            "trainer.max_steps=10", "trainer.eval_every=1000", "trainer.eval_max_batches=1", "trainer.log_every=1",
            "checkpoint.every_steps=4", "resume=auto", "model.decoder.dropout=0.1", "data.batch_size=8"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"], env=env)
    proc = start([*args, f"output_dir={cut}"], env=env)
    wait_for_step(proc, cut, 5)
    assert len(kill_job(proc)) >= 1  # the run really was killed
    before = snapshot(cut)
    assert 0 < before.step < 10 and before.step % 6 != 0  # part-way into an epoch
    run_train([*args, f"output_dir={cut}"], env=env)
    check_resume(cut, before, last_step=10)
    assert model_bytes(ref, 10) == model_bytes(cut, 10)


def test_datasets_not_installed_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    from .test_bad_input import main_of

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    out = tmp_path / "run"
    code, err = main_of(["--config", TINY, "data.source=hf_stream", "data.hf_stream.train_files=t-*.parquet",
                         "data.hf_stream.val_files=v.parquet", f"output_dir={out}"], capsys)
    assert code == 2 and "datasets library" in err and "pip install -e '.[data]'" in err, err
    assert not out.exists() or not any(out.iterdir())
