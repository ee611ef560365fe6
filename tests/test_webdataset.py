"""``data.source: webdataset`` (mtl/data/streamed.py): the epoch a stream gives every rank and worker, exact resume
part-way into an epoch, 1 process against 2, and bad shards refused before anything is written. Shards are written
here (tests/webdataset_shards.py); nothing is downloaded."""

from __future__ import annotations

import collections
import os
import tarfile
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from mtl.config.keys import Config
from mtl.data.loader import build_datasets, build_eval_loader, build_train_loader, start_at
from mtl.errors import ConfigError

from .conftest import TINY, run_train
from .resume_check import check_resume, snapshot
from .test_bad_input import main_of
from .webdataset_shards import CLASSES, overrides, write_shards

pytest.importorskip("webdataset")


def config(folder, train_sizes, val_sizes=(5, 5), **data):
    cfg = OmegaConf.structured(Config)
    cfg.data.source = "webdataset"
    cfg.data.image_size = 16
    cfg.data.webdataset.train_shards = write_shards(str(folder), list(train_sizes))
    cfg.data.webdataset.val_shards = write_shards(str(folder), list(val_sizes), "val", start=10_000)
    for k, v in data.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def collate(records):
    return {"index": torch.tensor([r["index"] for r in records]), "image": torch.stack([r["image"] for r in records]),
            "label": torch.tensor([r["label"] for r in records]), "caption": [r["captions"][0] for r in records]}


def as_rank(rank, world):
    """torchrun's environment for rank ``rank`` of ``world``: webdataset's split_by_node reads it."""
    return mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)})


def epoch(ds, rank, world, workers, batch, e=0, start=0):
    loader = build_train_loader(ds, collate, batch, rank, world, seed=0, num_workers=workers)
    start_at(loader, e, start)
    with as_rank(rank, world):
        out = list(loader)
    assert len(out) == len(loader)  # the loader says how many batches it gives
    return out


def indices(batches):
    return [int(i) for b in batches for i in b["index"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_across_ranks_and_workers_and_1_process_sees_the_same_multiset(tmp_path, workers):
    """8 shards of 6, batch 3: they divide evenly over 2 ranks x 2 workers, so an epoch of the two ranks together
    is every sample once, and one process sees the same multiset (in another order)."""
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    for e in (0, 1):
        ranks = [epoch(train, r, 2, workers, 3, e) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) == 8
        two = indices(ranks[0]) + indices(ranks[1])
        assert sorted(two) == list(range(48))  # every sample once
        one = indices(epoch(train, 0, 1, workers, 6, e))
        assert collections.Counter(one) == collections.Counter(two)  # 1 process: the same multiset
        assert train.left_out(e) == 0
    assert indices(epoch(train, 0, 2, workers, 3, 0)) != indices(epoch(train, 0, 2, workers, 3, 1))  # reshuffled


def test_uneven_shards_cut_every_stream_to_the_same_number_of_batches(tmp_path):
    """Shards of unequal sizes: every rank gets the same number of batches in every epoch (DDP cannot hang), no
    sample twice, and what is left out is counted."""
    train, _ = build_datasets(config(tmp_path, [7, 5, 9, 6, 4, 8, 6, 3]))
    for e in range(3):
        ranks = [epoch(train, r, 2, 2, 2, e) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) == train.batches_per_epoch(e) > 0
        seen = indices(ranks[0]) + indices(ranks[1])
        assert len(seen) == len(set(seen))
        assert len(seen) + train.left_out(e) == len(train) == 48


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_gives_the_same_batches(tmp_path, workers):
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    full = epoch(train, 1, 2, workers, 3, e=2)
    for k in (1, 3, 4, 7):
        rest = epoch(train, 1, 2, workers, 3, e=2, start=k)
        assert len(rest) == len(full) - k
        for a, b in zip(full[k:], rest):
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])
            assert a["caption"] == b["caption"]


def test_records_follow_the_open_clip_layout(tmp_path):
    train, val = build_datasets(config(tmp_path, [6] * 8))
    assert train.provides == {"image", "index", "label", "captions"} and train.class_names == CLASSES
    item = train[3]  # json: a list of two captions; the epoch chooses which comes first
    assert item["label"] == 3 and item["image"].shape == (3, 16, 16) and len(item["captions"]) == 2
    assert "a star number 3" in train.all_captions()
    got = indices(build_eval_loader(val, collate, 4, 0, 1, num_workers=0))
    assert got == list(range(10))  # validation: every sample once, in order


