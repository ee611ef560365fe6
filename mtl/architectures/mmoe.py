"""``mmoe``: Multi-gate Mixture-of-Experts (Ma et al., KDD 2018). E experts shared by every task over the backbone's
features; task t's features are ``sum_e g_t(x)_e f_e(x)`` with its own softmax gate ``g_t(x) = softmax(W_t x)``
(eq. 5-6 of the paper; x here the pooled backbone features). Trunk: the backbone and the experts (shared: every task
reaches them); tower t: its gate. Pieces: mtl/architectures/experts.py."""

from __future__ import annotations

from dataclasses import dataclass

from mtl.architectures.base import Architecture
from mtl.architectures.experts import ExpertTrunk, GatedTower, SoftmaxGate, experts
from mtl.models.backbones.base import feature_channels


@dataclass
class MMoEOptions:
    experts: int = 4  # the shared experts
    hidden: int = 0  # each expert's hidden width; 0: the features' width


class MMoE(Architecture):
    name = "mmoe"
    summary = "shared experts over the backbone's features, a softmax gate per task"
    Options = MMoEOptions

    @classmethod
    def check(cls, cfg):
        o = cfg.model.architecture.options
        return [] if int(o.get("experts", 4)) >= 1 else ["model.architecture.options.experts: needs at least 1 expert"]

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        c, pool = feature_channels(feature_shape), getattr(backbone, "pool", "mean")
        trunk = ExpertTrunk(backbone, experts(options.experts, feature_shape, options.hidden))
        return trunk, {t: GatedTower(SoftmaxGate(c, options.experts, pool)) for t in tasks}
