"""Every file in configs/ validates, trains its first steps in this process on the CPU, and learns in them.

The GPU-only settings (device, bf16/fp16, SyncBatchNorm, nccl) are replaced by their CPU counterparts, and the
sizes shrunk so that each run takes seconds; the architecture choices (backbone, its norm and weights, the
decoder's layout and dropout, the optimizer and its learning rate) are the file's own. Each step sees the whole
(tiny) training set, so its loss must fall: a config that trains garbage (frozen BatchNorm on random weights, which
began at loss_cls 6.65 on 3 classes) fails here, and so does one that can never run (one that asks for more classes than the
synthetic scenes' shape kinds).
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
from PIL import Image

import train
from mtl.config.schema import load_config, unread_keys
from mtl.setup.checks import load_run_config

from .conftest import ROOT
from .pretrained_folders import local_pretrained

# the QM9 configs (molecule graphs, the qm9 extra) train their first steps in tests/test_qm9_run.py
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")) if "qm9" not in os.path.basename(p))
# The configs with the big backbones (ResNet-50/152) or a whole 4-stage ResNet-18 (the two user-data ones) take
# tens of seconds each even shrunk: the full suite runs them, the fast tier (pytest -m "not slow") the others.
BIG = {"gpu.yaml", "user_data.yaml", "multi_input_user_data.yaml", "fsdp2.yaml", "bench_gpu.yaml", "vit_gpt2.yaml"}
PARAMS = [pytest.param(p, id=os.path.basename(p), marks=[pytest.mark.slow] if os.path.basename(p) in BIG else [])
          for p in CONFIGS]


def cpu_overrides(path: str) -> list[str]:
    """What a CPU-only machine must change: only the keys whose values need a GPU."""
    cfg = load_config(path)  # keys and types only: the checks that need the overrides come after
    out = ["device=cpu", "ddp.backend=auto"]
    if cfg.precision == "fp16":
        out.append("precision=fp32")  # fp16 autocast is a GPU feature; bf16 runs on the CPU
    if cfg.model.backbone.norm == "sync":
        out.append("model.backbone.norm=group")  # SyncBatchNorm needs CUDA
    return out


def shrink(path: str) -> list[str]:
    """Sizes on top of SMALL for a config whose backbone alone takes seconds per step on a CPU: its first stage
    only (the same network family and blocks; configs/fsdp2.yaml's ResNet-152 took 43 s whole)."""
    return ["model.backbone.stages=1"] if load_config(path).model.backbone.name in BIG_BACKBONES else []


BIG_BACKBONES = {"resnet101", "resnet152", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet101_2"}


def user_data(tmp_path) -> list[str]:
    """A small manifest for configs that read user data (the same file serves as both splits)."""
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(USER_ITEMS):
        Image.new("RGB", (40, 30), (40 * i, 200 - 30 * i, 90)).save(tmp_path / "img" / f"{i}.png")
        lines.append(json.dumps({"image": f"img/{i}.png", "label": i % 3, "caption": f"picture number {i}"}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.train_path={tmp_path / 'm.jsonl'}", f"data.val_path={tmp_path / 'm.jsonl'}"]


def per_task_data(path: str, tmp_path) -> list[str]:
    """Multi-input configs (data.per_task): small per-task sets; for user sources an ImageFolder tree (no
    captions) for the classification task and a captions-only manifest of OTHER images for the caption task."""
    cfg = load_config(path)
    out = []
    for task, section in (cfg.data.get("per_task") or {}).items():
        source = section.get("source", "synthetic")
        if source == "imagefolder":
            for c in range(2):
                (tmp_path / "folder" / f"class{c}").mkdir(parents=True)
                for i in range(3):
                    Image.new("RGB", (40, 30), (90 * c, 60 * i, 30)).save(tmp_path / "folder" / f"class{c}" / f"{i}.png")
            out += [f"data.per_task.{task}.batch_size=6", f"data.per_task.{task}.train_path={tmp_path / 'folder'}",
                    f"data.per_task.{task}.val_path={tmp_path / 'folder'}"]
        elif source == "manifest":
            (tmp_path / "cap").mkdir()
            lines = []
            for i in range(4):
                Image.new("RGB", (30, 40), (20, 50 * i, 200)).save(tmp_path / "cap" / f"{i}.png")
                lines.append(json.dumps({"image": f"{i}.png", "caption": f"a blue picture number {i}"}))
            (tmp_path / "cap" / "c.jsonl").write_text("\n".join(lines) + "\n")
            out += [f"data.per_task.{task}.batch_size=4", f"data.per_task.{task}.train_path={tmp_path / 'cap' / 'c.jsonl'}",
                    f"data.per_task.{task}.val_path={tmp_path / 'cap' / 'c.jsonl'}"]
        else:  # every step a task's whole (tiny) training set: the same rows, so its loss must fall (the sizes are
            # read for a synthetic set only: set for another source, they are refused)
            out += [f"data.per_task.{task}.train_size=4", f"data.per_task.{task}.val_size=2",
                    f"data.per_task.{task}.batch_size=4"]
    return out


STEPS = 6
USER_ITEMS = 6
# the whole training set in every step (4 synthetic items, the 6-line manifest); the file's own learning rate,
# reached by a warmup over these steps (gpu.yaml's 500 warmup steps would leave its lr near 0 in them)
SMALL = ["data.batch_size=4", "data.eval_batch_size=2", "data.num_workers=0", "data.image_size=32",
         "data.synthetic.train_size=4", "data.synthetic.val_size=2", "data.synthetic.max_count=1",
         "model.decoder.n_layer=1", "model.decoder.n_embd=32", "model.decoder.n_head=2", "tokenizer.vocab_size=64",
         f"trainer.max_steps={STEPS}", f"trainer.eval_every={STEPS}", "trainer.eval_max_batches=1",
         "trainer.num_samples=0", "trainer.log_every=1", "trainer.progress=false", "checkpoint.every_steps=0",
         f"optim.warmup_steps={STEPS}"]


@pytest.mark.parametrize("path", PARAMS)
def test_config_validates_and_its_first_steps_lower_the_loss(path, tmp_path, capsys):
    user = load_config(path).data.source != "synthetic"
    data = user_data(tmp_path) if user else []
    data += per_task_data(path, tmp_path)
    data += local_pretrained(load_config(path), tmp_path / "pretrained")  # runs/pretrained/*: tiny ones written here
    cpu = cpu_overrides(path)
    unread = unread_keys(load_run_config(path, cpu + data))  # the file as it is, but for the GPU-only keys
    small = [o for o in SMALL if not o.split("=")[0].startswith(tuple(unread))]  # a key set but not read is refused
    out_dir = tmp_path / "run"
    code = train.main(["--config", path, *cpu, *data, *small, *(["data.batch_size=6"] if user else []),
                       *shrink(path), f"output_dir={out_dir}"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    final = json.loads((out_dir / "final_metrics.json").read_text())
    assert final["step"] == STEPS and "cls_acc" in final
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    cfg = load_config(path)
    for task in cfg.tasks:
        first, last = train_rows[0][f"loss_{task}"], train_rows[-1][f"loss_{task}"]
        assert last < first, (task, [r[f"loss_{task}"] for r in train_rows])
    # it starts near chance: not a network whose outputs are blown up from the first step
    classes = len(json.loads((out_dir / "class_names.json").read_text()))
    assert train_rows[0]["loss_cls"] < math.log(classes) + 1.0, (train_rows[0]["loss_cls"], classes)
    # the console shows only what differs from the defaults; config.yaml keeps everything
    head = printed.out.split("\nmtl: ")[0].splitlines()
    assert head[0].startswith("resolved config: only what differs") and str(out_dir / "config.yaml") in head[0]
    assert len(head) <= 1 + 15, head  # one line per section that differs
    assert "max_bad_steps" in (out_dir / "config.yaml").read_text()  # a key at its default, read by every run


def test_frozen_norms_without_pretrained_weights_are_refused(tmp_path, capsys):
    """Frozen BatchNorm keeps pretrained statistics; on random weights it normalises nothing."""
    out_dir = tmp_path / "run"
    code = train.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "device=cpu",
                       "model.backbone.norm=frozen", f"output_dir={out_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and sum(line.startswith("error") for line in err.splitlines()) == 1, err
    assert "model.backbone.norm: frozen" in err and "model.backbone.weights" in err and "norm=group" in err, err
    assert not os.path.exists(out_dir / "config.yaml")
