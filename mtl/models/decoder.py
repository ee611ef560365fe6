"""A caption decoder behind a small interface of ours.

Everything the rest of the package needs from transformers goes through ``CaptionDecoder``: build it
(from sizes, or from a local GPT-2 directory), compute logits given the image memory, and generate
(greedy or beam) with ``generate()``. transformers' cross-attention path for decoder-only models has
regressed before; if it does again, only this file changes, and ``tests/test_models.py`` checks that
``generate()`` agrees with a hand-written greedy loop.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mtl.errors import ConfigError


def _gpt2_config(vocab_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float, max_positions: int,
                 bos_id: int, eos_id: int, pad_id: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_positions=max_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, add_cross_attention=True,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=True,
        loss_type="ForCausalLM",
    )


class CaptionDecoder(nn.Module):
    """GPT-2 with cross-attention over an image memory of shape (B, N, n_embd)."""

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, n_layer: int = 2,
                 n_embd: int = 128, n_head: int = 4, dropout: float = 0.1, max_positions: int = 32,
                 pretrained: str | None = None):
        super().__init__()
        from transformers import GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if pretrained:
            if not os.path.isdir(pretrained):
                raise ConfigError(f"model.decoder.pretrained: {pretrained!r} is not a directory")
            try:
                self.lm = GPT2LMHeadModel.from_pretrained(pretrained, add_cross_attention=True,
                                                          local_files_only=True)
            except Exception as e:
                raise ConfigError(f"model.decoder.pretrained: cannot load a GPT-2 model from {pretrained!r}: {e}") from None
            if self.lm.config.vocab_size != vocab_size:
                raise ConfigError(
                    f"model.decoder.pretrained: the decoder's vocabulary ({self.lm.config.vocab_size}) does not match "
                    f"the tokenizer's ({vocab_size}); set tokenizer.path to the decoder's own tokenizer directory"
                )
            self.lm.config.bos_token_id, self.lm.config.eos_token_id = bos_id, eos_id
            self.lm.config.pad_token_id = pad_id
        else:
            cfg = _gpt2_config(vocab_size, n_layer, n_embd, n_head, dropout, max_positions, bos_id, eos_id, pad_id)
            self.lm = GPT2LMHeadModel(cfg)
        self.pretrained_base = bool(pretrained)  # model.peft adapts a pretrained GPT-2 (mtl/models/peft_adapters.py)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.lm.generation_config.pad_token_id = pad_id
        self.lm.generation_config.bos_token_id = bos_id
        self.lm.generation_config.eos_token_id = eos_id

    def blocks(self) -> list[tuple[str, nn.Module]]:
        """The transformer blocks (each self-attention, cross-attention and MLP), named from this module, in order.
        The token embedding and the LM head share one weight outside them."""
        return [(f"lm.transformer.h.{i}", block) for i, block in enumerate(self.lm.transformer.h)]

    @property
    def vocab_size(self) -> int:
        """The rows of the token embedding (and of the LM head, tied to it)."""
        return self.lm.get_input_embeddings().num_embeddings

    def resize_vocab(self, size: int) -> None:
        """transformers' ``resize_token_embeddings``: the first ``min(old, size)`` rows are kept exactly; rows added
        are drawn around the old rows' mean and covariance (its ``mean_resizing``). The LM head stays tied to the
        token embedding (one weight: it grows with it)."""
        self.lm.resize_token_embeddings(size)
        tied = self.lm.get_output_embeddings().weight is self.lm.get_input_embeddings().weight
        if getattr(self.lm.config, "tie_word_embeddings", False) and not tied:  # a transformers change would show here
            raise RuntimeError("resize_token_embeddings untied the LM head from the token embedding")

    @property
    def width(self) -> int:
        return self.lm.config.n_embd

    @property
    def max_positions(self) -> int:
        return self.lm.config.n_positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, T, V) for ``input_ids`` given the image ``memory`` (B, N, width)."""
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=memory,
                      use_cache=False)
        return out.logits

    @torch.no_grad()
    def generate(self, memory: torch.Tensor, max_new_tokens: int, num_beams: int = 1) -> list[list[int]]:
        """Token ids after BOS, up to (not including) EOS, for each image in ``memory``."""
        bos = torch.full((memory.shape[0], 1), self.bos_id, dtype=torch.long, device=memory.device)
        out = self.lm.generate(
            input_ids=bos, attention_mask=torch.ones_like(bos), encoder_hidden_states=memory,
            max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False, early_stopping=num_beams > 1,
            # transformers turns synced_gpus on for an FSDP-managed module (parallel.engine=fsdp2): an all-reduce per
            # token, which hangs when ranks evaluate different numbers of batches. Generation here is local.
            synced_gpus=False,
        )
        result = []
        for row in out[:, 1:].tolist():
            if self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            result.append([t for t in row if t != self.pad_id])
        return result
