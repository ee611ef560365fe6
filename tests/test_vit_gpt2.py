"""A captioner in transformers' layout, in and out (mtl/models/vision_encoder_decoder.py): ``init_from`` of a
``VisionEncoderDecoderModel`` folder (a tiny random ViT-GPT2, as scripts/make_tiny_pretrained.py writes it) makes its
encoder the backbone, its decoder the caption head's and its tokenizer the run's; a folder that cannot be used is
refused by name before anything is written; an export holds the trained model again as such a folder
(``hf_captioner/``), whose ``generate`` and ``pipeline("image-to-text")`` give mtl's captions without mtl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from mtl.data.images import normalize_images
from mtl.errors import ConfigError
from mtl.inference import load_model
from mtl.models import vision_encoder_decoder as ved
from mtl.run.trainer import Trainer
from mtl.tools import export as export_tool

from . import pretrained_folders
from .conftest import TINY
from .test_inference import synthetic_val, to_pil
from .test_interop import NO_MTL

tiny_pretrained = pretrained_folders.tiny_pretrained()  # scripts/make_tiny_pretrained.py

DECODER = ["model.decoder.n_layer=2", "model.decoder.n_embd=64", "model.decoder.n_head=4",
           "model.decoder.max_positions=32", "model.decoder.dropout=0.0"]  # the tiny GPT-2's sizes


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny ViT, GPT-2 and their VisionEncoderDecoderModel (with image processor, tokenizer and processor)."""
    out = tmp_path_factory.mktemp("pretrained")
    vit = tiny_pretrained.write_vit(str(out / "vit"))
    gpt2 = tiny_pretrained.write_gpt2(str(out / "gpt2"))
    return {"vit": vit, "gpt2": gpt2, "vit-gpt2": tiny_pretrained.write_vit_gpt2(str(out / "vit-gpt2"), vit, gpt2),
            "dinov2": tiny_pretrained.write_dinov2(str(out / "dinov2"))}


def overrides(out, folders, *extra):
    return [f"output_dir={out}", f"init_from={folders['vit-gpt2']}", "model.backbone.name=hf_vision",
            f"model.backbone.pretrained={folders['vit']}", *DECODER, "trainer.eval_max_batches=0",
            "checkpoint.every_steps=0", "optim.warmup_steps=0", *extra]


