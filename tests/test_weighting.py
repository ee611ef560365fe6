"""Task-weighting methods: what every method shares (discovery, levels, degenerate inputs, devices), the
options each one declares, and the forms of combine the step hands a strategy. The methods themselves, by family:
tests/test_weighting_gram.py, test_weighting_loss.py, test_weighting_rows.py; the shared helpers: weighting_cases.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mtl.weighting import weighting_types
from mtl.weighting.dwa import dwa_weights
from mtl.weighting.mgda import mgda_weights
from mtl.weighting.nashmtl import nashmtl_weights

from .weighting_cases import (
    BILEVEL_METHODS,
    GRAD_FUNCS,
    GRAD_METHODS,
    LOSS_METHODS,
    ROW_METHODS,
    TASKS,
    G,
    cfg_for,
    close,
    gram,
    gram_case,
    make,
    random_grads,
    roundtrip,
)

# --------------------------------------------------------------------------------------------------
# discovery and the common contract


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_every_method_is_discovered_with_its_level():
    types = weighting_types()
    for m in LOSS_METHODS:
        assert types[m].level == "loss", m
    for m in GRAD_METHODS + ROW_METHODS:
        assert types[m].level == "grad", m
    assert set(types) == {*LOSS_METHODS, *GRAD_METHODS, *ROW_METHODS, *BILEVEL_METHODS, "equal", "static"}
    for m in LOSS_METHODS + GRAD_METHODS + ROW_METHODS:
        assert types[m].check(cfg_for(m)) == []
        roundtrip(make(m))  # every state_dict loads (strictly) into a fresh instance
    for m in BILEVEL_METHODS:
        assert types[m].level == "loss" and types[m].needs_heldout_batch
        cfg = cfg_for(m)
        assert types[m].check(cfg) and types[m].check(OmegaConf.merge(cfg, {"data": {"heldout": 32}})) == []
        w = make(m)
        w.lam.add_(torch.tensor([0.25, -0.5], dtype=w.lam.dtype))
        if hasattr(w, "adam_t"):  # the step count of lambda's Adam: extra state
            w.adam_t = 3
        fresh = roundtrip(w)
        assert fresh.weights() == w.weights() and getattr(fresh, "adam_t", 3) == 3


@pytest.mark.parametrize("method", GRAD_METHODS)
def test_grad_methods_leave_losses_unweighted_and_report_the_combination(method):
    w = make(method)
    loss = torch.tensor(2.5)
    assert w.weigh("cls", loss) is loss
    grads = G([1.0, 0.0, 2.0], [0.5, -1.0, 0.0])
    w.begin_step(0)
    d = w.combine(grads, torch.tensor([1.0, 2.0]))
    alpha = torch.tensor([w.weights()[t] for t in TASKS], dtype=torch.float64)
    close(d, alpha @ grads, 1e-12)


@pytest.mark.parametrize("name", list(GRAD_FUNCS))
@pytest.mark.parametrize("rows", [
    [[0.0, 0.0, 0.0], [1.0, 2.0, -1.0]],  # a zero row
    [[1.0, 2.0, -1.0], [0.0, 0.0, 0.0]],
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],  # all zero
    [[1e-30, 0.0, 0.0], [0.0, 1e30, 0.0]],  # extreme scales
    [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]],  # K = 3: zero and opposed
])
def test_degenerate_inputs_give_finite_updates(name, rows):
    g = G(*rows)
    d = GRAD_FUNCS[name](g)
    assert d.shape == (g.shape[1],) and torch.isfinite(d).all(), d


@pytest.mark.parametrize("name", list(GRAD_FUNCS))
def test_float32_and_single_task_inputs(name):
    g = random_grads(3, 50, 1).float()
    d = GRAD_FUNCS[name](g)
    assert d.dtype == torch.float32 and torch.isfinite(d).all()
    one = G([3.0, 4.0])
    d1 = GRAD_FUNCS[name](one)
    assert torch.isfinite(d1).all()
    assert float(d1 @ one[0]) > 0  # a single task always descends


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAD_FUNCS))
def test_cuda_matches_cpu(name):
    for k in (2, 3):
        g = random_grads(k, 1000, 7)
        close(GRAD_FUNCS[name](g.cuda()).cpu(), GRAD_FUNCS[name](g), 1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("method", LOSS_METHODS + GRAD_METHODS + ROW_METHODS)
def test_weightings_run_on_cuda(method):
    w = make(method, tasks=["a", "b", "c"]).to("cuda")
    for step in range(3):
        w.begin_step(step)
        if w.level == "grad":
            grads = random_grads(3, 1000, step).float().cuda()
            d = w.combine(grads, torch.ones(3, device="cuda"))
            assert d.device.type == "cuda" and d.shape == (1000,) and torch.isfinite(d).all()
        else:
            for t in w.tasks:
                term = w.weigh(t, torch.tensor(1.5, device="cuda"))
                assert term.device.type == "cuda" and torch.isfinite(term)
        w.end_step({"a": 2.0 - 0.1 * step, "b": 1.0, "c": 0.5 + 0.1 * step})
        assert all(math.isfinite(v) for v in w.weights().values())


# --------------------------------------------------------------------------------------------------
# options (weighting.options): each one changes what the method does


def run_steps(w, steps=4):
    """A few steps of ``w`` (gram_case rows for gradient-level methods, moving losses); the weights after each."""
    tasks = w.tasks
    g = gram_case(len(tasks))
    g = g / g.norm(dim=1, keepdim=True) * torch.linspace(1.0, 1.5, len(tasks), dtype=g.dtype)[:, None]
    seen = []
    for step in range(steps):
        w.begin_step(step)
        losses = {t: 2.0 / (1 + step * (i + 1)) + 0.1 * i for i, t in enumerate(tasks)}
        if w.level == "grad":  # the rows change from step to step
            rows = g * (1 + 0.3 * step * torch.arange(len(tasks), dtype=g.dtype))[:, None]
            w.combine(rows, torch.tensor([losses[t] for t in tasks], dtype=torch.float64))
        w.end_step(losses)
        seen.append(list(w.weights().values()))
    return seen


@pytest.mark.parametrize("method, options", [
    ("cagrad", {"c": 0.2}), ("cagrad", {"rescale": False}),
    ("gradnorm", {"alpha": 0.0}), ("gradnorm", {"lr": 0.1}),
    ("dwa", {"T": 0.5}), ("famo", {"lr": 0.1}), ("famo", {"gamma": 0.5}),
    ("pcgrad", {"reduction": "mean"}),
    ("nashmtl", {"update_every": 2}), ("nashmtl", {"max_norm": 0.5}),
    ("mgda", {"normalization": "l2"}), ("mgda", {"normalization": "loss"}), ("mgda", {"normalization": "loss+"}),
    ("gradvac", {"beta": 0.1}), ("fairgrad", {"alpha": 2.0}), ("graddrop", {"leak": 0.5}),
    ("dbmtl", {"beta": 0.5}), ("dbmtl", {"sigma": 0.5}), ("excessmtl", {"eta": 0.5}),
    ("modo", {"gamma": 0.1}), ("modo", {"rho": 1.0}), ("sdmgrad", {"lamda": 1.0}), ("sdmgrad", {"niter": 2}),
    ("moco", {"beta": 0.9}), ("moco", {"beta_sigma": 0.0}), ("moco", {"gamma": 1.0}), ("moco", {"gamma_sigma": 0.0}),
    ("moco", {"rho": 1.0}), ("moco", {"normalize": False}),
    ("stch", {"warmup_steps": 1, "nadir_steps": 1}),
])
def test_each_option_changes_the_method(method, options):
    tasks = ["a", "b", "c"]
    default, changed = make(method, tasks=tasks), make(method, tasks=tasks, options=options)
    for key, value in options.items():
        assert getattr(changed.options, key) == value and getattr(default.options, key) != value
    a, b = run_steps(default), run_steps(changed)
    assert any(not np.allclose(x, y, rtol=1e-6, atol=0) for x, y in zip(a, b)), (a, b)


def test_option_values_do_what_they_say():
    g = gram_case(3)
    m = gram(g)
    # pcgrad mean = sum / K
    close(make("pcgrad", options={"reduction": "mean"}).weights_for_gram(m) * 3, make("pcgrad").weights_for_gram(m), 1e-12)
    # dwa: T is the softmax temperature
    close(dwa_weights([1.0, 0.5], [1.0, 1.0], 0.5), (2 * torch.softmax(torch.tensor([2.0, 1.0]), 0)).tolist(), 1e-6)
    # nashmtl: max_norm bounds ||d|| (here below the unclipped norm), update_every reuses the last solution
    clipped = make("nashmtl", tasks=["a", "b", "c"], options={"max_norm": 0.5})
    alpha = clipped.weights_for_gram(m)
    free = make("nashmtl", tasks=["a", "b", "c"]).weights_for_gram(m)
    assert float(free @ m @ free) > 0.25
    close(float(alpha @ m @ alpha), 0.25, 1e-12)
    close(alpha / alpha.sum(), free / free.sum(), 1e-12)  # the same direction
    w = make("nashmtl", tasks=["a", "b", "c"], options={"update_every": 3})
    first = []
    for step in range(6):
        w.begin_step(step)
        first.append(w.weights_for_gram(m * (1 + step)))
    close(first[1], first[0], 0)
    close(first[2], first[0], 0)
    close(first[3], nashmtl_weights(m * 4), 1e-12)  # solved again at step 3 ...
    close(first[5], first[3], 0)
    fresh = roundtrip(w)  # ... and the reused alpha survives a resume
    for mod in (w, fresh):
        mod.begin_step(7)
    close(fresh.weights_for_gram(m), w.weights_for_gram(m), 0)
    # mgda l2 is the min-norm point of the unit gradients; loss divides by the losses
    n = m.diagonal().sqrt()
    unit = make("mgda", tasks=["a", "b", "c"], options={"normalization": "l2"}).weights_for_gram(m, torch.ones(3))
    close(unit * n, mgda_weights(m / torch.outer(n, n)), 1e-12)
    losses = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    by_loss = make("mgda", tasks=["a", "b", "c"], options={"normalization": "loss"}).weights_for_gram(m, losses)
    close(by_loss * losses, mgda_weights(m / torch.outer(losses, losses)), 1e-12)


@pytest.mark.parametrize("name", LOSS_METHODS + GRAD_METHODS + ROW_METHODS)
def test_grad_hooks_are_the_forms_of_combine_the_method_has(name):
    """What train_step hands the strategy: nothing for a loss-level method; ``combine`` for every gradient-level
    one; ``weights_for_gram`` for a Gram-only one; ``combine_shard`` / ``finish_shard`` for one exact per shard."""
    w = make(name)
    hooks = w.grad_hooks()
    assert set(hooks) == {"combine", "gram_weights", "combine_shard", "finish_shard", "head_weights"}
    assert hooks["head_weights"] is None  # weighting.heads: unweighted, the default
    grad = w.level == "grad"
    assert (hooks["combine"] == w.combine) if grad else hooks["combine"] is None
    assert (hooks["gram_weights"] == w.weights_for_gram) if grad and name in GRAD_METHODS \
        else hooks["gram_weights"] is None
    shards = name == "graddrop"  # the one row method exact column by column (FSDP2)
    assert (hooks["combine_shard"] == w.combine_shard) if shards else hooks["combine_shard"] is None
    assert (hooks["finish_shard"] == w.finish_shard) if shards else hooks["finish_shard"] is None
    if name in GRAD_METHODS:  # weighting.heads: weighted, read by the Gram methods (tests/test_weighted_heads.py)
        cfg = cfg_for(name)
        cfg.weighting.heads = "weighted"
        weighted = type(w)(cfg, list(w.tasks))
        assert weighted.grad_hooks()["head_weights"] == weighted.weights_for_heads
