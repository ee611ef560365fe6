"""Bad input through the real train.py: one message naming the thing and the fix, non-zero exit, no traceback."""

import json

import pytest
from PIL import Image

from .conftest import TINY, run_train


def manifest(tmp_path, lines):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return path


def good_image(tmp_path, name="ok.png"):
    Image.new("RGB", (16, 16), (200, 10, 10)).save(tmp_path / name)
    return name


def corrupt_image(tmp_path, name="bad.jpg"):
    Image.new("RGB", (64, 64), (10, 200, 10)).save(tmp_path / name, quality=95)
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[: len(data) // 2])
    return name


CASES = {
    "missing config": (lambda p: ["--config", str(p / "nope.yaml")], 2, ["nope.yaml", "does not exist"]),
    "unknown key": (lambda p: ["--config", TINY, "trainer.max_stepz=3"], 2, ["trainer.max_stepz", "unknown key"]),
    "wrong type": (lambda p: ["--config", TINY, "data.batch_size=many"], 2, ["data.batch_size", "'many'"]),
    "unknown backbone": (lambda p: ["--config", TINY, "model.backbone.name=resnet7"], 2,
                         ["model.backbone.name", "resnet7", "supported"]),
    "unknown strategy": (lambda p: ["--config", TINY, "ddp.strategy=magic"], 2, ["ddp.strategy", "magic", "known"]),
    "missing image": (lambda p: ["--config", TINY, "data.source=manifest",
                                 f"data.train_path={manifest(p, [{'image': 'gone.png', 'label': 0, 'caption': 'x'}])}",
                                 f"data.val_path={p / 'm.jsonl'}"], 3, ["m.jsonl line 1", "gone.png", "on_error=skip"]),
    "no caption": (lambda p: ["--config", TINY, "data.source=manifest",
                              f"data.train_path={manifest(p, [{'image': good_image(p), 'label': 0}])}",
                              f"data.val_path={p / 'm.jsonl'}"], 3, ["m.jsonl line 1", "caption"]),
    "corrupt image": (lambda p: ["--config", TINY, "data.source=manifest",
                                 f"data.train_path={manifest(p, [{'image': corrupt_image(p), 'label': 0, 'caption': 'x'}])}",
                                 f"data.val_path={p / 'm.jsonl'}"], 3, ["bad.jpg"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_message(tmp_path, case):
    make_args, code, needles = CASES[case]
    args = make_args(tmp_path) + [f"output_dir={tmp_path / 'run'}"]
    proc = run_train(args, check=False, timeout=120)
    assert proc.returncode == code, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert err.count("error") >= 1 and not (tmp_path / "run" / "checkpoints").exists()