def folder_tensors(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def transformers_model(folder):
    from transformers import VisionEncoderDecoderModel

    return VisionEncoderDecoderModel.from_pretrained(folder, local_files_only=True)


def test_init_from_a_vit_gpt2_folder_loads_its_encoder_decoder_and_tokenizer_and_trains(tmp_path, folders, capsys):
    trainer = Trainer.from_config(TINY, overrides(tmp_path / "run", folders, "trainer.max_steps=1"))
    try:
        said = capsys.readouterr().out
        assert "encoder -> backbone.model" in said and "started fresh (not in a captioner): heads.cls" in said
        assert "encoder.pooler.dense.weight" in said  # the one tensor no mtl module holds is named
        own = trainer.bare.state_dict()
        folder = transformers_model(folders["vit-gpt2"]).state_dict()  # the folder's tensors, as transformers names them
        for k, v in folder.items():
            if k.startswith("encoder.pooler."):
                continue
            ours = ("backbone.model." + k[len("encoder."):] if k.startswith("encoder.")
                    else "heads.gen.decoder.lm." + k[len("decoder."):])
            assert torch.equal(own[ours], v), k
        assert {k for k in own if not k.startswith("heads.cls.")} == {
            ("backbone.model." + k[len("encoder."):] if k.startswith("encoder.") else "heads.gen.decoder.lm." + k[8:])
            for k in folder if not k.startswith("encoder.pooler.")}
        assert isinstance(trainer.bare.heads["gen"].proj, torch.nn.Identity)  # both 64 wide, as the VED: no proj
        assert trainer.tokenizer.vocab() == json.load(open(os.path.join(folders["vit-gpt2"], "tokenizer.json")))[
            "model"]["vocab"] | {t["content"]: t["id"] for t in json.load(open(
                os.path.join(folders["vit-gpt2"], "tokenizer.json")))["added_tokens"]}
        before = {k: v.clone() for k, v in own.items()}
        result = trainer.step_once()
        assert all(torch.isfinite(torch.tensor(float(v))) for v in result.losses.values())
        after = trainer.bare.state_dict()
        for part in ("backbone.model.layers.0.", "heads.gen.decoder.lm.transformer.h.0.", "heads.cls."):
            assert any(not torch.equal(before[k], after[k]) for k in after if k.startswith(part)), part
    finally:
        trainer.close()


def _ved(folder, encoder=None, decoder=None):
    """A VisionEncoderDecoderModel folder from tiny random parts (saved as transformers saves it)."""
    from transformers import VisionEncoderDecoderModel

    VisionEncoderDecoderModel(encoder=encoder, decoder=decoder).save_pretrained(folder)
    return str(folder)


def _refused(tmp_path, folders, *extra, init_from=None):
    args = overrides(tmp_path / "run", folders, *extra)
    if init_from is not None:
        args = [a if not a.startswith("init_from=") else f"init_from={init_from}" for a in args]
    with pytest.raises(ConfigError) as e:
        Trainer.from_config(TINY, args).close()
    assert not os.path.exists(tmp_path / "run") or not os.listdir(tmp_path / "run"), "a refused run writes nothing"
    return e.value.message


def test_a_folder_that_is_not_a_usable_captioner_is_refused_by_name(tmp_path, folders):
    from transformers import BertConfig, BertLMHeadModel, ViTModel

    # a transformers folder that is not a VisionEncoderDecoderModel
    said = _refused(tmp_path, folders, init_from=folders["gpt2"])
    assert "init_from" in said and "'gpt2'" in said and "vision-encoder-decoder" in said
    # a decoder that is not a GPT-2
    bert = BertLMHeadModel(BertConfig(vocab_size=27, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, is_decoder=True, add_cross_attention=True))
    folder = _ved(tmp_path / "vit-bert", ViTModel.from_pretrained(folders["vit"]), bert)
    said = _refused(tmp_path, folders, init_from=folder)
    assert "decoder" in said and "'bert'" in said and "GPT-2" in said
    # a backbone that is not hf_vision; a decoder of another size
    assert "model.backbone.name" in _refused(tmp_path, folders, "model.backbone.name=resnet18")
    said = _refused(tmp_path, folders, "model.decoder.n_layer=1")
    assert "model.decoder.n_layer: 1 here" in said and "set model.decoder.n_layer=2" in said
    # images normalised otherwise than the captioner was trained (its preprocessor_config.json)
    said = _refused(tmp_path, folders, "data.normalize=imagenet")
    assert "data.normalize" in said and "(0.5, 0.5, 0.5)" in said
    # a tokenizer whose vocabulary is not the decoder's
    from mtl.data.tokenizer import train_tokenizer

    other = tmp_path / "other_tokenizer"
    train_tokenizer(["a completely different vocabulary of words"], 64).save(str(other))
    said = _refused(tmp_path, folders, f"tokenizer.path={other}")
    assert "tokenizer" in said and "27 rows" in said and "not the same vocabulary" in said


def test_vit_gpt2_to_mtl_and_back_gives_the_same_tensors(tmp_path, folders):
    """VED folder -> mtl's model (init_from) -> VED (the export's map): every tensor as it was, but the pooler,
    which mtl does not hold and the export names."""
    trainer = Trainer.from_config(TINY, overrides(tmp_path / "run", folders, "trainer.max_steps=1"))
    try:
        model, untrained = ved.to_vision_encoder_decoder(trainer.bare.backbone, trainer.bare.heads["gen"])
    finally:
        trainer.close()
    assert untrained == ["encoder.pooler.dense.weight", "encoder.pooler.dense.bias"]
    original = transformers_model(folders["vit-gpt2"]).state_dict()
    back = model.state_dict()
    assert set(back) == set(original)
    assert all(k in untrained or torch.equal(back[k], v) for k, v in original.items())
    # and as files: what save_pretrained writes is the folder's model.safetensors, tensor for tensor
    model.save_pretrained(tmp_path / "back")
    files, saved = folder_tensors(folders["vit-gpt2"]), folder_tensors(tmp_path / "back")
    assert set(saved) == set(files)
    differ = {k for k in files if not torch.equal(saved[k], files[k])}
    assert differ <= set(untrained), differ  # the pooler: initialised afresh (seeded), as mtl_export.json says


def test_a_dinov2_run_with_a_narrower_decoder_is_a_vision_encoder_decoder_with_its_projection(tmp_path, folders):
    """DINOv2 (64 wide) and a 32-wide GPT-2: the head's Linear is the VED's enc_to_dec_proj, and generate gives the
    head's captions, greedy and with beams."""
    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path / 'run'}", "model.backbone.name=hf_vision",
                                         f"model.backbone.pretrained={folders['dinov2']}", "trainer.max_steps=1"])
    try:
        backbone, head = trainer.bare.backbone, trainer.bare.heads["gen"]
        model, untrained = ved.to_vision_encoder_decoder(backbone, head)
        trainer.bare.eval()
        assert untrained == [] and torch.equal(model.enc_to_dec_proj.weight, head.proj.weight)
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            memory = head.memory(backbone(x))
            for beams in (1, 3):
                ours = head.decoder.generate(memory, head.max_new_tokens, beams)
                ids = model.generate(pixel_values=x, num_beams=beams, do_sample=False, max_new_tokens=head.max_new_tokens)
                theirs = [[t for t in row[1:] if t != head.decoder.pad_id] for row in ids.tolist()]
                theirs = [row[: row.index(head.decoder.eos_id)] if head.decoder.eos_id in row else row for row in theirs]
                assert theirs == ours and any(ours), (beams, theirs, ours)
    finally:
        trainer.close()


