"""``checkpoint.trainable_only``: checkpoints that hold the trained parameters alone (the LoRA adapters and the heads,
``model.peft``), with the frozen base named by its folder and the SHA-256 of its weight files.

A checkpoint's ``model.safetensors`` and its sharded ``state/`` then hold the parameters that train and the buffers;
``trainer_state.pt`` holds ``base``: {config key: {"folder", "sha256"}} for ``model.backbone.pretrained`` and
``model.decoder.pretrained``. A resume, ``predict`` and ``export`` build the model from those folders (the base) and
load the rest on top; a folder whose weights differ from the recorded hash is refused, naming the key and the fix.
"""

from __future__ import annotations

import hashlib
import os

from omegaconf import OmegaConf
from torch import nn

from mtl.errors import ConfigError
from mtl.files import sha256_file

BASE_KEYS = ("model.backbone.pretrained", "model.decoder.pretrained")
WEIGHT_FILES = (".safetensors", ".bin", ".pth", ".pt")


def trainable_only(cfg) -> bool:
    return bool(OmegaConf.select(cfg, "checkpoint.trainable_only", default=False))


def kept_names(model: nn.Module) -> set[str]:
    """The state-dict keys a trainable-only checkpoint keeps: the trainable parameters and every buffer."""
    return ({n for n, p in model.named_parameters() if p.requires_grad}
            | {n for n, _ in model.named_buffers()})


def keep(state: dict, names: set[str] | None) -> dict:
    return dict(state) if names is None else {k: v for k, v in state.items() if k in names}


def digest(path: str) -> str:
    """SHA-256 of a weight file, or of a folder's weight files (their names and hashes, in order)."""
    if os.path.isfile(path):
        return sha256_file(path)
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith(WEIGHT_FILES) and os.path.isfile(os.path.join(path, name)):
            h.update(f"{name}:{sha256_file(os.path.join(path, name))}\n".encode())
    return h.hexdigest()


def base_record(cfg) -> dict:
    """{config key: {"folder": its absolute path, "sha256": ``digest``}} for the run's pretrained folders."""
    out = {}
    for key in BASE_KEYS:
        folder = OmegaConf.select(cfg, key, default=None)
        if folder and os.path.exists(str(folder)):
            out[key] = {"folder": os.path.abspath(str(folder)), "sha256": digest(str(folder))}
    return out


def base_problems(record: dict | None, cfg, what: str) -> list[str]:
    """Why ``cfg``'s pretrained folders are not the base ``record`` (a trainable-only checkpoint's) names."""
    if not record:
        return []
    problems = []
    for key, saved in record.items():
        folder = OmegaConf.select(cfg, key, default=None)
        now = digest(str(folder)) if folder and os.path.exists(str(folder)) else None
        if now != saved["sha256"]:
            found = f"{folder!r} has sha256 {now[:12]}" if now else f"{folder!r} does not exist"
            problems.append(f"{key}: {what} holds only the trained parameters (checkpoint.trainable_only) of the base "
                            f"{saved['folder']!r} (sha256 {saved['sha256'][:12]}), and {found}; point {key} at that "
                            "base folder, or resume from a full checkpoint (checkpoint.trainable_only=false)")
    return problems


def refuse_other_base(record: dict | None, cfg, what: str) -> None:
    problems = base_problems(record, cfg, what)
    if problems:
        raise ConfigError(problems)
