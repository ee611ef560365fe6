"""A trained model's parts in other libraries' own layouts, for an export folder (``mtl.inference.export_model``).

- ``hf_decoder/``: the caption decoder as a Hugging Face model folder (``config.json``, ``generation_config.json``,
  ``model.safetensors`` under transformers' names) that ``transformers.GPT2LMHeadModel.from_pretrained`` loads as
  it is, plus ``image_memory.safetensors``: the projection from the backbone's feature map to the decoder's
  cross-attention input (``encoder_hidden_states``);
- ``torchvision_backbone/``: the backbone's weights under torchvision's own state-dict names, where its
  architecture is a torchvision one (``backbone.json`` says how to build it and how far to run it);
- ``image_program.pt2``: a ``torch.export`` program of the image path, normalisation, backbone and classification
  head, for any batch size: ``torch.export.load(path).module()(images)`` gives ``(features, logits)`` with plain
  torch, whatever the backbone (``image_program.json`` says what goes in and comes out).

``INTERFACE`` (written to the folder as README.md) is the contract: with only transformers and torchvision, the
same features and the same captions as ``mtl.inference`` (tests/test_interop.py checks it in a process that
cannot import mtl).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from mtl.data.images import image_normalization
from mtl.models.backbones.torchvision_cnn import CONVNEXTS, RESNETS

HF_DIR = "hf_decoder"
TV_DIR = "torchvision_backbone"

INTERFACE = """# Using this model without mtl

## Backbone (torchvision): `torchvision_backbone/`

`backbone.json` names the torchvision model (`torchvision_model`), its normalisation layers (`norm`) and how far to
run it (`run`). Build it and load the weights:

```python
import json, torch, torchvision
from safetensors.torch import load_file
spec = json.load(open("torchvision_backbone/backbone.json"))
norm_layer = None  # torchvision's BatchNorm2d for norm batch, sync and frozen
if spec["norm"] == "group":  # GroupNorm, groups per channel count (layers not run: any, e.g. 1)
    norm_layer = lambda c: torch.nn.GroupNorm(spec["group_norm_groups"].get(str(c), 1), c)
kwargs = {"norm_layer": norm_layer} if norm_layer else {}
net = torchvision.models.get_model(spec["torchvision_model"], weights=None, **kwargs).eval()
missing, unexpected = net.load_state_dict(load_file("torchvision_backbone/model.safetensors"), strict=False)
assert not unexpected and all(k.split(".")[0] in spec["unused"] for k in missing)
```

The features are the output of the modules listed in `run`, in order (for a ResNet: `conv1, bn1, relu, maxpool,
layer1 ... layerN`; for the others: `features`, its first N blocks). Input images: (B, 3, S, S) in [0, 1] (S is
`image_size`), normalised with `normalize` (mean, std per channel) if it is not null.

## Caption decoder (transformers): `hf_decoder/`

`transformers.GPT2LMHeadModel.from_pretrained("hf_decoder")` loads a GPT-2 with cross-attention. Its image input is
`encoder_hidden_states` of shape (B, h*w, n_embd), made from the backbone's feature map (B, C, h, w) with
`image_memory.safetensors`:

```python
mem = load_file("hf_decoder/image_memory.safetensors")
memory = features.flatten(2).transpose(1, 2) @ mem["proj.weight"].T + mem["proj.bias"] + mem["pos"]
bos = torch.full((B, 1), model.config.bos_token_id)
ids = model.generate(input_ids=bos, attention_mask=torch.ones_like(bos), encoder_hidden_states=memory,
                     max_new_tokens=spec["max_new_tokens"], num_beams=1, do_sample=False)
```

Each caption is the ids after BOS up to the first EOS (`eos_token_id`), padding (`pad_token_id`) removed, decoded
with `tokenizer/tokenizer.json` (the `tokenizers` library). `max_new_tokens` is in `hf_decoder/image_memory.json`.
"""

PROGRAM_INTERFACE = """
## The image path as one program (plain torch): `image_program.pt2`

A `torch.export` program of normalisation, backbone and classification head, for any batch size, on the CPU in
float32. It needs torch only (not torchvision, not mtl):

```python
import json, torch
program = torch.export.load("image_program.pt2").module()
features, logits = program(images)  # images: (B, 3, S, S) float32 in [0, 1], not normalised
names = json.load(open("class_names.json"))  # logits.argmax(-1) indexes them; image_program.json: the shapes
```

