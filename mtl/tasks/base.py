"""What a task is: a head that turns the shared feature map and a batch into a loss, and evaluates.

Tasks are data, not special cases. The model returns ``{task name: loss}``; the step, the weighting
and the logging loop over those names, so adding a task means adding one file in ``mtl/tasks/``
with a ``TaskHead`` subclass that sets ``name`` (see docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mtl.config import NoOptions, options_of


@dataclass
class BuildInfo:
    """What a head may need to know when it is built."""

    cfg: Any  # the full run config (DictConfig)
    feature_channels: int  # C of the backbone feature map (B, C, h, w)
    feature_hw: tuple  # (h, w) of that map at the configured image size
    num_classes: int
    class_names: list
    tokenizer: Any  # mtl.data.tokenizer.CaptionTokenizer


class TaskHead(nn.Module):
    name: str = ""  # the key of this task's loss; set by each subclass
    # The task's own config section, ``task_options.<name>``: a dataclass whose fields are the keys, with
    # defaults (checked like every config key; the filled values are saved in config.yaml).
    Options: type = NoOptions
    # The quality metrics of ``eval_reduce`` that curves, the benchmark and delta-m use: name -> higher is
    # better. They are logged as ``<task>_<metric>``; other keys of ``eval_reduce`` are logged too.
    metrics: dict[str, bool] = {}

    @classmethod
    def options_from(cls, cfg):
        """This task's ``Options`` instance from ``cfg.task_options.<name>`` (defaults where not given)."""
        return options_of(cls.Options, cfg.get("task_options", {}).get(cls.name), f"task_options.{cls.name}")

    @classmethod
    def build(cls, info: BuildInfo) -> TaskHead:
        return cls(info)

    def prepare(self, batch: dict, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Collectives the loss needs before the forward (e.g. a global normaliser). Default: none."""

    def forward(self, features: torch.Tensor, batch: dict) -> torch.Tensor:
        """The task's loss (a scalar) from the feature map (B, C, h, w)."""
        raise NotImplementedError

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
