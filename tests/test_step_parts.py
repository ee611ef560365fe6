"""``scripts/step_parts.py``: our loss-level step timed beside LibMTL's (or a plain PyTorch step) with each of its
extras switched off. Each switch is checked to take effect before anything is timed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "step_parts.py")


def _script():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        spec = importlib.util.spec_from_file_location("step_parts", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))


@pytest.mark.slow  # a trainer and 3 sweeps of 5 steps: about 10 s
def test_the_variants_are_timed_side_by_side_against_the_plain_step(tmp_path):
    out = tmp_path / "parts.json"
    done = subprocess.run([sys.executable, SCRIPT, "--no-libmtl", "--sweeps", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert list(got["times_s"]) == ["plain", "ours", "ours - weights check", "ours, combined",
                                    "ours, combined - weights check"]
    assert all(len(t) == 3 and all(x > 0 for x in t) for t in got["times_s"].values())
    rows = {r["variant"]: r for r in got["rows"]}
    assert rows["plain"]["ratio"] == 1.0 and rows["plain"]["extra_ms"] == 0.0  # the reference against itself
    assert "| `ours - weights check` |" in done.stdout and "paired difference to `plain`" in done.stdout


@pytest.mark.slow  # a trainer and 2 steps: about 5 s
def test_a_switch_that_does_not_take_effect_stops_the_script(tmp_path):
    """A patch that lands somewhere the step does not read (here: the weights' check patched in another
    namespace) is found before any timing: with nothing off, the check was not seen to run."""
    script = _script()
    from mtl.run.evaluate import to_device

    trainer = script.mpm.build("equal", str(tmp_path / "run"), 8)
    try:
        batch = to_device(next(trainer.batches())[1], trainer.device)
        switches = script.Switches(trainer)
        script.check_switches(trainer, switches, batch)  # as built: every switch takes effect
        switches.step = types.SimpleNamespace(params_finite=switches.own["weights_check"])  # not mtl.run.step
        with pytest.raises(SystemExit, match="with nothing off, calls {'weights_check': 0}"):
            script.check_switches(trainer, switches, batch)
    finally:
        trainer.close()


@pytest.mark.slow  # a fresh interpreter's failed import: about 3 s
def test_without_libmtl_the_script_says_so_and_times_nothing(tmp_path):
    if importlib.util.find_spec("LibMTL") is not None:
        pytest.skip("LibMTL is importable in this environment: the script would measure")
    done = subprocess.run([sys.executable, SCRIPT, "--sweeps", "3"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "LIBMTL_PATH": str(tmp_path)})
    assert done.returncode == 2 and "LibMTL is not importable" in done.stderr and "--no-libmtl" in done.stderr
    assert "|" not in done.stdout  # no table
