"""Every row of DDP-FACTS.md (two backward passes per step under DDP) as a test of our own.

A torch upgrade that changes any of these facts must fail here. The model is a tiny plain PyTorch module (not the
project's): a shared trunk, a classification head ("cls", 3 classes) and a generation head ("gen", Linear + Tanh,
MSE). All DDP patterns run inside ONE spawn of 2 gloo workers on the CPU (module-scoped fixture); each worker runs
every pattern in turn with a fresh DDP object and writes what it saw (gradients, all-reduce counts, or the error
text and the stage at which it was raised) to a file. The tests then compare against a single-process reference
computed here with plain autograd on the concatenated global batch.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mtl.parallel.dist import free_port

from .conftest import join_spawned

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]  # tests of torch itself: the slow tier

WORLD = 2
LOCAL_BATCH = 4
D_IN, D_HID, N_CLS, D_GEN = 4, 8, 3, 2
N_BATCHES = 3
TOL = 1e-6
SPAWN_DEADLINE_S = 120
SPARE_GROUPS = 3

MSG_FINISHED = "Expected to have finished reduction in the prior iteration before starting a new one"
MSG_READY_ONCE = "Expected to mark a variable ready only once"
MSG_GRAPH_CHANGED = "Your training graph has changed in this iteration"
MSG_UNDEFINED = "Encountered gradient which is undefined, but still allreduced by DDP reducer"
MSG_SECOND_TIME = "Trying to backward through the graph a second time"


# ----------------------------------------------------------------------------------------------------------------
# model, data, losses and the single-process reference
# ----------------------------------------------------------------------------------------------------------------
class TinyMTL(nn.Module):
    """Shared trunk + "cls" head + "gen" head. ``norm`` puts a BatchNorm/GroupNorm into the trunk."""

    def __init__(self, norm: str | None = None):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(D_IN, D_HID)]
        if norm == "bn":
            layers.append(nn.BatchNorm1d(D_HID))
        elif norm == "gn":
            layers.append(nn.GroupNorm(2, D_HID))
        layers.append(nn.Tanh())
        self.trunk = nn.Sequential(*layers)
        self.cls = nn.Linear(D_HID, N_CLS)
        self.gen = nn.Sequential(nn.Linear(D_HID, D_GEN), nn.Tanh())

    def forward(self, x, task: str = "both"):
        f = self.trunk(x)
        if task == "cls":
            return self.cls(f)
        if task == "gen":
            return self.gen(f)
        if task == "detach":  # the generation head reads features.detach()
            return self.cls(f), self.gen(f.detach())
        if task == "leaf":  # both heads read a feature leaf; the trunk is back-propagated by hand
            fl = f.detach().requires_grad_()
            return f, fl, self.cls(fl), self.gen(fl)
        return self.cls(f), self.gen(f)


def _loss_cls(out, yc):
    return F.cross_entropy(out, yc)


def _loss_gen(out, yg):
    return F.mse_loss(out, yg)


def _make_data():
    g = torch.Generator().manual_seed(1234)
    n = WORLD * LOCAL_BATCH
    return {
        "x": [torch.randn(n, D_IN, generator=g) for _ in range(N_BATCHES)],
        "yc": [torch.randint(0, N_CLS, (n,), generator=g) for _ in range(N_BATCHES)],
        "yg": [torch.rand(n, D_GEN, generator=g) * 2 - 1 for _ in range(N_BATCHES)],
    }


def _make_states():
    torch.manual_seed(99)
    return {norm: {k: v.clone() for k, v in TinyMTL(norm).state_dict().items()} for norm in (None, "bn", "gn")}


def _shard(data, k, rank):
    s = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return data["x"][k][s], data["yc"][k][s], data["yg"][k][s]


def _reference(state, x, yc, yg, objective="sum", norm=None):
    """Plain autograd, one process, no DDP. Missing gradients are returned as zeros."""
    m = TinyMTL(norm)
    m.load_state_dict(state)
    if objective == "cls":
        loss = _loss_cls(m(x, "cls"), yc)
    elif objective == "gen":
        loss = _loss_gen(m(x, "gen"), yg)
    elif objective == "detach":
        oc, og = m(x, "detach")
        loss = _loss_cls(oc, yc) + _loss_gen(og, yg)
    else:
        oc, og = m(x)
        loss = _loss_cls(oc, yc) + _loss_gen(og, yg)
    loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}


def _feature_grads(state, x, yc, yg):
    """Rank-local d l_cls / d features and d l_gen / d features (the feature-leaf row)."""
    m = TinyMTL()
    m.load_state_dict(state)
    f = m.trunk(x).detach().requires_grad_()
    (gc,) = torch.autograd.grad(_loss_cls(m.cls(f), yc), f)
    (gg,) = torch.autograd.grad(_loss_gen(m.gen(f), yg), f)
    return gc, gg


# ----------------------------------------------------------------------------------------------------------------
# the worker side: every pattern, recorded into a dict
# ----------------------------------------------------------------------------------------------------------------
def _count_hook(state, bucket):
    """Counts the all-reduces of bucket 0, then does exactly the default all-reduce (average)."""
    if bucket.index() == 0:
        state["b0"] += 1
    state["max_index"] = max(state["max_index"], bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


class _Ctx:
    def __init__(self, rank, data, states):
        self.rank, self.data, self.states = rank, data, states
        self.ddp: DDP | None = None

    def batch(self, k):
        return _shard(self.data, k, self.rank)

    def make(self, hook=True, norm=None, **flags):
        model = TinyMTL(norm)
        model.load_state_dict(self.states[norm])
        flags.setdefault("gradient_as_bucket_view", True)
        self.ddp = DDP(model, **flags)
        counter = {"b0": 0, "max_index": 0}
        if hook:
            self.ddp.register_comm_hook(counter, _count_hook)
        return self.ddp, counter

    @staticmethod
    def grads(module):
        return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def _pertask_step(ddp, rec, it, x, yc, yg):
    rec["stage"] = f"it{it}:F_cls"
    lc = _loss_cls(ddp(x, "cls"), yc)
    rec["stage"] = f"it{it}:B_cls"
    lc.backward()
    rec["stage"] = f"it{it}:F_gen"
    lg = _loss_gen(ddp(x, "gen"), yg)
    rec["stage"] = f"it{it}:B_gen"
    lg.backward()


def _counted_iterations(ctx, rec, ddp, cnt):
    """The two iterations of a pattern whose buckets are counted: zero_grad, then ``(it, x, yc, yg)`` for the caller's
    passes; after them, the iteration's gradients and how many buckets it reduced; at the end the highest bucket
    index seen."""
    for it in range(2):
        ddp.zero_grad()
        before = cnt["b0"]
        yield (it, *ctx.batch(it))
        rec[f"grads{it}"], rec[f"count{it}"] = ctx.grads(ddp.module), cnt["b0"] - before
    rec["max_bucket_index"] = cnt["max_index"]


def p_pertask(ctx, rec, hook=True, **flags):
    ddp, cnt = ctx.make(hook=hook, **flags)
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        _pertask_step(ddp, rec, it, x, yc, yg)


def p_placeholder(ctx, rec, hook=True):
    ddp, cnt = ctx.make(hook=hook, find_unused_parameters=False)
    mod = ddp.module
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        rec["stage"] = f"it{it}:cls"
        lc = _loss_cls(ddp(x, "cls"), yc) + 0 * sum(p.sum() for p in mod.gen.parameters())
        lc.backward()
        rec["stage"] = f"it{it}:gen"
        lg = _loss_gen(ddp(x, "gen"), yg) + 0 * sum(p.sum() for p in mod.cls.parameters())
        lg.backward()


def p_nosync_first(ctx, rec, hook=True, **flags):
    """First task's F and B inside no_sync(), second task's F and B synced."""
    ddp, cnt = ctx.make(hook=hook, **flags)
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        rec["stage"] = f"it{it}:F_cls(no_sync)"
        with ddp.no_sync():
            _loss_cls(ddp(x, "cls"), yc).backward()
        rec["stage"] = f"it{it}:F_gen"
        lg = _loss_gen(ddp(x, "gen"), yg)
        rec["stage"] = f"it{it}:B_gen"
        lg.backward()


def p_shared_retain(ctx, rec, **flags):
    """One shared F returning both heads, then l_cls.backward(retain_graph=True); l_gen.backward()."""
    ddp, cnt = ctx.make(**flags)
    for it in range(2):
        ddp.zero_grad()
        x, yc, yg = ctx.batch(it)
        rec["stage"] = f"it{it}:F"
        oc, og = ddp(x)
        lc, lg = _loss_cls(oc, yc), _loss_gen(og, yg)
        rec["stage"] = f"it{it}:B_cls"
        lc.backward(retain_graph=True)
        rec["stage"] = f"it{it}:B_gen"
        lg.backward()
        rec[f"grads{it}"] = ctx.grads(ddp.module)


def p_detach(ctx, rec, hook=True, **flags):
    """Shared F, the generation head reads features.detach(); l_gen.backward(); l_cls.backward()."""
    ddp, cnt = ctx.make(hook=hook, **flags)
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        before = cnt["b0"]
        rec["stage"] = f"it{it}:F"
        oc, og = ddp(x, "detach")
        lc, lg = _loss_cls(oc, yc), _loss_gen(og, yg)
        rec["stage"] = f"it{it}:B_gen"
        lg.backward()
        rec[f"count_after_B_gen{it}"] = cnt["b0"] - before
        rec["stage"] = f"it{it}:B_cls"
        lc.backward()


def p_leaf(ctx, rec, hook=True, **flags):
    """Heads read fl = features.detach().requires_grad_(); l_cls.backward(); l_gen.backward(); f.backward(fl.grad)."""
    ddp, cnt = ctx.make(hook=hook, **flags)
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        rec["stage"] = f"it{it}:F"
        f, fl, oc, og = ddp(x, "leaf")
        lc, lg = _loss_cls(oc, yc), _loss_gen(og, yg)
        rec["stage"] = f"it{it}:B_cls"
        lc.backward()
        rec[f"fgrad_cls{it}"] = fl.grad.clone()
        rec["stage"] = f"it{it}:B_gen"
        lg.backward()
        rec[f"fgrad_gen{it}"] = fl.grad.clone() - rec[f"fgrad_cls{it}"]
        rec["stage"] = f"it{it}:B_features"
        f.backward(fl.grad)


def p_clone_zero(ctx, rec, hook=True):
    """Per-task forward, clone grads after the first B, p.grad.zero_(), second B, add the clone back."""
    ddp, cnt = ctx.make(hook=hook, find_unused_parameters=True)
    params = dict(ddp.module.named_parameters())
    for it in range(2):
        ddp.zero_grad()
        x, yc, yg = ctx.batch(it)
        rec["stage"] = f"it{it}:cls"
        _loss_cls(ddp(x, "cls"), yc).backward()
        g_cls = ctx.grads(ddp.module)
        for p in params.values():
            if p.grad is not None:
                p.grad.zero_()
        rec["stage"] = f"it{it}:gen"
        _loss_gen(ddp(x, "gen"), yg).backward()
        g_gen = ctx.grads(ddp.module)
        for n, p in params.items():
            if g_cls[n] is not None:
                if p.grad is None:
                    p.grad = g_cls[n].clone()
                else:
                    p.grad.add_(g_cls[n])
        rec[f"g_cls{it}"], rec[f"g_gen{it}"], rec[f"grads{it}"] = g_cls, g_gen, ctx.grads(ddp.module)


def p_debug_names(ctx, rec):
    """The finished-reduction error with TORCH_DISTRIBUTED_DEBUG=INFO (set through the API, same effect)."""
    old = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        p_pertask(ctx, rec, hook=False, find_unused_parameters=False)
    finally:
        dist.set_debug_level(old)


def p_nograd_forward(ctx, rec):
    """F_cls B_cls (find_unused_parameters=False), then a no_grad forward, then a grad-enabled forward."""
    ddp, _ = ctx.make(hook=False, find_unused_parameters=False)
    x, yc, _yg = ctx.batch(0)
    rec["stage"] = "F_cls B_cls"
    _loss_cls(ddp(x, "cls"), yc).backward()
    rec["stage"] = "no_grad forward"
    with torch.no_grad():
        ddp(x, "gen")
    rec["stage"] = "grad-enabled forward"
    ddp(x, "gen")
    rec["stage"] = "done"


def p_nosync_scope(ctx, rec, where):
    """no_sync() around the forward only, or around the backward only."""
    ddp, cnt = ctx.make(find_unused_parameters=False)
    x, yc, yg = ctx.batch(0)
    if where == "forward":
        with ddp.no_sync():
            oc, og = ddp(x)
        (_loss_cls(oc, yc) + _loss_gen(og, yg)).backward()
    else:
        oc, og = ddp(x)
        with ddp.no_sync():
            (_loss_cls(oc, yc) + _loss_gen(og, yg)).backward()
    rec["grads0"], rec["count0"] = ctx.grads(ddp.module), cnt["b0"]


def _full_step(ddp, k, ctx):
    x, yc, yg = ctx.batch(k)
    oc, og = ddp(x)
    (_loss_cls(oc, yc) + _loss_gen(og, yg)).backward()


def p_alias(ctx, rec, view):
    """Keep a reference to .grad after a step, zero_grad() (set_to_none=True), run the next synced step."""
    ddp, _ = ctx.make(hook=False, find_unused_parameters=False, gradient_as_bucket_view=view)
    p = ddp.module.trunk[0].weight
    _full_step(ddp, 0, ctx)  # warm-up: DDP rebuilds its buckets at the second forward
    ddp.zero_grad()
    _full_step(ddp, 1, ctx)
    kept, cloned = p.grad, p.grad.clone()
    ddp.zero_grad(set_to_none=True)
    _full_step(ddp, 2, ctx)
    rec["kept"], rec["cloned"], rec["new"] = kept.clone(), cloned, p.grad.clone()


def p_dataptr(ctx, rec, set_to_none):
    """data_ptr of .grad after each backward, and inside a post-accumulate-grad hook (before DDP's hook)."""
    ddp, _ = ctx.make(hook=False, find_unused_parameters=False, gradient_as_bucket_view=True)
    p = ddp.module.trunk[0].weight
    in_hook: list[int] = []
    p.register_post_accumulate_grad_hook(lambda t: in_hook.append(t.grad.data_ptr()))
    after: list[int] = []
    for it in range(3):
        ddp.zero_grad(set_to_none=set_to_none)
        _full_step(ddp, it, ctx)
        after.append(p.grad.data_ptr())
    rec["after"], rec["in_hook"] = after, in_hook


def p_second_pass(ctx, rec):
    """Two synced passes without zeroing in between (bucket views)."""
    ddp, _ = ctx.make(hook=False, find_unused_parameters=False, gradient_as_bucket_view=True)
    _full_step(ddp, 0, ctx)
    rec["grads_pass1"] = ctx.grads(ddp.module)
    _full_step(ddp, 1, ctx)
    rec["grads_pass2"] = ctx.grads(ddp.module)


def p_autograd_grad(ctx, rec):
    """GradNorm-style torch.autograd.grad(..., create_graph=True) through a DDP model, then the real backward."""
    ddp, cnt = ctx.make(find_unused_parameters=False)
    trunk = dict(ddp.module.trunk.named_parameters())
    for it in range(2):
        ddp.zero_grad()
        x, yc, yg = ctx.batch(it)
        oc, og = ddp(x)
        lc, lg = _loss_cls(oc, yc), _loss_gen(og, yg)
        gs = torch.autograd.grad(lc, list(trunk.values()), create_graph=True, retain_graph=True)
        rec[f"autograd_grad{it}"] = {f"trunk.{n}": g.detach().clone() for n, g in zip(trunk, gs)}
        rec[f"count_after_autograd_grad{it}"] = cnt["b0"]
        (lc + lg).backward()
        rec[f"grads{it}"] = ctx.grads(ddp.module)


def p_gloo_avg(ctx, rec):
    t = torch.full((3,), float(ctx.rank + 1))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        rec["avg_error"] = None
        rec["avg_result"] = t.clone()
    except Exception as e:  # the message is the fact
        rec["avg_error"] = f"{type(e).__name__}: {e}"
    s = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    rec["sum_then_divide"] = s / dist.get_world_size()


def p_static_nosync(ctx, rec, first_synced):
    """static_graph=True with gradient accumulation: a no_sync micro-batch, then a synced one, for 3 steps."""
    ddp, _ = ctx.make(hook=False, static_graph=True)
    for it in range(3):
        ddp.zero_grad()
        rec["stage"] = f"it{it}:no_sync"
        if it > 0 or not first_synced:
            with ddp.no_sync():
                _full_step(ddp, it, ctx)
        rec[f"local{it}"] = ctx.grads(ddp.module)
        rec["stage"] = f"it{it}:synced"
        _full_step(ddp, (it + 1) % N_BATCHES, ctx)
        rec[f"grads{it}"] = ctx.grads(ddp.module)


def p_absent(ctx, rec, where, zero_term=False, **flags):
    """Multi-input steps: the generation task is absent from the step on EVERY rank (``where="all"``: one
    forward and backward of the classification loss), or only on rank 1 (``where="one"``: rank 0's step holds
    both tasks, its generation loss a share of the mean over the GLOBAL generation rows, which are rank 0's:
    2 x its local mean). ``zero_term``: rank 1 adds ``0 * sum(p.sum())`` over the generation head (what mtl's model
    does for a task with no row on a rank)."""
    ddp, cnt = ctx.make(**flags)
    for it, x, yc, yg in _counted_iterations(ctx, rec, ddp, cnt):
        rec["stage"] = f"it{it}:F"
        oc, og = ddp(x)
        loss = _loss_cls(oc, yc)
        if where == "one" and ctx.rank == 0:
            loss = loss + WORLD * _loss_gen(og, yg)
        elif zero_term:
            loss = loss + 0 * sum(p.sum() for p in ddp.module.gen.parameters())
        rec["stage"] = f"it{it}:B"
        loss.backward()


def p_norm(ctx, rec, norm):
    ddp, _ = ctx.make(hook=False, norm=norm, find_unused_parameters=False)
    _full_step(ddp, 0, ctx)
    rec["grads0"] = ctx.grads(ddp.module)


def _patterns():
    return {
        # the table
        "pertask_nofind": lambda c, r: p_pertask(c, r, find_unused_parameters=False),
        "pertask_find": lambda c, r: p_pertask(c, r, find_unused_parameters=True),
        "pertask_find_nohook": lambda c, r: p_pertask(c, r, hook=False, find_unused_parameters=True),
        "placeholder": lambda c, r: p_placeholder(c, r),
        "placeholder_nohook": lambda c, r: p_placeholder(c, r, hook=False),
        "nosync_find": lambda c, r: p_nosync_first(c, r, find_unused_parameters=True),
        "nosync_find_nohook": lambda c, r: p_nosync_first(c, r, hook=False, find_unused_parameters=True),
        "nosync_nofind": lambda c, r: p_nosync_first(c, r, find_unused_parameters=False),
        "shared_retain_nofind": lambda c, r: p_shared_retain(c, r, find_unused_parameters=False),
        "shared_retain_static": lambda c, r: p_shared_retain(c, r, static_graph=True),
        "shared_retain_find": lambda c, r: p_shared_retain(c, r, find_unused_parameters=True),
        "detach_nofind": lambda c, r: p_detach(c, r, find_unused_parameters=False),
        "detach_nofind_nohook": lambda c, r: p_detach(c, r, hook=False, find_unused_parameters=False),
        "detach_find": lambda c, r: p_detach(c, r, find_unused_parameters=True),
        "leaf_nofind": lambda c, r: p_leaf(c, r, find_unused_parameters=False),
        "leaf_nofind_nohook": lambda c, r: p_leaf(c, r, hook=False, find_unused_parameters=False),
        "leaf_find": lambda c, r: p_leaf(c, r, find_unused_parameters=True),
        "clone_zero": lambda c, r: p_clone_zero(c, r),
        "clone_zero_nohook": lambda c, r: p_clone_zero(c, r, hook=False),
        # "from reading the source"
        "debug_off": lambda c, r: p_pertask(c, r, hook=False, find_unused_parameters=False),
        "debug_info": p_debug_names,
        "nograd_forward": p_nograd_forward,
        "nosync_forward_only": lambda c, r: p_nosync_scope(c, r, "forward"),
        "nosync_backward_only": lambda c, r: p_nosync_scope(c, r, "backward"),
        "alias_view": lambda c, r: p_alias(c, r, True),
        "alias_noview": lambda c, r: p_alias(c, r, False),
        "dataptr_keep": lambda c, r: p_dataptr(c, r, False),
        "dataptr_none": lambda c, r: p_dataptr(c, r, True),
        "second_pass": p_second_pass,
        "autograd_grad": p_autograd_grad,
        "gloo_avg": p_gloo_avg,
        "static_nosync": lambda c, r: p_static_nosync(c, r, False),
        "static_nosync_after_sync": lambda c, r: p_static_nosync(c, r, True),
        "norm_bn": lambda c, r: p_norm(c, r, "bn"),
        "norm_gn": lambda c, r: p_norm(c, r, "gn"),
        # multi-input: a task absent from a step (mtl/setup/multi_input.py, docs/multi-input.md)
        "absent_all_nofind": lambda c, r: p_absent(c, r, "all", find_unused_parameters=False),
        "absent_all_find": lambda c, r: p_absent(c, r, "all", find_unused_parameters=True),
        "absent_one_find": lambda c, r: p_absent(c, r, "one", find_unused_parameters=True),
        "absent_one_zero_term": lambda c, r: p_absent(c, r, "one", zero_term=True, find_unused_parameters=False),
    }


def _group_healthy(rank) -> bool:
    t = torch.full((1,), float(rank + 1))
    try:
        dist.all_reduce(t)
    except RuntimeError:
        return False
    return t.item() == sum(range(1, WORLD + 1))


def _worker(rank, ports, outdir, data, states):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=30)
    port_iter = iter(ports)

    def init():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{next(port_iter)}", rank=rank,
                                world_size=WORLD, timeout=timeout)

    init()
    ctx = _Ctx(rank, data, states)
    results = {}
    for name, fn in _patterns().items():
        rec: dict = {"stage": "start", "error": None}
        t0 = time.perf_counter()
        try:
            fn(ctx, rec)
        except Exception as e:  # the error is what we record
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["error_type"] = type(e).__name__
            rec["traceback"] = traceback.format_exc()
            if ctx.ddp is not None:
                rec["grads_at_error"] = _Ctx.grads(ctx.ddp.module)
        rec["seconds"] = time.perf_counter() - t0
        ctx.ddp = None
        rec["group_reinit"] = False
        if not _group_healthy(rank):  # not seen with torch 2.14.1; a fresh group keeps the later patterns meaningful
            dist.destroy_process_group()
            init()
            rec["group_reinit"] = True
        results[name] = rec
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(outdir, data, states):
    ports = [free_port() for _ in range(1 + SPARE_GROUPS)]  # spares: re-init after a pattern breaks the group
    join_spawned(_worker, (ports, str(outdir), data, states), WORLD, SPAWN_DEADLINE_S, "DDP facts")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


