"""``task_grads``: each task's rank-averaged gradient of the shared parameters, for gradient-level weighting.

One backbone forward (the ``feature_leaf`` graph, through DDP as usual). For each task t but the last:
its head backward pass into the feature leaf, then ``torch.autograd.grad(features, shared, g_t)``,
which gives row t of the K x P matrix G without touching ``.grad`` (so DDP's hooks do not fire); each
parameter's gradient is written straight into its slice of row t of a preallocated buffer as autograd computes
it (``RowWriter``), and the row's all-reduce starts at once, asynchronously, so that
it runs while the next tasks' backward passes compute. The LAST task's backbone backward is an
ordinary ``features.backward(g_K)`` through DDP: every parameter (the heads, from their passes, and
the backbone, from this one) gets exactly one gradient, so DDP reduces the last row and the heads'
gradients in its usual buckets, overlapped with that backward. Then every row is averaged over ranks
*before* the weighting method sees them. Combining first and averaging after would give a different,
rank-count-dependent answer for every nonlinear method (PCGrad, MGDA, CAGrad, Nash-MTL, ...).

Then: the last row is copied from ``.grad`` into the buffer (the only copy of a row), the K x K Gram
matrix of the buffer gives a Gram-only method its weights w (``StepInputs.gram_weights``), and the
update ``sum_t w_t g_t`` is formed in place in ``.grad`` (a method that needs the rows gets the K x P
buffer through ``combine``). With a loss-level method w = 1: the rows are summed, which reproduces
``combined`` (the parity tests check it).

Cost: one backbone forward, K backbone backward passes; K all-reduces (K - 1 rows by hand, the first
carrying the K losses; DDP's bucketed one for the last row and the heads), K*P_shared + P_heads + K
numbers in all; the K x P buffer held between steps.

Under FSDP2 (``parallel.engine=fsdp2``, ``_sharded``) every task's backbone backward goes through FSDP2, which
reduce-scatters it: each rank ends the pass holding ITS SHARD of that task's rank-averaged gradient, which
is copied into row t of a K x (P / W) buffer and zeroed before the next pass. The Gram matrix is the sum
over the ranks of the shards' local products, ``G G^T = sum_r G_r G_r^T``: ONE all-reduce of K x K numbers
(carrying the K losses too). Every rank gets the same Gram matrix, so the same weights, and combines its
own shard in place in ``.grad``. A method that needs the rows runs only where its update is exact column
by column (``RowWeighting.combine_shard``: GradDrop); the config check refuses the others. Cost: K backbone
backward passes, each with FSDP2's all-gathers and reduce-scatters, and one K x K all-reduce; the buffer
is K x P / W per rank.

Heads: each head's gradient is its own task's (DDP's, in the last pass); with ``weighting.heads: weighted`` head t's
is then multiplied by the method's w_t (``weigh_heads_``), as the backward pass of ``sum_t w_t L_t`` would give it
(under DDP; the config check refuses it under FSDP2, where this is not done).

Multi-input steps that leave tasks out: K is the number of present tasks (their rows only), and the first head
pass carries a zero term over the absent heads' parameters (mtl/strategies/absent.py), so DDP needs no
find_unused_parameters (``covers_unused_parameters``).
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel

from mtl.parallel.fsdp import is_sharded, local_shards, shard_index
from mtl.strategies.absent import absent_heads_term
from mtl.strategies.base import Strategy, gram_stats, weigh_heads_
from mtl.weighting.base import gram_matrix


class TaskGrads(Strategy):
    name = "task_grads"
    summary = "one backbone forward, a backbone backward per task, per-task rank-averaged shared gradients"
    task_gradients = True
    gradient_sources = ("parameters",)
    backbone_backwards = "K"  # one per task
    allreduces = "K"  # K - 1 rows by hand, each started as soon as it is computed; the last row and the heads by DDP
    covers_unused_parameters = True  # a zero term over the heads of the tasks a step leaves out

    def __init__(self, cfg):
        super().__init__(cfg)
        self._buf: torch.Tensor | None = None  # [K losses, G (K x P)], kept between steps
        self._shards: tuple | None = None  # FSDP2: ((parameter ids, device), shard_index on it, P), built once
        self._writers_key, self._writers = None, {}  # RowWriter per row of the buffer (_writer)

    @classmethod
    def allreduce_bytes(cls, num_tasks, shared_params, head_params, elem=4):
        return (num_tasks * shared_params + head_params + num_tasks) * elem  # G, the heads' gradients, the losses

    @classmethod
    def extra_memory_bytes(cls, num_tasks, shared_params, feature_numel, elem=4):
        # the K x P buffer (each row written in place, one parameter's gradient at a time), the leaf and its
        # per-task gradients
        return num_tasks * shared_params * elem + 3 * feature_numel * elem

    def _buffer(self, k: int, n: int, like: torch.Tensor) -> torch.Tensor:
        if self._buf is None or self._buf.numel() != k + k * n or self._buf.dtype != like.dtype \
                or self._buf.device != like.device:
            self._buf = torch.empty(k + k * n, dtype=like.dtype, device=like.device)
        return self._buf

    def _writer(self, i: int, shared: list, rows: torch.Tensor) -> RowWriter:
        """The ``RowWriter`` of row ``i`` of ``rows``, made once per buffer and parameter list."""
        key = (rows.data_ptr(), rows.shape, tuple(id(p) for p in shared))
        if self._writers_key != key:
            self._writers_key, self._writers = key, {}
        if i not in self._writers:
            self._writers[i] = RowWriter(shared, rows[i])
        return self._writers[i]

    def forward_backward(self, s):
        if is_sharded(s.model):
            return self._sharded(s)
        bare = s.model.module if isinstance(s.model, DistributedDataParallel) else s.model
        shared = [p for p in bare.backbone.parameters() if p.requires_grad]
        out = s.model(s.batch, feature_leaf=True)
        leaf, features, losses = out["leaf"], out["features"], out["losses"]
        k, n = len(s.tasks), sum(p.numel() for p in shared)
        buf = self._buffer(k, n, shared[0])
        loss_vec, rows = buf[:k], buf[k:].view(k, n)
        loss_vec.copy_(torch.stack([losses[t].detach() for t in s.tasks]))
        pending, zero = [], absent_heads_term(s.model, s.tasks)
        for i, t in enumerate(s.tasks):
            leaf.grad = None
            term = s.weigh(t, losses[t])
            # head t's pass (DDP marks head t ready, and the absent heads with the first); stops at the leaf
            s.scale(term if i or zero is None else term + zero).backward()
            if i == k - 1:
                features.backward(leaf.grad)  # through DDP: the last row and the heads, in its buckets
                break
            self._writer(i, shared, rows)(features, leaf.grad)  # row i, written in place
            # row i starts its all-reduce now (row 0 with the losses: one collective) and runs under the next passes
            pending.append(s.comm.start_all_reduce_mean_(buf[: k + n] if i == 0 else rows[i]))
        if k == 1:
            pending.append(s.comm.start_all_reduce_mean_(loss_vec))
        for p in shared:
            if p.grad is None:  # one process, a parameter the features do not depend on
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in shared]
        torch._foreach_copy_(list(torch.split(rows[k - 1], [p.numel() for p in shared])),
                             [x.reshape(-1) for x in grads])
        for p in pending:
            p.wait()
        tic = time.perf_counter()
        scale = s.loss_scale()  # fp16: the rows are scaled; a method sees them unscaled
        gram = gram_matrix(rows)
        if s.gram_weights is not None:
            w = s.gram_weights(gram / (scale * scale), loss_vec, rows.dtype).tolist()
        elif s.combine is None:  # loss-level weighting: the weighted rows just add up
            w = [1.0] * k
        else:  # a method that needs the rows
            w = None
            direction = s.combine(rows if scale == 1 else rows / scale, loss_vec) * scale
        if w is not None:
            add_weighted_rows_(grads, rows, w)
        else:
            copy_flat_(grads, direction)
        if s.head_weights is not None:  # weighting.heads: weighted (a Gram method: w is its weights)
            weigh_heads_(s.model, s.tasks, s.head_weights())
        if rows.is_cuda:
            torch.cuda.synchronize(rows.device)
        stats = {**(gram_stats(s.tasks, gram) if s.log_stats else {}),  # the trainer unscales them
                 "combine_s": time.perf_counter() - tic}
        return {t: v.detach() for t, v in losses.items()}, stats

    def _sharded(self, s):
        """FSDP2: each task's shard of its rank-averaged gradient; one K x K all-reduce (module docstring)."""
        shared = [p for p in s.model.backbone.parameters() if p.requires_grad]
        out = s.model(s.batch, feature_leaf=True)
        leaf, features, losses = out["leaf"], out["features"], out["losses"]
        k = len(s.tasks)
        grads = None
        for i, t in enumerate(s.tasks):
            leaf.grad = None
            s.scale(s.weigh(t, losses[t])).backward()  # head t's pass, reduce-scattered by FSDP2; stops at the leaf
            features.backward(leaf.grad, retain_graph=i < k - 1)  # task t's backbone pass: FSDP2 reduce-scatters it
            grads = local_shards(shared)  # this rank's shard of g_t (accumulated onto zeros)
            if i == 0:
                n = sum(g.numel() for g in grads)
                buf = self._buffer(k, n, grads[0])
                loss_vec, rows = buf[:k], buf[k:].view(k, n)
            torch.cat([g.reshape(-1) for g in grads], out=rows[i])
            if i < k - 1:
                torch._foreach_zero_(grads)  # the next pass starts from zero; .grad ends holding g_K's shard
        loss_vec.copy_(torch.stack([losses[t].detach() for t in s.tasks]))
        tic = time.perf_counter()
        scale = s.loss_scale()  # fp16: the rows are scaled; a method sees them unscaled
        direction, partial = None, rows.new_zeros(0)
        if s.gram_weights is None and s.combine is not None and s.combine_shard is None:
            raise RuntimeError("a method that needs the rows of G whole cannot run under parallel.engine=fsdp2 "
                               "(mtl.parallel.fsdp.check_method refuses it at config time)")
        if s.gram_weights is None and s.combine_shard is not None:  # a row method, exact per shard (GradDrop)
            index, total = self._shard_index(shared, rows.device)
            direction, partial = s.combine_shard(rows / scale, index, total)
            direction = direction * scale  # partial: sums over the unscaled rows already
        # ONE collective: the sum over ranks of the shards' Gram matrices, the mean of the losses, and the method's
        # partial sums; every rank then holds the same numbers
        world = s.comm.world_size()
        local = torch.cat([gram_matrix(rows).reshape(-1), loss_vec.double(), partial.reshape(-1).double()])
        reduced = s.comm.all_reduce_mean(local) * world  # float64: the sums (exactly, for W = 2^n)
        gram = reduced[: k * k].view(k, k)
        loss_avg = (reduced[k * k: k * k + k] / world).to(rows.dtype)
        if direction is not None:
            s.finish_shard(reduced[k * k + k:], gram / (scale * scale))
            copy_flat_(grads, direction)
        else:
            if s.gram_weights is not None:
                w = s.gram_weights(gram / (scale * scale), loss_avg, rows.dtype).tolist()
            else:  # loss-level weighting: the weighted rows just add up
                w = [1.0] * k
            add_weighted_rows_(grads, rows, w)  # .grad holds the last row's shard
        if rows.is_cuda:
            torch.cuda.synchronize(rows.device)
        stats = {**(gram_stats(s.tasks, gram) if s.log_stats else {}),  # the trainer unscales them
                 "combine_s": time.perf_counter() - tic}
        return {t: v.detach() for t, v in losses.items()}, stats

    def _shard_index(self, shared: list, device: torch.device) -> tuple[torch.Tensor, int]:
        """FSDP2: (this rank's coordinates in the full flat vector of ``shared``, on ``device``; P), built the first
        time and kept: the shards of the same parameters do not move between steps."""
        key = (tuple(id(p) for p in shared), device)
        if self._shards is None or self._shards[0] != key:
            total = sum(p.numel() for p in shared)  # a DTensor's numel is the full parameter's
            self._shards = (key, shard_index(shared).to(device), total)
        return self._shards[1], self._shards[2]


