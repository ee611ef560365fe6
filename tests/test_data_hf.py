"""``data.source: hf`` (mtl/data/hf_source.py): a Hugging Face ``datasets`` data set read where it is: splits and
columns by name, ClassLabel names, a list of captions per image (one per epoch for training, all of them as BLEU's
references), memory-mapped random access through the samplers every source uses (the same global batch on 1 and 2
processes, exact resume by global-sample position), per-task sets in multi-input mode, and bad input refused with
one message naming the key (exit 2), or a bad row skipped and counted with ``data.on_error=skip``."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from mtl.config.schema import Config, load_config
from mtl.data import all_captions, build_datasets, build_train_loader, set_epoch
from mtl.data.hf_source import caption_choice
from mtl.data.loader import build_test_dataset, resume_position
from mtl.errors import ConfigError

from .conftest import TINY, make_collate
from .hf_data import CLASSES, captions_of, save_dict, split

pytest.importorskip("datasets")


def _cfg(path_, **hf):
    cfg = OmegaConf.structured(Config)
    cfg.data.source, cfg.data.image_size, cfg.seed = "hf", 16, 3
    cfg.data.hf.path = str(path_)
    for k, v in hf.items():
        OmegaConf.update(cfg, f"data.hf.{k}" if k != "on_error" else "data.on_error", v)
    return cfg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_dict(tmp_path_factory.mktemp("hf") / "ds")


def test_a_saved_dataset_dict_gives_splits_classes_and_caption_lists(saved):
    train, val = build_datasets(_cfg(saved))
    assert (len(train), len(val)) == (48, 12)
    assert train.class_names == val.class_names == CLASSES and train.num_classes == 3
    assert train.provides >= {"image", "index", "label", "captions"}
    item = val[5]
    assert item["image"].shape == (3, 16, 16) and 0.0 <= float(item["image"].min()) <= float(item["image"].max()) <= 1
    assert item["label"] == 5 % 3 and item["index"] == 5
    assert sorted(item["captions"]) == sorted(captions_of(5))  # every caption: the references
    assert train.normalization is None
    assert all_captions(train) == [c for i in range(48) for c in captions_of(i)]
    assert train.table.cache_files  # memory-mapped Arrow files, not a table copied into memory


def test_training_takes_one_caption_per_epoch_from_seed_epoch_and_index(saved):
    train, _ = build_datasets(_cfg(saved))
    i = 2  # three captions
    firsts = [train[(i, epoch)]["captions"][0] for epoch in range(12)]
    assert firsts == [captions_of(i)[caption_choice(3, e, i, 3)] for e in range(12)]
    assert len(set(firsts)) == 3  # every caption gets its turn
    assert firsts == [train[(i, epoch)]["captions"][0] for epoch in range(12)]  # a pure function: a resume agrees
    other = build_datasets(_cfg(saved))[0]
    other.seed = 4
    assert [other[(i, e)]["captions"][0] for e in range(12)] != firsts  # the seed chooses too
    assert sorted(train[(i, 7)]["captions"]) == sorted(captions_of(i))


def test_parquet_files_through_the_builder_and_a_test_split(tmp_path):
    for name, n, off in (("train", 24, 0), ("validation", 6, 500), ("test", 9, 900)):
        split(n, off).to_parquet(str(tmp_path / f"{name}.parquet"))
    files = {"train": "train.parquet", "validation": "validation.parquet", "test": "test.parquet"}
    cfg = _cfg(tmp_path, builder="parquet", data_files=files, cache_dir=str(tmp_path / "cache"), test_split="test")
    train, val = build_datasets(cfg)
    assert (len(train), len(val), train.class_names) == (24, 6, CLASSES)  # the ClassLabel survives Parquet
    test = build_test_dataset(cfg, train)
    assert len(test) == 9 and test.class_names == CLASSES


def test_an_image_folder_through_datasets_imagefolder_builder(tmp_path):
    from .hf_data import png

    for part, n in (("train", 6), ("validation", 3)):
        for c in CLASSES[:2]:
            os.makedirs(tmp_path / "imgs" / part / c)
            for i in range(n):
                (tmp_path / "imgs" / part / c / f"{i}.png").write_bytes(png(i + 10 * len(c)))
    train, val = build_datasets(_cfg(tmp_path / "imgs", builder="imagefolder", cache_dir=str(tmp_path / "cache")))
    assert (len(train), len(val), train.class_names) == (12, 6, CLASSES[:2])
    assert "captions" not in train.provides and {train[i]["label"] for i in range(12)} == {0, 1}


def test_integer_labels_name_classes_by_index_and_a_string_caption_is_one_reference(tmp_path):
    path = save_dict(tmp_path / "ds", label="int", caption="str")
    train, _ = build_datasets(_cfg(path))
    assert train.class_names == ["0", "1", "2"] and train[4]["captions"] == [captions_of(4)[0]]


BAD = {  # override -> (the key the message names, words it says)
    "missing split": ({"val_split": "valid"}, "data.hf.val_split", "its splits: train, validation"),
    "missing image column": ({"image_column": "img"}, "data.hf.image_column", "its columns: image, label, caption"),
    "missing label column": ({"label_column": "y"}, "data.hf.label_column", "no column 'y'"),
    "missing caption column": ({"caption_column": "text"}, "data.hf.caption_column", "no column 'text'"),
    "not a save_to_disk folder": ({"path": "/"}, "data.hf.path", "data.hf.builder"),
    "an unknown builder": ({"builder": "tfrecord"}, "data.hf.builder", "parquet"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_message_naming_the_key(saved, case):
    overrides, key, says = BAD[case]
    with pytest.raises(ConfigError) as e:
        build_datasets(_cfg(saved, **overrides))
    assert e.value.exit_code == 2 and len(e.value.errors) == 1
    assert e.value.errors[0].startswith(key) and says in e.value.errors[0]


def test_a_label_column_neither_integer_nor_classlabel_is_refused(tmp_path):
    path = save_dict(tmp_path / "ds", label="str")
    with pytest.raises(ConfigError, match=r"data.hf.label_column: column 'label' .* holds string, neither integers "
                                          r"nor a ClassLabel — encode it \(ds.class_encode_column"):
        build_datasets(_cfg(path))


def test_an_undecodable_image_cell_stops_the_run_or_is_skipped_and_counted(tmp_path):
    path = save_dict(tmp_path / "ds", bad=(3, 17))
    with pytest.raises(ConfigError, match=r"data.hf.image_column: split 'train' of .* row 3: the image cannot be "
                                          r"decoded .* — replace the cell, or set data.on_error=skip"):
        build_datasets(_cfg(path))
    train, _ = build_datasets(_cfg(path, on_error="skip"))
    assert len(train) == 46 and train.skipped == 2 and "row 17" in train.skip_reasons[1]
    assert train[3]["index"] == 3 and train.row_of(3) == 4  # the items after a skipped row move up
    # with the check off a bad cell is named when it is read
    lazy = build_datasets(_cfg(path, verify=False))[0]
    assert len(lazy) == 48
    with pytest.raises(ConfigError, match="row 3 cannot be decoded at load time"):
        lazy[3]


def test_datasets_not_installed_names_the_extra(saved, monkeypatch):
    import builtins

    from mtl.setup import checks

    real = builtins.__import__

    def no_datasets(name, *a, **kw):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ConfigError, match=r"pip install -e '.\[data\]'"):
        build_datasets(_cfg(saved))
    monkeypatch.setattr(checks, "tracker_installed", lambda name: name != "datasets")
    cfg = load_config(TINY, ["data.source=hf", f"data.hf.path={saved}"])
    assert [e for e in checks.validate(cfg) if "data extra" in e] == [
        "data.source: hf reads Hugging Face datasets, and the datasets library is not installed; install the data "
        "extra (pip install -e '.[data]', or make install)"]


def test_train_batches_and_resume_positions_do_not_depend_on_world_size(saved, tok):
    """Rows come through the samplers every source uses: W ranks with batch B see exactly the samples of one
    process with batch W*B, and a position resumed part-way through an epoch continues with the same samples."""
    train, _ = build_datasets(_cfg(saved))
    collate = make_collate(tok, 8)
    ranks = [build_train_loader(train, collate, 4, r, 2, seed=3) for r in range(2)]
    single = build_train_loader(train, collate, 8, 0, 1, seed=3)
    for loader in [*ranks, single]:
        set_epoch(loader, 1)
    rank_batches = [[b["index"].tolist() for b in loader] for loader in ranks]
    single_batches = [b["index"].tolist() for b in single]
    assert len(single_batches) == 6
    for k, glob in enumerate(single_batches):
        assert [rank_batches[r][k] for r in range(2)] == [glob[0::2], glob[1::2]]
    # resumed after 2 global batches of 8, on one process: the rest of the epoch, as the uninterrupted run
    epoch, batches, rest = resume_position({"epoch": 1, "samples": 16}, 8, 1)
    again = build_train_loader(train, collate, 8, 0, 1, seed=3)
    set_epoch(again, epoch)
    again.sampler.set_start(batches * 8)
    assert rest == 0 and [b["index"].tolist() for b in again] == single_batches[2:]


@pytest.fixture(scope="module")
def tok():
    from mtl.data import train_tokenizer

    return train_tokenizer([c for i in range(48) for c in captions_of(i)], vocab_size=64)


def test_evaluation_scores_against_every_reference():
    """Multi-reference corpus BLEU (sacrebleu's reference streams, an image with fewer references padded with
    None), as COCO is scored: a caption equal to any one reference is a perfect match."""
    from mtl.tasks.captioning import CaptioningHead

    hyps = ["the big brown dog runs", "a small cat sits on the mat"]
    refs = [["a dog in a park today", "the big brown dog runs"], ["a small cat sits on the mat"]]
    part = {"hyps": hyps, "refs": refs, "index": [0, 1], "nll": 1.0, "tokens": 4}
    every = CaptioningHead.eval_reduce(None, [part])
    first = CaptioningHead.eval_reduce(None, [{**part, "refs": [r[:1] for r in refs]}])
    assert every["bleu4"] == pytest.approx(1.0) and every["exact"] == 1.0
    assert first["bleu4"] < 0.9 and first["exact"] == 0.5


def test_each_task_takes_its_own_hf_dataset_in_multi_input_mode(tmp_path):
    from mtl.data.multi_input import build_task_datasets
    from mtl.setup.build import run_task_types

    cls_path = save_dict(tmp_path / "cls", train=30, val=6)
    gen_path = save_dict(tmp_path / "gen", train=20, val=5, label="int")
    cfg = load_config(TINY, ["tasks=[cls,gen]", "data.image_size=16",
                             f"data.per_task={{cls: {{source: hf, hf: {{path: {cls_path}}}}}, "
                             f"gen: {{source: hf, on_error: skip, hf: {{path: {gen_path}, label_column: null}}}}}}"])
    types = run_task_types(cfg)
    sets = build_task_datasets(cfg, {t: types[t] for t in cfg.tasks})
    (cls_train, cls_val), (gen_train, gen_val) = sets["cls"], sets["gen"]
    assert (len(cls_train), len(cls_val), len(gen_train), len(gen_val)) == (30, 6, 20, 5)
    assert cls_train.class_names == CLASSES and set(cls_train[0]) == {"image", "index", "label"}
    assert set(gen_train[0]) == {"image", "index", "captions"}


def test_the_evaluate_tool_reads_the_val_split_with_the_model_s_classes(saved):
    from mtl.inference.evaluate import eval_dataset

    val = eval_dataset(_cfg(saved), CLASSES)
    assert len(val) == 12 and val.class_names == CLASSES and val[4]["label"] == 1
    with pytest.raises(ConfigError, match="the training split's classes are a, b"):
        eval_dataset(_cfg(saved), ["a", "b"])


def test_skipped_rows_are_counted_with_the_run_s_bad_lines(tmp_path):
    from mtl.setup.build import build_run_inputs
    from mtl.setup.checks import load_run_config

    path = save_dict(tmp_path / "ds", bad=(3, 17))
    cfg = load_run_config(TINY, ["data.source=hf", f"data.hf.path={path}", "data.on_error=skip", "data.image_size=16",
                                 f"output_dir={tmp_path / 'run'}"])
    count, reasons = build_run_inputs(cfg).skipped_lines()
    assert count == 2 and [r.split(": ")[0].rsplit(" ", 2)[1:] for r in reasons] == [["row", "3"], ["row", "17"]]