# ----------------------------------------------------------------------------------------------------------------
# fixture and helpers for the asserts
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    data, states = _make_data(), _make_states()
    t0 = time.perf_counter()
    ranks = _spawn(tmp_path_factory.mktemp("ddp_facts"), data, states)
    return {"ranks": ranks, "data": data, "states": states, "seconds": time.perf_counter() - t0}


def _ref(facts, k, objective="sum", rank=None, norm=None):
    data = facts["data"]
    if rank is None:
        x, yc, yg = data["x"][k], data["yc"][k], data["yg"][k]
    else:
        x, yc, yg = _shard(data, k, rank)
    return _reference(facts["states"][norm], x, yc, yg, objective, norm)


def _maxdiff(a, b):
    """Max abs difference over the parameters in ``a``; a missing (None) gradient counts as zeros."""
    out = 0.0
    for n in a:
        x, y = a[n], b[n]
        if x is None and y is None:
            continue
        x = torch.zeros_like(y) if x is None else x
        y = torch.zeros_like(x) if y is None else y
        out = max(out, (x - y).abs().max().item())
    return out


def _assert_close(got, ref, what):
    d = _maxdiff(got, ref)
    assert d <= TOL, f"{what}: max abs diff {d:.3e} > {TOL}"


def _assert_correct(facts, name, key="grads", objective="sum", its=(0, 1)):
    """On both ranks, equal to the single-process reference on the global batch; ranks identical."""
    r0, r1 = (facts["ranks"][r][name] for r in range(WORLD))
    for rec in (r0, r1):
        assert rec["error"] is None, f"{name}: unexpected error at {rec['stage']}: {rec['error']}"
    for it in its:
        ref = _ref(facts, it, objective)
        for rank, rec in enumerate((r0, r1)):
            _assert_close(rec[f"{key}{it}"], ref, f"{name} rank {rank} iteration {it} vs single process")
        assert _maxdiff(r0[f"{key}{it}"], r1[f"{key}{it}"]) == 0, f"{name}: ranks differ at iteration {it}"


