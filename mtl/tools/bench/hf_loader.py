"""``data.source: hf``: the training process's memory against the data set's size, and the loader's throughput
against a plain torch DataLoader doing the same reads:

    python -m mtl.tools.bench.hf_loader [--sizes 1000,100000] [--batches 200] [--workers 0,2]
                                        [--throughput-rows 4000] [--image 24] [--folder DIR] [--json out.json]

Memory: for each size, a DatasetDict of that many rows (a seeded ``--image`` px PNG, a ClassLabel, two captions) is
saved with ``save_to_disk`` (kept in ``--folder``), then a fresh process builds the run's data sets from it
(``build_datasets``, which checks every row and decodes every image once: ``data.hf.verify``) and reads ``--batches``
batches of 32 through the run's training loader (``build_train_loader``, random access by the shuffled sampler). It
reports its resident memory from /proc/self/status: ``RssAnon`` (the process's own memory: what would grow with the
rows if they were loaded) and ``RssFile`` (pages of the memory-mapped Arrow files the reads touched: the kernel's page
cache, shared and dropped under pressure, bounded by the files' size), after start-up, after building and after
reading, and ``VmHWM`` (the peak).

Throughput: over the same ``--throughput-rows`` rows and with the same number of workers, batches per second of the
run's training loader (its sampler, the classification task's collate, packed batches from the workers) against a
plain ``torch.utils.data.DataLoader`` (shuffle, default collate) over a data set that reads the same row and decodes
it the same way (``image_tensor``): the cost of mtl's loader machinery; the best of seven passes each, taken in
turn, and without workers the CPU time a batch costs (which the machine's other load does not change).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader

from mtl.config.schema import load_config
from mtl.data import build_datasets, build_train_loader, set_epoch
from mtl.data.hf_source import open_cell
from mtl.data.images import image_tensor
from mtl.setup.build import build_collate
from mtl.tools import tool_parser

BATCH = 32


def status() -> dict:
    """RssAnon, RssFile and VmHWM of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def make(path: str, rows: int, image: int) -> None:
    """A DatasetDict (train: ``rows``, validation: 64) of seeded PNGs, labels of 10 classes and two captions."""
    import io

    import datasets
    import numpy as np
    from PIL import Image

    def gen(n, offset):
        for i in range(n):
            buf = io.BytesIO()
            rng = np.random.default_rng(offset + i)
            Image.fromarray(rng.integers(0, 255, (image, image, 3), dtype=np.uint8)).save(buf, "PNG")
            yield {"image": {"bytes": buf.getvalue(), "path": None}, "label": i % 10,
                   "caption": [f"picture {i % 7}", f"class {i % 10}"]}

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10),
                                  "caption": datasets.List(datasets.Value("string"))})
    with tempfile.TemporaryDirectory() as cache:
        parts = {s: datasets.Dataset.from_generator(gen, features=features, cache_dir=cache,
                                                    gen_kwargs={"n": n, "offset": off})
                 for s, n, off in (("train", rows, 0), ("validation", 64, 10**7))}
        datasets.DatasetDict(parts).save_to_disk(path)


def run_config(path: str, extra: tuple = ()):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return load_config(os.path.join(root, "configs", "tiny.yaml"),
                       ["data.source=hf", f"data.hf.path={path}", "data.image_size=32", "tasks=[cls]", *extra])


