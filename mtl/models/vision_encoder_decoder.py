"""A captioner in transformers' own layout, a ``VisionEncoderDecoderModel`` folder (a ViT-GPT2), in and out.

In (``init_from: DIR``, ``mtl.setup.build.init_from_weights``): the folder's encoder is the backbone (``hf_vision``), its
GPT-2 decoder the caption head's decoder and its tokenizer the run's. The map is one to one:

    encoder.*          -> backbone.model.*
    decoder.*          -> heads.gen.decoder.lm.*
    enc_to_dec_proj.*  -> heads.gen.proj.*      (where the encoder's width is not the decoder's)

The run's config says what model to build (``model.backbone.name=hf_vision`` and its folder, ``model.decoder.*``,
as configs/vit_gpt2.yaml does) and ``ved_state`` checks the built model against the folder's config.json before a
weight is read: a key that disagrees is named with the value to set. The other heads (a classification head) start
fresh, and the folder's tensors no mtl module holds (ViT's pooler, which a captioner never reads) are named.

Out (``to_vision_encoder_decoder``, for ``mtl.inference.interop``): the same map backwards, into a
``VisionEncoderDecoderModel`` whose ``generate`` gives mtl's captions.
"""

from __future__ import annotations

import copy
import json
import os

import torch

from mtl.data.images import PROCESSOR_FILE, image_normalization, processor_normalization
from mtl.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from mtl.data.tokenizer import CaptionTokenizer
from mtl.errors import CheckpointError, ConfigError
from mtl.models.backbones import hf_vision

VED_TYPE = "vision-encoder-decoder"
BACKBONE = hf_vision.HFVisionBackbone.name
# the VED's modules -> the mtl model's (prefixes of their state-dict keys)
PREFIXES = (("encoder.", "backbone.model."), ("decoder.", "heads.gen.decoder.lm."),
            ("enc_to_dec_proj.", "heads.gen.proj."))
# encoder types whose transformers model (AutoModel.from_config) is what hf_vision holds, so that its
# last_hidden_state is the backbone's features: the ones a VED folder can be written for
EXPORTABLE_ENCODERS = ("vit", "dinov2")
# GPT-2 config keys that decide what the decoder computes (not its size, checked by key, nor dropout, vocab or ids)
GPT2_ARCHITECTURE = ("n_inner", "activation_function", "layer_norm_epsilon", "scale_attn_weights",
                     "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention",
                     "tie_word_embeddings")
GPT2_SIZES = (("n_layer", "n_layer"), ("n_embd", "n_embd"), ("n_head", "n_head"), ("n_positions", "max_positions"))
# config keys that do not change what a vision encoder computes from an image
ENCODER_NOT_ARCHITECTURE = {
    "_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "_commit_hash", "id2label",
    "label2id", "num_labels", "return_dict", "output_hidden_states", "output_attentions", "use_cache",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_word_embeddings", "chunk_size_feed_forward",
    "problem_type", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "_attn_implementation_autoset",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate", "layerscale_value", "pooler_act",
    "pooler_output_size", "encoder_stride", "initializer_range", "use_mask_token", "out_features", "out_indices",
    "stage_names", "apply_layernorm", "reshape_hidden_states", "_output_attentions", "_output_hidden_states",
}


def is_vision_encoder_decoder(path) -> bool:
    """Whether ``path`` is a folder whose config.json is a ``VisionEncoderDecoderModel``'s."""
    return transformers_type(path) == VED_TYPE


def transformers_type(path) -> str | None:
    """The ``model_type`` of a transformers model folder (its config.json), or None where ``path`` is not one."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def is_captioner_source(path) -> bool:
    """Whether ``init_from`` names a VisionEncoderDecoderModel folder (False: an mtl model folder or file). A
    transformers folder of another kind is refused here (ConfigError naming init_from and its model type)."""
    kind = transformers_type(path)
    if kind is None or kind == VED_TYPE:
        return kind == VED_TYPE
    raise ConfigError(f"init_from: {os.fspath(path)!r} is a transformers {kind!r} folder, neither an mtl model folder "
                      f"nor a VisionEncoderDecoderModel (model_type {VED_TYPE!r}, a ViT-GPT2 captioner). For a vision "
                      f"encoder alone set model.backbone.name={BACKBONE} and model.backbone.pretrained to it; for a "
                      "GPT-2, model.decoder.pretrained")


def read_config(folder: str) -> dict:
    """The folder's config.json (a VED's: ``encoder`` and ``decoder`` sub-configs)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def tokenizer_dir(folder: str) -> str:
    """The VED folder itself (checked first: ``check_folder``), which must hold transformers' fast-tokenizer file
    (``tokenizer.json``)."""
    errors = check_folder(folder, read_config(folder))
    if errors:
        raise ConfigError(errors)
    if not os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
        raise ConfigError(f"init_from: the VisionEncoderDecoderModel folder {folder!r} has no {TOKENIZER_FILE} (the "
                          "run's tokenizer comes from it). Save its fast tokenizer there (transformers: "
                          f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), or set tokenizer.path to a "
                          "folder holding the decoder's tokenizer.json")
    return folder


