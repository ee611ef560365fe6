"""A trained model's files, for ``init_from`` (a warm start) and the tools that load a model (``mtl.inference``):
where a checkpoint's or an export's pieces are (``find_model_files``), trusted only once its manifest checks out
(``verify_model_files``), and its weights loaded into a new run's model (``init_from_weights``: class rows matched by
name, a grown caption vocabulary, a head of another size started fresh)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from mtl.architectures import adopt_plain_weights
from mtl.checkpoint import folder as ckpt
from mtl.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from mtl.data.tokenizer import CaptionTokenizer
from mtl.errors import CheckpointError, ConfigError
from mtl.models import vision_encoder_decoder as ved
from mtl.models.decoder import CaptionDecoder
from mtl.registry import PLUGIN_KEYS

MODEL_FILE = "model.safetensors"
CLASS_NAMES_FILE = "class_names.json"


@dataclass
class ModelFiles:
    """Where a trained model's pieces are. ``tokenizer`` and ``class_names`` are the folder's own copies
    when it has them, else the run folder's (a checkpoint ``output_dir/checkpoints/step_N`` falls back
    to ``output_dir``); None when neither exists."""

    folder: str  # the checkpoint or export folder
    weights: str  # its model.safetensors
    config: str | None  # its config.yaml
    tokenizer: str | None  # a folder holding tokenizer.json
    class_names: str | None  # a class_names.json


BEST = "@best"  # after a run's output_dir: its best checkpoint, output_dir/checkpoints/best (checkpoint.best_metric)


def find_model_files(path: str, key: str) -> ModelFiles:
    """A checkpoint folder, an export folder, a run's output_dir (its newest checkpoint), a run's output_dir with
    ``@best`` (its best checkpoint, ``checkpoints/best``: ``checkpoint.best_metric``) or a model.safetensors.

    ``key`` names the setting in messages (e.g. ``init_from``, ``--model``). Raises CheckpointError.
    """
    what = "a checkpoint folder, an export folder, a run's output_dir (or output_dir@best) or a model.safetensors file"
    if path.endswith(BEST) and not os.path.exists(path):
        run, best = path[:-len(BEST)], os.path.join(ckpt.checkpoint_root(path[:-len(BEST)]), ckpt.BEST_DIR)
        if not os.path.isdir(best):
            raise CheckpointError(f"{key}: {path!r}: {run!r} holds no best checkpoint ({best}: a run keeps one with "
                                  f"checkpoint.best_metric set). Pass {what}")
        path = best
    if os.path.isfile(path):
        folder, weights = os.path.dirname(os.path.abspath(path)), path
    elif os.path.isdir(path):
        folder = path
        if not os.path.isfile(os.path.join(path, MODEL_FILE)):
            folder = ckpt.latest_checkpoint(path)  # a run's output_dir
            if folder is None:
                raise CheckpointError(f"{key}: {path!r} holds no {MODEL_FILE} and no complete checkpoints/step_<N>/: "
                                      f"it is not an mtl model folder. Pass {what}")
        weights = os.path.join(folder, MODEL_FILE)
    else:
        raise CheckpointError(f"{key}: {path!r} does not exist. Pass {what}")
    parent = os.path.dirname(os.path.abspath(folder))
    places = [folder] + ([os.path.dirname(parent)] if os.path.basename(parent) == "checkpoints" else [])
    tokenizers = [os.path.join(p, "tokenizer") for p in places]
    names = [os.path.join(p, CLASS_NAMES_FILE) for p in places]
    config = os.path.join(folder, "config.yaml")
    return ModelFiles(
        folder=folder, weights=weights, config=config if os.path.isfile(config) else None,
        tokenizer=next((t for t in tokenizers if os.path.isfile(os.path.join(t, TOKENIZER_FILE))), None),
        class_names=next((n for n in names if os.path.isfile(n)), None),
    )


def verify_model_files(files: ModelFiles, key: str) -> set[str]:
    """Trust a model folder only once its manifest checks out, as a resume does: a checkpoint through
    ``mtl.checkpoint.folder.verify_checkpoint`` (every file's size and SHA-256), an export folder through its own manifest
    (``verify_manifest``, the same check), and every file of the folder that is read (the weights, config.yaml, the
    class names, the tokenizer) must be listed in it. Returns the names the manifest lists (checked), against which
    ``mtl.registry.use_folder_copies`` admits plug-in copies. Raises CheckpointError naming ``key``, the file and the
    fix."""
    folder = files.folder
    fix = ("It changed after it was written (corrupt, or edited by hand): use another checkpoint, or export again "
           "from the run's checkpoint")
    is_checkpoint = os.path.isfile(os.path.join(folder, "trainer_state.pt"))
    if not os.path.isfile(os.path.join(folder, ckpt.MANIFEST)):
        what = "checkpoint" if is_checkpoint else "export folder"
        raise CheckpointError(f"{key}: {what} {folder!r} has no {ckpt.MANIFEST}, so its files cannot be checked "
                              "(written by an mtl without checksums, or assembled by hand); load the weights only "
                              "from a checkpoint written by train.py or a folder written by mtl.tools.export")
    try:
        ckpt.verify_checkpoint(folder) if is_checkpoint else ckpt.verify_manifest(folder)
        with open(os.path.join(folder, ckpt.MANIFEST), encoding="utf-8") as f:
            listed = set(json.load(f)["files"])
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e.message}. {fix}") from None
    code = [os.path.join(folder, key, n) for key in PLUGIN_KEYS if os.path.isdir(os.path.join(folder, key))
            for n in sorted(os.listdir(os.path.join(folder, key)))]  # plug-in copies: imported on load
    used = [files.weights, files.config, files.class_names, *code, *(
        [os.path.join(files.tokenizer, n) for n in sorted(os.listdir(files.tokenizer))] if files.tokenizer else [])]
    for path in used:
        if path is None:
            continue
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder)).replace(os.sep, "/")
        if not rel.startswith("../") and os.path.isfile(path) and rel not in listed:
            raise CheckpointError(f"{key}: {rel} in {folder!r} is not in its {ckpt.MANIFEST} (added after it was "
                                  f"written). {fix}")
    return listed


def find_verified_model_files(path: str, key: str) -> ModelFiles:
    """``find_model_files`` whose folder has passed ``verify_model_files``: what every load path uses (the tools
    and ``init_from``)."""
    files = find_model_files(path, key)
    verify_model_files(files, key)
    return files


def read_model_weights(weights: str, key: str) -> dict:
    """The state dict in an mtl ``model.safetensors`` (a checkpoint's, or an export's copy of it)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(weights, "pt") as f:
            meta = f.metadata() or {}
        state = load_file(weights)
    except Exception as e:
        raise CheckpointError(f"{key}: {weights!r} cannot be read as safetensors ({type(e).__name__}); it is "
                              "truncated or not a model file") from None
    if not str(meta.get("format", "")).startswith("mtl-checkpoint-"):  # any version: the keys are checked on load
        raise CheckpointError(f"{key}: {weights!r} is not an mtl model file (no {ckpt.FORMAT!r} tag): pass a file "
                              "written by train.py or mtl.tools.export. For torchvision backbone weights use "
                              "model.backbone.weights")
    return state


def load_model_weights(model: torch.nn.Module, state: dict, key: str, fix: str) -> None:
    """Load ``state`` into ``model`` exactly; anything missing, unexpected or of another shape is named."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {label} (e.g. {', '.join(v[:3])})"
                 for label, v in (("of another shape", shapes), ("missing", missing), ("unexpected", unexpected)) if v]
        raise CheckpointError(f"{key}: the weights do not fit this model: {'; '.join(parts)}. {fix}")
    model.load_state_dict(state)


INIT_FROM_FIX = ("A warm start needs the model of the run that wrote the weights: set model.*, tasks, "
                 "data.image_size and the tokenizer as in that run's config.yaml (a class head's rows follow the "
                 "class names, the caption vocabulary grows with new words, another task head of another size is "
                 "re-initialised; the rest must fit)")
FRESH_CLASS_HEAD = "init_from_fresh_class_head"  # the config key that starts the class heads fresh


def init_from_tokenizer(source: str) -> str:
    """The tokenizer folder that goes with the ``init_from`` weights (a VisionEncoderDecoderModel folder's own)."""
    if ved.is_captioner_source(source):
        return ved.tokenizer_dir(source)
    found = find_verified_model_files(source, "init_from").tokenizer
    if found is None:
        raise CheckpointError(f"init_from: no tokenizer found with {source!r} (a tokenizer/ folder in it or in its "
                              "run folder); set tokenizer.path to the tokenizer those weights were trained with")
    return found


def init_from_weights(model: torch.nn.Module, source: str, class_names: list | None = None,
                      tokenizer: CaptionTokenizer | None = None, fresh_class_head: bool | None = None) -> str:
    """Warm start: load the weights of ``source`` into ``model`` (nothing else); return what was read, in words
    (one line, then a line per note).

    ``class_names``, ``tokenizer`` and ``fresh_class_head`` (``init_from_fresh_class_head``) default to what the
    model was built for (``build_model``). Fine-tuning onto other data:
    - the heads of the tasks that read labels follow the class names (``match_class_rows``): the rows of the classes
      both runs have carry over to this run's order, a new class keeps its fresh rows, a missing one is dropped;
      no class in common is refused unless those heads start fresh;
    - a caption decoder whose vocabulary this run's tokenizer extended (``resolve_tokenizer``) loads its old rows
      and grows as transformers' ``resize_token_embeddings`` does (``shrink_grown_decoders``);
    - another task head whose tensors all exist in the file but some with another shape keeps its fresh
      initialisation, and is named;
    everything else loads strictly (a missing, unexpected or misshapen backbone key is refused, naming it)."""
    info = getattr(model, "build_info", None)
    class_names = class_names if class_names is not None else (info.class_names if info else None)
    tokenizer = tokenizer if tokenizer is not None else (info.tokenizer if info else None)
    if fresh_class_head is None:
        fresh_class_head = bool(info.cfg.get(FRESH_CLASS_HEAD)) if info else False
    if ved.is_captioner_source(source):  # transformers' captioner layout (mtl/models/vision_encoder_decoder.py)
        files, state, notes = init_from_captioner(model, source, tokenizer)
        weights = files.folder
    else:
        files = find_verified_model_files(source, "init_from")
        weights = files.weights
        state = read_model_weights(weights, "init_from")
        notes = match_class_rows(model, state, files, class_names, fresh_class_head)
    notes += adopt_plain_weights(model, state)  # an hps (or captioner) file into a model with an architecture
    grown = shrink_grown_decoders(model, state, files, tokenizer)
    own = model.state_dict()
    fresh: dict[str, list[str]] = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "heads" and k in own and own[k].shape != v.shape:
            fresh.setdefault(parts[1], []).append(f"{k} {tuple(v.shape)} in the file, {tuple(own[k].shape)} here")
    kept = []  # the same head with other sizes: it keeps its fresh weights
    for task in fresh:
        head = {k for k in own if k.startswith(f"heads.{task}.")}
        if head == {k for k in state if k.startswith(f"heads.{task}.")}:
            state.update({k: own[k] for k in head})
            kept.append(task)
    load_model_weights(model, state, f"init_from {weights!r}", INIT_FROM_FIX)
    for name, decoder, size, added in grown:
        old = decoder.vocab_size
        decoder.resize_vocab(size)
        notes.append(f"{name}: vocabulary {old} -> {size} tokens, {len(added)} word(s) of the training captions added "
                     f"to the tokenizer ({shown(added)}); the old rows kept, the new ones as transformers' "
                     "resize_token_embeddings makes them")
    if kept:
        notes.append("re-initialised for their new shapes: " + "; ".join(
            f"heads.{t} ({', '.join(fresh[t][:2])})" for t in kept) + "; every other weight loaded")
    return weights + "".join(f"\ninit_from: {n}" for n in notes)


def init_from_captioner(model: torch.nn.Module, folder: str,
                        tokenizer: CaptionTokenizer | None) -> tuple[ModelFiles, dict, list[str]]:
    """``init_from`` of a ``VisionEncoderDecoderModel`` folder: (its files, the state dict under mtl's names, the
    notes). The folder is checked against the run's config and the built model first (ConfigError naming each key
    to set); the encoder becomes the backbone, the decoder the caption head's, and the other heads start fresh."""
    info = getattr(model, "build_info", None)
    if info is None:
        raise ValueError("init_from_captioner: the model must come from build_model (its config is needed)")
    old = CaptionTokenizer.load(folder) if os.path.isfile(os.path.join(folder, TOKENIZER_FILE)) else None
    errors = ved.check_model(info.cfg, model, folder, ved.read_config(folder), tokenizer, old)
    if errors:
        raise ConfigError(errors)
    state, notes = ved.ved_state(model, ved.load_folder(folder))
    files = ModelFiles(folder=folder, weights=folder, config=None, tokenizer=folder, class_names=None)
    return files, state, notes


def shown(names: list, limit: int = 8) -> str:
    """Names for a message: the first ``limit``, and how many there are in all when more."""
    return ", ".join(map(str, names[:limit])) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def read_class_names(path: str) -> list[str]:
    """A model folder's ``class_names.json``: a JSON list of strings."""
    try:
        with open(path, encoding="utf-8") as f:
            names = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"init_from: {path!r} cannot be read as JSON ({e}); export the model again") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"init_from: {path!r} is not a JSON list of class names; export the model again")
    return names


