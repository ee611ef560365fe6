"""Training throughput and model FLOPs utilisation (MFU) of one process:

    python -m mtl.tools.throughput --config configs/gpu.yaml [--steps 100] [--warmup 10]
                                   [--peak-tflops X] [--json out.json] [key=value ...]

One process builds the run (``Trainer.from_config``; no torchrun needed), takes ``warmup`` untimed steps, then
times ``steps`` optimizer steps on the run's own training batches (the loader included, as in training).

Model FLOPs: one more step, untimed, under ``torch.utils.flop_counter.FlopCounterMode``, which counts the
matrix products and convolutions of the forward and backward passes (the optimizer's element-wise work and
the weighting maths are not model FLOPs). MFU = FLOPs per step x steps per second / the device's peak dense
rate for the run's precision: ``--peak-tflops``, or for a GPU whose name this tool knows, its vendor figure
(``PEAK_TFLOPS``). On a device it does not know and with no ``--peak-tflops``, MFU is not reported.

Samples per second counts the step's rows (``batch_size`` images; in multi-input mode the rows of every task).
On CUDA the clock waits for the device (``torch.cuda.synchronize``) before reading the time.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from mtl.run.error_report import run_guarded
from mtl.run.trainer import Trainer
from mtl.tools import tool_parser

# Dense (no sparsity) peak TFLOP/s by the vendor's datasheets, per compute precision; a name matches when it
# is a substring of torch.cuda.get_device_name(). H200 SXM has the H100 SXM's matrix rates. fp32 is the plain
# fp32 rate: mtl leaves torch's default float32 matmul precision ("highest", no TF32).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 80GB HBM3": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # the SXM part
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}


def known_peak(device_name: str, precision: str) -> float | None:
    """The datasheet peak in FLOP/s for a device name and precision, or None."""
    for name, rates in PEAK_TFLOPS.items():
        if name in device_name:
            return rates.get(precision, rates["fp32"]) * 1e12
    return None


def count_flops(fn) -> int:
    """The FLOPs ``fn()`` runs in matrix products and convolutions, forward and backward (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def rows_of(batch: dict) -> int:
    """The number of training rows in a step's batch (in multi-input mode every task's rows are in its images)."""
    return int(batch["index"].shape[0])  # every batch has one index per row (images, or QM9's molecules)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: str, overrides: list[str], steps: int, warmup: int, peak_tflops: float | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer.from_config(config, [*overrides, f"output_dir={tmp}/run", "trainer.progress=false", "resume=null",
                                         "checkpoint.every_steps=0"])
        try:
            stream = t.batches()
            for _ in range(warmup):
                t.step_once(next(stream)[1])
            _sync(t.device)
            rows = 0
            start = time.perf_counter()
            for _ in range(steps):
                batch = next(stream)[1]
                rows += rows_of(batch)
                t.step_once(batch)
            _sync(t.device)
            seconds = time.perf_counter() - start
            batch = next(stream)[1]
            flops = count_flops(lambda: t.step_once(batch))
        finally:
            t.close()
        precision = str(t.cfg.precision)
        device = torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else f"{t.device.type} (CPU)"
    peak = peak_tflops * 1e12 if peak_tflops else (known_peak(device, precision) if t.device.type == "cuda" else None)
    achieved = flops * steps / seconds
    return {"device": device, "precision": precision, "steps": steps, "seconds": seconds,
            "samples_per_s": rows / seconds, "step_ms": seconds / steps * 1e3, "flops_per_step": flops,
            "achieved_tflops": achieved / 1e12, "peak_tflops": peak / 1e12 if peak else None,
            "mfu": achieved / peak if peak else None}


def report(r: dict) -> str:
    lines = [f"device {r['device']}, precision {r['precision']}, {r['steps']} timed steps in {r['seconds']:.1f} s",
             f"  {r['samples_per_s']:.1f} samples/s, {r['step_ms']:.1f} ms/step",
             f"  model FLOPs per step {r['flops_per_step'] / 1e9:.2f} GFLOP (FlopCounterMode, forward + backward), "
             f"achieved {r['achieved_tflops']:.2f} TFLOP/s"]
    if r["mfu"] is None:
        lines.append("  MFU: no peak known for this device; pass --peak-tflops")
    else:
        lines.append(f"  MFU {r['mfu'] * 100:.1f}% of {r['peak_tflops']:.1f} TFLOP/s (dense {r['precision']} peak)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = tool_parser("mtl.tools.throughput", __doc__, "configs/gpu.yaml", "key=value config overrides")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak for the precision")
    p.add_argument("--json", default=None, help="also save the numbers here")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")

    def go():
        r = measure(a.config, a.overrides, a.steps, a.warmup, a.peak_tflops)
        print(report(r))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)

    return run_guarded(go)  # a bad config, data or checkpoint: one line naming it, its exit code


if __name__ == "__main__":
    sys.exit(main())
