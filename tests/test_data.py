"""Tests of mtl.data: the synthetic set, user manifests/ImageFolders, the tokenizer and the loaders."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from mtl.config.schema import Config
from mtl.data import (
    CaptionTokenizer,
    ImageFolderCaptions,
    ManifestDataset,
    SyntheticShapes,
    all_captions,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    set_epoch,
    train_tokenizer,
)
from mtl.data.synthetic import COLOURS, COUNT_WORDS, POSITIONS, SHAPES, caption_text, max_count_for
from mtl.errors import ConfigError, DataError
from mtl.tasks.captioning import IGNORE_INDEX

from .conftest import make_collate


def shapes(**kw) -> SyntheticShapes:
    args = dict(size=64, image_size=32, num_classes=4, max_count=3, noise=0.05, clutter=2, seed=7)
    args.update(kw)
    return SyntheticShapes(**args)


# ---------------------------------------------------------------------------------------------
# synthetic shapes


def test_synthetic_is_deterministic_per_seed_and_index():
    a, b = shapes(), shapes()
    for i in (0, 5, 63):
        assert torch.equal(a[i]["image"], b[i]["image"])
        assert a[i]["captions"] == b[i]["captions"] and a[i]["label"] == b[i]["label"]
    # order of access does not matter: item i depends on (seed, i) only
    assert torch.equal(shapes()[5]["image"], a[5]["image"])
    other = shapes(seed=8)
    assert not any(torch.equal(a[i]["image"], other[i]["image"]) for i in range(8))
    assert [a.caption(i) for i in range(32)] != [other.caption(i) for i in range(32)]


def test_a_kept_item_equals_a_fresh_render_and_is_the_callers_to_change(monkeypatch):
    """The memo of rendered items gives records equal to a render (image and every field), hands out copies (a
    caller that writes into a record changes nothing the next reader sees), stops keeping at MEMO_BYTES, and is
    not carried into a worker's copy of the data set."""
    import pickle

    import mtl.data.synthetic as synthetic

    ds = shapes()
    first = [ds[i] for i in range(8)]
    assert len(ds._memo) == 8
    for i, rec in enumerate(first):
        again = ds[(i, 3)]  # kept (the train sampler's (index, epoch) key)
        img, fields = ds.render(i)
        assert torch.equal(again["image"], torch.from_numpy(img)) and torch.equal(again["image"], rec["image"])
        assert {k: v for k, v in again.items() if k != "image"} == {k: v for k, v in rec.items() if k != "image"}
        assert all(again[k] == v for k, v in fields.items())
    first[0]["image"].zero_()
    first[0]["centres"][0][0] = -1.0
    assert ds[0]["image"].sum() > 0 and ds[0]["centres"][0][0] != -1.0
    assert pickle.loads(pickle.dumps(ds))._memo == {}
    monkeypatch.setattr(synthetic, "MEMO_BYTES", 3 * first[0]["image"].numel() * 4)
    small = shapes()
    for i in range(8):
        small[i]
    assert sorted(small._memo) == [0, 1, 2] and torch.equal(small[7]["image"], first[7]["image"])


def test_synthetic_item_format_and_label_range():
    ds = shapes(num_classes=5, size=200, image_size=40)
    assert len(ds) == 200 and ds.num_classes == 5 and ds.class_names == SHAPES[:5]
    labels, counts = set(), set()
    for i in range(0, 200, 10):
        item = ds[i]
        # the raw record: the image, its index, and the scene it was drawn from (for any task to take targets from)
        assert set(item) == set(ds.provides) == {"image", "index", "label", "shape", "captions", "count", "size",
                                                 "colour", "position", "centres", "radius", "background"}
        img = item["image"]
        assert img.dtype == torch.float32 and img.shape == (3, 40, 40)
        assert 0.0 <= img.min() and img.max() <= 1.0
        assert item["index"] == i and len(item["captions"]) == 1
        a = ds.attributes(i)  # the fast path draws the same scene
        assert {k: item[k] for k in a} == a and item["shape"] == SHAPES[item["label"]]
        assert item["colour"] in COLOURS and item["position"] in POSITIONS and len(item["background"]) == 3
        assert len(item["centres"]) == item["count"] and item["radius"] > 0
        # the centres are where the shape's colour was painted (next to them: a ring is hollow)
        colour = torch.tensor(COLOURS[item["colour"]])[:, None, None]
        for x, y in item["centres"]:
            x0, y0 = int(x), int(y)
            near = img[:, max(0, y0 - 3):y0 + 4, max(0, x0 - 3):x0 + 4]
            assert ((near - colour).abs().amax(0) < 0.2).any(), (i, x, y)
    for i in range(200):
        a = ds.attributes(i)
        labels.add(a["label"])
        counts.add(a["count"])
    assert labels == set(range(5))
    assert counts == {1, 2, 3}
    with pytest.raises(IndexError):
        ds[200]


