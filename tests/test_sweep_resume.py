"""A sweep launched again after it was killed (its job killed, a node lost, a Ctrl-C): an unfinished run with a
complete checkpoint of the same configuration resumes from it (resume=auto) and ends as the uninterrupted run, byte
for byte; one without a checkpoint, or whose checkpoint is another configuration's, starts from scratch; the sweep
says which, per run, in one line (issue 35.2)."""

import json
import os
import shutil
import subprocess
import time

import pytest

from .conftest import PY, ROOT, TINY
from .proctree import kill_tree
from .resume_check import metrics_records

ARGS = ["trainer.max_steps=60", "trainer.eval_every=30", "trainer.log_every=1", "checkpoint.every_steps=4",
        "trainer.num_samples=0", "bench.seeds=[0]", "bench.last_k=2", "bench.methods=[equal]",
        "bench.baselines=false", "bench.select=last", "bench.parallel=1", "bench.threads=1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _sweep(out):
    return [PY, "-m", "mtl.tools.bench.sweep", "--config", TINY, f"output_dir={out}", *ARGS]


def _planned(out):
    """The run's entry of the sweep's plan, with its identity (what ``run_all`` gives ``begin``)."""
    from mtl.bench.record import run_identity
    from mtl.bench.regimes import plan, regime_configs
    from mtl.setup.checks import load_run_config

    over = [f"output_dir={out}", *ARGS]
    loaded, errors = regime_configs(load_run_config(TINY, over), TINY, over)
    assert not errors, errors
    (r,) = plan(load_run_config(TINY, over), loaded=loaded)
    r["config"], r["code"] = run_identity(TINY, [*over, *r["overrides"]], 1)
    return r


@pytest.mark.slow
def test_a_sweep_launched_again_resumes_an_unfinished_run_from_its_checkpoint(tmp_path):
    from mtl.bench.runs import earlier_attempt

    out = tmp_path / "bench"
    run = out / "runs" / "natural" / "equal" / "seed0"
    r = _planned(out)
    # the same run uninterrupted: train.py with the sweep's own overrides for it, in another folder
    over = [o for o in r["overrides"] if not o.startswith("output_dir=")]
    reference = subprocess.run([PY, os.path.join(ROOT, "train.py"), "--config", TINY, f"output_dir={out}", *ARGS,
                                *over, f"output_dir={tmp_path / 'reference'}"], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]

    first = subprocess.Popen(_sweep(out), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_4" / "manifest.json").exists():
        assert first.poll() is None and time.time() < deadline, "the sweep ended before its run's first checkpoint"
        time.sleep(0.05)
    kill_tree(first.pid)  # the sweep's job killed, the node lost: the sweep and its run at once, no save
    first.wait()
    # the kill happened mid-run: a complete checkpoint, no finished record
    assert not (run / "final_metrics.json").exists()
    saved = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert saved and saved[-1] < 60, saved

    # what the sweep decides for other leftovers: no checkpoint, or another configuration's: from scratch
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "run.json").write_text("{}")
    assert earlier_attempt({**r, "dir": str(bare)}) == (
        None, "from scratch: an unfinished earlier attempt left no complete checkpoint")
    other = tmp_path / "other"
    shutil.copytree(run, other)
    path, how = earlier_attempt({**r, "dir": str(other), "config": {**r["config"], "seed": 1}})
    assert path is None and how.startswith("from scratch: an unfinished earlier attempt has a checkpoint, but its "
                                           "configuration changed: seed: 0 -> 1"), how
    path, how = earlier_attempt({**r, "dir": str(other)})
    step = int(os.path.basename(path).split("_")[1])
    assert step == saved[-1] and how.endswith(f"from its newest checkpoint, step {step} (resume=auto)"), how

    again = subprocess.run(_sweep(out), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:] + again.stdout[-3000:]
    line = [ln for ln in again.stdout.splitlines() if "natural equal seed 0: training" in ln]
    assert line == [f"[1/1] natural equal seed 0: training (local), resuming an unfinished earlier attempt from its "
                    f"newest checkpoint, step {step} (resume=auto)"], again.stdout[-3000:]
    log = (run / "log.txt").read_text()
    assert f"resume=auto: resuming from {run / 'checkpoints' / f'step_{step}'}" in log, log[-3000:]
    # each step trained once across the two attempts; the final model and metrics are the uninterrupted run's
    steps = [x["step"] for x in metrics_records(str(run)) if x.get("kind") == "train"]
    assert steps == list(range(1, 61)), steps
    final = os.path.join("checkpoints", "step_60", "model.safetensors")
    assert (run / final).read_bytes() == (tmp_path / "reference" / final).read_bytes()
    ours, theirs = (json.loads((d / "final_metrics.json").read_text()) for d in (run, tmp_path / "reference"))
    assert {k: v for k, v in ours.items() if k != "wall_time_s"} == {k: v for k, v in theirs.items()
                                                                      if k != "wall_time_s"}
    assert [json.loads(x)["status"] for x in (out / "runs.jsonl").read_text().splitlines()] == ["ok"]
