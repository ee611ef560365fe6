"""The pretrained model sees what it was trained on (mtl/data/model_transforms.py): file images go through the model's
own transform from its library (transformers' AutoImageProcessor, timm's create_transform), so mtl's pixels and
features equal the library's own pipeline on non-square images of several sizes, for ViT, DINOv2 (with registers too),
CLIP, SigLIP and timm; the loaders normalise with the library's statistics (timm's too), and augmentation sits on top.
Tiny random folders written into tmp, with processors set as the real models' are (resampling, resize then crop)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from mtl.data.images import (
    Augment,
    image_normalization,
    load_image,
    model_transform,
    normalization_text,
    normalize_images,
    prepare_images,
)
from mtl.data.manifest import ManifestDataset
from mtl.errors import ConfigError

SIZES = [(64, 48), (300, 200), (224, 224), (37, 91)]  # (width, height)
S = 32  # every tiny model's own input size
MEAN, STD = [0.48, 0.45, 0.40], [0.27, 0.26, 0.28]
HF_KINDS = ["vit", "dinov2", "dinov2_registers", "clip", "siglip"]
TIMM_KINDS = {"vit_tiny_patch16_224": {"img_size": S, "patch_size": 8, "depth": 2}, "resnet18": {}}


def _hf_folder(kind: str, out: str) -> str:
    """A tiny model of ``kind`` with the image processor its real checkpoints have (their resize, crop, resampling):
    ViT and SigLIP stretch to H x W (bilinear, bicubic), DINOv2 resizes the short side to 256/224 of the crop, bicubic,
    CLIP the short side to the crop, bicubic. CLIP and SigLIP: full folders (text tower too)."""
    import transformers as tf

    torch.manual_seed(0)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=S,
                 patch_size=8)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    crop = {"height": S, "width": S}
    stats = dict(image_mean=MEAN, image_std=STD)
    model, processor = {
        "vit": lambda: (tf.ViTModel(tf.ViTConfig(**small)), tf.ViTImageProcessor(size=crop, **stats)),
        "dinov2": lambda: (tf.Dinov2Model(tf.Dinov2Config(**small)), tf.BitImageProcessor(
            size={"shortest_edge": S * 256 // 224}, crop_size=crop, resample=3, **stats)),
        "dinov2_registers": lambda: (tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(
            **small, num_register_tokens=4)), tf.BitImageProcessor(size={"shortest_edge": S * 256 // 224},
                                                                   crop_size=crop, resample=3, **stats)),
        "clip": lambda: (tf.CLIPModel(tf.CLIPConfig(vision_config=small, text_config=text)), tf.CLIPImageProcessor(
            size={"shortest_edge": S}, crop_size=crop, resample=3, **stats)),
        "siglip": lambda: (tf.SiglipModel(tf.SiglipConfig(vision_config=small, text_config=text)),
                           tf.SiglipImageProcessor(size=crop, resample=3, **stats)),
    }[kind]()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Image files of several non-square sizes (random colours, so every resampling difference shows)."""
    out = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for w, h in SIZES:
        path = out / f"{w}x{h}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def _cfg(name: str, **backbone):
    return OmegaConf.create({"model": {"backbone": {"name": name, "pretrained": None, "config": None, "weights": None,
                                                    **backbone}},
                             "data": {"image_size": S, "normalize": "auto"}})