def _assert_error(facts, name, phrase, stage=None):
    for rank in range(WORLD):
        rec = facts["ranks"][rank][name]
        assert rec["error"] is not None, f"{name} rank {rank}: no error raised (expected {phrase!r})"
        assert rec["error_type"] == "RuntimeError", f"{name} rank {rank}: {rec['error']}"
        assert phrase in rec["error"], f"{name} rank {rank}: expected {phrase!r}, got {rec['error']!r}"
        if stage is not None:
            assert rec["stage"] == stage, f"{name} rank {rank}: raised at {rec['stage']}, expected {stage}"


def _counts(facts, name, its=(0, 1)):
    out = set()
    for rank in range(WORLD):
        rec = facts["ranks"][rank][name]
        assert rec["max_bucket_index"] == 0, f"{name}: the tiny model should fit one bucket"
        out |= {rec[f"count{it}"] for it in its}
    return out


def _rank_local(facts, name, key, k, objective):
    """Gradients recorded under key are each rank's own (unreduced) gradients and differ between ranks."""
    recs = [facts["ranks"][r][name] for r in range(WORLD)]
    for rank, rec in enumerate(recs):
        _assert_close(rec[key], _ref(facts, k, objective, rank=rank), f"{name} rank {rank}: {key} vs rank-local")
    assert _maxdiff(recs[0][key], recs[1][key]) > 1e-3, f"{name}: {key} are identical across ranks (reduced?)"


