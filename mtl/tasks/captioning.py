"""Caption generation: a GPT-2 decoder cross-attending to the projected backbone feature map."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtl.models.decoder import CaptionDecoder
from mtl.tasks.base import BuildInfo, TaskHead


class CaptioningHead(TaskHead):
    name = "gen"
    metrics = {"bleu4": True, "chrf": True}

    def __init__(self, info: BuildInfo):
        super().__init__()
        d, tok = info.cfg.model.decoder, info.tokenizer
        self.decoder = CaptionDecoder(
            vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
            n_layer=d.n_layer, n_embd=d.n_embd, n_head=d.n_head, dropout=d.dropout,
            max_positions=d.max_positions, pretrained=d.pretrained,
        )
        h, w = info.feature_hw
        self.proj = nn.Linear(info.feature_channels, self.decoder.width)
        self.pos = nn.Parameter(torch.zeros(h * w, self.decoder.width))
        nn.init.normal_(self.pos, std=0.02)
        self.tokenizer = tok
        self.max_new_tokens = int(info.cfg.data.max_caption_tokens)
        self.num_beams = int(info.cfg.trainer.num_beams)

    def memory(self, features: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, h*w, width): one cross-attention token per feature-map cell."""
        x = features.flatten(2).transpose(1, 2)
        return self.proj(x) + self.pos

    def prepare(self, batch, reduce_sum):
        # The caption loss is the mean over the GLOBAL batch's tokens. DDP averages gradients over
        # ranks, so each rank's loss is its token-NLL sum * world / global token count.
        local = torch.stack([(batch["target_ids"] != -100).sum(), torch.ones((), dtype=torch.long,
                                                                         device=batch["target_ids"].device)])
        batch["gen_tokens_global"], batch["gen_world"] = reduce_sum(local.to(torch.float64)).unbind()

    def token_nll_sum(self, features, batch) -> torch.Tensor:
        logits = self.decoder(batch["input_ids"], batch["attention_mask"], self.memory(features))
        return F.cross_entropy(logits.float().flatten(0, 1), batch["target_ids"].flatten(), ignore_index=-100,
                               reduction="sum")

    def forward(self, features, batch):
        nll = self.token_nll_sum(features, batch)
        if "gen_tokens_global" not in batch:  # used outside the trainer: a plain local mean
            return nll / (batch["target_ids"] != -100).sum().clamp(min=1)
        scale = batch["gen_world"] / batch["gen_tokens_global"].clamp(min=1)
        return nll * scale.to(nll.dtype)

    @torch.no_grad()
    def eval_batch(self, features, batch):
        nll = float(self.token_nll_sum(features, batch))
        tokens = int((batch["target_ids"] != -100).sum())
        ids = self.decoder.generate(self.memory(features), self.max_new_tokens, self.num_beams)
        hyps = [self.tokenizer.decode(t) for t in ids]
        return {"nll": nll, "tokens": tokens, "hyps": hyps, "refs": [list(r) for r in batch["references"]],
                "index": batch["index"].tolist()}

    def eval_reduce(self, parts):
        import sacrebleu

        hyps = [h for p in parts for h in p["hyps"]]
        refs = [r for p in parts for r in p["refs"]]
        index = [i for p in parts for i in p["index"]]
        n_ref = max(len(r) for r in refs) if refs else 1
        # sacrebleu takes reference *streams*; images with fewer references pad with None
        streams = [[r[k] if k < len(r) else None for r in refs] for k in range(n_ref)]
        nll = sum(p["nll"] for p in parts)
        tokens = max(1, sum(p["tokens"] for p in parts))
        order = sorted(range(len(index)), key=index.__getitem__)
        return {
            "bleu4": sacrebleu.corpus_bleu(hyps, streams).score / 100.0,
            "chrf": sacrebleu.corpus_chrf(hyps, streams).score / 100.0,
            "exact": sum(h in r for h, r in zip(hyps, refs)) / max(1, len(hyps)),
            "loss": nll / tokens,
            "ppl": math.exp(min(50.0, nll / tokens)),
            "samples": [(index[i], hyps[i], refs[i][0]) for i in order],
        }