def check_folder(folder: str, ved: dict) -> list[str]:
    """What makes a VED folder unusable whatever the run's config: an encoder type hf_vision does not take, a
    decoder that is not a GPT-2."""
    errors = []
    encoder, decoder = ved.get("encoder") or {}, ved.get("decoder") or {}
    if encoder.get("model_type") not in hf_vision._supported():
        errors.append(f"init_from: the encoder of {folder!r} is a {encoder.get('model_type')!r} model, not a vision "
                      f"model {BACKBONE} takes (ViT, DeiT, DINOv2, CLIP, SigLIP, Swin, ConvNeXt ...); use a "
                      "captioner with one of those encoders")
    if decoder.get("model_type") != "gpt2":
        errors.append(f"init_from: the decoder of {folder!r} is a {decoder.get('model_type')!r} model; mtl's caption "
                      "head is a GPT-2 (model_type 'gpt2'), so only a captioner with a GPT-2 decoder can be imported")
    return errors


def _differences(ours: dict, theirs: dict, keys) -> list[str]:
    return [f"{k} {ours.get(k)!r} here, {theirs.get(k)!r} in the folder" for k in keys if ours.get(k) != theirs.get(k)]


def check_model(cfg, model, folder: str, ved: dict, tokenizer: CaptionTokenizer | None,
                old_tokenizer: CaptionTokenizer | None) -> list[str]:
    """The built model against the folder's config: the backbone's transformers config against the encoder's, the
    decoder's sizes and architecture against the decoder's, the tokenizer's vocabulary and special ids against the
    decoder's. Each difference names the key to set and the value."""
    errors = check_folder(folder, ved)
    if cfg.model.backbone.name != BACKBONE:
        errors.append(f"model.backbone.name: init_from {folder!r} is a VisionEncoderDecoderModel, whose encoder "
                      f"becomes the backbone: set model.backbone.name={BACKBONE} (with model.backbone.pretrained or "
                      f"config, a folder of that encoder; configs/vit_gpt2.yaml), not {cfg.model.backbone.name!r}")
    if errors:
        return errors
    where, source = hf_vision.source_of(cfg)
    encoder = ved["encoder"]
    ours = model.backbone.model.config.to_dict()
    keys = sorted((set(ours) | set(encoder)) - ENCODER_NOT_ARCHITECTURE)
    diff = _differences(ours, encoder, [k for k in keys if not k.startswith("_")])
    if diff:
        errors.append(f"{where}: the backbone built from {source!r} is not the encoder "
                      f"of init_from {folder!r}: {'; '.join(diff[:6])}. Point {where} at a folder of that encoder "
                      "(the same config.json)")
    errors += check_normalization(cfg, folder)
    if "gen" not in model.heads:
        return errors
    decoder, lm = ved["decoder"], model.heads["gen"].decoder.lm.config.to_dict()
    d = cfg.model.decoder
    if d.get("pretrained"):
        diff = _differences(lm, decoder, [k for k, _ in GPT2_SIZES] + list(GPT2_ARCHITECTURE))
        if diff:
            errors.append(f"model.decoder.pretrained: the GPT-2 in {d.pretrained!r} is not the decoder of init_from "
                          f"{folder!r}: {'; '.join(diff)}. Unset model.decoder.pretrained and set model.decoder.* to "
                          "the decoder's sizes")
    else:
        errors += [f"model.decoder.{key}: {lm.get(k)} here, the decoder of init_from {folder!r} has {decoder.get(k)}: "
                   f"set model.decoder.{key}={decoder.get(k)}" for k, key in GPT2_SIZES if lm.get(k) != decoder.get(k)]
        diff = _differences(lm, decoder, GPT2_ARCHITECTURE)
        if diff:
            errors.append(f"init_from: the decoder of {folder!r} is a GPT-2 that model.decoder.* cannot build "
                          f"({'; '.join(diff)}); set model.decoder.pretrained to a GPT-2 folder with its config")
    if tokenizer is not None:
        errors += check_tokenizer(cfg, folder, ved, tokenizer, old_tokenizer)
    return errors


