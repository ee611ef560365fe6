"""``weighting.heads: weighted``: a Gram method's w_t also weighs head t's gradient (the Nash-MTL authors' weighted
loss backward); ``unweighted`` (the default) leaves head t the gradient of L_t. One step of each strategy that
serves gradient-level methods (task_grads, feature_leaf), in one process on tiny.yaml, against plain autograd; the
2-rank parity of both values is in tests/test_weighting_ddp.py. And the key is refused where it means nothing."""

from __future__ import annotations

import pytest
import torch

from mtl.errors import ConfigError

from .conftest import TINY

CASES = [("nashmtl", "task_grads", ["weighting.options.max_norm=0.5"]), ("imtlg", "feature_leaf", []),
         ("mgda", "task_grads", [])]


def head_grads_after_one_strategy_pass(tmp_path, method, strategy, extra, heads):
    """(each head's gradient after the strategy's pass, each head's own-loss gradient by autograd, the method)."""
    from mtl.parallel.dist import all_reduce_sum
    from mtl.run.trainer import Trainer
    from mtl.strategies.base import StepInputs

    source = "features" if strategy == "feature_leaf" else "parameters"
    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path / heads}", "trainer.progress=false",
                                         f"weighting.method={method}", f"ddp.strategy={strategy}",
                                         f"weighting.source={source}", f"weighting.heads={heads}", *extra])
    p, batch = trainer.parts, next(trainer.batches())[1]
    p.bare.train()
    for t in p.tasks:
        p.bare.heads[t].prepare(batch, all_reduce_sum)
    losses = p.bare(batch)["losses"]
    own = {t: torch.autograd.grad(losses[t], list(p.bare.heads[t].parameters()), materialize_grads=True)
           for t in p.tasks}
    p.weighting.begin_step(0, p.tasks)
    p.strategy.forward_backward(StepInputs(model=p.model, batch=batch, tasks=p.tasks, weigh=p.weighting.weigh,
                                           scale=p.amp.scale, loss_scale=p.amp.loss_scale, comm=p.comm,
                                           **p.weighting.grad_hooks()))
    got = {t: [q.grad.clone() for q in p.bare.heads[t].parameters()] for t in p.tasks}
    return got, own, p.weighting


@pytest.mark.parametrize("method,strategy,extra", CASES)
def test_weighted_heads_get_w_t_times_their_gradient(tmp_path, method, strategy, extra):
    got, own, w = head_grads_after_one_strategy_pass(tmp_path, method, strategy, extra, "weighted")
    alpha = w.weights_for_heads().tolist()
    assert any(abs(a - 1.0) > 1e-3 for a in alpha), alpha  # else weighted and unweighted would look alike
    if method == "nashmtl":  # the heads get alpha before max_norm's clip (the authors clip the shared part only)
        assert alpha == w.cached and w.last_weights.tolist() != alpha
    for i, t in enumerate(w.tasks):
        for g, o in zip(got[t], own[t]):
            torch.testing.assert_close(g, alpha[i] * o, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method,strategy,extra", CASES[:2])
def test_unweighted_heads_get_their_own_gradient(tmp_path, method, strategy, extra):
    got, own, w = head_grads_after_one_strategy_pass(tmp_path, method, strategy, extra, "unweighted")
    for t in w.tasks:
        for g, o in zip(got[t], own[t]):
            torch.testing.assert_close(g, o, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides,message", [
    (["weighting.heads=weighted"], "but not read: weighting.method=equal does not read it"),  # loss-level
    (["weighting.method=graddrop", "ddp.strategy=task_grads", "weighting.heads=weighted"], "weighting.heads"),
    (["weighting.method=mgda", "ddp.strategy=task_grads", "weighting.heads=weigthed"], "did you mean 'weighted'?"),
    (["weighting.method=mgda", "ddp.strategy=task_grads", "weighting.heads=weighted", "parallel.engine=fsdp2"],
     "does not run with parallel.engine=fsdp2"),
])
def test_heads_is_refused_where_it_means_nothing(tmp_path, overrides, message):
    from mtl.setup.checks import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"output_dir={tmp_path}", *overrides])
    assert any(message in x and "weighting.heads" in x for x in e.value.errors), e.value.errors


def test_bench_entries_carry_heads():
    from mtl.bench.entries import entry_heads, method_spec, without_source
    from mtl.bench.regimes import method_errors, method_overrides
    from mtl.setup.checks import load_run_config

    entry = "nashmtl(max_norm=1.0, heads=weighted)"
    assert method_spec(entry) == ("nashmtl", {"max_norm": 1.0}, "parameters") and entry_heads(entry) == "weighted"
    assert "weighting.heads=weighted" in method_overrides(entry) and "heads" not in " ".join(method_overrides("mgda"))
    assert without_source("nashmtl(heads=weighted, source=features)") == "nashmtl(heads=weighted)"
    cfg = load_run_config(TINY, [])
    assert method_errors(cfg, [entry, "mgda(heads=weighted)"]) == []
    errors = method_errors(cfg, ["equal(heads=weighted)"])
    assert len(errors) == 1 and "weighting.heads: weighted applies to" in errors[0] and "equal" in errors[0]
