"""``data.source: hf``: a Hugging Face ``datasets`` data set, read where it is (docs/data.md).

``data.hf.path`` is a ``save_to_disk`` folder holding a ``DatasetDict``, or, with ``data.hf.builder``, files that the
named packaged builder reads (``parquet``, ``arrow``, ``json``, ``csv``, ``imagefolder``; ``data.hf.data_files``).
Either way each split is an Arrow table that ``datasets`` memory-maps: a row is read when the sampler asks for it, so
the training process's resident memory does not grow with the number of rows (the benchmark in docs/data.md), and
the random access goes through the same samplers as every other source: the same exact resume by global-sample
position, the same global batch on 1 and 2 processes.

- Splits and columns are chosen by name (``train_split`` ...; ``image_column``, ``label_column``,
  ``caption_column``); a named one that is not there is a ConfigError naming the key and what there is.
- Labels: an integer or ``ClassLabel`` column; a ``ClassLabel``'s names are the class names (class_names.json).
- Captions: a string, or a list of strings per image. Training takes one of them per epoch, drawn from (seed, epoch,
  index) (``caption_choice``); evaluation scores against all of them (multi-reference BLEU, mtl/tasks/captioning.py).
- Every row is checked before training (its label, its captions, and with ``data.hf.verify`` its image, fully
  decoded); a bad row stops the run naming the split, the row and the fix, or with ``data.on_error=skip`` is left
  out and counted in the run's summary with today's bad lines.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from mtl.config.schema import HFConfig, options_of
from mtl.data.images import PIL_ERRORS, Augment, image_tensor, shape_problem
from mtl.data.manifest import BASE_FIELDS, ON_ERROR
from mtl.errors import ConfigError

EXTRA = "install the data extra (pip install -e '.[data]', or make install)"
BUILDERS = ("parquet", "arrow", "json", "csv", "imagefolder")
SPLIT_KEYS = {"train": "train_split", "val": "val_split", "test": "test_split"}
DEFAULT_LABEL, DEFAULT_CAPTIONS = ("label",), ("caption", "captions")
BATCH = 256  # rows read at once by the checks and all_captions (transient: nothing grows with the data set)


def import_datasets():
    """The ``datasets`` library, or a ConfigError naming the extra that brings it."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.source: hf reads Hugging Face datasets, and the datasets library is not installed; "
                          f"{EXTRA}") from None
    return datasets


def caption_choice(seed: int, epoch: int, index: int, n: int) -> int:
    """Which of an item's ``n`` captions training takes first in ``epoch``: a pure function of (seed, epoch, index),
    so a resumed run, every worker and every world size take the same one."""
    if n <= 1:
        return 0
    digest = hashlib.blake2b(f"caption:{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def load_dataset_dict(h: HFConfig, key: str = "data.hf"):
    """The splits of ``h.path`` ({name: Dataset}), memory-mapped; a path or builder that cannot be read is a
    ConfigError naming the key."""
    datasets = import_datasets()
    if not h.path:
        raise ConfigError(f"{key}.path: data.source=hf needs the data set's folder (a save_to_disk folder, or the "
                          f"folder of the files {key}.builder reads)")
    if not os.path.exists(h.path):
        raise ConfigError(f"{key}.path: {h.path!r} not found — set it to an existing folder")
    if h.builder is None:
        if not os.path.isfile(os.path.join(h.path, "dataset_dict.json")):
            single = os.path.isfile(os.path.join(h.path, "dataset_info.json"))
            why = ("holds one Dataset saved without splits — save a DatasetDict({'train': ..., 'validation': ...})"
                   if single else "is not a save_to_disk folder (no dataset_dict.json) — set "
                   f"{key}.builder ({', '.join(BUILDERS)}) to read its files")
            raise ConfigError(f"{key}.path: {h.path!r} {why}")
        try:
            return dict(datasets.load_from_disk(h.path, keep_in_memory=False))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}.path: {h.path!r} cannot be read by datasets.load_from_disk ({e}); save "
                              "it again with DatasetDict.save_to_disk") from None
    if h.builder not in BUILDERS:
        raise ConfigError(f"{key}.builder: {h.builder!r} is not one of {', '.join(BUILDERS)} (or null for a "
                          "save_to_disk folder)")
    files = _data_files(h.data_files, h.path)
    try:
        loaded = datasets.load_dataset(h.builder, data_dir=h.path if files is None else None, data_files=files,
                                       cache_dir=h.cache_dir, keep_in_memory=False)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (FileNotFoundError, DatasetGenerationError ...)
        raise ConfigError(f"{key}.path / {key}.data_files: the {h.builder} builder cannot read {h.path!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); point them at "
                          f"{h.builder} files") from None
    return dict(loaded)


