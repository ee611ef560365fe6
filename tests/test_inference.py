"""Using what you trained: export, load_model, predict, evaluate, and the init_from warm start.

Every run here is real: configs/tiny.yaml for a few steps through train.py's main() in this process.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from mtl.data.manifest import ManifestDataset
from mtl.data.synthetic import SHAPES, SyntheticShapes
from mtl.data.tokenizer import CaptionTokenizer
from mtl.inference import eval_config, eval_dataset, load_model
from mtl.parallel.dist import DistInfo
from mtl.run.evaluate import evaluate
from mtl.tools import evaluate as evaluate_tool
from mtl.tools import export as export_tool
from mtl.tools import predict as predict_tool

from .conftest import ROOT, TINY

_spec = importlib.util.spec_from_file_location("mtl_train_script", os.path.join(ROOT, "train.py"))
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)

METRICS = ("cls_acc", "cls_loss", "gen_bleu4", "gen_chrf", "gen_exact", "gen_loss", "gen_ppl")


def train(out, *overrides, max_steps=4):
    rc = train_script.main(["--config", TINY, f"output_dir={out}", f"trainer.max_steps={max_steps}",
                            "trainer.eval_max_batches=0", "checkpoint.every_steps=0", *overrides])
    assert rc == 0
    return str(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny synthetic run: output_dir, with checkpoints/step_4 and final_metrics.json."""
    return train(tmp_path_factory.mktemp("inference") / "run")


def checkpoint(run_dir, step=4):
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def synthetic_val(n, num_classes=4):
    return SyntheticShapes(size=n, image_size=32, num_classes=num_classes, max_count=3, noise=0.05, clutter=0,
                           seed=1_000_003)


def to_pil(image):
    return Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


def write_images(folder, items, jpeg_every=3):
    """Synthetic val items as PNG/JPEG files (+ a manifest.jsonl); returns [(path, label, caption)]."""
    os.makedirs(folder, exist_ok=True)
    rows = []
    for i, item in enumerate(items):
        path = os.path.join(folder, f"img{i:02d}." + ("jpg" if i % jpeg_every == 2 else "png"))
        to_pil(item["image"]).save(path)
        rows.append((path, item["label"], item["captions"][0]))
    with open(os.path.join(folder, "manifest.jsonl"), "w") as f:
        f.writelines(json.dumps({"image": os.path.basename(p), "label": lab, "caption": c}) + "\n"
                     for p, lab, c in rows)
    return rows


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ export and load_model


def test_export_round_trip_rebuilds_the_trained_model(run, tmp_path):
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", checkpoint(run), "--out", str(export)]) == 0
    assert sorted(os.listdir(export)) == ["README.md", "class_names.json", "config.yaml", "hf_decoder", "image_program.json",
                                          "image_program.pt2", "manifest.json", "model.safetensors", "tokenizer",
                                          "torchvision_backbone"]
    assert os.path.isfile(export / "tokenizer" / "tokenizer.json")
    assert json.loads((export / "class_names.json").read_text()) == SHAPES[:4]

    exported, original = load_model(export, "cpu"), load_model(checkpoint(run), "cpu")
    assert not exported.model.training and exported.device == torch.device("cpu")
    assert exported.class_names == SHAPES[:4] and exported.tokenizer.vocab_size == original.tokenizer.vocab_size
    saved = load_file(os.path.join(checkpoint(run), "model.safetensors"))
    for k, v in exported.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    images = torch.stack([synthetic_val(6)[i]["image"] for i in range(6)])
    with torch.no_grad():
        a, b = exported.model.backbone(images), original.model.backbone(images)
        assert torch.equal(exported.model.heads["cls"].logits(a), original.model.heads["cls"].logits(b))
    assert exported.predict(images, num_beams=2) == original.predict(images, num_beams=2)
    # the trained model itself: its own final evaluation (run in memory, right before the save)
    final = json.loads(open(os.path.join(run, "final_metrics.json")).read())
    metrics = evaluate_tool.main(["--checkpoint", str(export), "--out", str(tmp_path / "m.json"), "--device", "cpu"])
    assert metrics == 0
    got = json.loads((tmp_path / "m.json").read_text())
    for k in METRICS:
        assert got[k] == pytest.approx(final[k], rel=1e-9, abs=1e-12), k