def memory(folder: str, rows: int, image: int, batches: int, verify: bool) -> dict:
    """The data set of ``rows`` rows (made once in ``folder``), measured in a fresh process (``memory_child``)."""
    path = os.path.join(folder, f"rows{rows}")
    if not os.path.isdir(path):
        make(path, rows, image)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20
    out = subprocess.run([sys.executable, "-m", "mtl.tools.bench.hf_loader", "--child", path, "--batches",
                          str(batches), "--child-verify", str(verify).lower()], capture_output=True, text=True,
                         check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    m["files_mib"], m["verify"] = size, verify
    print(f"memory, {m['rows']:>7,} rows ({size:6.1f} MiB of Arrow files), data.hf.verify={str(verify).lower():<5}, "
          f"{m['batches']} batches read: RssAnon {m['start']['RssAnon']:.0f} -> {m['built']['RssAnon']:.0f} -> "
          f"{m['read']['RssAnon']:.0f} MiB, RssFile {m['start']['RssFile']:.0f} -> {m['built']['RssFile']:.0f} -> "
          f"{m['read']['RssFile']:.0f} MiB, peak VmHWM {m['read']['VmHWM']:.0f} MiB", flush=True)
    return m


def memory_child(path: str, batches: int, verify: str = "true") -> dict:
    """In a fresh process: memory after start-up, after building the data sets and after reading ``batches``."""
    torch.set_num_threads(1)
    out = {"start": status()}
    cfg = run_config(path, (f"data.hf.verify={verify}",))
    train, _ = build_datasets(cfg)
    out["built"] = status()
    loader = build_train_loader(train, build_collate(cfg, train.num_classes, train.class_names, None), BATCH, 0, 1, 0)
    n, epoch = 0, 0
    while n < batches:  # epochs on end where the data set holds fewer batches
        set_epoch(loader, epoch)
        for _ in loader:
            n += 1
            if n >= batches:
                break
        epoch += 1
    out["read"], out["batches"], out["rows"] = status(), n, len(train)
    return out


class Plain:
    """The plain reference: the same row read from the same table and decoded the same way, (image, label)."""

    def __init__(self, ds):
        self.table, self.cols, self.size = ds.table, ds.cols, ds.image_size

    def __len__(self):
        return len(self.table)

    def __getitem__(self, i):
        rec = self.table[int(i)]
        return image_tensor(open_cell(rec[self.cols.image], self.cols.image_kind), self.size), rec[self.cols.label]


def rates(loaders: list, passes: int = 5) -> list[tuple[float, float]]:
    """(batches per second, this process's CPU milliseconds per batch) of each loader: the best of ``passes``
    passes, the loaders' passes taken in turn (a machine's load then weighs on each alike). Without workers the CPU
    time is the whole work of a batch, and does not depend on what else the machine runs."""
    best = [(0.0, float("inf"))] * len(loaders)
    for epoch in range(passes):
        for k, loader in enumerate(loaders):
            set_epoch(loader, epoch)
            start, cpu, n = time.perf_counter(), time.process_time(), 0
            for _ in loader:
                n += 1
            wall, ms = n / (time.perf_counter() - start), (time.process_time() - cpu) / n * 1e3
            best[k] = (max(best[k][0], wall), min(best[k][1], ms))
    return best


def throughput(path: str, workers: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    cfg = run_config(path, ("data.hf.verify=false",))
    train, _ = build_datasets(cfg)
    collate = build_collate(cfg, train.num_classes, train.class_names, None)
    rows = []
    for w in workers:
        ours = build_train_loader(train, collate, BATCH, 0, 1, 0, num_workers=w)
        plain = DataLoader(Plain(train), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=w,
                           persistent_workers=w > 0, generator=torch.Generator().manual_seed(0))
        (r_ours, ms_ours), (r_plain, ms_plain) = rates([ours, plain], 7)
        rows.append({"workers": w, "rows": len(train), "hf_batches_per_s": r_ours, "plain_batches_per_s": r_plain,
                     "ratio": r_ours / r_plain, "hf_cpu_ms": ms_ours, "plain_cpu_ms": ms_plain,
                     "load_average": os.getloadavg()[0], "cpus": os.cpu_count()})
        cpu = (f"; CPU a batch, this process: {ms_ours:.1f} ms against {ms_plain:.1f} ms ({ms_plain / ms_ours:.2f}x)"
               if w == 0 else "")
        print(f"throughput, {len(train)} rows, workers {w}: hf loader {r_ours:6.1f} batches/s, plain DataLoader "
              f"{r_plain:6.1f} batches/s: {r_ours / r_plain:.2f}x{cpu} (load average {os.getloadavg()[0]:.1f}, "
              f"{os.cpu_count()} CPUs)", flush=True)
        del ours, plain
    return rows


def main(argv: list[str] | None = None) -> int:
    p = tool_parser("mtl.tools.bench.hf_loader", __doc__)
    p.add_argument("--sizes", default="1000,100000", help="training rows of each data set, comma-separated")
    p.add_argument("--batches", type=int, default=200, help="batches of 32 read in the memory measurement")
    p.add_argument("--workers", default="0,2", help="loader workers of the throughput measurement")
    p.add_argument("--throughput-rows", type=int, default=4000, help="rows of the throughput measurement")
    p.add_argument("--image", type=int, default=24, help="the images' side in pixels")
    p.add_argument("--folder", default=None, help="where the data sets are kept (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", default=None, help=argparse_hidden())
    p.add_argument("--child-verify", default="true", help=argparse_hidden())
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(memory_child(a.child, a.batches, a.child_verify)))
        return 0
    folder = a.folder or tempfile.mkdtemp(prefix="hf-bench-")
    results = {"memory": [], "throughput": []}
    for rows in [int(s) for s in a.sizes.split(",")]:
        for verify in (True, False):
            results["memory"].append(memory(folder, rows, a.image, a.batches, verify))
    tp = os.path.join(folder, f"rows{a.throughput_rows}")
    if not os.path.isdir(tp):
        make(tp, a.throughput_rows, a.image)
    results["throughput"] = throughput(tp, [int(w) for w in a.workers.split(",")])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
