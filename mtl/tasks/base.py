"""What a task is: a head that turns the shared feature map and a batch into a loss, and evaluates.

Tasks are data, not special cases. The model returns ``{task name: loss}``; the step, the weighting
and the logging loop over those names, so adding a task means adding one file in ``mtl/tasks/`` (or
anywhere, named in the config's ``task_modules``) with a ``TaskHead`` subclass that sets ``name``
(see docs/extending.md). A task also says what it needs from the data: the raw record fields it
``requires``, and how its batch fields are made from a record (``item_fields``) and batched
(``collate_fields``). The data sets and the loaders name no task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mtl.config.keys import NoOptions, options_of
from mtl.models.backbones.base import feature_kind


@dataclass
class DataInfo:
    """What a task's ``item_fields`` / ``collate_fields`` may use (picklable: it travels to loader workers)."""

    cfg: Any  # the full run config (DictConfig)
    num_classes: int
    class_names: list
    tokenizer: Any  # mtl.data.tokenizer.CaptionTokenizer
    _options: dict = field(default_factory=dict, repr=False)

    def options(self, task: type) -> Any:
        """``task.options_from(cfg)``, made once per task (the collate runs per batch)."""
        if task.name not in self._options:
            self._options[task.name] = task.options_from(self.cfg)
        return self._options[task.name]


def default_collate(items: list[dict]) -> dict:
    """Per key: ints -> a long tensor, floats -> a float tensor, bools -> a bool tensor, tensors -> stacked;
    anything else stays a list (one entry per item)."""
    out = {}
    for key in items[0]:
        values = [it[key] for it in items]
        if all(isinstance(v, bool) for v in values):
            out[key] = torch.tensor(values, dtype=torch.bool)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            out[key] = torch.tensor(values, dtype=torch.long)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = torch.tensor(values, dtype=torch.float32)
        elif all(torch.is_tensor(v) for v in values):
            out[key] = torch.stack(values)
        else:
            out[key] = values
    return out


@dataclass
class BuildInfo:
    """What a head may need to know when it is built."""

    cfg: Any  # the full run config (DictConfig)
    feature_channels: int  # C: a map's channels (B, C, h, w), a token's width (B, N, C), a vector's length (B, C)
    feature_hw: tuple  # (h, w) of a map at the configured image size; () for tokens and vectors
    num_classes: int
    class_names: list
    tokenizer: Any  # mtl.data.tokenizer.CaptionTokenizer
    feature_shape: tuple = ()  # the backbone's features per item: (C, h, w), (N, C) or (C,) (its feature_kind)
    pool: str = "mean"  # the backbone's pool for token features (mtl.models.backbones.base.pool_features)

    @property
    def feature_kind(self) -> str:
        """``"map"``, ``"tokens"`` or ``"vector"`` (mtl.models.backbones.base.feature_kind)."""
        return feature_kind(self.feature_shape)


