"""What the weighting tests share: the method lists by family, a method built from a bare config, and small
gradient matrices and comparisons."""

from __future__ import annotations

import dataclasses
import io

import torch
from omegaconf import OmegaConf

from mtl.config.schema import Config
from mtl.weighting import weighting_types
from mtl.weighting.alignedmtl import alignedmtl
from mtl.weighting.cagrad import cagrad
from mtl.weighting.conflictfree import config
from mtl.weighting.dualproj import dualproj
from mtl.weighting.fairgrad import fairgrad
from mtl.weighting.imtlg import imtlg
from mtl.weighting.mgda import mgda
from mtl.weighting.modo import modo
from mtl.weighting.nashmtl import nashmtl
from mtl.weighting.pcgrad import pcgrad
from mtl.weighting.sdmgrad import sdmgrad
from mtl.weighting.upgrad import upgrad

TASKS = ["cls", "gen"]
GRAD_FUNCS = {"pcgrad": pcgrad, "mgda": mgda, "cagrad": cagrad, "nashmtl": nashmtl, "imtlg": imtlg,
              "alignedmtl": alignedmtl, "upgrad": upgrad, "dualproj": dualproj, "config": config, "fairgrad": fairgrad,
              "modo": modo, "sdmgrad": sdmgrad}
LOSS_METHODS = ["rlw", "uw", "dwa", "gls", "si", "famo", "stch"]
GRAD_METHODS = [*GRAD_FUNCS, "gradnorm", "gradvac"]  # weights from the Gram matrix (GramWeighting)
STATEFUL_GRAM = ("gradnorm", "gradvac", "modo", "sdmgrad")  # their state moves every time the weights are computed
ROW_METHODS = ["graddrop", "dbmtl", "excessmtl", "moco"]  # gradient-level, but they need the rows (signs, K x P state)
BILEVEL_METHODS = ["autolambda", "moml", "forum"]  # loss-level, with a meta update on a held-out batch: tests/test_bilevel.py


def cfg_for(method: str, seed: int = 0, tasks=TASKS, options=None):
    cfg = OmegaConf.structured(Config)
    cfg.weighting.method = method
    cfg.seed = seed
    cfg.tasks = list(tasks)
    cfg.weighting.options = dict(options or {})
    return cfg


_CFGS: dict = {}  # building a structured Config takes ~0.1 s; the methods only read it


def make(method: str, seed: int = 0, tasks=TASKS, options=None):
    key = (method, seed, tuple(tasks), repr(sorted((options or {}).items())))
    if key not in _CFGS:
        _CFGS[key] = cfg_for(method, seed, tasks, options)
    return weighting_types()[method](_CFGS[key], list(tasks))


def G(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def gram(g: torch.Tensor) -> torch.Tensor:
    return g @ g.T


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"{a.tolist()} != {b.tolist()}"


def random_grads(k: int, p: int, seed: int) -> torch.Tensor:
    return torch.randn(k, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def roundtrip(module):
    """A fresh instance of the same method loaded from ``module``'s state_dict (through torch.save)."""
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    fresh = make(module.name, tasks=module.tasks, options=dataclasses.asdict(module.options))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    return fresh


def gram_case(k: int) -> torch.Tensor:
    """(K, 7) rows with a shared component and some conflicts (negative cosines) for K = 2, 3, 5."""
    gen = torch.Generator().manual_seed(1000 + {2: 1, 3: 3, 5: 5}[k])
    g = torch.randn(k, 7, generator=gen, dtype=torch.float64) + 0.6 * torch.randn(1, 7, generator=gen, dtype=torch.float64)
    return g * torch.tensor([1.0, 3.0, 0.2, 1.5, 0.7][:k], dtype=torch.float64)[:, None]


def pcgrad_hard_cases(k: int):
    """Random rows and the hard ones: nearly opposed, one row 100x, identical rows, a zero row."""
    gen = torch.Generator().manual_seed(50 + k)
    cases = [random_grads(k, 6, 60 + k)]
    g = random_grads(k, 6, 70 + k)
    g[1] = -g[0] + 1e-4 * torch.randn(6, generator=gen, dtype=torch.float64)  # nearly opposed
    cases.append(g)
    g = random_grads(k, 6, 80 + k)
    g[0] *= 100.0
    cases.append(g)
    g = random_grads(k, 6, 90 + k)
    g[-1] = g[0]  # identical rows
    cases.append(g)
    g = random_grads(k, 6, 100 + k)
    g[1] = 0.0  # a zero row
    cases.append(g)
    return cases