def test_caption_depends_only_on_attributes_and_never_names_the_shape():
    ds = shapes(num_classes=7, size=300, max_count=4)
    by_attrs = defaultdict(set)
    labels_per_caption = defaultdict(set)
    for i in range(300):
        a = ds.attributes(i)
        cap = ds.caption(i)
        key = (a["count"], a["size"], a["colour"], a["position"])
        by_attrs[key].add(cap)
        labels_per_caption[cap].add(a["label"])
        assert cap == caption_text(*key)
        words = cap.split()
        assert not set(words) & set(SHAPES)
        assert words[0] == COUNT_WORDS[a["count"]] and a["size"] in words and a["colour"] in words
        assert cap.endswith(a["position"])
    assert all(len(caps) == 1 for caps in by_attrs.values())
    # the label does not decide the caption: many captions occur with more than one shape kind
    assert sum(len(v) > 1 for v in labels_per_caption.values()) > 10
    # the rendering path gives the same caption as the fast path
    assert all(ds[i]["captions"][0] == ds.caption(i) for i in range(0, 300, 37))


def _components(mask: np.ndarray) -> int:
    """Number of 8-connected components of a boolean mask (a tiny flood fill; no scipy needed)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    n = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        n += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            a, b = stack.pop()
            for c in range(max(a - 1, 0), min(a + 2, h)):
                for d in range(max(b - 1, 0), min(b + 2, w)):
                    if mask[c, d] and not seen[c, d]:
                        seen[c, d] = True
                        stack.append((c, d))
    return n


@pytest.mark.parametrize("image_size", [32, 64])
def test_image_shows_what_the_caption_says(image_size):
    """Without noise and clutter: the count is the number of blobs, the colour, size and position
    are where and what the caption says. So a model can learn every caption attribute."""
    max_count = max_count_for(image_size)
    ds = shapes(num_classes=7, size=60, image_size=image_size, noise=0.0, clutter=0, max_count=max_count)
    area = defaultdict(list)
    for i in range(60):
        img, a = ds.render(i)
        bg = np.median(img.reshape(3, -1), axis=1)
        diff = np.abs(img - bg[:, None, None]).max(axis=0)
        mask = diff > 0.5 * diff.max()
        assert _components(mask) == a["count"], (i, a)
        mean_rgb = img[:, mask].mean(axis=1)
        nearest = min(COLOURS, key=lambda c: np.abs(np.array(COLOURS[c]) - mean_rgb).sum())
        assert nearest == a["colour"], (i, a, mean_rgb)
        # position, read from the group's bounding box: a centre group is centred (within 7%), a
        # corner group lies on its side of both midlines by more than that (so the rule is crisp)
        ys, xs = np.nonzero(mask)
        cx = (xs.min() + xs.max() + 1) / 2 / image_size - 0.5
        cy = (ys.min() + ys.max() + 1) / 2 / image_size - 0.5
        ax, ay = POSITIONS[a["position"]]
        if a["position"] == "centre":
            assert max(abs(cx), abs(cy)) <= 0.07, (i, a, cx, cy)
        else:
            assert min(cx * np.sign(ax - 0.5), cy * np.sign(ay - 0.5)) >= 0.085, (i, a, cx, cy)
        area[a["size"]].append(mask.sum() / a["count"])
    assert min(area["large"]) > max(area["small"]) * 0.9
    assert np.mean(area["large"]) > 1.8 * np.mean(area["small"])


def test_synthetic_rejects_bad_settings():
    with pytest.raises(ConfigError, match="max_count"):
        shapes(max_count=max_count_for(32) + 1)
    with pytest.raises(ConfigError, match="num_classes"):
        shapes(num_classes=len(SHAPES) + 1)


def test_synthetic_captions_without_rendering():
    ds = shapes(size=500)
    caps = all_captions(ds)
    assert caps == [ds.caption(i) for i in range(500)]
    assert len(set(caps)) > 50


# ---------------------------------------------------------------------------------------------
# tokenizer


@pytest.fixture(scope="module")
def tok() -> CaptionTokenizer:
    return train_tokenizer(all_captions(shapes(size=400, max_count=4)) + ["a, b. c!"], vocab_size=200)


def test_tokenizer_specials_and_round_trip(tok):
    assert tok.pad_id == 0
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
    cap = "three small red objects in the top left"
    ids = tok.encode(cap)
    assert len(ids) == 8 and not {tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id} & set(ids)
    assert tok.decode(ids) == cap
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == cap
    messy = "  Three SMALL red, objects!  "
    assert tok.decode(tok.encode(messy)) == tok.normalize(messy) == "three small red , objects !"
    assert tok.encode("zebra")[0] == tok.unk_id
    assert 20 < tok.vocab_size <= 200


def test_tokenizer_save_load(tok, tmp_path):
    path = tok.save(str(tmp_path / "tok"))
    assert os.path.basename(path) == "tokenizer.json"
    again = CaptionTokenizer.load(str(tmp_path / "tok"))
    cap = "one large blue object in the centre"
    assert again.encode(cap) == tok.encode(cap)
    assert (again.pad_id, again.bos_id, again.eos_id, again.vocab_size) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
        tok.vocab_size,
    )
    with pytest.raises(DataError, match="nowhere"):
        CaptionTokenizer.load(str(tmp_path / "nowhere"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="broken"):
        CaptionTokenizer.load(str(tmp_path / "broken"))


def test_tokenizer_loads_gpt2_style_specials(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    bpe.train_from_iterator(["two small red objects", "one large blue object"] * 5, trainer=trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    t = CaptionTokenizer.load(str(tmp_path))
    eot = bpe.token_to_id("<|endoftext|>")
    assert t.bos_id == t.eos_id == t.pad_id == eot
    assert t.unk_id is None
    assert t.decode(t.encode("two red objects") + [eot]) == "two red objects"


# ---------------------------------------------------------------------------------------------
# collate and loaders


def _item(caption: str, index: int = 0) -> dict:
    return {"image": torch.zeros(3, 8, 8), "label": 1, "captions": [caption, "x"], "count": 2, "index": index}


def test_collate_shapes_and_target_shift(tok):
    collate = make_collate(tok, 16)
    caps = ["one large blue object in the centre", "two small red objects", "three objects"]
    batch = collate([_item(c, i) for i, c in enumerate(caps)])
    lengths = [len(tok.encode(c)) + 2 for c in caps]
    b, t = batch["input_ids"].shape
    assert (b, t) == (3, max(lengths)) and batch["image"].shape == (3, 3, 8, 8)
    for key in ("input_ids", "attention_mask", "target_ids", "label", "count", "index"):
        assert batch[key].dtype == torch.long
    assert batch["index"].tolist() == [0, 1, 2] and batch["count"].tolist() == [2, 2, 2]
    assert batch["references"] == [[c, "x"] for c in caps]
    for i, n in enumerate(lengths):
        row, tgt, mask = batch["input_ids"][i], batch["target_ids"][i], batch["attention_mask"][i]
        assert row[0] == tok.bos_id and row[n - 1] == tok.eos_id
        assert tok.decode(row[:n].tolist()) == caps[i]
        assert mask.tolist() == [1] * n + [0] * (t - n)
        assert (row[n:] == tok.pad_id).all()
        assert torch.equal(tgt[: n - 1], row[1:n])  # the next token
        assert (tgt[n - 1 :] == IGNORE_INDEX).all()  # nothing after EOS, nothing at padding


def test_collate_truncates_but_keeps_eos(tok):
    batch = make_collate(tok, 3)([_item("one large blue object in the centre")])
    ids = batch["input_ids"][0].tolist()
    assert ids == [tok.bos_id] + tok.encode("one large")[:2] + [tok.eos_id]
    assert batch["target_ids"][0].tolist() == ids[1:] + [IGNORE_INDEX]


def test_train_batches_do_not_depend_on_world_size(tok):
    """W ranks with batch B see, batch by batch, exactly the samples of 1 process with batch W*B."""
    ds = shapes(size=37, image_size=16, max_count=1, clutter=0)
    collate = make_collate(tok, 8)
    world, per_rank = 2, 4
    ranks = [build_train_loader(ds, collate, per_rank, r, world, seed=3) for r in range(world)]
    single = build_train_loader(ds, collate, per_rank * world, 0, 1, seed=3)
    orders = []
    for epoch in (0, 1):
        for loader in ranks + [single]:
            set_epoch(loader, epoch)
        rank_batches = [[b["index"].tolist() for b in loader] for loader in ranks]
        single_batches = [b["index"].tolist() for b in single]
        assert len(single_batches) == 37 // 8 == len(rank_batches[0]) == len(rank_batches[1])
        for k, glob in enumerate(single_batches):
            assert len(glob) == 8
            for r in range(world):
                assert rank_batches[r][k] == glob[r::world]  # positions r, r+W, ... of the global batch
        orders.append(single_batches)
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_eval_loader_covers_every_index_once(tok):
    ds = shapes(size=11, image_size=16, max_count=1, clutter=0)
    collate = make_collate(tok, 8)
    seen = []
    for r in range(3):
        idx = [i for b in build_eval_loader(ds, collate, 2, r, 3) for i in b["index"].tolist()]
        assert idx == list(range(r, 11, 3))
        seen += idx
    assert sorted(seen) == list(range(11))


# ---------------------------------------------------------------------------------------------
# user data


def _png(path, colour=(200, 30, 30), size=(12, 10)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def _write_lines(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


@pytest.fixture
def images(tmp_path):
    _png(str(tmp_path / "img" / "a.png"))
    _png(str(tmp_path / "img" / "b.png"), colour=(0, 0, 255))
    Image.new("RGB", (16, 16), (0, 255, 0)).save(tmp_path / "img" / "c.jpg", quality=90)
    return tmp_path


GOOD = [
    {"image": "img/a.png", "label": 0, "caption": "a red square"},
    {"image": "img/b.png", "label": 1, "captions": ["a blue square", "blue", "a square"]},
]


def test_manifest_good(images):
    third = {"image": "img/c.jpg", "label": 2, "caption": "g"}
    path = _write_lines(images / "train.jsonl", GOOD + ["", third])
    ds = ManifestDataset(path, image_size=8)
    assert len(ds) == 3 and ds.skipped == 0 and ds.num_classes == 3 and ds.class_names == ["0", "1", "2"]
    item = ds[0]
    assert item["image"].shape == (3, 8, 8) and item["image"].dtype == torch.float32
    assert torch.allclose(item["image"][:, 4, 4], torch.tensor([200, 30, 30]) / 255.0)
    assert (item["label"], item["index"], item["captions"]) == (0, 0, ["a red square"])
    assert "count" not in item and ds.provides == {"image", "index", "label", "captions"}  # no count in this file
    assert ds[1]["image"][2].min() == 1.0  # blue channel of the blue image
    assert sorted(all_captions(ds)) == sorted(["a red square", "a blue square", "blue", "a square", "g"])
    # explicit image_root: paths resolve against it, not the manifest's folder
    sub = images / "lists"
    sub.mkdir()
    ds2 = ManifestDataset(_write_lines(sub / "m.jsonl", GOOD), image_root=str(images), num_classes=5)
    assert len(ds2) == 2 and ds2.num_classes == 5


def test_multi_caption_choice_rotates_with_epoch(images):
    ds = ManifestDataset(_write_lines(images / "m.jsonl", GOOD), image_size=8)
    caps = GOOD[1]["captions"]
    firsts = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        item = ds[1]
        assert sorted(item["captions"]) == sorted(caps)
        firsts.append(item["captions"][0])
        assert ds[(1, epoch)]["captions"][0] == item["captions"][0]  # the sampler's (index, epoch) key
    assert firsts == [caps[(e + 1) % 3] for e in range(4)]


def test_caption_choice_reaches_persistent_workers(tok, images):
    """A train loader with a persistent worker still uses each epoch's caption (set on the sampler)."""
    lines = [{"image": "img/a.png", "label": 0, "captions": ["red", "blue"]}] * 4
    ds = ManifestDataset(_write_lines(images / "m.jsonl", lines), image_size=8)
    loader = build_train_loader(ds, make_collate(tok, 4), 4, 0, 1, seed=0, num_workers=1)
    assert loader.persistent_workers
    for epoch in (0, 1, 2):
        set_epoch(loader, epoch)
        (batch,) = list(loader)
        expect = [["red", "blue"][(epoch + i) % 2] for i in batch["index"].tolist()]
        assert [tok.decode(ids.tolist()) for ids in batch["input_ids"]] == expect