def test_shards_named_by_a_list_file_or_joined_patterns(tmp_path):
    from mtl.data.streamed import shard_paths

    pattern = write_shards(str(tmp_path), [2] * 4)
    (tmp_path / "list.txt").write_text("# the first two\ntrain-000000.tar\ntrain-000001.tar\n")
    assert shard_paths(str(tmp_path / "list.txt"), "k") == [str(tmp_path / f"train-00000{i}.tar") for i in (0, 1)]
    joined = f"{tmp_path}/train-{{000000..000001}}.tar::{tmp_path}/train-000003.tar"
    assert [os.path.basename(p) for p in shard_paths(joined, "k")] == [f"train-00000{i}.tar" for i in (0, 1, 3)]
    assert len(shard_paths(pattern, "k")) == 4


def test_a_resume_on_another_split_is_refused_by_name(tmp_path):
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    loader = build_train_loader(train, collate, 3, 0, 1, seed=0, num_workers=0)
    loader.verify_resume({"world_size": 1, "num_workers": 0})  # the same split: continues
    for saved in ({"world_size": 2, "num_workers": 0}, {"world_size": 1, "num_workers": 2}):
        with pytest.raises(ConfigError, match="data.source=webdataset.*Resume with"):
            loader.verify_resume(saved)


def test_too_few_shards_for_the_workers_is_refused(tmp_path):
    train, _ = build_datasets(config(tmp_path, [6] * 3))
    with pytest.raises(ConfigError, match="3 shard.*2 process.*at least 4"):
        build_train_loader(train, collate, 3, 0, 2, seed=0, num_workers=2)


def test_an_undecodable_image_follows_on_error(tmp_path):
    bad = {5: b"\xff\xd8\xff not a jpeg"}
    cfg = config(tmp_path, [6] * 8)
    cfg.data.webdataset.train_shards = write_shards(str(tmp_path / "bad"), [6] * 8, bad=bad)
    with pytest.raises(ConfigError, match="train-000000.tar sample 's000005'.*cannot be decoded.*on_error=skip"):
        build_datasets(cfg)
    cfg.data.on_error = "skip"
    train, _ = build_datasets(cfg)
    assert train.skipped == 1 and "s000005" in train.skip_reasons[0] and len(train) == 47
    assert "s000005" not in train.shards[0].keys  # never streamed: every other sample is, once
    assert sorted(indices(epoch(train, 0, 1, 0, 1))) == list(range(47))


def truncated(p):
    pattern = write_shards(str(p), [6] * 8)
    path = str(p / "train-000003.tar")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(tarfile.TarError):
        with tarfile.open(path) as t:
            t.getmembers()
    return pattern


def unnamed(p):
    pattern = write_shards(str(p), [6] * 8)
    os.remove(p / "class_names.json")
    return pattern


