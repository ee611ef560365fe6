"""scripts/qm9_size_probe.py's reading of a size, on runs written here with known numbers."""

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.slow  # a tool's check (it imports scipy and the bench): the full suite, not the fast tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["mu", "alpha", "homo", "lumo", "r2", "zpve", "U0", "U", "H", "G", "Cv"]


def probe():
    spec = importlib.util.spec_from_file_location("qm9_size_probe", os.path.join(ROOT, "scripts", "qm9_size_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIZE = ["data.qm9.train_size=8000", "trainer.max_steps=120"]  # a size's overrides, as the probe's --size gives them


def write_run(run_dir, test_mae, rising=0.0, entry="equal", seed=0, train_size=8000, last_step=120, nan=False):
    """12 evaluations: the validation MAE of every task 100 * (1 + rising * step / 100) (so its slope is ``rising``
    in %/100 steps at step 0's level, about that at the last ten's), the best validation Δm at step 60 with
    ``test_mae``, and at step 120 a decoy with better test MAEs but a worse validation Δm. Its config.yaml records
    ``entry``, ``seed`` and ``train_size``; final_metrics.json its last step."""
    import yaml

    name, _, rest = entry.partition("(")
    source = "features" if "source=features" in rest else "parameters"
    os.makedirs(run_dir)
    config = {"seed": seed, "weighting": {"method": name, "source": source, "options": {}},
              "data": {"qm9": {"train_size": train_size}}, "trainer": {"max_steps": 120}}
    (open(os.path.join(run_dir, "config.yaml"), "w")).write(yaml.safe_dump(config))
    (open(os.path.join(run_dir, "final_metrics.json"), "w")).write(json.dumps({"step": last_step}))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "kind": "train", "loss_mu": 1.0}) + "\n")
        for step in range(10, 130, 10):
            row = {"step": step, "kind": "eval", "plateau_delta_m": 50.0 if step == 60 else 100.0 - step / 100}
            for t in TASKS:
                row[f"{t}_mae"] = 100 * (1 + rising * step / 10000)
                row[f"test_{t}_mae"] = test_mae / 2 if step == 120 else test_mae if step == 60 else 9.0
            if nan and step == 60:
                row["test_lumo_mae"] = float("nan")
            f.write(json.dumps(row) + "\n")


def test_the_probe_reads_the_selected_evaluation_paired_by_seed(tmp_path, capsys):
    script = probe()
    methods = ["equal", "cagrad(source=features)"]
    # equal: test MAE 2, 4, 6 on seeds 0-2 (mean 4); cagrad 10% of that mean lower, plus 0, 0.04, 0.08
    for seed, (base, shift) in enumerate([(2.0, 0.0), (4.0, 0.04), (6.0, 0.08)]):
        write_run(script.folder(str(tmp_path), "s", "equal", seed), base, rising=1.0, seed=seed)
        write_run(script.folder(str(tmp_path), "s", methods[1], seed), base - 0.4 + shift, entry=methods[1],
                  seed=seed)
    reading = script.report(str(tmp_path), "s", SIZE, methods, [0, 1, 2], comparisons=8)
    diffs = reading["methods"][methods[1]]["diffs"]
    assert diffs == pytest.approx([-10.0, -9.0, -8.0])  # (MAE - equal's) / equal's mean MAE 4, in %
    assert reading["methods"][methods[1]]["ratio"] == pytest.approx(9.0)  # mean 9 over sd 1
    p = 1 - 0.05 / 16  # Holm's strictest level over 8 comparisons, two-sided; t(2)'s quantile in closed form:
    assert reading["need"] == pytest.approx((2 * p - 1) / (2 * p * (1 - p)) ** 0.5 / 3 ** 0.5)  # over sqrt(3)
    assert all(0.9 < v < 1.0 for v in reading["slopes"].values())  # +1% of step 0's level, a bit less of the mean
    assert "| `cagrad(source=features)` | -10.00, -9.00, -8.00 |" in capsys.readouterr().out


def test_a_size_needs_its_name(tmp_path):
    with pytest.raises(SystemExit):
        probe().main(["--out", str(tmp_path), "--size", "data.qm9.train_size=8000", "--analyse-only"])


@pytest.mark.parametrize("fault, says", [
    ({"train_size": 2000}, "data.qm9.train_size is 2000, this size asks for 8000"),  # a stale run of another size
    ({"seed": 5}, "seed is 5, this size asks for 0"),
    ({"entry": "cagrad(source=features)"}, "weighting.method is 'cagrad', this size asks for 'equal'"),
    ({"last_step": 60}, "stopped at step 60 of 120"),
    ({"nan": True}, "non-finite at step 60: lumo"),
])
def test_the_probe_refuses_a_run_that_is_not_the_one_asked_for(tmp_path, fault, says):
    script = probe()
    run_dir = script.folder(str(tmp_path), "s", "equal", 0)
    write_run(run_dir, 1.0, **fault)
    with pytest.raises(SystemExit) as e:
        script.read(run_dir, script.expected_settings(SIZE, "equal", 0))
    assert says in str(e.value) and run_dir in str(e.value)
    write_run(str(tmp_path / "good"), 1.0)  # the same reading of a run that matches passes
    assert script.read(str(tmp_path / "good"), script.expected_settings(SIZE, "equal", 0))["step"] == 60