CAPTIONER_CHECK = NO_MTL + textwrap.dedent('''
    import torch
    import transformers
    from PIL import Image
    transformers.utils.logging.set_verbosity_error()
    export, expected_file = sys.argv[1], sys.argv[2]
    expected = torch.load(expected_file, weights_only=True)
    captioner = transformers.VisionEncoderDecoderModel.from_pretrained(f"{export}/hf_captioner").eval()
    processor = transformers.AutoProcessor.from_pretrained(f"{export}/hf_captioner")
    tokenizer = processor.tokenizer
    def captions(ids):
        return [" ".join(t.split()) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    with torch.no_grad():
        for beams, want in expected["captions"].items():
            ids = captioner.generate(pixel_values=expected["pixel_values"], num_beams=beams, do_sample=False,
                                     max_new_tokens=expected["max_new_tokens"])
            assert captions(ids) == want, (beams, captions(ids), want)
        assert captions(captioner.generate(pixel_values=expected["pixel_values"])) == expected["configured"]
    pipe = transformers.pipeline("image-to-text", model=f"{export}/hf_captioner")
    pil = [Image.open(p).convert("RGB") for p in expected["files"]]
    out = pipe(pil, text=[""] * len(pil), generate_kwargs={"num_beams": 1, "do_sample": False})
    got = [" ".join(o["generated_text"].split()) for o in out]
    assert got == expected["file_captions"], (got, expected["file_captions"])
    # README.md's section for it, as written, from the export folder, on the same images as a tensor
    import os, re
    readme = open(f"{export}/README.md").read()
    section = readme[readme.index("## The captioner"):]
    section = section.split("\\n## ")[0]
    blocks = re.findall(r"```python\\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    os.chdir(export)
    scope = {"images": expected["images"]}
    for block in blocks:
        exec(block, scope)
    assert scope["captions"] == expected["file_captions"], (scope["captions"], expected["file_captions"])
    assert scope["pipeline_captions"] == expected["file_captions"], scope["pipeline_captions"]
    assert not [m for m in sys.modules if m == "mtl" or m.startswith(("mtl.", "mtl_plugins"))]
    print(json.dumps({"captions": len(got)}))
''')


