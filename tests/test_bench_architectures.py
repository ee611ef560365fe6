"""python -m mtl.tools.bench.architectures: a row per architecture and variant, each against hps with the same
variant, and the parameter count each architecture adds. The timings themselves are the benchmark's (docs), not
a test's."""

from __future__ import annotations

import pytest

from mtl.tools.bench import architectures as bench

from .conftest import TINY


@pytest.mark.slow
def test_the_tool_prints_a_row_per_architecture_and_variant(capsys):
    assert bench.main(["--config", TINY, "--architectures", "mmoe", "--steps", "1", "--warmup", "0"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| hps")
            or line.startswith("| mmoe")]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [(a, v) for a in ("hps", "mmoe") for v in bench.VARIANTS]
    assert all(r[4].strip() == "1.00x" and r[6].strip() == "1.00x" for r in rows[:3])  # hps against itself
    hps, mmoe = (int(rows[i][1].replace(",", "")) for i in (0, 3))
    assert mmoe > hps  # the experts and gates
