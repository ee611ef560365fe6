"""``model.peft`` (mtl/models/peft_adapters.py): LoRA adapters through peft on the hf_vision encoder, the GPT-2 caption
decoder and the timm backbone, the base frozen; per-task adapters each active only in its task's forward, with a shared
adapter beside them; the parameters source of a gradient-level method covers the trainable parameters only; bad input
is one message naming the key and the fix, exit 2, nothing written.

The 2-processes-equal-1-process proofs (DDP and FSDP2), the naive setup's DDP failure and kill-then-resume are in
tests/test_peft_ddp.py."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

import train
from mtl.setup.build import build_run_inputs
from mtl.setup.checks import load_run_config

from .conftest import ROOT
from .pretrained_folders import local_pretrained
from .test_interop import NO_MTL

VIT_GPT2 = os.path.join(ROOT, "configs", "vit_gpt2.yaml")
SMALL = ["data.batch_size=4", "data.eval_batch_size=4", "data.synthetic.train_size=8", "data.synthetic.val_size=4",
         "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_max_batches=1", "trainer.num_samples=0",
         "checkpoint.every_steps=1", "trainer.progress=false", "optim.warmup_steps=0", "model.decoder.dropout=0.0"]
LORA = ["model.peft.method=lora", "model.peft.r=4", "model.peft.alpha=8"]
PER_TASK = [*LORA, "model.peft.per_task=true", "model.peft.shared=true", "ddp.strategy=find_unused"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The overrides pointing configs/vit_gpt2.yaml at a tiny ViT and GPT-2 written into a temporary folder."""
    from mtl.config.schema import load_config

    return local_pretrained(load_config(VIT_GPT2), tmp_path_factory.mktemp("pretrained"))


def model_of(folders, tmp_path, *extra):
    cfg = load_run_config(VIT_GPT2, [*folders, *SMALL, f"output_dir={tmp_path / 'run'}", *extra], announce=False)
    return build_run_inputs(cfg)


def test_lora_comes_from_peft_and_freezes_the_base_of_the_encoder_and_the_decoder(folders, tmp_path):
    from peft.tuners.lora import LoraLayer

    model = model_of(folders, tmp_path, *LORA).model
    lora = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    assert any(n.startswith("backbone.model.") for n in lora)  # the ViT's query/value projections
    assert any(n.startswith("heads.gen.decoder.lm.") and n.endswith("attn.c_attn") for n in lora)  # GPT-2's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, _ in model.named_parameters():
        if n.startswith("backbone.") or (n.startswith("heads.gen.decoder.lm.") and "cross" not in n):
            assert (n in trainable) == ("lora_" in n), n  # the pretrained base: frozen; the adapters: trained
    assert any(n.startswith("heads.cls.") for n in trainable)  # the heads train
    assert any("crossattention" in n and "lora_" not in n for n in trainable)  # GPT-2 has none: trained as a head
    notes = model.peft_notes
    total, train_n = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters()
                                                                     if p.requires_grad)
    assert notes[-1] == (f"model.peft: {train_n:,} trainable of {total:,} parameters "
                         f"({100 * train_n / total:.2f}%)")


