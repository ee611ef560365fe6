"""User data: a JSONL manifest, or an ImageFolder tree with a captions file.

Both formats are read by one validator (``read_caption_lines``) that checks *every* line and
*every* image (fully decoded) before training starts: a bad file found at step 40 000 on one
rank would kill a multi-GPU job hours in; found here it costs seconds and the message says which
file, which line and how to fix it. With ``on_error="skip"`` bad lines are dropped and counted
instead, so one corrupt JPEG in a scraped set does not block a run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image
from torch.utils.data import Dataset

from mtl.data.images import PIL_ERRORS as _PIL_ERRORS
from mtl.data.images import Augment, load_image, shape_problem
from mtl.errors import DataError

ON_ERROR = ("raise", "skip")
# keys of a line that the readers interpret; every other key of a line reaches the tasks as a record field
RESERVED = ("image", "label", "caption", "captions", "index")
BASE_FIELDS = frozenset({"image", "index", "label", "captions"})


@dataclass
class Record:
    """One validated line: an absolute image path, its label and its captions (never empty)."""

    image: str
    label: int  # the class index
    captions: list[str]
    line: int
    extra: dict = field(default_factory=dict)  # the line's other keys, passed on to the tasks as record fields


class LineError(Exception):
    """A problem with one line; ``read_caption_lines`` adds the file and line number."""

    def __init__(self, message: str, fix: str = "fix the line"):
        super().__init__(message)
        self.fix = fix


# A label function gets the parsed line and its (relative) image path and returns the label,
# raising LineError when it cannot.
LabelFn = Callable[[dict, str], int]


def _captions_of(obj: dict) -> list[str]:
    if "captions" in obj:
        caps = obj["captions"]
        if not isinstance(caps, list) or not caps:
            raise LineError("'captions' must be a non-empty list of strings")
    elif "caption" in obj:
        caps = [obj["caption"]]
    else:
        raise LineError("no 'caption' (a string) or 'captions' (a list of strings)")
    out = []
    for c in caps:
        if not isinstance(c, str):
            raise LineError(f"caption {c!r} is not a string")
        if not c.strip():
            raise LineError("empty caption")
        out.append(c.strip())
    return out


def _verify_image(path: str, rel: str, root: str) -> None:
    if not os.path.isfile(path):
        raise LineError(f"image {rel!r} not found under {root!r}", fix="fix the path")
    problem = None
    try:
        with Image.open(path) as img:
            problem = shape_problem(*img.size)  # from the header: a 1 x 1,000,000 strip is not decoded
            if problem is None:
                img.load()  # decode every pixel: a truncated file only fails here
    except _PIL_ERRORS as e:
        raise LineError(f"image {rel!r} ({path}) cannot be decoded: {e}", fix="replace the file") from None
    if problem is not None:
        raise LineError(f"image {rel!r} ({path}) {problem}", fix="crop it to a less elongated shape")


def _parse_line(text: str, number: int, image_root: str, label_fn: LabelFn) -> Record:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    rel = obj.get("image")
    if not isinstance(rel, str) or not rel.strip():
        raise LineError("no 'image' key (the image path, a string)")
    captions = _captions_of(obj)
    label = label_fn(obj, rel)
    path = rel if os.path.isabs(rel) else os.path.join(image_root, rel)
    _verify_image(path, rel, image_root)
    extra = {k: v for k, v in obj.items() if k not in RESERVED}
    return Record(image=path, label=label, captions=captions, line=number, extra=extra)


def read_caption_lines(
    path: str, image_root: str, label_fn: LabelFn, on_error: str, kind: str = "manifest"
) -> tuple[list[Record], list[str]]:
    """Validate every line of the JSONL file ``path``; return (good records, skip reasons).

    Blank lines are ignored. With ``on_error="raise"`` the first bad line raises DataError; with
    ``"skip"`` bad lines are left out and their reasons returned. No good line at all is always an
    error, since there would be nothing to train on.
    """
    if on_error not in ON_ERROR:
        raise DataError(f"data.on_error={on_error!r}: must be one of {', '.join(ON_ERROR)}")
    if os.path.isdir(path):
        fix = ("for an ImageFolder tree (root/<class>/<image>, captions in root/captions.jsonl) set "
               "data.source=imagefolder; for a manifest, give its .jsonl file" if kind == "manifest"
               else "give the .jsonl file itself")
        raise DataError(f"{kind} {path!r} is a folder, not a JSONL file — {fix}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise DataError(f"{kind} {path!r} is not a regular file — set the data path to a .jsonl file")
    if not os.path.isfile(path):
        raise DataError(f"{kind} {path!r} not found — set the data path to an existing .jsonl file")
    image_root = os.path.abspath(image_root)
    records, reasons = [], []
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()  # bytes: one undecodable line must not sink the whole file
    except OSError as e:
        raise DataError(f"{kind} {path!r} cannot be read: {e.strerror}") from None
    first = True
    for number, raw in enumerate(lines, start=1):
        try:
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise LineError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                                fix="save the file as UTF-8") from None
            if not text.strip():
                continue
            header, first = first and kind == "manifest", False
            if header and classes_line(text, path, number) is not None:
                continue
            records.append(_parse_line(text, number, image_root, label_fn))
        except LineError as e:
            where = f"{kind} {path} line {number}: {e}"
            if on_error == "raise":
                raise DataError(f"{where} — {e.fix} or set data.on_error=skip") from None
            reasons.append(where)
    if not records:
        detail = f"; first problems: {'; '.join(reasons[:3])}" if reasons else ""
        raise DataError(f"{kind} {path!r} has no usable lines ({len(reasons)} bad){detail}")
    return records, reasons


class CaptionedImages(Dataset):
    """Validated records served as items; what the manifest and ImageFolder sets have in common.

    Which caption comes first is ``captions[(epoch + index) % n]``: a pure function of epoch and
    index, so a resumed run trains on exactly the captions the original run would have used.
    """

    def __init__(self, records: list[Record], reasons: list[str], image_size: int, source: str,
                 augment: Augment | None = None):
        self.records = records
        self.augment = augment  # training augmentation (random crop, flip); None: the centre crop
        self.image_transform = None  # the model's own image transform (mtl.data.images.prepare_images); None: mtl's
        self.skipped = len(reasons)
        self.skip_reasons = reasons
        self.image_size = int(image_size)
        self.source = source
        self.epoch = 0
        self.class_names: list[str] = []
        self.num_classes = 0
        # the record fields every item has: the base ones, and the extra keys that every line has
        shared = set(records[0].extra) if records else set()
        for r in records[1:]:
            shared &= set(r.extra)
        self.provides = BASE_FIELDS | frozenset(shared)
        if not all(r.captions for r in records):
            self.provides -= {"captions"}

    def how_to_provide(self, field: str) -> str:
        return f"add a {field!r} key to every line of {self.source}"

    def labels_present(self, enough: int | None = None) -> set[int]:
        """The labels the records have: the classes a training split can teach (``num_classes`` may count more:
        an empty class folder, ``data.num_classes``)."""
        return {r.label for r in self.records}

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def all_captions(self) -> list[str]:
        return [c for r in self.records for c in r.captions]

    def __getitem__(self, key) -> dict:
        # the train sampler passes (index, epoch) so the choice survives persistent workers
        index, epoch = key if isinstance(key, tuple) else (key, self.epoch)
        index = int(index)
        rec = self.records[index]
        where = f" ({self.source} line {rec.line})" if rec.line else f" ({self.source})"
        caps = rec.captions
        first = (int(epoch) + index) % max(1, len(caps))
        item = {
            **rec.extra,
            "image": load_image(rec.image, self.image_size, where, self.augment, (index, int(epoch)), self.image_transform),
            "label": rec.label,
            "index": index,
        }
        if caps:  # an ImageFolder without a captions file has none
            item["captions"] = [caps[first]] + caps[:first] + caps[first + 1 :]
        return item


def _raw_label(obj: dict) -> int | str:
    """A line's label as it is written: an integer class index, or a class name."""
    label = obj.get("label")
    if label is None:
        raise LineError("no 'label' (a class name, or an integer class index)")
    if isinstance(label, str):
        if not label.strip():
            raise LineError("empty label")
        return label
    if isinstance(label, bool) or not isinstance(label, int):
        raise LineError(f"label {label!r} is not an integer class index or a class name (a string)")
    if label < 0:
        raise LineError(f"label {label} is negative")
    return label


