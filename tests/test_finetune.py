"""Fine-tuning with init_from keeps labels and words straight (issue 32.4).

- a class head's rows follow the class names (``class_names.json``), not the position: carried, new, dropped, said;
  no class in common is refused unless ``init_from_fresh_class_head=true``;
- caption words the model folder's tokenizer lacks grow the vocabulary (the decoder's token embedding and its tied
  LM head; the old rows bit for bit), and every run's data summary gives the share of unknown caption tokens.

One tiny ImageFolder run (configs/tiny.yaml, one step) is the model folder every test starts from.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

from mtl.checkpoint.folder import write_manifest
from mtl.data.tokenizer import CaptionTokenizer, extend_to_texts, train_tokenizer, unknown_share_text
from mtl.errors import CheckpointError, DataError
from mtl.inference import evaluate_model, export_model, load_model
from mtl.parallel.dist import DistInfo
from mtl.run.trainer import Trainer
from mtl.setup.build import ModelFiles, build_run_inputs, match_class_rows
from mtl.setup.checks import load_run_config

from .conftest import ROOT, TINY

_spec = importlib.util.spec_from_file_location("mtl_train_script", os.path.join(ROOT, "train.py"))
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)

OLD_CLASSES = ["circle", "square", "triangle"]
OLD_CAPTIONS = ["one red circle", "two blue squares", "one blue triangle", "two red squares"]
WTE = "heads.gen.decoder.lm.transformer.wte.weight"
HEAD = "heads.cls.fc."


def image_folder(root, classes, captions, per_class=3):
    """``root/<class>/<i>.png`` (random 32 px images) and ``root/captions.jsonl`` cycling through ``captions``."""
    rng = np.random.default_rng(0)
    lines = []
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(os.path.join(root, c, f"{i}.png"))
            lines.append(json.dumps({"image": f"{c}/{i}.png", "caption": captions[len(lines) % len(captions)]}))
    with open(os.path.join(root, "captions.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(root)


def data_args(folder):
    return ["data.source=imagefolder", f"data.train_path={folder}", f"data.val_path={folder}", "data.batch_size=4",
            "data.eval_batch_size=4", "trainer.eval_max_batches=1"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The model folder: a one-step run on 3 classes whose captions never say 'crosses'; its checkpoint."""
    base = tmp_path_factory.mktemp("finetune")
    folder = image_folder(base / "data", OLD_CLASSES, OLD_CAPTIONS)
    out = base / "run"
    rc = train_script.main(["--config", TINY, f"output_dir={out}", "trainer.max_steps=1", "checkpoint.every_steps=0",
                            *data_args(folder)])
    assert rc == 0
    return os.path.join(out, "checkpoints", "step_1")


def warm(tmp_path, source, folder, *extra):
    return Trainer(load_run_config(TINY, [f"output_dir={tmp_path / 'warm'}", f"init_from={source}",
                                          "trainer.max_steps=1", *data_args(folder), *extra]), DistInfo())


def cold_head(folder, source):
    """heads.cls of a run on ``folder`` without init_from: a fresh head (the same seed builds the same weights)."""
    cfg = load_run_config(TINY, [f"tokenizer.path={os.path.join(source, 'tokenizer')}", *data_args(folder)])
    return {k: v for k, v in build_run_inputs(cfg).model.state_dict().items() if k.startswith(HEAD)}


# ------------------------------------------------------------------ class heads follow the class names