def test_load_model_takes_a_run_folder_or_the_weights_file(run):
    by_run = load_model(run)
    by_file = load_model(os.path.join(checkpoint(run), "model.safetensors"))
    assert by_run.files.folder == by_file.files.folder == checkpoint(run)
    assert by_run.files.tokenizer == os.path.join(checkpoint(run), "tokenizer") or \
        by_run.files.tokenizer == os.path.join(run, "tokenizer")


# ------------------------------------------------------------------ evaluate


def test_evaluate_tool_equals_the_runs_own_final_eval(run, tmp_path):
    final = json.loads(open(os.path.join(run, "final_metrics.json")).read())
    out = tmp_path / "sub" / "metrics.json"
    assert evaluate_tool.main(["--checkpoint", checkpoint(run), "--config", TINY, f"--out={out}"]) == 0
    got = json.loads(out.read_text())
    assert got["images"] == 64 and got["checkpoint"] == checkpoint(run)
    for k in METRICS:
        assert got[k] == pytest.approx(final[k], rel=1e-9, abs=1e-12), k
    # another data set: other seed -> other images, other metrics
    assert evaluate_tool.main(["--checkpoint", checkpoint(run), "seed=5", "data.synthetic.val_size=32",
                               f"--out={out}"]) == 0
    other = json.loads(out.read_text())
    assert other["images"] == 32 and other["gen_loss"] != got["gen_loss"]


def test_predict_and_evaluate_agree_on_a_manifest_of_image_files(run, tmp_path, capsys):
    val = synthetic_val(20)
    rows = write_images(tmp_path / "imgs", [val[i] for i in range(20)])
    manifest = tmp_path / "imgs" / "manifest.jsonl"
    out = tmp_path / "metrics.json"
    assert evaluate_tool.main(["--checkpoint", run, "data.source=manifest", f"data.val_path={manifest}",
                               "data.eval_batch_size=7", f"--out={out}"]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["images"] == 20
    capsys.readouterr()
    assert predict_tool.main(["--model", run, *[p for p, _, _ in rows]]) == 0
    preds = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["image"] for p in preds] == [p for p, _, _ in rows]
    acc = np.mean([p["class_index"] == lab for p, (_, lab, _) in zip(preds, rows)])
    exact = np.mean([p["caption"] == cap for p, (_, _, cap) in zip(preds, rows)])
    assert metrics["cls_acc"] == pytest.approx(acc) and metrics["gen_exact"] == pytest.approx(exact)


# ------------------------------------------------------------------ predict


@pytest.mark.parametrize("beams", [1, 3])
def test_predict_a_folder_as_training_and_eval_see_it(run, tmp_path, beams):
    val = synthetic_val(8)
    rows = write_images(tmp_path / "imgs" / "nested", [val[i] for i in range(8)])
    (tmp_path / "imgs" / "README.txt").write_text("not an image")
    out = tmp_path / "preds.jsonl"
    args = ["--model", run, str(tmp_path / "imgs"), "--out", str(out), "--batch-size", "3"]
    assert predict_tool.main(args + (["--beams", str(beams)] if beams > 1 else [])) == 0
    preds = read_jsonl(out)
    assert [p["image"] for p in preds] == sorted(p for p, _, _ in rows)  # the folder's images, not README.txt
    for p in preds:
        assert p["class"] in SHAPES[:4] and SHAPES.index(p["class"]) == p["class_index"]
        assert 0.25 <= p["prob"] <= 1.0 and isinstance(p["caption"], str)

    # the same files through the data code (ManifestDataset), then the project's evaluation code
    predictor = load_model(run)
    ds = ManifestDataset(str(tmp_path / "imgs" / "nested" / "manifest.jsonl"), image_size=32, num_classes=4)
    batch = torch.stack([ds[i]["image"] for i in range(len(ds))])
    direct = predictor.predict(batch, num_beams=beams)
    by_path = {p["image"]: p for p in preds}
    for (path, _, _), d in zip(rows, direct):  # batches of 3 against one of 8: the same up to float summation order
        got = dict(by_path[path])
        assert got.pop("prob") == pytest.approx(d["prob"], rel=1e-5, abs=1e-6)
        assert got == {"image": path, **{k: v for k, v in d.items() if k != "prob"}}
    gen = predictor.model.heads["gen"]
    gen.num_beams = beams
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=_collate(predictor))
    metrics = evaluate(predictor.model, loader, ["cls", "gen"], predictor.device)
    assert [h for _, h, _ in metrics["gen"]["samples"]] == [d["caption"] for d in direct]
    assert metrics["cls"]["acc"] == pytest.approx(np.mean([d["class_index"] == lab for d, (_, lab, _) in
                                                           zip(direct, rows)]))


