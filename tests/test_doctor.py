"""The gradient doctor, in one process on the tiny config."""

import json
import subprocess

from .conftest import PY, ROOT, TINY


def test_doctor_reports_reach_norms_conflict_costs_and_a_recommendation():
    proc = subprocess.run([PY, "-m", "mtl.doctor", "--config", TINY, "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["reach"]["cls"]["heads.cls.fc"] == "non-zero" and r["reach"]["cls"]["heads.gen.decoder"] == "none"
    assert r["reach"]["gen"]["heads.cls.fc"] == "none" and r["reach"]["gen"]["heads.gen.decoder"] == "non-zero"
    assert all(r["reach"][t]["backbone.stem.0"] == "non-zero" for t in ("cls", "gen"))
    assert r["grad_norms"]["cls"] > 0 and r["grad_norms"]["gen"] > 0 and not any(r["nonfinite"].values())
    assert -1.0 <= r["cosine"]["cls/gen"] <= 1.0
    s = r["strategies"]
    assert s["find_unused"]["allreduces"] == 2 and s["feature_leaf"]["allreduces"] == 1
    assert s["find_unused"]["bytes_allreduced"] == 2 * s["combined"]["bytes_allreduced"]
    assert s["detach"]["exact_combined_gradient"] is False
    assert r["recommendation"]["strategy"] == "feature_leaf"


def test_doctor_recommends_task_grads_for_gradient_level_weighting():
    proc = subprocess.run([PY, "-m", "mtl.doctor", "--config", TINY, "--json", "weighting.method=pcgrad",
                           "ddp.strategy=task_grads"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["recommendation"]["strategy"] == "task_grads"


def test_doctor_bad_config_is_one_message():
    proc = subprocess.run([PY, "-m", "mtl.doctor", "--config", TINY, "ddp.strategy=nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ddp.strategy" in proc.stderr and "Traceback" not in proc.stderr