def classes_line(text: str, path: str, number: int) -> list[str] | None:
    """The class list of a manifest's first line ``{"classes": ["cat", "dog", ...]}``, or None when ``text`` is not
    one (a line with no ``image`` key and a ``classes`` key). A malformed one is a DataError: it names every class."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "classes" not in obj or "image" in obj:
        return None
    names = obj["classes"]
    where = f"manifest {path} line {number}: the classes line"
    fix = 'write it as {"classes": ["<name>", ...]}, a list of class names, the class index their position'
    if set(obj) != {"classes"}:
        raise DataError(f"{where} has other keys ({', '.join(sorted(set(obj) - {'classes'}))}) — {fix}")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise DataError(f"{where} is not a non-empty list of class names — {fix}")
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise DataError(f"{where} lists {twice!r} twice — name each class once")
    return names


def manifest_classes(path: str) -> list[str] | None:
    """The class list of the manifest ``path``'s first line, if it is a classes line (``classes_line``); None when it
    is not, or the file cannot be read (``read_caption_lines`` says why)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            return None
        if text.strip():
            return classes_line(text, path, number)
    return None


class ManifestDataset(CaptionedImages):
    """A JSONL manifest: ``{"image": "a/b.jpg", "label": "cat", "caption": "..."}`` per line
    (or ``"captions": [...]``). Relative paths resolve against ``image_root`` (default: the
    manifest's folder).

    A label is a class name or an integer class index, one kind in a file. The class list:
    - ``class_names`` given (a val or test split): the training split's; a name it lacks is refused by name;
    - else a first line ``{"classes": ["cat", "dog", ...]}``: that list, in its order (a class may have no image);
    - else, class names: the sorted names;
    - else, integers: ``num_classes`` None: the classes are 0..K-1 where every one of them has an image, named
      "0".."K-1". A label beyond a class with no image at all (labels 0..3 and one 7) is a typo, not four new
      classes: it is reported with its line (or skipped with ``on_error="skip"``); set ``num_classes`` when some
      classes really have no training image.
    """

    def __init__(
        self,
        path: str,
        image_root: str | None = None,
        image_size: int = 64,
        num_classes: int | None = None,
        on_error: str = "raise",
        augment: Augment | None = None,
        class_names: list[str] | None = None,
    ):
        names = _class_list(path, class_names, num_classes)
        index = {n: i for i, n in enumerate(names or ())}
        kinds: set[type] = set()

        def label_fn(obj: dict, rel: str) -> int | str:
            label = _raw_label(obj)
            kind = str if isinstance(label, str) else int
            if kinds and kind not in kinds:
                raise LineError(f"label {label!r} is {'a class name' if kind is str else 'an integer'}, but the "
                                f"labels before it are {'integers' if kind is str else 'class names'}: use one kind in a "
                                "manifest (class names, or integer class indices)", fix="fix the label")
            kinds.add(kind)
            if kind is int:
                limit = len(names) if names is not None else num_classes
                if limit is not None and label >= limit:
                    said = f"num_classes={limit}" if names is None else f"{limit} classes: {', '.join(names)}"
                    raise LineError(f"label {label} is outside [0, {limit}) ({said})")
                return label
            if names is None:
                return label  # named once every line is read (the sorted names)
            if label not in index:
                if class_names is not None:  # a split checked against the training classes
                    raise DataError(untrained_class(f"manifest {path}", [label], names, ("its lines", "their lines")))
                raise LineError(f"label {label!r} is not in the classes line ({', '.join(names)})",
                                fix="add it to the classes line or fix the label")
            return index[label]

        root = image_root if image_root is not None else os.path.dirname(os.path.abspath(path))
        records, reasons = read_caption_lines(path, root, label_fn, on_error)
        if names is None and str in kinds:
            names = _sorted_names(records, path, num_classes)
        elif names is None and num_classes is None:
            records, reasons = _drop_stray_labels(records, reasons, path, on_error)
        super().__init__(records, reasons, image_size, f"manifest {path}", augment)
        self.path = path
        if names is not None:
            self.num_classes, self.class_names = len(names), list(names)
        else:
            self.num_classes = num_classes if num_classes is not None else max(r.label for r in records) + 1
            self.class_names = [str(i) for i in range(self.num_classes)]


