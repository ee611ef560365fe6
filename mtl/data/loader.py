"""Data sets from the config, the batch collate (each task makes its own fields) and the DDP-aware data loaders."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mtl.data.hf_source import hf_datasets, hf_test
from mtl.data.images import Augment, Normalized, prepare_images
from mtl.data.manifest import CaptionedImages, ImageFolderCaptions, ManifestDataset
from mtl.data.packing import PackedCollate, unpacked
from mtl.data.parquet_stream import hf_stream_splits
from mtl.data.qm9_source import batch_graphs, qm9_splits
from mtl.data.streamed import StreamPosition, stream_loader_kwargs, streamed, webdataset_splits
from mtl.data.synthetic import MIN_CLASSES, SyntheticShapes
from mtl.errors import ConfigError, DataError

SOURCES = ("synthetic", "manifest", "imagefolder", "qm9", "hf", "webdataset", "hf_stream")


def build_datasets(cfg) -> tuple[Dataset, Dataset]:
    """(train, val) data sets from the full config (``cfg.data``, ``cfg.seed``, ``cfg.model.backbone.weights``).

    Each gets ``normalization`` (the (mean, std) that the loaders normalise its batches with, or None) and, a set
    of image files, ``image_transform`` (the model's own image transform, or None): ``mtl.data.images.prepare_images``.
    """
    if cfg.data.source == "qm9":  # molecule graphs (mtl/data/qm9_source.py): no image normalisation

        splits = qm9_splits(cfg)
        return splits["train"], splits["val"]
    train, val = _datasets(cfg)
    prepare_images(cfg, train, val)
    return train, val


def build_test_dataset(cfg, train: Dataset) -> Dataset | None:
    """The held-out test split (``data.synthetic.test_size`` > 0, or ``data.test_path``), or None: evaluated beside
    the validation split and logged as ``test_<metric>``; nothing in training reads it, and the benchmark selects
    on validation only. Labels are checked against ``train``'s classes, as the validation split's are."""
    d = cfg.data
    if d.source == "qm9":  # the papers' test split (data.qm9.test_size)

        return qm9_splits(cfg)["test"] if d.qm9.test_size else None
    if d.source in ("webdataset", "hf_stream"):  # no test split for streamed sources (yet)
        return None
    if d.source == "synthetic":
        if not d.synthetic.test_size:
            return None
        test = _synthetic_split(cfg, d.synthetic.test_size, d.synthetic.test_seed_offset)
    elif d.source == "hf":  # data.hf.test_split (mtl/data/hf_source.py)
        test = hf_test(cfg, train)
        if test is None:
            return None
    elif not d.test_path:
        return None
    elif d.source == "manifest":
        test = ManifestDataset(d.test_path, d.image_root, d.image_size, train.num_classes, d.on_error,
                               class_names=train.class_names)
    else:
        test = ImageFolderCaptions(d.test_path, image_size=d.image_size, on_error=d.on_error,
                                   class_names=train.class_names)
    prepare_images(cfg, test)
    return test


def _synthetic_split(cfg, size: int, offset: int) -> SyntheticShapes:
    d, s = cfg.data, cfg.data.synthetic
    return SyntheticShapes(size=size, image_size=d.image_size, num_classes=s.num_classes, max_count=s.max_count,
                           noise=s.noise, clutter=s.clutter, seed=cfg.seed + offset)


def _datasets(cfg) -> tuple[Dataset, Dataset]:
    d = cfg.data
    if d.source == "webdataset":  # streamed tar shards (mtl/data/streamed.py)
        return webdataset_splits(cfg, Augment.from_config(cfg))
    if d.source == "hf_stream":  # Parquet streamed through datasets (mtl/data/parquet_stream.py)
        return hf_stream_splits(cfg, Augment.from_config(cfg))
    if d.source == "synthetic":
        s = d.synthetic
        return _synthetic_split(cfg, s.train_size, s.train_seed_offset), _synthetic_split(cfg, s.val_size,
                                                                                          s.val_seed_offset)
    if d.source not in SOURCES:
        raise ConfigError(f"data.source={d.source!r}: must be one of {', '.join(SOURCES)}")
    if d.source == "hf":  # a Hugging Face datasets data set (mtl/data/hf_source.py)
        return hf_datasets(cfg)
    for key in ("train_path", "val_path"):
        if not getattr(d, key, None):
            raise ConfigError(
                f"data.{key} is required for data.source={d.source} (set it to the {key[:-5]} split's path)"
            )
    if d.source == "manifest":
        with _naming("data.train_path"):
            train = ManifestDataset(d.train_path, d.image_root, d.image_size, d.num_classes, d.on_error,
                                    Augment.from_config(cfg))
        # val labels are checked against the train split's classes
        with _naming("data.val_path"):
            val = ManifestDataset(d.val_path, d.image_root, d.image_size, train.num_classes, d.on_error,
                                  class_names=train.class_names)
        return train, val
    with _naming("data.train_path"):
        train = ImageFolderCaptions(d.train_path, image_size=d.image_size, on_error=d.on_error,
                                    augment=Augment.from_config(cfg))
    if d.num_classes is not None and d.num_classes != train.num_classes:
        raise ConfigError(
            f"data.num_classes={d.num_classes} but {d.train_path!r} has {train.num_classes} class folders "
            "— remove data.num_classes or fix the folders"
        )
    with _naming("data.val_path"):
        val = ImageFolderCaptions(d.val_path, image_size=d.image_size, on_error=d.on_error,
                                  class_names=train.class_names)
    return train, val


@contextmanager
def _naming(key: str):
    """A data set's error names the config key whose path it read (``data.train_path: image folder ... not found``)."""
    try:
        yield
    except DataError as e:
        raise DataError(f"{key}: {e.message}") from None


def all_captions(ds: Dataset) -> list[str]:
    """Every caption of ``ds`` (for training a tokenizer), without decoding images where possible."""
    if isinstance(ds, SyntheticShapes):
        return [ds.caption(i) for i in range(len(ds))]
    if isinstance(ds, CaptionedImages) or hasattr(ds, "all_captions") or streamed(ds):  # read without decoding an image
        return ds.all_captions()
    if "captions" not in provided_fields(ds):  # QM9's molecules: none (the run's tokenizer then has no words)
        return []
    return [c for i in range(len(ds)) for c in ds[i]["captions"]]


def stack_images(records: list[dict]) -> dict:
    """The input field of a batch of image records: ``image`` (B, 3, S, S)."""
    return {"image": torch.stack([r["image"] for r in records])}


def input_collate(source: str):
    """How a batch's input field (what the backbone consumes) is made from the records of ``data.source``: images
    stacked under ``image``, or for ``qm9`` the molecule graphs as one PyG ``Batch`` under ``graph``."""
    if source == "qm9":

        return batch_graphs
    return stack_images


class BatchCollate:
    """Raw records -> a batch. Every batch has its input field (``inputs(records)``: ``image`` (B, 3, S, S) by
    default, a graph batch for QM9, ``input_collate``) and ``index`` (B,); the rest is what each task makes of the
    records (``TaskHead.item_fields`` per record, then ``TaskHead.collate_fields``): the data sets and this collate
    name no task. ``tasks`` maps task names to their classes, ``info`` is the ``mtl.tasks.DataInfo`` they read (the
    tokenizer, the config, the class names)."""

    def __init__(self, tasks: dict[str, type], info, inputs=stack_images):
        self.tasks, self.info, self.inputs = dict(tasks), info, inputs

    def __call__(self, records: list[dict]) -> dict:
        batch = {**self.inputs(records),
                 "index": torch.tensor([int(r["index"]) for r in records], dtype=torch.long)}
        owner = dict.fromkeys(batch, "the loader")
        for name, task in self.tasks.items():
            fields = task.collate_fields([task.item_fields(r, self.info) for r in records], self.info) if records else {}
            for key, value in fields.items():
                if key in owner:
                    raise ConfigError(f"tasks: {name!r} and {owner[key]!r} both make the batch field {key!r}; rename "
                                      f"it in one of them (prefix it with the task name, e.g. '{name}_{key}')")
                owner[key] = name
                batch[key] = value
        return batch


def provided_fields(ds: Dataset) -> frozenset:
    """The raw record fields every item of ``ds`` has (``ds.provides``; else read from its first item)."""
    provides = getattr(ds, "provides", None)
    if provides is None:
        provides = frozenset(ds[0]) if len(ds) else frozenset()
    return frozenset(provides)


def classes_present(ds: Dataset) -> list[int] | None:
    """The class indices ``ds``'s items have (``labels_present``, up to ``MIN_CLASSES`` found where that is all a
    check needs), else its declared ``range(num_classes)``; None when it has neither."""
    present = getattr(ds, "labels_present", None)
    if present is not None:
        return sorted(present(MIN_CLASSES))
    k = getattr(ds, "num_classes", None)
    return None if k is None else list(range(int(k)))


def too_few_classes(train: Dataset, task: str) -> str | None:
    """Why ``task`` (it reads labels) cannot learn from the training set ``train``: items of fewer than
    ``MIN_CLASSES`` classes, named, with the classes it declares but has no item of; or None."""
    found = classes_present(train)
    if found is None or len(found) >= MIN_CLASSES:
        return None
    names = list(getattr(train, "class_names", []) or [])
    name = lambda i: names[i] if i < len(names) else str(i)  # noqa: E731
    k = len(found)
    source = getattr(train, "source", None) or type(train).__name__
    text = (f"task {task!r} learns to tell classes apart, and the training set ({source}) has items of {k} "
            f"class{'' if k == 1 else 'es'}" + (f" ({', '.join(map(name, found))})" if k else ""))
    empty = [name(i) for i in range(int(getattr(train, "num_classes", 0) or 0)) if i not in found]
    if empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        one = len(empty) == 1
        text += f"; {'class' if one else 'classes'} {shown} {'has' if one else 'have'} no training item"
    return (f"{text}; it needs items of at least {MIN_CLASSES} classes — add images of another class, or remove "
            f"{task!r} from tasks")


def verify_task_fields(tasks: dict[str, type], datasets: dict[str, Dataset]) -> None:
    """Every task's ``requires`` must be in every split's records: one error naming each task, field and fix. A
    task that reads labels needs items of at least two classes in its training split (one would score 1.0 by
    construction), whatever the source and however many classes it declares (an empty class folder,
    ``data.num_classes``): the synthetic set's own range, ``MIN_CLASSES``. Single-set and multi-input runs
    (``data.per_task``, each task's own training set) both pass through here."""
    errors = []
    for name, task in tasks.items():
        train = datasets.get("training")
        if "label" in task.requires and train is not None:
            problem = too_few_classes(train, name)
            if problem:
                errors.append(problem)
        for split, ds in datasets.items():
            have = provided_fields(ds)
            for field in task.requires:
                if field not in have:
                    fix = getattr(ds, "how_to_provide", lambda f: f"use a data source whose items have {f!r}")(field)
                    errors.append(f"task {name!r} needs the field {field!r} in every {split} item, which "
                                  f"{getattr(ds, 'source', type(ds).__name__)} does not provide (its items have: "
                                  f"{', '.join(sorted(have))}) — {fix}, or remove {name!r} from tasks")
    if errors:
        raise DataError(errors[0] if len(errors) == 1 else "; ".join(errors))


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch (exact resume).

    ``set_start(n)`` skips this rank's first ``n`` indices of the current epoch's order without
    loading them; the order itself still depends on seed and epoch only.
    """

    start = 0

    def set_start(self, n: int) -> None:
        self.start = max(0, int(n))

    def __iter__(self) -> Iterator:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


class EpochDistributedSampler(ResumableDistributedSampler):
    """A resumable sampler that yields ``(index, epoch)``: the data set picks the epoch's caption.

    Why not just ``dataset.set_epoch``: with persistent workers each worker keeps the copy of the
    data set it was started with, so a later ``set_epoch`` in the main process never reaches it.
    The sampler runs in the main process, so the epoch it sends along is always the current one.
    ``set_epoch`` on this sampler is all a training loop has to call.
    """

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((i, epoch) for i in super().__iter__())


def data_position(epoch: int, batches: int, batch_size: int, world_size: int) -> dict:
    """Where the training stream stands, the same for any number of processes: the epoch, and how many samples
    of the epoch's order the whole job has consumed. The order depends on the seed and the epoch only, and a
    global batch is a contiguous slice of it (each rank's DistributedSampler takes positions r, r + W, ...), so
    a run with the same global batch on another world size continues with the same samples."""
    return {"epoch": int(epoch), "samples": int(batches) * int(batch_size) * int(world_size)}


def resume_position(position: dict, batch_size: int, world_size: int) -> tuple[int, int, int]:
    """(epoch, batches into it at this batch size and world size, samples of the last global batch that will be
    seen again): the last is 0 unless the global batch changed and the position falls inside a batch."""
    batches, rest = divmod(int(position["samples"]), int(batch_size) * int(world_size))
    return int(position["epoch"]), batches, rest


def verify_train_size(size: int, batch_size: int, world_size: int) -> None:
    """The training set must fill at least one GLOBAL batch (``data.batch_size`` x the number of processes).

    Every rank sees the same data-set size, so every rank takes the same decision. With fewer items each
    rank's epoch would hold no full batch at all (``drop_last``), and a training loop would wait forever.
    """
    if size < batch_size * world_size:
        raise DataError(
            f"the training set has {size} item(s), fewer than one global batch: data.batch_size={batch_size} "
            f"x {world_size} process(es) = {batch_size * world_size}. Lower data.batch_size, run fewer "
            "processes, or add training data")


class Loader(DataLoader):
    """A DataLoader whose workers send each batch packed as one buffer (mtl/data/packing.py; ``_loader_kwargs``
    packs it): its iterator gives the batch as the collate made it."""

    def __iter__(self):
        batches = super().__iter__()
        return (unpacked(b) for b in batches) if self.num_workers > 0 else batches


class TrainLoader(Loader):
    """A DataLoader that refuses to start an epoch without a single batch, rather than let a
    ``while True: for batch in loader`` loop spin forever (silently, deaf to signals)."""

    def __iter__(self):
        if len(self) == 0 and getattr(self.sampler, "start", 0) == 0:
            raise DataError(
                f"the training loader has no full batch in an epoch ({len(self.dataset)} item(s), "
                f"data.batch_size={self.batch_size}, sampler of {len(self.sampler)} per process); lower "
                "data.batch_size or add training data")
        return super().__iter__()


class StreamLoader(StreamPosition, Loader):
    """A loader over a streamed data set (``data.source: webdataset``, mtl/data/streamed.py): no sampler; each
    worker batches its own part of the shards."""


def normalizing(collate, ds: Dataset):
    norm = getattr(ds, "normalization", None)
    return Normalized(collate, *norm) if norm else collate


def _loader_kwargs(ds: Dataset, collate, batch_size: int, num_workers: int, pin_memory: bool, pack: bool = True) -> dict:
    """What the train and the eval loaders share: the batch size, the collate (normalizing where ``ds`` says so;
    packing its batch into one buffer in the workers, so the training process receives one storage a batch) and
    the workers."""
    collate = normalizing(collate, ds)
    return {"batch_size": batch_size, "collate_fn": PackedCollate(collate) if num_workers > 0 and pack else collate,
            "num_workers": num_workers,
            "pin_memory": pin_memory, "persistent_workers": num_workers > 0}


def build_train_loader(ds: Dataset, collate: BatchCollate, batch_size: int, rank: int, world_size: int, seed: int,
                       num_workers: int = 0, pin_memory: bool = False, heldout: int = 0, pack: bool = True) -> DataLoader:
    """Shuffled, equal-size batches on every rank (``drop_last`` in the sampler and the loader), from the first
    ``len(ds) - heldout`` items (``data.heldout``: the last ones are the held-out part, mtl/data/heldout.py).

    The sampler permutes all indices with a generator seeded by ``seed + epoch`` only, and rank r
    takes permuted positions r, r+W, r+2W, ... So with W ranks of per-process batch B, rank r's
    k-th batch is the positions k*W*B + r + W*j (j < B) of that permutation: the W rank batches k
    together are exactly the permuted positions [k*W*B, (k+1)*W*B), which is the k-th batch of a
    1-process run with batch W*B. Changing the number of GPUs (at a fixed global batch) therefore
    changes nothing about which samples are seen together, which makes runs with different world
    sizes comparable. (A resume still needs the world size of the checkpoint: the per-rank RNG
    states do not map onto another number of ranks, and the resume refuses it.) Call ``loader.sampler.set_epoch(epoch)`` before each epoch.
    ``pack=False`` (for ``mtl.tools.bench.qm9_loader``'s comparison only): the workers send each tensor on its own.
    """
    verify_train_size(len(ds) - heldout, batch_size, world_size)
    if streamed(ds):  # a stream splits its shards by rank and worker (mtl/data/streamed.py)
        return StreamLoader(ds, **stream_loader_kwargs(ds, rank, world_size, _loader_kwargs(
            ds, collate, batch_size, num_workers, pin_memory, pack)))
    # data sets with set_epoch (ours) take (index, epoch) keys; any other gets plain indices
    cls = EpochDistributedSampler if hasattr(ds, "set_epoch") else ResumableDistributedSampler
    # the sampler reads only the length of what it is given: the first len(ds) - heldout indices
    items = range(len(ds) - heldout) if heldout else ds
    sampler = cls(items, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    # the loader's own generator: making an iterator (at each epoch, and at a resume) must not draw
    # from the global torch RNG, or a resumed run's dropout would see a shifted random stream
    return TrainLoader(ds, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(seed),
                       **_loader_kwargs(ds, collate, batch_size, num_workers, pin_memory, pack))


def build_eval_loader(ds: Dataset, collate: BatchCollate, batch_size: int, rank: int, world_size: int,
                      num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """Rank r evaluates indices r, r+W, ... in order, with no padding: every sample counts once.

    (DistributedSampler pads with repeated samples to even out the ranks, which would count some
    twice in the metrics.) Ranks may therefore get one batch more or less than each other, so eval
    code must reduce sums and counts, not per-rank means, and must not run a collective per batch.
    """
    if streamed(ds):  # each rank and worker streams its own shards, in order
        return StreamLoader(ds, **stream_loader_kwargs(ds, rank, world_size, _loader_kwargs(
            ds, collate, batch_size, num_workers, pin_memory)))
    return Loader(ds, sampler=list(range(rank, len(ds), world_size)), shuffle=False, drop_last=False,
                      **_loader_kwargs(ds, collate, batch_size, num_workers, pin_memory))


def start_at(loader: DataLoader, epoch: int, batches: int) -> None:
    """Put a train loader at ``batches`` batches into ``epoch`` (its sampler, or a stream's own position)."""
    set_epoch(loader, epoch)
    target = loader.dataset if streamed(loader.dataset) else loader.sampler
    target.set_start(batches if streamed(loader.dataset) else batches * loader.batch_size)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Set the epoch on a train loader's sampler and its data set (for direct indexing too)."""
    sampler: DistributedSampler | None = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


# ---------------------------------------------------------------------------------------------
# a batch on its way to the step


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with every value that can move (``.to``: a tensor, a PyG ``Batch`` of graphs) on ``device``; nested
    dicts (a multi-input sub-batch) likewise; anything else (captions, references) as it is."""
    non_blocking = device.type == "cuda"
    return {k: to_device(v, device) if isinstance(v, dict) else
            v.to(device, non_blocking=non_blocking) if callable(getattr(v, "to", None)) else v
            for k, v in batch.items()}


@contextmanager
def rng_untouched():
    """Run a block (evaluation, diagnostics) without moving any random stream that training draws from.

    Python's, NumPy's, torch's and the current CUDA device's generator are put back as they were, so
    how often a run evaluates or diagnoses changes nothing about its dropout or data order.
    """
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
