"""One training step of mtl on a ViT + GPT-2 (classification + captioning) against a plain transformers training
loop on the same ``VisionEncoderDecoderModel``: ``python -m mtl.tools.bench.ved_step``.

    python -m mtl.tools.bench.ved_step [--hidden 192] [--layers 6] [--decoder-layers 4] [--image 64] [--batch 16]
                                       [--steps 15] [--warmup 2] [--no-compile]

mtl: ``Trainer.from_config(configs/vit_gpt2.yaml)`` with an ``hf_vision`` ViT (random weights of the given size,
``model.backbone.config``), its GPT-2 caption head, tasks cls + gen, ``weighting.method: equal``,
``ddp.strategy: combined`` (one process: one forward, one backward), AdamW, ``optim.grad_clip: 1.0``; the step is
``Trainer.step_once(batch)`` (everything a training step does: the finite checks, the clipping, the scheduler).
plain: the same weights exported as a ``VisionEncoderDecoderModel`` (``to_vision_encoder_decoder``), its forward on
the same batch (``pixel_values``, ``decoder_input_ids``, ``decoder_attention_mask``), the caption cross-entropy plus
the classification loss of a copy of mtl's classification head on the encoder's last hidden state, ``backward``,
``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` (same lr and weight decay), ``zero_grad``. The batch is taken once
before timing, so neither side loads data.

Time: the variants (mtl, plain, mtl with ``model.activation_checkpointing``, mtl with ``model.compile``) step in
turn, ``--warmup`` steps each then ``--steps`` timed rounds, in one process; the table gives each one's median step
and its ratio to plain (to mtl for the checkpointing and compile rows), and the compile row its first step (the
compilation). Peak memory, on CPU: after the timed rounds, one more step of each variant under ``torch.profiler``
(``profile_memory=True``); the peak is the bytes held when the step starts (parameters, the gradients a side keeps
between steps, the optimizer state: summed from the tensors) plus the highest running sum of the step's allocations
and frees (each profiled op's own memory, in time order). CPU only (on CUDA ``torch.cuda.max_memory_allocated``
would be the measure; not implemented here).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from mtl.bench.step_memory import held_bytes, step_peak_bytes
from mtl.models.vision_encoder_decoder import to_vision_encoder_decoder
from mtl.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = os.path.join(ROOT, "configs", "vit_gpt2.yaml")
VARIANTS = {"mtl": [], "plain": [], "mtl+ckpt": ["model.activation_checkpointing=true"],
            "mtl+compile": ["model.compile=true"]}


def write_vit(out: str, hidden: int, layers: int, image: int) -> str:
    """A ViT config folder (config.json and image processor) of the given size; weights are drawn at build."""
    from transformers import ViTConfig, ViTImageProcessor

    heads = max(1, hidden // 64)
    ViTConfig(image_size=image, patch_size=8, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
              ).save_pretrained(out)
    ViTImageProcessor(size={"height": image, "width": image}, image_mean=[0.5] * 3,
                      image_std=[0.5] * 3).save_pretrained(out)
    return out


def overrides(args, vit: str, out: str) -> list[str]:
    return [f"output_dir={out}", "model.backbone.pretrained=null", f"model.backbone.config={vit}",
            "model.decoder.pretrained=null", "tokenizer.path=null", f"model.decoder.n_embd={args.hidden}",
            f"model.decoder.n_layer={args.decoder_layers}", f"model.decoder.n_head={max(1, args.hidden // 64)}",
            "model.decoder.max_positions=32", f"data.batch_size={args.batch}", f"data.image_size={args.image}",
            "ddp.strategy=combined", "weighting.method=equal", "optim.name=adamw", "optim.grad_clip=1.0",
            "optim.warmup_steps=0", "trainer.progress=false", "trainer.num_samples=0", "checkpoint.every_steps=0",
            "data.num_workers=0", "tasks=[cls,gen]"]


class Plain:
    """The transformers loop: a VisionEncoderDecoderModel and a classification head on its encoder's tokens."""

    def __init__(self, trainer):
        bare = trainer.bare
        self.ved, _ = to_vision_encoder_decoder(bare.backbone, bare.heads["gen"])
        self.ved.train()
        self.cls = copy.deepcopy(bare.heads["cls"]).train()
        params = [p for p in [*self.ved.parameters(), *self.cls.parameters()] if p.requires_grad]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=trainer.cfg.optim.lr, weight_decay=trainer.cfg.optim.weight_decay)

    def step(self, batch):
        out = self.ved(pixel_values=batch["image"], decoder_input_ids=batch["input_ids"],
                       decoder_attention_mask=batch["attention_mask"])
        gen = F.cross_entropy(out.logits.float().flatten(0, 1), batch["target_ids"].flatten(), ignore_index=-100)
        cls = F.cross_entropy(self.cls.logits(out.encoder_last_hidden_state).float(), batch["label"])
        (cls + gen).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def build(args, variant: str, vit: str, out: str):
    """(a step function of ``batch``, the batch) for one variant."""
    extra = VARIANTS[variant]
    torch.manual_seed(0)
    trainer = Trainer.from_config(CONFIG, [*overrides(args, vit, os.path.join(out, variant)), *extra])
    trainer.bare.train()
    batch = trainer.feed.on_device(trainer.feed.take(0)[1])
    if variant == "plain":
        plain = Plain(trainer)
        return plain.step, batch, lambda: held_bytes([plain.ved, plain.cls], plain.opt)
    return (lambda b: trainer.step_once(dict(b))), batch, lambda: held_bytes([trainer.bare], trainer.optimizer)


