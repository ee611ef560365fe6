"""Turning DDP's failure modes into messages: reduction errors, replica divergence, non-finite gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.data.loader import rng_untouched
from mtl.data.multi_input import step_tasks, task_rows
from mtl.errors import TrainingError
from mtl.parallel.dist import all_gather_objects
from mtl.parallel.gradient_reach import nonfinite_parameters, reach_table, task_gradients
from mtl.run.step import restore_running_stats, snapshot_running_stats

DDP_ERRORS = {
    "Expected to have finished reduction in the prior iteration": "a backward pass left some parameters without a "
    "gradient (per-task forwards, or no_sync, without find_unused_parameters), so DDP never finished that reduction "
    "and the gradients it left are rank-local. With no_sync the error only comes at the next step's forward, after "
    "the optimizer has stepped on them",
    "Expected to mark a variable ready only once": "one forward was followed by several backward passes through "
    "the same parameters",
    "Encountered gradient which is undefined, but still allreduced": "find_unused_parameters=True with several "
    "backward passes through one forward",
    "Your training graph has changed in this iteration": "static_graph=True with several backward passes",
}


def explain_ddp_error(error: RuntimeError, trainer, batch: dict) -> TrainingError | None:
    """A TrainingError naming, per task, the module groups that got no gradient, or None if not a DDP error."""
    text = str(error)
    cause = next((why for key, why in DDP_ERRORS.items() if key in text), None)
    if cause is None:
        return None
    cfg = trainer.cfg
    lines = [f"DDP error at step {trainer.step + 1} with ddp.strategy={cfg.ddp.strategy} "
             f"(find_unused_parameters={trainer.strategy.ddp_kwargs()['find_unused_parameters']}): {cause}.",
             f"  torch said: {text.splitlines()[0][:200]}"]
    tasks = task_rows(batch).present(trainer.tasks)
    try:
        table = reach_table(task_gradients(trainer.bare, batch, tasks), depth=2)
        for t, row in table.items():
            missing = sorted(g for g, s in row.items() if s == "none")
            lines.append(f"  task {t}: no gradient reaches {', '.join(missing) or '(every parameter is reached)'}")
        shared = sorted(g for g in next(iter(table.values())) if all(row[g] != "none" for row in table.values()))
        if shared:
            lines.append(f"  reached by every task (a backward pass per task marks them ready again): {', '.join(shared)}")
    except Exception as e:  # the explanation must never hide the original error
        lines.append(f"  (could not trace the per-task gradients: {e})")
    if getattr(trainer.feed, "plan", None) is not None and trainer.step > 0:  # multi-input
        lines += absent_task_lines(trainer)
        return TrainingError("\n".join(lines))
    lines.append("  fix: set ddp.strategy=feature_leaf (one shared forward, exact, one all-reduce), or "
                 "ddp.strategy=placeholder / find_unused for per-task forwards, and remove ddp.unsafe and any "
                 "ddp.find_unused_parameters / ddp.static_graph override (see docs/strategies.md)")
    return TrainingError("\n".join(lines))


def absent_task_lines(trainer) -> list[str]:
    """Multi-input: which tasks the previous step left out (every rank derives it from the seed and the step)."""
    cfg, prior = trainer.cfg, trainer.step - 1
    held = list(dict.fromkeys(step_tasks(trainer.feed.plan, prior, trainer.dist.world_size)))
    absent = [t for t in trainer.tasks if t not in held]
    return [f"  multi-input: step {prior + 1} (data.sampling.policy={cfg.data.sampling.policy}) held only task(s) "
            f"{', '.join(held)}: no gradient reached {', '.join(f'heads.{t}' for t in absent) or '(none)'} in that "
            "step, so DDP never finished its reduction",
            "  fix: set ddp.strategy=find_unused, accumulate, placeholder, feature_leaf or task_grads (they cope with a task absent from a "
            "step), or data.sampling.policy=all or mixed (every task in every step); remove ddp.unsafe "
            "(docs/multi-input.md)"]


def replicated(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for what every rank should hold an identical copy of. DDP: every parameter. FSDP2
    (DTensor parameters): each element of a sharded parameter lives on one rank only, so there is nothing to
    compare; what the ranks do replicate is compared instead: parameters that are not sharded (all-Replicate
    DTensors, or plain tensors) and the buffers, which FSDP2, unlike DDP, never synchronises."""
    from torch.distributed.tensor import DTensor, Replicate

    named = list(model.named_parameters())
    if not any(isinstance(p, DTensor) for _, p in named):
        return [(n, p.detach()) for n, p in named]
    out = [(n, p.to_local().detach() if isinstance(p, DTensor) else p.detach()) for n, p in named
           if not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements)]
    return out + [(n, b.detach()) for n, b in model.named_buffers() if b.is_floating_point()]


def parameter_checksums(model: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Two float64 numbers per parameter tensor (or per tensor of ``tensors``): its sum and its sum of squares."""
    params = [p.detach() for p in model.parameters()] if tensors is None else tensors
    sums = torch.stack([p.double().sum() for p in params])
    norms = torch.stack(torch._foreach_norm([p.double() for p in params]))
    return torch.cat([sums, norms])


def verify_replicas(model: torch.nn.Module, step: int) -> None:
    """Fail loudly, naming the first diverging parameter, if the ranks' parameters are not identical
    (under FSDP2: the tensors the ranks replicate, see ``replicated``)."""
    named = replicated(model)
    if not named:  # FSDP2 with every parameter sharded and no buffer: the same (empty) list on every rank
        return
    local = parameter_checksums(model, [t for _, t in named])
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # one collective: the max and (minus) the min of each
    n = local.numel()
    spread = both[:n] + both[n:]  # max - min per checksum; exactly 0 when every rank agrees
    if bool((spread != 0).any()):
        names = [name for name, _ in named]
        first = int((spread.view(2, -1) != 0).any(0).nonzero()[0])
        raise TrainingError(
            f"replica check at step {step}: the ranks' parameters differ, first at {names[first]!r} "
            f"(checksum spread {float(spread[first]):.3g}). Gradients stopped being synchronised: check "
            "ddp.strategy and its flags (docs/strategies.md), or set ddp.replica_check_every=0 to turn the check off")


def locate_nonfinite(model, batch: dict, tasks: list[str]) -> str:
    """Per rank and task, the first parameter whose gradient is NaN/inf (recomputed on this rank's batch).

    Its extra forward passes draw dropout from no stream training uses and leave BatchNorm's running
    statistics as they were, so ``ddp.nan_monitor`` can change on resume.
    """
    stats = snapshot_running_stats(model)
    try:
        with rng_untouched():
            grads = task_gradients(model, batch, tasks)
        found = {t: nonfinite_parameters(g)[:1] for t, g in grads.items()}
    except Exception as e:
        found = {"?": [f"could not trace: {e}"]}
    finally:
        restore_running_stats(stats)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    reports = all_gather_objects((rank, found))
    lines = [f"  rank {r} task {t}: first non-finite gradient in {p[0]}" for r, f in reports for t, p in f.items() if p]
    return "\n".join(lines) or "  no task gives a non-finite gradient on its own batch (an overflow in the sum?)"
