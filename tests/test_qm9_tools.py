"""The gradient doctor, evaluate and predict on a graph model (configs/qm9.yaml's MPNN, QM9's first molecules):
the doctor reads the backbone's own input field, evaluate goes through the trainer's evaluation, and predict, which
takes images, refuses the model with one message."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("torch_geometric")
pytest.importorskip("rdkit")
if importlib.util.find_spec("qm9pack") is None:
    pytest.skip("qm9pack is not installed (pip install -e '.[qm9]')", allow_module_level=True)

from .conftest import ROOT  # noqa: E402

QM9_YAML = os.path.join(ROOT, "configs", "qm9.yaml")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qm9_cache"))


def small(cache_dir, out):
    """configs/qm9.yaml on QM9's first 240 molecules, with small batches."""
    return [f"output_dir={out}", f"data.qm9.cache_dir={cache_dir}", "data.qm9.molecules=240", "data.qm9.test_size=40",
            "data.qm9.val_size=40", "data.batch_size=8", "data.eval_batch_size=40", "data.num_workers=0",
            "trainer.progress=false"]


@pytest.mark.slow
def test_the_doctor_examines_a_graph_model(cache_dir, tmp_path, capsys):
    """The MPNN reads ``batch["graph"]`` (Backbone.consumes), not images: the doctor measures its shared features,
    the reach of every task's gradient and the conflict, as on an image model. (~20 s here: slow tier.)"""
    from mtl.tools.doctor import main

    code = main(["--config", QM9_YAML, "--json", "--batches", "2", *small(cache_dir, tmp_path / "never")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not (tmp_path / "never").exists()
    r = json.loads(out[out.index("{"):])  # after the note of the cache's first build
    tasks = ["mu", "alpha", "homo", "lumo", "r2", "zpve", "U0", "U", "H", "G", "Cv"]
    assert r["tasks"] == tasks and all(r["grad_norms"][t] > 0 for t in tasks)
    assert all(r["reach"][t]["backbone.gru"] == "non-zero" and r["reach"][t][f"heads.{t}.fc"] == "non-zero"
               for t in tasks)
    assert r["reach"]["mu"]["heads.U0.fc"] == "none"
    assert len(r["cosine"]) == 55 and all(c["batches"] == 2 for c in r["cosine"].values())
    # feature_leaf holds each task's gradient of the shared features: 11 x (batch 8 x 64 features) floats
    assert r["strategies"]["feature_leaf"]["extra_memory_bytes"] > 0


@pytest.mark.slow
def test_evaluate_a_graph_model_and_predict_refuses_it(cache_dir, tmp_path, capsys):
    """A 2-step QM9 run: ``evaluate`` on its checkpoint gives the run's own final validation metrics (the same
    evaluation, the head's standardisation loaded with the weights); ``predict`` takes images and refuses the
    graph model with exit 2, naming what it supports. (~20 s here: slow tier.)"""
    import train
    from mtl.tools import evaluate as evaluate_tool
    from mtl.tools import predict as predict_tool

    out = tmp_path / "run"
    assert train.main(["--config", QM9_YAML, *small(cache_dir, out), "data.qm9.train_size=8", "trainer.max_steps=2",
                       "trainer.eval_every=2"]) == 0
    final = json.loads((out / "final_metrics.json").read_text())
    capsys.readouterr()
    metrics_file = tmp_path / "m.json"
    assert evaluate_tool.main(["--checkpoint", str(out), "--device", "cpu", f"--out={metrics_file}"]) == 0
    metrics = json.loads(metrics_file.read_text())
    assert metrics["images"] == 40  # the 40 molecules of the validation split
    for t in ("mu", "U0", "Cv"):
        assert metrics[f"{t}_mae"] == pytest.approx(final[f"{t}_mae"], rel=1e-6)
        assert metrics[f"{t}_loss"] == pytest.approx(final[f"{t}_loss"], rel=1e-6)
    capsys.readouterr()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    code = predict_tool.main(["--model", str(out), "--device", "cpu", str(tmp_path / "photo.png")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "predict: takes images" in err and "(mpnn) reads 'graph' batches" in err
    assert "python -m mtl.tools.evaluate" in err and "Traceback" not in err
