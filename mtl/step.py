"""One optimizer step: the strategy's backward passes, then clip, step, schedule, zero.

This is the function to read first. The strategy (mtl/strategies/) runs one backward pass per task
and leaves the rank-averaged gradient of the weighted objective in ``.grad``; everything after that
is the same for every strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mtl.dist import all_reduce_mean, all_reduce_sum, average_grads
from mtl.strategies import StepInputs


@dataclass
class StepResult:
    losses: dict  # task -> loss averaged over ranks (NaN/inf where a rank's loss was)
    grad_norm: float  # global norm of the (unscaled, unclipped) gradient
    stepped: bool  # False: skipped (non-finite, or an fp16 overflow)
    nonfinite: bool  # a NaN/inf loss or gradient (not an fp16 overflow)
    stats: dict = field(default_factory=dict)


def train_step(run, batch: dict) -> StepResult:
    """``run`` holds model, strategy, weighting, optimizer, scheduler, amp, comm, tasks (see Trainer)."""
    run.weighting.begin_step(run.step)
    for head in run.heads.values():
        head.prepare(batch, all_reduce_sum)  # e.g. the global caption-token count

    w = run.weighting
    poison(batch, run.cfg.trainer.poison, run.step + 1, run.dist.rank)
    stats_before = snapshot_running_stats(run.bare)  # the forward updates them; a skipped step puts them back
    losses, stats = run.strategy.forward_backward(StepInputs(
        model=run.model, batch=batch, tasks=run.tasks, weigh=w.weigh, scale=run.amp.scale,
        combine=w.combine if w.level == "grad" else None, loss_scale=run.amp.loss_scale, comm=run.comm))
    average_grads(list(w.parameters()))  # learned loss weights (e.g. uw) live outside DDP

    run.amp.unscale_(run.optimizer)
    grads = [p.grad for p in run.params if p.grad is not None]
    # DDP has already averaged the gradients, so this norm is the same on every rank: a NaN or inf
    # anywhere (any task, any rank) makes every rank skip the step together.
    grad_norm = torch.nn.utils.get_total_norm(grads)
    # one collective for the rank-averaged losses and "does any rank want to stop" (SIGTERM/SIGUSR1)
    stop = torch.tensor([float(run.stop_requested)], device=grad_norm.device)
    reduced = all_reduce_mean(torch.cat([torch.stack([losses[t].float() for t in run.tasks]).to(stop.device), stop]))
    loss_avg, run.stop_agreed = reduced[:-1], bool(reduced[-1] > 0)
    grad_finite, loss_finite = bool(torch.isfinite(grad_norm)), bool(torch.isfinite(loss_avg).all())
    if grad_finite and run.cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(run.params, run.cfg.optim.grad_clip, grad_norm)
    stepped, nonfinite = run.amp.step(run.optimizer, loss_finite, grad_finite)
    if stepped:
        run.scheduler.step()
    else:
        restore_running_stats(stats_before)
    run.optimizer.zero_grad(set_to_none=False)  # keeps DDP's bucket views (gradient_as_bucket_view)
    loss_values = dict(zip(run.tasks, loss_avg.tolist()))
    if stepped:
        run.weighting.end_step(loss_values)
    gn = float(grad_norm)
    return StepResult(losses=loss_values, grad_norm=gn if math.isfinite(gn) else float("nan"), stepped=stepped,
                      nonfinite=nonfinite, stats=stats)


def snapshot_running_stats(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) for every running-stat buffer (BatchNorm's mean, var and count); empty without any.

    A forward in training mode updates these buffers before anyone knows whether the step is good:
    one NaN input would otherwise poison them for good although the optimizer step is skipped.
    """
    out = []
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            out += [(b, b.detach().clone()) for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                    if b is not None]
    return out


@torch.no_grad()
def restore_running_stats(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buf, saved in snapshot:
        buf.copy_(saved)


def poison(batch: dict, spec: str | None, step: int, rank: int) -> None:
    """``trainer.poison = "STEP:TASK:RANK"``: that task's loss is NaN at that step on that rank (testing).

    TASK ``crash`` makes that rank raise instead. The model multiplies the named task's loss by NaN.
    """
    if not spec:
        return
    at, task, who = spec.split(":")
    if int(at) != step or who not in ("*", str(rank)):
        return
    if task == "crash":  # a rank that dies mid-step: the others must not hang
        raise RuntimeError(f"trainer.poison: rank {rank} crashes at step {step} (testing)")
    batch["poison"] = task
