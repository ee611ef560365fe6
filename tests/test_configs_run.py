"""Every file in configs/ validates and trains one step, in this process, on the CPU.

The GPU-only settings (device, bf16/fp16, SyncBatchNorm, nccl) are replaced by their CPU
counterparts, and the sizes shrunk so that each run takes seconds; everything else is the file's own.
A config that can never run (issue 8: gpu.yaml asked for 8 of the 7 shape kinds) fails here.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from PIL import Image

import train
from mtl.config import load_config
from mtl.config_check import load_run_config

from .conftest import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def cpu_overrides(path: str) -> list[str]:
    """What a CPU-only machine must change: only the keys whose values need a GPU."""
    cfg = load_config(path)  # keys and types only: the checks that need the overrides come after
    out = ["device=cpu", "ddp.backend=auto"]
    if cfg.precision == "fp16":
        out.append("precision=fp32")  # fp16 autocast is a GPU feature; bf16 runs on the CPU
    if cfg.model.backbone.norm == "sync":
        out.append("model.backbone.norm=group")  # SyncBatchNorm needs CUDA
    return out


def user_data(tmp_path) -> list[str]:
    """A small manifest for configs that read user data (the same file serves as both splits)."""
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(6):
        Image.new("RGB", (40, 30), (40 * i, 200 - 30 * i, 90)).save(tmp_path / "img" / f"{i}.png")
        lines.append(json.dumps({"image": f"img/{i}.png", "label": i % 3, "caption": f"picture number {i}"}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.train_path={tmp_path / 'm.jsonl'}", f"data.val_path={tmp_path / 'm.jsonl'}"]


SMALL = ["data.batch_size=2", "data.eval_batch_size=2", "data.num_workers=0", "data.image_size=32",
         "data.synthetic.train_size=4", "data.synthetic.val_size=2", "data.synthetic.max_count=1",
         "model.decoder.n_layer=1", "model.decoder.n_embd=32", "model.decoder.n_head=2", "tokenizer.vocab_size=64",
         "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_max_batches=1", "trainer.num_samples=0",
         "trainer.progress=false", "checkpoint.every_steps=0"]


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_config_validates_and_runs_one_step(path, tmp_path, capsys):
    data = user_data(tmp_path) if load_config(path).data.source != "synthetic" else []
    cpu = cpu_overrides(path)
    load_run_config(path, cpu + data)  # the file as it is, but for the GPU-only keys
    out_dir = tmp_path / "run"
    code = train.main(["--config", path, *cpu, *data, *SMALL, f"output_dir={out_dir}"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    final = json.loads((out_dir / "final_metrics.json").read_text())
    assert final["step"] == 1 and "cls_acc" in final
    # the console shows only what differs from the defaults; config.yaml keeps everything
    head = printed.out.split("\nmtl: ")[0].splitlines()
    assert head[0].startswith("resolved config: only what differs") and str(out_dir / "config.yaml") in head[0]
    assert len(head) <= 10, head
    assert "bucket_cap_mb" in (out_dir / "config.yaml").read_text()