def _mtl_pixels(cfg, paths) -> torch.Tensor:
    """The images as mtl's data sets give them to the model: a manifest set prepared for the run, normalised by
    the loaders' function."""
    manifest = paths[0].rsplit("/", 1)[0] + "/manifest.jsonl"
    with open(manifest, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"image": p, "label": 0, "captions": ["a"]}) + "\n" for p in paths)
    ds = ManifestDataset(manifest, None, S, 1)
    prepare_images(cfg, ds)
    return normalize_images(torch.stack([ds[i]["image"] for i in range(len(ds))]), ds.normalization)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_pixels_and_features_equal_the_processors_and_models_own(tmp_path, images, kind):
    from transformers import AutoImageProcessor, AutoModel

    from mtl.models.backbones.hf_vision import HFVisionBackbone

    folder = _hf_folder(kind, str(tmp_path / kind))
    cfg = _cfg("hf_vision", pretrained=folder)
    ours = _mtl_pixels(cfg, images)
    pil = [Image.open(p).convert("RGB") for p in images]
    theirs = AutoImageProcessor.from_pretrained(folder)(images=pil, return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape == (len(SIZES), 3, S, S)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    backbone = HFVisionBackbone.build(cfg).eval()
    reference = AutoModel.from_pretrained(folder).eval()
    if kind in ("clip", "siglip"):
        reference = reference.vision_model
    with torch.no_grad():
        got, want = backbone(ours), reference(pixel_values=theirs).last_hidden_state
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert f"image files through AutoImageProcessor of {folder}" in normalization_text(cfg)


@pytest.mark.parametrize("name", list(TIMM_KINDS))
def test_timm_pixels_and_features_equal_timms_own_create_transform(tmp_path, images, name):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    from mtl.models.backbones.timm_models import TimmBackbone

    torch.manual_seed(0)
    ref = timm.create_model(name, pretrained=False, num_classes=0, **TIMM_KINDS[name]).eval()
    weights = str(tmp_path / "w.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, weights)
    cfg = _cfg("timm", pretrained=weights, norm="batch", options={"model": name, **TIMM_KINDS[name]})
    data = timm.data.resolve_data_config({"input_size": (3, S, S)}, model=ref)
    transform = timm.data.create_transform(**data)
    theirs = torch.stack([transform(Image.open(p).convert("RGB")) for p in images])
    ours = _mtl_pixels(cfg, images)
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    # the weights' own statistics: before, a timm run under data.normalize=auto was never normalised
    assert image_normalization(cfg) == (tuple(data["mean"]), tuple(data["std"]))
    backbone = TimmBackbone.build(cfg).eval()
    with torch.no_grad():
        assert torch.allclose(backbone(ours), ref.forward_features(theirs), atol=1e-4, rtol=1e-4)
    assert "image files through timm.data.create_transform" in normalization_text(cfg)


def test_a_timm_save_pretrained_folder_gives_its_own_pretrained_cfg(tmp_path, images):
    timm = pytest.importorskip("timm")
    from timm.models._hub import save_for_hf

    ref = timm.create_model("resnet18", pretrained=False, num_classes=0)
    ref.pretrained_cfg = {**ref.pretrained_cfg, "crop_pct": 0.5, "interpolation": "bilinear", "mean": (0.1, 0.2, 0.3)}
    save_for_hf(ref, str(tmp_path / "folder"))
    cfg = _cfg("timm", pretrained=str(tmp_path / "folder"), options={"model": "resnet18"})
    owned = model_transform(cfg)
    assert owned.settings["crop_pct"] == 0.5 and owned.settings["interpolation"] == "bilinear"
    assert image_normalization(cfg)[0] == (0.1, 0.2, 0.3)


def test_augmentation_crops_and_flips_before_the_models_transform_the_same_for_the_same_key(tmp_path, images):
    folder = _hf_folder("dinov2", str(tmp_path / "dinov2"))
    owned = model_transform(_cfg("hf_vision", pretrained=folder))
    aug = Augment(random_resized_crop=True, hflip=True, seed=3)
    path = images[1]
    a = load_image(path, S, augment=aug, key=(2, 5), transform=owned)
    again = load_image(path, S, augment=aug, key=(2, 5), transform=pickle.loads(pickle.dumps(owned)))  # a worker's
    assert a.shape == (3, S, S) and torch.equal(a, again)
    assert not torch.equal(a, load_image(path, S, augment=aug, key=(2, 6), transform=owned))
    # a flip alone: the model's transform of the image or of its mirror, whichever the key draws
    flip = Augment(hflip=True, seed=3)
    img = Image.open(path).convert("RGB")
    both = {owned(img).numpy().tobytes(), owned(img.transpose(Image.FLIP_LEFT_RIGHT)).numpy().tobytes()}
    drawn = [load_image(path, S, augment=flip, key=(i, 0), transform=owned).numpy().tobytes() for i in range(8)]
    assert set(drawn) == both


def test_another_image_size_scales_the_processors_resize_and_crop(tmp_path, images):
    folder = _hf_folder("dinov2", str(tmp_path / "dinov2"))
    cfg = _cfg("hf_vision", pretrained=folder)
    cfg.data.image_size = 64
    owned = model_transform(cfg)
    assert owned.settings == {"crop_size": {"height": 64, "width": 64}, "size": {"shortest_edge": 72}}  # 36 * 64 / 32
    assert load_image(images[0], 64, transform=owned).shape == (3, 64, 64)


def test_the_cnn_path_keeps_mtls_own_transform(images):
    cfg = _cfg("resnet18")
    assert model_transform(cfg) is None and image_normalization(cfg) is None
    assert "image files through mtl's resize short side" in normalization_text(cfg)


@pytest.mark.parametrize("value", [{"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}])
def test_explicit_mean_and_std(value):
    cfg = _cfg("resnet18")
    cfg.data.normalize = value
    assert image_normalization(cfg) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert "from data.normalize" in normalization_text(cfg)


@pytest.mark.parametrize("value", ["imagenett", {"mean": [0.1, 0.2], "std": [1, 1, 1]},
                                   {"mean": [0, 0, 0], "std": [1, 0, 1]}, {"mean": [0, 0, 0]},
                                   {"mean": [0, 0, 0], "std": ["a", 1, 1]}])
def test_bad_normalize_is_one_message_naming_the_key(value):
    cfg = _cfg("resnet18")
    cfg.data.normalize = value
    with pytest.raises(ConfigError) as e:
        image_normalization(cfg)
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith("data.normalize: ")
    assert "{mean: [r, g, b], std: [r, g, b]}" in e.value.errors[0]


def test_explicit_statistics_through_the_config_and_a_bad_one_named_before_the_run():
    from mtl.setup.checks import load_run_config

    from .conftest import TINY

    cfg = load_run_config(TINY, ["data.normalize={mean:[0.1,0.2,0.3],std:[0.4,0.5,0.6]}"], announce=False)
    assert image_normalization(cfg) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, ["data.normalize={mean:[0.1,0.2,0.3],sd:[0.4,0.5,0.6]}"], announce=False)
    assert [m for m in e.value.errors if m.startswith("data.normalize: ")] == e.value.errors[:1]


def test_an_hf_data_set_s_cells_go_through_the_model_s_own_transform(tmp_path, images):
    """data.source=hf: an image cell (PNG bytes, non-square) reaches the model through the same transform as an image
    file, DINOv2's resize-then-crop and bicubic resampling, normalised with the processor's statistics."""
    from types import SimpleNamespace

    import datasets
    from transformers import AutoImageProcessor

    from mtl.data.hf_source import hf_split

    folder = _hf_folder("dinov2", str(tmp_path / "dinov2"))
    cells = [{"bytes": open(p, "rb").read(), "path": None} for p in images]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    split = datasets.Dataset.from_dict({"image": cells, "label": [0] * len(cells)}, features=features)
    datasets.DatasetDict(validation=split).save_to_disk(str(tmp_path / "hf"))
    cfg = _cfg("hf_vision", pretrained=folder)
    cfg.seed, cfg.data.on_error, cfg.data.num_classes = 0, "raise", None
    cfg.data.hf = {"path": str(tmp_path / "hf")}
    ds = hf_split(cfg, "val", train=SimpleNamespace(class_names=["a"]))
    prepare_images(cfg, ds)
    ours = normalize_images(torch.stack([ds[i]["image"] for i in range(len(ds))]), ds.normalization)
    pil = [Image.open(p).convert("RGB") for p in images]
    theirs = AutoImageProcessor.from_pretrained(folder)(images=pil, return_tensors="pt")["pixel_values"]
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