# ----------------------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------------------
def _absent_on_rank1_reference(facts, k):
    """One process: the classification loss over the global batch plus the generation loss over rank 0's rows
    (the only generation rows of the step)."""
    m = TinyMTL()
    m.load_state_dict(facts["states"][None])
    data = facts["data"]
    x0, _, yg0 = _shard(data, k, 0)
    (_loss_cls(m(data["x"][k], "cls"), data["yc"][k]) + _loss_gen(m(x0, "gen"), yg0)).backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}


def test_a_task_absent_from_a_step_on_every_rank_needs_find_unused(facts):
    """| multi-input: a step without the gen task on any rank (round_robin, weighted, temperature) |
    find_unused_parameters=False | RuntimeError at the next step's forward: "Expected to have finished reduction"
    (the absent head never got a gradient) | find_unused_parameters=True | correct: the present task's gradient
    of the global batch, the absent head's gradient zero, one all-reduce |"""
    _assert_error(facts, "absent_all_nofind", MSG_FINISHED, stage="it1:F")
    _assert_correct(facts, "absent_all_find", objective="cls")
    assert _counts(facts, "absent_all_find") == {1}
    for rank in range(WORLD):
        g = facts["ranks"][rank]["absent_all_find"]["grads1"]["gen.0.weight"]
        assert g is None or not g.any()


