"""A trained model's parts in other libraries' own layouts, for an export folder (``mtl.inference.export_model``).

- ``hf_decoder/``: the caption decoder as a Hugging Face model folder (``config.json``, ``generation_config.json``,
  ``model.safetensors`` under transformers' names) that ``transformers.GPT2LMHeadModel.from_pretrained`` loads as
  it is, plus ``image_memory.safetensors``: the projection from the backbone's feature map to the decoder's
  cross-attention input (``encoder_hidden_states``);
- ``torchvision_backbone/``: the backbone's weights under torchvision's own state-dict names, where its
  architecture is a torchvision one (``backbone.json`` says how to build it and how far to run it);
- ``hf_captioner/``: the backbone and the caption head as one ``transformers.VisionEncoderDecoderModel`` folder (a
  ViT-GPT2's layout), with its image processor (the backbone folder's own, at the run's image size, with the run's
  mean and std), tokenizer and processor, where
  the backbone is ``hf_vision`` (ViT, DINOv2) and the head reads its tokens: ``generate(pixel_values=...)`` and
  ``pipeline("image-to-text", model=...)(image, text="")`` give mtl's captions (``mtl.models.vision_encoder_decoder``;
  its tokenizer starts every prompt with BOS, the decoder's start);
- ``image_program.pt2``: a ``torch.export`` program of the image path, normalisation, backbone and classification
  head, for any batch size: ``torch.export.load(path).module()(images)`` gives ``(features, logits)`` with plain
  torch, whatever the backbone (``image_program.json`` says what goes in and comes out).

The folder's README.md (``README_TITLE`` and the sections of the parts written) is the contract: with only transformers and torchvision, the
same features and the same captions as ``mtl.inference`` (tests/test_interop.py checks it in a process that
cannot import mtl).
"""

from __future__ import annotations

import io
import json
import os
import tempfile

import torch
from safetensors.torch import save as safetensors_bytes

from mtl.data.images import image_normalization
from mtl.models import vision_encoder_decoder as ved
from mtl.models.backbones.torchvision_cnn import CONVNEXTS, RESNETS

HF_DIR = "hf_decoder"
TV_DIR = "torchvision_backbone"

README_TITLE = """# Using this model without mtl

Each section below is a Python snippet; run them in order, from this folder, with `images` a (B, 3, S, S) float32
tensor in [0, 1] (S is `image_size` in `image_program.json`; not normalised). Together they give the classes, the
features and the captions `mtl.inference` gives (mtl's tests run this file's code as written, in a process that
cannot import mtl).
"""

PROGRAM_INTERFACE = """
## The image path as one program (plain torch): `image_program.pt2`

A `torch.export` program of normalisation, backbone and classification head, for any batch size, on the CPU in
float32. It needs torch only (not torchvision, not mtl):

```python
import json, torch
program = torch.export.load("image_program.pt2").module()
with torch.no_grad():
    features, logits = program(images)  # features: the backbone's (B, C, h, w) map
names = json.load(open("class_names.json"))  # image_program.json: the shapes
classes = [names[i] for i in logits.argmax(-1).tolist()]
```
"""

BACKBONE_INTERFACE = """
## Backbone (torchvision): `torchvision_backbone/`

`backbone.json` names the torchvision model (`torchvision_model`), its normalisation layers (`norm`), how far to
run it (`run`: modules of the network in order, `features[:N]` for its first N blocks) and the input
normalisation (`normalize`: mean and std per channel, or null). Build it, load the weights and compute the
features:

```python
import json, torch, torchvision
from safetensors.torch import load_file
spec = json.load(open("torchvision_backbone/backbone.json"))
kwargs = {}  # torchvision's BatchNorm2d for norm batch
if spec["norm"] == "group":  # GroupNorm, groups per channel count (layers not run: any, e.g. 1)
    kwargs["norm_layer"] = lambda c: torch.nn.GroupNorm(spec["group_norm_groups"].get(str(c), 1), c)
net = torchvision.models.get_model(spec["torchvision_model"], weights=None, **kwargs).eval()
missing, unexpected = net.load_state_dict(load_file("torchvision_backbone/model.safetensors"), strict=False)
assert not unexpected and all(k.split(".")[0] in spec["unused"] for k in missing)
x = images
if spec["normalize"] is not None:
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in spec["normalize"])
    x = (x - mean) / std
with torch.no_grad():
    for name in spec["run"]:
        module, _, cut = name.partition("[:")
        x = (getattr(net, module)[: int(cut[:-1])] if cut else getattr(net, module))(x)
features = x  # (B, C, h, w): what the caption decoder reads
```
"""