def check_normalization(cfg, folder: str) -> list[str]:
    """The run normalises images as the captioner was trained (its image processor, where the folder has one)."""
    if not os.path.isfile(os.path.join(folder, PROCESSOR_FILE)):
        return []
    theirs, ours = processor_normalization(folder), image_normalization(cfg)
    same = (theirs is None and ours is None) or (theirs is not None and ours is not None and all(
        abs(a - b) < 1e-6 for t, o in zip(theirs, ours) for a, b in zip(t, o)))
    if same:
        return []
    return [f"data.normalize: this run normalises images with {ours} (mean, std), the captioner init_from {folder!r} "
            f"was trained with {theirs} (its {PROCESSOR_FILE}); use a backbone folder with that image processor "
            "(data.normalize=auto reads it), or set data.normalize to match"]


def check_tokenizer(cfg, folder: str, ved: dict, tokenizer: CaptionTokenizer,
                    old_tokenizer: CaptionTokenizer | None) -> list[str]:
    """The run's tokenizer fits the decoder: its vocabulary is the decoder's (or extends the folder's own tokenizer,
    whose size is the decoder's: the decoder then grows), and BOS/EOS are the ids the captioner starts and stops
    with."""
    decoder = ved["decoder"]
    source = f"tokenizer.path {cfg.tokenizer.path!r}" if cfg.tokenizer.get("path") else f"the tokenizer of {folder!r}"
    fix = ("unset tokenizer.path (the folder's own tokenizer is used)" if cfg.tokenizer.get("path")
           else "save the decoder's own tokenizer in that folder")
    vocab = int(decoder.get("vocab_size") or 0)
    grown = (old_tokenizer is not None and old_tokenizer.vocab_size == vocab and tokenizer.vocab_size > vocab
             and all(tokenizer.vocab().get(w) == i for w, i in old_tokenizer.vocab().items()))
    errors = []
    if tokenizer.vocab_size != vocab and not grown:
        errors.append(f"tokenizer: {source} has {tokenizer.vocab_size} tokens and the decoder of init_from {folder!r} "
                      f"{vocab} rows: they are not the same vocabulary; {fix}")
    start = ved.get("decoder_start_token_id", decoder.get("decoder_start_token_id", decoder.get("bos_token_id")))
    eos = ved.get("eos_token_id", decoder.get("eos_token_id"))
    if not errors and start is not None and start != tokenizer.bos_id:
        errors.append(f"tokenizer: {source} starts a caption with id {tokenizer.bos_id}, the captioner "
                      f"{folder!r} with decoder_start_token_id {start}; {fix}")
    if not errors and eos is not None and eos != tokenizer.eos_id:
        errors.append(f"tokenizer: {source} ends a caption with id {tokenizer.eos_id}, the captioner "
                      f"{folder!r} with eos_token_id {eos}; {fix}")
    return errors


def load_folder(folder: str):
    """The folder's ``VisionEncoderDecoderModel`` (transformers reads the files: safetensors, shards, key renames);
    a tensor the model needs and the files lack is refused, never initialised at random in silence."""
    from transformers import VisionEncoderDecoderModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        ved, info = VisionEncoderDecoderModel.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError ... for a folder it cannot read
        raise CheckpointError(f"init_from: transformers cannot load {folder!r} as a VisionEncoderDecoderModel "
                              f"({type(e).__name__}: {str(e)[:300]}); it is incomplete or damaged") from None
    missing = list(info.get("missing_keys") or []) + [str(m[0]) if isinstance(m, tuple) else str(m)
                                                      for m in info.get("mismatched_keys") or []]
    if missing:
        raise CheckpointError(f"init_from: {folder!r} lacks {len(missing)} tensor(s) of its model "
                              f"({', '.join(sorted(missing)[:5])}); it is incomplete or damaged")
    return ved.eval()


