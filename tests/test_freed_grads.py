"""Step 7 frees the gradients between steps outside DDP (``mtl.run.step.Gradients``) and changes no result.

Multi-input mode with ``round_robin`` and ``find_unused`` leaves the absent task's head out of the graph: in step 0
the caption head gets no gradient (AdamW skips it), from step 2 on every head is absent in every other step, where
zeroed-and-kept gradients give it a zero gradient (AdamW decays it). Freed gradients with the zero gradient given
back must end bitwise where zeroed-and-kept ones do; without giving it back they must not (the case is not trivial).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.run.step import Gradients
from mtl.run.trainer import Trainer

from .conftest import ROOT

MI = os.path.join(ROOT, "configs", "multi_input.yaml")
STEPS = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _run(out_dir, free: bool, refill: bool = True) -> tuple[dict, list, set]:
    """(the model's and the optimizer's state after STEPS steps, the parameters without a gradient after each step,
    every parameter the optimizer updates)."""
    trainer = Trainer.from_config(MI, [f"output_dir={out_dir}", "data.sampling.policy=round_robin",
                                       "ddp.strategy=find_unused", "trainer.progress=false"])
    grads = trainer.parts.grads
    assert grads.free  # one process: the bare model, no DDP
    grads.free = free
    if not refill:
        grads.refill = lambda: None
    names = {id(p): n for n, p in trainer.bare.named_parameters()}
    missing = []
    try:
        for _ in range(STEPS):
            trainer.step_once()
            missing.append({names.get(id(p), "") for p in trainer.params if p.grad is None})
        state = {f"model.{k}": v.clone() for k, v in trainer.bare.state_dict().items()}
        for i, (p, s) in enumerate(trainer.optimizer.state.items()):
            state.update({f"opt.{names.get(id(p), i)}.{k}": v.clone() for k, v in s.items()})
    finally:
        trainer.close()
    return state, missing, set(names.values())


@pytest.mark.slow  # three in-process runs of 4 steps: about 9 s
def test_freed_gradients_end_bitwise_where_zeroed_ones_do_and_none_is_kept_between_steps(tmp_path):
    kept, kept_missing, _ = _run(tmp_path / "kept", free=False)
    freed, freed_missing, every = _run(tmp_path / "freed", free=True)
    assert freed_missing == [every] * STEPS  # no gradient is kept between steps
    assert kept_missing[0] and all(n.startswith("heads.gen.") for n in kept_missing[0])  # step 0: gen had none
    assert kept_missing[1:] == [set()] * (STEPS - 1)  # then zeroed and kept: each absent head has a zero one
    assert kept.keys() == freed.keys()
    assert [k for k in kept if not torch.equal(_bits(kept[k]), _bits(freed[k]))] == []
    # without the zero gradient given back, AdamW skips the absent head: the weights differ
    skipped, _, _ = _run(tmp_path / "skipped", free=True, refill=False)
    assert any(not torch.equal(_bits(kept[k]), _bits(skipped[k])) for k in kept if k.startswith("model.heads."))


def test_under_ddp_the_gradients_are_zeroed_and_kept():
    """DDP's gradients are views of its buckets (gradient_as_bucket_view): freeing them would save nothing."""
    assert not Gradients(DistributedDataParallel.__new__(DistributedDataParallel), []).free
    assert Gradients(torch.nn.Linear(1, 1), []).free
