"""A task really is one file: docs/examples/dominant_colour.py, copied outside the package and named in the
config's ``task_modules``, builds, batches, trains (2 processes), logs and is benchmarked, with no other edit."""

import csv
import json
import os
import subprocess

import pytest
import torch

from mtl.data.synthetic import COLOUR_NAMES
from mtl.errors import ConfigError, DataError
from mtl.setup.build import build_run_inputs
from mtl.setup.checks import load_run_config

from .conftest import PY, ROOT, TINY, example_outside, run_train

task_file = example_outside("dominant_colour.py", "my_colour_task.py")  # the example, copied where no mtl code is


def test_the_new_task_builds_batches_and_computes_a_loss_from_the_synthetic_scene(task_file, tmp_path):
    cfg = load_run_config(TINY, [f"task_modules=[{task_file}]", "tasks=[cls,gen,colour]",
                                 "task_options.colour.label_smoothing=0.1", f"output_dir={tmp_path / 'run'}"])
    assert cfg.task_options.colour == {"label_smoothing": 0.1}  # its typed section, filled and checked
    run = build_run_inputs(cfg)
    batch = next(iter(run.train_loader()))
    # the task's own field, made from each raw record's colour (which synthetic.py draws for its captions)
    records = [run.train_ds[i] for i in batch["index"].tolist()]
    assert batch["colour_label"].dtype == torch.long
    assert batch["colour_label"].tolist() == [COLOUR_NAMES.index(r["colour"]) for r in records]
    assert batch["label"].tolist() == [r["label"] for r in records] and "input_ids" in batch  # the others' too
    losses = run.model(batch)["losses"]
    assert set(losses) == {"cls", "gen", "colour"} and torch.isfinite(losses["colour"])
    assert run.model.heads["colour"].smoothing == 0.1
    assert not (tmp_path / "run").exists()  # the builder is read-only


def test_the_new_task_s_options_and_module_are_checked(task_file):
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"task_modules=[{task_file}]", "tasks=[cls,colour]",
                               "task_options.colour.label_smothing=0.1", "task_options.cls.x=1"])
    text = str(e.value)
    assert "did you mean 'task_options.colour.label_smoothing'" in text and "task_options.cls" in text
    with pytest.raises(ConfigError, match=r"label_smoothing: must be in \[0, 1\)"):
        load_run_config(TINY, [f"task_modules=[{task_file}]", "tasks=[cls,colour]",
                               "task_options.colour.label_smoothing=1.5"])
    with pytest.raises(ConfigError, match="task_modules: cannot import 'no_such_module_xyz'"):
        load_run_config(TINY, ["task_modules=[no_such_module_xyz]", "tasks=[cls]"])
    with pytest.raises(ConfigError, match="tasks: unknown task 'colour'"):  # without its file, no such task
        load_run_config(TINY, ["tasks=[cls,colour]"])