def test_a_task_absent_on_one_rank_only_is_correct_with_find_unused_or_a_zero_term(facts):
    """| multi-input: gen rows on rank 0 only (mixed), each task's loss a share of the mean over its GLOBAL rows |
    find_unused_parameters=True, or a zero term over the absent head on rank 1 with find_unused_parameters=False |
    correct: DDP averages rank 1's zero gradient of the gen head with rank 0's, which is the gradient of the mean
    over the global gen rows; one all-reduce |"""
    for name in ("absent_one_find", "absent_one_zero_term"):
        r0, r1 = (facts["ranks"][r][name] for r in range(WORLD))
        assert r0["error"] is None and r1["error"] is None, (name, r0["error"], r1["error"])
        for it in (0, 1):
            _assert_close(r0[f"grads{it}"], _absent_on_rank1_reference(facts, it), f"{name} iteration {it}")
            assert _maxdiff(r0[f"grads{it}"], r1[f"grads{it}"]) == 0
        assert _counts(facts, name) == {1}


def test_all_patterns_ran_and_group_stayed_healthy(facts):
    """Harness check: every pattern ran on both ranks and no pattern left the gloo group unusable."""
    for rank in range(WORLD):
        assert set(facts["ranks"][rank]) == set(_patterns())
        assert not any(rec["group_reinit"] for rec in facts["ranks"][rank].values())


