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


@pytest.mark.slow  # a real process per case; the same cases run in-process in the fast tier below
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


# ---------------------------------------------------------------------------------------------
# the same, in this process through train.py's main(argv): a bad input is one message and an exit code


def main_of(argv, capsys):
    import train

    code = train.main(argv)
    return code, capsys.readouterr().err


def stray_label_manifest(p):
    img = good_image(p)
    return manifest(p, [{"image": img, "label": i % 3, "caption": "x"} for i in range(6)]
                    + [{"image": img, "label": 7, "caption": "typo"}])


def non_utf8_manifest(p):
    path = manifest(p, [{"image": good_image(p), "label": i, "caption": "x"} for i in range(2)])  # two classes
    path.write_bytes(path.read_bytes() + b'{"image": "ok.png", "label": 0, "caption": "na\xefve"}\n')
    return path


def one_class_folder(p):
    """An ImageFolder tree with a single class folder (and no captions file)."""
    (p / "folder" / "only").mkdir(parents=True)
    for i in range(10):
        Image.new("RGB", (16, 16), (20 * i, 10, 10)).save(p / "folder" / "only" / f"{i}.png")
    return p / "folder"


def two_class_folder(p):
    """An ImageFolder tree with two class folders and no captions file."""
    for c in ("a", "b"):
        (p / "folder" / c).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (16, 16), (20 * i, 10, 10)).save(p / "folder" / c / f"{i}.png")
    return p / "folder"


