"""Methods with state survive a real resume bitwise: a run stopped at a checkpoint and resumed ends with the
same bytes as the run that never stopped (in-process train.py, one process, tiny.yaml).

The unit tests (tests/test_weighting.py) round-trip each method's ``state_dict`` by hand; this is the same
through the trainer's checkpoint (``trainer_state.pt``, loaded to the CPU with ``weights_only=True``),
for one method of each kind of state that is not a fixed-shape buffer: a K x P tensor in extra state
(dbmtl; excessmtl keeps the same kind), gradvac's EMA targets and step, stch's nadir and loss history, nashmtl's
warm start of its CCCP iteration (``optim_niter``).
"""

from __future__ import annotations

import pytest

from .conftest import TINY

# one of each kind of state (excessmtl's and moco's K x P extra state is dbmtl's kind; nashmtl's reused alpha is a list
# like stch's; modo's and sdmgrad's weights are fixed-shape buffers, round-tripped in tests/test_weighting.py)
CASES = {
    "dbmtl": ["ddp.strategy=task_grads"],
    "gradvac": ["ddp.strategy=task_grads"],
    # the authors' iteration: its warm start (the last update's alpha) is extra state, a list
    "nashmtl": ["ddp.strategy=task_grads", "weighting.options.optim_niter=20"],
    "stch": ["weighting.options.warmup_steps=2", "weighting.options.nadir_steps=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CASES))
def test_a_resumed_run_ends_bitwise_equal_to_an_unbroken_one(tmp_path, method):
    import train

    # a constant learning rate: a cosine schedule depends on max_steps, which the two legs of the cut run change
    common = ["--config", TINY, f"weighting.method={method}", *CASES[method], "checkpoint.every_steps=2",
              "trainer.eval_every=1000", "trainer.progress=false", "optim.scheduler=constant", "optim.warmup_steps=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train.main([*common, f"output_dir={whole}", "trainer.max_steps=5"]) == 0
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=3"]) == 0  # checkpoints at 2 and 3
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=5", "resume=auto"]) == 0  # from step 3
    a = (whole / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    b = (cut / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    assert a == b
