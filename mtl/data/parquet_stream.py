"""``data.source: hf_stream``: Parquet files streamed through Hugging Face's ``IterableDataset`` (``streaming=True``),
split by node with ``datasets.distributed.split_dataset_by_node`` and by loader worker by ``datasets`` itself.

The plan is ``mtl.data.streamed``'s, file for shard: epoch e orders the files by a shuffle seeded with ``seed + e``,
rank r of W streams every W-th from r (``split_dataset_by_node``'s "shards" strategy, which needs the number of
files to be a multiple of W), worker w of N every N-th of those, each (rank, worker) stream mixed in a shuffle
buffer seeded by (seed, e, r, w) and cut to the same number of batches; a resume skips each worker's consumed rows.
``datasets`` gives a loader worker its files by the worker's own id, so a resumed epoch (whose next batch is another
worker's than the loader's first) hands ``datasets`` the rank's files rotated: the files of worker w come to the
loader worker that plays w's part. That needs as many files on every worker: a multiple of W x N files.

At start every file's row count, labels and captions are read (pyarrow, without the images; with
``data.hf_stream.verify_images`` every image decoded once); class names are the label column's ``ClassLabel``
names.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import os

from torch.utils.data import get_worker_info

from mtl.data.images import PIL_ERRORS, Augment, shape_problem
from mtl.data.streamed import EXTRA, Shard, ShardStream, _arranged, stream_errors
from mtl.errors import ConfigError


def need_datasets():
    if importlib.util.find_spec("datasets") is None or importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"data.source=hf_stream needs the datasets library, which is not installed; {EXTRA}")
    import datasets

    return datasets


def parquet_paths(spec, key: str) -> list[str]:
    """The files ``spec`` names: a glob pattern (sorted), several joined by ``::``, or a ``.txt`` list file."""
    if not spec:
        raise ConfigError(f"{key} is required for data.source=hf_stream (a glob such as 'data/train-*.parquet')")
    paths: list[str] = []
    for s in str(spec).split("::"):
        if s.endswith(".txt") and os.path.isfile(s):
            with open(s) as f:
                paths += [os.path.join(os.path.dirname(os.path.abspath(s)), ln.strip()) for ln in f
                          if ln.strip() and not ln.lstrip().startswith("#")]
        else:
            paths += sorted(glob.glob(s)) if glob.has_magic(s) else [s]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise ConfigError(f"{key}: {spec!r} matches no Parquet file" + (f" ({missing[0]!r} does not exist)" if missing
                          else "") + " — fix the pattern or its folder")
    return paths


def _column(table, name: str | None):
    return table.column(name).to_pylist() if name and name in table.column_names else None


def scan_file(path: str, key: str, h, on_error: str, reasons: list[str]) -> tuple[Shard, int]:
    """(the file's good rows as a Shard, its row count); a bad row refused by name or left out (``on_error``)."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        wanted = [c for c in (h.label_column, h.caption_column) if c and c in schema.names]
        if h.image_column not in schema.names:
            raise ConfigError(f"data.hf_stream.image_column: {path!r} has no column {h.image_column!r} (it has "
                              f"{', '.join(schema.names)}) — set data.hf_stream.image_column")
        table = pq.read_table(path, columns=wanted + ([h.image_column] if h.verify_images else []))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path!r} is not a readable Parquet file ({e}) — write it again") from None
    labels, caps = _column(table, h.label_column), _column(table, h.caption_column)
    images = _column(table, h.image_column) if h.verify_images else None
    shard = Shard(path)
    for row in range(table.num_rows):
        problem = _image_problem(images[row]) if images is not None else None
        if problem:
            where = f"{path} row {row}: its {h.image_column} {problem}"
            if on_error == "raise":
                raise ConfigError(f"{key}: {where} — replace the row's image, or set data.on_error=skip")
            reasons.append(where)
            continue
        shard.keys.append(str(row))
        shard.labels.append(None if labels is None else int(labels[row]))
        c = None if caps is None else caps[row]
        shard.captions.append(None if c is None else [c] if isinstance(c, str) else list(c))
    return shard, table.num_rows


def _image_problem(cell) -> str | None:
    from PIL import Image

    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not data:
        return "holds no image bytes"
    try:
        with Image.open(io.BytesIO(data)) as img:
            problem = shape_problem(*img.size)
            if problem is None:
                img.load()
    except PIL_ERRORS as e:
        return f"cannot be decoded ({e})"
    return problem


def class_names_of(path: str, h) -> list[str] | None:
    """The label column's ``ClassLabel`` names (the features ``datasets`` wrote into the Parquet schema), or None."""
    import pyarrow.parquet as pq

    datasets = need_datasets()
    features = datasets.Features.from_arrow_schema(pq.read_schema(path))
    label = features.get(h.label_column) if h.label_column else None
    return list(label.names) if isinstance(label, datasets.ClassLabel) else None