`features` are what the caption decoder above reads (`encoder_hidden_states` from them, as shown).
"""

PROGRAM_FILE = "image_program.pt2"


def torchvision_state(name: str, backbone_state: dict) -> dict | None:
    """The backbone's weights (its own state dict: ``stem.0.weight``, ``layers.0.0.conv1.weight`` ...) under torchvision's names, or
    None where the trunk is not a prefix of a torchvision model."""
    out = {}
    if name in RESNETS:
        for k, v in backbone_state.items():
            part, rest = k.split(".", 1)
            if part == "stem":  # Sequential(conv1, bn1, relu, maxpool)
                index, leaf = rest.split(".", 1)
                out[f"{('conv1', 'bn1')[int(index)]}.{leaf}"] = v
            elif part == "layers":
                index, leaf = rest.split(".", 1)
                out[f"layer{int(index) + 1}.{leaf}"] = v
            else:
                return None
        return out
    if all(k.startswith("features.") for k in backbone_state):
        return dict(backbone_state)
    return None


def write_torchvision_backbone(folder: str, cfg, backbone: torch.nn.Module) -> bool:
    """``folder/torchvision_backbone/``: the weights under torchvision's names and ``backbone.json``; False (and
    nothing written) where the architecture is not torchvision's (GroupNorm outside the ResNets)."""
    b = cfg.model.backbone
    if b.norm == "group" and b.name not in RESNETS:
        return False
    own = {k: v.detach().cpu() for k, v in backbone.state_dict().items()}
    tv = torchvision_state(b.name, own)
    if tv is None:
        return False
    groups = {}
    if b.norm == "frozen":  # FrozenBatchNorm2d has no counter; torchvision's BatchNorm2d expects one
        for k in [k for k in tv if k.endswith(".running_var")]:
            tv[k[: -len("running_var")] + "num_batches_tracked"] = torch.zeros((), dtype=torch.long)
    if b.norm == "group":
        groups = {str(m.num_channels): m.num_groups for m in backbone.modules() if isinstance(m, torch.nn.GroupNorm)}
    if b.name in RESNETS:
        run = ["conv1", "bn1", "relu", "maxpool", *[f"layer{i + 1}" for i in range(int(b.stages))]]
        unused = ["fc", *[f"layer{i + 1}" for i in range(int(b.stages), 4)]]
    else:
        blocks = 2 * int(b.stages) if b.name in CONVNEXTS else None
        run = [f"features[:{blocks}]" if blocks else "features"]
        unused = ["classifier", "features"] if blocks else ["classifier"]

    normalize = image_normalization(cfg)
    spec = {"torchvision_model": b.name, "norm": "batch" if b.norm in ("sync", "frozen") else b.norm,
            "group_norm_groups": groups, "run": run, "unused": unused, "image_size": int(cfg.data.image_size),
            "normalize": None if normalize is None else [list(map(float, t)) for t in normalize]}
    out = os.path.join(folder, TV_DIR)
    os.makedirs(out)
    save_file({k: v.contiguous() for k, v in tv.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "backbone.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    return True


def write_hf_decoder(folder: str, head) -> bool:
    """``folder/hf_decoder/``: the captioning head's GPT-2 as transformers saves it, and its image-memory
    projection. False where the model has no such head."""
    decoder = getattr(head, "decoder", None)
    if decoder is None or not hasattr(decoder, "lm"):
        return False
    out = os.path.join(folder, HF_DIR)
    decoder.lm.save_pretrained(out, safe_serialization=True)
    save_file({"proj.weight": head.proj.weight.detach().cpu().contiguous(),
               "proj.bias": head.proj.bias.detach().cpu().contiguous(),
               "pos": head.pos.detach().cpu().contiguous()}, os.path.join(out, "image_memory.safetensors"))
    with open(os.path.join(out, "image_memory.json"), "w", encoding="utf-8") as f:
        json.dump({"max_new_tokens": int(head.max_new_tokens), "bos_token_id": decoder.bos_id,
                   "eos_token_id": decoder.eos_id, "pad_token_id": decoder.pad_id,
                   "memory": "features.flatten(2).transpose(1, 2) @ proj.weight.T + proj.bias + pos"}, f, indent=1)
    return True


class ImagePath(torch.nn.Module):
    """Images in [0, 1] -> (the backbone's features, the classification head's logits): what ``mtl.inference``
    computes for them, as one module to export."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Module, normalization):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.normalize = normalization is not None
        mean, std = normalization or ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (images - self.mean) / self.std if self.normalize else images
        features = self.backbone(x)
        return features, self.head.logits(features)


def write_image_program(folder: str, predictor) -> bool:
    """``folder/image_program.pt2`` (``torch.export``, any batch size) and ``image_program.json``; False where the
    model has no classification head (``cls``, with ``logits``)."""
    head = predictor.model.heads["cls"] if "cls" in predictor.model.heads else None
    if head is None or not hasattr(head, "logits"):
        return False
    module = ImagePath(predictor.model.backbone, head, predictor.normalization).eval()
    size = int(predictor.cfg.data.image_size)
    example = torch.rand(2, 3, size, size)
    with torch.no_grad():
        program = torch.export.export(module, (example,), dynamic_shapes={"images": {0: torch.export.Dim.DYNAMIC}})
        features, logits = module(example)
    torch.export.save(program, os.path.join(folder, PROGRAM_FILE))
    with open(os.path.join(folder, "image_program.json"), "w", encoding="utf-8") as f:
        json.dump({"input": f"images: (B, 3, {size}, {size}) float32 in [0, 1], not normalised",
                   "outputs": [f"features: (B, {', '.join(map(str, features.shape[1:]))})",
                               f"logits: (B, {logits.shape[1]}), indexing class_names.json"],
                   "normalization": None if predictor.normalization is None
                   else [list(map(float, t)) for t in predictor.normalization]}, f, indent=1)
    return True


def write_interop(folder: str, predictor) -> list[str]:
    """Each part where the model allows it, and README.md; returns the files and folders written."""
    written = []
    if write_torchvision_backbone(folder, predictor.cfg, predictor.model.backbone):
        written.append(TV_DIR)
    if "gen" in predictor.model.heads and write_hf_decoder(folder, predictor.model.heads["gen"]):
        written.append(HF_DIR)
    if write_image_program(folder, predictor):
        written.append(PROGRAM_FILE)
    if written:
        text = (INTERFACE if {TV_DIR, HF_DIR} & set(written) else "# Using this model without mtl\n")
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
            f.write(text + (PROGRAM_INTERFACE if PROGRAM_FILE in written else ""))
    return written
