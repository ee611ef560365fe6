"""The batches a run trains on: one ``Feed`` over where they come from.

- ``LoaderFeed``: one data set for every task, through the DDP-aware train loader, epoch by epoch, resumable
  part-way into one (its position is in global samples, so any world size at the same global batch continues
  with the same samples; mtl/data/loader.py);
- ``PlanFeed``: multi-input mode (``data.per_task``): each task its own data set and sampler, the step's plan
  (mtl/data/multi_input.py);
- beside either, a bilevel method's held-out batches (``data.heldout``, mtl/data/heldout.py), at the steps the
  method asks for one.

``Feed.take(step)`` is the step's batch on the host, ``Feed.on_device(batch)`` moves it; ``Feed.heldout_batch(step)``
is its held-out batch on the device, or None.
``state_dict``/``load_state_dict`` are the position a checkpoint keeps (``trainer_state.pt``: "data", and
"multi_input" / "heldout" where the run has them). A batch's values move with ``.to(device)`` whatever they are
(tensors, PyG graph batches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mtl.data.heldout import HeldoutStream, verify_heldout_size
from mtl.data.images import model_transform, normalization_text, processor_folder
from mtl.data.loader import (
    all_captions,
    build_eval_loader,
    build_test_dataset,
    build_train_loader,
    data_position,
    normalizing,
    resume_position,
    start_at,
    to_device,
    verify_train_size,
)
from mtl.data.multi_input import MultiInputStream, verify_task_sizes
from mtl.data.tokenizer import unknown_share_text
from mtl.errors import ConfigError
from mtl.setup.build import build_eval_loaders


class LoaderFeed:
    """One data set for every task: the train loader's batches, epoch after epoch, from the current position."""

    plan = None  # no multi-input plan

    def __init__(self, loader, batch_size: int, world_size: int):
        self.loader, self.batch_size, self.world = loader, int(batch_size), int(world_size)
        self.epoch = self.batch_in_epoch = 0  # the position: batches of this epoch handed out
        self._stream: Iterator | None = None

    def batches(self) -> Iterator[tuple[int, dict]]:
        """(index in the epoch, batch) from the current position on; the position follows what is handed out."""
        while True:
            start_at(self.loader, self.epoch, self.batch_in_epoch)
            for i, batch in enumerate(self.loader, start=self.batch_in_epoch):
                self.batch_in_epoch = i + 1
                yield i, batch
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def take(self, step: int) -> tuple[int, dict]:
        if self._stream is None:
            self._stream = self.batches()
        return next(self._stream)

    def state_dict(self) -> dict:
        stream = getattr(self.loader, "stream_state", None)  # a streamed source: the split its position needs
        return {"data": data_position(self.epoch, self.batch_in_epoch, self.batch_size, self.world),
                **({"stream": stream()} if stream else {})}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue where ``state["data"]`` says, at this run's batch size and world size; returns notes."""
        if hasattr(self.loader, "verify_resume"):  # a stream continues on its own split only, else refused by name
            self.loader.verify_resume(state.get("stream") or {"world_size": None, "num_workers": None})
        self.epoch, self.batch_in_epoch, again = resume_position(state["data"], self.batch_size, self.world)
        return [f"resume: the checkpoint's position falls inside a batch of this run's global batch; its last "
                f"{again} sample(s) are seen again"] if again else []


