"""``data.source: webdataset``: tar shards (open_clip's and timm's layout) streamed by every rank and loader worker.

A sample is the tar members that share a key: the image under ``jpg``/``jpeg``/``png``/``webp``, the class index
under ``cls``, the caption under ``txt`` or a list of captions under ``json``. A ``webdataset`` pipeline reads them
(``DataPipeline``: ``SimpleShardList``, its ``split_by_node`` and ``split_by_worker``, ``tarfile_to_samples``, its
seeded ``shuffle`` buffer); this module plans which shards each rank and worker streams and how long an epoch is.
``split_by_node`` reads the rank and world size from torchrun's environment (RANK, WORLD_SIZE), ``split_by_worker``
the loader worker's id; a stream checks both agree with the run's.

At start every shard is scanned once (tar headers, the small text members and, with
``data.webdataset.verify_images``, every image decoded, as the manifest source does): a truncated shard, a pattern
that matches nothing or a bad sample is refused before anything is written (a bad image follows ``data.on_error``:
skipped samples are counted and never streamed).

Epochs (training). Epoch e shuffles the shard list with ``seed + e``; rank r of W takes every W-th shard from r
(the node split), worker w of N of those every N-th from w (the worker split), and mixes its samples in a
shuffle buffer seeded by (seed, e, r, w). Every (rank, worker) stream is cut to the same number of batches: the
least any of them can fill (``epoch_batches``). So every rank runs the same number of steps (DDP cannot hang), and
when the shards divide evenly (equal sizes, a multiple of W x N shards, a shard a multiple of data.batch_size) every
sample is seen exactly once per epoch across all ranks and workers. When they do not, the longer streams' surplus
is left out of that epoch (a different part each epoch, as the shard order changes) and the run says how many.

Resume. The position is (epoch, batches of the epoch); a worker's stream is a pure function of them, so a resumed
stream skips each worker's consumed samples (after the shuffle buffer, before decoding) and continues with the same
batches. It needs the same number of processes and ``data.num_workers``: another split is refused by name.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import tarfile
from dataclasses import dataclass, field

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from mtl.data.images import PIL_ERRORS, Augment, load_image, shape_problem
from mtl.errors import ConfigError, DataError

EXTRA = "install the data extra (pip install -e '.[data]', or make install)"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TEXT_EXTS = ("cls", "txt", "json")
CLASS_NAMES_FILE = "class_names.json"


def need_webdataset():
    """The ``webdataset`` module, or one ConfigError naming the extra that brings it."""
    if importlib.util.find_spec("webdataset") is None:
        raise ConfigError(f"data.source=webdataset needs the webdataset library, which is not installed; {EXTRA}")
    import webdataset

    return webdataset


def shard_paths(spec, key: str) -> list[str]:
    """The shard files ``spec`` names: a brace pattern (``train-{000000..000127}.tar``, expanded by webdataset),
    several joined by ``::``, or a list file (``.txt``: one path a line, relative to the file's folder)."""
    wds = need_webdataset()
    if not spec:
        raise ConfigError(f"{key} is required for data.source=webdataset (a brace pattern such as "
                          "'shards/train-{000000..000015}.tar', or a .txt file listing the shards)")
    paths: list[str] = []
    for s in str(spec).split("::"):
        if s.endswith(".txt") and os.path.isfile(s):
            with open(s) as f:
                lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            paths += [os.path.join(os.path.dirname(os.path.abspath(s)), ln) for ln in lines]
        else:
            paths += list(wds.shardlists.expand_urls(s))
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or len(missing) == len(paths):
        raise ConfigError(f"{key}: {spec!r} matches no shard file" + (f" ({missing[0]!r} does not exist)" if missing
                          else "") + " — fix the pattern or its folder (brace ranges such as {000000..000015})")
    if missing:
        raise ConfigError(f"{key}: {len(missing)} of the {len(paths)} shards {spec!r} names do not exist (the first: "
                          f"{missing[0]!r}) — fix the pattern's range or write the missing shards")
    return paths


@dataclass
class Shard:
    """One scanned shard: its samples' keys in tar order, their labels and captions, and the bad ones left out."""

    path: str
    keys: list[str] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)
    captions: list[list[str]] = field(default_factory=list)
    offset: int = 0  # the global index of its first sample

    def __len__(self) -> int:
        return len(self.keys)