def test_the_main_job_is_unchanged_peft_is_off_by_default():
    cfg = load_run_config(os.path.join(ROOT, "configs", "default.yaml"), [], announce=False)
    assert cfg.model.peft.method is None
    model = build_run_inputs(load_run_config(os.path.join(ROOT, "configs", "tiny.yaml"), [], announce=False)).model
    assert model.adapters is None and model.peft_notes == []
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.slow  # a whole (one-step) run through train.py; the counts' text is checked fast above
def test_the_start_up_prints_the_trainable_and_total_counts(folders, tmp_path, capsys):
    assert train.main(["--config", VIT_GPT2, *folders, *SMALL, *LORA, "ddp.strategy=combined",
                       f"output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "model.peft: LoRA r=4 alpha=8.0 on 4 encoder layers, adapters default" in out
    assert "trainable of" in out and "parameters (" in out


def test_each_task_s_adapter_is_active_only_in_its_task_s_forward(folders, tmp_path):
    """per_task + shared: task t's forward reaches its own adapter and the shared one, never another task's; the
    encoder runs once per task, and each task's features differ (its adapter is in them)."""
    inputs = model_of(folders, tmp_path, *PER_TASK)
    model = inputs.model
    for n, p in model.named_parameters():
        if "lora_B" in n:  # LoRA starts at B = 0: an adapter adds nothing until B moves; move it to see it
            torch.nn.init.normal_(p, std=0.1)
    batch = next(iter(inputs.train_loader()))
    for task in ("cls", "gen"):
        model.zero_grad(set_to_none=True)
        model(batch, tasks=[task])["losses"][task].backward()
        got = {n.split(".lora_")[1].split(".")[1] for n, p in model.backbone.named_parameters()
               if "lora_" in n and p.grad is not None and p.grad.abs().sum() > 0}
        assert got == {f"task_{task}", "default"}, (task, got)
    x = batch["image"]
    feats = dict(model.features_by_task(x, ["cls", "gen"]))
    assert not torch.allclose(feats["cls"], feats["gen"])
    with model.adapters.active("cls"):
        assert torch.equal(model.backbone(x), feats["cls"])
    assert not torch.allclose(model.backbone(x), feats["cls"])  # outside a task: the shared adapter alone


def test_the_timm_backbone_gets_peft_s_layers(tmp_path):
    pytest.importorskip("timm")
    from peft.tuners.lora import LoraLayer

    inputs = build_run_inputs(load_run_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "model.backbone.name=timm", "model.backbone.options.model=vit_tiny_patch16_224",
        "model.backbone.options.img_size=32", "model.backbone.options.patch_size=8",
        "model.backbone.options.embed_dim=32", "model.backbone.options.depth=2", "model.backbone.options.num_heads=2",
        *LORA, "ddp.strategy=combined", f"output_dir={tmp_path}"], announce=False))
    model = inputs.model
    lora = [n for n, m in model.backbone.named_modules() if isinstance(m, LoraLayer)]
    assert lora and all(n.endswith(".qkv") for n in lora)  # auto: timm's qkv
    assert not any(p.requires_grad for n, p in model.backbone.named_parameters() if "lora_" not in n)
    batch = next(iter(inputs.train_loader()))
    sum(model(batch)["losses"].values()).backward()
    assert all(p.grad is not None for n, p in model.backbone.named_parameters() if "lora_A" in n)


def test_the_parameters_source_covers_the_trainable_parameters_only(folders, tmp_path):
    """task_grads with a gradient-level method: its K x P matrix holds the adapters' gradients alone."""
    from mtl.run.trainer import Trainer

    trainer = Trainer.from_config(VIT_GPT2, [*folders, *SMALL, *LORA, "ddp.strategy=task_grads",
                                             "weighting.method=mgda", f"output_dir={tmp_path / 'run'}"])
    try:
        trainer.step_once()
        backbone = list(trainer.bare.backbone.named_parameters())
        adapters = sum(p.numel() for n, p in backbone if "lora_" in n)
        frozen = sum(p.numel() for n, p in backbone if "lora_" not in n)
        k = len(trainer.tasks)
        assert trainer.strategy._buf.numel() == k + k * adapters  # [K losses, G (K x P)]: P the adapters' count
        assert frozen > 10 * adapters  # and the frozen base, ten times more, is not in it
        assert all(p.grad is None for n, p in backbone if "lora_" not in n)
    finally:
        trainer.close()


# ------------------------------------------------------------------ bad input: one message, exit 2, nothing written


