"""Loader throughput of ``data.source: webdataset`` (docs/data.md), on N small JPEGs written here:

    python scripts/bench_webdataset.py [--images 10000] [--size 48] [--shards 20] [--workers 2] [--batch 64]
                                       [--image-size 32] [--repeat 3] [--dir DIR]

Three loaders over the same images, each with ``--workers`` workers and batch ``--batch``, decoded by the same
function (``mtl.data.images.load_image``: RGB, resize/centre-crop to ``--image-size``, float in [0, 1]):

- ``webdataset source``: mtl's training loader over the shards (``build_train_loader``: the node/worker split, the
  seeded shuffle buffer, the records mtl's tasks read);
- ``plain DataLoader``: a ``torch.utils.data.DataLoader`` over webdataset's own minimal pipeline on the same shards
  (``SimpleShardList`` -> ``split_by_worker`` -> ``tarfile_to_samples`` -> decode), default collate: the baseline;
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtl.config.keys import Config  # noqa: E402
from mtl.data.images import load_image  # noqa: E402
from mtl.data.loader import build_datasets, build_train_loader, start_at  # noqa: E402

CLASSES = ["a", "b", "c", "d"]


def write_data(folder: str, n: int, size: int, shards: int) -> tuple[str, str]:
    """n JPEGs as an ImageFolder (folder/images/<class>/<i>.jpg, with captions.jsonl) and as shards; returns
    (the ImageFolder root, the shards' brace pattern)."""
    import json

    import webdataset as wds

    root, rng = os.path.join(folder, "images"), np.random.default_rng(0)
    for c in CLASSES:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    per = -(-n // shards)
    sinks = [wds.TarWriter(os.path.join(folder, f"train-{k:06d}.tar")) for k in range(shards)]
    captions = open(os.path.join(root, "captions.jsonl"), "w")
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
        c = i % len(CLASSES)
        rel = f"{CLASSES[c]}/{i:06d}.jpg"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(buf.getvalue())
        captions.write(json.dumps({"image": rel, "caption": f"image {CLASSES[c]}"}) + "\n")
        sinks[i // per].write({"__key__": f"{i:06d}", "jpg": buf.getvalue(), "cls": str(c), "txt": f"image {CLASSES[c]}"})
    captions.close()
    for s in sinks:
        s.close()
    with open(os.path.join(folder, "class_names.json"), "w") as f:
        json.dump(CLASSES, f)
    return root, os.path.join(folder, f"train-{{000000..{shards - 1:06d}}}.tar")


def stack(records: list[dict]) -> dict:
    return {"image": torch.stack([r["image"] for r in records]), "index": torch.tensor([r["index"] for r in records])}


class PlainDecode:
    """webdataset's minimal pipeline's decode stage: the same function mtl decodes with."""

    def __init__(self, image_size: int):
        self.image_size = image_size

    def __call__(self, sample: dict) -> dict:
        return {"image": load_image(io.BytesIO(sample["jpg"]), self.image_size), "index": int(sample["__key__"])}


def plain_loader(pattern: str, args) -> torch.utils.data.DataLoader:
    import webdataset as wds

    urls = list(wds.shardlists.expand_urls(pattern))
    pipe = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples(),
                            wds.map(PlainDecode(args.image_size)))
    return torch.utils.data.DataLoader(pipe, batch_size=args.batch, num_workers=args.workers,
                                       persistent_workers=args.workers > 0)


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
    folder = args.dir or tempfile.mkdtemp(prefix="bench_wds_")
    root, pattern = write_data(folder, args.images, args.size, args.shards)
    cfg = OmegaConf.structured(Config)
    cfg.data.image_size = args.image_size
    cfg.data.source, cfg.data.webdataset.train_shards, cfg.data.webdataset.val_shards = "webdataset", pattern, pattern
    wds_loader, scan = mtl_loader(cfg, args)
    folder_cfg = OmegaConf.structured(Config)
    folder_cfg.data.image_size = args.image_size
    folder_cfg.data.source, folder_cfg.data.train_path, folder_cfg.data.val_path = "imagefolder", root, root
    folder_loader, folder_scan = mtl_loader(folder_cfg, args)
    timed = interleaved([(plain_loader(pattern, args), False), (wds_loader, True), (folder_loader, True)],
                        args.repeat)
    names = ("plain DataLoader (webdataset pipeline)", "webdataset source", "imagefolder source (a file per image)")
    rows = [(name, rate, count, start) for name, (rate, count), start in zip(names, timed, (0.0, scan, folder_scan))]
    base = rows[0][1]
    print(f"{args.images} JPEGs of {args.size}x{args.size} px, {args.shards} shards, {args.workers} workers, batch "
          f"{args.batch}, decoded to {args.image_size}x{args.image_size}; median of {args.repeat} interleaved epochs\n")
    print("| loader | images/s | vs plain | images an epoch | start-up scan (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, rate, count, start in rows:
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}x | {count:,} | {start:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