def measure(args, variants) -> tuple[dict, dict, dict]:
    """Median seconds per step of each variant, stepped in turn; each variant's first step; its peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        vit = write_vit(os.path.join(tmp, "vit"), args.hidden, args.layers, args.image)
        built = {v: build(args, v, vit, tmp) for v in variants}
        times, first = {v: [] for v in variants}, {}
        for r in range(args.warmup + args.steps):
            for v, (step, batch, _) in built.items():
                tic = time.perf_counter()
                step(batch)
                dt = time.perf_counter() - tic
                if r == 0:
                    first[v] = dt
                if r >= args.warmup:
                    times[v].append(dt)
        mem = {} if args.no_memory else {v: step_peak_bytes(*b) for v, b in built.items()}
    return {v: statistics.median(t) for v, t in times.items()}, first, mem


def table(args, med: dict, first: dict, mem: dict) -> str:
    mib = 2 ** 20
    rows = [f"ViT {args.layers} x {args.hidden} ({args.image} px, patch 8) + GPT-2 {args.decoder_layers} x {args.hidden}, "
            f"batch {args.batch}, AdamW, torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"median of {args.steps} alternated steps after {args.warmup}",
            "| variant | median step (ms) | time ratio | peak memory (MiB) | memory ratio |",
            "|---|---|---|---|---|"]

    def row(v, base, label):
        t = f"{med[v] / med[base]:.3f}x {label}" if v != base else "1"
        m = (f"{mem[v] / mib:.1f}", f"{mem[v] / mem[base]:.3f}x {label}" if v != base else "1") if v in mem else ("n/a", "n/a")
        return f"| {v} | {1000 * med[v]:.1f} | {t} | {m[0]} | {m[1]} |"

    rows.append(row("plain", "plain", ""))
    rows.append(row("mtl", "plain", "of plain"))
    if "mtl+ckpt" in med:
        rows.append(row("mtl+ckpt", "mtl", "of mtl"))
    if "mtl+compile" in med:
        rows.append(row("mtl+compile", "mtl", "of mtl") +
                    f" first step (compiles) {first['mtl+compile']:.1f} s; speed-up {med['mtl'] / med['mtl+compile']:.2f}x")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtl.tools.bench.ved_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--decoder-layers", type=int, default=4)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="leave out the model.compile row")
    p.add_argument("--no-memory", action="store_true", help="leave out the memory columns (no profiled step)")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    variants = [v for v in VARIANTS if not (args.no_compile and v == "mtl+compile")]
    med, first, mem = measure(args, variants)
    print(table(args, med, first, mem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
