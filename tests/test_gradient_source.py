"""weighting.source: which gradients a gradient-level method sees (fast, one process).

- the config refuses every combination that cannot work, naming the key and the fix;
- ``features`` (feature_leaf): the step's gradient is J^T sum_t w_t g_t with w the method's weights for the Gram
  matrix of the feature gradients g_t, and each head's gradient is its own loss's; checked against plain autograd;
- ``parameters`` (task_grads): the step's shared gradient is sum_t w_t G_t with w from the Gram matrix of the rows
  G_t of the shared parameters' gradients; checked against plain autograd.
The 2-process == 1-process proofs of both are in tests/test_weighting_ddp.py.
"""

from __future__ import annotations

import pytest
import torch

from mtl.errors import ConfigError
from mtl.setup.checks import load_run_config
from mtl.weighting import weighting_types
from mtl.weighting.base import GramWeighting, gram_matrix

from .conftest import TINY


def errors_of(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, list(overrides))
    return str(e.value)


def test_gram_only_is_read_from_the_class():
    from mtl.weighting.base import Weighting

    for name, cls in weighting_types().items():  # a Gram method that does not override combine, and only that
        gram = issubclass(cls, GramWeighting) and cls.combine is GramWeighting.combine
        assert cls.gram_only() == gram, name
        assert cls.level == "grad" or not gram, name
    assert not Weighting.gram_only()


def test_the_shipped_rows_methods_are_refused_with_features():
    rows = [n for n, cls in weighting_types().items() if cls.level == "grad" and not cls.gram_only()]
    for name in rows:
        assert "needs the rows of G themselves" in errors_of(f"weighting.method={name}", "weighting.source=features")


def test_bad_combinations_are_refused_with_the_fix():
    msg = errors_of("weighting.method=mgda", "ddp.strategy=feature_leaf")  # named: never replaced; source parameters
    assert "ddp.strategy=task_grads" in msg and "weighting.source=features" in msg
    msg = errors_of("weighting.method=mgda", "weighting.source=features", "ddp.strategy=task_grads")
    assert "weighting.source=features" in msg and "use ddp.strategy=feature_leaf" in msg
    msg = errors_of("weighting.method=upgrad", "weighting.source=features", "ddp.strategy=combined")
    assert "use ddp.strategy=feature_leaf" in msg
    msg = errors_of("weighting.method=equal", "weighting.source=features")
    assert "weighting.source: features applies to gradient-level methods only" in msg
    assert "is not one of parameters, features" in errors_of("weighting.method=mgda", "weighting.source=feature")
    load_run_config(TINY, ["weighting.method=mgda", "weighting.source=features"])  # the right ones pass
    load_run_config(TINY, ["weighting.method=mgda", "weighting.source=features", "parallel.engine=fsdp2"])  # test_fsdp.py
    load_run_config(TINY, ["weighting.method=mgda", "ddp.strategy=task_grads"])


def test_a_method_that_needs_the_rows_is_refused_with_features(monkeypatch):
    class Rows(GramWeighting):  # overrides combine: it needs G itself, not only G G^T
        name = "rows"

        def combine(self, grads, losses=None):
            return grads.sign().sum(0)

    assert not Rows.gram_only()
    monkeypatch.setattr("mtl.setup.checks.run_method_types", lambda cfg: {**weighting_types(), "rows": Rows})
    msg = errors_of("weighting.method=rows", "weighting.source=features")
    assert "needs the rows of G themselves" in msg and "weighting.source=parameters" in msg
    load_run_config(TINY, ["weighting.method=rows", "ddp.strategy=task_grads"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny single-process run (building it is what costs; both sources' tests share it)."""
    from mtl.run.trainer import Trainer

    tr = Trainer.from_config(TINY, [f"output_dir={tmp_path_factory.mktemp('source')}", "trainer.progress=false",
                                    "weighting.method=mgda", "weighting.source=features"])
    yield tr
    tr.close()


def _step_grads(tr, strategy: str, source: str):
    """(w, .grad after the strategy's forward_backward, the plain-autograd expectation) on one batch."""
    from mtl.parallel.dist import all_reduce_sum
    from mtl.run.step import StepInputs
    from mtl.strategies import strategy_types

    batch = dict(next(tr.batches())[1])
    for head in tr.bare.heads.values():
        head.prepare(batch, all_reduce_sum)
    model, tasks = tr.bare, tr.tasks
    shared = [p for p in model.backbone.parameters() if p.requires_grad]
    # the expectation, by plain autograd
    out = model(batch)
    feats, losses = out["features"], out["losses"]
    if source == "features":
        g = torch.stack([torch.autograd.grad(losses[t], feats, retain_graph=True)[0].reshape(-1) for t in tasks])
        w = type(tr.weighting)(tr.cfg, tasks).weights_for_gram(gram_matrix(g), None, g.dtype)
        want_shared = torch.autograd.grad(feats, shared, (w.to(g.dtype) @ g).view_as(feats), retain_graph=True)
    else:
        rows = torch.stack([torch.cat([x.reshape(-1) for x in torch.autograd.grad(losses[t], shared,
                                                                                  retain_graph=True)])
                            for t in tasks])
        w = type(tr.weighting)(tr.cfg, tasks).weights_for_gram(gram_matrix(rows), None, rows.dtype)
        want_shared = torch.split(w.to(rows.dtype) @ rows, [p.numel() for p in shared])
    want_heads = {t: torch.autograd.grad(losses[t], list(model.heads[t].parameters()), retain_graph=True,
                                         materialize_grads=True) for t in tasks}
    # the strategy
    model.zero_grad(set_to_none=False)
    wt = type(tr.weighting)(tr.cfg, tasks)
    strategy_types()[strategy](tr.cfg).forward_backward(StepInputs(
        model=tr.model, batch=batch, tasks=tasks, weigh=wt.weigh, scale=lambda x: x, combine=wt.combine,
        gram_weights=wt.weights_for_gram))
    got_shared = [p.grad.reshape(-1).clone() for p in shared]
    got_heads = {t: [p.grad.clone() for p in model.heads[t].parameters()] for t in tasks}
    return w, got_shared, want_shared, got_heads, want_heads


@pytest.mark.slow  # in-process, but building the run costs ~8 s of the fast tier's 2-minute budget
@pytest.mark.parametrize("strategy,source", [("feature_leaf", "features"), ("task_grads", "parameters")])
def test_the_update_is_the_weighted_sum_of_the_sources_gradients(tiny_run, strategy, source):
    w, got_shared, want_shared, got_heads, want_heads = _step_grads(tiny_run, strategy, source)
    assert (w - w.mean()).abs().max() > 1e-3 * w.abs().max()  # weights that are not all equal: a real test
    for got, want in zip(got_shared, want_shared):
        torch.testing.assert_close(got, want.reshape(-1), rtol=1e-5, atol=1e-9)
    for t in want_heads:  # each head: its own task's gradient, unweighted
        for got, want in zip(got_heads[t], want_heads[t]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