@pytest.mark.parametrize("extra, says", [
    ([*LORA, "model.peft.target_modules=[nothing_here]"],
     ["model.peft.target_modules: ['nothing_here'] match no layer of the hf_vision encoder", "q_proj",
      "model.peft.target_modules=auto"]),
    ([*LORA, "model.peft.per_task=true", "ddp.strategy=feature_leaf"],
     ["model.peft.per_task: true needs one encoder forward per task", "ddp.strategy=feature_leaf",
      "set ddp.strategy to combined, find_unused, accumulate or placeholder"]),
    ([*LORA, "model.peft.per_task=true", "ddp.strategy=task_grads", "weighting.method=mgda"],
     ["model.peft.per_task: true needs one encoder forward per task", "ddp.strategy=task_grads"]),
    ([*LORA, "model.peft.shared=true", "ddp.strategy=combined"], ["model.peft.shared: true", "model.peft.per_task=true"]),
    ([*LORA, "model.backbone.freeze=true"], ["model.backbone.freeze: true would freeze the backbone's adapters too"]),
    (["model.peft.r=4"], ["model.peft.r: set (command line) but not read: model.peft.method is null",
                          "Set model.peft.method=lora, or remove model.peft.r"]),
])
def test_bad_peft_input_is_one_message_exit_2_and_nothing_written(folders, tmp_path, capsys, extra, says):
    out = tmp_path / "run"
    code = train.main(["--config", VIT_GPT2, *folders, *SMALL, *extra, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "Traceback" not in err, err
    for s in says:
        assert s in err, (s, err)


def test_peft_on_a_backbone_it_cannot_wrap_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    code = train.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), *LORA, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "Traceback" not in err, err
    assert "model.peft: the 'resnet18' backbone cannot be wrapped by peft here" in err
    assert "set model.backbone.name to one of them, or remove model.peft.method" in err


def test_without_the_peft_library_one_message_names_the_extra(tmp_path, capsys, monkeypatch):
    from mtl.models import peft_adapters

    monkeypatch.setattr(peft_adapters, "installed", lambda: False)
    out = tmp_path / "run"
    code = train.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), *LORA, f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.count("pip install -e '.[peft]'") == 1 and "model.peft: the peft library is not installed" in err


# ------------------------------------------------------------------ checkpoint.trainable_only

TRAINABLE_ONLY = [*PER_TASK, "ddp.strategy=accumulate", "checkpoint.trainable_only=true", "checkpoint.every_steps=2",
                  "trainer.max_steps=4", "trainer.eval_every=100", "model.decoder.dropout=0.1", "trainer.log_every=1",
                  "data.synthetic.train_size=16"]


@pytest.mark.slow  # three short training runs in this process
def test_trainable_only_checkpoints_hold_adapters_and_heads_and_resume_exactly(folders, tmp_path, capsys):
    """The checkpoint holds the trained parameters and buffers alone, names its base by folder and hash, and a run
    resumed from its step 2 ends byte for byte where the uninterrupted run ends; predict loads it onto the base."""
    from safetensors.torch import load_file

    from mtl.checkpoint.folder import read_trainer_state
    from mtl.inference import load_model

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert train.main(["--config", VIT_GPT2, *folders, *SMALL, *TRAINABLE_ONLY, f"output_dir={ref}"]) == 0
    assert train.main(["--config", VIT_GPT2, *folders, *SMALL, *TRAINABLE_ONLY, f"output_dir={cut}",
                       f"resume={ref / 'checkpoints' / 'step_2'}"]) == 0
    capsys.readouterr()
    step4 = ref / "checkpoints" / "step_4"
    assert (step4 / "model.safetensors").read_bytes() == (cut / "checkpoints" / "step_4" / "model.safetensors").read_bytes()
    saved = load_file(str(step4 / "model.safetensors"))
    model = model_of(folders, tmp_path, *TRAINABLE_ONLY).model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained <= set(saved) and not any(n in saved for n, p in model.named_parameters() if not p.requires_grad)
    assert any(".lora_A.task_cls." in k for k in saved) and "backbone.model.layers.0.attention.q_proj.base_layer.weight" \
        not in saved
    base = read_trainer_state(str(step4))["base"]
    assert set(base) == {"model.backbone.pretrained", "model.decoder.pretrained"}
    assert all(len(b["sha256"]) == 64 for b in base.values())
    predictor = load_model(str(step4))
    image = torch.rand(2, 3, 32, 32)
    assert predictor.predict(image) == load_model(str(cut / "checkpoints" / "step_4")).predict(image)