class ParquetStream(ShardStream):
    """A split's Parquet files as a stream: ``ShardStream``'s plan, the rows read by ``datasets`` (streaming)."""

    def __init__(self, shards: list[Shard], rows: dict, image_column: str, key: str, *args, **kwargs):
        super().__init__(shards, key, *args, **kwargs)
        self.rows, self.image_column = rows, image_column
        self.source = f"Parquet files streamed by datasets ({key})"

    def __getitem__(self, index: int) -> dict:
        """One row by its global index, its image read from its file (a few, for the samples figure)."""
        import pyarrow.parquet as pq

        index = int(index)
        shard = next(s for s in self.shards if s.offset <= index < s.offset + len(s))
        key = shard.keys[index - shard.offset]
        cell = pq.read_table(shard.path, columns=[self.image_column]).column(self.image_column)[int(key)].as_py()
        sample = {"__url__": shard.path, "__key__": key, "jpg": cell["bytes"] if isinstance(cell, dict) else cell}
        return self.record(sample, self.epoch)

    def how_to_provide(self, field: str) -> str:
        return f"give the Parquet files a {field} column and name it in data.hf_stream.{field.rstrip('s')}_column"

    def place(self, rank: int, world: int, workers: int, batch: int) -> None:
        n = world * (max(1, workers) if self.train else 1)
        if len(self.shards) % n:
            raise ConfigError(
                f"{self.key}: {len(self.shards)} Parquet file(s) for {world} process(es)" + (
                    f" x {max(1, workers)} loader worker(s) (data.num_workers={workers})" if self.train else "")
                + f": split_dataset_by_node gives every process whole files, and exact resume needs as many on every "
                f"worker, so the number of files must be a multiple of {n} — write the data as such a number of files, "
                "or change the number of processes or data.num_workers")
        super().place(rank, world, workers, batch)

    def read(self, order: list[str], worker: int, n: int):
        datasets = need_datasets()
        from datasets.distributed import split_dataset_by_node

        info = get_worker_info()
        physical = info.id if info is not None else 0
        mine = order[self.rank::self.world]
        if info is not None:  # datasets gives loader worker p the files mine[p::n]: let them be worker's
            order = list(order)  # (as many files on every worker, place(): _arranged leaves no hole)
            order[self.rank::self.world] = list(_arranged(n, (worker - physical) % n)(mine))
        ds = datasets.load_dataset("parquet", data_files=order, split="train", streaming=True)
        ds = ds.select_columns([self.image_column])
        if isinstance(ds.features[self.image_column], datasets.Image):
            ds = ds.cast_column(self.image_column, datasets.Image(decode=False))
        rows = iter(split_dataset_by_node(ds, rank=self.rank, world_size=self.world))
        for path in mine[worker::n] if info is not None else mine:
            for row in range(self.rows[path]):
                cell = next(rows)[self.image_column]
                yield {"__url__": path, "__key__": str(row), "jpg": cell["bytes"] if isinstance(cell, dict) else cell}


def hf_stream_split(cfg, split: str, class_names: list[str] | None, augment: Augment | None = None) -> ParquetStream:
    """One split's stream from ``data.hf_stream`` (``split``: train or val), scanned; labels checked against
    ``class_names`` (the training split's own ``ClassLabel`` names, or a trained model's)."""
    d, h = cfg.data, cfg.data.hf_stream
    key, reasons = f"data.hf_stream.{split}_files", []
    scanned = [scan_file(p, key, h, d.on_error, reasons) for p in parquet_paths(h.get(f"{split}_files"), key)]
    shards = [s for s, _ in scanned]
    if split == "train":
        class_names = class_names_of(shards[0].path, h)
        if class_names is None and any(x is not None for s in shards for x in s.labels):
            raise ConfigError(f"data.hf_stream.label_column: {h.label_column!r} is not a ClassLabel, so the files carry "
                              "no class names — write the data set with a ClassLabel feature (datasets.ClassLabel)")
    for s in shards:
        for k, x in zip(s.keys, s.labels):
            if x is not None and not 0 <= x < len(class_names or []):
                raise ConfigError(f"{key}: {s.path} row {k} has class index {x}, outside the {len(class_names or [])} "
                                  "class names — fix its label")
    return ParquetStream(shards, {s.path: n for s, n in scanned}, h.image_column, key, d.image_size, d.on_error,
                         split == "train", cfg.seed, h.shuffle_buffer, augment if split == "train" else None,
                         class_names, reasons)


def hf_stream_splits(cfg, augment: Augment | None) -> tuple[ParquetStream, ParquetStream]:
    train = hf_stream_split(cfg, "train", None, augment)
    return train, hf_stream_split(cfg, "val", train.class_names)


def hf_stream_errors(cfg) -> list[str]:
    """``data.source: hf_stream``'s keys, checked before anything is read (``stream_errors``)."""
    return stream_errors(cfg, "hf_stream", "datasets", {
        k: f"a glob such as 'data/{k[:-6]}-*.parquet'" for k in ("train_files", "val_files")}, "rows")