def _data_files(files, root: str):
    """``data.hf.data_files`` with relative paths resolved against ``data.hf.path``."""
    if files is None:
        return None
    fix = lambda f: f if os.path.isabs(f) else os.path.join(root, f)  # noqa: E731
    if isinstance(files, str):
        return fix(files)
    if isinstance(files, (list, tuple)) or hasattr(files, "__iter__") and not hasattr(files, "items"):
        return [fix(str(f)) for f in files]
    return {str(k): fix(v) if isinstance(v, str) else [fix(str(f)) for f in v] for k, v in files.items()}


def pick_split(splits: dict, h: HFConfig, split: str, key: str = "data.hf"):
    """The split named by ``<key>.<split>_split``; a missing one names the splits there are."""
    name = getattr(h, SPLIT_KEYS[split])
    if name not in splits:
        raise ConfigError(f"{key}.{SPLIT_KEYS[split]}: split {name!r} is not in {h.path!r} (its splits: "
                          f"{', '.join(sorted(splits)) or 'none'}) — set {key}.{SPLIT_KEYS[split]} to one of them")
    return splits[name]


@dataclass(frozen=True)
class Columns:
    """The columns read from a split: image (required), label and captions (None: the items have none)."""

    image: str
    image_kind: str  # "image" (an Image feature, read undecoded) | "bytes" (a binary column of encoded files)
    label: str | None
    class_names: tuple[str, ...] | None  # a ClassLabel's names
    captions: str | None
    caption_list: bool  # a list of captions per row (else one string)


def _feature_kind(feature) -> str:
    """A column's feature as words: its dtype, or its class name."""
    return getattr(feature, "dtype", None) or type(feature).__name__


def resolve_columns(ds, h: HFConfig, where: str, key: str = "data.hf") -> Columns:
    """The configured columns of ``ds``, checked by name and type: a ConfigError naming the key and the fix."""
    datasets = import_datasets()
    feats, have = ds.features, ", ".join(ds.column_names)
    if h.image_column not in feats:
        raise ConfigError(f"{key}.image_column: {where} has no column {h.image_column!r} (its columns: {have}) — set "
                          f"{key}.image_column to the column holding the images")
    f = feats[h.image_column]
    if isinstance(f, datasets.Image):
        image_kind = "image"
    elif getattr(f, "dtype", None) in ("binary", "large_binary"):
        image_kind = "bytes"
    else:
        raise ConfigError(f"{key}.image_column: column {h.image_column!r} of {where} holds {_feature_kind(f)}, not "
                          "images (an Image feature, or bytes of image files) — name the image column, or cast it "
                          "with ds.cast_column(name, datasets.Image())")
    label = _named_column(feats, h.label_column, DEFAULT_LABEL, "label_column", where, have, key)
    names = None
    if label is not None:
        f = feats[label]
        if isinstance(f, datasets.ClassLabel):
            names = tuple(f.names)
        elif not str(getattr(f, "dtype", "")).startswith(("int", "uint")):
            raise ConfigError(f"{key}.label_column: column {label!r} of {where} holds {_feature_kind(f)}, neither "
                              "integers nor a ClassLabel — encode it (ds.class_encode_column(" + repr(label) + ") "
                              "before save_to_disk, or python -m mtl.tools.shard), or set "
                              f"{key}.label_column to the class-index column")
    captions = _named_column(feats, h.caption_column, DEFAULT_CAPTIONS, "caption_column", where, have, key)
    caption_list = False
    if captions is not None:
        f = feats[captions]
        inner = getattr(f, "feature", None)
        caption_list = inner is not None
        if _feature_kind(inner if caption_list else f) not in ("string", "large_string"):
            raise ConfigError(f"{key}.caption_column: column {captions!r} of {where} holds {_feature_kind(f)}, "
                              "neither strings nor lists of strings — name the caption column")
    return Columns(h.image_column, image_kind, label, names, captions, caption_list)