@pytest.mark.slow  # three short training runs in this process
def test_a_trainable_only_checkpoint_on_another_base_is_refused_and_nothing_written(folders, tmp_path, capsys):
    """The base folder's weights replaced (same path, other weights): the resume is one message naming the key and
    the fix, exit 2, and the run folder is left as it was."""
    import shutil

    from .pretrained_folders import tiny_pretrained

    vit = [f for f in folders if f.startswith("model.backbone.pretrained=")][0].split("=", 1)[1]
    base = tmp_path / "vit"
    shutil.copytree(vit, base)
    args = ["--config", VIT_GPT2, *folders, *SMALL, *TRAINABLE_ONLY, f"model.backbone.pretrained={base}",
            "trainer.max_steps=2", f"output_dir={tmp_path / 'run'}"]
    assert train.main(args) == 0
    other = tiny_pretrained().write_vit(str(tmp_path / "other"), seed=1)
    shutil.copy(os.path.join(other, "model.safetensors"), base / "model.safetensors")
    before = sorted(str(p) + str(p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*"))
    capsys.readouterr()
    assert train.main([*args[:-2], "trainer.max_steps=4", f"output_dir={tmp_path / 'run'}", "resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "model.backbone.pretrained:" in err and "checkpoint.trainable_only" in err and "Traceback" not in err
    assert "point model.backbone.pretrained at that base folder" in err
    assert sorted(str(p) + str(p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")) == before


# ------------------------------------------------------------------ export: merged into today's plain folders

MERGED_CHECK = NO_MTL + textwrap.dedent('''
    import torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    export, expected_file = sys.argv[1], sys.argv[2]
    expected = torch.load(expected_file, weights_only=True)
    captioner = transformers.VisionEncoderDecoderModel.from_pretrained(f"{export}/hf_captioner").eval()
    assert not any("lora" in n for n, _ in captioner.named_parameters())  # merged: a plain model
    tokenizer = transformers.AutoProcessor.from_pretrained(f"{export}/hf_captioner").tokenizer
    with torch.no_grad():
        ids = captioner.generate(pixel_values=expected["pixel_values"], num_beams=1, do_sample=False,
                                 max_new_tokens=expected["max_new_tokens"])
        captions = [" ".join(t.split()) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        assert captions == expected["captions"], (captions, expected["captions"])
        program = torch.export.load(f"{export}/image_program.pt2").module()
        _, logits = program(expected["images"])
    assert logits.argmax(1).tolist() == expected["classes"], (logits.argmax(1).tolist(), expected["classes"])
    assert (logits.softmax(1).max(1).values - torch.tensor(expected["probs"])).abs().max() < 1e-4
    # the adapters apart: peft's own folders onto the base folder, the class head from mtl's model.safetensors
    import peft
    from safetensors.torch import load_file
    base = transformers.AutoModel.from_pretrained(expected["base"], add_pooling_layer=False).eval()
    first, *more = expected["adapters"]
    encoder = peft.PeftModel.from_pretrained(base, f"{export}/peft_adapters/encoder/{first[1]}",
                                             adapter_name=first[0]).eval()
    for name, sub in more:
        encoder.load_adapter(f"{export}/peft_adapters/encoder/{sub}", adapter_name=name)
    encoder.base_model.set_adapter([name for name, _ in expected["adapters"]])
    head = load_file(f"{export}/model.safetensors")
    with torch.no_grad():
        h = encoder(pixel_values=expected["pixel_values"]).last_hidden_state[:, 0]
        logits = h @ head["heads.cls.fc.weight"].T + head["heads.cls.fc.bias"]
    assert logits.argmax(1).tolist() == expected["classes"], (logits.argmax(1).tolist(), expected["classes"])
    assert (logits.softmax(1).max(1).values - torch.tensor(expected["probs"])).abs().max() < 1e-4
    # captions: the caption task's encoder adapters and the decoder's adapter (with its cross-attention), merged by peft
    encoder = peft.PeftModel.from_pretrained(
        transformers.AutoModel.from_pretrained(expected["base"], add_pooling_layer=False),
        f"{export}/peft_adapters/encoder/{expected['gen_adapters'][0][1]}", adapter_name=expected["gen_adapters"][0][0])
    for name, sub in expected["gen_adapters"][1:]:
        encoder.load_adapter(f"{export}/peft_adapters/encoder/{sub}", adapter_name=name)
    encoder.base_model.set_adapter([name for name, _ in expected["gen_adapters"]])
    decoder = peft.PeftModel.from_pretrained(
        transformers.GPT2LMHeadModel.from_pretrained(expected["decoder_base"], add_cross_attention=True),
        f"{export}/peft_adapters/decoder")
    ved = transformers.VisionEncoderDecoderModel(encoder=encoder.merge_and_unload(),
                                                 decoder=decoder.merge_and_unload()).eval()
    ved.generation_config = transformers.GenerationConfig.from_pretrained(f"{export}/hf_captioner")
    ved.config.decoder_start_token_id = ved.generation_config.decoder_start_token_id
    ved.config.pad_token_id = ved.generation_config.pad_token_id
    with torch.no_grad():
        ids = ved.generate(pixel_values=expected["pixel_values"], num_beams=1, do_sample=False,
                           max_new_tokens=expected["max_new_tokens"])
    apart = [" ".join(t.split()) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    assert apart == expected["captions"], (apart, expected["captions"])
    print(json.dumps({"captions": len(captions)}))
''')


@pytest.mark.slow  # trains, exports, and loads the export in a process without mtl
@pytest.mark.parametrize("layout", ["shared", "per_task"])
def test_a_lora_export_gives_mtl_s_classes_and_captions_without_mtl(folders, tmp_path, layout):
    """Merged: the adapters merged into the base (with per-task adapters: the caption task's into the captioner's
    encoder, the class task's into the image program's) and peft's layers gone: transformers' VisionEncoderDecoderModel
    and the torch image program give what mtl's predict gives. Apart: peft's adapter folders of the encoder, loaded by
    PeftModel.from_pretrained onto the base folder (the class task's and the shared one active), with the class head
    from model.safetensors, give mtl's classes; the caption task's and the GPT-2 decoder's (its cross-attention
    in modules_to_save) onto the base ViT and GPT-2 folders, merged by peft's merge_and_unload into a
    VisionEncoderDecoderModel, give mtl's captions. All in a process that cannot import mtl."""
    import json
    import subprocess
    import sys

    from mtl.data.images import normalize_images
    from mtl.inference import load_model
    from mtl.tools import export as export_tool

    extra = PER_TASK if layout == "per_task" else [*LORA, "ddp.strategy=combined"]
    run = tmp_path / "run"
    assert train.main(["--config", VIT_GPT2, *folders, *SMALL, *extra, "trainer.max_steps=3", "optim.lr=0.05",
                       "checkpoint.every_steps=3", f"output_dir={run}"]) == 0
    for n, p in load_model(str(run / "checkpoints" / "step_3")).model.named_parameters():
        if "lora_B" in n:
            assert float(p.abs().max()) > 0, n  # the adapters trained: merging them changes the weights
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", str(run), "--out", str(export)]) == 0
    from safetensors.torch import load_file

    for _, sub in ([("task_cls", "task_cls"), ("default", "default")] if layout == "per_task" else [("", "")]):
        saved = load_file(str(export / "peft_adapters" / "encoder" / sub / "adapter_model.safetensors"))
        assert all(k.startswith("base_model.model.layers.") for k in saved)  # onto the ViT as transformers loads it
        assert any(".lora_B." in k and float(v.abs().max()) > 0 for k, v in saved.items())  # the trained adapter
    decoder = load_file(str(export / "peft_adapters" / "decoder" / "adapter_model.safetensors"))
    assert any(".crossattention." in k for k in decoder) and any(".attn.c_attn.lora_B." in k for k in decoder)
    predictor = load_model(str(export))
    images = torch.rand(4, 3, 32, 32)
    got = predictor.predict(images)
    expected = {"images": images, "pixel_values": normalize_images(images, predictor.normalization),
                "max_new_tokens": predictor.model.heads["gen"].max_new_tokens,
                "captions": [p["caption"] for p in got], "classes": [p["class_index"] for p in got],
                "probs": [p["prob"] for p in got],
                "base": [f for f in folders if f.startswith("model.backbone.pretrained=")][0].split("=", 1)[1],
                "adapters": [("task_cls", "task_cls"), ("default", "default")] if layout == "per_task"
                else [("default", "")],
                "gen_adapters": [("task_gen", "task_gen"), ("default", "default")] if layout == "per_task"
                else [("default", "")],
                "decoder_base": [f for f in folders if f.startswith("model.decoder.pretrained=")][0].split("=", 1)[1]}
    assert any(expected["captions"]), "empty captions only would make the comparison meaningless"
    torch.save(expected, tmp_path / "expected.pt")
    script = tmp_path / "check.py"
    script.write_text(MERGED_CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", str(script), str(export), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["captions"] == 4