def ved_state(model, ved) -> tuple[dict, list[str]]:
    """The mtl state dict for ``model`` from a loaded VED: its tensors under mtl's names, and the model's own
    (fresh) tensors for every other head (a classification head); returns it and the notes: what started fresh,
    and every tensor of the folder that no mtl module holds (named, never dropped in silence)."""
    own = model.state_dict()
    state, unused = {}, []
    for name, module in (("encoder", ved.encoder), ("decoder", ved.decoder),
                         ("enc_to_dec_proj", getattr(ved, "enc_to_dec_proj", None))):
        if module is None:
            continue
        prefix = dict(PREFIXES)[name + "."]
        for k, v in module.state_dict().items():
            if prefix + k in own:
                state[prefix + k] = v.detach().clone()
            else:
                unused.append(f"{name}.{k}")
    mapped = {p for _, p in PREFIXES}
    fresh = sorted({k.split(".")[1] for k in own if k.startswith("heads.")
                    and not any(k.startswith(p) for p in mapped) and not k.startswith("heads.gen.")})
    state.update({k: v for k, v in own.items() if k.startswith("heads.") and k.split(".")[1] in fresh})
    notes = [f"encoder -> backbone.model ({sum(k.startswith('backbone.') for k in state)} tensors), decoder -> "
             f"heads.gen.decoder.lm ({sum(k.startswith('heads.gen.decoder.') for k in state)}), enc_to_dec_proj -> "
             f"heads.gen.proj ({sum(k.startswith('heads.gen.proj.') for k in state)})"]
    if fresh:
        notes.append("started fresh (not in a captioner): " + ", ".join(f"heads.{t}" for t in fresh))
    if unused:
        notes.append(f"not used ({len(unused)} tensors no mtl module holds): " + ", ".join(unused[:8])
                     + (", ..." if len(unused) > 8 else ""))
    return state, notes


# ------------------------------------------------------------------ out: mtl -> a VisionEncoderDecoderModel

def export_problem(backbone, head) -> str | None:
    """Why the model cannot be written as a VisionEncoderDecoderModel, or None: the backbone must be hf_vision with
    an encoder of ``EXPORTABLE_ENCODERS``, the head a GPT-2 caption head reading its tokens (no position table)."""
    model = getattr(backbone, "model", None)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if getattr(backbone, "name", None) != BACKBONE or kind is None:
        return f"the backbone is not {BACKBONE}"
    if kind not in EXPORTABLE_ENCODERS:
        return f"its encoder is a {kind!r} model (written for {', '.join(EXPORTABLE_ENCODERS)})"
    if getattr(head, "pos", None) is not None or not hasattr(getattr(head, "decoder", None), "lm"):
        return "the caption head does not read the encoder's tokens as they are"
    return None


@torch.no_grad()
def to_vision_encoder_decoder(backbone, head, seed: int = 0):
    """A ``VisionEncoderDecoderModel`` holding the backbone's encoder, the head's GPT-2 and its projection, with the
    head's generation settings (BOS as the decoder's start, EOS, padding, ``max_new_tokens``, ``num_beams``).
    Returns (the model, the names of its tensors mtl does not train: ViT's pooler, initialised as transformers
    does, from ``seed``)."""
    from transformers import VisionEncoderDecoderConfig, VisionEncoderDecoderModel

    encoder, decoder = backbone.model, head.decoder
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(copy.deepcopy(encoder.config),
                                                                    copy.deepcopy(decoder.lm.config))
    config.decoder_start_token_id, config.eos_token_id = decoder.bos_id, decoder.eos_id
    config.pad_token_id = decoder.pad_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ved = VisionEncoderDecoderModel(config)
    missing, unexpected = ved.encoder.load_state_dict(encoder.state_dict(), strict=False)
    if unexpected:
        raise RuntimeError(f"the encoder of the VisionEncoderDecoderModel lacks {unexpected}")
    ved.decoder.load_state_dict(decoder.lm.state_dict())
    proj = getattr(ved, "enc_to_dec_proj", None)
    if proj is not None:
        proj.load_state_dict(head.proj.state_dict())
    g = ved.generation_config
    g.decoder_start_token_id, g.bos_token_id = decoder.bos_id, decoder.bos_id
    g.eos_token_id, g.pad_token_id = decoder.eos_id, decoder.pad_id
    g.max_new_tokens, g.num_beams = int(head.max_new_tokens), int(head.num_beams)
    g.do_sample, g.early_stopping = False, int(head.num_beams) > 1
    g.max_length = None
    return ved.eval(), [f"encoder.{k}" for k in missing]
