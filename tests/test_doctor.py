"""The gradient doctor, in one process on the tiny config, run in-process through its ``main``."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from mtl.tools.doctor import main

from .conftest import TINY


def doctor(capsys, *args):
    code = main(["--config", TINY, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_reports_reach_norms_conflict_costs_and_a_recommendation(capsys, tmp_path):
    code, out, err = doctor(capsys, "--json", f"output_dir={tmp_path / 'never'}")
    assert code == 0, err
    # it builds through mtl.setup.build.build_run_inputs (the trainer's own builder), read-only: no output_dir made
    assert not (tmp_path / "never").exists()
    r = json.loads(out)
    assert r["reach"]["cls"]["heads.cls.fc"] == "non-zero" and r["reach"]["cls"]["heads.gen.decoder"] == "none"
    assert r["reach"]["gen"]["heads.cls.fc"] == "none" and r["reach"]["gen"]["heads.gen.decoder"] == "non-zero"
    assert all(r["reach"][t]["backbone.stem.0"] == "non-zero" for t in ("cls", "gen"))
    assert r["grad_norms"]["cls"] > 0 and r["grad_norms"]["gen"] > 0 and not any(r["nonfinite"].values())
    c = r["cosine"]["cls/gen"]
    assert c["batches"] == 8 == len(c["per_batch"])  # the default: several batches, not one
    assert all(-1.0 <= v <= 1.0 for v in c["per_batch"]) and len(set(c["per_batch"])) == 8
    assert c["mean"] == pytest.approx(sum(c["per_batch"]) / 8) and 0 < c["ci95"] < float("inf")
    rec = r["recommendation"]["reason"]
    assert "95% CI over 8 batches" in rec
    # a gradient-level method is suggested only when the whole interval lies below zero (one pair: Holm changes
    # nothing, and the two-sided t-test at 5% is the 95% interval)
    assert ("conflict significantly" in rec) == (c["mean"] + c["ci95"] < 0) == c["conflict"]
    assert c["p_holm"] == c["p"] == pytest.approx(stats.ttest_1samp(c["per_batch"], 0.0).pvalue)
    s = r["strategies"]
    assert "two_backward" not in s  # unsafe: never offered
    assert s["find_unused"]["allreduces"] == 2 and s["feature_leaf"]["allreduces"] == 1
    assert s["find_unused"]["bytes_allreduced"] == 2 * s["combined"]["bytes_allreduced"]
    assert s["task_grads"]["extra_memory_bytes"] > s["feature_leaf"]["extra_memory_bytes"] > 0
    assert s["combined"]["extra_memory_bytes"] == 0
    assert s["detach"]["exact_combined_gradient"] is False
    assert r["recommendation"]["strategy"] == "feature_leaf"


def test_doctor_recommends_task_grads_for_gradient_level_weighting(capsys):
    code, out, err = doctor(capsys, "--json", "weighting.method=pcgrad", "ddp.strategy=task_grads")
    assert code == 0, err
    assert json.loads(out)["recommendation"]["strategy"] == "task_grads"


def test_doctor_bad_config_is_one_message(capsys):
    code, _, err = doctor(capsys, "ddp.strategy=nope")
    assert code == 2 and "ddp.strategy" in err and "Traceback" not in err


def test_mean_ci95_follows_students_t():
    from mtl.bench.doctor import mean_ci95

    mean, half = mean_ci95([1.0, 2.0, 3.0])  # sd 1, n 3, t(0.975, 2) = 4.303
    assert mean == 2.0 and half == pytest.approx(stats.t.ppf(0.975, 2) / 3**0.5) == pytest.approx(4.303 / 3**0.5, 1e-4)
    assert mean_ci95([0.5]) == (0.5, float("inf"))
    _, wide = mean_ci95([0.0, 1.0] * 2)
    _, narrow = mean_ci95([0.0, 1.0] * 50)  # more batches, narrower interval (t -> 1.96)
    assert narrow < wide / 5


def test_a_conflict_among_many_pairs_must_survive_holms_correction():
    """55 pairs at K = 11: the most negative mean alone is no evidence. A pair whose uncorrected p is 0.01 is not a
    conflict among 55 (Holm: 0.55); one whose p is 1e-6 is; a negative mean with a large p never is."""
    from mtl.bench.doctor import conflict_tests

    rng = np.random.default_rng(0)

    def pair(shift):
        v = rng.normal(0, 1, 8)
        return {"per_batch": list((v - v.mean()) / v.std(ddof=1) * 0.1 + shift), "mean": shift}

    t = stats.t.ppf(0.995, 7) * 0.1 / math.sqrt(8)  # a mean this far below 0 has a two-sided p of 0.01
    cosine = {f"p{i}": pair(0.05) for i in range(53)}
    cosine["weak"], cosine["strong"] = pair(-t), pair(-0.5)
    conflict_tests(cosine)
    assert cosine["weak"]["p"] == pytest.approx(0.01) and cosine["weak"]["p_holm"] > 0.05
    assert not cosine["weak"]["conflict"] and cosine["strong"]["conflict"]
    assert not any(c["conflict"] for k, c in cosine.items() if k.startswith("p"))