@pytest.mark.parametrize("classes, carried, note", [
    # the case: circle/ renamed zcircle/, so the sorted order changes (square 1 -> 0, triangle 2 -> 1)
    (["square", "triangle", "zcircle"], {"square": 1, "triangle": 2},
     "carried 2 (square, triangle; moved square 1->0, triangle 2->1), new 1 (zcircle, initialised as a fresh head), "
     "dropped 1 (circle)"),
    # one class more: the three carried move up by one, diamond is new
    (["circle", "diamond", "square", "triangle"], {"circle": 0, "square": 1, "triangle": 2},
     "carried 3 (circle, square, triangle; moved square 1->2, triangle 2->3), new 1 (diamond"),
])
def test_class_rows_follow_the_class_names(source, tmp_path, capsys, classes, carried, note):
    folder = image_folder(tmp_path / "data", classes, OLD_CAPTIONS)
    saved = load_file(os.path.join(source, "model.safetensors"))
    fresh = cold_head(folder, source)
    trainer = warm(tmp_path, source, folder)
    try:
        out = capsys.readouterr().out
        assert "init_from: heads.cls rows matched by class name (class_names.json): " + note in out, out
        state = trainer.bare.state_dict()
        for i, name in enumerate(classes):
            for part in ("weight", "bias"):
                expected = saved[HEAD + part][carried[name]] if name in carried else fresh[HEAD + part][i]
                assert torch.equal(state[HEAD + part][i], expected), (name, part)
        assert all(torch.equal(v, saved[k]) for k, v in state.items() if not k.startswith(HEAD))
    finally:
        trainer.close()


def test_no_class_in_common_is_refused_unless_a_fresh_head_is_asked_for(source, tmp_path, capsys):
    folder = image_folder(tmp_path / "data", ["apple", "pear", "plum"], OLD_CAPTIONS)
    out = tmp_path / "refused"
    rc = train_script.main(["--config", TINY, f"output_dir={out}", f"init_from={source}", *data_args(folder)])
    err = capsys.readouterr().err
    assert rc == 4 and "Traceback" not in err, err
    assert "none of this run's 3 classes (apple, pear, plum) is among the 3" in err and "circle" in err, err
    assert "init_from_fresh_class_head=true" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out / "checkpoints")
    saved, fresh = load_file(os.path.join(source, "model.safetensors")), cold_head(folder, source)
    trainer = warm(tmp_path, source, folder, "init_from_fresh_class_head=true")
    try:
        assert "init_from: heads.cls: fresh (init_from_fresh_class_head=true)" in capsys.readouterr().out
        for k, v in trainer.bare.state_dict().items():
            assert torch.equal(v, fresh[k] if k.startswith(HEAD) else saved[k]), k
    finally:
        trainer.close()


def test_a_folder_without_class_names_loads_by_position_only_for_the_same_count(source, tmp_path, capsys):
    export = tmp_path / "export"
    export_model(source, str(export))
    os.remove(export / "class_names.json")
    write_manifest(str(export))  # a folder whose manifest does not list one (as an older export)
    saved = load_file(os.path.join(export, "model.safetensors"))
    same = image_folder(tmp_path / "same", ["a", "b", "c"], OLD_CAPTIONS)
    capsys.readouterr()
    trainer = warm(tmp_path, export, same)
    try:
        out = capsys.readouterr().out
        assert "has no class_names.json, so its rows load by position, taken to be this run's 3 classes" in out, out
        assert all(torch.equal(v, saved[k]) for k, v in trainer.bare.state_dict().items())
    finally:
        trainer.close()
    other = image_folder(tmp_path / "other", ["a", "b"], OLD_CAPTIONS)
    rc = train_script.main(["--config", TINY, f"output_dir={tmp_path / 'x'}", f"init_from={export}",
                            *data_args(other)])
    err = capsys.readouterr().err
    assert rc == 4 and "has no class_names.json" in err and "init_from_fresh_class_head=true" in err, err


def manifest(path, folder, label, header=None):
    """A JSONL manifest of ``folder``'s images (``image_folder``), ``label(class)`` each, after ``header`` if given."""
    lines = [header] if header else []
    with open(os.path.join(folder, "captions.jsonl")) as f:
        for line in f:
            obj = json.loads(line)
            lines.append(dict(obj, image=os.path.join(folder, obj["image"]), label=label(obj["image"].split("/")[0])))
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def manifest_args(path, val=None):
    return ["data.source=manifest", f"data.train_path={path}", f"data.val_path={val or path}", "data.batch_size=4",
            "data.eval_batch_size=4", "trainer.eval_max_batches=1"]


