"""Smoke test of ``python -m mtl.tools.bench.ved_step`` (mtl vs a plain transformers loop on a ViT + GPT-2): tiny
sizes, one step; it prints its rows with a time and a peak memory each. No timing is asserted (the numbers are
docs/scale.md's)."""

from __future__ import annotations

import pytest

TINY_ARGS = ["--hidden=32", "--layers=1", "--decoder-layers=1", "--image=32", "--batch=2", "--steps=1", "--warmup=1"]


@pytest.mark.slow  # builds three tiny trainers
def test_the_benchmark_prints_a_row_per_variant_with_its_time_and_peak_memory(capsys):
    from mtl.tools.bench import ved_step

    assert ved_step.main([*TINY_ARGS, "--no-compile"]) == 0
    rows = [r.split("|")[1:-1] for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["plain", "mtl", "mtl+ckpt"]
    assert "x of plain" in rows[2][2] and "x of mtl" in rows[3][2] and "x of plain" in rows[2][4]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows[1:])  # a step time and a peak memory each
