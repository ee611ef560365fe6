"""Write your ImageFolder or JSONL manifest as WebDataset shards or as a Hugging Face dataset.

    python -m mtl.tools.shard --train PATH --val PATH [--test PATH] --to webdataset|hf --out DIR
                              [--shard-size N] [--image-root DIR] [--on-error raise|skip] [--no-check]

Each --train/--val/--test is a JSONL manifest (``{"image": ..., "label": ..., "caption"/"captions": ...}`` per line)
or an ImageFolder root (root/<class>/<image>, captions in root/captions.jsonl), read and checked exactly as training
reads them (every line, every image decoded; the val and test splits' labels against the training classes). Then:

- ``--to webdataset``: ``<out>/<split>-000000.tar`` ..., ``--shard-size`` samples a shard (webdataset.ShardWriter),
  each sample as open_clip and timm read them: the image file's own bytes under ``jpg``, ``png`` or ``webp`` (other
  formats re-encoded as ``png``), the class index under ``cls``, the first caption under ``txt`` and, where an image
  has more than one, the list of them under ``json``; and ``<out>/class_names.json``.
- ``--to hf``: a DatasetDict (train, validation, test) saved with ``save_to_disk`` in shards of at most
  ``--shard-size`` rows: ``image`` (an Image feature holding the file's bytes), ``label`` (a ClassLabel with the
  class names) and ``caption`` (a list of strings, where the source has captions): what ``data.source: hf`` reads.

A progress bar counts the samples written. After writing, every sample is read back through the library
(``webdataset.WebDataset``, ``datasets.load_from_disk``) and compared with its source (the image bytes, the label,
the captions) unless --no-check. Everything is written to a temporary folder beside --out and moved there at the end:
bad input (a bad line or image, an existing --out, a missing library) is one message, exit 2, and nothing written.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile

from mtl.errors import ConfigError, DataError
from mtl.tools import tool_parser

SPLITS = (("train", "train"), ("val", "validation"), ("test", "test"))  # (option, split name)
KEEP = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
EXTRA = "install the data extra (pip install -e '.[data]', or make install)"


def _library(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"--to: writing needs the {name} library, which is not installed; {EXTRA}") from None


def read_split(path: str, option: str, image_root: str | None, on_error: str, train=None):
    """A manifest (a file) or an ImageFolder (a folder), validated as training reads it; a problem is a ConfigError
    naming the option (exit 2)."""
    from mtl.data.manifest import ImageFolderCaptions, ManifestDataset  # import here: --help answers without torch

    classes = None if train is None else train.class_names
    try:
        if os.path.isdir(path):
            return ImageFolderCaptions(path, on_error=on_error, class_names=classes)
        return ManifestDataset(path, image_root, num_classes=None if train is None else train.num_classes,
                               on_error=on_error, class_names=classes)
    except DataError as e:
        raise ConfigError(f"{option}: {e.message.replace('data.on_error=skip', '--on-error skip')}") from None


def encoded(path: str) -> tuple[bytes, str]:
    """(the bytes to store, their extension): the file as it is where it is a JPEG, PNG or WebP, else re-encoded as a
    PNG (the picture the training reader would decode)."""
    from PIL import Image

    with open(path, "rb") as f:
        data = f.read()
    with Image.open(io.BytesIO(data)) as img:
        ext = KEEP.get(img.format or "")
        if ext is not None:
            return data, ext
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue(), "png"


def samples(ds):
    """(key, image bytes, extension, label, captions) of each record of ``ds``, in order."""
    for i, r in enumerate(ds.records):
        data, ext = encoded(r.image)
        yield f"{i:08d}", data, ext, int(r.label), list(r.captions)


def _bar(total: int, split: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"writing {split}", unit=" samples", file=sys.stderr, mininterval=0.5)


def write_webdataset(sets: dict, tmp: str, shard_size: int) -> dict:
    """Each split as ``<split>-%06d.tar`` shards of ``shard_size`` samples; {split: the shard files}."""
    wds = _library("webdataset")
    out = {}
    for split, ds in sets.items():
        with wds.ShardWriter(os.path.join(tmp, f"{split}-%06d.tar"), maxcount=shard_size, verbose=0) as sink, \
                _bar(len(ds), split) as bar:
            for key, data, ext, label, caps in samples(ds):
                sample = {"__key__": key, ext: data, "cls": label}
                if caps:
                    sample["txt"] = caps[0]
                if len(caps) > 1:
                    sample["json"] = caps
                sink.write(sample)
                bar.update(1)
        out[split] = sorted(f for f in os.listdir(tmp) if f.startswith(f"{split}-") and f.endswith(".tar"))
    return out


def _rows(ds, split: str, captions: bool):
    with _bar(len(ds), split) as bar:
        for key, data, ext, label, caps in samples(ds):
            row = {"image": {"bytes": data, "path": f"{key}.{ext}"}, "label": label}
            if captions:
                row["caption"] = caps
            yield row
            bar.update(1)


def write_hf(sets: dict, tmp: str, shard_size: int, class_names: list[str]) -> None:
    """A DatasetDict of the splits, saved in ``tmp`` in shards of at most ``shard_size`` rows."""
    datasets = _library("datasets")
    captions = all(s.all_captions() for s in sets.values())
    cols = {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(class_names))}
    if captions:
        cols["caption"] = datasets.List(datasets.Value("string"))
    features, cache = datasets.Features(cols), os.path.join(tmp, ".cache")
    parts = {}
    for split, ds in sets.items():
        parts[split] = datasets.Dataset.from_generator(
            _rows, features=features, cache_dir=cache, gen_kwargs={"ds": ds, "split": split, "captions": captions})
    dd = datasets.DatasetDict(parts)
    out = os.path.join(tmp, "hf")
    dd.save_to_disk(out, num_shards={s: max(1, -(-len(d) // shard_size)) for s, d in parts.items()})
    del dd, parts
    shutil.rmtree(cache, ignore_errors=True)
    for name in os.listdir(out):
        shutil.move(os.path.join(out, name), os.path.join(tmp, name))
    os.rmdir(out)


def verify_webdataset(sets: dict, folder: str, shards: dict) -> int:
    """Read every shard back (webdataset.WebDataset, in order) and compare each sample with its source."""
    wds = _library("webdataset")
    n = 0
    for split, ds in sets.items():
        urls = [os.path.join(folder, f) for f in shards[split]]
        got = {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False)}
        for key, data, ext, label, caps in samples(ds):
            s = got.pop(key, None)
            back = None if s is None else (s.get(ext), int(s["cls"]),
                                           json.loads(s["json"]) if "json" in s else
                                           [s["txt"].decode("utf-8")] if "txt" in s else [])
            _same(split, key, back, (data, label, caps))
            n += 1
        if got:
            raise DataError(f"round-trip check: {split} shards hold {len(got)} sample(s) that the source has not")
    return n


def verify_hf(sets: dict, folder: str) -> int:
    """Read the saved DatasetDict back (datasets.load_from_disk) and compare each row with its source."""
    datasets = _library("datasets")
    dd = datasets.load_from_disk(folder)
    n = 0
    for split, ds in sets.items():
        table = dd[split].cast_column("image", datasets.Image(decode=False))
        if len(table) != len(ds):
            raise DataError(f"round-trip check: split {split} has {len(table)} rows, the source {len(ds)}")
        for i, (key, data, _, label, caps) in enumerate(samples(ds)):
            row = table[i]
            _same(split, key, (row["image"]["bytes"], int(row["label"]), list(row.get("caption") or [])),
                  (data, label, caps))
            n += 1
    return n


def _same(split: str, key: str, back, source) -> None:
    if back is None:
        raise DataError(f"round-trip check: sample {key} of {split} was not read back")
    for what, a, b in zip(("image bytes", "label", "captions"), back, source):
        if a != b:
            raise DataError(f"round-trip check: sample {key} of {split}: its {what} read back differ from the source")


def _prepare(args) -> tuple[dict, str]:
    """The splits, read and checked, and the temporary folder beside --out; a problem: ConfigError, nothing written."""
    if args.shard_size < 1:
        raise ConfigError(f"--shard-size: must be at least 1 (got {args.shard_size})")
    if os.path.lexists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(f"--out: {args.out!r} exists and is not an empty folder; name a new folder")
    _library("webdataset" if args.to == "webdataset" else "datasets")
    sets, train = {}, None
    for option, split in SPLITS:
        path = getattr(args, option)
        if path is None:
            continue
        if not os.path.exists(path):
            raise ConfigError(f"--{option}: {path!r} not found — give a manifest .jsonl file or an ImageFolder root")
        sets[split] = read_split(path, f"--{option}", args.image_root, args.on_error, train)
        train = train or sets[split]
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    return sets, tempfile.mkdtemp(prefix=".shard-", dir=parent)


def convert(args) -> str:
    sets, tmp = _prepare(args)
    try:
        names = sets["train"].class_names
        if args.to == "webdataset":
            shards = write_webdataset(sets, tmp, args.shard_size)
            with open(os.path.join(tmp, "class_names.json"), "w", encoding="utf-8") as f:
                json.dump(names, f)
            checked = 0 if args.no_check else verify_webdataset(sets, tmp, shards)
            what = ", ".join(f"{s}: {len(v)} shard(s)" for s, v in shards.items())
        else:
            write_hf(sets, tmp, args.shard_size, names)
            checked = 0 if args.no_check else verify_hf(sets, tmp)
            what = ", ".join(f"{s}: {len(d)} rows" for s, d in sets.items())
        if os.path.isdir(args.out):
            os.rmdir(args.out)  # an empty folder (checked before)
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    skipped = sum(d.skipped for d in sets.values())
    note = f"; read back and compared: {checked} samples" if checked else ""
    return f"wrote {args.out} ({args.to}; {what}; {len(names)} classes; {skipped} bad line(s) skipped{note})"


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("mtl.tools.shard", __doc__)
    parser.add_argument("--train", required=True, help="the training split: a manifest .jsonl or an ImageFolder root")
    parser.add_argument("--val", help="the validation split (its labels checked against the training classes)")
    parser.add_argument("--test", help="a test split")
    parser.add_argument("--to", required=True, choices=("webdataset", "hf"), help="what to write")
    parser.add_argument("--out", required=True, help="the folder to create (new, or empty)")
    parser.add_argument("--shard-size", type=int, default=10_000, help="samples (rows) a shard (default 10000)")
    parser.add_argument("--image-root", help="a manifest's base for relative image paths (default: its folder)")
    parser.add_argument("--on-error", default="raise", choices=("raise", "skip"),
                        help="a bad line or image: stop (raise) or leave it out and count it (skip)")
    parser.add_argument("--no-check", action="store_true", help="do not read the output back to compare it")
    args = parser.parse_args(argv)

    from mtl.run.error_report import run_guarded  # import here: --help answers without torch

    return run_guarded(lambda: print(convert(args), flush=True))


if __name__ == "__main__":
    sys.exit(main())
