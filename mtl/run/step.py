"""One optimizer step, top to bottom: the function to read first.

``train_step(parts, batch, step, stop_requested, heldout) -> StepResult`` reads nothing but its arguments:

0. a bilevel weighting method's meta update, at the steps it asks for a held-out batch (mtl/weighting/bilevel.py);
1. forward and one backward pass per task, through the strategy (mtl/strategies/), which leaves the
   rank-averaged gradient of the weighted objective in ``.grad``;
2. unscale (fp16 scaled each task's loss);
3. the finite check, the same decision on every rank;
4. clip;
5. ``optimizer.step()``, then the weights' check (a NaN/inf or blown-up weight is a bad step that ends the run);
6. ``scheduler.step()``;
7. free the gradients (zero them under DDP: :class:`Gradients`).

Everything after step 1 is the same for every strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.checkpoint.finite import params_finite
from mtl.data.multi_input import task_rows
from mtl.parallel.amp import Amp
from mtl.parallel.dist import Comm, all_reduce_mean, all_reduce_sum, average_grads
from mtl.parallel.fsdp import clip_ as clip_grads_
from mtl.parallel.fsdp import grad_norm as total_grad_norm
from mtl.parallel.fsdp import is_sharded
from mtl.strategies import StepInputs, Strategy
from mtl.weighting.bilevel import MetaInputs, add_to_grads_


@dataclass
class StepParts:
    """Everything a step touches, built once per run (``Trainer.parts``)."""

    model: torch.nn.Module  # what the strategy runs: the DDP wrapper when distributed, else ``bare``
    bare: torch.nn.Module  # the MultiTaskModel itself (its heads, its BatchNorm buffers)
    tasks: list[str]
    strategy: Strategy
    weighting: torch.nn.Module  # a mtl.weighting.Weighting
    optimizer: torch.optim.Optimizer
    scheduler: object  # a torch LR scheduler
    amp: Amp
    params: list[torch.nn.Parameter]  # everything the optimizer updates (model and learned loss weights)
    grad_clip: float  # 0: no clipping
    comm: Comm = field(default_factory=Comm)  # the strategy's hand-made collectives (tools count them)
    running_stats: RunningStats = field(init=False)  # ``bare``'s BatchNorm buffers, found once
    grads: Gradients = field(init=False)  # step 7's choice: free the gradients, or zero them (DDP)

    def __post_init__(self):
        self.running_stats = RunningStats(self.bare)
        self.grads = Gradients(self.model, self.params)


@dataclass
class StepResult:
    losses: dict  # task -> loss averaged over ranks (NaN/inf where a rank's loss was)
    grad_norm: float  # global norm of the (unscaled, unclipped) gradient
    stepped: bool  # False: skipped on every rank (non-finite, or an fp16 overflow)
    nonfinite: bool  # a NaN/inf loss or gradient (not an fp16 overflow)
    stop_agreed: bool  # some rank asked to stop (SIGTERM/SIGUSR1/SIGINT): every rank saves and exits now
    stats: dict = field(default_factory=dict)
    weights_nonfinite: bool = False  # the optimizer step made a parameter NaN/inf or blew it up (the run cannot go on)
    # task -> the weight this step used (the method's ``step_weights()`` right after its backward passes, before
    # ``end_step``, the optimizer step or a Gram method's own update move it for the next step); None: not taken
    # (``log_stats`` False)
    weights: dict | None = None


def train_step(p: StepParts, batch: dict, step: int, stop_requested: bool = False,
               heldout: dict | None = None, log_stats: bool = True) -> StepResult:
    """One optimizer step on ``batch`` (on the device); ``step`` is the number of steps taken before it.
    ``heldout``: a bilevel method's held-out batch, at the steps it asks for one (``wants_heldout``). ``log_stats``:
    the strategy's per-task gradient norms and cosines in ``StepResult.stats`` and the weights the step used in
    ``StepResult.weights`` (the trainer asks for them on the steps its log writes); the step itself is the same
    either way."""
    w = p.weighting
    rows = task_rows(batch)  # which rows each task reads (multi-input: the tasks present, each its own rows)
    tasks = rows.present(p.tasks)  # the same on every rank
    w.begin_step(step, tasks)  # the method weighs / combines these tasks only (mtl/weighting/base.py)
    for t in tasks:  # collectives a loss needs first, e.g. the global caption-token count
        p.bare.heads[t].prepare(rows.sub_batch(batch, t), all_reduce_sum)
    p.running_stats.save()  # the forward updates BatchNorm's statistics; a skipped step puts them back

    # 0. bilevel methods: the meta update of the task weights, on the bare model (never through DDP; no .grad)
    meta_stats = {}
    if heldout is not None:
        for t in tasks:
            p.bare.heads[t].prepare(heldout, all_reduce_sum)
        meta_stats = w.meta_step(MetaInputs(model=p.bare, batch=batch, heldout=heldout, tasks=tasks,
                                            lr=p.scheduler.get_last_lr()[0], comm=p.comm))
        p.running_stats.restore()  # its forwards must not move BatchNorm's statistics

    # 1. forward, and one backward pass per task: .grad = the rank-averaged gradient of the weighted objective;
    #    grad_hooks: a gradient-level method's combine (and its Gram / FSDP2-shard forms)
    losses, stats = p.strategy.forward_backward(StepInputs(
        model=p.model, batch=batch, tasks=tasks, weigh=w.weigh, scale=p.amp.scale, loss_scale=p.amp.loss_scale,
        comm=p.comm, log_stats=log_stats, **w.grad_hooks()))
    p.grads.refill()  # a zero gradient where step 7 freed one and no pass wrote one (an absent task's head)
    average_grads(list(w.parameters()))  # learned loss weights (e.g. uw) live outside DDP
    # the weights the losses were just weighed (or the gradients combined) with: what the step's record logs
    used_weights = w.step_weights() if log_stats else None

    # 2. unscale, once for all the tasks' scaled backward passes (fp16; nothing otherwise)
    p.amp.unscale_(p.optimizer)
    extra = w.meta_gradient() if heldout is not None else None  # FORUM: its held-out term of the model's update
    if extra is not None:
        add_to_grads_(p.bare, extra)

    # 3. the finite check. DDP has averaged the gradients (FSDP2: the norm is taken over every rank's shard), so
    #    their norm is the same on every rank; the losses
    #    are averaged in one collective that also carries "does any rank want to stop". A NaN anywhere (any
    #    task, any rank) therefore makes every rank skip together.
    grad_norm = total_grad_norm([q.grad for q in p.params if q.grad is not None])  # over every rank's shard (FSDP2)
    loss_avg, stop_agreed = average_losses_and_stop(losses, tasks, stop_requested, grad_norm.device)
    grads_ok, losses_ok = bool(torch.isfinite(grad_norm)), bool(torch.isfinite(loss_avg).all())
    ok = grads_ok and losses_ok

    # 4. clip
    if ok and p.grad_clip > 0:
        clip_grads_(p.params, p.grad_clip, grad_norm)

    # 5. the optimizer step and 6. the schedule: on every rank, or on none
    weights_ok = True
    if ok:
        p.optimizer.step()
        weights_ok = params_finite(p.params, is_sharded(p.bare))  # finite gradients can still blow the weights up
        p.scheduler.step()
    else:
        p.running_stats.restore()
    p.amp.update()  # fp16: back the loss scale off after an overflow, grow it after a run of good steps

    # 7. free the gradients, so the next forward (the step's memory peak) runs without them; under DDP zero them
    #    instead: they are views of its buckets (gradient_as_bucket_view), freeing them saves nothing
    p.grads.release(p.optimizer)

    loss_values = dict(zip(tasks, loss_avg.tolist()))
    if ok:
        w.end_step(loss_values)
    overflow = p.amp.scaler is not None and losses_ok and not grads_ok  # the GradScaler's business, not a bad step
    gn = float(grad_norm)
    return StepResult(losses=loss_values, grad_norm=gn if math.isfinite(gn) else float("nan"), stepped=ok,
                      nonfinite=(not ok and not overflow) or not weights_ok, stop_agreed=stop_agreed,
                      stats={**meta_stats, **stats}, weights_nonfinite=not weights_ok, weights=used_weights)


def average_losses_and_stop(losses: dict, tasks: list[str], stop_requested: bool,
                            device: torch.device) -> tuple[torch.Tensor, bool]:
    """(the losses averaged over ranks, whether any rank asked to stop), in one collective."""
    stop = torch.tensor([float(stop_requested)], device=device)
    reduced = all_reduce_mean(torch.cat([torch.stack([losses[t].float() for t in tasks]).to(device), stop]))
    return reduced[:-1], bool(reduced[-1] > 0)


class Gradients:
    """Step 7: free the gradients between steps (``set_to_none``) where no DDP bucket views back them: one process,
    and FSDP2 (its sharded gradients are views of a reduce-scatter output it allocates anew for a parameter without
    one, so freeing them frees that output). Under DDP: zero them and keep them.

    Freeing must not change a result. Zeroed and kept, a parameter that once had a gradient has a zero one in a
    step no backward pass reaches it (an absent task's head in multi-input mode), and AdamW updates it (weight decay,
    the moments' decay); with no gradient AdamW would skip it. So ``refill``, right after the backward passes and
    before anything reads ``.grad``, gives every such parameter a zero gradient again: the methods, clipping and the
    optimizer see what they see with the gradients zeroed, bit for bit (tests/test_freed_grads.py). A parameter that
    never had one stays without, as it does when zeroed (``zero_grad`` leaves a missing gradient missing)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter]):
        self.free = not isinstance(model, DistributedDataParallel)
        self.had: list[torch.nn.Parameter] = []  # the parameters that have had a gradient in this process
        self.never = list(params)  # the others

    def refill(self) -> None:
        if self.free:
            for q in self.had:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        if self.never:  # empty once every parameter has had a gradient: nothing to do per step then
            self.had += [q for q in self.never if q.grad is not None]
            self.never = [q for q in self.never if q.grad is None]
        optimizer.zero_grad(set_to_none=self.free)


def running_stat_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every running-stat buffer (BatchNorm's mean, var and count); empty without any."""
    return [b for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
            for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


class RunningStats:
    """A model's running-stat buffers, found once (a module walk each step costs more than the copies), and a
    copy of them kept in tensors allocated once.

    A forward in training mode updates these buffers before anyone knows whether the step is good:
    one NaN input would otherwise poison them for good although the optimizer step is skipped. Loading a
    checkpoint copies into the same buffers, so the list found at the start stays theirs.
    """

    def __init__(self, model: torch.nn.Module):
        self.buffers = running_stat_buffers(model)
        self.saved = [b.detach().clone() for b in self.buffers]

    @torch.no_grad()
    def save(self) -> None:
        for saved, buf in zip(self.saved, self.buffers):
            saved.copy_(buf)

    @torch.no_grad()
    def restore(self) -> None:
        for buf, saved in zip(self.buffers, self.saved):
            buf.copy_(saved)


def snapshot_running_stats(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, copy) for every running-stat buffer, for a one-off check (:class:`RunningStats` in a step)."""
    return [(b, b.detach().clone()) for b in running_stat_buffers(model)]


@torch.no_grad()
def restore_running_stats(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buf, saved in snapshot:
        buf.copy_(saved)
