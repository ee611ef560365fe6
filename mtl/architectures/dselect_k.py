"""``dselect_k``: DSelect-k gates (Hazimeh et al., NeurIPS 2021) over shared experts, per example (§3.2).

E = 2^m shared experts, as in ``mmoe``; task t's gate is sparse and differentiable: k selectors, selector i with m
logits ``z_i = W_i x`` (x the pooled features); expert l, with binary code l_1 .. l_m, gets from selector i
``r_l(z_i) = prod_j S(z_ij)^[l_j = 1] (1 - S(z_ij))^[l_j = 0]`` (eq. 3: one expert per selector once the z's
saturate), where S is the smooth step (eq. 2) of width ``gamma``::

    S(t) = 0 (t <= -gamma/2),   -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2 (|t| < gamma/2),   1 (t >= gamma/2)

and the gate is ``q(x) = sum_i softmax(alpha(x))_i r(z_i(x))`` with ``alpha = A x`` (eq. 4). Initialisation as the
authors' code: z's layer uniform in +-gamma/100, alpha's in +-0.05. E must be a power of two (the selectors address
exactly 2^m experts; the authors' penalty for other E is not provided). Not applied: the entropy regulariser the
authors add to the loss (weight 1e-6 in LibMTL) to push the selectors to one expert each; the selectors still reach
one expert each as the z's saturate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mtl.architectures.base import Architecture
from mtl.architectures.experts import ExpertTrunk, GatedTower, experts
from mtl.models.backbones.base import feature_channels, pool_features


@dataclass
class DSelectKOptions:
    experts: int = 4  # the shared experts: a power of two
    k: int = 2  # selectors per task: at most k experts per task once the selectors saturate
    gamma: float = 1.0  # the smooth step's width
    hidden: int = 0  # each expert's hidden width; 0: the features' width


def smooth_step(t: torch.Tensor, gamma: float) -> torch.Tensor:
    cubic = -2 / gamma**3 * t**3 + 3 / (2 * gamma) * t + 0.5
    return torch.where(t <= -gamma / 2, torch.zeros_like(t), torch.where(t >= gamma / 2, torch.ones_like(t), cubic))


def binary_codes(n: int) -> torch.Tensor:
    """(n, m) booleans: row e is e in binary, most significant bit first."""
    m = int(math.log2(n))
    return torch.tensor([[(e >> (m - 1 - j)) & 1 for j in range(m)] for e in range(n)], dtype=torch.bool)


class DSelectGate(nn.Module):
    def __init__(self, channels: int, n: int, k: int, gamma: float, pool: str):
        super().__init__()
        self.k, self.m, self.gamma, self.pool = k, int(math.log2(n)), gamma, pool
        self.z = nn.Linear(channels, k * self.m)
        self.alpha = nn.Linear(channels, k)
        nn.init.uniform_(self.z.weight, -gamma / 100, gamma / 100)
        nn.init.uniform_(self.z.bias, -gamma / 100, gamma / 100)
        nn.init.uniform_(self.alpha.weight, -0.05, 0.05)
        nn.init.uniform_(self.alpha.bias, -0.05, 0.05)
        self.register_buffer("codes", binary_codes(n), persistent=False)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """(B, E) expert weights: each row on the simplex."""
        x = pool_features(f, self.pool)
        s = smooth_step(self.z(x).float().view(-1, self.k, 1, self.m), self.gamma)  # (B, k, 1, m)
        r = torch.where(self.codes, s, 1 - s).prod(-1)  # (B, k, E): selector i's weight on expert l
        return torch.einsum("bi,bie->be", torch.softmax(self.alpha(x).float(), dim=-1), r)


class DSelectK(Architecture):
    name = "dselect_k"
    summary = "shared experts over the backbone's features, a sparse differentiable DSelect-k gate per task"
    Options = DSelectKOptions

    @classmethod
    def check(cls, cfg):
        o, key = cfg.model.architecture.options, "model.architecture.options"
        n, errors = int(o.get("experts", 4)), []
        if n < 2 or n & (n - 1):
            errors.append(f"{key}.experts: {n} is not a power of two >= 2 (DSelect-k's selectors address 2^m experts)")
        if int(o.get("k", 2)) < 1:
            errors.append(f"{key}.k: needs at least 1 selector")
        if not float(o.get("gamma", 1.0)) > 0:
            errors.append(f"{key}.gamma: the smooth step's width must be > 0")
        return errors

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        c, pool = feature_channels(feature_shape), getattr(backbone, "pool", "mean")
        trunk = ExpertTrunk(backbone, experts(options.experts, feature_shape, options.hidden))
        return trunk, {t: GatedTower(DSelectGate(c, options.experts, options.k, options.gamma, pool))
                       for t in tasks}
