"""scripts/make_tiny_pretrained.py for the tests (it is a script, not a package module), and the overrides that point a
config's ``runs/pretrained/...`` folders at tiny ones written into a temporary folder (a fresh clone has none)."""

from __future__ import annotations

import importlib.util
import os

from .conftest import ROOT

PRETRAINED = "runs/pretrained/"  # where configs/vit_gpt2.yaml reads the folders the script writes
KEYS = ("model.backbone.pretrained", "model.backbone.config", "model.decoder.pretrained", "tokenizer.path")


def tiny_pretrained():
    """The module scripts/make_tiny_pretrained.py (write_vit, write_dinov2, write_gpt2, ...)."""
    spec = importlib.util.spec_from_file_location("make_tiny_pretrained",
                                                  os.path.join(ROOT, "scripts", "make_tiny_pretrained.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_pretrained(cfg, out) -> list[str]:
    """Overrides for every key of ``cfg`` under runs/pretrained/: the same folder, written into ``out``."""
    from omegaconf import OmegaConf

    script, overrides, written = tiny_pretrained(), [], {}
    for key in KEYS:
        value = OmegaConf.select(cfg, key)
        if not (isinstance(value, str) and value.startswith(PRETRAINED)):
            continue
        name = value[len(PRETRAINED):].strip("/")
        if name not in written:
            written[name] = getattr(script, f"write_{name.replace('-', '_')}")(os.path.join(str(out), name))
        overrides.append(f"{key}={written[name]}")
    return overrides