DECODER_INTERFACE = """
## Caption decoder (transformers): `hf_decoder/`

`transformers.GPT2LMHeadModel.from_pretrained("hf_decoder")` loads a GPT-2 with cross-attention. Its image input is
`encoder_hidden_states` of shape (B, h*w, n_embd), made from the backbone's feature map `features` (B, C, h, w)
with `image_memory.safetensors`; `image_memory.json` holds `max_new_tokens` and the special token ids. Each caption
is the ids after BOS up to the first EOS, padding removed, decoded with `tokenizer/tokenizer.json` (the
`tokenizers` library):

```python
import json, torch, transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer
model = transformers.GPT2LMHeadModel.from_pretrained("hf_decoder").eval()
mem = load_file("hf_decoder/image_memory.safetensors")
info = json.load(open("hf_decoder/image_memory.json"))
memory = features.flatten(2).transpose(1, 2) @ mem["proj.weight"].T + mem["proj.bias"] + mem["pos"]
bos = torch.full((memory.shape[0], 1), info["bos_token_id"])
with torch.no_grad():
    ids = model.generate(input_ids=bos, attention_mask=torch.ones_like(bos), encoder_hidden_states=memory,
                         max_new_tokens=info["max_new_tokens"], num_beams=1, do_sample=False)
tokenizer = Tokenizer.from_file("tokenizer/tokenizer.json")
captions = []
for row in ids[:, 1:].tolist():
    row = row[: row.index(info["eos_token_id"])] if info["eos_token_id"] in row else row
    text = tokenizer.decode([t for t in row if t != info["pad_token_id"]], skip_special_tokens=True)
    captions.append(" ".join(text.split()))
```
"""

CAPTIONER_INTERFACE = """
## The captioner (transformers): `hf_captioner/`

A `transformers.VisionEncoderDecoderModel` (the backbone as its encoder, the GPT-2 as its decoder) with its image
processor, tokenizer and processor. Its input is `pixel_values`: the images normalised with the image processor's
mean and std (what the run's loaders did). `num_beams=1` is mtl's `predict` (greedy); `num_beams=N` is
`predict(..., num_beams=N)`; `generation_config.json` holds the run's own `num_beams` and `max_new_tokens`:

```python
import torch, transformers
captioner = transformers.VisionEncoderDecoderModel.from_pretrained("hf_captioner").eval()
processor = transformers.AutoProcessor.from_pretrained("hf_captioner")
ip = processor.image_processor
pixel_values = images
if ip.do_normalize:
    pixel_values = (images - torch.tensor(ip.image_mean).view(1, 3, 1, 1)) / torch.tensor(ip.image_std).view(1, 3, 1, 1)
with torch.no_grad():
    ids = captioner.generate(pixel_values=pixel_values, num_beams=1, do_sample=False,
                             max_new_tokens=captioner.generation_config.max_new_tokens)
captions = [" ".join(t.split()) for t in processor.tokenizer.batch_decode(ids, skip_special_tokens=True)]
```

On image files or PIL images, with transformers' pipeline: its image processor is the backbone folder's own (at the
run's size S), the one mtl reads files with, so the pixels (and the captions) equal mtl's. In transformers 5 the
`image-to-text` task runs as `image-text-to-text`, which takes a text prompt with every image: `text=""` is the
caption from its start (the tokenizer puts BOS, the decoder's start, before any prompt; `text="two"` would start the
caption with that word).
Without `text`, transformers reads a path as the prompt and finds no image, and refuses a PIL image:

```python
import transformers
from PIL import Image
pipe = transformers.pipeline("image-to-text", model="hf_captioner")  # pipe("photo.jpg", text="") for a file
pil = [Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()) for image in images]
out = pipe(pil, text=[""] * len(pil), generate_kwargs={"num_beams": 1, "do_sample": False})
pipeline_captions = [" ".join(o["generated_text"].split()) for o in out]
```
"""

PROGRAM_FILE = "image_program.pt2"
CAPTIONER_DIR = "hf_captioner"