def test_a_fine_tune_across_manifests_numbered_differently_matches_by_class_name(source, tmp_path, capsys):
    """The model folder's classes (circle, square, triangle) numbered 0, 1, 2; this run's manifest numbers them
    triangle 0, circle 1, square 2 and names them in a classes line: the rows follow the names, the run's
    class_names.json has them, and a val manifest labelled by name evaluates (issue 41.6)."""
    classes = ["triangle", "circle", "square"]
    folder = image_folder(tmp_path / "data", OLD_CLASSES, OLD_CAPTIONS)
    numbered = manifest(tmp_path / "train.jsonl", folder, classes.index, {"classes": classes})
    named = manifest(tmp_path / "val.jsonl", folder, str)
    saved = load_file(os.path.join(source, "model.safetensors"))
    trainer = Trainer(load_run_config(TINY, [f"output_dir={tmp_path / 'warm'}", f"init_from={source}",
                                             "trainer.max_steps=1", *manifest_args(numbered, named)]), DistInfo())
    try:
        out = capsys.readouterr().out
        assert "carried 3 (triangle, circle, square; moved triangle 2->0, circle 0->1, square 1->2)" in out, out
        state = trainer.bare.state_dict()
        for i, name in enumerate(classes):
            for part in ("weight", "bias"):
                assert torch.equal(state[HEAD + part][i], saved[HEAD + part][OLD_CLASSES.index(name)]), (name, part)
        trainer.train()
    finally:
        trainer.close()
    step = tmp_path / "warm" / "checkpoints" / "step_1"
    assert json.loads((step / "class_names.json").read_text()) == classes
    cfg = load_run_config(os.path.join(step, "config.yaml"), [])
    assert "cls_acc" in evaluate_model(load_model(str(step)), cfg)


def test_a_fine_tune_onto_manifest_classes_of_other_names_is_refused_by_name(source, tmp_path):
    folder = image_folder(tmp_path / "data", OLD_CLASSES, OLD_CAPTIONS)
    fruit = manifest(tmp_path / "train.jsonl", folder, lambda c: {"circle": "apple", "square": "pear"}.get(c, "plum"))
    with pytest.raises(CheckpointError) as e:
        Trainer(load_run_config(TINY, [f"output_dir={tmp_path / 'x'}", f"init_from={source}",
                                       *manifest_args(fruit)]), DistInfo())
    assert "none of this run's 3 classes (apple, pear, plum) is among the 3" in str(e.value), e.value
    assert "circle" in str(e.value) and "init_from_fresh_class_head=true" in str(e.value)


class _ClassHead(torch.nn.Module):
    requires = ("label",)

    def __init__(self, k):
        super().__init__()
        self.fc = torch.nn.Linear(2, k)


def test_integer_labels_on_both_sides_say_the_rows_match_by_index(tmp_path):
    """Neither side names its classes (integer labels: "0", "1", "2"): the rows load by index, and the init_from
    note says so with the way to name them, rather than passing it over as a match by class name."""
    model = torch.nn.Module()
    model.heads = torch.nn.ModuleDict({"cls": _ClassHead(3)})
    names = tmp_path / "class_names.json"
    names.write_text(json.dumps(["0", "1", "2"]))
    files = ModelFiles(folder=str(tmp_path), weights="", config=None, tokenizer=None, class_names=str(names))
    state = {k: v + 1 for k, v in model.state_dict().items()}
    notes = match_class_rows(model, state, files, ["0", "1", "2"], fresh=False)
    assert len(notes) == 1 and notes[0].startswith("heads.cls: both runs' classes are integer labels (0, 1, 2), so "
                                                   "its rows load by index"), notes
    assert '{"classes": [...]}' in notes[0] and "class names as labels" in notes[0], notes
    names.write_text(json.dumps(["a", "b", "c"]))
    assert match_class_rows(model, state, files, ["a", "b", "c"], fresh=False) == []  # named: nothing to say


# ------------------------------------------------------------------ new caption words grow the vocabulary


GROWN = ["two red crosses", "one zigzag", "two blue squares"]  # 'crosses' and 'zigzag' are new words


