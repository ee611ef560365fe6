"""LoRA (``model.peft``) against full fine-tuning on configs/vit_gpt2.yaml's sizes: ``python -m mtl.tools.bench.peft``.

    python scripts/make_tiny_pretrained.py      # runs/pretrained/{vit,gpt2}: the folders configs/vit_gpt2.yaml reads
    python -m mtl.tools.bench.peft [--pretrained runs/pretrained] [--steps 20] [--warmup 3] [--r 8]

Variants, each a ``Trainer.from_config(configs/vit_gpt2.yaml)`` (cls + gen, equal weighting, AdamW, one process):
``full`` (every weight trains, ``ddp.strategy=combined``), ``lora`` (one shared adapter on the ViT and the GPT-2,
``combined``) and ``lora per task`` (an adapter per task and a shared one on the ViT, ``accumulate``: K encoder
forwards). Columns:

- trainable / total parameters;
- step: the median of ``--steps`` timed ``Trainer.step_once`` calls on one batch, after ``--warmup``; the variants
  step in turn (full, lora, lora per task, full, ...), so that a load on the machine falls on each alike;
- peak memory: ``mtl.bench.step_memory`` (CPU: the parameters, gradients and optimizer state held at the step's start
  plus the peak of the step's allocations net of frees, from torch.profiler);
- checkpoint: the bytes of one checkpoint folder (model.safetensors, the sharded state/ with the optimizer, the rest),
  and with ``checkpoint.trainable_only`` (adapters and heads alone);
- gradient-method cost (``weighting.source=parameters``, the K backward passes of task_grads): one encoder forward,
  then K ``autograd.grad`` passes into the trainable encoder parameters (a random cotangent each), the K x P rows
  stacked and their Gram matrix; the median time and the K x P buffer's bytes, for K = 2 and K = 11. Per-task adapters
  take no part (they need a forward per task, which the parameters source does not give).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

from mtl.bench.step_memory import held_bytes, step_peak_bytes

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "vit_gpt2.yaml")
LORA = ["model.peft.method=lora", "model.peft.alpha=16"]
VARIANTS = {"full": ["ddp.strategy=combined"], "lora": [*LORA, "ddp.strategy=combined"],
            "lora per task": [*LORA, "model.peft.per_task=true", "model.peft.shared=true", "ddp.strategy=accumulate"]}


def _trainer(args, out: str, extra: list[str]):
    from mtl.run.trainer import Trainer  # import here: --help answers without loading the trainer

    p = args.pretrained
    return Trainer.from_config(CONFIG, [f"output_dir={out}", f"model.backbone.pretrained={p}/vit",
                                        f"model.decoder.pretrained={p}/gpt2", f"tokenizer.path={p}/gpt2",
                                        "trainer.progress=false", "trainer.num_samples=0", "optim.warmup_steps=0",
                                        "model.decoder.dropout=0.0", f"model.peft.r={args.r}", "checkpoint.every_steps=0",
                                        f"trainer.max_steps={args.steps + args.warmup + 5}", *extra])


def _step(trainer, batch: dict):
    return trainer.step_once(dict(batch))


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _grad_cost(trainer, batch, k: int, rounds: int = 5) -> tuple[float, int]:
    """(median seconds, K x P bytes) of K backward passes into the trainable encoder parameters and their Gram."""
    backbone = trainer.bare.backbone
    shared = [p for p in backbone.parameters() if p.requires_grad]
    times = []
    for _ in range(rounds):
        tic = time.perf_counter()
        feats = backbone(batch["image"])
        rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            feats, shared, torch.randn_like(feats), retain_graph=i < k - 1)]) for i in range(k)])
        (rows @ rows.T).sum().item()
        times.append(time.perf_counter() - tic)
    return statistics.median(times), rows.numel() * rows.element_size()


def measure(args, out: str) -> list[dict]:
    """Every variant's row; the variants built first and then timed in turn, step by step (and the gradient cost
    round by round), so that a load on the machine falls on each alike."""
    trainers = {name: _trainer(args, os.path.join(out, name.replace(" ", "_")), extra)
                for name, extra in VARIANTS.items()}
    try:
        batches = {n: next(t.batches())[1] for n, t in trainers.items()}
        steps = {n: functools.partial(_step, t) for n, t in trainers.items()}
        times = {n: [] for n in trainers}
        for i in range(args.warmup + args.steps):
            for n in trainers:
                tic = time.perf_counter()
                steps[n](batches[n])
                if i >= args.warmup:
                    times[n].append(time.perf_counter() - tic)
        grads = {(n, k): [] for n, t in trainers.items() if t.bare.adapters is None for k in (2, 11)}
        for _ in range(args.steps):
            for n, k in grads:
                grads[n, k].append(_grad_cost(trainers[n], batches[n], k, rounds=1))
        rows = []
        for n, t in trainers.items():
            params = list(t.bare.parameters())
            row = {"variant": n, "trainable": sum(p.numel() for p in params if p.requires_grad),
                   "total": sum(p.numel() for p in params), "step_ms": 1e3 * statistics.median(times[n]),
                   "peak": step_peak_bytes(steps[n], batches[n], lambda t=t: held_bytes([t.bare], t.optimizer))}
            row["ckpt"] = _folder_bytes(t.folder.save(t.step, t.parts, t.feed)[0])
            if n != "full":
                t.cfg.checkpoint.trainable_only = True
                row["ckpt_trainable"] = _folder_bytes(t.folder._write(t.step + 1, t.parts, t.feed, 0, 0))
            for k in (2, 11):
                if (n, k) in grads:
                    row[f"grad{k}"] = (statistics.median(s for s, _ in grads[n, k]), grads[n, k][0][1])
            rows.append(row)
        return rows
    finally:
        for t in trainers.values():
            t.close()


def table(rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    lines = ["| variant | trainable / total | step | peak memory | checkpoint | trainable_only | grad cost K=2 | "
             "grad cost K=11 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        grads = [f"{1e3 * r[f'grad{k}'][0]:.1f} ms, {mib(r[f'grad{k}'][1])}" if f"grad{k}" in r else "n/a (per task)"
                 for k in (2, 11)]
        lines.append(f"| {r['variant']} | {r['trainable']:,} / {r['total']:,} | {r['step_ms']:.1f} ms | "
                     f"{mib(r['peak'])} | {mib(r['ckpt'])} | {mib(r['ckpt_trainable']) if 'ckpt_trainable' in r else '-'}"
                     f" | {' | '.join(grads)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pretrained", default="runs/pretrained", help="the folder scripts/make_tiny_pretrained.py wrote")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--r", type=int, default=8, help="the LoRA rank")
    args = ap.parse_args(argv)
    if not all(os.path.isdir(os.path.join(args.pretrained, n)) for n in ("vit", "gpt2")):
        print(f"error: --pretrained: {args.pretrained!r} lacks vit/ and gpt2/; run python scripts/make_tiny_pretrained.py"
              " (or point --pretrained at such folders)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        rows = measure(args, out)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