def _write_bytes(path: str, data: bytes) -> None:
    """Python writes the files (a full disk is an OSError naming the file), never a library's native writer: torch's
    C++ one aborts the process on a short write, safetensors' raises its own error type."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        e.filename = e.filename or path
        raise


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def interop_bytes(predictor) -> int:
    """About what ``write_interop`` writes, from the tensors' sizes (the weights of each part; the headers, the JSON
    files and the exported program's graph are left to the caller's margin): the backbone twice (torchvision_backbone/
    and image_program.pt2), the captioning head (hf_decoder/) and the classification head (image_program.pt2)."""
    heads = predictor.model.heads
    captioner = 0  # hf_captioner/: the backbone and the caption head once more
    if "gen" in heads and ved.export_problem(predictor.model.backbone, heads["gen"]) is None:
        captioner = _tensor_bytes(predictor.model.backbone) + _tensor_bytes(heads["gen"])
    return (2 * _tensor_bytes(predictor.model.backbone) + captioner
            + sum(_tensor_bytes(heads[t]) for t in ("gen", "cls") if t in heads))


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
    _write_bytes(os.path.join(out, "model.safetensors"), safetensors_bytes({k: v.contiguous() for k, v in tv.items()}))
    with open(os.path.join(out, "backbone.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    return True


def write_hf_decoder(folder: str, head) -> bool:
    """``folder/hf_decoder/``: the captioning head's GPT-2 as transformers saves it, and its image-memory
    projection. False where the model has no such head."""
    decoder = getattr(head, "decoder", None)
    if decoder is None or not hasattr(decoder, "lm") or getattr(head, "pos", None) is None:
        return False  # no GPT-2, or a head reading tokens as they are (hf_captioner/ holds it)
    out = os.path.join(folder, HF_DIR)
    decoder.lm.save_pretrained(out, safe_serialization=True)
    _write_bytes(os.path.join(out, "image_memory.safetensors"), safetensors_bytes({
        "proj.weight": head.proj.weight.detach().cpu().contiguous(), "proj.bias": head.proj.bias.detach().cpu().contiguous(),
        "pos": head.pos.detach().cpu().contiguous()}))
    with open(os.path.join(out, "image_memory.json"), "w", encoding="utf-8") as f:
        json.dump({"max_new_tokens": int(head.max_new_tokens), "bos_token_id": decoder.bos_id,
                   "eos_token_id": decoder.eos_id, "pad_token_id": decoder.pad_id,
                   "memory": "features.flatten(2).transpose(1, 2) @ proj.weight.T + proj.bias + pos"}, f, indent=1)
    return True


def _prompt_tokenizer(path: str, bos: str, bos_id: int):
    """The run's tokenizer (``tokenizers``, from ``path``) whose encoding of a text starts with BOS: the pipeline's
    prompt (``text=""``, or the caption's first words) is then the decoder's start, as in mtl's own generate."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer.from_file(path)
    tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1",
                                                  special_tokens=[(bos, bos_id)])
    return tokenizer


def _image_processor(predictor):
    """The captioner's image processor: the backbone folder's own (``Predictor.transform``, at the run's size), or
    where the run read files with mtl's transform, that one (the short side resized to S, bilinear, the centre S x S
    cut out); normalised as the run's loaders normalised (``data.normalize``)."""
    import copy

    from transformers import CLIPImageProcessor

    size, norm = int(predictor.cfg.data.image_size), predictor.normalization
    owned = predictor.transform
    if owned is not None and owned.kind == "hf":
        images = copy.deepcopy(owned.fn)
        images.do_normalize = norm is not None
        if norm is not None:
            images.image_mean, images.image_std = list(norm[0]), list(norm[1])
        return images
    return CLIPImageProcessor(do_resize=True, size={"shortest_edge": size}, resample=2, do_center_crop=True,
                              crop_size={"height": size, "width": size}, do_rescale=True, do_convert_rgb=True,
                              do_normalize=norm is not None, image_mean=list(norm[0]) if norm else None,
                              image_std=list(norm[1]) if norm else None)


def write_hf_captioner(folder: str, predictor) -> bool:
    """``folder/hf_captioner/``: the backbone and the caption head as a ``VisionEncoderDecoderModel``
    (``mtl.models.vision_encoder_decoder``), its image processor (the backbone folder's own at the run's
    ``data.image_size``, with the run's normalisation: ``_image_processor``), its tokenizer (the run's, as
    transformers' fast tokenizer) and processor. False (nothing written) where the model is not such a captioner
    (``export_problem``)."""
    from transformers import PreTrainedTokenizerFast, VisionTextDualEncoderProcessor

    head = predictor.model.heads["gen"] if "gen" in predictor.model.heads else None
    if head is None or ved.export_problem(predictor.model.backbone, head) is not None:
        return False
    model, untrained = ved.to_vision_encoder_decoder(predictor.model.backbone, head)
    out = os.path.join(folder, CAPTIONER_DIR)
    model.save_pretrained(out, safe_serialization=True)
    images = _image_processor(predictor)
    tok = predictor.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        names = {i: t for t, i in tok.vocab().items()}
        fast = PreTrainedTokenizerFast(tokenizer_object=_prompt_tokenizer(os.path.join(tmp, "tokenizer.json"),
                                                                          names[tok.bos_id], tok.bos_id),
                                       bos_token=names[tok.bos_id],
                                       eos_token=names[tok.eos_id], pad_token=names[tok.pad_id],
                                       unk_token=names.get(tok.unk_id) if tok.unk_id is not None else None,
                                       clean_up_tokenization_spaces=False)
    VisionTextDualEncoderProcessor(images, fast).save_pretrained(out)  # processor_config.json: the pipeline's
    images.save_pretrained(out)  # preprocessor_config.json: AutoImageProcessor's
    fast.save_pretrained(out)
    with open(os.path.join(out, "mtl_export.json"), "w", encoding="utf-8") as f:
        json.dump({"map": {k: v for k, v in ved.PREFIXES}, "not_trained_by_mtl": untrained,
                   "not_trained_by_mtl_why": "the encoder's pooler: a captioner never reads it"}, f, indent=1)
    return True