BAD = {  # the train shards' pattern, what the message must say
    "a pattern that matches nothing": (lambda p: str(p / "nope-{000000..000003}.tar"),
                                       ["data.webdataset.train_shards", "matches no shard file", "brace"]),
    "a truncated shard": (truncated, ["data.webdataset.train_shards", "train-000003.tar", "truncated"]),
    "no class names": (unnamed, ["data.webdataset.class_names", "class_names.json"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_shards_are_one_message_exit_2_nothing_written(tmp_path, capsys, case):
    make, needles = BAD[case]
    val = write_shards(str(tmp_path / "v"), [8], "val")
    out = tmp_path / "run"
    code, err = main_of(["--config", TINY, "data.source=webdataset", f"data.webdataset.train_shards={make(tmp_path)}",
                         f"data.webdataset.val_shards={val}", f"output_dir={out}"], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists() or not any(out.iterdir())


def test_webdataset_not_installed_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "webdataset" else real(name, *a))
    out = tmp_path / "run"
    code, err = main_of(["--config", TINY, "data.source=webdataset", "data.webdataset.train_shards=x-{0..1}.tar",
                         "data.webdataset.val_shards=y.tar", f"output_dir={out}"], capsys)
    assert code == 2 and "webdataset" in err and "pip install -e '.[data]'" in err, err
    assert not out.exists() or not any(out.iterdir())


# ---------------------------------------------------------------------------------------------
# through train.py: a run killed part-way into an epoch and resumed ends with the same weights


FAST = ["trainer.max_steps=10", "trainer.eval_every=1000", "trainer.eval_max_batches=1", "trainer.log_every=1",
        "checkpoint.every_steps=4", "resume=auto", "model.decoder.dropout=0.1", "data.batch_size=8"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_webdataset_run_resumes_bitwise_identical(tmp_path, workers):
    """48 samples, batch 8: 6 steps an epoch, so the 10 steps cross an epoch and the step-4 checkpoint is
    part-way into the first one. Then a resume with the other number of loader workers is refused by name."""
    from .test_reliability import kill_job, model_bytes, start, wait_for_step

    args = ["--config", TINY, *overrides(str(tmp_path / "shards"), [6] * 8, [8, 8]), *FAST,
            f"data.num_workers={workers}"]
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"])
    proc = start([*args, f"output_dir={cut}"])
    wait_for_step(proc, cut, 5)  # past the step-4 checkpoint, before step 8's
    assert len(kill_job(proc)) >= 1  # the run really was killed
    before = snapshot(cut)
    assert 0 < before.step < 10 and before.step % 6 != 0  # a real resume, part-way into an epoch
    run_train([*args, f"output_dir={cut}"])
    check_resume(cut, before, last_step=10)
    assert model_bytes(ref, 10) == model_bytes(cut, 10)
    # going on with other loader workers would split the shards otherwise: refused by name, nothing trained
    done = snapshot(cut)
    other = run_train([*args, f"output_dir={cut}", "trainer.max_steps=12", f"data.num_workers={2 - workers}"],
                      check=False)
    assert other.returncode == 2, other.stderr
    assert f"data.num_workers={workers}" in other.stderr and "Resume with 1 process(es)" in other.stderr
    assert check_resume(cut, done, last_step=10) == []  # no step after 10 was taken


@pytest.mark.slow
def test_two_processes_on_uneven_shards_run_the_same_steps_across_epochs(tmp_path):
    """2 processes (gloo) on shards of unequal sizes: every rank is cut to the same batches an epoch, so the run
    goes through several epochs to its last step instead of hanging in an all-reduce."""
    from .resume_check import metrics_records

    out = tmp_path / "run"
    sizes = [7, 5, 9, 6, 4, 8, 6, 3]
    done = run_train(["--config", TINY, *overrides(str(tmp_path / "shards"), sizes, [5, 4, 3]), "data.batch_size=4",
                      "trainer.max_steps=14", "trainer.eval_every=7", "trainer.log_every=1", f"output_dir={out}"],
                     nproc=2, timeout=240)
    assert "streamed: 5 batches a process in epoch 0 (2 process(es) x 1 worker stream(s); 8 of 48 samples left out" \
        in done.stdout + done.stderr
    epochs = [r["epoch"] for r in metrics_records(str(out)) if r.get("kind") == "train"]
    assert len(epochs) == 14 and max(epochs) >= 2, epochs  # epochs of 4 to 6 steps (48 samples, some cut)


def test_persistent_workers_read_each_new_position(tmp_path):
    """One loader (its 2 workers persist) moved from epoch to epoch and into one part-way, after an epoch left
    half-read: each iterator gives what a fresh loader at that position gives."""
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    loader = build_train_loader(train, collate, 3, 0, 2, seed=0, num_workers=2)
    assert loader.persistent_workers
    for e, k, stop in ((0, 0, None), (1, 0, 2), (1, 3, None), (2, 5, None)):
        start_at(loader, e, k)
        with as_rank(0, 2):
            got = [b["index"].tolist() for _, b in zip(range(stop or 99), loader)]
        want = [b["index"].tolist() for b in epoch(train, 0, 2, 2, 3, e, k)][: stop or 99]
        assert got == want, (e, k)


@pytest.mark.parametrize("workers", [0, 2])
def test_reading_a_stream_leaves_the_global_random_stream_alone(tmp_path, workers):
    """Making a stream's iterator (each epoch, a resume) must not draw from torch's global generator: a resumed
    run's dropout would see a shifted stream and end with other weights."""
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    state = torch.get_rng_state()
    epoch(train, 0, 1, workers, 6, e=0)
    epoch(train, 0, 1, workers, 6, e=0, start=2)
    assert torch.equal(state, torch.get_rng_state())


def test_evaluate_reads_the_validation_shards_alone_with_the_model_s_classes(tmp_path):
    from mtl.inference.evaluate import eval_dataset

    cfg = config(tmp_path, [6] * 8)
    cfg.data.webdataset.train_shards = str(tmp_path / "gone-{0..3}.tar")  # an evaluation never reads them
    ds = eval_dataset(cfg, CLASSES)
    assert len(ds) == 10 and ds.class_names == CLASSES
    with pytest.raises(ConfigError, match="class index 2, beyond the 2 class names"):
        eval_dataset(cfg, CLASSES[:2])


def test_the_node_split_is_webdataset_s_own_and_must_agree_with_the_run(tmp_path, monkeypatch):
    """split_by_node reads the rank from torchrun's environment: a stream placed at rank 1 of 2 in a process whose
    environment says otherwise is refused by name, never read as another rank's shards."""
    train, _ = build_datasets(config(tmp_path, [6] * 8))
    loader = build_train_loader(train, collate, 3, 1, 2, seed=0, num_workers=0)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="webdataset places this stream at rank 0 of 1.*RANK/WORLD_SIZE"):
        next(iter(loader))
    with as_rank(1, 2):
        assert len(list(loader)) == len(loader) == 8
