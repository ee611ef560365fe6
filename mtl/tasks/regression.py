"""Scalar regression: one task type, many tasks (QM9's 11 targets are 11 instances of it).

A task of this type predicts one number per item with a linear layer on the shared features ((B, C), or (B, C, h, w)
mean-pooled). Training minimises the MSE on the *standardised* target, ``(y - mean) / std``, with ``mean`` and
``std`` from the training split (as the QM9 papers do); the metric is the MAE in the target's reported unit:
``|prediction - y| * scale`` in the data's units times ``scale`` (1000 for QM9's energies, reported in meV where the
data is in eV). ``mean`` and ``std`` are buffers of the head, set once from the training split
(``set_standardisation``) and saved with it, so evaluation and inference of a saved run use the same ones.

One class per task name is what the task registry finds (``name`` is a class attribute), so the type itself has no
name: it is the task type of kind ``regression``. ``RegressionHead.instance("U0", field="y", column=12)`` makes the
class of one task, named ``U0``, reading column 12 of each record's ``y`` (or the scalar field ``field`` when
``column`` is None), with its options (unit, scale) in ``task_options.U0`` like any task's. A config declares it as
``task_instances: {U0: {type: regression, field: y, column: 12}}`` (mtl/tasks/__init__.py). The builder calls
``fit_training_data`` with the training split, which sets ``mean`` and ``std``. The loss is a mean over the local
rows: every rank holds the same number of items (drop_last), so DDP's average over ranks is the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtl.errors import DataError
from mtl.models.backbones.base import pool_features
from mtl.tasks.base import BuildInfo, TaskHead

# (type, name, field, column) -> the class ``RegressionHead.instance`` made. The classes are made from a run's
# config in each process that builds the run (they are not importable by name, so they do not pickle by reference).
_INSTANCES: dict[tuple, type] = {}


@dataclass
class RegressionOptions:
    unit: str = ""  # the reported unit, for logs and predictions (e.g. "meV")
    scale: float = 1.0  # factor from the data's unit to the reported one (eV -> meV: 1000)
    # train on (y - mean) / std with the training split's mean and std (the QM9 papers); false: on y itself
    standardise: bool = True


class RegressionHead(TaskHead):
    name = ""  # the type: ``instance`` makes the named tasks
    kind = "regression"
    Options = RegressionOptions
    metrics = {"mae": False}
    field: str = ""  # the record field holding the target
    column: int | None = None  # the column of that field's vector (None: the field is a number)

    @classmethod
    def instance(cls, name: str, field: str | None = None, column: int | None = None) -> type[RegressionHead]:
        """The class of one regression task named ``name``, reading ``record[field]`` (default: ``name``), or
        ``record[field][..., column]`` when ``column`` is given. The same arguments give the same class (so the
        registry's "one class per name" check holds when a run's config is read twice)."""
        if not name or not name.isidentifier():
            raise ValueError(f"a regression task's name must be an identifier, not {name!r}")
        if field is not None and (not isinstance(field, str) or not field):
            raise ValueError(f"field: the record field holding the target, a name (got {field!r})")
        if column is not None and (isinstance(column, bool) or not isinstance(column, int) or column < 0):
            raise ValueError(f"column: the target's index in the field's vector, an integer >= 0 (got {column!r})")
        key = (cls, name, field or name, column)
        if key not in _INSTANCES:
            _INSTANCES[key] = type(f"Regression_{name}", (cls,), {
                "name": name, "field": field or name, "column": column, "requires": (field or name,),
                "__module__": cls.__module__, "__qualname__": f"RegressionHead.instance({name!r})"})
        return _INSTANCES[key]

    @classmethod
    def check(cls, cfg) -> list[str]:
        scale = cls.options_from(cfg).scale
        return [] if scale > 0 else [f"task_options.{cls.name}.scale={scale}: must be > 0 (the factor from the "
                                     "data's unit to the reported one, 1 to keep it)"]

    @classmethod
    def target_of(cls, record) -> float:
        value = record[cls.field]
        if cls.column is not None:
            value = torch.as_tensor(value).reshape(-1)[cls.column]
        return float(value)

    @classmethod
    def item_fields(cls, record, info):
        return {f"{cls.name}_target": cls.target_of(record)}

    def __init__(self, info: BuildInfo):
        super().__init__()
        options = self.options_from(info.cfg)
        self.unit, self.scale = options.unit, float(options.scale)
        self.standardise_targets = bool(options.standardise)
        self.fc = nn.Linear(info.feature_channels, 1)
        self.pool = info.pool  # token features: the backbone's CLS token or mean (pool_features)
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("std", torch.ones(()))

    def fit_training_data(self, train_ds) -> None:
        """The training split's mean and std of this target (``standardise``; else 0 and 1)."""
        if not self.standardise_targets:
            return
        values = self.targets_of(train_ds).double()
        std = float(values.std()) if values.numel() > 1 else 0.0
        if not std > 0:
            raise DataError(f"task {self.name!r}: its target ({self.field}" + (f"[{self.column}]" if self.column is not None
                                                                               else "")
                            + f") is constant on the training split ({values.numel()} item(s)), so it cannot be "
                            f"standardised; use more training data, or set task_options.{self.name}.standardise=false")
        self.set_standardisation(float(values.mean()), std)

    @classmethod
    def targets_of(cls, ds) -> torch.Tensor:
        """This task's target for every item of ``ds``: from ``ds.field_values(field)`` (all items' values of one
        field at once, without reading the rest of each record) where the data set has it, else item by item."""
        values = getattr(ds, "field_values", None)
        if values is None:
            return torch.tensor([cls.target_of(ds[i]) for i in range(len(ds))], dtype=torch.float64)
        t = torch.as_tensor(values(cls.field))
        t = t.reshape(t.shape[0], -1)
        return t[:, cls.column] if cls.column is not None else t[:, 0]

    def set_standardisation(self, mean: float, std: float) -> None:
        """The training split's mean and std of this target (in the data's units)."""
        if not std > 0:
            raise ValueError(f"task {self.name!r}: the std of its target must be > 0, not {std}")
        self.mean.fill_(float(mean))
        self.std.fill_(float(std))

    def standardised_prediction(self, features: torch.Tensor) -> torch.Tensor:
        out = self.fc(pool_features(features, self.pool)).squeeze(-1)
        return out.to(torch.promote_types(out.dtype, torch.float32))  # bf16/fp16 up to float32; float64 kept

    def standardise(self, y: torch.Tensor) -> torch.Tensor:
        return (y.float() - self.mean) / self.std

    def forward(self, features, batch):
        return F.mse_loss(self.standardised_prediction(features), self.standardise(batch[f"{self.name}_target"]))

    @torch.no_grad()
    def predict(self, features, **options):
        values = self.standardised_prediction(features) * self.std + self.mean
        return [{"value": v * self.scale, "unit": self.unit} for v in values.tolist()]

    @torch.no_grad()
    def eval_batch(self, features, batch):
        pred, y = self.standardised_prediction(features), self.standardise(batch[f"{self.name}_target"])
        return {"abs_sum": float(((pred - y).abs() * self.std).sum()) * self.scale,
                "sq_sum": float(((pred - y) ** 2).sum()), "count": int(y.numel())}

    def eval_reduce(self, parts):
        n = max(1, sum(p["count"] for p in parts))
        return {"mae": sum(p["abs_sum"] for p in parts) / n, "loss": sum(p["sq_sum"] for p in parts) / n}
