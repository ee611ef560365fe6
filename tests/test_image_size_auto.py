"""``data.image_size: auto``: the size a transformers model folder's image processor feeds the model (hf_vision),
resolved when the config is loaded; refused by name where the run has no such folder."""

from __future__ import annotations

import pytest

from mtl.errors import ConfigError
from mtl.setup.checks import load_run_config

from .conftest import TINY
from .pretrained_folders import tiny_pretrained

HF = ["model.backbone.name=hf_vision", "data.image_size=auto"]


@pytest.mark.parametrize("size", [32, 48])
def test_auto_takes_the_folders_processor_size(tmp_path, size):
    vit = tiny_pretrained().write_vit(str(tmp_path / "vit"), size)
    cfg = load_run_config(TINY, [*HF, f"model.backbone.pretrained={vit}"], announce=False)
    assert cfg.data.image_size == size and isinstance(cfg.data.image_size, int)
    cfg = load_run_config(TINY, [*HF, f"model.backbone.pretrained={vit}", "data.image_size=16"], announce=False)
    assert cfg.data.image_size == 16  # a number the user sets is kept (the model interpolates)


def test_auto_without_a_model_folder_and_a_size_that_is_not_one_are_refused_by_name():
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, ["data.image_size=auto"], announce=False)  # the tiny ResNet: no processor folder
    assert [m for m in e.value.errors if m.startswith("data.image_size: auto takes the model folder's image size")]
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, ["data.image_size=big"], announce=False)
    assert "data.image_size: 'big' is neither a size in pixels nor auto" in e.value.errors