def _named_column(feats, named: str | None, defaults: tuple, name: str, where: str, have: str, key: str):
    """A configured column (it must exist), else the first default name the split has, else None."""
    if named is None:
        return next((c for c in defaults if c in feats), None)
    if named not in feats:
        raise ConfigError(f"{key}.{name}: {where} has no column {named!r} (its columns: {have}) — set {key}.{name} "
                          "to one of them, or null")
    return named


def open_cell(cell, kind: str) -> Image.Image:
    """An image cell (an undecoded Image feature's {bytes, path}, or bytes) as an upright RGB picture; OSError and
    the other PIL errors when it cannot be decoded, ValueError when it is unusable (``shape_problem``)."""
    if kind == "image":
        data, path = (cell or {}).get("bytes"), (cell or {}).get("path")
    else:
        data, path = cell, None
    if data is None and not path:
        raise ValueError("the cell is empty")
    with Image.open(io.BytesIO(data) if data is not None else path) as raw:
        problem = shape_problem(*raw.size)
        if problem is not None:
            raise ValueError(problem)
        return ImageOps.exif_transpose(raw).convert("RGB")  # convert decodes every pixel


def _caption_list(value, is_list: bool) -> list[str]:
    caps = list(value or []) if is_list else ([] if value is None else [value])
    out = [c.strip() for c in caps if isinstance(c, str) and c.strip()]
    if not out or len(out) != len(caps):
        raise ValueError("no caption" if not caps else f"an empty caption in {caps!r}")
    return out


