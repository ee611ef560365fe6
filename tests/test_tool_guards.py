"""The tools (evaluate, predict, export) on bad options, a full disk and odd inputs: one message, a documented exit
code, nothing computed before a check that can fail up front, and nothing half-written left behind (issue 36.8, 36.9).

A full disk is simulated without root as the checkpoint tests do (tests/test_checkpoint.py): ``shutil.disk_usage``
reporting little room, or an ``open`` that fails with ENOSPC once some bytes are written (``FullDisk``).
"""

import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from mtl import inference
from mtl.checkpoint import folder as ckpt
from mtl.errors import CheckpointError
from mtl.tools import evaluate as evaluate_tool
from mtl.tools import export as export_tool
from mtl.tools import predict as predict_tool

from .test_checkpoint import FullDisk, decide
from .test_inference import _image, checkpoint, train
from .test_trust import refresh_manifest, save_sharded

USAGE = namedtuple("usage", "total used free")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny synthetic run: output_dir, with checkpoints/step_1."""
    return train(tmp_path_factory.mktemp("guards") / "run", max_steps=1)


def one_error(err: str) -> str:
    assert "Traceback" not in err and sum(line.startswith("error") for line in err.splitlines()) == 1, err
    return err


def disk_with(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: USAGE(1 << 41, (1 << 41) - free, free))


def no_model_load(monkeypatch) -> list:
    """Records a model load (the work a check up front must come before), and stops there."""
    loads = []

    def load(*args, **kwargs):
        loads.append(args)
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(inference, "load_model", load)
    return loads


# ------------------------------------------------------------------ evaluate and predict: train.py's checks, --device


@pytest.mark.parametrize("override, key", [("data.eval_batch_size=0", "data.eval_batch_size: must be > 0"),
                                           ("data.num_workers=-1", "data.num_workers: must be >= 0")])
def test_evaluate_refuses_what_train_py_refuses(run, capsys, override, key):
    assert evaluate_tool.main(["--checkpoint", run, "--max-batches", "1", override]) == 2  # was a DataLoader traceback
    err = one_error(capsys.readouterr().err)
    assert key in err and "config error" in err, err


@pytest.mark.parametrize("tool", ["predict", "evaluate"])
def test_a_cuda_device_the_machine_lacks_is_one_message_before_the_model_loads(run, tmp_path, monkeypatch, capsys,
                                                                                 tool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without an NVIDIA driver
    args = (["--model", run, _image(tmp_path)] if tool == "predict" else ["--checkpoint", run])
    main = predict_tool.main if tool == "predict" else evaluate_tool.main
    assert main([*args, "--device", "cuda:0"]) == 2  # was "Found no NVIDIA driver" in a traceback
    err = one_error(capsys.readouterr().err)
    assert "--device: 'cuda:0'" in err and "--device=cpu" in err, err

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    loads = no_model_load(monkeypatch)
    assert main([*args, "--device", "cuda:3"]) == 2
    err = one_error(capsys.readouterr().err)
    assert "--device: 'cuda:3'" in err and "1 CUDA device(s), cuda:0 to cuda:0" in err, err
    assert not loads


# ------------------------------------------------------------------ predict and evaluate --out


@pytest.mark.parametrize("tool", ["predict", "evaluate"])
def test_out_on_a_full_disk_is_refused_before_any_work(run, tmp_path, monkeypatch, capsys, tool):
    image = _image(tmp_path)
    out = tmp_path / "res" / "out.jsonl"
    loads = no_model_load(monkeypatch)
    disk_with(monkeypatch, 0)
    args = ["--model", run, image] if tool == "predict" else ["--checkpoint", run]
    main = predict_tool.main if tool == "predict" else evaluate_tool.main
    assert main([*args, "--out", str(out)]) == 2
    err = one_error(capsys.readouterr().err)
    assert "--out:" in err and "has 0 bytes free" in err and "nothing was computed or written" in err, err
    assert not loads and not os.path.exists(tmp_path / "res")


def test_predict_out_that_fails_after_the_work_is_an_io_error_leaving_no_file(run, tmp_path, monkeypatch, capsys):
    """The disk fills while predicting: exit 3 (not "config error", exit 2), no 0-byte file, the lines on stdout."""
    from mtl import files

    image = _image(tmp_path)
    out = tmp_path / "preds.jsonl"
    disk = FullDisk("preds.jsonl", room=0)  # write_atomic's temporary file
    monkeypatch.setattr(files, "open", disk, raising=False)
    assert predict_tool.main(["--model", run, image, "--out", str(out)]) == 3
    captured = capsys.readouterr()
    err = one_error(captured.err)
    assert disk.fired, "the disk never filled up"
    assert f"cannot write --out {str(out)!r}: no space left on device" in err and "config error" not in err, err
    assert "printed to stdout instead" in err and f'"image": "{image}"' in captured.out
    assert sorted(os.listdir(tmp_path)) == ["ok.png"]  # no preds.jsonl, no preds.jsonl.<pid>.tmp


# ------------------------------------------------------------------ predict: a FIFO among the inputs


def test_a_fifo_among_the_inputs_is_named_skipped_and_counted(run, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    good = _image(images)
    os.mkfifo(images / "pipe.png")  # found in the folder by its extension
    os.mkfifo(tmp_path / "named")  # named on the command line
    out = tmp_path / "preds.jsonl"
    assert predict_tool.main(["--model", run, str(images), str(tmp_path / "named"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not found" not in err, err
    for fifo in (images / "pipe.png", tmp_path / "named"):
        assert f"skipped: image {str(fifo)!r} is not a regular file but a FIFO (named pipe)" in err, err
    assert "1 prediction(s) written" in err and "2 image(s) skipped" in err, err
    assert [line.split('"')[3] for line in out.read_text().splitlines()] == [good]


# ------------------------------------------------------------------ export


def _left(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def test_export_on_a_full_disk_is_refused_before_it_writes(run, tmp_path, monkeypatch, capsys):
    disk_with(monkeypatch, 5_000_000)  # the SafetensorError case: 5 MB free
    out = tmp_path / "exp"
    assert export_tool.main(["--checkpoint", checkpoint(run, 1), "--out", str(out)]) == 2
    err = one_error(capsys.readouterr().err)
    assert f"--out: the disk of {str(out)!r} has 5,000,000 bytes free, and the export needs about" in err, err
    needed = int(err.split("needs about ")[1].split(";")[0].replace(",", ""))
    model_bytes = os.path.getsize(os.path.join(checkpoint(run, 1), "model.safetensors"))
    assert needed > 2 * model_bytes  # the copy, plus the parts in other layouts
    assert _left(tmp_path) == []  # no exp, no exp.<pid>.tmp


@pytest.mark.slow  # the python write case exports the image program (torch.export): ~7 s
@pytest.mark.parametrize("fault", ["python write", "safetensors writer"])
def test_an_export_that_fails_while_writing_is_one_message_and_leaves_nothing(run, tmp_path, monkeypatch, capsys,
                                                                             fault):
    """The pre-check passed, and the disk fills up anyway: torch's zip writer is never given the disk (it aborts
    the process on a short write, exit 134), and safetensors' own error type is caught."""
    from safetensors import SafetensorError
    from transformers import modeling_utils

    from mtl.inference import interop
    fired = []
    if fault == "python write":
        disk = FullDisk("image_program.pt2", room=4096)
        monkeypatch.setattr(interop, "open", disk, raising=False)
        fired = disk
    else:
        def full(*args, **kwargs):
            fired.append(1)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    out = tmp_path / "sub" / "exp"
    assert export_tool.main(["--checkpoint", checkpoint(run, 1), "--out", str(out)]) == 4
    err = one_error(capsys.readouterr().err)
    assert (fired.fired if fault == "python write" else fired), "the disk never filled up"
    assert f"cannot write the export {str(out)!r}: " in err and "no space left on device" in err, err
    assert "free before it began" in err and "nothing was left behind" in err, err
    if fault == "python write":
        assert "image_program.pt2: no space left on device" in err, err
    assert _left(tmp_path) == []  # no exp, no exp.<pid>.tmp, not even the folder made for it