IN_PROCESS = {
    "one-class image folder": (lambda p: [TINY, "data.source=imagefolder", "tasks=[cls]",
                                          f"data.train_path={one_class_folder(p)}", f"data.val_path={p / 'folder'}"],
                               3, ["task 'cls'", "1 class (only)", "at least 2"]),
    "one-class manifest": (lambda p: [TINY, "data.source=manifest", "tasks=[cls]",
                                      f"data.train_path={manifest(p, [{'image': good_image(p), 'label': 0, 'caption': 'x'}] * 10)}",
                                      f"data.val_path={p / 'm.jsonl'}"], 3, ["task 'cls'", "1 class", "m.jsonl"]),
    # 4 training images, batch 8: fewer than one (global) batch
    "missing image folder": (lambda p: [TINY, "data.source=imagefolder", f"data.train_path={p / 'nope'}",
                                        f"data.val_path={p / 'nope'}"], 3,
                             ["data.train_path: image folder", "nope", "not found"]),
    "a folder given as the manifest": (lambda p: [TINY, "data.source=manifest", f"data.train_path={two_class_folder(p)}",
                                                  f"data.val_path={p / 'folder'}"], 3,
                                       ["manifest", "is a folder, not a JSONL file", "data.source=imagefolder"]),
    "image folder without captions": (lambda p: [TINY, "data.source=imagefolder",
                                                 f"data.train_path={two_class_folder(p)}",
                                                 f"data.val_path={p / 'folder'}"], 3,
                                      ["captions.jsonl", "multi-input mode", "data.per_task"]),
    "training set smaller than a batch": (lambda p: [TINY, "data.synthetic.train_size=4"], 3,
                                          ["data.batch_size=8", "1 process(es)", "4 item(s)"]),
    "label outside the class list": (lambda p: [TINY, "data.source=manifest", "data.batch_size=2",
                                                f"data.train_path={stray_label_manifest(p)}",
                                                f"data.val_path={p / 'm.jsonl'}"], 3,
                                     ["m.jsonl line 7", "label 7", "data.num_classes"]),
    "non-UTF-8 byte": (lambda p: [TINY, "data.source=manifest", f"data.train_path={non_utf8_manifest(p)}",
                                  f"data.val_path={p / 'm.jsonl'}"], 3, ["m.jsonl line 3", "UTF-8", "0xef"]),
    "sync batch norm on the CPU": (lambda p: [TINY, "model.backbone.norm=sync", "device=cpu"], 2,
                                   ["model.backbone.norm", "CUDA"]),
    "copied config loses its base": (lambda p: [str(p / "copy.yaml")], 2,
                                     ["copy.yaml", "default.yaml", "relative to", "absolute path"]),
    "every config error at once": (lambda p: [TINY, "trainer.bogus=1", "data.batch_size=0", "optim.lr=-1"], 2,
                                   ["trainer.bogus", "data.batch_size", "optim.lr"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_cases_in_process(tmp_path, capsys, case):
    """CASES above through train.py's main in this process: the fast tier's copy of the same checks."""
    make_args, code, needles = CASES[case]
    got, err = main_of(make_args(tmp_path) + [f"output_dir={tmp_path / 'run'}"], capsys)
    assert got == code, err
    assert "Traceback" not in err and err.count("error") >= 1
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("case", list(IN_PROCESS))
def test_bad_input_in_process(tmp_path, capsys, case):
    (tmp_path / "copy.yaml").write_text(open(TINY).read())  # base: default.yaml, which is not beside the copy
    make_args, code, needles = IN_PROCESS[case]
    config, *overrides = make_args(tmp_path)
    got, err = main_of(["--config", config, *overrides, f"output_dir={tmp_path / 'run'}"], capsys)
    assert got == code, err
    assert "Traceback" not in err and err.count("error") >= 1
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_non_utf8_line_is_skipped_and_the_run_goes_on(tmp_path, capsys):
    path = non_utf8_manifest(tmp_path)
    code = __import__("train").main(["--config", TINY, "data.source=manifest", f"data.train_path={path}",
                                     f"data.val_path={path}", "data.on_error=skip", "data.batch_size=2",
                                     "trainer.max_steps=1", "checkpoint.every_steps=0", "trainer.num_samples=0",
                                     f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "skipped 2 bad data line(s)" in out.out + out.err and "line 3" in out.out + out.err  # train + val


@pytest.mark.slow
def test_two_processes_with_less_than_one_global_batch_fail_fast(tmp_path):
    """Fewer images than one global batch: 12 images, 8 per process, 2 processes. Each rank's epoch holds 6 images,
    so no batch at all; this used to hang forever. Now every rank refuses with one message."""
    proc = run_train(["--config", TINY, "data.synthetic.train_size=12", f"output_dir={tmp_path / 'run'}"],
                     nproc=2, check=False, timeout=240)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("fewer than one global batch") == 1 and "2 process(es)" in proc.stderr


@pytest.mark.parametrize("config, overrides, code, needle", [
    (TINY, ["data.synthetic.train_size=4"], 3, "fewer than one global batch"),
    (TINY, ["weighting.method=autolambda", "data.heldout=4"], 3, "data.heldout=4 holds out fewer items"),
    ("configs/multi_input.yaml", ["data.per_task.gen={source: manifest, train_path: '{tmp}/m.jsonl', val_path: "
                                  "'{tmp}/m.jsonl', image_root: '{tmp}', batch_size: 4}"], 3,
     "task 'gen': a step can ask for 4 of its training items"),  # 3 lines: known only once the data is read
    # each task has its own validation set there; one shared test split would score the wrong data: refused
    ("configs/multi_input.yaml", ["data.synthetic.test_size=8"], 2,
     "data.synthetic.test_size: set (command line) but not read: multi-input mode"),  # mtl/config/read_rules.py
])
def test_a_run_refused_for_its_data_sizes_writes_nothing(tmp_path, capsys, config, overrides, code, needle):
    """What the feeds refuse (a training set under one global batch, a held-out part under one, a task's set under
    what a step asks of it, a test split in multi-input mode) is checked on the data sets before the run folder is
    prepared: one message, and no config.yaml, tokenizer or checkpoint left behind to mistake for a run."""
    out = tmp_path / "run"
    manifest(tmp_path, [{"image": good_image(tmp_path), "label": 0, "caption": f"a caption {i}"} for i in range(3)])
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    got, err = main_of(["--config", config, *overrides, "trainer.max_steps=1", f"output_dir={out}"], capsys)
    assert got == code, err
    assert needle in err and err.count(needle) == 1 and "Traceback" not in err
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not {"config.yaml", "tokenizer", "checkpoints", "metrics.jsonl"} & set(left), left
