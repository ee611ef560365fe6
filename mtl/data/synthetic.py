"""The built-in data set: procedurally drawn shapes with captions, no files and no download.

Why it looks like this: the two tasks must need *different* information from the same image, so
that multi-task training is a real test. The class label is the shape kind only; the caption
describes everything the label does not decide (count, size, colour, position) and never names
the shape. A model that solves one task has therefore not solved the other.

Every item is drawn on the fly from ``(seed, index)`` alone, so any process (any DDP rank, any
data-loader worker, a resumed run) sees bit-identical samples without sharing state, and train and
val splits are simply two seeds.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from mtl.errors import ConfigError

# The label is an index into SHAPES; ``num_classes`` takes the first N. The order puts the most
# distinct silhouettes first, so the default (4) stays easy at 32 px.
SHAPES = ["circle", "square", "triangle", "cross", "ring", "diamond", "star"]
MEMO_BYTES = 256 << 20  # the rendered images a SyntheticShapes keeps per process (a 1,000-image set at 32 x 32: 12 MiB)
MIN_CLASSES = 2  # one class would leave nothing to classify


def num_classes_problem(num_classes: int) -> str | None:
    """Why ``data.synthetic.num_classes`` is unusable, or None. The one place that knows the range:
    ``mtl.setup.checks`` (the launcher's up-front check) asks this too."""
    if not MIN_CLASSES <= num_classes <= len(SHAPES):
        return (f"data.synthetic.num_classes={num_classes}: must be in {MIN_CLASSES}..{len(SHAPES)}, "
                f"the number of shape kinds ({', '.join(SHAPES)})")
    return None

COLOURS = {
    "red": (0.90, 0.15, 0.15),
    "green": (0.15, 0.80, 0.20),
    "blue": (0.20, 0.35, 0.95),
    "yellow": (0.95, 0.90, 0.20),
    "purple": (0.65, 0.25, 0.85),
    "orange": (1.00, 0.55, 0.10),
}
COLOUR_NAMES = list(COLOURS)
_COLOUR_RGB = np.array([COLOURS[c] for c in COLOUR_NAMES], dtype=np.float32)

SIZES = ["small", "large"]

_COORDS = np.arange(4096, dtype=np.float32) + np.float32(0.5)  # pixel centres, sliced by _stamp

# Anchor of the group's centre, as a fraction of the image side (x, y).
POSITIONS = {
    "top left": (0.25, 0.25),
    "top right": (0.75, 0.25),
    "bottom left": (0.25, 0.75),
    "bottom right": (0.75, 0.75),
    "centre": (0.50, 0.50),
}
POSITION_NAMES = list(POSITIONS)

COUNT_WORDS = ["zero", "one", "two", "three", "four", "five", "six"]
MAX_COUNT = len(COUNT_WORDS) - 1  # the most there are words for; max_count_for(size) is the real limit


# Every shape lies within EXTENT * r of its centre (the square's corners reach 1.13 r): layout and
# clipping use this, so that shapes never touch.
EXTENT = 1.15
# A group's bounding box spans at most this fraction of the image side, so that even the largest
# group stays clearly on its side of both midlines (or clearly centred): the position caption is true.
GROUP_SPAN = 0.7


def shape_radius(size: str, image_size: int) -> float:
    """Outer radius in pixels. The floor keeps small shapes recognisable at 32 px."""
    if size == "small":
        return max(0.055 * image_size, 2.5)
    return max(0.09 * image_size, 4.0)


def caption_text(count: int, size: str, colour: str, position: str) -> str:
    """The caption is a pure function of these four attributes (and never names the shape)."""
    noun = "object" if count == 1 else "objects"
    return f"{COUNT_WORDS[count]} {size} {colour} {noun} in the {position}"


# ---------------------------------------------------------------------------------------------
# drawing: each shape is an approximate signed distance (pixels, < 0 inside) so that a one-pixel
# soft edge gives cheap anti-aliasing; this keeps small shapes distinguishable.


def _sdf(kind: str, x: np.ndarray, y: np.ndarray, r: float) -> np.ndarray:
    if kind == "circle":
        return np.hypot(x, y) - 0.95 * r
    if kind == "square":
        return np.maximum(np.abs(x), np.abs(y)) - 0.8 * r
    if kind == "triangle":  # equilateral, apex up, circumradius r, centred on its centroid
        s3 = math.sqrt(3) / 2
        d = np.maximum(y, np.maximum(-0.5 * y + s3 * x, -0.5 * y - s3 * x))
        return d - 0.5 * r * 1.1
    if kind == "cross":
        w = max(0.3 * r, 0.75)
        ax, ay = np.abs(x), np.abs(y)
        return np.minimum(np.maximum(ax - r, ay - w), np.maximum(ax - w, ay - r))
    if kind == "ring":
        w = max(0.22 * r, 0.6)
        return np.abs(np.hypot(x, y) - (r - w)) - w
    if kind == "diamond":
        return (np.abs(x) + np.abs(y) - r) / math.sqrt(2)
    if kind == "star":  # five points; the boundary radius is a triangle wave in the angle
        theta = np.arctan2(x, -y)  # 0 points up
        phase = np.abs(((theta * 5 / (2 * math.pi)) % 1.0) - 0.5) * 2  # 1 at a point, 0 between
        return (np.hypot(x, y) - r * (0.45 + 0.55 * phase)) * 0.7
    raise ValueError(f"unknown shape {kind!r}")


def _stamp(img: np.ndarray, kind: str, cx: float, cy: float, r: float, rgb: np.ndarray) -> None:
    """Blend one shape into ``img`` (3, H, W), touching only its bounding box."""
    h, w = img.shape[1:]
    e = EXTENT * r + 2
    x0, x1 = max(int(cx - e), 0), min(int(cx + e) + 1, w)
    y0, y1 = max(int(cy - e), 0), min(int(cy + e) + 1, h)
    if x0 >= x1 or y0 >= y1:
        return
    ys = _COORDS[y0:y1, None] - np.float32(cy)
    xs = _COORDS[None, x0:x1] - np.float32(cx)
    alpha = 0.5 - _sdf(kind, xs, ys, r)
    np.clip(alpha, 0.0, 1.0, out=alpha)
    patch = img[:, y0:y1, x0:x1]
    patch += alpha * (rgb[:, None, None] - patch)


def _dot(img: np.ndarray, cx: float, cy: float, side: int, rgb: np.ndarray) -> None:
    """A tiny hard-edged square: clutter, far smaller than any shape, and cheap."""
    x0, y0 = int(cx), int(cy)
    img[:, y0 : y0 + side, x0 : x0 + side] = rgb[:, None, None]


def _spacing(r: float, image_size: int) -> float:
    """Minimum distance between two shape centres: their extents plus a visible gap."""
    return 2 * EXTENT * r + max(1.5, 0.03 * image_size)


def _grid(n: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(n))
    return cols, math.ceil(n / cols)


def max_count_for(image_size: int) -> int:
    """The most large shapes that fit, on a grid and without touching, in a group of GROUP_SPAN."""
    r = shape_radius("large", image_size)
    usable = GROUP_SPAN * image_size - 2 * EXTENT * r
    spacing = _spacing(r, image_size)
    n = 1
    while n < MAX_COUNT and all((k - 1) * spacing <= usable for k in _grid(n + 1)):
        n += 1
    return n


def _centred(pts: np.ndarray) -> np.ndarray:
    """Move the group so that its bounding box is centred on (0, 0)."""
    return pts - (pts.min(axis=0) + pts.max(axis=0)) / 2


def _layout(rng: np.random.Generator, n: int, r: float, image_size: int) -> np.ndarray:
    """``n`` centres (n, 2) at least ``_spacing`` apart, their bounding box centred on (0, 0).

    A compact cluster: each new shape goes next to a random earlier one (1 to 1.3 spacings away,
    random direction) where it touches no other and the group still fits in the image. Compact
    keeps the group inside its position region; the spacing keeps the count readable. If no spot
    is found (crowded small images) a regular grid is used, which ``max_count_for`` makes fit.
    """
    pts = np.zeros((n, 2))
    if n == 1:
        return pts
    spacing = _spacing(r, image_size)
    span = GROUP_SPAN * image_size - 2 * EXTENT * r  # how far apart centres may be
    placed = 1
    for _ in range(8 * n):
        if placed == n:
            return _centred(pts)
        base = pts[rng.integers(placed)]
        angle = rng.uniform(0.0, 2 * math.pi, size=16)
        dist = spacing * rng.uniform(1.0, 1.3, size=16)
        cand = base + np.stack([np.cos(angle), np.sin(angle)], axis=1) * dist[:, None]
        diff = cand[:, None, :] - pts[None, :placed, :]
        ok = np.einsum("ijk,ijk->ij", diff, diff).min(axis=1) >= spacing * spacing * 0.999
        lo = np.minimum(pts[:placed].min(axis=0), cand)
        hi = np.maximum(pts[:placed].max(axis=0), cand)
        ok &= ((hi - lo) <= span).all(axis=1)
        good = np.flatnonzero(ok)
        if good.size:
            pts[placed] = cand[good[0]]
            placed += 1
    if placed == n:
        return _centred(pts)
    cols, _ = _grid(n)
    grid = np.array([(i % cols, i // cols) for i in range(n)], dtype=np.float64) * spacing
    return _centred(grid)


class SyntheticShapes(Dataset):
    """Images of 1..max_count same shapes; label = shape kind; caption = count/size/colour/position.

    Item ``i`` depends on ``(seed, i)`` only. Attributes are drawn first, from the same random
    stream as the drawing, so ``caption(i)`` can give the caption without rendering the image
    (used to train a tokenizer on thousands of captions in milliseconds).

    Because an item is a function of its index, each process keeps the items it has rendered (up to
    ``MEMO_BYTES`` of images; a loader worker keeps its own, and is persistent): from the second epoch on, and at
    every evaluation after the first, an item is a copy instead of a render (~0.4 ms at 32 x 32).
    """

    def __init__(
        self,
        size: int,
        image_size: int,
        num_classes: int,
        max_count: int,
        noise: float,
        clutter: int,
        seed: int,
    ):
        problem = num_classes_problem(num_classes)
        if problem:
            raise ConfigError(problem)
        if not 16 <= image_size <= 1024:
            raise ConfigError(f"data.image_size={image_size}: the synthetic shapes need 16..1024")
        if not 1 <= max_count <= max_count_for(image_size):
            raise ConfigError(
                f"data.synthetic.max_count={max_count}: must be in 1..{max_count_for(image_size)} at "
                f"data.image_size={image_size} (more shapes would overlap) — lower it or raise image_size"
            )
        if size < 1 or noise < 0 or clutter < 0:
            raise ConfigError("data.synthetic: size must be >= 1, noise and clutter >= 0")
        self.size = int(size)
        self.image_size = int(image_size)
        self.num_classes = int(num_classes)
        self.max_count = int(max_count)
        self.noise = float(noise)
        self.clutter = int(clutter)
        self.seed = int(seed)
        self.class_names = SHAPES[: self.num_classes]
        self.epoch = 0
        self._bank: np.ndarray | None = None
        self._memo: dict[int, tuple[np.ndarray, dict]] = {}  # index -> render(index), up to MEMO_BYTES of images
        self._memo_bytes = 0

    def __getstate__(self) -> dict:  # a worker starts with an empty memo, not a copy of this process's
        return {**self.__dict__, "_memo": {}, "_memo_bytes": 0}

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        """Same interface as the user data sets; a synthetic item has a single caption."""
        self.epoch = int(epoch)

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        return np.random.default_rng([self.seed, index])

    def _attributes(self, rng: np.random.Generator) -> dict:
        return {
            "label": int(rng.integers(self.num_classes)),
            "count": int(rng.integers(1, self.max_count + 1)),
            "size": SIZES[int(rng.integers(len(SIZES)))],
            "colour": COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))],
            "position": POSITION_NAMES[int(rng.integers(len(POSITION_NAMES)))],
        }

    def attributes(self, index: int) -> dict:
        """label, count, size, colour and position of item ``index`` (no rendering)."""
        return self._attributes(self._rng(index))

    def labels_present(self, enough: int | None = None) -> set[int]:
        """The labels the items have (no rendering); stops once ``enough`` different ones are found."""
        found: set[int] = set()
        for i in range(self.size):
            found.add(self.attributes(i)["label"])
            if enough is not None and len(found) >= enough:
                break
        return found

    def caption(self, index: int) -> str:
        a = self.attributes(index)
        return caption_text(a["count"], a["size"], a["colour"], a["position"])

    def render(self, index: int) -> tuple[np.ndarray, dict]:
        """The image (3, S, S) float32 in [0, 1] and its attributes, with where the shapes were drawn:
        ``centres`` ([[x, y], ...] in pixels), ``radius`` (pixels) and ``background`` (its RGB)."""
        rng = self._rng(index)
        a = self._attributes(rng)
        s = self.image_size
        # background: a dark, slightly tinted grey, so every palette colour stands out
        bg = rng.uniform(0.05, 0.3) + rng.uniform(-0.04, 0.04, size=3)
        img = np.empty((3, s, s), dtype=np.float32)
        img[:] = bg.astype(np.float32)[:, None, None]
        a["background"] = [float(v) for v in bg]
        # clutter: tiny blobs, well below the small shape size so they do not look like one more shape
        side = max(1, round(0.04 * s))
        for _ in range(self.clutter):
            cx, cy = rng.uniform(0, s - side, size=2)
            rgb = _COLOUR_RGB[rng.integers(len(_COLOUR_RGB))] * np.float32(rng.uniform(0.5, 1.0))
            _dot(img, cx, cy, side, rgb)
        r = shape_radius(a["size"], s)
        pts = _layout(rng, a["count"], r, s)
        ax, ay = POSITIONS[a["position"]]
        centre = np.array([ax * s, ay * s]) + rng.uniform(-0.03 * s, 0.03 * s, size=2)
        pts = pts + centre
        # keep the whole group inside the image (moves large groups towards the centre a little;
        # GROUP_SPAN bounds how much, so a corner group stays clearly in its corner)
        lo, hi = pts.min(axis=0) - EXTENT * r - 1, pts.max(axis=0) + EXTENT * r + 1
        pts += np.maximum(0.0, -lo) - np.maximum(0.0, hi - s)
        kind = SHAPES[a["label"]]
        rgb = _COLOUR_RGB[COLOUR_NAMES.index(a["colour"])]
        for cx, cy in pts:
            _stamp(img, kind, cx, cy, r, rgb)
        a["centres"], a["radius"] = [[float(x), float(y)] for x, y in pts], float(r)
        if self.noise > 0:
            img += self._noise(rng)
        np.clip(img, 0.0, 1.0, out=img)
        return img, a

    def _noise(self, rng: np.random.Generator) -> np.ndarray:
        """Gaussian pixel noise (3, S, S), std ``noise``: a random window of a per-data-set bank.

        Drawing 3*S*S fresh normals costs more than the whole rest of the image; a random offset
        (and sign) into a fixed bank of normals keeps each pixel N(0, noise^2) at a tenth of the cost.
        The bank is made lazily from the seed, so data-loader workers rebuild the same one.
        """
        n = 3 * self.image_size**2
        if self._bank is None:
            bank_rng = np.random.default_rng([self.seed, 0x6E6F697365])  # a stream no item index uses
            self._bank = bank_rng.standard_normal(max(1 << 16, 4 * n), dtype=np.float32) * np.float32(
                self.noise
            )
        start = int(rng.integers(len(self._bank) - n + 1))
        window = self._bank[start : start + n].reshape(3, self.image_size, self.image_size)
        return window if rng.integers(2) else -window

    # The raw record of every item: the image, its index, and everything the scene was drawn from, so that a new
    # task can take its targets from here (``TaskHead.item_fields``) without editing this file.
    provides = frozenset({"image", "index", "label", "shape", "captions", "count", "size", "colour", "position",
                          "centres", "radius", "background"})
    source = "the synthetic shapes (data.source=synthetic)"

    def how_to_provide(self, field: str) -> str:
        return (f"the synthetic scenes have no {field!r}; derive the task's targets from the fields they have, or use "
                f"data.source=manifest with a {field!r} key on every line")

    def __getitem__(self, key) -> dict:
        """The raw record: ``image`` (3, S, S) float32 in [0, 1], ``index``, ``label`` (the shape's class),
        ``shape`` (its name), ``captions`` ([the caption]), ``count``, ``size``, ``colour``, ``position`` (the
        caption's words), ``centres`` ([[x, y], ...] pixels), ``radius`` (pixels), ``background`` (RGB)."""
        # the train sampler passes (index, epoch); see mtl.data.loader.EpochDistributedSampler
        index = int(key[0] if isinstance(key, tuple) else key)
        kept = self._memo.get(index)
        if kept is None:
            kept = self.render(index)
            if self._memo_bytes + kept[0].nbytes <= MEMO_BYTES:
                self._memo[index] = kept
                self._memo_bytes += kept[0].nbytes
        img, a = kept
        return {  # the caller's to change: the memo's image and lists stay as rendered
            **a,
            "centres": [list(c) for c in a["centres"]],
            "background": list(a["background"]),
            "image": torch.from_numpy(img.copy()),
            "index": index,
            "shape": SHAPES[a["label"]],
            "captions": [caption_text(a["count"], a["size"], a["colour"], a["position"])],
        }