def test_an_export_removes_what_a_killed_export_left(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(inference.export, "write_interop", lambda folder, predictor, for_task=None: [])  # the parts: not needed here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its PID is gone: what a SIGKILLed export leaves is named after a dead process
    stale, alive = tmp_path / f"exp.{child.pid}.tmp", tmp_path / "exp.1.tmp"  # PID 1 never dies
    for folder in (stale, alive):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    out = tmp_path / "exp"
    assert export_tool.main(["--checkpoint", checkpoint(run, 1), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"note: removed {str(stale)!r}, the half-written folder of an earlier export" in err, err
    assert _left(tmp_path) == ["exp", "exp.1.tmp"]  # a live process's folder is not touched
    assert inference.load_model(str(out)).tasks


# ------------------------------------------------------------------ the checkpoint's messages (36.9)


def test_the_full_disk_message_reports_the_room_there_was_before_the_write(tmp_path, monkeypatch):
    """A short write fills the disk: the message gives what was free before it (not "0 free", measured after)."""
    import torch.distributed.checkpoint.filesystem as fs

    free = iter([3_000] + [0] * 100)  # before the write, then full
    monkeypatch.setattr(shutil, "disk_usage", lambda path: USAGE(1 << 41, 1 << 40, next(free)))
    fired = []

    def short_write(transforms, stream, data, *args, **kwargs):
        stream.write(b"x" * 64)
        fired.append(1)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(fs, "_write_item", short_write)
    with pytest.raises(CheckpointError) as e:
        save_sharded(tmp_path, 2)
    assert fired, "the writer never failed"
    assert "no space left on device (" in e.value.message and "bytes to write here, 3,000 free)" in e.value.message


def test_a_crafted_index_message_says_its_fix_once(tmp_path):
    save_sharded(tmp_path, 2)
    newest = save_sharded(tmp_path, 4)
    index = os.path.join(newest, ckpt.STATE_DIR, ".metadata")
    with open(index, "rb") as f:
        real = f.read()
    with open(index, "wb") as f:
        f.write(b"cos\nsystem\n(Vtrue\ntR0" + real)
    refresh_manifest(newest)
    with pytest.raises(CheckpointError) as e:
        decide(tmp_path, f"resume={newest}")
    assert "os.system" in e.value.message and e.value.message.count("Point resume at another checkpoint") == 1



def test_init_from_parses_no_config_yaml_as_the_trust_table_says(run, tmp_path):
    """docs/reliability.md's table of load paths: init_from reads the weights, the tokenizer and the class names, not
    config.yaml. A config.yaml the tools refuse (a ``${...}``; the manifest refreshed) does not stop a warm start."""
    from mtl.setup.build import init_from_weights

    folder = tmp_path / "m"
    shutil.copytree(checkpoint(run, 1), folder)
    (folder / "config.yaml").write_text("seed: ${oc.env:HOME}\n")
    refresh_manifest(str(folder))
    assert evaluate_tool.main(["--checkpoint", str(folder)]) == 4  # the tools parse it, and refuse it
    assert init_from_weights(inference.load_model(checkpoint(run, 1)).model, str(folder))  # init_from does not
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "reliability.md"), encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `init_from=`"))
    reads = row.split(" | ")[1].split("; not")[0]
    assert "`model.safetensors`" in reads and "`config.yaml`" not in reads, row
