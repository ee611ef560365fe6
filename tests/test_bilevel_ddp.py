"""The bilevel weighting methods, proven under DDP: 2 processes x batch B == 1 process x batch 2B after 2 steps,
held-out batches included (the one proof of the claim in mtl/weighting/bilevel.py; in the full suite, like the other parity proofs).

One spawn of three workers, as tests/test_weighting_ddp.py (see its docstring for float64, SGD and GroupNorm):
workers 0 and 1 are a 2-rank gloo run with data.batch_size=B, worker 2 a single process with 2B. Each runs every
method with ``needs_heldout_batch`` for 2 steps with a meta update at each, 8 held-out items (one global batch:
the held-out stream changes epoch between the steps), and compares the parameters, the weights and the
method's state. The negative control: Auto-Lambda's hypergradient at step 0 from each rank's LOCAL gradients (no
rank average) misses the single process's by far, while the rank-averaged one the method used matches it.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from mtl.weighting import weighting_types

from .conftest import TINY, end_state, parity_worker, spawn_parity_runs
from .test_weighting_ddp import DTYPE, bitwise_equal, max_rel_diff

B = 4
STEPS = 2
TOL = 1e-5
# the method's state (Adam's moments of lambda): the hypergradient is a central difference of the float32 losses the
# model returns, (L(+) - L(-)) / 2 eps, which divides their rounding (~1e-7 relative) by a small difference (5e-6 seen)
STATE_TOL = 1e-4
METHODS = sorted(n for n, c in weighting_types().items() if c.needs_heldout_batch)
DEADLINE_S = 300
# options that move the weights visibly within the steps
EXTRA = {"autolambda": ["weighting.options.lr=0.01"], "moml": ["weighting.options.lr=0.01"],
         "forum": ["weighting.options.rho=1.0"]}


def _to64(batch):
    return {k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def _runs(world, out_dir):
    from mtl.run.trainer import Trainer
    from mtl.weighting.autolambda import autolambda_hypergradient
    from mtl.weighting.bilevel import ModelVector

    torch.set_default_dtype(DTYPE)
    results, captured = {}, {}
    for method in METHODS:
        trainer = Trainer.from_config(TINY, [
            f"output_dir={os.path.join(out_dir, f'world{world}', method)}", f"data.batch_size={2 * B // world}",
            "optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0", "optim.warmup_steps=0",
            "trainer.progress=false", "ddp.timeout_s=60", f"weighting.method={method}", "data.heldout=8",
            *EXTRA.get(method, [])])
        assert trainer.dist.world_size == world
        collate = trainer.feed.heldout.collate
        trainer.feed.heldout.collate = lambda recs, c=collate: _to64(c(recs))
        if method == "autolambda":  # the negative control: the same hypergradient without the rank averages
            meta_step = trainer.weighting.meta_step

            def spy(meta, w=trainer.weighting, meta_step=meta_step):
                if "local" not in captured:
                    mv = ModelVector(meta.model)
                    captured["local"] = autolambda_hypergradient(
                        lambda th: mv.losses(th, meta.batch, w.tasks), lambda th: mv.losses(th, meta.heldout,
                                                                                            w.primary).sum(),
                        mv.vector(), w.lam, float(meta.lr), float(w.options.fd_eps))[0]
                stats = meta_step(meta)
                captured.setdefault("reduced", torch.stack([stats[f"meta_hypergrad/{t}"] for t in w.tasks]))
                return stats

            trainer.weighting.meta_step = spy
        batches = trainer.batches()
        trainer.bare.train()
        for _ in range(STEPS):
            trainer.step_once(_to64(next(batches)[1]))
        results[method] = end_state(trainer, heldout=trainer.feed.heldout.state_dict())
    return {"results": results, "captured": captured}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    worker = functools.partial(parity_worker, _runs)
    return spawn_parity_runs(worker, tmp_path_factory, "bilevel_ddp", DEADLINE_S, "bilevel DDP")


@pytest.mark.slow  # one 3-process spawn, about 30 s: the full suite's, like the other parity proofs
@pytest.mark.parametrize("method", METHODS)
def test_two_processes_equal_one_process_on_the_global_batch_held_out_batches_included(runs, method):
    r0, r1, single = (runs[k]["results"][method] for k in ("rank0", "rank1", "single"))
    for part in ("model", "weighting", "weights", "heldout"):  # the two ranks are replicas, bit for bit
        assert bitwise_equal(r0[part], r1[part]), (method, part)
    assert r0["heldout"] == single["heldout"] == {"epoch": 1, "samples": 8, "size": 8}  # the stream's global position
    model, weights = max_rel_diff(single["model"], r0["model"]), max_rel_diff(single["weights"], r0["weights"])
    state = max_rel_diff(single["weighting"], r0["weighting"])
    init = weighting_types()[method].Options().init
    moved = max(abs(v - init) for v in single["weights"].values())
    print(f"{method}: parameters {model:.1e}, weights {weights:.1e}, state {state:.1e}; weights moved {moved:.1e}")
    assert moved > 1e-4  # the meta updates did move the weights (else the comparison would test nothing)
    assert model <= TOL and weights <= TOL and state <= STATE_TOL, (method, model, weights, state)


@pytest.mark.slow
def test_the_hypergradient_without_rank_averages_misses_the_bar(runs):
    truth = runs["single"]["captured"]["reduced"]  # no process group: the global batch's
    right, local = runs["rank0"]["captured"]["reduced"], runs["rank0"]["captured"]["local"]

    def rel(a, b):
        return float((a - b).abs().max() / a.abs().max())

    print(f"hypergradient: rank-averaged {rel(truth, right):.1e}, rank 0's local {rel(truth, local):.1e}")
    assert rel(truth, right) <= STATE_TOL and rel(truth, local) > 1e3 * STATE_TOL
