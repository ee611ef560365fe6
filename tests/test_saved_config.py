"""A saved config (a checkpoint's or an export's ``config.yaml``) is data: YAML anchors, aliases and duplicate keys in it
are refused by name and line when it is read, before anything expands it (issue 41: a 9-line alias bomb hung predict
and made resume=auto die of a MemoryError). A user's own config may use anchors, up to a size cap.

The bombs here are bounded (10^6 strings once expanded: a regression fails in seconds, not hours) and each test has a
timeout besides."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from mtl.checkpoint import folder as ckpt
from mtl.errors import CheckpointError
from mtl.setup.resume import saved_config
from mtl.tools import predict as predict_tool

from .test_checkpoint import decide, file_bytes, save
from .test_trust import refresh_manifest

pytestmark = pytest.mark.timeout(60)


def alias_bomb(levels: int = 5) -> str:
    """The issue's bomb, ``levels`` deep: a0 holds 10 strings, each aN ten aliases of a(N-1) (10^(levels+1) strings)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def edit_config(path: str, edit) -> int:
    """Replace the checkpoint's config.yaml by ``edit(text)`` and refresh its manifest, as an attacker would; returns
    the number of lines the original had."""
    config = os.path.join(path, "config.yaml")
    text = file_bytes(config).decode()
    with open(config, "w", encoding="utf-8") as f:
        f.write(edit(text))
    refresh_manifest(path)
    return text.count("\n")


CASES = {  # how to edit the file, what the refusal says and where (from the file's lines as mtl wrote it)
    "alias bomb": (lambda text: text + alias_bomb(), "an anchor (&a0)", lambda lines: f"line {lines + 1}"),
    "alias": (lambda text: "seed: &s 0\n" + text.replace("seed: 0\n", "") + "extra: *s\n", "an anchor (&s)",
              lambda lines: "line 1"),
    "duplicate key": (lambda text: text + "seed: 7\n", "key 'seed' appears twice", lambda lines: f"and {lines + 1}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_saved_config_with_anchors_or_duplicate_keys_is_refused_by_file_and_line(tmp_path, case):
    edit, says, where = CASES[case]
    path = save(tmp_path, 2)
    where = where(edit_config(path, edit))
    with pytest.raises(CheckpointError) as e:
        saved_config(path)
    assert e.value.exit_code == 4 and os.path.join(path, "config.yaml") in e.value.message, e.value.message
    assert f"{where}: {says}" in e.value.message, e.value.message
    with pytest.raises(CheckpointError) as e:
        ckpt.verify_checkpoint(path)
    assert e.value.message.startswith("checkpoint step_2: config.yaml, ") and f"{where}: {says}" in e.value.message


def test_resume_auto_falls_back_past_a_checkpoint_whose_config_is_a_bomb(tmp_path, capsys):
    save(tmp_path, 2)
    edit_config(save(tmp_path, 4), lambda text: text + alias_bomb())
    assert decide(tmp_path, "resume=auto") == os.path.join(tmp_path, "checkpoints", "step_2")
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and "step_4: config.yaml, line" in skipped[0] and "anchor" in skipped[0], out
    assert len(skipped[0]) < 400, skipped[0]  # one line, the bomb not in it


def test_predict_refuses_a_bomb_in_a_checkpoint_and_in_an_export_with_exit_4(tmp_path, capsys):
    image = tmp_path / "i.png"
    Image.new("RGB", (20, 20)).save(image)
    path = save(tmp_path / "run", 2, extra={"tokenizer/tokenizer.json": b"{}"})
    edit_config(path, lambda text: text + alias_bomb())
    export = tmp_path / "export"  # an export: no trainer state, its config read by saved_config
    export.mkdir()
    for name in ("model.safetensors", "config.yaml"):
        (export / name).write_bytes(file_bytes(os.path.join(path, name)))
    (export / "tokenizer").mkdir()
    (export / "tokenizer" / "tokenizer.json").write_text("{}")
    refresh_manifest(str(export))
    for folder in (path, str(export)):
        assert predict_tool.main(["--model", folder, str(image)]) == 4
        err = capsys.readouterr().err
        assert "config.yaml" in err and "line" in err and "anchor (&a0)" in err and "Traceback" not in err, err