def _class_list(path: str, class_names: list[str] | None, num_classes: int | None) -> list[str] | None:
    """A manifest's class list before its lines are read: the training split's (``class_names``; a classes line
    must then say the same), else its classes line's; None: its labels decide."""
    own = manifest_classes(path)
    if class_names is not None:
        if own is not None and own != list(class_names):
            raise DataError(f"manifest {path!r}: its classes line ({', '.join(own)}) is not the training set's class "
                            f"list ({', '.join(class_names)}) — make the two lines the same, or remove this one")
        return list(class_names)
    if own is not None and num_classes is not None and num_classes != len(own):
        raise DataError(f"manifest {path!r}: data.num_classes={num_classes} but its classes line lists {len(own)} "
                        "classes — remove data.num_classes")
    return own


def _sorted_names(records: list[Record], path: str, num_classes: int | None) -> list[str]:
    """The classes of a manifest labelled by name without a classes line: the sorted names; each record's label
    becomes its name's index."""
    names = sorted({r.label for r in records})
    if num_classes is not None and num_classes != len(names):
        raise DataError(f"manifest {path!r}: data.num_classes={num_classes} but its labels name {len(names)} classes "
                        f"({', '.join(names)}) — remove data.num_classes, or list every class in a first line "
                        '{"classes": [...]}')
    index = {n: i for i, n in enumerate(names)}
    for r in records:
        r.label = index[r.label]
    return names


