"""mtl.tools.throughput (the GPU report's samples/s and MFU), checked on the CPU: the FLOP count against the
analytic count of a linear layer, the datasheet lookup, and the report's arithmetic on a tiny run."""

from __future__ import annotations

import pytest
import torch

from mtl.tools.throughput import count_flops, known_peak, measure

from .conftest import TINY


@pytest.mark.parametrize("input_grad", [False, True])
def test_flops_of_a_linear_layer_forward_and_backward(input_grad):
    b, n_in, n_out = 8, 16, 4
    layer = torch.nn.Linear(n_in, n_out)
    x = torch.randn(b, n_in, requires_grad=input_grad)
    flops = count_flops(lambda: layer(x).sum().backward())
    # forward x W^T: 2 b n_in n_out; backward: the weight's gradient, and the input's when it needs one
    assert flops == 2 * b * n_in * n_out * (3 if input_grad else 2)


def test_the_datasheet_peak_is_found_by_device_name():
    assert known_peak("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert known_peak("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert known_peak("NVIDIA GeForce GTX 1080", "bf16") is None


@pytest.mark.slow  # two in-process runs, about 15 s
def test_a_tiny_run_reports_consistent_figures():
    r = measure(TINY, ["data.batch_size=4"], steps=2, warmup=1, peak_tflops=2.0)
    assert r["samples_per_s"] == pytest.approx(2 * 4 / r["seconds"])
    assert r["flops_per_step"] > 0
    assert r["achieved_tflops"] == pytest.approx(r["flops_per_step"] * 2 / r["seconds"] / 1e12)
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 2.0)
    half = measure(TINY, ["data.batch_size=2"], steps=1, warmup=0, peak_tflops=None)
    assert half["mfu"] is None  # a CPU with no peak given: no MFU
    assert 0 < half["flops_per_step"] < r["flops_per_step"]  # fewer rows, fewer model FLOPs
