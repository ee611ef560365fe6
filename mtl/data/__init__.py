"""Data: the built-in synthetic shapes, user manifests/ImageFolders, the tokenizer and the loaders.

Item format (every data set): ``{"image": float (3, S, S) in [0, 1], "label": int,
"captions": list[str] (the one to train on first), "count": int (-1 if unknown), "index": int}``.
Items stay pictures in [0, 1]; the loaders normalise whole batches with the data set's
``normalization`` (the pretrained weights' mean/std, see ``mtl.data.images``), when it has one.
"""

from mtl.data.loader import (
    CaptionCollate,
    EpochDistributedSampler,
    all_captions,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    set_epoch,
)
from mtl.data.manifest import ImageFolderCaptions, ManifestDataset
from mtl.data.synthetic import SyntheticShapes
from mtl.data.tokenizer import CaptionTokenizer, train_tokenizer

__all__ = [
    "CaptionCollate",
    "CaptionTokenizer",
    "EpochDistributedSampler",
    "ImageFolderCaptions",
    "ManifestDataset",
    "SyntheticShapes",
    "all_captions",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
    "set_epoch",
    "train_tokenizer",
]
