"""Methods with state survive a real resume bitwise: a run stopped at a checkpoint and resumed ends with the
same bytes as the run that never stopped (in-process train.py, one process, tiny.yaml).

The unit tests (tests/test_weighting.py) round-trip each method's ``state_dict`` by hand; this is the same
through the trainer's checkpoint (``trainer_state.pt``, loaded to the CPU with ``weights_only=True``),
for the methods whose state is not a buffer of fixed shape: K x P tensors in extra state (dbmtl,
excessmtl), the EMA targets and step of gradvac, stch's nadir and loss history, nashmtl's reused alpha.
"""

from __future__ import annotations

import pytest

from .conftest import TINY

CASES = {
    "dbmtl": ["ddp.strategy=task_grads"],
    "excessmtl": ["ddp.strategy=task_grads"],
    "gradvac": ["ddp.strategy=task_grads"],
    "nashmtl": ["ddp.strategy=task_grads", "weighting.options.update_every=3"],
    "stch": ["weighting.options.warmup_steps=2", "weighting.options.nadir_steps=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CASES))
def test_a_resumed_run_ends_bitwise_equal_to_an_unbroken_one(tmp_path, method):
    import train

    common = ["--config", TINY, f"weighting.method={method}", *CASES[method], "checkpoint.every_steps=2",
              "trainer.eval_every=1000", "trainer.progress=false"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train.main([*common, f"output_dir={whole}", "trainer.max_steps=5"]) == 0
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=3"]) == 0  # checkpoints at 2 and 3
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=5", "resume=auto"]) == 0  # from step 3
    a = (whole / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    b = (cut / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    assert a == b