class HFImages(Dataset):
    """One split of an HF data set as items: ``image`` (3, S, S), ``index``, and ``label`` / ``captions`` where the
    split has those columns. Rows are read on demand from the memory-mapped table; ``rows`` (kept only when
    ``data.on_error=skip`` left some out) maps an item index to its row."""

    def __init__(self, table, cols: Columns, image_size: int, source: str, seed: int = 0,
                 augment: Augment | None = None, on_error: str = "raise", verify: bool = True,
                 class_names: list[str] | None = None, num_classes: int | None = None, key: str = "data.hf"):
        if on_error not in ON_ERROR:
            raise ConfigError(f"data.on_error={on_error!r}: must be one of {', '.join(ON_ERROR)}")
        datasets = import_datasets()
        keep = [c for c in (cols.image, cols.label, cols.captions) if c is not None]
        table = table.select_columns(list(dict.fromkeys(keep)))
        if cols.image_kind == "image":
            table = table.cast_column(cols.image, datasets.Image(decode=False))
        self.table, self.cols, self.source, self.key = table, cols, source, key
        self.image_size, self.seed, self.augment = int(image_size), int(seed), augment
        self.epoch = 0
        self.image_transform = None  # the model's own image transform (mtl.data.images.prepare_images); None: mtl's
        self.provides = BASE_FIELDS - ({"label"} if cols.label is None else set()) \
            - ({"captions"} if cols.captions is None else set())
        self.class_names, self.num_classes = _classes(self, class_names, num_classes)
        self.rows, self.skip_reasons, self.present = _verify_rows(self, on_error, verify)
        self.skipped = len(self.skip_reasons)
        if class_names is None and cols.class_names is None and cols.label is not None and num_classes is None:
            self.num_classes = max(self.present) + 1 if self.present else 0
            self.class_names = [str(i) for i in range(self.num_classes)]

    def __len__(self) -> int:
        return len(self.table) if self.rows is None else len(self.rows)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def how_to_provide(self, field: str) -> str:
        which = {"label": "label_column", "captions": "caption_column"}.get(field)
        if which is None:
            return f"use a data source whose items have {field!r}"
        return (f"set {self.key}.{which} to the column holding them (the split's columns: "
                f"{', '.join(self.table.column_names)}; {self.source})")

    def labels_present(self, enough: int | None = None) -> set[int]:
        return set(self.present)

    def all_captions(self) -> list[str]:
        if self.cols.captions is None:
            return []
        out = []
        for batch in self.table.select_columns([self.cols.captions]).iter(batch_size=BATCH):
            for value in batch[self.cols.captions]:
                out += _caption_list(value, self.cols.caption_list)
        return out

    def row_of(self, index: int) -> int:
        return int(index) if self.rows is None else int(self.rows[index])

    def __getitem__(self, key) -> dict:
        # the train sampler passes (index, epoch), so the caption choice survives persistent workers
        index, epoch = key if isinstance(key, tuple) else (key, self.epoch)
        index, row = int(index), self.row_of(int(index))
        rec = self.table[row]
        try:
            img = open_cell(rec[self.cols.image], self.cols.image_kind)
        except (*PIL_ERRORS, ValueError) as e:
            raise ConfigError(f"{self.key}.image_column: {self.source} row {row} cannot be decoded at load time "
                              f"({e}); replace the cell, or leave data.hf.verify on to check every image first "
                              "(data.on_error=skip then leaves it out)") from None
        item = {"image": image_tensor(img, self.image_size, self.augment, (index, int(epoch)), self.image_transform),
                "index": index}
        if self.cols.label is not None:
            item["label"] = int(rec[self.cols.label])
        if self.cols.captions is not None:
            caps = _caption_list(rec[self.cols.captions], self.cols.caption_list)
            first = caption_choice(self.seed, int(epoch), index, len(caps))
            item["captions"] = [caps[first]] + caps[:first] + caps[first + 1:]
        return item


def _classes(ds: HFImages, class_names, num_classes) -> tuple[list[str], int]:
    """(class names, number of classes) before the rows are read: the training split's (a val or test split, whose
    ClassLabel must then name the same classes), else the ClassLabel's, else ``data.num_classes``'s range; else
    ([], 0), filled in from the labels once they are read."""
    own = ds.cols.class_names
    if class_names is not None:
        if own is not None and list(own) != list(class_names):
            raise ConfigError(f"{ds.key}.label_column: the ClassLabel of {ds.source} names {', '.join(own)}, and the "
                              f"training split's classes are {', '.join(class_names)} — give the splits one ClassLabel")
        return list(class_names), len(class_names)
    if own is not None:
        if num_classes is not None and num_classes != len(own):
            raise ConfigError(f"data.num_classes={num_classes}, and the ClassLabel of {ds.source} names {len(own)} "
                              "classes — remove data.num_classes")
        return list(own), len(own)
    if num_classes is not None:
        return [str(i) for i in range(num_classes)], int(num_classes)
    return [], 0