class PlanFeed:
    """Multi-input mode: the step's plan decides which tasks it holds; each task's sampler keeps its own epoch."""

    epoch = 0

    def __init__(self, stream: MultiInputStream):
        self.stream, self.plan = stream, stream.plan

    def take(self, step: int) -> tuple[int, dict]:
        return 0, self.stream.next_batch(step)

    def state_dict(self) -> dict:
        return {"data": data_position(0, 0, 1, 1), "multi_input": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> list[str]:
        self.stream.load_state_dict(state.get("multi_input", {}))
        return []


class Feed:
    """What the loop steps on: the training stream (``train``: a ``LoaderFeed`` or a ``PlanFeed``) and, for a
    bilevel method, the held-out stream (``heldout``), both handing their batches over on ``device``."""

    def __init__(self, train: LoaderFeed | PlanFeed, heldout: HeldoutStream | None, device: torch.device,
                 wants_heldout: Callable[[int], bool]):
        self.train, self.heldout, self.device, self.wants_heldout = train, heldout, device, wants_heldout

    @property
    def plan(self):
        """The multi-input sampling plan, or None (one data set)."""
        return self.train.plan

    @property
    def epoch(self) -> int:
        return self.train.epoch

    def take(self, step: int) -> tuple[int, dict]:
        """(index in the epoch, the next training batch on the host), for the step after ``step`` steps."""
        return self.train.take(step)

    def on_device(self, batch: dict) -> dict:
        """``batch`` (the feed's, or one a tool hands the trainer) on the run's device."""
        return to_device(batch, self.device)

    def heldout_batch(self, step: int) -> dict | None:
        """The held-out batch of this step on the device, at the steps the method asks for one; else None."""
        if self.heldout is None or not self.wants_heldout(step):
            return None
        return self.on_device(self.heldout.next_batch())

    def state_dict(self) -> dict:
        return {**self.train.state_dict(), **({"heldout": self.heldout.state_dict()} if self.heldout else {})}

    def load_state_dict(self, state: dict) -> list[str]:
        notes = self.train.load_state_dict(state)
        if self.heldout is not None:
            self.heldout.load_state_dict(state["heldout"])
        return notes

    def describe(self, cfg, world_size: int) -> str:
        """The batch part of the run's first console line."""
        d = cfg.data
        if self.plan is None:
            text = f"global batch={d.batch_size * world_size} ({d.batch_size} per process)"
        elif d.sampling.policy == "mixed":
            text = f"multi-input, sampling.policy=mixed, {d.batch_size} rows per process, each task's drawn per row"
        else:
            text = (f"multi-input, sampling.policy={d.sampling.policy}, per-task rows per process: "
                    + ", ".join(f"{t}={n}" for t, n in self.plan.batch_sizes.items()))
        stream = getattr(getattr(self.train, "loader", None), "dataset", None)
        if hasattr(stream, "epoch_text"):  # a streamed source (mtl/data/streamed.py): its epoch's length and cut
            text += f", {stream.epoch_text()}"
        if self.heldout is not None:
            text += f", {d.heldout} training items held out for {cfg.weighting.method}'s meta update"
        return text


def build_feed(cfg, inputs, dist, weighting) -> Feed:
    """The run's Feed from its inputs (``mtl.setup.build.build_run_inputs``); every size check runs here, before a step."""
    d = cfg.data
    if inputs.task_sets is not None:
        stream = MultiInputStream(cfg, {t: tr for t, (tr, _) in inputs.task_sets.items()}, inputs.task_collates,
                                  dist.rank, dist.world_size)
        return Feed(PlanFeed(stream), None, dist.device, weighting.wants_heldout)
    heldout = None
    if weighting.needs_heldout_batch:  # first: its size check names data.heldout
        heldout = HeldoutStream(inputs.train_ds, normalizing(inputs.collate, inputs.train_ds), d.heldout,
                                d.batch_size, dist.rank, dist.world_size, cfg.seed)
    loader = build_train_loader(inputs.train_ds, inputs.collate, d.batch_size, dist.rank, dist.world_size, cfg.seed,
                                d.num_workers, dist.device.type == "cuda", heldout=d.heldout)
    return Feed(LoaderFeed(loader, d.batch_size, dist.world_size), heldout, dist.device, weighting.wants_heldout)


def check_feed_data(cfg, train_ds, task_sets: dict | None, world_size: int, needs_heldout: bool):
    """What the feeds will refuse, checked on the data sets alone, before the run writes anything: the training
    set against one global batch, the held-out part's size (a bilevel method), every task's training set against
    the rows a step asks of it (multi-input mode), and the test split, which is read here; returns the test set
    (or None) for ``build_eval_feeds``. The same checks run again where the feeds are built (for other callers)."""
    d = cfg.data
    if task_sets is not None:
        verify_task_sizes(cfg, {t: len(tr) for t, (tr, _) in task_sets.items()}, world_size)
    else:
        if needs_heldout:  # first: its message names data.heldout
            verify_heldout_size(d.heldout, len(train_ds), d.batch_size, world_size)
        verify_train_size(len(train_ds) - int(d.heldout or 0), d.batch_size, world_size)
    test_ds = build_test_dataset(cfg, train_ds)
    refuse_multi_input_test(task_sets, test_ds)
    return test_ds


def refuse_multi_input_test(task_sets: dict | None, test_ds) -> None:
    if task_sets is not None and test_ds is not None:
        raise ConfigError("data.synthetic.test_size / data.test_path: a test split is not supported in "
                          "multi-input mode (data.per_task) yet; set it to 0 / null")


def build_eval_feeds(cfg, inputs, dist, test_ds=None) -> tuple[dict, object]:
    """({task: its validation loader}, the test loader or None): what the run evaluates on. ``test_ds``: the test
    set ``check_feed_data`` read, else it is read here (optional: evaluated beside val as test_<metric>)."""
    pin = dist.device.type == "cuda"
    test_ds = test_ds if test_ds is not None else build_test_dataset(cfg, inputs.train_ds)
    refuse_multi_input_test(inputs.task_sets, test_ds)
    test = None if test_ds is None else build_eval_loader(test_ds, inputs.collate, cfg.data.eval_batch_size,
                                                          dist.rank, dist.world_size, cfg.data.num_workers, pin)
    vals = build_eval_loaders(cfg, inputs.val_ds, inputs.collate, inputs.task_vals(), dist.rank, dist.world_size, pin)
    return vals, test


def data_summary(cfg, inputs, task_types: dict) -> str:
    """Per task and split what the run reads: items, the classes found (a task that reads labels), the
    vocabulary and the share of each split's caption tokens it does not know (a task that reads captions)."""
    lines = ["data:"]
    for t, kind in task_types.items():
        train, val = inputs.task_sets[t] if inputs.task_sets is not None else (inputs.train_ds, inputs.val_ds)
        held = int(cfg.data.get("heldout") or 0) if inputs.task_sets is None else 0
        text = f"  {t}: train {len(train) - held} items" + (f" (+{held} held out)" if held else "")
        text += f", val {len(val)} items"
        if "label" in kind.requires:
            text += f"; {getattr(train, 'num_classes', '?')} classes"
        if "captions" in kind.requires:
            text += f"; vocabulary {inputs.tokenizer.vocab_size} tokens, " + unknown_share_text(inputs.tokenizer, {
                split: all_captions(getattr(ds, "inner", ds)) for split, ds in (("train", train), ("val", val))})
        lines.append(text)
    # a pretrained model's own transform (a transformers folder, timm weights): what the images get
    if cfg.data.source != "qm9" and (processor_folder(cfg) or model_transform(cfg) is not None):
        lines.append("  " + normalization_text(cfg))
    return "\n".join(lines)
