"""Multi-input mode: each task its own data set, and which tasks each step holds (docs/multi-input.md).

``data.per_task.<task>`` gives a task its own source (synthetic, a JSONL manifest, an ImageFolder), size and
per-process batch size; ``data.sampling.policy`` decides which tasks a step holds. Everything here is a pure
function of the config, the seed, the step and each task's sampler state, so every rank computes the same
GLOBAL plan for a step without any communication, and takes its own share of it:

- ``all``: every task every step, task t with ``per_task.t.batch_size`` rows per process;
- ``round_robin``: one task per step, in ``tasks`` order;
- ``weighted``: one task per step, drawn with probabilities ``per_task.t.ratio`` (``sampling.weights=set``) or
  proportional to the tasks' training-set sizes (``size``);
- ``temperature``: one task per step, p_t proportional to size_t ** (1 / ``sampling.temperature``);
- ``mixed``: per-sample mixing: the step's ``data.batch_size`` x W global rows each get a task (the weighted
  probabilities; every task at least once per step), and rank r takes global positions r, r+W, ... so the
  ranks hold DIFFERENT numbers of each task's rows, zero included. A task is then absent on some ranks only.

Each task has its own resumable sampler (a per-task epoch: a permutation of its data set seeded by seed, task
and epoch; a new epoch when the rest cannot fill a request). Its state (epoch, position) is all a resume needs.
The global rows of task t in a step are the sampler's next n_t indices; rank r of W takes ``[r::W]`` of them
(or, for ``mixed``, the rows of its positions), so 1 process with batch W*B sees exactly what W processes see.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from mtl.config.schema import TaskDataConfig, task_data
from mtl.data.hf_source import hf_task_split
from mtl.data.images import Augment, normalize_images, prepare_images
from mtl.data.manifest import CaptionedImages, ImageFolderCaptions, ManifestDataset, read_caption_lines
from mtl.data.synthetic import SyntheticShapes
from mtl.errors import DataError

POLICIES = ("all", "round_robin", "weighted", "temperature", "mixed")
# the policies whose steps leave whole tasks out (on every rank): a strategy must cope with unused heads
ABSENT_POLICIES = ("round_robin", "weighted", "temperature")
SOURCES = ("synthetic", "manifest", "imagefolder", "hf")


def seed_of(*parts) -> int:
    """A 63-bit seed from any values (the same in every process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TaskOnly(Dataset):
    """A task's view of a data set: its records keep ``image``, ``index`` and the fields ``keep`` only (a
    labelled-only or captioned-only set), so no task can read another task's annotations by accident."""

    def __init__(self, inner: Dataset, keep: tuple[str, ...]):
        self.inner, self.keep = inner, frozenset(keep) | {"image", "index"}
        have = getattr(inner, "provides", None)
        self.provides = self.keep if have is None else frozenset(have) & self.keep
        for name in ("class_names", "num_classes", "skipped", "skip_reasons", "source", "how_to_provide",
                     "labels_present"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __getitem__(self, key) -> dict:
        return {k: v for k, v in self.inner[key].items() if k in self.keep}


def _no_label(obj: dict, rel: str) -> int:
    return 0  # a task that reads no label: whatever the line says is not used


def _user_split(cfg, d: TaskDataConfig, path: str, train: bool, labelled: bool, train_split=None) -> Dataset:
    """One split of a task's own data. A labelled task's manifest is read as the single-set mode reads one
    (``ManifestDataset``: strict integer labels, stray labels reported, the val split checked against the
    training classes); a task that reads no label ignores the lines' labels."""
    augment = Augment.from_config(cfg) if train else None
    if d.source == "imagefolder":
        return ImageFolderCaptions(path, image_size=cfg.data.image_size, on_error=d.on_error, augment=augment,
                                   class_names=getattr(train_split, "class_names", None))
    if labelled:
        return ManifestDataset(path, d.image_root or None, cfg.data.image_size,
                               getattr(train_split, "num_classes", None), d.on_error, augment,
                               class_names=getattr(train_split, "class_names", None))
    records, reasons = read_caption_lines(path, d.image_root or _folder(path), _no_label, d.on_error)
    ds = CaptionedImages(records, reasons, cfg.data.image_size, f"manifest {path}", augment)
    ds.num_classes = max(r.label for r in records) + 1 if records else 0
    ds.class_names = [str(i) for i in range(ds.num_classes)]
    return ds


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def build_task_datasets(cfg, task_types: dict[str, type]) -> dict[str, tuple[Dataset, Dataset]]:
    """{task: (train, val)}: each task's own data, reduced to the record fields the task requires."""
    out = {}
    for t, kind in task_types.items():
        train = task_split(cfg, t, kind, "train")
        out[t] = (train, task_split(cfg, t, kind, "val", train))
    return out


def build_task_val_sets(cfg, task_types: dict[str, type], classes) -> dict[str, Dataset]:
    """{task: its validation set} without reading any training set (evaluating a trained model): ``classes``
    (``class_names``, ``num_classes``: the model's) stands in for the training split that labels are checked
    against. A set that cannot be read is a DataError naming the task and its key."""
    out = {}
    for t, kind in task_types.items():
        key = f"data.per_task.{t}.val_path"
        d = task_data(cfg, t)
        if d.source not in ("synthetic", "hf") and not d.val_path:
            raise DataError(f"{key}: task {t}'s validation set is not set; set it to the {d.source} to evaluate on")
        try:
            out[t] = task_split(cfg, t, kind, "val", classes)
        except DataError as e:
            raise DataError(f"{key} (task {t}): {e.message}") from None
    return out


def task_split(cfg, task: str, kind: type, split: str, train_split=None) -> Dataset:
    """One split ("train" or "val") of ``task``'s own data, reduced to the fields the task requires; a val split's
    labels are checked against ``train_split``'s classes."""
    d = task_data(cfg, task)
    if d.source == "synthetic":
        # a stream of its own per task and split: the tasks' images are disjoint sets
        s = cfg.data.synthetic
        ds = SyntheticShapes(size=d.train_size if split == "train" else d.val_size, image_size=cfg.data.image_size,
                             num_classes=s.num_classes, max_count=s.max_count, noise=s.noise, clutter=s.clutter,
                             seed=seed_of(cfg.seed, "synthetic", task, split))
    elif d.source == "hf":  # the task's own HF data set, data.per_task.<task>.hf (mtl/data/hf_source.py)
        ds = hf_task_split(cfg, task, split, train_split)
    else:
        ds = _user_split(cfg, d, d.train_path if split == "train" else d.val_path, split == "train",
                         "label" in kind.requires, train_split)
    prepare_images(cfg, ds)  # the model's image transform on the set that reads the files
    ds = TaskOnly(ds, kind.requires)
    ds.normalization = ds.inner.normalization
    return ds


def class_source(task_sets: dict, task_types: dict[str, type]) -> Dataset:
    """The training set whose class list the run uses: the first task's that requires labels, else the first's."""
    for t, kind in task_types.items():
        if "label" in kind.requires:
            return task_sets[t][0]
    return next(iter(task_sets.values()))[0]


class TaskSampler:
    """One resumable order over ``size`` items: a permutation per epoch, seeded by the seed, ``key`` (default: the
    task's own, ``("order", task)``) and the epoch; ``take(n)`` the next n indices. When fewer than n are left,
    the epoch ends (the rest is dropped, like ``drop_last``) and the next one begins. The held-out stream
    (mtl/data/heldout.py) is one too, under its own key."""

    def __init__(self, size: int, seed: int, task: str, key: tuple | None = None):
        self.size, self.seed, self.task = int(size), int(seed), task
        self.key = ("order", task) if key is None else tuple(key)
        self.epoch = self.pos = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    def order(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(seed_of(self.seed, *self.key, self.epoch))
            self._perm = (self.epoch, torch.randperm(self.size, generator=g))
        return self._perm[1]

    def take(self, n: int) -> tuple[list[int], int]:
        """(n indices, the epoch they belong to)."""
        if n > self.size:
            raise DataError(f"task {self.task!r}: a step needs {n} of its items but its training set has "
                            f"{self.size}; lower its batch size or add data")
        if self.pos + n > self.size:
            self.epoch, self.pos = self.epoch + 1, 0
        out = self.order()[self.pos: self.pos + n].tolist()
        self.pos += n
        return out, self.epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise DataError(f"task {self.task!r}: the checkpoint's sampler is for {state['size']} items, this run's "
                            f"training set has {self.size}; resume with the same data")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


@dataclass(frozen=True)
class SamplingPlan:
    """What the step plan reads, taken from the config once: the policy, the tasks' sizes, batch sizes and
    probabilities (``weighted``, ``temperature``, ``mixed``), the seed and ``data.batch_size`` (``mixed``)."""

    policy: str
    seed: int
    sizes: dict  # task -> training-set size, in ``tasks`` order
    batch_sizes: dict  # task -> per-process rows in a step that holds it
    probs: tuple  # per task, in ``tasks`` order
    mixed_batch: int  # data.batch_size

    @classmethod
    def from_config(cls, cfg, sizes: dict[str, int]) -> SamplingPlan:
        sp, tasks = cfg.data.sampling, list(sizes)
        sections = {t: task_data(cfg, t) for t in tasks}
        if sp.policy == "temperature":
            raw = [sizes[t] ** (1.0 / sp.temperature) for t in tasks]
        elif sp.weights == "size":
            raw = [float(sizes[t]) for t in tasks]
        else:
            raw = [float(sections[t].ratio) for t in tasks]
        return cls(policy=sp.policy, seed=int(cfg.seed), sizes=dict(sizes),
                   batch_sizes={t: sections[t].batch_size for t in tasks},
                   probs=tuple(r / sum(raw) for r in raw), mixed_batch=int(cfg.data.batch_size))


def step_tasks(plan: SamplingPlan, step: int, world: int) -> list[str]:
    """The step's global row list: one task name per global row, in order (the same on every rank).

    Not ``mixed``: the present tasks' rows, task by task (``per_task.t.batch_size`` x W each).
    ``mixed``: ``data.batch_size`` x W rows, each task once, the rest drawn with the plan's probabilities, shuffled.
    """
    tasks = list(plan.sizes)
    g = torch.Generator().manual_seed(seed_of(plan.seed, "sampling", step))
    p = torch.tensor(plan.probs, dtype=torch.float64)
    if plan.policy == "mixed":
        n = plan.mixed_batch * world
        drawn = torch.multinomial(p, n - len(tasks), replacement=True, generator=g).tolist() if n > len(tasks) else []
        rows = list(range(len(tasks))) + drawn
        return [tasks[rows[i]] for i in torch.randperm(n, generator=g).tolist()]
    if plan.policy == "all":
        present = tasks
    elif plan.policy == "round_robin":
        present = [tasks[step % len(tasks)]]
    else:
        present = [tasks[int(torch.multinomial(p, 1, generator=g))]]
    return [t for t in present for _ in range(plan.batch_sizes[t] * world)]


class WholeBatch:
    """How the tasks read a batch of one data set: every task every row, the batch itself."""

    def present(self, tasks) -> list[str]:
        return list(tasks)

    def sub_batch(self, batch: dict, task: str) -> dict:
        return batch

    def loss(self, head, shared: torch.Tensor, task: str, batch: dict) -> torch.Tensor:
        return head(shared, batch)


class TaskSlices:
    """How the tasks read a multi-input batch (``MultiInputStream``): each present task its own rows of the shared
    features and its own sub-batch; its loss is the mean over its GLOBAL rows in the step (a head's local mean times
    n_local * W / n_global; a head whose loss already is a global mean, ``loss_is_global_mean``, as it is), so
    DDP's average over ranks is the global mean whatever each rank holds. A task present in the step with no row
    on this rank gets a zero loss that still reaches its head's parameters and the shared features (zero
    gradients): every rank builds the same graph."""

    def __init__(self, subs: dict):
        self.subs = subs

    def present(self, tasks) -> list[str]:
        return [t for t in tasks if t in self.subs]

    def sub_batch(self, batch: dict, task: str) -> dict:
        return self.subs[task]

    def loss(self, head, shared: torch.Tensor, task: str, batch: dict) -> torch.Tensor:
        sub = self.subs[task]
        start, stop = sub["rows"]
        if stop == start:  # none of this task's rows here: zero, through the same parameters as on the other ranks
            return 0.0 * (shared.sum() + sum(p.reshape(-1)[0] for p in head.parameters() if p.requires_grad))
        loss = head(shared[start:stop], sub)
        if getattr(head, "loss_is_global_mean", False):
            return loss
        return loss * ((stop - start) * sub.get("world", 1) / sub["global_rows"])


def task_rows(batch: dict) -> WholeBatch | TaskSlices:
    """Which rows of ``batch`` each task reads: the model and the step ask this, never the batch's layout."""
    subs = batch.get("multi_input")
    return WholeBatch() if subs is None else TaskSlices(subs)


def verify_task_sizes(cfg, sizes: dict[str, int], world: int, plan: SamplingPlan | None = None) -> None:
    """Before the first step (and before the run writes anything): every task's training set (``sizes``: {task:
    items}) fills the most rows a step can ask of it (its per-process rows x the world; with ``mixed``, the whole
    global batch), whatever the source. A step that holds the task may come arbitrarily late (``weighted``,
    ``temperature``), so this is not left to it."""
    plan = plan or SamplingPlan.from_config(cfg, sizes)
    errors, mixed, others = [], plan.policy == "mixed", len(sizes) - 1
    for t, size in sizes.items():
        # mixed: every task holds at least one of the data.batch_size x W rows, so one task at most all but K - 1
        need = cfg.data.batch_size * world - others if mixed else plan.batch_sizes[t] * world
        if size < need:
            key = "data.batch_size" if mixed else f"data.per_task.{t}.batch_size"
            fits = (size + others) // world if mixed else size // world
            errors.append(f"task {t!r}: a step can ask for {need} of its training items ({key} x "
                          f"{world} process(es){f' less the {others} row(s) of the other tasks' if mixed else ''}"
                          f") but its training set has {size}; lower {key} to at most {max(1, fits)} or add data")
    if errors:
        raise DataError("; ".join(errors))


class MultiInputStream:
    """The training batches of multi-input mode, for ``rank`` of ``world``.

    A batch: ``image`` (every local row, task by task), ``index``, and ``multi_input``: {task: its sub-batch}
    for every task PRESENT in the step (on any rank). A sub-batch holds the task's own batch fields (its
    collate's), ``rows`` (start, stop) into ``image`` (empty on a rank that holds none of the task's rows),
    and ``global_rows`` (the task's rows over all ranks): what the model slices and normalises with.
    """

    def __init__(self, cfg, train_sets: dict[str, Dataset], collates: dict, rank: int, world: int):
        self.cfg, self.sets, self.collates, self.rank, self.world = cfg, train_sets, collates, rank, world
        self.tasks = list(train_sets)
        self.sizes = {t: len(ds) for t, ds in train_sets.items()}
        self.plan = SamplingPlan.from_config(cfg, self.sizes)
        verify_task_sizes(cfg, self.sizes, world, self.plan)
        self.samplers = {t: TaskSampler(len(ds), cfg.seed, t) for t, ds in train_sets.items()}
        self._empty: dict[str, dict] = {}

    def next_batch(self, step: int) -> dict:
        order = step_tasks(self.plan, step, self.world)
        local: dict[str, list] = {t: [] for t in self.tasks if t in order}
        for t in local:
            positions = [i for i, name in enumerate(order) if name == t]
            indices, epoch = self.samplers[t].take(len(positions))
            if self.plan.policy == "mixed":  # rank r holds global positions r, r+W, ...
                mine = [k for k, i in enumerate(positions) if i % self.world == self.rank]
            else:  # rank r holds the task's global rows r, r+W, ...
                mine = list(range(self.rank, len(positions), self.world))
            local[t] = ([indices[k] for k in mine], epoch, len(positions))
        images, index, subs, start = [], [], {}, 0
        for t, (mine, epoch, n_global) in local.items():
            sub = self._collate(t, [self.sets[t][(i, epoch)] for i in mine]) if mine else self._empty_sub(t)
            images.append(sub.pop("image"))
            index.append(sub.pop("index"))
            sub["rows"], sub["global_rows"], sub["world"] = (start, start + len(mine)), n_global, self.world
            subs[t] = sub
            start += len(mine)
        return {"image": torch.cat(images), "index": torch.cat(index), "multi_input": subs}

    def _collate(self, task: str, records: list[dict]) -> dict:
        batch = self.collates[task](records)
        norm = getattr(self.sets[task], "normalization", None)
        if norm:
            batch["image"] = normalize_images(batch["image"], norm)
        return batch

    def _empty_sub(self, task: str) -> dict:
        """The task's batch fields with no rows (a real item's, cut to zero rows): same keys, dtypes, widths."""
        if task not in self._empty:
            one = self._collate(task, [self.sets[task][(0, 0)]])
            self._empty[task] = {k: v[:0] if torch.is_tensor(v) else [] for k, v in one.items()}
        return {k: v.clone() if torch.is_tensor(v) else [] for k, v in self._empty[task].items()}

    def state_dict(self) -> dict:
        return {t: s.state_dict() for t, s in self.samplers.items()}

    def load_state_dict(self, state: dict) -> None:
        for t, s in self.samplers.items():
            if t not in state:
                raise DataError(f"the checkpoint has no sampler state for task {t!r}; resume with its tasks")
            s.load_state_dict(state[t])
