"""A trained model exported: ``export_model`` writes a self-contained folder (the model's files, its plug-in code,
the parts in other libraries' layouts from ``mtl.inference.interop``, a manifest), whole or not at all."""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import sys

from safetensors import SafetensorError

from mtl.checkpoint.folder import describe_os_error, write_manifest
from mtl.errors import CheckpointError, ConfigError
from mtl.files import free_bytes
from mtl.inference.interop import interop_bytes, write_interop
from mtl.inference.model import Predictor, load_model
from mtl.models import peft_adapters
from mtl.models.backbones.hf_vision import carried_files
from mtl.registry import PLUGIN_KEYS, copy_names
from mtl.run.runlock import alive  # the run lock's own test of a PID
from mtl.setup.build import CLASS_NAMES_FILE, MODEL_FILE


def export_model(path: str, out: str, trust_plugins: bool = False) -> str:
    """Write a self-contained folder ``out``: model.safetensors, config.yaml, tokenizer/, class_names.json, the
    plug-in files (``<key>/<file>``: task_modules/, backbone_modules/, weighting_modules/), and the parts in other
    libraries' layouts (``mtl.inference.interop``: hf_decoder/ for transformers, torchvision_backbone/, README.md), with
    manifest.json last.

    The model is loaded first (so a broken checkpoint is refused, not copied; its plug-in code, and so the copy of
    it, only with ``trust_plugins`` or where it is your own run's code: ``load_model``). Before anything is written, the free
    space is checked against the export's size (``export_bytes``): too little is one ConfigError (exit 2) naming the
    folder, the bytes needed and free. The folder appears whole or not at all: it is written next to ``out`` as
    ``<out>.<pid>.tmp`` and renamed; a write that fails anyway (the disk filled up meanwhile) is one CheckpointError
    (exit 4, as a checkpoint that cannot be saved) and leaves nothing behind. A ``<out>.<pid>.tmp`` left by an export
    that was killed (its process gone) is removed by the next export to ``out``."""
    out = os.fspath(out).rstrip(os.sep) or os.sep
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out: {out!r} already exists and is not an empty folder; choose a new folder")
    predictor = load_model(path, "cpu", trust_plugins)
    parent = os.path.dirname(os.path.abspath(out))
    _remove_stale_exports(out)
    needed, free = export_bytes(predictor), free_bytes(parent)
    if free is not None and free < needed:
        raise ConfigError(f"--out: the disk of {out!r} has {free:,} bytes free, and the export needs about "
                          f"{needed:,}; free space or choose --out on another disk (nothing was written)")
    made = []  # the folders above out that the export makes: removed again if it fails
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    tmp = f"{out}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        shutil.copyfile(predictor.files.weights, os.path.join(tmp, MODEL_FILE))
        shutil.copyfile(predictor.files.config, os.path.join(tmp, "config.yaml"))
        predictor.tokenizer.save(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, CLASS_NAMES_FILE), "w", encoding="utf-8") as f:
            json.dump(predictor.class_names, f, indent=1)
        for key in PLUGIN_KEYS:  # the plug-in files the model was loaded with, under the names it loads them by
            original = [str(m) for m in (predictor.saved_config or {}).get(key) or []]
            for spec, name in copy_names(key, original).items():
                os.makedirs(os.path.join(tmp, key), exist_ok=True)
                shutil.copyfile(str(predictor.cfg[key][original.index(spec)]), os.path.join(tmp, *name.split("/")))
        for name, data in carried_files(predictor.cfg).items():  # hf_vision: backbone/config.json and processor
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        # the decoder for transformers, the backbone for torchvision (interop.py); model.peft: the adapters merged
        write_interop(tmp, predictor, merged_for_task(predictor))
        if peft_adapters.has_adapters(predictor.model):  # and the adapters apart, for PeftModel.from_pretrained
            peft_adapters.write_encoder_adapters(tmp, predictor.model)
        write_manifest(tmp)  # last: the size and SHA-256 of every file, checked wherever the folder is loaded
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:  # safetensors' writer (transformers' save_pretrained) raises its own
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        room = f"{needed:,} bytes to write, {'an unknown number' if free is None else f'{free:,}'} free before it began"
        raise CheckpointError(f"cannot write the export {out!r}: {_write_failure(e, tmp)} ({room}); nothing was left "
                              "behind. Free space or choose another --out, then export again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


EXPORT_MARGIN = 1.05, 1 << 20  # x1.05 + 1 MiB over the known sizes: headers, JSON files, the exported program's graph


def merged_for_task(predictor: Predictor):
    """``model.peft``: task -> a copy of ``predictor`` whose model has the adapters merged into its base weights
    (with per-task adapters, that task's and the shared one), for the plain transformers/torch folders; else None."""
    if not peft_adapters.has_adapters(predictor.model):
        return None
    cache: dict = {}

    def pick(task: str) -> Predictor:
        key = task if predictor.model.adapters is not None else None
        if key not in cache:
            cache[key] = copy.copy(predictor)
            cache[key].model = peft_adapters.merged_copy(predictor.model, key).eval()
        return cache[key]

    return pick


def export_bytes(predictor: Predictor) -> int:
    """About the bytes ``export_model`` writes, from the sizes known before writing (the files it copies, the tensors
    of the parts ``mtl.inference.interop`` writes), with ``EXPORT_MARGIN``."""
    copied = [predictor.files.weights, predictor.files.config]
    if predictor.files.tokenizer:
        copied += [os.path.join(predictor.files.tokenizer, n) for n in os.listdir(predictor.files.tokenizer)]
    copied += [str(s) for key in PLUGIN_KEYS for s in predictor.cfg.get(key) or () if os.path.isfile(str(s))]
    known = sum(os.path.getsize(f) for f in copied if os.path.isfile(f)) + interop_bytes(predictor)
    scale, extra = EXPORT_MARGIN
    return int(known * scale) + extra


def _write_failure(error: Exception, tmp: str) -> str:
    """Which file of the export could not be written, and why, in the words of a checkpoint save."""
    if isinstance(error, OSError):
        where = f"{os.path.relpath(error.filename, tmp)}: " if error.filename and str(error.filename).startswith(tmp) else ""
        return where + describe_os_error(error)
    text = str(error)  # safetensors: "Error while serializing: I/O error: No space left on device (os error 28)"
    return "no space left on device" if f"os error {errno.ENOSPC})" in text else f"{type(error).__name__}: {text}"


def _remove_stale_exports(out: str) -> None:
    """The half-written folders ``<out>.<pid>.tmp`` of earlier exports to ``out`` whose process is gone (killed before
    it could clean up): removed, each with a note."""
    parent, base = os.path.split(os.path.abspath(out))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(base) + 1:-len(".tmp")] if name.startswith(base + ".") and name.endswith(".tmp") else ""
        path = os.path.join(parent, name)
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)) and os.path.isdir(path) \
                and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            print(f"note: removed {path!r}, the half-written folder of an earlier export to {out!r} that stopped "
                  f"before it finished (its process {pid} is gone)", file=sys.stderr, flush=True)
