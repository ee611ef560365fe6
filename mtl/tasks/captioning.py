"""Caption generation: a GPT-2 decoder cross-attending to the backbone's features (a projected feature map with
learned positions, or a token sequence as VisionEncoderDecoderModel feeds it).

Its batch fields come from each record's ``captions`` (the first is trained on; all are the references):
``input_ids`` = [BOS] tokens [EOS], padded with ``pad_id``; at most ``max_tokens`` ids follow BOS, and a
cut caption keeps its EOS (so the model still learns to stop). ``target_ids[t]`` is ``input_ids[t + 1]``,
and IGNORE_INDEX where there is no next token (at EOS and padding): the model is fed ``input_ids`` and its
loss is CE(logits[:, t], target_ids[:, t]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtl.models.decoder import CaptionDecoder
from mtl.tasks.base import BuildInfo, DataInfo, TaskHead

IGNORE_INDEX = -100  # target id that cross-entropy skips (torch's default ignore_index)

# BLEU-4 as reported (``gen_bleu4``): sacrebleu's corpus BLEU, 13a tokens, its default 'exp' smoothing (NIST
# mteval-v13a's, Chen & Cherry 2014 method 3) and its effective order. Unchanged wherever a generated caption has
# 4 tokens; when none has n tokens (captions of three words or fewer) corpus BLEU-4 would be 0 for any quality
# (no 4-gram to count), and the geometric mean runs over orders 1 .. n-1 instead. The order used is logged as
# ``gen_bleu4_order`` (4, or fewer for short captions).
BLEU_SMOOTH = "exp"
BLEU_MAX_ORDER = 4


def corpus_bleu4(hyps: list[str], streams: list[list]) -> tuple[float, int]:
    """(BLEU-4 in [0, 1], the n-gram order it used) of the hypotheses against sacrebleu's reference ``streams``,
    as defined above (``BLEU_SMOOTH``, effective order)."""
    from sacrebleu.metrics import BLEU  # import here: sacrebleu, at evaluation only

    score = BLEU(tokenize="13a", smooth_method=BLEU_SMOOTH, effective_order=True).corpus_score(hyps, streams)
    order = next((n for n, total in enumerate(score.totals[:BLEU_MAX_ORDER]) if total == 0), BLEU_MAX_ORDER)
    return min(1.0, max(0.0, score.score / 100.0)), order  # sacrebleu's perfect match is 100.00000000000004


@dataclass
class CaptionOptions:
    max_tokens: int = 16  # tokens after BOS, EOS included; longer captions are cut (was data.max_caption_tokens)
    num_beams: int = 1  # beam width for the eval captions, 1: greedy (was trainer.num_beams; may change on resume)


def encode_caption(tokenizer, caption: str, max_tokens: int) -> list[int]:
    """[BOS] + at most ``max_tokens - 1`` caption ids + [EOS]."""
    return [tokenizer.bos_id] + tokenizer.encode(caption)[: max_tokens - 1] + [tokenizer.eos_id]


class CaptioningHead(TaskHead):
    name = "gen"
    metrics = {"bleu4": True, "chrf": True}
    watchable = ("exact", "ppl")  # exact-match rate (higher is better), perplexity (lower: checkpoint.best_mode=min)
    requires = ("captions",)
    Options = CaptionOptions
    reads = ("model.decoder.", "tokenizer.", "trainer.num_samples")  # shared keys it reads (mtl/config/read_rules.py)
    resume_safe = ("num_beams",)
    loss_is_global_mean = True  # prepare() all-reduces the token count

    @classmethod
    def check(cls, cfg):
        errors = []
        o = cls.options_from(cfg)
        if o.max_tokens < 1:
            errors.append(f"task_options.gen.max_tokens: must be at least 1, room for EOS (got {o.max_tokens})")
        if o.num_beams < 1:
            errors.append(f"task_options.gen.num_beams: must be at least 1 (got {o.num_beams})")
        if o.max_tokens + 1 > cfg.model.decoder.max_positions:
            errors.append(f"task_options.gen.max_tokens: {o.max_tokens} + 1 (BOS) exceeds model.decoder.max_positions "
                          f"({cfg.model.decoder.max_positions}); raise max_positions")
        return errors

    @classmethod
    def item_fields(cls, record: dict, info: DataInfo) -> dict:
        caps = list(record["captions"])
        return {"ids": encode_caption(info.tokenizer, caps[0], info.options(cls).max_tokens), "references": caps}

    @classmethod
    def collate_fields(cls, items: list[dict], info: DataInfo) -> dict:
        seqs = [it["ids"] for it in items]
        b, t = len(seqs), max(len(s) for s in seqs)
        input_ids = torch.full((b, t), info.tokenizer.pad_id, dtype=torch.long)
        target_ids = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.long)
        for i, s in enumerate(seqs):
            row = torch.tensor(s, dtype=torch.long)
            input_ids[i, : len(s)] = row
            target_ids[i, : len(s) - 1] = row[1:]
            mask[i, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "target_ids": target_ids,
                "references": [it["references"] for it in items]}

    def __init__(self, info: BuildInfo):
        super().__init__()
        d, tok = info.cfg.model.decoder, info.tokenizer
        self.decoder = CaptionDecoder(
            vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
            n_layer=d.n_layer, n_embd=d.n_embd, n_head=d.n_head, dropout=d.dropout,
            max_positions=d.max_positions, pretrained=d.pretrained,
        )
        self.tokens = bool(info.feature_shape) and info.feature_kind == "tokens"
        if self.tokens:
            # a token sequence is the memory as it is: the encoder has its own positions, so no learned ``pos``;
            # proj is VisionEncoderDecoderModel's enc_to_dec_proj rule (Identity at equal widths, else a Linear)
            width = info.feature_channels
            self.proj = nn.Identity() if width == self.decoder.width else nn.Linear(width, self.decoder.width)
        else:  # a map (B, C, h, w): one token per cell, projected, plus a learned position per cell
            h, w = info.feature_hw
            self.proj = nn.Linear(info.feature_channels, self.decoder.width)
            self.pos = nn.Parameter(torch.zeros(h * w, self.decoder.width))
            nn.init.normal_(self.pos, std=0.02)
        self.tokenizer = tok
        options = self.options_from(info.cfg)
        self.max_new_tokens = int(options.max_tokens)
        self.num_beams = int(options.num_beams)

    def shard_units(self):
        # one FSDP2 unit per transformer block; the embeddings (wte tied to the LM head), the final norm, the LM
        # head and the memory projection stay in the head's own unit
        return [(f"decoder.{name}", block) for name, block in self.decoder.blocks()]

    def memory(self, features: torch.Tensor) -> torch.Tensor:
        """The cross-attention memory (B, N, width). A map (B, C, h, w): one token per cell (N = h*w), projected, plus
        its learned position. Tokens (B, N, C): projected (or as they are at the decoder's width)."""
        if self.tokens:
            return self.proj(features)
        x = features.flatten(2).transpose(1, 2)
        return self.proj(x) + self.pos

    def prepare(self, batch, reduce_sum):
        # The caption loss is the mean over the GLOBAL batch's tokens. DDP averages gradients over
        # ranks, so each rank's loss is its token-NLL sum * world / global token count.
        local = torch.stack([(batch["target_ids"] != IGNORE_INDEX).sum(), torch.ones((), dtype=torch.long,
                                                                         device=batch["target_ids"].device)])
        batch["gen_tokens_global"], batch["gen_world"] = reduce_sum(local.to(torch.float64)).unbind()

    def token_nll_sum(self, features, batch) -> torch.Tensor:
        logits = self.decoder(batch["input_ids"], batch["attention_mask"], self.memory(features))
        return F.cross_entropy(logits.float().flatten(0, 1), batch["target_ids"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def forward(self, features, batch):
        nll = self.token_nll_sum(features, batch)
        if "gen_tokens_global" not in batch:  # used outside the trainer: a plain local mean
            return nll / (batch["target_ids"] != IGNORE_INDEX).sum().clamp(min=1)
        scale = batch["gen_world"] / batch["gen_tokens_global"].clamp(min=1)
        return nll * scale.to(nll.dtype)

    @torch.no_grad()
    def predict(self, features, num_beams: int = 1, **options):
        ids = self.decoder.generate(self.memory(features), self.max_new_tokens, num_beams)
        return [{"caption": self.tokenizer.decode(seq)} for seq in ids]

    @torch.no_grad()
    def eval_batch(self, features, batch):
        nll = float(self.token_nll_sum(features, batch))
        tokens = int((batch["target_ids"] != IGNORE_INDEX).sum())
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
        bleu, order = corpus_bleu4(hyps, streams)
        by_index = sorted(range(len(index)), key=index.__getitem__)
        return {
            "bleu4": bleu, "bleu4_order": order,
            "chrf": sacrebleu.corpus_chrf(hyps, streams).score / 100.0,
            "exact": sum(h in r for h, r in zip(hyps, refs)) / max(1, len(hyps)),
            "loss": nll / tokens,
            "ppl": math.exp(min(50.0, nll / tokens)),
            "samples": [(index[i], hyps[i], refs[i][0]) for i in by_index],
        }
