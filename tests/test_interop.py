"""An export's parts load in other libraries without mtl: transformers loads ``hf_decoder/`` as
it is and generates the same caption from the same features; torchvision loads ``torchvision_backbone/`` and
computes the same features; plain torch loads ``image_program.pt2`` and computes the same features and logits.
The checking side runs in a separate ``python -I`` process whose import system refuses ``mtl`` (and any module
under it), and which asserts at the end that no mtl module was loaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from mtl.data.images import normalize_images
from mtl.inference import Predictor, load_model
from mtl.inference.interop import write_hf_captioner
from mtl.run.trainer import Trainer
from mtl.tools import export as export_tool

from . import pretrained_folders
from .conftest import ROOT, TINY
from .doc_blocks import blocks
from .test_inference import checkpoint, synthetic_val, to_pil, train

# the head of a check script run with ``python -I``: its import system refuses mtl (tests/test_vit_gpt2.py too)
NO_MTL = textwrap.dedent('''
    import importlib.abc, json, sys

    class NoMtl(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mtl" or name.startswith(("mtl.", "mtl_plugins")):
                raise ImportError(f"this check must not import {name}")
            return None

    sys.meta_path.insert(0, NoMtl())
''')
CHECK = NO_MTL + textwrap.dedent('''
    import torch

    export, expected_file = sys.argv[1], sys.argv[2]
    expected = torch.load(expected_file, weights_only=True)
    # the image path as one program, with torch alone, at two batch sizes
    program = torch.export.load(f"{export}/image_program.pt2").module()
    for n in (6, 3):
        with torch.no_grad():
            features, logits = program(expected["images"][:n])
        assert (features - expected["features"][:n]).abs().max().item() <= 1e-5
        assert (logits - expected["logits"][:n]).abs().max().item() <= 1e-5
    assert "torchvision" not in sys.modules and "transformers" not in sys.modules

    import torchvision
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
    # the backbone, as README.md in the export says
    spec = json.load(open(f"{export}/torchvision_backbone/backbone.json"))
    kwargs = {}
    if spec["norm"] == "group":
        kwargs["norm_layer"] = lambda c: torch.nn.GroupNorm(spec["group_norm_groups"].get(str(c), 1), c)
    net = torchvision.models.get_model(spec["torchvision_model"], weights=None, **kwargs).eval()
    missing, unexpected = net.load_state_dict(load_file(f"{export}/torchvision_backbone/model.safetensors"),
                                              strict=False)
    assert not unexpected and missing and all(k.split(".")[0] in spec["unused"] for k in missing), (missing, unexpected)
    x = expected["images"]
    if spec["normalize"] is not None:
        mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in spec["normalize"])
        x = (x - mean) / std
    with torch.no_grad():
        for name in spec["run"]:
            x = getattr(net, name)(x)
    features = x
    assert features.shape == expected["features"].shape, (features.shape, expected["features"].shape)
    diff = (features - expected["features"]).abs().max().item()
    assert diff <= 1e-5, diff
    # the decoder, from those features
    model = GPT2LMHeadModel.from_pretrained(f"{export}/hf_decoder").eval()
    mem = load_file(f"{export}/hf_decoder/image_memory.safetensors")
    info = json.load(open(f"{export}/hf_decoder/image_memory.json"))
    memory = features.flatten(2).transpose(1, 2) @ mem["proj.weight"].T + mem["proj.bias"] + mem["pos"]
    bos = torch.full((memory.shape[0], 1), model.config.bos_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=bos, attention_mask=torch.ones_like(bos), encoder_hidden_states=memory,
                             max_new_tokens=info["max_new_tokens"], num_beams=1, do_sample=False)
    ids = []
    for row in out[:, 1:].tolist():
        row = row[: row.index(info["eos_token_id"])] if info["eos_token_id"] in row else row
        ids.append([t for t in row if t != info["pad_token_id"]])
    assert ids == expected["ids"], (ids, expected["ids"])
    assert not [m for m in sys.modules if m == "mtl" or m.startswith(("mtl.", "mtl_plugins"))]
    print(json.dumps({"feature_max_abs_diff": diff, "captions": len(ids)}))
''')


@pytest.mark.slow  # trains, exports and loads through transformers and torchvision (~10 s a case)
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_transformers_and_torchvision_load_the_export_and_agree_without_mtl(tmp_path, norm):
    run = train(tmp_path / "run", f"model.backbone.norm={norm}", max_steps=3)
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", checkpoint(run, 3), "--out", str(export)]) == 0
    assert {"hf_decoder", "torchvision_backbone", "image_program.pt2", "README.md"} <= set(os.listdir(export))
    assert "transformers" in (export / "README.md").read_text() and "torch.export" in (export / "README.md").read_text()
    # mtl's own answers, in this process
    predictor = load_model(export)
    images = torch.stack([synthetic_val(6)[i]["image"] for i in range(6)])
    head = predictor.model.heads["gen"]
    with torch.no_grad():
        features = predictor.model.backbone(normalize_images(images, predictor.normalization))
        ids = head.decoder.generate(head.memory(features), head.max_new_tokens, 1)
        logits = predictor.model.heads["cls"].logits(features)
    assert any(ids), "the model must caption something for the comparison to mean anything"
    predicted = predictor.predict(images)
    assert [predictor.tokenizer.decode(i) for i in ids] == [p["caption"] for p in predicted]
    assert logits.argmax(-1).tolist() == [p["class_index"] for p in predicted]
    expected = tmp_path / "expected.pt"
    torch.save({"images": images, "features": features, "ids": ids, "logits": logits}, expected)
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", str(script), str(export), str(expected)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["captions"] == 6


def readme_pipeline_block():
    """README.md's Python block that calls ``pipeline("image-to-text", ...)`` on an export's ``hf_captioner/``."""
    found = [b for b in blocks(os.path.join(ROOT, "README.md")) if 'pipeline("image-to-text"' in b.text]
    assert len(found) == 1 and found[0].lang == "python", [b.where for b in found]
    return found[0]


@pytest.mark.slow  # builds a ViT-GPT2-shaped run, steps it 3 times and runs transformers' pipeline (~4 s warm)
def test_the_readme_pipeline_line_captions_an_exported_captioner_as_mtl_does(tmp_path, monkeypatch, capsys):
    """README.md's ``pipeline("image-to-text", model=EXPORT/hf_captioner)`` line, as written, from a folder that has
    the export where README's commands put it and ``photo.jpg``: it prints mtl's own caption of that file (an
    untrained ViT-GPT2-sized model: the export's files, not the training, are under test)."""
    vit = pretrained_folders.tiny_pretrained().write_vit(str(tmp_path / "vit"))
    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path / 'run'}", "model.backbone.name=hf_vision",
                                         f"model.backbone.pretrained={vit}", "model.decoder.n_embd=32",
                                         "model.decoder.max_positions=32"])
    try:
        for _ in range(3):
            trainer.step_once()
        trainer.bare.eval()
        predictor = Predictor(trainer.bare, trainer.cfg, trainer.tokenizer, ["a"] * 4, torch.device("cpu"), None)
        block = readme_pipeline_block()
        export = re.search(r'model="([^"]+)/hf_captioner"', block.text).group(1)
        os.makedirs(tmp_path / export)
        assert write_hf_captioner(str(tmp_path / export), predictor)
        to_pil(synthetic_val(1)[0]["image"]).save(tmp_path / "photo.jpg")
        want = predictor.predict([str(tmp_path / "photo.jpg")])[0]["caption"]
    finally:
        trainer.close()
    assert want, "an empty caption would make the comparison meaningless"
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(block.text, {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed and " ".join(printed[-1].split()) == want, (printed, want)