def _captions(members: dict, where: str) -> list[str] | None:
    if "txt" in members:
        return [members["txt"].decode("utf-8").strip()]
    if "json" not in members:
        return None
    obj = json.loads(members["json"].decode("utf-8"))
    if isinstance(obj, dict):  # open_clip's metadata: {"caption": ...} or {"captions": [...]}
        obj = obj.get("captions", obj.get("caption"))
    obj = [obj] if isinstance(obj, str) else obj
    if not isinstance(obj, list) or not obj or not all(isinstance(c, str) and c.strip() for c in obj):
        raise ValueError(f"{where}: its json is not a caption or a non-empty list of captions")
    return [c.strip() for c in obj]


def _verify_sample(key: str, members: dict, where: str, verify: bool) -> tuple[int | None, list[str] | None]:
    """(label, captions) of one sample; ValueError saying what is wrong with it."""
    images = [e for e in IMAGE_EXTS if e in members]
    if not images:
        raise ValueError(f"{where}: no image (one of {', '.join(IMAGE_EXTS)}; it has {', '.join(sorted(members))})")
    label = None
    if "cls" in members:
        text = members["cls"].decode("utf-8").strip()
        if not re.fullmatch(r"\d+", text):
            raise ValueError(f"{where}: its cls {text!r} is not a class index (a non-negative integer)")
        label = int(text)
    if verify:
        try:
            with Image.open(io.BytesIO(members[images[0]])) as img:
                problem = shape_problem(*img.size)
                if problem is None:
                    img.load()  # decode every pixel: a truncated file only fails here
        except PIL_ERRORS as e:
            raise ValueError(f"{where}: its {images[0]} cannot be decoded ({e})") from None
        if problem is not None:
            raise ValueError(f"{where}: its {images[0]} {problem}")
    return label, _captions(members, where)


def scan_shard(path: str, key: str, on_error: str, verify: bool, reasons: list[str]) -> Shard:
    """Read one shard's samples (their text members, and their images when ``verify``); a bad sample raises
    ConfigError naming it (``on_error="raise"``) or is left out and its reason appended to ``reasons``."""
    split_name = need_webdataset().tariterators.base_plus_ext  # webdataset's (key, extension) of a member name
    shard, members, current = Shard(path), {}, None

    def close():
        if current is None:
            return
        where = f"shard {path} sample {current!r}"
        try:
            label, caps = _verify_sample(current, members, where, verify)
        except (ValueError, UnicodeDecodeError) as e:
            if on_error == "raise":
                raise ConfigError(f"{key}: {e} — fix or drop the sample, or set data.on_error=skip") from None
            reasons.append(str(e))
            return
        shard.keys.append(current)
        shard.labels.append(label)
        shard.captions.append(caps)

    try:
        with tarfile.open(path) as tar:
            for m in tar:
                k, ext = split_name(m.name) if m.isfile() else (None, None)
                if k is None:
                    continue
                ext = ext.lower()
                if k != current:
                    close()
                    current, members = k, {}
                if ext in TEXT_EXTS or (verify and ext in IMAGE_EXTS):
                    members[ext] = tar.extractfile(m).read()
                else:
                    members[ext] = b""
            close()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ConfigError(f"{key}: shard {path!r} is truncated or not a tar file ({e}) — write it again (python -m "
                          "mtl.tools.shard) or leave it out of the pattern") from None
    return shard