def _manifest(folder, with_colour: bool) -> str:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(8):
        Image.new("RGB", (12, 12), (200, 30 * i, 30)).save(folder / f"{i}.png")
        line = {"image": f"{i}.png", "label": i % 2, "caption": "a thing"}
        if with_colour:
            line["colour"] = COLOUR_NAMES[i % 3]
        lines.append(json.dumps(line))
    (folder / "m.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "m.jsonl")


def test_a_data_source_without_the_task_s_field_is_one_error_naming_task_field_and_fix(task_file, tmp_path):
    path = _manifest(tmp_path / "plain", with_colour=False)
    over = [f"task_modules=[{task_file}]", "tasks=[cls,colour]", "data.source=manifest", f"data.train_path={path}",
            f"data.val_path={path}", "data.batch_size=4", "data.image_size=16", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(DataError) as e:
        build_run_inputs(load_run_config(TINY, over))
    message = e.value.message
    assert "task 'colour' needs the field 'colour'" in message
    assert f"add a 'colour' key to every line of manifest {path}" in message and "remove 'colour' from tasks" in message
    # the same manifest with a colour on every line: the key reaches the task as a record field
    good = _manifest(tmp_path / "coloured", with_colour=True)
    over = [o.replace(path, good) for o in over]
    run = build_run_inputs(load_run_config(TINY, over))
    batch = next(iter(run.train_loader()))
    assert sorted(batch["colour_label"].tolist()) == sorted(i % 3 for i in batch["index"].tolist())


def test_an_image_folder_without_captions_serves_classification_and_refuses_captioning(tmp_path):
    from PIL import Image

    root = tmp_path / "folder"
    for c, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (10, 10), (250 * c, 20 * i, 90)).save(root / name / f"{i}.png")
    (root / "dog" / "notes.txt").write_text("not an image")
    over = ["data.source=imagefolder", f"data.train_path={root}", f"data.val_path={root}", "data.batch_size=4",
            "data.image_size=16", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(DataError) as e:
        build_run_inputs(load_run_config(TINY, over))  # tasks [cls, gen]: gen reads captions
    message = e.value.message
    assert "task 'gen' needs the field 'captions'" in message and "no captions.jsonl" in message
    assert f"add {root / 'captions.jsonl'} with one line per image" in message
    run = build_run_inputs(load_run_config(TINY, [*over, "tasks=[cls]"]))
    assert len(run.train_ds) == 8 and run.train_ds.class_names == ["cat", "dog"]
    batch = next(iter(run.train_loader()))
    assert sorted(batch["label"].tolist()) == sorted(run.train_ds[i]["label"] for i in batch["index"].tolist())
    assert set(batch) == {"image", "index", "label"} and torch.isfinite(run.model(batch)["losses"]["cls"])


def test_old_caption_keys_still_read_and_resume(tmp_path):
    """data.max_caption_tokens / trainer.num_beams moved to task_options.gen: old configs and the config.yaml of
    checkpoints written before the move are read as the new keys, so those checkpoints still resume."""
    import yaml

    from mtl.config.schema import to_yaml
    from mtl.errors import CheckpointError
    from mtl.setup.resume import verify_resume_config

    cfg = load_run_config(TINY, [f"output_dir={tmp_path}"])
    assert cfg.task_options.gen == {"max_tokens": 10, "num_beams": 1}  # tiny.yaml: task_options.gen.max_tokens 10
    old = yaml.safe_load(to_yaml(cfg))  # what a checkpoint written before the move holds
    gen = old["task_options"].pop("gen")
    old["data"]["max_caption_tokens"], old["trainer"]["num_beams"] = gen["max_tokens"], 3
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(old))
    verify_resume_config(str(ckpt), cfg)  # same caption length; the beam width is an eval setting that may change
    with pytest.raises(CheckpointError, match="task_options.gen.max_tokens: checkpoint 10, now 12"):
        verify_resume_config(str(ckpt), load_run_config(TINY, [f"output_dir={tmp_path}", "data.max_caption_tokens=12"]))
    with pytest.raises(ConfigError, match="data.max_caption_tokens .the old name. and task_options.gen.max_tokens"):
        load_run_config(TINY, ["data.max_caption_tokens=12", "task_options.gen.max_tokens=14"])


@pytest.mark.slow
def test_the_new_task_trains_under_two_processes_logs_and_is_benchmarked(task_file, tmp_path):
    out = tmp_path / "run"
    run_train(["--config", TINY, f"output_dir={out}", f"task_modules=[{task_file}]", "tasks=[cls,gen,colour]",
               "trainer.max_steps=4", "trainer.eval_every=2", "checkpoint.every_steps=0"], nproc=2)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert all(r["loss_colour"] > 0 and "weight_colour" in r for r in train) and len(train) == 4
    assert [e["step"] for e in evals] == [2, 4] and all(0.0 <= e["colour_acc"] <= 1.0 for e in evals)
    assert json.loads((out / "final_metrics.json").read_text())["world_size"] == 2
    assert (out / "curves.png").stat().st_size > 10_000

    bench = tmp_path / "bench"
    proc = subprocess.run(
        [PY, "-m", "mtl.tools.bench.sweep", "--config", TINY, f"output_dir={bench}", f"task_modules=[{task_file}]",
         "tasks=[cls,colour]", "bench.methods=[equal]", "bench.seeds=[0]", "bench.last_k=2", "trainer.max_steps=4",
         "trainer.eval_every=2", "checkpoint.every_steps=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(bench / "results.csv") as f:
        row = next(csv.DictReader(f))
    assert row["method"] == "equal" and 0.0 <= float(row["colour_acc"]) <= 1.0
    assert float(row["delta_m"]) == float(row["delta_m"])  # a number: the single_colour baseline ran too
    table = (bench / "results.md").read_text()
    assert "| method | level | source | cls_acc | colour_acc | Δm % (lower is better) |" in table  # its declared metric
    assert "Single-task baselines: cls_acc " in table and ", colour_acc " in table