class RowWriter:
    """Writes a gradient with respect to ``shared`` straight into ``row`` (P,), flattened in order, without touching
    ``.grad`` (so DDP's hooks do not fire): ``writer(features, grad)``. Each parameter's gradient is copied into its
    slice of the row by a tensor hook as soon as autograd computes it, and the hook hands autograd a zero-stride zero
    in its place, so no P-sized set of fresh gradients is ever held at once. The slices and zeros are made once, for
    the row of a buffer kept between steps."""

    def __init__(self, shared: list[torch.Tensor], row: torch.Tensor):
        self.shared = list(shared)
        parts = torch.split(row, [p.numel() for p in self.shared])
        self.slices = [part.view_as(p) for part, p in zip(parts, self.shared)]
        zero = row.new_zeros(())
        self.zeros = [zero.expand_as(p) for p in self.shared]

    def __call__(self, features: torch.Tensor, grad: torch.Tensor) -> None:
        reached = [False] * len(self.shared)

        def hook_for(i: int):
            def hook(g):
                self.slices[i].copy_(g)
                reached[i] = True
                return self.zeros[i]

            return hook

        handles = [p.register_hook(hook_for(i)) for i, p in enumerate(self.shared)]
        try:
            torch.autograd.grad(features, self.shared, grad_outputs=grad, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for view, hit in zip(self.slices, reached):
            if not hit:  # a parameter the features do not reach: a zero slice
                view.zero_()


def add_weighted_rows_(grads: list[torch.Tensor], rows: torch.Tensor, w: list[float]) -> None:
    """``grads`` (which hold the last row, split like it) becomes sum_t w_t rows[t], in place."""
    sizes = [g.numel() for g in grads]
    torch._foreach_mul_(grads, w[-1])
    for i in range(len(w) - 1):
        torch._foreach_add_(grads, [v.view_as(x) for v, x in zip(torch.split(rows[i], sizes), grads)], alpha=w[i])


def copy_flat_(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``grads`` become the matching pieces of the flat vector ``flat`` (in their dtype)."""
    pieces = torch.split(flat.to(grads[0].dtype), [g.numel() for g in grads])
    torch._foreach_copy_(grads, [v.view_as(x) for v, x in zip(pieces, grads)])