@pytest.mark.slow  # trains 3 steps, exports, and loads the export in a process without mtl (~15 s)
def test_an_exported_vit_gpt2_run_captions_as_mtl_does_in_transformers_without_mtl(tmp_path, folders):
    run = tmp_path / "run"
    Trainer.from_config(TINY, overrides(run, folders, "trainer.max_steps=3", "checkpoint.every_steps=3",
                                        "task_options.gen.num_beams=2")).train()
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", str(run), "--out", str(export)]) == 0
    assert "## The captioner (transformers): `hf_captioner/`" in (export / "README.md").read_text()
    predictor = load_model(str(export))
    images = torch.stack([synthetic_val(6)[i]["image"] for i in range(6)])
    files = []
    for i, image in enumerate(images):
        files.append(str(tmp_path / f"img{i}.png"))
        to_pil(image).save(files[-1])
    head = predictor.model.heads["gen"]
    loaded = predictor.load_images(files)  # the files as mtl reads them: what predict(files) captions
    expected = {"images": loaded, "pixel_values": normalize_images(loaded, predictor.normalization),
                "max_new_tokens": head.max_new_tokens, "files": files}
    expected["captions"] = {b: [p["caption"] for p in predictor.predict(files, num_beams=b)] for b in (1, 2)}
    expected["configured"] = expected["captions"][2]
    expected["file_captions"] = expected["captions"][1]
    assert any(expected["captions"][1]), "an empty caption would make the comparison meaningless"
    torch.save(expected, tmp_path / "expected.pt")
    script = tmp_path / "check.py"
    script.write_text(CAPTIONER_CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", str(script), str(export), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["captions"] == 6


def test_a_captioner_whose_tokenizer_lacks_words_of_the_captions_grows_its_decoder(tmp_path, folders, capsys,
                                                                                   monkeypatch):
    """A ViT-GPT2 whose tokenizer (and decoder vocabulary) never saw one colour of the built-in captions: the run's
    tokenizer extends the folder's (its ids kept), the decoder grows as resize_token_embeddings does: the folder's
    rows kept exactly, one new row per added word; the grown model trains."""
    import mtl.data.synthetic as synthetic

    missing = synthetic.COLOUR_NAMES[-1]
    monkeypatch.setattr(synthetic, "COLOUR_NAMES", synthetic.COLOUR_NAMES[:-1])  # what the folders' tokenizer sees
    gpt2 = tiny_pretrained.write_gpt2(str(tmp_path / "gpt2"))
    captioner = tiny_pretrained.write_vit_gpt2(str(tmp_path / "vit-gpt2"), folders["vit"], gpt2)
    monkeypatch.undo()
    small = folder_tensors(captioner)["decoder.transformer.wte.weight"]
    trainer = Trainer.from_config(TINY, overrides(tmp_path / "run", {**folders, "vit-gpt2": captioner},
                                                  "trainer.max_steps=1"))
    try:
        said = capsys.readouterr().out
        old = json.load(open(os.path.join(captioner, "tokenizer.json")))["model"]["vocab"]
        assert missing not in old and trainer.tokenizer.vocab()[missing] >= small.shape[0]
        assert all(trainer.tokenizer.vocab()[w] == i for w, i in old.items())
        assert f"vocabulary {small.shape[0]} -> {trainer.tokenizer.vocab_size} tokens" in said, said
        wte = trainer.bare.state_dict()["heads.gen.decoder.lm.transformer.wte.weight"]
        assert wte.shape[0] == trainer.tokenizer.vocab_size > small.shape[0]
        assert torch.equal(wte[:small.shape[0]], small)
        result = trainer.step_once()
        assert all(torch.isfinite(torch.tensor(float(v))) for v in result.losses.values())
    finally:
        trainer.close()