def read_class_names(path: str | None, shards: list[str], key: str) -> list[str] | None:
    """The class names: ``data.webdataset.class_names`` (a JSON list, or a text file with one name a line), else
    ``class_names.json`` beside the first training shard; None when neither exists."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(shards[0])), CLASS_NAMES_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read()
    try:
        names = json.loads(text) if path.endswith(".json") else [ln.strip() for ln in text.splitlines() if ln.strip()]
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {path!r} is not JSON ({e}) — write a list of class names") from None
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{key}: {path!r} is not a non-empty list of class names — write it as [\"cat\", ...]")
    return names


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The shard order of an epoch: the same on every rank and worker (seeded by ``seed + epoch``)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


class ShardStream(IterableDataset):
    """A split's shards as a stream of raw records (``image``, ``index``, and ``label``/``captions`` where every
    sample has them). ``place(rank, world, workers, batch)`` says where it runs (the loaders call it);
    ``set_epoch``/``set_start`` its position. ``train=False``: every sample once, in shard order, no cut."""

    def __init__(self, shards: list[Shard], key: str, image_size: int, on_error: str, train: bool, seed: int,
                 buffer: int = 1000, augment: Augment | None = None, class_names: list[str] | None = None,
                 reasons: list[str] | None = None):
        self.shards, self.key, self.image_size, self.train, self.seed = shards, key, image_size, train, seed
        self.buffer, self.augment, self.on_error = int(buffer), augment, on_error
        self.source = f"webdataset shards ({key})"
        self.skip_reasons = list(reasons or [])
        self.skipped = len(self.skip_reasons)
        self.normalization = None
        self.image_transform = None  # the model's own image transform (mtl.data.images.prepare_images); None: mtl's
        total = 0
        for s in shards:
            s.offset, total = total, total + len(s)
        self.size = total
        self.by_path = {s.path: s for s in shards}
        self.index = {s.path: {k: s.offset + i for i, k in enumerate(s.keys)} for s in shards}
        every = lambda get: all(x is not None for s in shards for x in get(s))  # noqa: E731
        self.provides = frozenset({"image", "index"} | ({"label"} if every(lambda s: s.labels) else set())
                                  | ({"captions"} if every(lambda s: s.captions) else set()))
        self.class_names = list(class_names or [])
        self.num_classes = len(self.class_names)
        self.rank, self.world, self.workers, self.batch = 0, 1, 0, 1
        # the position (epoch, batches into it) in shared memory: the loader's persistent workers read the one the
        # training process sets before each epoch (and a resume) when they start the epoch's stream
        self.position = torch.zeros(2, dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self.position[0])

    @property
    def start(self) -> int:
        return int(self.position[1])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        """One sample by its global index, read from its shard (a few for the samples figure; training streams)."""
        index = int(index)
        shard = next(s for s in self.shards if s.offset <= index < s.offset + len(s))
        key, split_name = shard.keys[index - shard.offset], need_webdataset().tariterators.base_plus_ext
        with tarfile.open(shard.path) as tar:
            sample = {"__url__": shard.path, "__key__": key}
            for m in tar:
                k, ext = split_name(m.name) if m.isfile() else (None, None)
                if k == key and ext.lower() in IMAGE_EXTS:
                    sample[ext.lower()] = tar.extractfile(m).read()
                    break
        return self.record(sample, self.epoch)

    def how_to_provide(self, field: str) -> str:
        member = {"label": "cls (the class index)", "captions": "txt (a caption) or json (a list of captions)"}
        return f"write every sample's {member.get(field, field)} into the shards"

    def labels_present(self, enough: int | None = None) -> set[int]:
        return {x for s in self.shards for x in s.labels if x is not None}

    def all_captions(self) -> list[str]:
        return [c for s in self.shards for caps in s.captions if caps for c in caps]

    def place(self, rank: int, world: int, workers: int, batch: int) -> None:
        """Run as ``rank`` of ``world`` with ``workers`` loader workers (0: in the process) and per-process batch
        ``batch``; a training stream refuses a split that leaves a worker without a batch in an epoch."""
        self.rank, self.world, self.workers, self.batch = int(rank), int(world), int(workers), int(batch)
        streams = self.world * max(1, self.workers)
        if self.train and len(self.shards) < streams:
            raise ConfigError(
                f"{self.key}: {len(self.shards)} shard(s) for {self.world} process(es) x {max(1, self.workers)} "
                f"loader worker(s) (data.num_workers={self.workers}): every worker streams whole shards, so it needs "
                f"at least {streams} — write the data as more shards, run fewer processes or lower data.num_workers")
        if self.train and self.epoch_batches(0) == 0:
            raise ConfigError(
                f"{self.key}: in epoch 0 some process's worker streams fewer than data.batch_size={self.batch} samples, "
                "so no rank could run a step — write larger or more equal shards, or lower data.batch_size")

    def set_epoch(self, epoch: int) -> None:
        self.position[0], self.position[1] = int(epoch), 0

    def set_start(self, batches: int) -> None:
        """Begin the epoch after its first ``batches`` batches on this rank (a resume)."""
        self.position[1] = int(batches)

    def streams(self, epoch: int) -> list[list[list[Shard]]]:
        """[rank][worker] -> the shards it streams in ``epoch``."""
        order = [self.shards[i] for i in epoch_order(len(self.shards), self.seed, epoch, self.train)]
        n = max(1, self.workers)
        return [[order[r::self.world][w::n] for w in range(n)] for r in range(self.world)]

    def epoch_batches(self, epoch: int) -> int:
        """Batches every (rank, worker) stream gives in ``epoch``: the least any of them can fill."""
        return min(sum(map(len, mine)) // self.batch for rank in self.streams(epoch) for mine in rank)

    def batches_per_epoch(self, epoch: int) -> int:
        """This rank's batches in ``epoch`` (the same on every rank)."""
        return self.epoch_batches(epoch) * max(1, self.workers)

    def left_out(self, epoch: int) -> int:
        """Samples no rank trains on in ``epoch`` (the cut of the longer streams)."""
        return self.size - self.batches_per_epoch(epoch) * self.batch * self.world

    def epoch_text(self) -> str:
        """The first epoch as the run's first line gives it: its batches, and the samples its cut leaves out."""
        left = self.left_out(0)
        return (f"streamed: {self.batches_per_epoch(0)} batches a process in epoch 0 ({self.world} process(es) x "
                f"{max(1, self.workers)} worker stream(s)" + (f"; {left} of {self.size} samples left out by the cut "
                "to equal streams" if left else "; every sample once") + ")")

    def __iter__(self):
        info = get_worker_info()
        physical, n = (info.id, info.num_workers) if info is not None else (0, 1)
        # a resumed epoch starts at batch `start`, which worker (start mod n) made: the loader asks its worker 0
        # first, so worker p plays the part of worker (p + start) mod n
        epoch, start = self.epoch, self.start  # read once, as the epoch's iterator starts
        return self._records((physical + start) % n, n, epoch, start)

    def read(self, order: list[str], worker: int, n: int):
        """The samples (webdataset's dicts: ``__url__``, ``__key__``, the image under its extension) of the shards
        that this rank's worker ``worker`` of ``n`` streams from the epoch's shard ``order``, in their order.

        webdataset's own ``split_by_node`` (the rank and world size torchrun sets) and ``split_by_worker`` (the
        loader worker's id) split the shard list. A resumed epoch's next batch may be another worker's than the
        loader's first, so the rank's shards reach ``split_by_worker`` arranged (``_arranged``) for the loader
        worker that plays ``worker``'s part to take ``worker``'s shards."""
        wds = need_webdataset()
        info = get_worker_info()
        physical = info.id if info is not None else 0
        library = tuple(wds.utils.pytorch_worker_info())
        if library != (self.rank, self.world, physical, n):
            raise RuntimeError(
                f"{self.key}: webdataset places this stream at rank {library[0]} of {library[1]}, worker {library[2]} "
                f"of {library[3]}, and the run at rank {self.rank} of {self.world}, worker {physical} of {n}: the "
                "environment's RANK/WORLD_SIZE (torchrun's) or WORKER/NUM_WORKERS differ from the run's")
        return wds.DataPipeline(wds.SimpleShardList(order), wds.split_by_node, _arranged(n, (worker - physical) % n),
                                wds.split_by_worker, _present, wds.tarfile_to_samples())

    def _records(self, worker: int, n: int, epoch: int, start: int):
        wds = need_webdataset()
        rank = self.rank
        order = [self.shards[i].path for i in epoch_order(len(self.shards), self.seed, epoch, self.train)]
        source = self.read(order, worker, n)
        stages = [lambda: source, _known(self.index)]
        if self.train:
            cut = self.epoch_batches(epoch) * self.batch
            done = (max(0, start - worker) + n - 1) // n * self.batch  # this worker's samples already trained on
            rng = random.Random(f"{self.seed}/{epoch}/{rank}/{worker}")
            stages += [wds.shuffle(self.buffer, initial=min(self.buffer, 100), rng=rng), _window(done, cut)]
        for sample in wds.DataPipeline(*stages):
            yield self.record(sample, epoch)

    def record(self, sample: dict, epoch: int) -> dict:
        url, key = sample["__url__"], sample["__key__"]
        index = self.index[url][key]
        shard = self.by_path[url]
        i = index - shard.offset
        ext = next(e for e in IMAGE_EXTS if e in sample)
        try:
            image = load_image(io.BytesIO(sample[ext]), self.image_size, "", self.augment, (index, int(epoch)),
                               self.image_transform)
        except DataError as e:
            raise DataError(f"{self.key}: shard {url} sample {key!r}: its {ext} cannot be decoded ({e.message}) — "
                            "replace the sample (it changed after the start-up scan)") from None
        item = {"image": image, "index": index}
        if shard.labels[i] is not None:
            item["label"] = shard.labels[i]
        caps = shard.captions[i]
        if caps:
            first = (int(epoch) + index) % len(caps)
            item["captions"] = [caps[first]] + caps[:first] + caps[first + 1:]
        return item


