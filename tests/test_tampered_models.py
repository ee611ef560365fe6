"""Every path that loads a trained model (predict, evaluate, export, ``train.py init_from=``) verifies the folder's
manifest as a resume does (``mtl.setup.build.verify_model_files`` -> ``mtl.checkpoint.folder.verify_checkpoint``), and reads its
config.yaml as data: no ``${...}`` resolved, no ``base:`` followed."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from mtl.checkpoint.folder import write_manifest
from mtl.errors import TrainingError
from mtl.inference import load_model
from mtl.tools import evaluate as evaluate_tool
from mtl.tools import export as export_tool
from mtl.tools import predict as predict_tool

from .conftest import TINY
from .test_inference import _image, checkpoint, run, train_script  # noqa: F401  (run: the trained-model fixture)

TENSOR = "heads.cls.fc.weight"


def flip_exponent_bit(path: str, name: str = TENSOR) -> None:
    """Flip the top exponent bit of the first float32 of ``name`` in a safetensors file, in place (its manifest
    entry goes stale)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        assert header[name]["dtype"] == "F32"
        at = 8 + n + header[name]["data_offsets"][0] + 3  # little-endian: the sign and exponent's top bits
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


@pytest.fixture
def tampered(run, tmp_path):  # noqa: F811
    """A copy of the run's checkpoint with one bit of one weight flipped, its manifest left as written."""
    folder = tmp_path / "step_4"
    shutil.copytree(checkpoint(run), folder)
    before = load_file(folder / "model.safetensors")[TENSOR].clone()
    flip_exponent_bit(str(folder / "model.safetensors"))
    after = load_file(folder / "model.safetensors")[TENSOR]
    assert not torch.equal(before, after) and abs(after[0, 0]) > 1e30  # the fault is real: a weight blown up
    return folder


def one_error(err: str) -> None:
    assert "Traceback" not in err and sum(line.startswith("error") for line in err.splitlines()) == 1, err


def test_every_tool_refuses_a_tampered_checkpoint(tampered, tmp_path, capsys):
    image = _image(tmp_path)
    for tool, args in ((predict_tool, ["--model", str(tampered), image]),
                       (evaluate_tool, ["--checkpoint", str(tampered), "--max-batches", "1"]),
                       (export_tool, ["--checkpoint", str(tampered), "--out", str(tmp_path / "e")])):
        assert tool.main(args) == 4, tool.__name__
        err = capsys.readouterr().err
        one_error(err)
        assert "model.safetensors does not match its SHA-256 checksum" in err, err
    assert not os.path.exists(tmp_path / "e")
    # the weights file named directly is checked against its folder's manifest too
    assert predict_tool.main(["--model", str(tampered / "model.safetensors"), image]) == 4
    assert "SHA-256" in capsys.readouterr().err


