"""A method's own learning rate (issue 35.3): where a paper's code trains the method's parameters in their own
optimizer param group (Nash-MTL's QM9 code: UW's log-variances at 0.025, the model at 1e-3),
``weighting.options.lr`` gives them that group; the plateau schedule scales it with the model's."""

import torch

from mtl.errors import ConfigError
from mtl.setup.build import build_optimizer, build_scheduler, build_weighting
from mtl.setup.checks import load_run_config

from .conftest import TINY


def _optimizer(overrides):
    cfg = load_run_config(TINY, ["weighting.method=uw", *overrides])
    weighting = build_weighting(cfg)
    return cfg, weighting, build_optimizer(cfg, torch.nn.Linear(3, 2), weighting)  # the model: any module


def _group_of(optimizer, param):
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


def test_uw_log_variances_train_at_their_own_lr_in_their_own_group():
    cfg, uw, opt = _optimizer(["weighting.options.lr=0.025", "optim.lr=0.001", "optim.weight_decay=0.01"])
    group = _group_of(opt, uw.log_vars)
    assert group["lr"] == 0.025 and group["weight_decay"] == 0.0 and len(group["params"]) == 1
    assert all(g["lr"] == 0.001 for g in opt.param_groups if g is not group)  # the model keeps optim.lr
    before = uw.log_vars.detach().clone()
    uw.log_vars.grad = torch.ones_like(uw.log_vars)
    opt.step()  # Adam's first step moves each parameter by its lr
    assert torch.allclose(before - uw.log_vars.detach(), torch.full_like(before, 0.025), rtol=1e-4)


def test_without_the_option_uw_stays_in_the_models_group():
    _, uw, opt = _optimizer(["optim.lr=0.001"])
    assert _group_of(opt, uw.log_vars)["lr"] == 0.001 and len(_group_of(opt, uw.log_vars)["params"]) > 1


def test_the_plateau_schedule_scales_the_methods_group_too():
    cfg, uw, opt = _optimizer(["weighting.options.lr=0.025", "optim.scheduler=plateau", "optim.plateau.patience=0",
                               "optim.plateau.factor=0.5", "optim.warmup_steps=0",
                               'optim.plateau.baselines={cls_acc: 0.5, gen_bleu4: 0.1, gen_chrf: 0.2}'])
    sched = build_scheduler(cfg, opt)
    group = _group_of(opt, uw.log_vars)
    sched.inner.step(1.0)
    sched.inner.step(2.0)  # worse, patience 0: every group's lr halves (Nash-MTL's ReduceLROnPlateau on both)
    assert group["lr"] == 0.0125


def test_a_negative_method_lr_is_refused():
    try:
        load_run_config(TINY, ["weighting.method=uw", "weighting.options.lr=-1"])
    except ConfigError as e:
        assert any("weighting.options.lr" in m for m in e.errors)
    else:
        raise AssertionError("weighting.options.lr=-1 was accepted")


def test_nashmtl_max_norm_is_the_authors_clip_of_the_shared_gradient():
    """Nash-MTL's QM9 code clips with ``clip_grad_norm_(shared_parameters, 1.0)`` after the weighted backward; our
    ``max_norm`` scales alpha so that ``||alpha @ G|| <= max_norm``: the same shared update (to the 1e-6 that
    clip_grad_norm_ adds to the norm), above and below the bound."""
    from mtl.weighting.nashmtl import clip_weights, nashmtl_weights

    gen = torch.Generator().manual_seed(0)
    for scale, max_norm in ((10.0, 1.0), (0.01, 1.0), (1.0, 3.0)):
        grads = torch.randn(4, 50, generator=gen, dtype=torch.float64) * scale
        gram = grads @ grads.T
        alpha = nashmtl_weights(gram)
        d = alpha @ grads
        assert abs(float(d.norm()) - 2.0) < 1e-8  # ||d||^2 = sum_t alpha_t d.g_t = K whatever the scale
        ours = clip_weights(alpha, gram, max_norm) @ grads
        shared = torch.nn.Parameter(torch.zeros(50, dtype=torch.float64))
        shared.grad = d.clone()
        torch.nn.utils.clip_grad_norm_([shared], max_norm)
        assert torch.allclose(ours, shared.grad, rtol=1e-5, atol=0)
        assert torch.equal(ours, d) if max_norm > 2.0 else abs(float(ours.norm()) - 1.0) < 1e-12
