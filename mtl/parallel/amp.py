"""Mixed precision: autocast for bf16/fp16, and a GradScaler for fp16 only.

fp16 scales each task's loss on its own (``scale(loss).backward()`` per pass), unscales once before
clipping and updates once per step. The step itself (``optimizer.step()``, skipped on an inf/NaN
gradient) is taken in mtl/run/step.py, in plain sight; the scaler only scales, unscales and updates.
bf16 needs no scaler. Both work on CPU and CUDA.

Under FSDP2 (``sharded=True``) the scaler is torch's ``ShardedGradScaler``: a rank's ``unscale_`` sees only its
gradient shards (DTensors), so an overflow may show on one rank only; ShardedGradScaler all-reduces its found-inf
flag over the ranks in ``unscale_``, so every rank backs its scale off together (tested in tests/test_fsdp.py:
FSDP2 fp16 == DDP fp16, an overflow skipped on both ranks). DDP's ranks hold the same averaged gradients and need
no such collective.
"""

from __future__ import annotations

import warnings

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Amp:
    def __init__(self, precision: str, device: torch.device, sharded: bool = False):
        self.precision = precision
        self.device_type = device.type
        self.sharded = sharded
        self.scaler = None
        if precision == "fp16" and sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device_type)
        elif precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device_type)
        self.dtype = DTYPES.get(precision)  # the model's autocast dtype; None for fp32

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def unscale_(self, optimizer) -> None:
        if self.scaler is None:
            return
        if not self.sharded:
            self.scaler.unscale_(optimizer)
            return
        with warnings.catch_warnings():  # ShardedGradScaler's (1,)-shaped inverse scale meets DTensor gradients
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.scaler.unscale_(optimizer)

    def update(self) -> None:
        """After the step (taken or skipped): the GradScaler backs its scale off if ``unscale_`` found an
        inf/NaN gradient, and grows it after a run of good steps. Nothing without a scaler."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