def match_class_rows(model: torch.nn.Module, state: dict, files: ModelFiles, class_names: list | None,
                     fresh: bool) -> list[str]:
    """The heads of the tasks that read labels (``requires`` has ``label``), in ``state`` (in place): their per-class
    tensors (first dimension the file's class count there, this run's here) get the rows of the classes both runs
    have, in this run's order, and a new class keeps the model's own fresh rows. ``fresh``: those heads keep their
    fresh initialisation. Returns the notes. Refused (CheckpointError): no class in common; a folder without
    class_names.json whose head has another size."""
    own = model.state_dict()
    heads = [t for t, h in model.heads.items() if "label" in getattr(h, "requires", ())]
    if not heads:
        return []
    fix = f"Set {FRESH_CLASS_HEAD}=true to start " + "/".join(f"heads.{t}" for t in heads) + " fresh (every other " \
          "weight loads)"
    if fresh:
        for t in heads:
            for k in [k for k in state if k.startswith(f"heads.{t}.")]:
                del state[k]
            state.update({k: v for k, v in own.items() if k.startswith(f"heads.{t}.")})
        return [", ".join(f"heads.{t}" for t in heads) + f": fresh ({FRESH_CLASS_HEAD}=true)"]
    if class_names is None:
        raise ValueError("init_from_weights: the run's class names are needed for its class heads")
    new = list(class_names)
    old = read_class_names(files.class_names) if files.class_names else None
    notes = []
    for t in heads:
        keys = [k for k in own if k.startswith(f"heads.{t}.")]
        if not all(k in state for k in keys):
            continue  # a head the file lacks: the strict load names it
        if old is None:
            if all(state[k].shape == own[k].shape for k in keys):
                notes.append(f"heads.{t}: {files.folder!r} has no {CLASS_NAMES_FILE}, so its rows load by position, "
                             f"taken to be this run's {len(new)} classes in this order ({shown(new)})")
                continue
            raise CheckpointError(f"init_from: {files.folder!r} has no {CLASS_NAMES_FILE} and its heads.{t} is of "
                                  f"another size than this run's {len(new)} classes, so its rows cannot be matched "
                                  f"to them. {fix}")
        if numbered(old) and numbered(new):
            notes.append(f"heads.{t}: both runs' classes are integer labels ({shown(old)}"
                         f"{'' if old == new else '; this run: ' + shown(new)}), so its rows load by index: if the two "
                         "data sets number their classes differently, name them (class names as labels, or a first "
                         'manifest line {"classes": [...]}) and the rows follow the names')
        if old == new:
            continue
        rows = [k for k in keys if k in state and state[k].ndim >= 1 and state[k].ndim == own[k].ndim
                and state[k].shape[0] == len(old) and own[k].shape[0] == len(new)
                and state[k].shape[1:] == own[k].shape[1:]]
        if not rows:
            continue
        where = {n: i for i, n in enumerate(old)}
        carried = [n for n in new if n in where]
        if not carried:
            raise CheckpointError(f"init_from: none of this run's {len(new)} classes ({shown(new)}) is among the "
                                  f"{len(old)} of {files.class_names!r} ({shown(old)}), so heads.{t}'s rows cannot "
                                  f"carry over. {fix}, or train on data with that model's classes")
        for k in rows:
            merged = own[k].detach().clone()
            for i, n in enumerate(new):
                if n in where:
                    merged[i] = state[k][where[n]]
            state[k] = merged
        added, dropped = [n for n in new if n not in where], [n for n in old if n not in set(new)]
        moved = [f"{n} {where[n]}->{i}" for i, n in enumerate(new) if n in where and where[n] != i]
        notes.append(f"heads.{t} rows matched by class name ({CLASS_NAMES_FILE}): carried {len(carried)} "
                     f"({shown(carried)}{'; moved ' + shown(moved) if moved else ''}), new {len(added)}"
                     f"{' (' + shown(added) + ', initialised as a fresh head)' if added else ''}, dropped "
                     f"{len(dropped)}{' (' + shown(dropped) + ')' if dropped else ''}")
    return notes


