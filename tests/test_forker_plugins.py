"""A forker's plug-ins, written against the docs before the house moved (issue 46), still train: the docs' three
worked examples (a task, a weighting method, a backbone: docs/examples/), copied outside the package as a fork
keeps them, named in one run's config."""

from __future__ import annotations

import ast
import json
import os

import pytest

import mtl

from .conftest import ROOT, TINY, copy_outside, run_train

EXAMPLES = {"task_modules": "dominant_colour.py", "weighting_modules": "unit_gradients.py",
            "backbone_modules": "small_cnn.py"}


@pytest.mark.slow  # subprocesses: not in the fast tier
def test_the_docs_three_plugins_still_train_together(tmp_path):
    paths = {key: copy_outside(os.path.join(ROOT, "docs", "examples", name), tmp_path, name)
             for key, name in EXAMPLES.items()}
    imported = {node.module for path in paths.values() for node in ast.walk(ast.parse(open(path).read()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtl")}
    assert imported and not imported & set(mtl.MOVED), imported  # what the old docs import has not moved ...
    out = tmp_path / "run"
    proc = run_train(["--config", TINY, f"output_dir={out}", *(f"{key}=[{p}]" for key, p in paths.items()),
                      "tasks=[cls,colour]", "model.backbone.name=small_cnn", "weighting.method=unit_gradients",
                      "trainer.max_steps=2", "trainer.eval_every=2", "checkpoint.every_steps=0", "trainer.num_samples=0"])
    assert "moved to" not in proc.stderr, proc.stderr  # ... and nothing on the run's way imports an old name
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2 and all(r["loss_cls"] > 0 and r["loss_colour"] > 0 for r in train), train
    assert "colour_acc" in json.loads((out / "final_metrics.json").read_text())
