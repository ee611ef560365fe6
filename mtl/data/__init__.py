"""Data: the built-in synthetic shapes, user manifests/ImageFolders, the tokenizer and the loaders.

Items are raw records: ``{"image": float (3, S, S) in [0, 1], "index": int, ...}`` plus whatever annotations
the source has: ``label`` and ``captions`` (the one to train on first) for every source, the synthetic scene's
``shape``, ``count``, ``size``, ``colour``, ``position``, ``centres`` ..., a manifest line's extra keys. A data
set's ``provides`` names them. ``BatchCollate`` asks each configured task for its batch fields
(``TaskHead.item_fields`` / ``collate_fields``); nothing here names a task.
Items stay pictures in [0, 1]; the loaders normalise whole batches with the data set's
``normalization`` (the pretrained weights' mean/std, see ``mtl.data.images``), when it has one.
"""

from mtl.data.loader import (
    BatchCollate,
    EpochDistributedSampler,
    all_captions,
    build_datasets,
    build_eval_loader,
    build_train_loader,
    data_position,
    resume_position,
    set_epoch,
    verify_task_fields,
)
from mtl.data.manifest import ImageFolderCaptions, ManifestDataset
from mtl.data.synthetic import SyntheticShapes
from mtl.data.tokenizer import CaptionTokenizer, train_tokenizer

__all__ = [
    "BatchCollate",
    "CaptionTokenizer",
    "EpochDistributedSampler",
    "ImageFolderCaptions",
    "ManifestDataset",
    "SyntheticShapes",
    "all_captions",
    "build_datasets",
    "build_eval_loader",
    "build_train_loader",
    "verify_task_fields",
    "data_position",
    "resume_position",
    "set_epoch",
    "train_tokenizer",
]