def test_init_from_refuses_a_tampered_checkpoint(tampered, tmp_path, capsys):
    out = tmp_path / "warm"
    rc = train_script.main(["--config", TINY, f"output_dir={out}", f"init_from={tampered}", "trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 4, err
    one_error(err)
    assert "init_from" in err and "model.safetensors does not match its SHA-256 checksum" in err, err
    assert not os.path.exists(out / "checkpoints")


def test_a_tampered_export_is_refused_and_so_is_one_without_a_manifest(run, tmp_path, capsys):  # noqa: F811
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", checkpoint(run), "--out", str(export)]) == 0
    image = _image(tmp_path)
    assert predict_tool.main(["--model", str(export), image]) == 0
    capsys.readouterr()
    names = json.loads((export / "class_names.json").read_text())
    (export / "class_names.json").write_text(json.dumps(names[::-1], indent=1))  # relabelled by hand, same size
    assert predict_tool.main(["--model", str(export), image]) == 4
    err = capsys.readouterr().err
    one_error(err)
    assert "class_names.json does not match its SHA-256 checksum" in err, err
    os.remove(export / "manifest.json")
    assert predict_tool.main(["--model", str(export), image]) == 4
    assert "has no manifest.json" in capsys.readouterr().err


def test_a_file_added_after_the_save_is_refused(run, tmp_path, capsys):  # noqa: F811
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", checkpoint(run), "--out", str(export)]) == 0
    (export / "tokenizer" / "extra.json").write_text("{}")
    assert predict_tool.main(["--model", str(export), _image(tmp_path)]) == 4
    assert "tokenizer/extra.json" in capsys.readouterr().err


CONFIG_EDITS = {
    "interpolated seed": ("seed", "${oc.env:MTL_TEST_SECRET}"),
    "interpolated path": ("output_dir", "${oc.env:MTL_TEST_SECRET}"),
    "base file": ("base", "/etc/hostname"),
}


@pytest.mark.parametrize("case", list(CONFIG_EDITS))
def test_a_checkpoints_config_is_data_never_resolved(run, tmp_path, capsys, monkeypatch, case):  # noqa: F811
    """An edited config.yaml whose manifest was refreshed (the manifest is not a signature) is read as plain data:
    an interpolation is refused as text, never evaluated (the secret is never printed), ``base:`` never followed."""
    monkeypatch.setenv("MTL_TEST_SECRET", "hunter2-not-an-int")
    key, value = CONFIG_EDITS[case]
    folder = tmp_path / "step_4"
    shutil.copytree(checkpoint(run), folder)
    text = (folder / "config.yaml").read_text()
    (folder / "config.yaml").write_text(f"{key}: '{value}'\n" + "\n".join(
        line for line in text.splitlines() if not line.startswith(f"{key}:")) + "\n")
    os.remove(folder / "manifest.json")
    write_manifest(str(folder))
    for tool, args in ((evaluate_tool, ["--checkpoint", str(folder), "--max-batches", "1"]),
                       (predict_tool, ["--model", str(folder), _image(tmp_path)]),
                       (export_tool, ["--checkpoint", str(folder), "--out", str(tmp_path / "e")])):
        assert tool.main(args) == 4, tool.__name__
        captured = capsys.readouterr()
        one_error(captured.err)
        assert "hunter2" not in captured.out + captured.err
        assert f"{key}: '{value}'" in captured.err and "config.yaml" in captured.err, captured.err
        assert ("never evaluated" if key != "base" else "'base:' is not followed") in captured.err


def test_non_finite_weights_are_refused_at_load_naming_the_tensor(run, tmp_path, capsys):  # noqa: F811
    """A model.safetensors holding a NaN or inf (the manifest refreshed: not damage, a diverged or edited model) is
    refused at load, exit 5 naming the tensor, in every tool: never "prob": NaN with exit 0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "step_4"
    shutil.copytree(checkpoint(run), folder)
    weights = str(folder / "model.safetensors")
    with safe_open(weights, "pt") as f:
        meta = f.metadata()
    state = load_file(weights)
    state[TENSOR][0, 1] = float("nan")
    save_file(state, weights, metadata=meta)
    write_manifest(str(folder))
    for tool, args in ((predict_tool, ["--model", str(folder), _image(tmp_path)]),
                       (evaluate_tool, ["--checkpoint", str(folder), "--max-batches", "1"]),
                       (export_tool, ["--checkpoint", str(folder), "--out", str(tmp_path / "e")])):
        captured = capsys.readouterr()
        assert tool.main(args) == 5, tool.__name__
        captured = capsys.readouterr()
        one_error(captured.err)
        assert TENSOR in captured.err and "NaN or inf" in captured.err, captured.err
        assert captured.out == ""
    assert not os.path.exists(tmp_path / "e")
    state[TENSOR][0, 1] = 0.0
    first = next(k for k, v in state.items() if k.startswith("backbone.") and v.is_floating_point())
    state[first].view(-1)[0] = float("-inf")
    save_file(state, weights, metadata=meta)
    write_manifest(str(folder))
    with pytest.raises(TrainingError, match=f"NaN or inf values in {first}:"):
        load_model(str(folder))