def test_new_caption_words_grow_the_vocabulary(source, tmp_path, capsys):
    old_tok = CaptionTokenizer.load(os.path.join(source, "tokenizer"))
    assert old_tok.unk_id in old_tok.encode("two red crosses")  # the premise: without growing, [UNK]
    folder = image_folder(tmp_path / "data", OLD_CLASSES, GROWN)
    saved = load_file(os.path.join(source, "model.safetensors"))
    trainer = warm(tmp_path, source, folder)
    try:
        out = capsys.readouterr().out
        tok, lm = trainer.tokenizer, trainer.bare.heads["gen"].decoder.lm
        n = old_tok.vocab_size
        assert tok.vocab_size == n + 2 and tok.unk_id not in tok.encode("two red crosses")
        assert {w: tok.encode(w) for w in ("crosses", "zigzag")} == {"crosses": [n], "zigzag": [n + 1]}
        assert all(tok.vocab()[w] == i for w, i in old_tok.vocab().items())  # every old token keeps its id
        wte = lm.transformer.wte.weight
        assert wte.shape[0] == n + 2 and torch.equal(wte[:n], saved[WTE])  # the old rows, bit for bit
        assert lm.lm_head.weight is wte and lm.config.vocab_size == n + 2  # the output layer grew with it (tied)
        assert all(torch.equal(v, saved[k]) for k, v in trainer.bare.state_dict().items() if "wte" not in k
                   and "lm_head" not in k)
        assert f"init_from: heads.gen.decoder: vocabulary {n} -> {n + 2} tokens, 2 word(s)" in out, out
        assert "(crosses, zigzag)" in out
        assert f"vocabulary {n + 2} tokens, unknown tokens train 0.00% (0 of 24), val 0.00%" in out, out
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_grown_vocabulary_is_saved_and_predicts(source, tmp_path):
    """One step after the warm start: the checkpoint carries the grown tokenizer and embedding; it loads and
    predicts, and decodes the new words."""
    folder = image_folder(tmp_path / "data", OLD_CLASSES, GROWN)
    n = CaptionTokenizer.load(os.path.join(source, "tokenizer")).vocab_size
    trainer = warm(tmp_path, source, folder)
    try:
        trainer.train()
    finally:
        trainer.close()
    step = tmp_path / "warm" / "checkpoints" / "step_1"
    assert CaptionTokenizer.load(str(step / "tokenizer")).encode("crosses") == [n]  # saved with the grown vocabulary
    assert load_file(str(step / "model.safetensors"))[WTE].shape[0] == n + 2
    predictor = load_model(str(step))
    got = predictor.predict([os.path.join(folder, "circle", "0.png")])
    assert len(got) == 1 and isinstance(got[0]["caption"], str) and got[0]["class"] in OLD_CLASSES
    assert predictor.tokenizer.decode([n, n + 1]) == "crosses zigzag"


def test_a_tokenizer_that_cannot_grow_is_refused_with_the_count():
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, "two": 4, "red": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = CaptionTokenizer(tok)
    assert extend_to_texts(wordpiece, ["two red"], "init_from")[1] == []  # nothing unknown: kept as it is
    with pytest.raises(DataError) as e:
        extend_to_texts(wordpiece, ["two red crosses", "red zigzag", "two crosses"], "init_from: the tokenizer X")
    assert "init_from: the tokenizer X: 2 word(s) of the training captions are unknown to its WordPiece" in str(e.value)
    assert "'crosses', 'zigzag'; 3 of 7 tokens" in str(e.value)


def test_the_data_summary_gives_the_share_of_unknown_tokens():
    captions = ["one red circle", "two red circles", "one blue square"]
    small = train_tokenizer(captions, vocab_size=7)  # the 4 special tokens and 3 words: the rest is [UNK]
    assert small.vocab_size == 7
    assert unknown_share_text(small, {"train": captions, "val": ["red red red"]}) == \
        "unknown tokens train 44.44% (4 of 9), val 0.00% (0 of 3)"
