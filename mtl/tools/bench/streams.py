"""Loader throughput of the streamed sources (``data.source: webdataset`` and ``hf_stream``, docs/data.md) on N
small JPEGs written here:

    python -m mtl.tools.bench.streams [--images 10000] [--size 48] [--shards 20] [--workers 2] [--batch 64]
                                      [--image-size 32] [--repeat 5] [--dir DIR]

Five loaders over the same images, each with ``--workers`` workers and batch ``--batch``, decoded by the same
function (``mtl.data.images.load_image``: RGB, resize/centre-crop to ``--image-size``, float in [0, 1]):

- ``plain DataLoader (webdataset pipeline)``: a ``torch.utils.data.DataLoader`` over webdataset's own minimal
  pipeline on the shards (``SimpleShardList`` -> ``split_by_worker`` -> ``tarfile_to_samples`` -> decode), default
  collate: the baseline of the webdataset source;
- ``webdataset source``: mtl's training loader over the shards (``build_train_loader``: the node/worker split, the
  seeded shuffle buffer, the records mtl's tasks read);
- ``plain DataLoader (datasets streaming)``: a DataLoader over ``datasets.load_dataset("parquet", streaming=True)``
  on the same images as ``--shards`` Parquet files (datasets splits the files over the workers), decoded alike: the
  baseline of the hf_stream source;
- ``hf_stream source``: mtl's training loader over those Parquet files;
- ``imagefolder source``: mtl's training loader over the same images as one file each (``data.source: imagefolder``).

Each is timed over whole epochs (one warm-up epoch each, then ``--repeat`` rounds of one epoch of each loader in
turn, the median reported): images per second, and the ratio to the plain loader. The files are read from the page
cache after the first epoch on a machine with enough memory; a cold network file system is where shards are meant
to win (sequential reads). The start-up scan (``data.webdataset.verify_images``: every image decoded once; the
ImageFolder source decodes every image at start too) is timed as well.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image

from mtl.config.keys import Config
from mtl.data.images import load_image
from mtl.data.loader import build_datasets, build_train_loader, start_at

CLASSES = ["a", "b", "c", "d"]


def write_data(folder: str, n: int, size: int, shards: int) -> tuple[str, str, str]:
    """n JPEGs as an ImageFolder (folder/images/<class>/<i>.jpg, with captions.jsonl), as tar shards and as as many
    Parquet files (written by datasets: an Image column, a ClassLabel); returns (the ImageFolder root, the shards'
    brace pattern, the Parquet files' glob)."""
    import json

    import datasets
    import webdataset as wds

    datasets.disable_progress_bars()

    root, rng = os.path.join(folder, "images"), np.random.default_rng(0)
    for c in CLASSES:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    per = -(-n // shards)
    sinks = [wds.TarWriter(os.path.join(folder, f"train-{k:06d}.tar")) for k in range(shards)]
    captions = open(os.path.join(root, "captions.jsonl"), "w")
    rows = [{"image": [], "label": [], "caption": []} for _ in range(shards)]
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
        c = i % len(CLASSES)
        rel = f"{CLASSES[c]}/{i:06d}.jpg"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(buf.getvalue())
        captions.write(json.dumps({"image": rel, "caption": f"image {CLASSES[c]}"}) + "\n")
        sinks[i // per].write({"__key__": f"{i:06d}", "jpg": buf.getvalue(), "cls": str(c), "txt": f"image {CLASSES[c]}"})
        for column, value in zip(rows[i // per], ({"bytes": buf.getvalue(), "path": None}, c, f"image {CLASSES[c]}")):
            rows[i // per][column].append(value)
    captions.close()
    for s in sinks:
        s.close()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES),
                                  "caption": datasets.Value("string")})
    for k, part in enumerate(rows):
        datasets.Dataset.from_dict(part, features=features).to_parquet(os.path.join(folder, f"part-{k:06d}.parquet"))
    with open(os.path.join(folder, "class_names.json"), "w") as f:
        json.dump(CLASSES, f)
    return (root, os.path.join(folder, f"train-{{000000..{shards - 1:06d}}}.tar"),
            os.path.join(folder, "part-*.parquet"))


def stack(records: list[dict]) -> dict:
    return {"image": torch.stack([r["image"] for r in records]), "index": torch.tensor([r["index"] for r in records])}


class PlainDecode:
    """webdataset's minimal pipeline's decode stage: the same function mtl decodes with."""

    def __init__(self, image_size: int):
        self.image_size = image_size

    def __call__(self, sample: dict) -> dict:
        return {"image": load_image(io.BytesIO(sample["jpg"]), self.image_size), "index": int(sample["__key__"])}


class PlainRows(torch.utils.data.IterableDataset):
    """datasets' own streaming of the Parquet files (its worker split: each loader worker its files), each row's
    image decoded by the same function: the plain baseline of the hf_stream source."""

    def __init__(self, files: str, image_size: int):
        self.files, self.image_size = files, image_size

    def __iter__(self):
        import datasets

        ds = datasets.load_dataset("parquet", data_files=self.files, split="train", streaming=True)
        ds = ds.select_columns(["image"]).cast_column("image", datasets.Image(decode=False))
        for i, row in enumerate(ds):
            yield {"image": load_image(io.BytesIO(row["image"]["bytes"]), self.image_size), "index": i}


def plain_loader(pattern: str, args) -> torch.utils.data.DataLoader:
    import webdataset as wds

    urls = list(wds.shardlists.expand_urls(pattern))
    pipe = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples(),
                            wds.map(PlainDecode(args.image_size)))
    return torch.utils.data.DataLoader(pipe, batch_size=args.batch, num_workers=args.workers,
                                       persistent_workers=args.workers > 0)


def plain_rows_loader(files: str, args) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(PlainRows(files, args.image_size), batch_size=args.batch,
                                       num_workers=args.workers, persistent_workers=args.workers > 0)


def source_config(args, source: str, **data) -> Config:
    cfg = OmegaConf.structured(Config)
    cfg.data.image_size, cfg.data.source = args.image_size, source
    for k, v in data.items():
        OmegaConf.update(cfg, f"data.{k}", v)
    return cfg


def mtl_loader(cfg, args):
    t0 = time.perf_counter()
    train, _ = build_datasets(cfg)
    scan = time.perf_counter() - t0
    loader = build_train_loader(train, stack, args.batch, 0, 1, seed=0, num_workers=args.workers)
    return loader, scan


def one_epoch(loader, e: int, mtl: bool) -> tuple[float, int]:
    """(images per second, images) of epoch ``e``."""
    if mtl:
        start_at(loader, e, 0)
    t0, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch["index"])
    return count / (time.perf_counter() - t0), count


def interleaved(loaders: list[tuple], repeat: int) -> list[tuple[float, int]]:
    """(median images per second, images an epoch) of each (loader, is it mtl's): a warm-up epoch each, then
    ``repeat`` rounds of one epoch of each in turn (a machine shared with other work slows them alike)."""
    rates = [[] for _ in loaders]
    counts = [one_epoch(loader, 0, mtl)[1] for loader, mtl in loaders]
    for r in range(1, repeat + 1):
        for i, (loader, mtl) in enumerate(loaders):
            rates[i].append(one_epoch(loader, r, mtl)[0])
    return [(statistics.median(x), n) for x, n in zip(rates, counts)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--size", type=int, default=48, help="the JPEGs' side in pixels")
    p.add_argument("--shards", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write the data (default: a temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    folder = args.dir or tempfile.mkdtemp(prefix="bench_streams_")
    root, pattern, files = write_data(folder, args.images, args.size, args.shards)
    sources = [
        ("webdataset source", source_config(args, "webdataset", **{"webdataset.train_shards": pattern,
                                                                   "webdataset.val_shards": pattern})),
        ("hf_stream source", source_config(args, "hf_stream", **{"hf_stream.train_files": files,
                                                                 "hf_stream.val_files": files})),
        ("imagefolder source (a file per image)", source_config(args, "imagefolder", train_path=root, val_path=root)),
    ]
    built = {name: mtl_loader(cfg, args) for name, cfg in sources}  # name -> (loader, start-up scan in s)
    # (name, loader, is it mtl's, start-up scan, the row it is compared with)
    loaders = [("plain DataLoader (webdataset pipeline)", plain_loader(pattern, args), False, 0.0, 0),
               ("webdataset source", *built["webdataset source"][:1], True, built["webdataset source"][1], 0),
               ("plain DataLoader (datasets streaming)", plain_rows_loader(files, args), False, 0.0, 2),
               ("hf_stream source", *built["hf_stream source"][:1], True, built["hf_stream source"][1], 2)]
    name = sources[2][0]
    loaders.append((name, built[name][0], True, built[name][1], 0))
    timed = interleaved([(loader, mtl) for _, loader, mtl, _, _ in loaders], args.repeat)
    print(f"{args.images} JPEGs of {args.size}x{args.size} px, {args.shards} shards (and as many Parquet files), "
          f"{args.workers} workers, batch {args.batch}, decoded to {args.image_size}x{args.image_size}; median of "
          f"{args.repeat} interleaved epochs\n")
    print("| loader | images/s | against | ratio | images an epoch | start-up scan (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for (name, _, _, start, against), (rate, count) in zip(loaders, timed):
        base = timed[against][0]
        print(f"| {name} | {rate:,.0f} | {loaders[against][0]} | {rate / base:.2f}x | {count:,} | {start:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
