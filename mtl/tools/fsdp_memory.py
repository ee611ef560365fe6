"""Per-rank memory of the training state under DDP and FSDP2: parameters, gradients, optimizer state, task gradients.

    torchrun --nproc_per_node=2 -m mtl.tools.fsdp_memory --config configs/default.yaml [key=value ...]

Builds the run once per engine (``ddp.engine=ddp``, then ``fsdp2``) in the same process group, takes two
optimizer steps (so that the optimizer state exists), and sums the bytes of the tensors each rank holds:
its parameters (under FSDP2 its DTensor shards, ``to_local()``), their gradients, and the optimizer's state.
Under FSDP2 a unit's full parameters also exist for a moment, while it runs forward or backward: the
largest unit's full size is printed too. With ``ddp.strategy=task_grads`` (gradient-level weighting) the
K x P matrix of the tasks' gradients that the strategy keeps between steps is counted apart: under FSDP2 each
rank keeps K x P / W (its shard of every row). Rank 0 prints a Markdown table (docs/fsdp.md).
"""

from __future__ import annotations

import argparse
import sys


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def measure(config: str, overrides: list[str], engine: str) -> dict:
    from mtl.fsdp import shard_units
    from mtl.trainer import Trainer

    trainer = Trainer.from_config(config, [*overrides, f"ddp.engine={engine}", "trainer.progress=false",
                                           "overwrite=true"])
    trainer.bare.train()
    for _ in range(2):
        trainer.step_once()
    params = list(trainer.bare.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    units = shard_units(trainer.bare)
    full = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in units}
    task_rows = getattr(trainer.parts.strategy, "_buf", None)  # task_grads: [K losses, K x P (or K x P / W)]
    out = {"params": _bytes(params), "grads": _bytes(p.grad for p in params), "optimizer": _bytes(state),
           "task_grads": _bytes([task_rows]),
           "largest_unit": max(full.values()), "largest_unit_name": max(full, key=full.get),
           "numel": sum(p.numel() for p in params)}
    trainer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from mtl import dist

    rows = {e: measure(args.config, list(args.overrides), e) for e in ("ddp", "fsdp2")}
    gathered = dist.all_gather_objects(rows)
    if _is_main():
        mib = 2 ** 20
        world = len(gathered)
        print(f"{rows['ddp']['numel']:,} parameters, {world} ranks; MiB per rank (max over ranks):")
        print("| engine | parameters | gradients | optimizer state | task-gradient matrix | total |")
        print("|---|---|---|---|---|---|")
        for e in ("ddp", "fsdp2"):
            vals = [max(g[e][k] for g in gathered) / mib for k in ("params", "grads", "optimizer", "task_grads")]
            print(f"| {e} | {vals[0]:.2f} | {vals[1]:.2f} | {vals[2]:.2f} | {vals[3]:.2f} | {sum(vals):.2f} |")
        f = rows["fsdp2"]
        print(f"FSDP2 also holds one unit's full parameters while it runs: the largest, "
              f"{f['largest_unit_name']}, is {f['largest_unit'] / mib:.2f} MiB")
    dist.destroy()
    return 0


def _is_main() -> bool:
    import torch.distributed as d

    return not d.is_initialized() or d.get_rank() == 0


if __name__ == "__main__":
    sys.exit(main())
