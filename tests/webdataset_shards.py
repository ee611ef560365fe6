"""Small WebDataset shards for the tests (``webdataset.TarWriter``, nothing downloaded): sample ``i`` of the whole
set is a 24 x 24 JPEG whose colour encodes ``i``, with its class index (``cls``) and captions (``txt``, or every
third sample a ``json`` list of two captions), and ``class_names.json`` beside the shards."""

from __future__ import annotations

import io
import json
import os

import numpy as np
from PIL import Image

CLASSES = ["circle", "square", "triangle", "star"]


def jpeg(i: int, size: int = 24) -> bytes:
    rng = np.random.default_rng(i)
    arr = (rng.random((size, size, 3)) * 255).astype(np.uint8)
    arr[..., 0] = i % 256
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def sample(i: int) -> dict:
    label = i % len(CLASSES)
    out = {"__key__": f"s{i:06d}", "jpg": jpeg(i), "cls": str(label).encode()}
    words = f"a {CLASSES[label]} number {i % 7}"
    if i % 3 == 0:
        out["json"] = json.dumps([words, f"one {CLASSES[label]}"]).encode()
    else:
        out["txt"] = words.encode()
    return out


def write_shards(folder: str, sizes: list[int], prefix: str = "train", start: int = 0, names: bool = True,
                 bad: dict | None = None) -> str:
    """Shards ``prefix-000000.tar`` ... holding ``sizes[k]`` samples each (numbered from ``start``); ``bad``:
    {sample number: bytes} written as that sample's jpg instead. Returns the brace pattern naming them."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    i = start
    for k, n in enumerate(sizes):
        with wds.TarWriter(os.path.join(folder, f"{prefix}-{k:06d}.tar")) as sink:
            for _ in range(n):
                s = sample(i)
                if bad and i in bad:
                    s["jpg"] = bad[i]
                sink.write(s)
                i += 1
    if names:
        with open(os.path.join(folder, "class_names.json"), "w") as f:
            json.dump(CLASSES, f)
    return os.path.join(folder, f"{prefix}-{{000000..{len(sizes) - 1:06d}}}.tar")


def overrides(folder: str, train: list[int], val: list[int]) -> list[str]:
    """Config overrides of a run on fresh shards in ``folder``."""
    return ["data.source=webdataset", f"data.webdataset.train_shards={write_shards(folder, train)}",
            f"data.webdataset.val_shards={write_shards(folder, val, 'val', start=10_000)}"]


def write_parquet(folder: str, sizes: list[int], prefix: str = "train", start: int = 0) -> str:
    """The same samples as Parquet files ``prefix-00.parquet`` ... written by ``datasets`` (an Image column, a
    ClassLabel ``label``, ``caption`` a list of captions); returns the glob naming them."""
    import datasets

    os.makedirs(folder, exist_ok=True)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES),
                                  "caption": datasets.Sequence(datasets.Value("string"))})
    i = start
    for k, n in enumerate(sizes):
        rows = {"image": [], "label": [], "caption": []}
        for _ in range(n):
            s = sample(i)
            rows["image"].append({"bytes": s["jpg"], "path": None})
            rows["label"].append(int(s["cls"]))
            rows["caption"].append(json.loads(s["json"]) if "json" in s else [s["txt"].decode()])
            i += 1
        datasets.Dataset.from_dict(rows, features=features).to_parquet(os.path.join(folder, f"{prefix}-{k:02d}.parquet"))
    return os.path.join(folder, f"{prefix}-*.parquet")