def test_pertask_forward_without_find_unused_raises_finished_reduction(facts):
    """| per-task forward, no extra care | find_unused_parameters=False | RuntimeError at the next forward:
    "Expected to have finished reduction in the prior iteration before starting a new one" (the other head never
    got a gradient) |

    Measured: the "next forward" is already the second task's forward (F_gen) of the same step, and the gradients
    left by B_cls were never reduced (each rank keeps its own)."""
    _assert_error(facts, "pertask_nofind", MSG_FINISHED, stage="it0:F_gen")
    _rank_local(facts, "pertask_nofind", "grads_at_error", 0, "cls")
    for rank in range(WORLD):
        assert facts["ranks"][rank]["pertask_nofind"]["grads_at_error"]["gen.0.weight"] is None


def test_pertask_forward_with_find_unused_is_correct_two_allreduces(facts):
    """| per-task forward | find_unused_parameters=True | correct; 2 all-reduces of every bucket per step |"""
    _assert_correct(facts, "pertask_find")
    _assert_correct(facts, "pertask_find_nohook")
    assert _counts(facts, "pertask_find") == {2}


def test_placeholder_zero_loss_is_correct_two_allreduces(facts):
    """| per-task forward, each loss plus `0 * sum(p.sum())` over the params its task does not reach (placeholder)
    | find_unused_parameters=False | correct; 2 all-reduces per step |"""
    _assert_correct(facts, "placeholder")
    _assert_correct(facts, "placeholder_nohook")
    assert _counts(facts, "placeholder") == {2}


def test_nosync_first_task_with_find_unused_is_correct_one_allreduce(facts):
    """| first task's F and B inside `no_sync()`, second task's F and B synced | find_unused_parameters=True |
    correct; 1 all-reduce per step (the used-parameter map is kept across no_sync passes) |"""
    _assert_correct(facts, "nosync_find")
    _assert_correct(facts, "nosync_find_nohook")
    assert _counts(facts, "nosync_find") == {1}


def test_nosync_first_task_without_find_unused_raises_finished_reduction(facts):
    """| same as above | find_unused_parameters=False | RuntimeError "Expected to have finished reduction ..." |

    Raised at the next step's forward, so the faulty step's gradients (left rank-local, never reduced) would
    already have been used by the optimizer: the silent-damage part of the fact."""
    _assert_error(facts, "nosync_nofind", MSG_FINISHED, stage="it1:F_cls(no_sync)")
    for rank in range(WORLD):
        assert facts["ranks"][rank]["nosync_nofind"]["count0"] == 0  # the bucket never completed
    _rank_local(facts, "nosync_nofind", "grads0", 0, "sum")


def test_shared_forward_retain_graph_raises_mark_ready_once(facts):
    """| one shared F returning both heads, then `l_cls.backward(retain_graph=True); l_gen.backward()` |
    find_unused_parameters=False | RuntimeError "Expected to mark a variable ready only once" |"""
    _assert_error(facts, "shared_retain_nofind", MSG_READY_ONCE, stage="it0:B_gen")


def _assert_first_step_desynced(facts, name):
    """Iteration 0 finished without an error, but each rank holds avg(g_cls) + its own g_gen: ranks disagree."""
    recs = [facts["ranks"][r][name] for r in range(WORLD)]
    ref_cls = _ref(facts, 0, "cls")
    for rank, rec in enumerate(recs):
        local_gen = _ref(facts, 0, "gen", rank=rank)
        expected = {n: ref_cls[n] + local_gen[n] for n in ref_cls}
        _assert_close(rec["grads0"], expected, f"{name} rank {rank}: iteration 0 vs avg(g_cls) + local g_gen")
    assert _maxdiff(recs[0]["grads0"], recs[1]["grads0"]) > 1e-3, f"{name}: iteration 0 no longer desyncs the ranks"


def test_shared_forward_retain_graph_static_graph_raises_graph_changed(facts):
    """| same | static_graph=True | RuntimeError "Your training graph has changed in this iteration ..." |

    Measured: raised only in the SECOND iteration (at its second backward). The first iteration passes silently
    with desynchronised gradients: cls part averaged, gen part rank-local."""
    _assert_error(facts, "shared_retain_static", MSG_GRAPH_CHANGED, stage="it1:B_gen")
    _assert_first_step_desynced(facts, "shared_retain_static")


def test_shared_forward_retain_graph_find_unused_raises_undefined_gradient(facts):
    """| same | find_unused_parameters=True | RuntimeError "Encountered gradient which is undefined, but still
    allreduced by DDP reducer" (reading the source says other orders can desync silently instead: never allow it) |

    Measured: raised only in the SECOND iteration (at its first backward). The first iteration passes silently
    with desynchronised gradients: cls part averaged, gen part rank-local."""
    _assert_error(facts, "shared_retain_find", MSG_UNDEFINED, stage="it1:B_cls")
    _assert_first_step_desynced(facts, "shared_retain_find")


def test_detached_gen_head_is_correct_one_allreduce(facts):
    """| one shared F, generation head reads `features.detach()`, then `l_gen.backward(); l_cls.backward()` |
    find_unused_parameters=False | correct against the detached objective; 1 all-reduce spread over the two
    backward passes |"""
    _assert_correct(facts, "detach_nofind", objective="detach")
    _assert_correct(facts, "detach_nofind_nohook", objective="detach")
    assert _counts(facts, "detach_nofind") == {1}
    for rank in range(WORLD):  # nothing is reduced before the second backward completes the bucket
        rec = facts["ranks"][rank]["detach_nofind"]
        assert rec["count_after_B_gen0"] == 0 and rec["count_after_B_gen1"] == 0


def test_detached_gen_head_with_find_unused_raises_second_backward(facts):
    """| same | find_unused_parameters=True | RuntimeError "Trying to backward through the graph a second time" |"""
    _assert_error(facts, "detach_find", MSG_SECOND_TIME, stage="it0:B_cls")


