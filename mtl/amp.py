"""Mixed precision: autocast for bf16/fp16, and a GradScaler for fp16 only.

fp16 scales each task's loss on its own (``scale(loss).backward()`` per pass), unscales once before
clipping and updates once per step. bf16 needs no scaler. Both work on CPU and CUDA.
"""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Amp:
    def __init__(self, precision: str, device: torch.device):
        self.precision = precision
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None
        self.dtype = DTYPES.get(precision)  # the model's autocast dtype; None for fp32

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def unscale_(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, loss_finite: bool, grad_finite: bool) -> tuple[bool, bool]:
        """Step unless something is not finite. Returns (stepped, bad).

        ``bad`` is a NaN/inf loss, or a NaN/inf gradient without a scaler. An fp16 gradient overflow
        with finite losses is the GradScaler's business (it skips and backs off): not ``bad``.
        """
        if self.scaler is None:
            ok = loss_finite and grad_finite
            if ok:
                optimizer.step()
            return ok, not ok
        if not loss_finite:
            self.scaler.update()  # unscale_ recorded the inf: back the scale off, no step
            return False, True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips by itself on inf/NaN gradients
        self.scaler.update()
        return self.scaler.get_scale() >= before, False

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