class ImagePath(torch.nn.Module):
    """Images in [0, 1] -> (the backbone's features, the classification head's logits): what ``mtl.inference``
    computes for them, as one module to export."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Module, normalization,
                 tower: torch.nn.Module | None = None):
        super().__init__()
        self.backbone, self.head, self.tower = backbone, head, tower  # tower: the task's own modules (an architecture's)
        self.normalize = normalization is not None
        mean, std = normalization or ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (images - self.mean) / self.std if self.normalize else images
        features = self.backbone(x)
        if self.tower is not None:
            features = self.tower(features)
        return features, self.head.logits(features)


def write_image_program(folder: str, predictor) -> bool:
    """``folder/image_program.pt2`` (``torch.export``, any batch size) and ``image_program.json``; False where the
    model has no classification head (``cls``, with ``logits``)."""
    head = predictor.model.heads["cls"] if "cls" in predictor.model.heads else None
    if head is None or not hasattr(head, "logits"):
        return False
    towers = getattr(predictor.model, "towers", None)
    tower = towers["cls"] if towers is not None and "cls" in towers else None
    module = ImagePath(predictor.model.backbone, head, predictor.normalization, tower).eval()
    size = int(predictor.cfg.data.image_size)
    example = torch.rand(2, 3, size, size)
    with torch.no_grad():
        program = torch.export.export(module, (example,), dynamic_shapes={"images": {0: torch.export.Dim.DYNAMIC}})
        features, logits = module(example)
    buffer = io.BytesIO()  # torch's C++ zip writer aborts the process on a full disk: it writes to memory only
    torch.export.save(program, buffer)
    _write_bytes(os.path.join(folder, PROGRAM_FILE), buffer.getvalue())
    with open(os.path.join(folder, "image_program.json"), "w", encoding="utf-8") as f:
        json.dump({"input": f"images: (B, 3, {size}, {size}) float32 in [0, 1], not normalised",
                   "outputs": [f"features: (B, {', '.join(map(str, features.shape[1:]))})",
                               f"logits: (B, {logits.shape[1]}), indexing class_names.json"],
                   "normalization": None if predictor.normalization is None
                   else [list(map(float, t)) for t in predictor.normalization]}, f, indent=1)
    return True


def write_interop(folder: str, predictor, for_task=None) -> list[str]:
    """Each part where the model allows it, and README.md; returns the files and folders written. A model whose
    architecture puts modules of its own between the backbone and the heads (``model.architecture`` other than
    ``hps``: ``towers``) has no layout in torchvision or transformers: only its image program (which runs them).
    ``for_task(task)``: the predictor whose model a task's parts are written from (``model.peft``: the adapters
    merged, with per-task adapters that task's), else ``predictor``."""
    written, pick = [], for_task or (lambda task: predictor)
    plain = getattr(predictor.model, "towers", None) is None
    if plain and write_torchvision_backbone(folder, predictor.cfg, pick("cls").model.backbone):
        written.append(TV_DIR)
    if plain and "gen" in predictor.model.heads and write_hf_decoder(folder, pick("gen").model.heads["gen"]):
        written.append(HF_DIR)
    if plain and write_hf_captioner(folder, pick("gen")):
        written.append(CAPTIONER_DIR)
    if write_image_program(folder, pick("cls")):
        written.append(PROGRAM_FILE)
    if written:  # the sections of the parts written, each using what the ones before it computed
        parts = [(PROGRAM_FILE, PROGRAM_INTERFACE), (TV_DIR, BACKBONE_INTERFACE), (HF_DIR, DECODER_INTERFACE),
                 (CAPTIONER_DIR, CAPTIONER_INTERFACE)]
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
            f.write(README_TITLE + "".join(text for part, text in parts if part in written))
    return written