def test_feature_leaf_is_correct_one_allreduce(facts):
    """| one shared F whose heads read a leaf `fl = features.detach().requires_grad_()`; `l_cls.backward();
    l_gen.backward(); features.backward(fl.grad)` | find_unused_parameters=False | correct: exactly the
    combined-loss gradient, 1 all-reduce ... each task's feature gradient is available on its own |"""
    _assert_correct(facts, "leaf_nofind")
    _assert_correct(facts, "leaf_nofind_nohook")
    assert _counts(facts, "leaf_nofind") == {1}
    for rank in range(WORLD):
        rec = facts["ranks"][rank]["leaf_nofind"]
        for it in range(2):
            gc, gg = _feature_grads(facts["states"][None], *_shard(facts["data"], it, rank))
            assert (rec[f"fgrad_cls{it}"] - gc).abs().max().item() <= TOL
            assert (rec[f"fgrad_gen{it}"] - gg).abs().max().item() <= TOL
            assert (gc - gg).abs().max().item() > 1e-3  # the two tasks' feature gradients really are distinct


def test_feature_leaf_with_find_unused_raises_second_backward(facts):
    """| same | find_unused_parameters=True | RuntimeError "Trying to backward through the graph a second time" |"""
    _assert_error(facts, "leaf_find", MSG_SECOND_TIME, stage="it0:B_gen")


def test_clone_zero_add_back_gives_each_tasks_rank_averaged_gradient(facts):
    """| per-task forward, clone grads after the first B, `p.grad.zero_()`, second B, add the clone back |
    find_unused_parameters=True | correct, and it yields each task's rank-averaged gradient |"""
    for name in ("clone_zero", "clone_zero_nohook"):
        _assert_correct(facts, name)
        _assert_correct(facts, name, key="g_cls", objective="cls")
        _assert_correct(facts, name, key="g_gen", objective="gen")


# ----------------------------------------------------------------------------------------------------------------
# "From reading the source and issue threads"
# ----------------------------------------------------------------------------------------------------------------
def test_finished_reduction_error_is_raised_at_next_grad_enabled_forward(facts):
    """The "finished reduction" error is raised at the *next* grad-enabled forward
    (`Reducer::ensure_prior_reduction_finished`): a no_grad forward in between passes."""
    _assert_error(facts, "nograd_forward", MSG_FINISHED, stage="grad-enabled forward")


def test_finished_reduction_error_names_parameters_only_in_debug_mode(facts):
    """`TORCH_DISTRIBUTED_DEBUG=INFO` (or DETAIL) makes the error list parameter names instead of indices.

    Measured: with INFO the names are listed in addition to the indices ("Parameters which did not receive grad for
    rank 0: gen.0.bias, gen.0.weight"); without it only indices are listed."""
    _assert_error(facts, "debug_off", MSG_FINISHED, stage="it0:F_gen")
    _assert_error(facts, "debug_info", MSG_FINISHED, stage="it0:F_gen")
    for rank in range(WORLD):
        off = facts["ranks"][rank]["debug_off"]["error"]
        info = facts["ranks"][rank]["debug_info"]["error"]
        assert "Parameter indices which did not receive grad" in off and "gen.0.weight" not in off
        assert "Parameters which did not receive grad" in info and "gen.0.weight" in info and "gen.0.bias" in info
        assert "cls.weight" not in info  # only the parameters that missed their gradient are named


def test_nosync_must_wrap_the_forward(facts):
    """`no_sync()` must wrap the forward as well as the backward: DDP decides at forward time whether the next
    backward syncs."""
    _assert_correct(facts, "nosync_backward_only", its=(0,))  # backward inside no_sync: still synced
    _rank_local(facts, "nosync_forward_only", "grads0", 0, "sum")  # forward inside no_sync: not synced
    for rank in range(WORLD):
        assert facts["ranks"][rank]["nosync_backward_only"]["count0"] == 1
        assert facts["ranks"][rank]["nosync_forward_only"]["count0"] == 0


def test_bucket_view_grad_reference_is_changed_in_place_unless_cloned(facts):
    """With `gradient_as_bucket_view=True`, `.grad` tensors alias DDP's buckets ... A saved reference to `.grad` is
    changed in place by the next synced backward: `clone()` before keeping a task's gradient.

    Even `zero_grad(set_to_none=True)` in between does not protect the saved reference. Control: without bucket
    views the saved reference keeps its values."""
    for rank in range(WORLD):
        ref1 = _ref(facts, 1)["trunk.0.weight"]
        ref2 = _ref(facts, 2)["trunk.0.weight"]
        assert (ref1 - ref2).abs().max().item() > 1e-3
        view = facts["ranks"][rank]["alias_view"]
        assert (view["cloned"] - ref1).abs().max().item() <= TOL
        assert (view["new"] - ref2).abs().max().item() <= TOL
        assert (view["kept"] - ref2).abs().max().item() <= TOL, "kept .grad reference was not overwritten"
        noview = facts["ranks"][rank]["alias_noview"]
        assert (noview["kept"] - ref1).abs().max().item() <= TOL
        assert (noview["new"] - ref2).abs().max().item() <= TOL


def test_set_to_none_throws_the_bucket_alias_away(facts):
    """With `gradient_as_bucket_view=True` ... `zero_grad(set_to_none=True)` (the default) throws the alias away
    every step (an extra copy).

    Measured: after each backward `.grad` is the bucket view again in both modes (same data_ptr from the second step
    on, after DDP's one-time bucket rebuild). The difference is inside the backward: with set_to_none=False autograd
    accumulates straight into the bucket; with set_to_none=True it first materialises a fresh tensor, which DDP then
    copies into the bucket (the extra copy)."""
    keep = facts["ranks"][0]["dataptr_keep"]
    none = facts["ranks"][0]["dataptr_none"]
    for rec in (keep, none):
        assert rec["after"][1] == rec["after"][2], "after backward, .grad is no longer the (rebuilt) bucket view"
    assert keep["in_hook"][1:] == keep["after"][1:], "set_to_none=False no longer accumulates into the bucket"
    assert all(h != a for h, a in zip(none["in_hook"][1:], none["after"][1:])), (
        "set_to_none=True: autograd accumulated straight into the bucket (no extra copy any more)")


