"""Small random pretrained-model folders, as transformers and timm save them, for the encoder paths without a download.

    python scripts/make_tiny_pretrained.py runs/pretrained          # (what configs/vit_gpt2.yaml points at)

writes, under the folder given:

- ``vit/``, ``dinov2/``: a ViT and a DINOv2 vision model (``save_pretrained``) with its image processor;
- ``gpt2/``: a GPT-2 LM with cross-attention and its tokenizer (``tokenizer.json``, word-level, trained on the
  built-in data set's captions, so that it covers them);
- ``vit-gpt2/``: a ``VisionEncoderDecoderModel`` of the two (a ViT-GPT2 captioner's layout), with its image processor,
  tokenizer and processor (``pipeline("image-to-text", model=...)`` loads it);
- ``timm_resnet18.safetensors`` (only where timm is installed): a timm ``resnet18``'s random weights.

The weights are random (seeded): the folders have a real model's layout and files, at a size that trains on a CPU in
seconds. For a real pretrained model, download its folder elsewhere (``huggingface-cli download google/vit-base-patch16-224
--local-dir DIR``) and point ``model.backbone.pretrained`` at it (docs/pretrained.md). The tests build their folders with
``write_all`` into a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

IMAGE_SIZE = 32  # the built-in data set's image size (configs/vit_gpt2.yaml)
MEAN, STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]


def _vit_config(image_size: int, hidden: int = 64, layers: int = 2, heads: int = 4):
    from transformers import ViTConfig

    return ViTConfig(image_size=image_size, patch_size=8, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)


def write_vit(out: str, image_size: int = IMAGE_SIZE, seed: int = 0) -> str:
    from transformers import ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    ViTModel(_vit_config(image_size)).save_pretrained(out)  # with its pooler, as google/vit-* checkpoints are
    ViTImageProcessor(size={"height": image_size, "width": image_size}, image_mean=MEAN, image_std=STD).save_pretrained(out)
    return out


def write_dinov2(out: str, image_size: int = IMAGE_SIZE, seed: int = 0) -> str:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    cfg = Dinov2Config(image_size=image_size, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       mlp_ratio=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    Dinov2Model(cfg).save_pretrained(out)
    BitImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                      image_mean=MEAN, image_std=STD, do_convert_rgb=True).save_pretrained(out)
    return out


def _tokenizer_dir(out: str) -> str:
    """A word-level tokenizer trained on the built-in data set's captions, saved as mtl and transformers read it."""
    from transformers import PreTrainedTokenizerFast

    from mtl.data.synthetic import COLOUR_NAMES, COUNT_WORDS, POSITION_NAMES, SIZES, caption_text
    from mtl.data.tokenizer import train_tokenizer

    captions = [caption_text(n, s, c, p) for n in range(1, len(COUNT_WORDS)) for s in SIZES for c in COLOUR_NAMES
                for p in POSITION_NAMES]
    tok = train_tokenizer(captions, 512)
    tok.save(out)
    PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"), bos_token="[BOS]", eos_token="[EOS]",
                            pad_token="[PAD]", unk_token="[UNK]").save_pretrained(out)
    return out


def write_gpt2(out: str, seed: int = 0, n_embd: int = 64) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    from mtl.data.tokenizer import CaptionTokenizer

    _tokenizer_dir(out)
    tok = CaptionTokenizer.load(out)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=tok.vocab_size, n_positions=32, n_embd=n_embd, n_layer=2, n_head=4, add_cross_attention=True,
                     bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


def write_vit_gpt2(out: str, vit: str, gpt2: str) -> str:
    from transformers import (
        AutoImageProcessor,
        AutoModel,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
        VisionEncoderDecoderModel,
        VisionTextDualEncoderProcessor,
    )

    model = VisionEncoderDecoderModel(encoder=AutoModel.from_pretrained(vit, local_files_only=True),
                                      decoder=GPT2LMHeadModel.from_pretrained(gpt2, local_files_only=True))
    tok = PreTrainedTokenizerFast.from_pretrained(gpt2, local_files_only=True)
    model.config.decoder_start_token_id = tok.bos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.decoder_start_token_id = tok.bos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    AutoImageProcessor.from_pretrained(vit, local_files_only=True).save_pretrained(out)
    _tokenizer_dir(out)  # mtl's own tokenizer.json and transformers' files (the same vocabulary)
    # processor_config.json: transformers 5 runs pipeline("image-to-text") as "image-text-to-text", which needs a
    # processor (image processor + tokenizer); VisionTextDualEncoderProcessor is transformers' plain pair
    VisionTextDualEncoderProcessor(AutoImageProcessor.from_pretrained(out, local_files_only=True),
                                   PreTrainedTokenizerFast.from_pretrained(out, local_files_only=True)).save_pretrained(out)
    return out


def write_timm_resnet(path: str, seed: int = 0) -> str | None:
    try:
        import timm
    except ImportError:
        return None
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    save_file(timm.create_model("resnet18", pretrained=False).state_dict(), path)
    return path


def write_all(out: str, image_size: int = IMAGE_SIZE) -> dict[str, str | None]:
    """Every folder above under ``out``; returns their paths by name."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.makedirs(out, exist_ok=True)
    paths = {"vit": write_vit(os.path.join(out, "vit"), image_size),
             "dinov2": write_dinov2(os.path.join(out, "dinov2"), image_size),
             "gpt2": write_gpt2(os.path.join(out, "gpt2"))}
    paths["vit-gpt2"] = write_vit_gpt2(os.path.join(out, "vit-gpt2"), paths["vit"], paths["gpt2"])
    paths["timm_resnet18"] = write_timm_resnet(os.path.join(out, "timm_resnet18.safetensors"))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/pretrained", help="the folder to write (default: runs/pretrained)")
    parser.add_argument("--image-size", type=int, default=IMAGE_SIZE)
    args = parser.parse_args(argv)
    for name, path in write_all(args.out, args.image_size).items():
        print(f"{name}: {path or 'skipped (timm is not installed)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
