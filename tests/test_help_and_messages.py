"""A mistyped weighting method gets a "did you mean", and ``train.py --help``
describes every key (a comment after the field, or the comment block above it) and each method's options."""

from __future__ import annotations

import pytest

import train

from .conftest import TINY


def test_a_mistyped_weighting_method_gets_the_nearest_name(tmp_path, capsys):
    assert train.main(["--config", TINY, "weighting.method=cagrd", f"output_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "weighting.method: unknown method 'cagrd' — did you mean 'cagrad'?" in err, err


def test_help_describes_the_keys_documented_above_their_field(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    lines = {x.split()[0]: x for x in out.splitlines() if x.startswith("  ") and x.split()}
    for key, says in [("data.per_task", "multi-input: each task its own data set"),
                      ("loss_scale", "factor on its training loss"), ("data.heldout", "held out for a bilevel"),
                      ("optim.lr", "float = 0.001")]:
        assert says in lines[key], (key, lines[key])
    assert not any(k.startswith("bench.") for k in lines)  # the benchmark's keys: its own --help (below)
    # each weighting method's options with the comment of its Options dataclass
    options = out[out.index("weighting.options (method=<name>):"):]
    assert "    c: float = 0.4  # the radius of the ball around the average gradient" in options
    assert "  equal: (no options)" in options


def test_the_benchmark_s_help_describes_its_own_keys(capsys):
    from mtl.tools.bench.sweep import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    lines = {x.split()[0]: x for x in out.splitlines() if x.startswith("  ") and x.split()}
    for key, says in [("bench.regimes", "overrides: [key=value"), ("bench.heldout", "data.heldout of a bilevel"),
                      ("bench.slurm.partition", "null: the cluster's default partition"),
                      ("bench.reference.metrics", "task -> {metric: value}")]:
        assert says in lines[key], (key, lines[key])
