"""Small Hugging Face data sets built on the spot for the tests (nothing downloads): a DatasetDict saved with
``save_to_disk``, its splits as Parquet files, an image folder; each image a seeded 12 x 12 PNG."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CLASSES = ["cat", "dog", "eel"]


def png(seed: int, size: int = 12) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def captions_of(i: int) -> list[str]:
    name = CLASSES[i % 3]
    return [f"a {name} number {i % 5}", f"the {name}", f"one {name} alone"][: 1 + i % 3]


def split(n: int, offset: int = 0, label: str = "classlabel", caption: str = "list", bad: tuple = ()):
    """A Dataset of ``n`` rows: ``image`` (an Image feature), ``label`` (ClassLabel, int or str) and ``caption``
    (a list of 1-3 captions, or one string); the rows in ``bad`` hold bytes that are no image."""
    import datasets

    label_feature = {"classlabel": datasets.ClassLabel(names=CLASSES), "int": datasets.Value("int64"),
                     "str": datasets.Value("string")}[label]
    caption_feature = datasets.List(datasets.Value("string")) if caption == "list" else datasets.Value("string")
    features = datasets.Features({"image": datasets.Image(), "label": label_feature, "caption": caption_feature})
    labels = [i % 3 for i in range(n)]
    return datasets.Dataset.from_dict({
        "image": [{"bytes": b"not an image" if i in bad else png(offset + i), "path": None} for i in range(n)],
        "label": [CLASSES[x] for x in labels] if label == "str" else labels,
        "caption": [captions_of(i) if caption == "list" else captions_of(i)[0] for i in range(n)],
    }, features=features)


def save_dict(path, train: int = 48, val: int = 12, **kw) -> str:
    """A DatasetDict (train, validation) saved to ``path``; ``kw`` go to both splits' ``split`` (``bad`` rows to the
    training split's only)."""
    import datasets

    both = {k: v for k, v in kw.items() if k != "bad"}
    datasets.DatasetDict(train=split(train, 0, **kw), validation=split(val, 10_000, **both)).save_to_disk(str(path))
    return str(path)