def _collate(predictor):
    from mtl.setup.build import build_collate

    return build_collate(predictor.cfg, len(predictor.class_names), predictor.class_names, predictor.tokenizer)


def test_beam_search_is_used_when_asked(run):
    predictor = load_model(run)
    images = torch.stack([synthetic_val(16)[i]["image"] for i in range(16)])
    head = predictor.model.heads["gen"]
    n = head.max_new_tokens
    with torch.no_grad():
        memory = head.memory(predictor.model.backbone(images))
        expected = {beams: [predictor.tokenizer.decode(t) for t in head.decoder.generate(memory, n, beams)]
                    for beams in (1, 4)}
    assert [p["caption"] for p in predictor.predict(images)] == expected[1]
    assert [p["caption"] for p in predictor.predict(images, num_beams=4)] == expected[4]


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_imagefolder_runs_keep_their_class_names(tmp_path):
    """The class list is the training set's sorted folder names; an ImageFolder run must save it."""
    root = tmp_path / "folder"
    names = ["zebra", "apple"]  # folder order != this order: names come from the sorted folders
    val = synthetic_val(16, num_classes=2)
    lines = []
    for i in range(16):
        item = val[i]
        cls = sorted(names)[item["label"]]
        os.makedirs(root / cls, exist_ok=True)
        to_pil(item["image"]).save(root / cls / f"{i}.png")
        lines.append(json.dumps({"image": f"{cls}/{i}.png", "caption": item["captions"][0]}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    out = train(tmp_path / "run", "data.source=imagefolder", f"data.train_path={root}", f"data.val_path={root}",
                max_steps=2)
    assert load_model(checkpoint(out, 2)).class_names == ["apple", "zebra"]
    final = json.loads(open(os.path.join(out, "final_metrics.json")).read())
    assert evaluate_tool.main(["--checkpoint", out, "--out", str(tmp_path / "m.json")]) == 0
    got = json.loads((tmp_path / "m.json").read_text())
    assert got["images"] == 16 and got["cls_acc"] == final["cls_acc"] and got["gen_loss"] == final["gen_loss"]
    preds = tmp_path / "p.jsonl"
    assert predict_tool.main(["--model", out, str(root), "--out", str(preds)]) == 0
    got = read_jsonl(preds)
    assert len(got) == 16 and {p["class"] for p in got} <= {"apple", "zebra"}
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", out, "--out", str(export)]) == 0
    assert load_model(export).class_names == ["apple", "zebra"]


# ------------------------------------------------------------------ warm start (init_from)


def _trainer(cfg_overrides):
    from mtl.run.trainer import Trainer
    from mtl.setup.checks import load_run_config

    return Trainer(load_run_config(TINY, cfg_overrides), DistInfo())


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_init_from_starts_a_new_run_from_the_weights(run, tmp_path, capsys):
    new = tmp_path / "warm"
    source = checkpoint(run)
    saved = load_file(os.path.join(source, "model.safetensors"))
    # fewer training captions: a tokenizer trained on them would not fit the weights' vocabulary
    trainer = _trainer([f"output_dir={new}", f"init_from={source}", "trainer.max_steps=2",
                        "data.synthetic.train_size=16"])
    try:
        assert trainer.step == 0 and trainer.feed.epoch == 0
        assert not trainer.optimizer.state  # fresh: no moments
        assert trainer.scheduler.last_epoch == 0 and trainer.scheduler.get_last_lr()[0] == 0.0  # warmup starts over
        for k, v in trainer.bare.state_dict().items():
            assert torch.equal(v, saved[k]), k
        # the weights' own vocabulary
        assert trainer.tokenizer._tok.get_vocab() == CaptionTokenizer.load(os.path.join(run, "tokenizer"))._tok.get_vocab()
    finally:
        trainer.close()
    # end to end through train.py; the export folder works as a source too
    export = tmp_path / "export"
    assert export_tool.main(["--checkpoint", source, "--out", str(export)]) == 0
    capsys.readouterr()
    train(tmp_path / "warm2", f"init_from={export}", max_steps=2)
    assert "init_from: a new run from the weights" in capsys.readouterr().out
    state = torch.load(os.path.join(checkpoint(tmp_path / "warm2", 2), "trainer_state.pt"), weights_only=True)
    assert state["step"] == 2 and state["scheduler"]["last_epoch"] == 2


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_resume_wins_over_init_from_and_may_drop_it(run, tmp_path, capsys):
    out = train(tmp_path / "warm", f"init_from={checkpoint(run)}", max_steps=2)
    resumed_weights = load_file(os.path.join(checkpoint(out, 2), "model.safetensors"))
    for extra in ([f"init_from={checkpoint(run)}"], []):  # init_from kept, or dropped on the resume
        trainer = _trainer([f"output_dir={out}", "resume=auto", "trainer.max_steps=3", *extra])
        try:
            assert trainer.step == 2
            assert ("init_from: not used, resuming from" in capsys.readouterr().out) == bool(extra)
            for k, v in trainer.bare.state_dict().items():
                assert torch.equal(v, resumed_weights[k]), k
        finally:
            trainer.close()


@pytest.mark.parametrize("change, says", [
    ("model.backbone.stages=3", ["missing", "backbone.layers.2."]),  # another backbone: refused
    ("model.decoder.n_layer=2", ["missing", "heads.gen.decoder"]),  # a head with other layers (keys): refused
])
def test_init_from_that_does_not_fit_names_the_keys(run, tmp_path, capsys, change, says):
    rc = train_script.main(["--config", TINY, f"output_dir={tmp_path / 'x'}", f"init_from={run}", change])
    err = capsys.readouterr().err
    assert rc == 4 and "Traceback" not in err
    assert "init_from" in err and "model.*" in err and all(s in err for s in says), err
    assert not os.path.exists(tmp_path / "x" / "checkpoints")


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_init_from_onto_a_new_class_count_reinitialises_that_head_only(run, tmp_path, capsys):
    """Fine-tuning onto new labels with init_from_fresh_class_head=true: the 4-class model moves to 3 classes.
    heads.cls keeps its fresh initialisation (the same as a run without init_from), is named, and every other weight
    is the source's. (Without the key the rows follow the class names: tests/test_finetune.py.)"""
    source = checkpoint(run)
    saved = load_file(os.path.join(source, "model.safetensors"))
    common = ["trainer.max_steps=1", "data.synthetic.num_classes=3", "data.synthetic.train_size=16"]
    warm = _trainer([f"output_dir={tmp_path / 'warm'}", f"init_from={source}", "init_from_fresh_class_head=true",
                     *common])
    cold = _trainer([f"output_dir={tmp_path / 'cold'}", *common, f"tokenizer.path={os.path.join(run, 'tokenizer')}"])
    try:
        out = capsys.readouterr().out
        assert "init_from: heads.cls: fresh (init_from_fresh_class_head=true)" in out, out
        assert warm.bare.heads["cls"].fc.weight.shape[0] == 3
        fresh, loaded = cold.bare.state_dict(), warm.bare.state_dict()
        for k, v in loaded.items():
            if k.startswith("heads.cls."):
                assert torch.equal(v, fresh[k]), k  # its fresh initialisation
            else:
                assert torch.equal(v, saved[k]), k  # the source's
        assert any(k.startswith("heads.cls.") and saved[k].shape != loaded[k].shape for k in loaded)
    finally:
        warm.close()
        cold.close()
    train(tmp_path / "warm2", f"init_from={source}", *common, max_steps=2)  # and it trains, end to end


BAD_CONFIG = {
    "missing init_from": (lambda p, run: [f"init_from={p / 'nope'}"], 2, ["init_from", "does not exist"]),
    "init_from with resume=<dir>": (lambda p, run: [f"init_from={run}", f"resume={checkpoint(run)}"], 2,
                                    ["init_from", "set only one"]),
    "our weights as backbone weights": (
        lambda p, run: [f"model.backbone.weights={checkpoint(run)}/model.safetensors"], 2,
        ["model.backbone.weights", "whole mtl model", "init_from="]),
    "init_from not an mtl model": (lambda p, run: [f"init_from={p}"], 4, ["init_from", "not an mtl model folder"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG))
def test_bad_warm_start_config_is_one_clear_message(run, tmp_path, capsys, case):
    make, code, needles = BAD_CONFIG[case]
    rc = train_script.main(["--config", TINY, f"output_dir={tmp_path / 'out'}", *make(tmp_path, run)])
    err = capsys.readouterr().err
    assert rc == code and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


# ------------------------------------------------------------------ bad input to the tools


def _not_ours(p):
    os.makedirs(p / "m")
    save_file({"w": torch.zeros(2)}, str(p / "m" / "model.safetensors"))
    (p / "m" / "config.yaml").write_text("seed: 0\n")
    return str(p / "m")


def _truncated(p, run):
    os.makedirs(p / "t")
    data = open(os.path.join(checkpoint(run), "model.safetensors"), "rb").read()
    (p / "t" / "model.safetensors").write_bytes(data[: len(data) // 2])
    return str(p / "t")


def _image(p, name="ok.png"):
    Image.new("RGB", (20, 20), (200, 10, 10)).save(p / name)
    return str(p / name)


def _garbage(p):
    (p / "bad.png").write_bytes(b"not a png")
    return str(p / "bad.png")


def _nonempty(p):
    (p / "full").mkdir()
    (p / "full" / "x").write_text("x")
    return str(p / "full")


TOOL_CASES = {
    "missing model folder": (lambda p, r: (predict_tool, ["--model", str(p / "gone"), _image(p)]), 4,
                             ["gone", "does not exist"]),
    "not an mtl folder": (lambda p, r: (predict_tool, ["--model", str(p), _image(p)]), 4,
                          ["not an mtl model folder"]),
    "not our weights": (lambda p, r: (evaluate_tool, ["--checkpoint", _not_ours(p)]), 4, ["not an mtl model file"]),
    "truncated weights": (lambda p, r: (export_tool, ["--checkpoint", _truncated(p, r), "--out", str(p / "e")]), 4,
                          ["model.safetensors", "truncated"]),
    "missing image": (lambda p, r: (predict_tool, ["--model", r, str(p / "none.png")]), 3,
                      ["none.png", "neither an image file nor a folder"]),
    "no readable image": (lambda p, r: (predict_tool, ["--model", r, _garbage(p)]), 3,
                          ["bad.png", "cannot be decoded", "none of the 1 image(s) could be used"]),
    "folder without images": (lambda p, r: (predict_tool, ["--model", r, _nonempty(p)]), 3, ["no image files"]),
    "model key as evaluate override": (lambda p, r: (evaluate_tool, ["--checkpoint", r, "model.decoder.n_layer=3"]),
                                       2, ["model.decoder.n_layer", "only data.* and seed"]),
    "other image size": (lambda p, r: (evaluate_tool, ["--checkpoint", r, "data.image_size=64"]), 2,
                         ["data.image_size", "trained at 32"]),
    "missing val manifest": (lambda p, r: (evaluate_tool, ["--checkpoint", r, "data.source=manifest",
                                                           f"data.val_path={p / 'gone.jsonl'}"]), 3, ["gone.jsonl"]),
    "export over a folder": (lambda p, r: (export_tool, ["--checkpoint", r, "--out", _nonempty(p)]), 2,
                             ["--out", "not an empty folder"]),
}


@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tool_bad_input_is_one_clear_message(run, tmp_path, capsys, case):
    make, code, needles = TOOL_CASES[case]
    tool, args = make(tmp_path, run)
    assert tool.main(args) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and sum(line.startswith("error") for line in err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert not os.path.exists(tmp_path / "e")


def test_predict_skips_an_unreadable_image_and_counts_it(run, tmp_path, capsys):
    good, bad = _image(tmp_path), _garbage(tmp_path)
    other = _image(tmp_path, "ok2.png")
    out = tmp_path / "preds.jsonl"
    assert predict_tool.main(["--model", run, good, bad, other, "--out", str(out), "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert [r["image"] for r in read_jsonl(out)] == [good, other]  # the job went on past the bad file
    assert "warning: skipped:" in err and "bad.png" in err and "cannot be decoded" in err, err
    assert f"2 prediction(s) written to {out}; 1 image(s) skipped (each named in a warning above)" in err, err
    alone = load_model(run).predict([good, other])
    # the same predictions; the probability up to rounding (the tool's batches of the good images differ from this one)
    got = [{k: v for k, v in r.items() if k != "image"} for r in read_jsonl(out)]
    assert [{**r, "prob": pytest.approx(r["prob"], rel=1e-5)} for r in alone] == got


def test_eval_config_keeps_the_model_and_takes_the_data(run, tmp_path):
    predictor = load_model(run)
    cfg = eval_config(predictor, TINY, ["data.synthetic.val_size=10"])
    assert cfg.model == predictor.cfg.model and cfg.data.synthetic.val_size == 10
    assert len(eval_dataset(cfg, predictor.class_names)) == 10


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_a_normalising_run_is_normalised_at_inference_too(tmp_path):
    """With ``data.normalize`` on (pretrained weights bring their mean/std), the training loaders normalise the
    batches; predict and evaluate must feed the model the same numbers, not the raw [0, 1] images."""
    from mtl.data.images import image_normalization
    from mtl.data.loader import build_datasets, build_eval_loader
    from mtl.inference import eval_dataset

    run_dir = train(tmp_path / "run", "data.normalize=imagenet")
    predictor = load_model(run_dir)
    assert predictor.normalization == image_normalization(predictor.cfg) is not None
    _, val = build_datasets(predictor.cfg)
    loader = build_eval_loader(val, _collate(predictor), 8, 0, 1, 0)
    batch = next(iter(loader))  # what the run's own evaluation fed the model
    model = predictor.model
    with torch.no_grad():
        expected = model.heads["cls"].logits(model.backbone(batch["image"])).float().softmax(-1).max(-1)
    raw = torch.stack([val[i]["image"] for i in range(8)])  # [0, 1], as the data sets give them
    got = predictor.predict(raw)
    assert [p["class_index"] for p in got] == expected.indices.tolist()
    assert [p["prob"] for p in got] == pytest.approx(expected.values.tolist(), rel=1e-5)
    rows = write_images(tmp_path / "imgs", [val[i] for i in range(4)])
    cfg = predictor.cfg.copy()
    cfg.data.source, cfg.data.val_path = "manifest", str(tmp_path / "imgs" / "manifest.jsonl")
    assert eval_dataset(cfg, predictor.class_names).normalization == predictor.normalization
    assert len(rows) == 4


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_a_run_from_pretrained_weights_is_normalised_as_it_trained(tmp_path):
    """data.normalize=auto with backbone weights: the loaders normalised with the weights' statistics, so the loaded
    model must too (the weights are not read again: the name alone decides), and evaluate matches the run."""
    import torchvision

    from mtl.data.images import IMAGENET_MEAN, IMAGENET_STD

    weights = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    run_dir = train(tmp_path / "run", f"model.backbone.weights={weights}")
    weights.unlink()  # never read again: the model's own file holds the backbone
    predictor = load_model(run_dir)
    assert predictor.normalization == (IMAGENET_MEAN, IMAGENET_STD)
    final = json.loads(open(os.path.join(run_dir, "final_metrics.json")).read())
    out = tmp_path / "m.json"
    assert evaluate_tool.main(["--checkpoint", run_dir, "--device", "cpu", f"--out={out}"]) == 0
    got = json.loads(out.read_text())
    for k in METRICS:
        assert got[k] == pytest.approx(final[k], rel=1e-9, abs=1e-12), k