def numbered(names: list[str]) -> bool:
    """Whether ``names`` are the classes of integer labels, which name nothing: "0", "1", ..."""
    return names == [str(i) for i in range(len(names))]


def shrink_grown_decoders(model: torch.nn.Module, state: dict, files: ModelFiles,
                          tokenizer: CaptionTokenizer | None) -> list[tuple[str, CaptionDecoder, int, list[str]]]:
    """Each caption decoder whose vocabulary this run's ``tokenizer`` extended from the model folder's (every old
    token keeps its id; ``resolve_tokenizer``) is shrunk back to the file's rows, so the file loads; returns
    (its name, it, its size, the words added) for ``init_from_weights`` to grow it again after the load."""
    decoders = [(n, m) for n, m in model.named_modules() if isinstance(m, CaptionDecoder)]
    if not decoders or tokenizer is None or files.tokenizer is None:
        return []
    old_vocab, new_vocab = CaptionTokenizer.load(files.tokenizer).vocab(), tokenizer.vocab()
    if len(new_vocab) <= len(old_vocab) or any(new_vocab.get(w) != i for w, i in old_vocab.items()):
        return []  # not an extension of the folder's tokenizer
    added = [w for w, _ in sorted(new_vocab.items(), key=lambda kv: kv[1]) if w not in old_vocab]
    out = []
    for name, decoder in decoders:
        rows = state.get(f"{name}.lm.transformer.wte.weight")
        if rows is not None and rows.shape[0] == len(old_vocab) and decoder.vocab_size == len(new_vocab):
            out.append((name, decoder, decoder.vocab_size, added))
            decoder.resize_vocab(len(old_vocab))
    return out
