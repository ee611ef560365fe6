"""Per-rank memory of the training state under DDP and FSDP2: parameters, gradients, optimizer state, task gradients.

    torchrun --nproc_per_node=2 -m mtl.tools.fsdp_memory --config configs/default.yaml [key=value ...]

Builds the run once per engine (``parallel.engine=ddp``, then ``fsdp2``) in the same process group, takes two
optimizer steps (so that the optimizer state exists), and sums the bytes of the tensors each rank holds:
its parameters (under FSDP2 its DTensor shards, ``to_local()``), their gradients, and the optimizer's state.
Under FSDP2 a unit's full parameters also exist for a moment, while it runs forward or backward: a third step
is watched (``mtl.parallel.fsdp.watch_gathered``: at every module's forward and backward, which units hold their full
parameters) and the peak is printed, over the step and while each head runs, for the sharding as built (the
caption decoder one unit per transformer block, ``TaskHead.shard_units``) and, for comparison, with each head
one unit. With ``ddp.strategy=task_grads`` (gradient-level weighting) the
K x P matrix of the tasks' gradients that the strategy keeps between steps is counted apart: under FSDP2 each
rank keeps K x P / W (its shard of every row). Rank 0 prints a Markdown table (docs/fsdp.md).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from mtl.parallel import dist, fsdp
from mtl.run.error_report import run_guarded
from mtl.run.trainer import Trainer


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def measure(config: str, overrides: list[str], engine: str, whole_heads: bool = False) -> dict:
    with _heads_as_one_unit() if whole_heads else contextlib.nullcontext():
        trainer = Trainer.from_config(config, [*overrides, f"parallel.engine={engine}", "trainer.progress=false",
                                               "overwrite=true"])
        trainer.bare.train()
        for _ in range(2):
            trainer.step_once()
        params = list(trainer.bare.parameters())
        state = [v for s in trainer.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
        units = fsdp.shard_units(trainer.bare)
        own = fsdp.gathered_now(trainer.bare, [*units, ("", trainer.bare)]) if engine == "ddp" else {}
        task_rows = getattr(trainer.parts.strategy, "_buf", None)  # task_grads: [K losses, K x P (or K x P / W)]
        # a step's gradients: one per trainable parameter (shard), of its size (freed between steps outside DDP)
        out = {"params": _bytes(params), "grads": _bytes(p for p in params if p.requires_grad), "optimizer": _bytes(state),
               "task_grads": _bytes([task_rows]), "units": [n for n, _ in units],
               "numel": sum(p.numel() for p in params)}
        if engine == "fsdp2":  # a third step, watched: the full parameters gathered at each module's passes
            with fsdp.watch_gathered(trainer.bare) as samples:
                trainer.step_once()
            out["peak"] = _peak(samples, "")
            out["peak_heads"] = {h: _peak(samples, f"heads.{h}.") for h in trainer.bare.heads}
        else:  # every unit's own parameters, to show which is largest
            out["largest_unit"] = max(own.values())
            out["largest_unit_name"] = max(own, key=own.get)
    trainer.close()
    return out


def _peak(samples, prefix: str) -> dict:
    """The most bytes of full parameters gathered at once, over the samples taken in the modules whose names start
    with ``prefix`` (all: ``""``), with the units gathered then and where."""
    best = {"bytes": 0, "units": [], "at": ""}
    for phase, name, units in samples:
        total = sum(units.values())
        if name.startswith(prefix) and total > best["bytes"]:
            best = {"bytes": total, "units": sorted(units), "at": f"{phase} of {name}"}
    return best


@contextlib.contextmanager
def _heads_as_one_unit():
    """FSDP2 as it was before heads declared units (``TaskHead.shard_units``): each head one unit, for comparison."""
    from unittest import mock

    full = fsdp.shard_units

    def whole(model):
        return [(n, m) for n, m in full(model) if not (n.startswith("heads.") and n.count(".") > 1)]

    with mock.patch.object(fsdp, "shard_units", whole):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    def go():  # a bad config, data or option: one message and its exit code, not a traceback
        rows = {e: measure(args.config, list(args.overrides), e) for e in ("ddp", "fsdp2")}
        rows["fsdp2, heads whole"] = measure(args.config, list(args.overrides), "fsdp2", whole_heads=True)
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
            d = rows["ddp"]
            print(f"The largest unit's own parameters: {d['largest_unit_name']}, {d['largest_unit'] / mib:.2f} MiB")
            print("FSDP2: full parameters gathered at once during a step (peak; sampled at every module's forward and "
                  "backward), MiB:")
            heads = list(rows["fsdp2"]["peak_heads"])
            print("| sharding | units | whole step | " + " | ".join(f"while heads.{h} runs" for h in heads) + " |")
            print("|---|---|---|" + "---|" * len(heads))
            for e in ("fsdp2", "fsdp2, heads whole"):
                r = rows[e]
                cells = [f"{max(g[e]['peak']['bytes'] for g in gathered) / mib:.2f}"]
                cells += [f"{max(g[e]['peak_heads'][h]['bytes'] for g in gathered) / mib:.2f}" for h in heads]
                print(f"| {e} | {len(r['units']) + 1} | " + " | ".join(cells) + " |")
            for e in ("fsdp2", "fsdp2, heads whole"):
                for where, p in [("step", rows[e]["peak"]), *[(f"heads.{h}", rows[e]["peak_heads"][h]) for h in heads]]:
                    print(f"  {e}, peak in {where}: {p['bytes'] / mib:.2f} MiB at the {p['at']}: {', '.join(p['units'])}")
        dist.destroy()

    return run_guarded(go)


def _is_main() -> bool:
    import torch.distributed as d

    return not d.is_initialized() or d.get_rank() == 0


if __name__ == "__main__":
    sys.exit(main())