def _verify_rows(ds: HFImages, on_error: str, verify: bool):
    """Every row's label, captions and (``verify``) image, read in batches: (kept rows or None when all are kept,
    the reasons of the rows left out, the labels present). A bad row raises unless ``on_error`` is skip."""
    c = ds.cols
    cols = [x for x in (c.label, c.captions) if x is not None] + ([c.image] if verify else [])
    limit = ds.num_classes if ds.num_classes else None
    bad, reasons, present, row = [], [], set(), 0
    if not cols:
        return None, [], present
    for batch in ds.table.select_columns(list(dict.fromkeys(cols))).iter(batch_size=BATCH):
        for i in range(len(batch[cols[0]])):
            problem = _row_problem(batch, i, c, verify, limit)
            if problem is None:
                if c.label is not None:
                    present.add(int(batch[c.label][i]))
            else:
                column, why, fix = problem
                where = f"{ds.source} row {row + i}: {why}"
                if on_error == "raise":
                    raise ConfigError(f"{ds.key}.{column}: {where} — {fix}, or set data.on_error=skip")
                bad.append(row + i)
                reasons.append(where)
        row += len(batch[cols[0]])
    if len(bad) == row:
        raise ConfigError(f"{ds.key}: {ds.source} has no usable rows ({row} bad); first problems: "
                          + "; ".join(reasons[:3]))
    if not bad:
        return None, reasons, present
    rows = np.setdiff1d(np.arange(row, dtype=np.int64), np.asarray(bad, dtype=np.int64))
    return rows, reasons, present


def _row_problem(batch, i: int, c: Columns, verify: bool, limit: int | None):
    """(column key, what is wrong with row ``i`` of ``batch``, the fix), or None."""
    if c.label is not None:
        label = batch[c.label][i]
        if label is None or int(label) < 0:
            return "label_column", f"no label ({label!r})", "label the row"
        if limit is not None and int(label) >= limit:
            return "label_column", f"label {label} is outside the classes 0..{limit - 1}", "fix the label"
    if c.captions is not None:
        try:
            _caption_list(batch[c.captions][i], c.caption_list)
        except ValueError as e:
            return "caption_column", str(e), "give every row a caption"
    if verify:
        try:
            open_cell(batch[c.image][i], c.image_kind)
        except (*PIL_ERRORS, ValueError) as e:
            return "image_column", f"the image cannot be decoded ({e})", "replace the cell"
    return None


def hf_split(cfg, split: str, h: HFConfig | None = None, splits: dict | None = None, train=None,
             key: str = "data.hf", on_error: str | None = None) -> HFImages:
    """One split ("train", "val", "test") of the configured HF data set; a val or test split's labels are checked
    against ``train``'s classes (a training split, or anything with ``class_names``)."""
    h = h if h is not None else options_of(HFConfig, cfg.data.hf, key)
    splits = splits if splits is not None else load_dataset_dict(h, key)
    table = pick_split(splits, h, split, key)
    where = f"split {getattr(h, SPLIT_KEYS[split])!r} of {h.path}"
    cols = resolve_columns(table, h, where, key)
    d = cfg.data
    return HFImages(table, cols, d.image_size, where, seed=cfg.seed,
                    augment=Augment.from_config(cfg) if split == "train" else None,
                    on_error=d.on_error if on_error is None else on_error,
                    verify=h.verify, class_names=None if train is None else list(train.class_names),
                    num_classes=d.num_classes if train is None and key == "data.hf" else None, key=key)


def hf_datasets(cfg) -> tuple[HFImages, HFImages]:
    """(train, val) of ``data.hf``."""
    h = options_of(HFConfig, cfg.data.hf, "data.hf")
    splits = load_dataset_dict(h)
    train = hf_split(cfg, "train", h, splits)
    return train, hf_split(cfg, "val", h, splits, train)


def hf_test(cfg, train) -> HFImages | None:
    """``data.hf.test_split``, or None when it is not set."""
    h = options_of(HFConfig, cfg.data.hf, "data.hf")
    return None if h.test_split is None else hf_split(cfg, "test", h, train=train)


def hf_task_split(cfg, task: str, split: str, train=None) -> HFImages:
    """Multi-input mode: one split of task ``task``'s own HF data set (``data.per_task.<task>.hf``)."""
    key, section = f"data.per_task.{task}.hf", cfg.data.per_task[task] or {}
    h = options_of(HFConfig, section.get("hf") or {}, key)
    return hf_split(cfg, split, h, train=train, key=key, on_error=section.get("on_error") or "raise")