def _truncated_jpeg(path):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


BAD_CASES = {
    "missing image": ({"image": "img/nope.png", "label": 0, "caption": "x"}, "not found"),
    "truncated image": ({"image": "img/cut.jpg", "label": 0, "caption": "x"}, "cannot be decoded"),
    "empty caption": ({"image": "img/a.png", "label": 0, "caption": "  "}, "empty caption"),
    "no caption": ({"image": "img/a.png", "label": 0}, "caption"),
    "invalid json": ('{"image": "img/a.png", "label": 0,', "invalid JSON"),
    "label out of range": ({"image": "img/a.png", "label": 5, "caption": "x"}, "outside"),
    "label not int": ({"image": "img/a.png", "label": 1.5, "caption": "x"}, "not an integer"),
    "label of the other kind": ({"image": "img/a.png", "label": "cat", "caption": "x"}, "one kind"),
    "no image key": ({"label": 0, "caption": "x"}, "image"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_manifest_bad_line(images, case):
    bad, reason = BAD_CASES[case]
    _truncated_jpeg(str(images / "img" / "cut.jpg"))
    # the bad line is line 4 (after a blank line)
    path = _write_lines(images / "train.jsonl", GOOD + ["", bad])
    with pytest.raises(DataError) as err:
        ManifestDataset(path, num_classes=3)
    msg = str(err.value)
    assert path in msg and "line 4" in msg and reason in msg and "on_error=skip" in msg
    ds = ManifestDataset(path, num_classes=3, on_error="skip")
    assert len(ds) == 2 and ds.skipped == 1
    assert "line 4" in ds.skip_reasons[0] and reason in ds.skip_reasons[0]


def test_manifest_all_bad_or_missing_raises_even_when_skipping(images):
    path = _write_lines(images / "bad.jsonl", [{"image": "img/nope.png", "label": 0, "caption": "x"}])
    with pytest.raises(DataError, match="no usable lines"):
        ManifestDataset(path, on_error="skip")
    with pytest.raises(DataError, match="missing.jsonl"):
        ManifestDataset(str(images / "missing.jsonl"))


def test_manifest_load_time_failure_names_the_file(images):
    ds = ManifestDataset(_write_lines(images / "m.jsonl", GOOD))
    os.remove(images / "img" / "a.png")
    with pytest.raises(DataError, match="a.png"):
        ds[0]


def _image_folder(root):
    _png(str(root / "cat" / "1.png"))
    _png(str(root / "cat" / "2.png"))
    _png(str(root / "dog" / "1.png"), colour=(0, 0, 0))
    return root


def _line_2_refused_or_skipped(make, path: str, why: str):
    """``make(**kw)`` builds a data set whose ``path`` has one good line and a bad line 2: by default a DataError names
    the file, the line and ``why``; with on_error="skip" the set holds the good line and counts the bad one. Returns
    that set."""
    with pytest.raises(DataError) as err:
        make()
    assert path in str(err.value) and "line 2" in str(err.value) and why in str(err.value)
    skipping = make(on_error="skip")
    assert len(skipping) == 1 and skipping.skipped == 1
    return skipping


def test_image_folder(tmp_path):
    root = _image_folder(tmp_path / "train")
    _write_lines(
        root / "captions.jsonl",
        [
            {"image": "dog/1.png", "caption": "a dog"},
            {"image": "cat/1.png", "captions": ["a cat", "cat"]},
            {"image": "cat/2.png", "caption": "another cat"},
        ],
    )
    ds = ImageFolderCaptions(str(root), image_size=8)
    assert ds.class_names == ["cat", "dog"] and ds.num_classes == 2
    assert [ds[i]["label"] for i in range(3)] == [1, 0, 0]
    assert ds[0]["image"].shape == (3, 8, 8) and ds[0]["image"].max() == 0.0
    assert ds[1]["captions"] == ["cat", "a cat"] or ds[1]["captions"] == ["a cat", "cat"]
    # val split with the train classes; an image outside every class folder is a bad line
    val = _image_folder(tmp_path / "val")
    _png(str(val / "loose.png"))
    caps = _write_lines(
        tmp_path / "val_caps.jsonl",
        [{"image": "cat/1.png", "caption": "c"}, {"image": "loose.png", "caption": "b"}],
    )
    _line_2_refused_or_skipped(lambda **kw: ImageFolderCaptions(str(val), captions_file=caps, class_names=ds.class_names,
                                                                **kw), caps, "class folder")


@pytest.mark.parametrize("captions", [True, False])
def test_a_validation_class_with_no_training_images_is_named(tmp_path, captions):
    """A val folder bird/ that the training set lacks: not an image "outside a class folder", nor dropped with
    on_error=skip (its class would vanish from the scores), but refused by name (issue 41.6)."""
    val = _image_folder(tmp_path / "val")
    _png(str(val / "bird" / "1.png"))
    if captions:
        _write_lines(val / "captions.jsonl", [{"image": "cat/1.png", "caption": "c"},
                                              {"image": "bird/1.png", "caption": "b"}])
    for on_error in ("raise", "skip"):
        with pytest.raises(DataError) as err:
            ImageFolderCaptions(str(val), on_error=on_error, class_names=["cat", "dog"])
        msg = str(err.value)
        assert "class 'bird' has no training images" in msg and "training set's classes: cat, dog" in msg, msg
        assert "add training images of 'bird'" in msg and "remove its folder" in msg, msg
        assert "on_error" not in msg and "not inside a class folder" not in msg, msg


def test_image_folder_bad_image(tmp_path):
    root = _image_folder(tmp_path / "train")
    _truncated_jpeg(str(root / "dog" / "cut.jpg"))
    path = _write_lines(
        root / "captions.jsonl",
        [{"image": "cat/1.png", "caption": "a cat"}, {"image": "dog/cut.jpg", "caption": "a dog"}],
    )
    ds = _line_2_refused_or_skipped(lambda **kw: ImageFolderCaptions(str(root), **kw), path, "cut.jpg")
    assert "cut.jpg" in ds.skip_reasons[0]


# ---------------------------------------------------------------------------------------------
# from the config


def _cfg(**data):
    cfg = OmegaConf.structured(Config)
    for k, v in data.items():
        OmegaConf.update(cfg, f"data.{k}", v)
    return cfg


def test_build_datasets_synthetic_splits_use_seed_offsets():
    cfg = _cfg(image_size=32, **{"synthetic.train_size": 20, "synthetic.val_size": 10})
    cfg.seed = 5
    train, val = build_datasets(cfg)
    assert (len(train), len(val)) == (20, 10)
    assert train.seed == 5 + cfg.data.synthetic.train_seed_offset
    assert val.seed == 5 + cfg.data.synthetic.val_seed_offset
    assert not torch.equal(train[0]["image"], val[0]["image"])


STRING = [{"image": "img/a.png", "label": "dog", "caption": "a"}, {"image": "img/b.png", "label": "cat", "caption": "b"},
          {"image": "img/c.jpg", "label": "dog", "caption": "c"}]


def test_string_labels_name_the_classes(images):
    """Class names as labels (issue 41.6): the classes are the sorted names, and a val split reads them by name."""
    train = ManifestDataset(_write_lines(images / "train.jsonl", STRING), image_size=8)
    assert train.class_names == ["cat", "dog"] and train.num_classes == 2
    assert [train[i]["label"] for i in range(3)] == [1, 0, 1]
    val = ManifestDataset(_write_lines(images / "val.jsonl", STRING[1:2]), image_size=8, class_names=train.class_names)
    assert val.class_names == ["cat", "dog"] and val[0]["label"] == 0
    bird = _write_lines(images / "bird.jsonl", STRING[1:2] + [dict(STRING[0], label="bird")])
    for on_error in ("raise", "skip"):  # skipping its lines would drop the class from the scores
        with pytest.raises(DataError) as err:
            ManifestDataset(bird, on_error=on_error, class_names=train.class_names)
        assert "class 'bird' has no training images (the training set's classes: cat, dog)" in str(err.value)
        assert "remove its lines" in str(err.value) and bird in str(err.value)
    with pytest.raises(DataError, match="num_classes=3.*2 classes"):
        ManifestDataset(_write_lines(images / "train.jsonl", STRING), num_classes=3)
    cfg = _cfg(source="manifest", train_path=str(images / "train.jsonl"), val_path=str(images / "val.jsonl"))
    assert [ds.class_names for ds in build_datasets(cfg)] == [["cat", "dog"]] * 2


def test_a_classes_line_orders_the_classes(images):
    """A first line {"classes": [...]}: the class list in its order, for string labels and integer ones alike."""
    header = {"classes": ["dog", "cat", "bird"]}
    ds = ManifestDataset(_write_lines(images / "named.jsonl", [header] + STRING), image_size=8)
    assert ds.class_names == ["dog", "cat", "bird"] and ds.num_classes == 3  # bird: declared, no image yet
    assert [ds[i]["label"] for i in range(3)] == [0, 1, 0] and [r.line for r in ds.records] == [2, 3, 4]
    numbered = ManifestDataset(_write_lines(images / "numbered.jsonl", [header] + GOOD), image_size=8)
    assert numbered.class_names == ["dog", "cat", "bird"] and [numbered[i]["label"] for i in range(2)] == [0, 1]
    typo = _write_lines(images / "typo.jsonl", [header, STRING[0], dict(STRING[1], label="fox")])
    with pytest.raises(DataError) as err:
        ManifestDataset(typo)
    assert "line 3" in str(err.value) and "'fox'" in str(err.value) and "classes line" in str(err.value)
    assert len(ManifestDataset(typo, on_error="skip")) == 1
    for bad, why in (({"classes": "dog"}, "a list of class names"), ({"classes": ["a", "a"]}, "'a' twice")):
        with pytest.raises(DataError, match=why):
            ManifestDataset(_write_lines(images / "bad.jsonl", [bad] + STRING))
    with pytest.raises(DataError, match="classes line"):  # a val split's own list must be the training one
        ManifestDataset(_write_lines(images / "val.jsonl", [{"classes": ["cat", "dog"]}] + STRING),
                        class_names=["dog", "cat"])


def test_build_datasets_user_data(images):
    path = _write_lines(images / "train.jsonl", GOOD)
    with pytest.raises(ConfigError, match="data.val_path"):
        build_datasets(_cfg(source="manifest", train_path=path))
    val_path = _write_lines(images / "val.jsonl", [{"image": "img/a.png", "label": 7, "caption": "x"}])
    # val labels are checked against the train split's classes (2, inferred)
    with pytest.raises(DataError, match="outside"):
        build_datasets(_cfg(source="manifest", train_path=path, val_path=val_path))
    train, val = build_datasets(_cfg(source="manifest", train_path=path, val_path=path, image_size=8))
    assert len(train) == len(val) == 2 and val.num_classes == train.num_classes == 2


def test_resolve_tokenizer_trains_or_loads_and_writes_nothing(tmp_path):
    from mtl.setup.build import resolve_tokenizer

    cfg = _cfg(image_size=32, **{"synthetic.train_size": 50})
    cfg.output_dir = str(tmp_path / "run1")
    train, _ = build_datasets(cfg)
    trained = resolve_tokenizer(cfg, lambda: all_captions(train))
    assert trained.decode(trained.encode(train.caption(3))) == train.caption(3)
    assert not (tmp_path / "run1").exists()  # the run folder writes the run's copy (RunFolder.commit), not this
    trained.save(str(tmp_path / "tok"))
    cfg.tokenizer.path = str(tmp_path / "tok")
    cfg.output_dir = str(tmp_path / "run2")
    loaded = resolve_tokenizer(cfg, lambda: [])
    assert loaded.encode(train.caption(3)) == trained.encode(train.caption(3))


# ---------------------------------------------------------------------------------------------
# data a new user gives by mistake: each one message naming the file or key and the fix


def test_training_set_smaller_than_the_global_batch_is_refused(tok):
    """12 items, batch 8 per process, 2 processes: each rank's epoch holds 6 items, no full batch. Every rank
    (same size, same decision) refuses with the numbers, instead of looping forever over empty epochs."""
    ds = shapes(size=12)
    for rank in (0, 1):
        with pytest.raises(DataError) as err:
            build_train_loader(ds, make_collate(tok, 8), 8, rank, 2, seed=0)
        msg = str(err.value)
        assert "data.batch_size=8" in msg and "2 process(es)" in msg and "12 item(s)" in msg
    assert len(build_train_loader(ds, make_collate(tok, 8), 6, 0, 2, seed=0)) == 1  # 12 = 6 x 2 fills one


def test_a_60_image_manifest_at_the_default_batch_on_two_processes_is_refused(tok, images):
    path = _write_lines(images / "m.jsonl", [{"image": "img/a.png", "label": 0, "caption": "x"}] * 60)
    ds = ManifestDataset(path)
    with pytest.raises(DataError, match=r"60 item\(s\).*data.batch_size=32 x 2 process\(es\) = 64"):
        build_train_loader(ds, make_collate(tok, 8), 32, 1, 2, seed=0)


def test_a_train_loader_never_spins_on_an_empty_epoch(tok):
    from mtl.data.loader import ResumableDistributedSampler, TrainLoader

    ds = shapes(size=4)
    sampler = ResumableDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    loader = TrainLoader(ds, batch_size=8, sampler=sampler, collate_fn=make_collate(tok, 8), drop_last=True)
    with pytest.raises(DataError, match="no full batch"):
        iter(loader)
    # a resumed run that starts at the very end of an epoch legitimately has nothing left of it
    full = build_train_loader(shapes(size=16), make_collate(tok, 8), 8, 0, 1, seed=0)
    full.sampler.set_start(16)
    assert list(full) == []


STRAY = [{"image": "img/a.png", "label": i % 4, "caption": "x"} for i in range(8)] + [
    {"image": "img/b.png", "label": 7, "caption": "a typo"}]


def test_a_stray_label_does_not_add_classes(images):
    """Labels 0..3 and one 7 (line 9): not 8 classes but a bad line, reported with file and line or skipped."""
    path = _write_lines(images / "train.jsonl", STRAY)
    with pytest.raises(DataError) as err:
        ManifestDataset(path)
    msg = str(err.value)
    assert path in msg and "line 9" in msg and "label 7" in msg and "data.num_classes" in msg and "skip" in msg
    ds = ManifestDataset(path, on_error="skip")
    assert ds.num_classes == 4 and len(ds) == 8 and ds.skipped == 1 and "line 9" in ds.skip_reasons[0]
    assert ManifestDataset(path, num_classes=8).num_classes == 8  # said on purpose: accepted
    with pytest.raises(DataError, match="no line has label 0"):
        ManifestDataset(_write_lines(images / "one_based.jsonl", [dict(x, label=x["label"] + 1) for x in STRAY[:8]]))


def test_a_non_utf8_byte_costs_one_line_not_the_file(images):
    path = images / "train.jsonl"
    lines = [json.dumps(x).encode() for x in GOOD]
    path.write_bytes(lines[0] + b"\n" + b'{"image": "img/a.png", "label": 0, "caption": "caf\xe9"}\n' + lines[1] + b"\n")
    with pytest.raises(DataError) as err:
        ManifestDataset(str(path))
    msg = str(err.value)
    assert "line 2" in msg and "UTF-8" in msg and "0xe9" in msg and "on_error=skip" in msg
    ds = ManifestDataset(str(path), on_error="skip")
    assert len(ds) == 2 and ds.skipped == 1 and "line 2" in ds.skip_reasons[0]
    assert [r.line for r in ds.records] == [1, 3]


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
def test_tokenizer_training_prints_no_progress_bar():
    """The tokenizers library draws its bar only on a terminal, so run the training under a pseudo-terminal."""
    import pty
    import subprocess
    import sys

    code = "from mtl.data.tokenizer import train_tokenizer; train_tokenizer(['a red b %d' % i for i in range(5000)], 64)"
    master, slave = pty.openpty()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=slave, stderr=slave, cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, out
    assert b"Pre-processing" not in out and b"[00:00" not in out, out[:300]


# ---------------------------------------------------------------------------------------------
# real-data basics: EXIF, aspect ratio, augmentation, normalisation


RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _bands(path, colours, band=(20, 20), vertical=True):
    """Side-by-side (or stacked) bands of colour, each ``band`` = (w, h) pixels."""
    w, h = band
    n = len(colours)
    img = Image.new("RGB", (w * n, h) if vertical else (w, h * n))
    for i, c in enumerate(colours):
        img.paste(c, (i * w, 0, (i + 1) * w, h) if vertical else (0, i * h, w, (i + 1) * h))
    return img


def _is(t: torch.Tensor, rgb) -> bool:
    return torch.allclose(t, torch.tensor(rgb, dtype=torch.float32).view(3, *([1] * (t.dim() - 1))) / 255, atol=0.05)


def test_images_are_cropped_not_stretched(tmp_path):
    """A 60x20 picture red|green|blue: the centre crop keeps its proportions and shows only the green middle."""
    from mtl.data.images import load_image

    _bands(tmp_path / "wide.png", [RED, GREEN, BLUE]).save(tmp_path / "wide.png")
    img = load_image(str(tmp_path / "wide.png"), 16)
    assert img.shape == (3, 16, 16) and _is(img[:, :, 2:-2], GREEN)  # (the outer columns blend at the seams)


def test_exif_orientation_is_applied(tmp_path):
    """Stored as 40x20 red|blue with EXIF orientation 6 (shown turned 90 degrees clockwise): the upright
    picture is 20 wide and 40 tall, red above blue, so its centre crop is the top-red/bottom-blue seam."""
    from mtl.data.images import load_image

    img = _bands(None, [RED, BLUE])
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(tmp_path / "turned.jpg", exif=exif, quality=100)
    t = load_image(str(tmp_path / "turned.jpg"), 20)
    assert _is(t[:, 2:8, :], RED) and _is(t[:, 12:18, :], BLUE)  # upright: red on top
    with Image.open(tmp_path / "turned.jpg") as raw:
        assert raw.size == (40, 20)  # the file itself really is stored sideways


def test_augmentation_is_off_by_default_and_reproducible_when_on(tmp_path):
    """Off: every epoch sees the same centre crop. On: the crop and flip change with the epoch but are a
    function of (seed, epoch, index), so resuming or another worker reproduces them."""
    from mtl.data.images import Augment

    _bands(None, [RED, GREEN, BLUE, (255, 255, 0)], band=(10, 40)).save(tmp_path / "img.png")
    lines = [{"image": "img.png", "label": 0, "caption": "x"}, {"image": "img.png", "label": 1, "caption": "y"}]
    path = _write_lines(tmp_path / "m.jsonl", lines)
    plain = ManifestDataset(path, image_size=16)
    assert all(torch.equal(plain[(0, e)]["image"], plain[(0, 0)]["image"]) for e in range(5))
    on = ManifestDataset(path, image_size=16, augment=Augment(random_resized_crop=True, hflip=True, seed=3))
    crops = [on[(0, e)]["image"] for e in range(8)]
    assert all(c.shape == (3, 16, 16) for c in crops)
    assert len({c.numpy().tobytes() for c in crops}) > 4  # they differ from epoch to epoch
    again = ManifestDataset(path, image_size=16, augment=Augment(random_resized_crop=True, hflip=True, seed=3))
    assert all(torch.equal(again[(0, e)]["image"], crops[e]) for e in range(8))
    flips = ManifestDataset(path, image_size=16, augment=Augment(hflip=True))
    # the whole square picture: red|green|blue|yellow, or mirrored, yellow|blue|green|red
    left = [flips[(0, e)]["image"][:, :, :2] for e in range(12)]
    assert all(_is(x, RED) or _is(x, (255, 255, 0)) for x in left)
    assert {_is(x, RED) for x in left} == {True, False}  # both occur


def test_augmentation_is_set_in_yaml_and_refused_for_synthetic_data(images):
    from mtl.setup.checks import load_run_config

    from .conftest import TINY

    errs = []
    try:
        load_run_config(TINY, ["data.augment.hflip=true"])
    except ConfigError as e:
        errs = e.errors
    assert any(e.startswith("data.augment") and "synthetic" in e for e in errs), errs
    path = _write_lines(images / "train.jsonl", GOOD)
    cfg = load_run_config(TINY, ["data.source=manifest", f"data.train_path={path}", f"data.val_path={path}",
                                 "data.augment.random_resized_crop=true", "data.augment.scale=[0.5, 1.0]"])
    train, val = build_datasets(cfg)
    assert train.augment.random_resized_crop and train.augment.scale == (0.5, 1.0)
    assert getattr(val, "augment", None) is None  # never on the validation split


def test_pretrained_weights_bring_their_normalisation(tok):
    import torchvision

    from mtl.data.images import image_normalization

    cfg = _cfg(image_size=32, **{"synthetic.train_size": 16, "synthetic.val_size": 4})
    assert image_normalization(cfg) is None  # from scratch: the [0, 1] images as they are
    train, _ = build_datasets(cfg)
    raw = torch.stack([train[i]["image"] for i in range(4)])
    assert torch.equal(next(iter(build_eval_loader(train, make_collate(tok, 8), 4, 0, 1)))["image"], raw)

    cfg.model.backbone.name, cfg.model.backbone.weights = "efficientnet_b0", "IMAGENET1K_V1"
    t = torchvision.models.get_model_weights("efficientnet_b0")["IMAGENET1K_V1"].transforms()
    mean, std = image_normalization(cfg)
    assert mean == pytest.approx(t.mean) and std == pytest.approx(t.std)
    train, val = build_datasets(cfg)
    expect = (raw - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(next(iter(build_eval_loader(train, make_collate(tok, 8), 4, 0, 1)))["image"], expect)
    batch = next(iter(build_train_loader(train, make_collate(tok, 8), 4, 0, 1, seed=0)))
    items = torch.stack([train[i]["image"] for i in batch["index"].tolist()])
    assert torch.allclose(batch["image"], (items - expect.new_tensor(mean).view(1, 3, 1, 1))
                          / expect.new_tensor(std).view(1, 3, 1, 1))
    assert train[0]["image"].min() >= 0  # items stay pictures (the sample figures show them)
    cfg.data.normalize = "none"
    assert image_normalization(cfg) is None