def _drop_stray_labels(records: list[Record], reasons: list[str], path: str, on_error: str):
    """The classes are 0..K-1, K the first label no line has; lines with a larger label are errors."""
    present = {r.label for r in records}
    k = next(i for i in range(len(present) + 1) if i not in present)
    stray = [r for r in records if r.label > k]
    if not stray:
        return records, reasons
    if k == 0:
        raise DataError(f"manifest {path!r}: no line has label 0 (the lowest is {min(present)}); labels are class "
                        "indices counted from 0 — renumber them, or set data.num_classes to include the unused ones")
    for r in stray:
        where = (f"manifest {path} line {r.line}: label {r.label} is outside the class list 0..{k - 1} (no image "
                 f"has label {k}, so {r.label} looks like a typo)")
        if on_error == "raise":
            raise DataError(f"{where} — fix the label, set data.num_classes={r.label + 1} if classes "
                            f"{k}..{r.label - 1} really have no training image, or set data.on_error=skip")
        reasons.append(where)
    kept = [r for r in records if r.label < k]
    if not kept:
        raise DataError(f"manifest {path!r} has no usable lines ({len(reasons)} bad); first problems: "
                        + "; ".join(reasons[:3]))
    return kept, reasons


class ImageFolderCaptions(CaptionedImages):
    """The torchvision ImageFolder layout ``root/<class>/<image>`` plus a captions JSONL file
    (default ``root/captions.jsonl``) with ``{"image": "<class>/<file>", "caption": ...}`` lines.

    The label is the index of the class folder among the sorted folder names (or among
    ``class_names`` when given, so a val split uses the train split's classes). With a captions file,
    only the images it lists are used (other keys of its lines reach the tasks as record fields).
    Without one (no ``captions_file`` given and no ``root/captions.jsonl``), every image file under the
    class folders is used and the items have no ``captions``: fine for classification, and a task that
    requires captions is refused before training with the fix.
    """

    def __init__(
        self,
        root: str,
        captions_file: str | None = None,
        image_size: int = 64,
        on_error: str = "raise",
        class_names: list[str] | None = None,
        augment: Augment | None = None,
    ):
        if not os.path.isdir(root):
            raise DataError(f"image folder {root!r} not found — set the data path to an existing folder")
        folders = sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name[0] != ".")
        if class_names is None:
            class_names = folders
            if not class_names:
                raise DataError(f"image folder {root!r} has no class folders (expected root/<class>/<image>)")
        index = {name: i for i, name in enumerate(class_names)}

        def label_fn(obj: dict, rel: str) -> int:
            parts = rel.replace("\\", "/").split("/")
            if len(parts) >= 2 and parts[0] in folders and parts[0] not in index:
                raise DataError(untrained_class(f"image folder {root}", [parts[0]], class_names))
            if len(parts) < 2 or parts[0] not in index:
                raise LineError(
                    f"image {rel!r} is not inside a class folder of {root!r} "
                    f"(classes: {', '.join(class_names)})",
                    fix="move the image into a class folder",
                )
            return index[parts[0]]

        default = os.path.join(root, "captions.jsonl")
        if captions_file is None and not os.path.isfile(default):
            extra = [f for f in folders if f not in index and _has_images(os.path.join(root, f))]
            if extra:
                raise DataError(untrained_class(f"image folder {root}", extra, class_names))
            records, reasons = _scan_class_folders(root, class_names, on_error)
            source = f"image folder {root} (no captions.jsonl)"
        else:
            captions_file = captions_file or default
            records, reasons = read_caption_lines(captions_file, root, label_fn, on_error, kind="captions file")
            source = f"captions file {captions_file}"
        super().__init__(records, reasons, image_size, source, augment)
        self.root = root
        self.captions_file = captions_file
        self.class_names = list(class_names)
        self.num_classes = len(class_names)

    def how_to_provide(self, field: str) -> str:
        if self.captions_file is None:
            return (f"add {os.path.join(self.root, 'captions.jsonl')} with one line per image, "
                    f'{{"image": "<class>/<file>", "caption": "..."{", " + repr(field) + ": ..." if field != "captions" else ""}}}'
                    "; or, if your captions are of other images, give each task its own data set in multi-input "
                    "mode (data.per_task; configs/multi_input_user_data.yaml, docs/multi-input.md)")
        return super().how_to_provide(field)


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def untrained_class(where: str, names: list[str], class_names: list[str],
                    remove: tuple[str, str] = ("its folder", "their folders")) -> str:
    """The message for classes of a split checked against the training classes (a validation or test set) that the
    training set does not have: not bad images or lines to skip, since skipping them drops the class from the
    scores."""
    one = len(names) == 1
    shown = ", ".join(map(repr, names))
    return (f"{where}: {'class' if one else 'classes'} {shown} {'has' if one else 'have'} no training images (the "
            f"training set's classes: {', '.join(class_names)}) — add training images of {shown}, or remove "
            f"{remove[0] if one else remove[1]} from this set")


def _has_images(folder: str) -> bool:
    return any(f.lower().endswith(IMAGE_EXTENSIONS) for _, _, files in os.walk(folder) for f in files)


def _scan_class_folders(root: str, class_names: list[str], on_error: str) -> tuple[list[Record], list[str]]:
    """Every image file under ``root/<class>/`` (sorted), each fully decoded once, with no captions."""
    records, reasons = [], []
    for label, name in enumerate(class_names):
        for dirpath, dirs, files in os.walk(os.path.join(root, name)):
            dirs.sort()
            for f in sorted(files):
                if not f.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                path = os.path.join(dirpath, f)
                try:
                    _verify_image(path, os.path.relpath(path, root), root)
                except LineError as e:
                    if on_error == "raise":
                        raise DataError(f"image folder {root}: {e} — {e.fix} or set data.on_error=skip") from None
                    reasons.append(f"image folder {root}: {e}")
                    continue
                records.append(Record(image=os.path.abspath(path), label=label, captions=[], line=0))
    if not records:
        raise DataError(f"image folder {root!r} has no images in its class folders ({', '.join(IMAGE_EXTENSIONS)})")
    return records, reasons