class TaskHead(nn.Module):
    name: str = ""  # the key of this task's loss; set by each subclass
    # A task *type* sets ``kind`` instead of ``name`` and defines ``instance(name, **arguments)``, which makes the
    # class of one task named ``name``: the config's ``task_instances.<name>: {type: <kind>, **arguments}``
    # (mtl/tasks/__init__.py). Its arguments are the keys of that section, checked against the signature.
    kind: str = ""
    # The task's own config section, ``task_options.<name>``: a dataclass whose fields are the keys, with
    # defaults (checked like every config key; the filled values are saved in config.yaml).
    Options: type = NoOptions
    # The quality metrics of ``eval_reduce`` that curves, the benchmark and delta-m use: name -> higher is
    # better. They are logged as ``<task>_<metric>``; other keys of ``eval_reduce`` are logged too.
    metrics: dict[str, bool] = {}
    # Other numbers of ``eval_reduce`` that a best checkpoint or early stopping may watch (``checkpoint.best_metric``,
    # ``trainer.early_stopping.metric``, as ``<task>_<name>``), outside delta-m and the benchmark; the loss always may.
    watchable: tuple[str, ...] = ()
    # The raw record fields (what a data set's items hold: "image", "label", "captions", "count", the synthetic
    # scene's "colour" ...) this task cannot do without. A data source without one of them is refused before
    # training, naming the task, the field and the fix.
    requires: tuple[str, ...] = ()
    # True if ``forward`` already returns the mean over the GLOBAL batch (its ``prepare`` all-reduces the
    # normaliser, as the caption head's token count); False: a mean over the local rows, which multi-input mode
    # rescales to a share of the global mean (mtl/models/multitask.py).
    loss_is_global_mean: bool = False
    # Options (field names) that may change when a run is resumed (they do not touch the maths: eval settings).
    resume_safe: tuple[str, ...] = ()

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors of this task (one message per problem, naming the key and the fix). Default: none."""
        return []

    @classmethod
    def item_fields(cls, record: dict, info: DataInfo) -> dict:
        """This task's batch fields of one raw record (runs in the loader, per item). Default: none."""
        return {}

    @classmethod
    def collate_fields(cls, items: list[dict], info: DataInfo) -> dict:
        """The batch from every item's ``item_fields``. Default: ``default_collate`` (ints and floats become
        tensors, tensors are stacked, anything else stays a list)."""
        return default_collate(items)

    @classmethod
    def options_from(cls, cfg):
        """This task's ``Options`` instance from ``cfg.task_options.<name>`` (defaults where not given)."""
        return options_of(cls.Options, cfg.get("task_options", {}).get(cls.name), f"task_options.{cls.name}")

    @classmethod
    def build(cls, info: BuildInfo) -> TaskHead:
        return cls(info)

    @classmethod
    def instance(cls, name: str, **arguments) -> type[TaskHead]:
        """A task type (``kind``): the class of the task named ``name``. Raises ValueError for bad arguments."""
        raise NotImplementedError(f"{cls.__name__} is not a task type (it has no kind)")

    def fit_training_data(self, train_ds) -> None:
        """Statistics of the training split that the head keeps (a regression head's mean and std): called once by
        the run's builder with this task's training set, before training. Default: nothing."""

    def shard_units(self) -> list[tuple[str, nn.Module]]:
        """Under ``parallel.engine: fsdp2``, the submodules of this head that are sharded on their own (``fully_shard``),
        as (name relative to the head, module), so that only one of them has its full parameters gathered at a
        time (e.g. a decoder's transformer blocks). What they leave, and every tied weight, is the head's own unit;
        a unit may not share a parameter with the rest of the head (``mtl.parallel.fsdp.shard_units`` checks). Default:
        none, the whole head is one unit."""
        return []

    def prepare(self, batch: dict, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Collectives the loss needs before the forward (e.g. a global normaliser). Default: none."""

    def forward(self, features: torch.Tensor, batch: dict) -> torch.Tensor:
        """The task's loss (a scalar) from the feature map (B, C, h, w)."""
        raise NotImplementedError

    @torch.no_grad()
    def predict(self, features: torch.Tensor, **options) -> list[dict]:
        """Per image, what ``mtl.inference`` reports for this task (JSON-able keys; ``options``: e.g. ``num_beams``).
        Default: nothing."""
        return [{} for _ in range(features.shape[0])]

    @torch.no_grad()
    def eval_batch(self, features: torch.Tensor, batch: dict) -> dict:
        """Partial evaluation results for one batch: picklable, so they can be gathered across ranks."""
        raise NotImplementedError

    @classmethod
    def metric_keys(cls) -> list[tuple[str, bool]]:
        """``[("<task>_<metric>", higher is better), ...]`` for the declared quality metrics."""
        return [(f"{cls.name}_{m}", higher) for m, higher in cls.metrics.items()]

    def eval_reduce(self, parts: list[dict]) -> dict:
        """Metrics (name -> float, plus optional 'samples') from every rank's partial results."""
        raise NotImplementedError