def _arranged(n: int, shift: int):
    """The rank's shard list L arranged for ``split_by_worker`` (loader worker p takes positions p, p + n, ...) to
    give worker p the shards L[(p + shift) mod n :: n]; the holes it leaves are None (``_present`` drops them)."""
    def arrange(src):
        mine = list(src)
        for j in range(0, len(mine), n):
            for p in range(n):
                i = j + (p + shift) % n
                yield mine[i] if i < len(mine) else None
    return arrange


def _present(src):
    return (item for item in src if item is not None)


def _known(index: dict):
    """Only the samples the start-up scan accepted (``data.on_error=skip`` leaves the bad ones out)."""
    def keep(src):
        for sample in src:
            if sample["__key__"] in index.get(sample["__url__"], ()):
                yield sample
    return keep


def _window(skip: int, stop: int):
    """Samples [skip, stop) of a worker's shuffled stream: its epoch's cut, after what a resumed run has seen."""
    def window(src):
        for i, sample in enumerate(src):
            if i >= stop:
                return
            if i >= skip:
                yield sample
    return window


class StreamPosition:
    """What a DataLoader over a ``ShardStream`` adds (``mtl.data.loader.StreamLoader``): each worker batches its own
    stream; ``len`` is this rank's batches in the epoch; the split a resume must keep."""

    def __len__(self) -> int:
        ds = self.dataset
        return max(0, ds.batches_per_epoch(ds.epoch) - ds.start) if ds.train else -(-len(ds) // ds.batch)

    def stream_state(self) -> dict:
        ds = self.dataset
        return {"world_size": ds.world, "num_workers": ds.workers}

    def verify_resume(self, saved: dict | None) -> None:
        """Refuse a resume whose stream was split over another number of processes or workers."""
        if not saved or saved == self.stream_state():
            return
        raise ConfigError(
            f"resume: data.source=webdataset streamed its shards over {saved['world_size']} process(es) x "
            f"data.num_workers={saved['num_workers']}, and this run has {self.dataset.world} x "
            f"data.num_workers={self.dataset.workers}: a stream's position does not carry over to another split. "
            f"Resume with {saved['world_size']} process(es) and data.num_workers={saved['num_workers']}, or start "
            "a new run")


def stream_loader_kwargs(ds: ShardStream, rank: int, world_size: int, kwargs: dict) -> dict:
    """Place ``ds`` at ``rank`` of ``world_size`` for a loader of ``kwargs`` (batch size, workers, collate ...).
    Its workers may persist: each reads the stream's position (shared memory) when an epoch's iterator starts."""
    ds.place(rank, world_size, kwargs["num_workers"], kwargs["batch_size"])
    # the loader's own generator: making an iterator (each epoch, a resume) must not draw from the global torch RNG,
    # or a resumed run's dropout would see a shifted random stream
    return {**kwargs, "generator": torch.Generator().manual_seed(ds.seed)}


def webdataset_splits(cfg, augment: Augment | None) -> tuple[ShardStream, ShardStream]:
    """(train, val) streams from ``data.webdataset``: both scanned, the class names read, everything refused
    before a run writes anything."""
    train = webdataset_split(cfg, "train", None, augment)
    return train, webdataset_split(cfg, "val", train.class_names)


def webdataset_split(cfg, split: str, class_names: list[str] | None, augment: Augment | None = None) -> ShardStream:
    """One split's stream (``split``: train or val), scanned; the training split reads the class names, another
    split's labels are checked against ``class_names`` (the training split's, or a trained model's)."""
    d, w = cfg.data, cfg.data.webdataset
    key, reasons = f"data.webdataset.{split}_shards", []
    shards = [scan_shard(p, key, d.on_error, bool(w.verify_images), reasons) for p in shard_paths(w.get(
        f"{split}_shards"), key)]
    if not any(shards):
        raise ConfigError(f"{key}: its shards hold no usable sample" + (f" ({reasons[0]})" if reasons else "")
                          + " — write samples with an image (jpg, png or webp)")
    if split == "train":
        class_names = _class_names(w.class_names, [s.path for s in shards], shards)
    else:
        _verify_labels(shards, class_names, key)
    return ShardStream(shards, key, d.image_size, d.on_error, split == "train", cfg.seed, w.shuffle_buffer,
                       augment if split == "train" else None, class_names, reasons)


def _class_names(path: str | None, paths: list[str], shards: list[Shard]) -> list[str]:
    labels = {x for s in shards for x in s.labels if x is not None}
    names = read_class_names(path, paths, "data.webdataset.class_names")
    if names is None:
        if labels:
            raise ConfigError(
                "data.webdataset.class_names: the shards have class indices (cls) and no class names; write "
                f"{CLASS_NAMES_FILE} (a JSON list, the class index its position) beside the training shards, or set "
                "data.webdataset.class_names to such a file")
        return []
    _verify_labels(shards, names, "data.webdataset.train_shards")
    return names


def _verify_labels(shards: list[Shard], names: list[str] | None, key: str) -> None:
    for s in shards:
        for k, x in zip(s.keys, s.labels):
            if x is not None and x >= len(names or []):
                raise ConfigError(f"{key}: shard {s.path} sample {k!r} has class index {x}, beyond the "
                                  f"{len(names or [])} class names (data.webdataset.class_names) — fix its cls or add "
                                  "the class's name")


def webdataset_errors(cfg) -> list[str]:
    """``data.source: webdataset``'s keys, checked before anything is read (``stream_errors``)."""
    return stream_errors(cfg, "webdataset", "webdataset", {
        k: f"a brace pattern such as 'shards/{k[:-7]}-{{000000..000015}}.tar', or a .txt file listing the shards"
        for k in ("train_shards", "val_shards")}, "samples")


def stream_errors(cfg, source: str, library: str, required: dict[str, str], unit: str) -> list[str]:
    """A streamed source's keys (``data.<source>``), checked before anything is read: the library, each required key
    (named with its example), a positive shuffle buffer, and what a stream cannot do yet (a bilevel method's held-out
    items)."""
    d, section = cfg.data, cfg.data[source]
    if importlib.util.find_spec(library) is None:
        return [f"data.source={source} needs the {library} library, which is not installed; {EXTRA}"]
    errors = [f"data.{source}.{k} is required for data.source={source} ({example})"
              for k, example in required.items() if not section.get(k)]
    if int(section.shuffle_buffer) < 1:
        errors.append(f"data.{source}.shuffle_buffer: must be at least 1 (got {section.shuffle_buffer})")
    if int(d.get("heldout") or 0):
        errors.append(f"data.heldout: data.source={source} streams its {unit} and holds none out; use a "
                      "weighting.method without a held-out meta update, or another data.source")
    return errors


def streamed(ds) -> bool:
    return isinstance(ds, ShardStream)