def test_second_synced_pass_adds_averages(facts):
    """With `gradient_as_bucket_view=True`, a second synced pass adds into `.grad` and gives avg(g1)+avg(g2)."""
    ref0, ref1 = _ref(facts, 0), _ref(facts, 1)
    both = {n: ref0[n] + ref1[n] for n in ref0}
    for rank in range(WORLD):
        rec = facts["ranks"][rank]["second_pass"]
        assert rec["error"] is None, rec["error"]
        _assert_close(rec["grads_pass1"], ref0, f"rank {rank} pass 1")
        _assert_close(rec["grads_pass2"], both, f"rank {rank} pass 1 + pass 2")


def test_autograd_grad_create_graph_is_rank_local(facts):
    """`GradNorm`-style `torch.autograd.grad(..., create_graph=True)` bypasses DDP's hooks: whatever it computes is
    rank-local and must be all-reduced by hand."""
    for it in range(2):
        _rank_local(facts, "autograd_grad", f"autograd_grad{it}", it, "cls")
        for rank in range(WORLD):
            assert facts["ranks"][rank]["autograd_grad"][f"count_after_autograd_grad{it}"] == it  # no extra sync
    _assert_correct(facts, "autograd_grad")  # the ordinary backward afterwards is still reduced correctly


def test_gloo_reduce_op_avg(facts):
    """gloo has no `ReduceOp.AVG`: sum, then divide.

    Measured (torch 2.14.1): gloo ACCEPTS ReduceOp.AVG on CPU tensors and returns the mean. The test pins the
    measured behaviour; sum-then-divide gives the same result and stays the portable spelling."""
    for rank in range(WORLD):
        rec = facts["ranks"][rank]["gloo_avg"]
        assert rec["avg_error"] is None, f"gloo now rejects ReduceOp.AVG: {rec['avg_error']}"
        assert torch.equal(rec["avg_result"], torch.full((3,), 1.5))
        assert torch.equal(rec["sum_then_divide"], torch.full((3,), 1.5))


def test_static_graph_with_no_sync(facts):
    """`static_graph=True` ... combined with `no_sync` it has a regression that silently stops syncing.

    Measured (torch 2.14.1, a no_sync micro-batch then a synced one per step): if the very first step starts inside
    no_sync() the first backward fails loudly ("expect_autograd_hooks_ INTERNAL ASSERT FAILED"); if the first step
    is a plain synced one, the later no_sync + synced steps are reduced correctly. No silent loss of syncing was
    observed with this pattern."""
    _assert_error(facts, "static_nosync", "expect_autograd_hooks_ INTERNAL ASSERT FAILED", stage="it0:no_sync")
    for rank in range(WORLD):
        rec = facts["ranks"][rank]["static_nosync_after_sync"]
        assert rec["error"] is None, rec["error"]
        for it in range(3):
            nxt = _ref(facts, (it + 1) % N_BATCHES)
            expected = nxt if it == 0 else {n: _ref(facts, it)[n] + nxt[n] for n in nxt}
            _assert_close(rec[f"grads{it}"], expected, f"static_graph + no_sync rank {rank} step {it}")
            if it > 0:  # the no_sync micro-batch itself stayed rank-local
                _assert_close(rec[f"local{it}"], _ref(facts, it, rank=rank), f"no_sync micro-batch rank {rank}")


def test_batchnorm_is_per_rank_groupnorm_matches(facts):
    """BatchNorm keeps per-rank statistics, so a BatchNorm model under DDP is not equal to one process on the global
    batch. Use SyncBatchNorm, GroupNorm or frozen BatchNorm wherever equality is asserted."""
    ref_bn, ref_gn = _ref(facts, 0, norm="bn"), _ref(facts, 0, norm="gn")
    for rank in range(WORLD):
        assert _maxdiff(facts["ranks"][rank]["norm_bn"]["grads0"], ref_bn) > 1e-3
        _assert_close(facts["ranks"][rank]["norm_gn"]["grads0"], ref_gn, f"GroupNorm rank {rank}")


# ----------------------------------------------------------------------------------------------------------------
# AMP (single process: no DDP involved)
# ----------------------------------------------------------------------------------------------------------------
def test_gradscaler_cpu_unscale_twice_raises_and_per_loss_scaling_works():
    """AMP: scale each loss on its own (`scaler.scale(l).backward()`), call `unscale_` at most once per step (a
    second call raises), and call `update()` once. `torch.amp.GradScaler("cpu")` ... work[s] on the CPU."""
    data, states = _make_data(), _make_states()
    x, yc, yg = data["x"][0], data["yc"][0], data["yg"][0]
    m = TinyMTL()
    m.load_state_dict(states[None])
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    oc, og = m(x)
    scaler.scale(_loss_cls(oc, yc)).backward(retain_graph=True)
    scaler.scale(_loss_gen(og, yg)).backward()
    scaler.unscale_(opt)
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    _assert_close(got, _reference(states[None], x, yc, yg), "GradScaler per-loss scaling, unscaled")
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1024.0  # no inf/nan: the scale is kept (growth only after growth_interval)


def test_fp16_and_bf16_autocast_run_on_cpu():
    """`torch.amp.GradScaler("cpu")` and fp16 autocast both work on the CPU. bf16 needs no scaler."""
    m = TinyMTL()
    x = torch.randn(LOCAL_BATCH, D_IN)
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            oc, og = m(x)
        assert oc.dtype == dtype and og.dtype == dtype
        assert torch.isfinite(oc.float()).all()
