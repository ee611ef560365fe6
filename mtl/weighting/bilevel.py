"""What the bilevel weighting methods share: a meta update of the task weights on a held-out batch.

A bilevel method (Auto-Lambda, FORUM, MOML) sets ``needs_heldout_batch = True``. At the steps it chooses
(``wants_heldout(step)``) the trainer draws one global batch of held-out training items (``data.heldout``,
mtl/data/heldout.py) and ``train_step`` calls ``meta_step(MetaInputs)`` after the heads' ``prepare`` of both
batches and before the strategy's forward passes; the real step then weighs the losses with the updated weights
(these methods are loss-level). A method whose model update has a term beyond the weighted losses' gradient
(FORUM: the held-out gradients) returns it from ``meta_gradient()``, and ``train_step`` adds it to ``.grad`` after
the backward passes (rank-averaged already, so the replicas stay equal). The class declares what a meta update costs (``meta_forwards``,
``meta_backwards``, ``meta_allreduces``, ``meta_param_copies``; ``BilevelWeighting.meta_cost``), which the benchmark's
cost table shows.

Exact under DDP, 2 processes x B == 1 process x 2B:
- the meta update never runs through the DDP wrapper: it evaluates the bare model at parameter vectors of its
  own with ``torch.func.functional_call`` (``ModelVector``) and takes gradients with ``torch.autograd.grad``,
  so DDP's reducer sees no backward pass and no ``.grad`` is written during it (the real step starts from zero
  gradients);
- every gradient it uses (of the training objective, of the held-out objective) is all-reduced by hand to the
  mean over the ranks, which is the global batch's gradient (each rank's loss is its share of the global mean,
  docs/extending.md), and so is every loss value it uses: the parameters it evaluates at, and the weights it
  ends with, are the same on every rank and the same as a single process's on the global batch;
- the forwards it runs in training mode would move BatchNorm's running statistics: ``train_step`` puts them
  back after it.

Refused by ``check`` (exit 2, naming the key and the fix): no ``data.heldout``; multi-input mode
(``data.per_task``: each task has its own data set, and no held-out part of them is defined); ``parallel.engine=fsdp2``
(the meta update needs the whole parameter vector on every rank; ``fsdp2_problem``); ``precision=fp16`` (the meta update's
backward passes have no loss scaling, so a small held-out gradient underflows; bf16 and fp32 run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call

from mtl.parallel.dist import Comm
from mtl.weighting.base import LossWeighting
from mtl.weighting.checks import option_range_errors


@dataclass
class MetaInputs:
    model: nn.Module  # the bare MultiTaskModel, never the DDP wrapper
    batch: dict  # the step's training batch (its heads' ``prepare`` has run)
    heldout: dict  # this rank's share of the global held-out batch (``prepare`` has run)
    tasks: list  # the step's tasks
    lr: float  # the optimizer's current learning rate: the virtual step's size
    comm: Comm = field(default_factory=Comm)  # rank averages (counted by the tools)


class ModelVector:
    """The trainable parameters of ``model`` as one flat vector, and the model's per-task losses at any such
    vector (``losses``), differentiable in it; the module's own parameters are read, never written."""

    def __init__(self, model: nn.Module):
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.params = [p for _, p in named]

    def vector(self) -> Tensor:
        """The current parameters, flattened (a detached copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def losses(self, theta: Tensor, batch: dict, tasks: list) -> Tensor:
        """(len(tasks),) this rank's loss of each task on ``batch`` with the parameters ``theta``."""
        pieces = torch.split(theta, self.sizes)
        params = {n: x.view(s) for n, x, s in zip(self.names, pieces, self.shapes)}
        out = functional_call(self.model, params, (batch,), {"tasks": list(tasks)})["losses"]
        return torch.stack([out[t] for t in tasks])


def add_to_grads_(model: nn.Module, flat: Tensor) -> None:
    """Add ``flat`` (ModelVector's order) to the trainable parameters' ``.grad`` in place (DDP's bucket views stay)."""
    params = ModelVector(model).params
    for p, piece in zip(params, torch.split(flat, [q.numel() for q in params])):
        piece = piece.view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.add_(piece)


def flat_grad(loss: Tensor, theta: Tensor, mean: Callable[[Tensor], Tensor]) -> Tensor:
    """The rank-averaged gradient of ``loss`` (this rank's share of the global objective) w.r.t. ``theta``."""
    (g,) = torch.autograd.grad(loss, theta, materialize_grads=True)
    return mean(g.detach())


def unrolled_hypergradients(task_losses: Callable[[Tensor], Tensor], meta_losses: Callable[[Tensor], Tensor],
                            theta: Tensor, lam: Tensor, alpha: float, fd_eps: float,
                            mean: Callable[[Tensor], Tensor] = lambda t: t) -> tuple[Tensor, Tensor]:
    """(H, values): the one-step unrolled hypergradients of M held-out objectives w.r.t. the K task weights, and
    the objectives' values at theta'. The lower level is ``L_tr(theta, lam) = sum_k lam_k L_k(theta)``
    (``task_losses(theta)`` -> (K,)), unrolled one gradient step; the upper level is ``meta_losses(theta')`` -> (M,)::

        theta' = theta - alpha g,   g = grad_theta L_tr(theta, lam)
        H_mk = d F_m(theta') / d lam_k = -alpha grad L_k(theta) . v_m,   v_m = grad F_m(theta')
             ~ -alpha (L_k(theta + eps_m v_m) - L_k(theta - eps_m v_m)) / (2 eps_m),   eps_m = fd_eps / ||v_m||

    (the Hessian-vector product by central differences, as in DARTS; exact for quadratic L_k). Both callables
    return this rank's share of the global objective; ``mean`` averages over the ranks (identity in one
    process): g, every v_m and every loss value used is rank-averaged. A zero v_m gives a zero row."""
    theta = theta.detach().requires_grad_(True)
    g = flat_grad((lam.detach().to(theta.dtype) * task_losses(theta)).sum(), theta, mean)
    virtual = (theta.detach() - alpha * g).requires_grad_(True)
    values = meta_losses(virtual)
    m = values.shape[0]
    vs = mean(torch.stack([torch.autograd.grad(values[i], virtual, retain_graph=i + 1 < m, materialize_grads=True)[0]
                           for i in range(m)]).detach())
    values = mean(values.detach())
    norms = vs.norm(dim=1)
    live = norms > 0
    eps = torch.where(live, fd_eps / norms.clamp(min=torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))
    with torch.no_grad():
        base = theta.detach()
        diffs = [torch.cat([task_losses(base + eps[i] * vs[i]), task_losses(base - eps[i] * vs[i])]).double()
                 if bool(live[i]) else torch.zeros(2 * len(lam), dtype=torch.float64, device=base.device)
                 for i in range(m)]
        both = mean(torch.stack(diffs))  # (M, 2K): one collective; v_m is rank-averaged, so every rank branches alike
        k = len(lam)
        h = -alpha * (both[:, :k] - both[:, k:]) / (2 * torch.where(live, eps, torch.ones_like(eps)).double()[:, None])
        h = torch.where(live[:, None], h, torch.zeros_like(h))
    return h.to(lam.dtype), values


def adam_update(x: Tensor, grad: Tensor, m: Tensor, v: Tensor, t: int, lr: float,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
    """One Adam step on ``x`` in place (moments ``m``, ``v`` in place; ``t`` counts this step): the optimizer the
    bilevel methods' papers update their task weights with."""
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
    x.sub_(lr * m_hat / (v_hat.sqrt() + eps))


class BilevelWeighting(LossWeighting):
    """A loss-level method whose task weights move by a meta update on a held-out batch (module docstring). A file
    defines ``meta_step`` (and ``wants_heldout``, ``meta_gradient`` where it has them), the cost counts below,
    ``weigh``, ``check`` and ``Options``."""

    needs_heldout_batch = True
    # What one meta update costs, beyond the step itself, in passes over the whole model (the cost tables read
    # these, never a method's name):
    meta_forwards: int = 0
    meta_backwards: int = 0
    meta_allreduces: int = 0  # all-reduces of a whole-model gradient (P numbers) under DDP
    meta_param_copies: int = 0  # whole-model-sized tensors (P numbers) held during the meta update
    absent_task_refusal = ("its meta-objective is defined over a held-out part of one shared training set, and "
                           "multi-input mode gives each task its own data set")
    fsdp2_refusal = "its meta update needs the whole parameter vector on every rank, and FSDP2 shards it"

    @classmethod
    def check(cls, cfg) -> list[str]:
        errors = []
        n = cls.name
        if int(cfg.data.get("heldout") or 0) == 0:  # a negative value is refused by mtl/setup/checks.py
            errors.append(f"data.heldout: weighting.method={n} evaluates its meta-objective on training items the "
                          "model does not train on; set data.heldout to how many of them to hold out (at least one "
                          "global batch, data.batch_size x the number of processes; e.g. data.heldout="
                          f"{4 * int(cfg.data.batch_size)})")
        if cfg.data.get("per_task"):
            errors.append(f"data.per_task: weighting.method={n} does not run in multi-input mode: "
                          f"{cls.absent_task_refusal}; remove data.per_task or choose another method")
        if cfg.precision == "fp16":
            errors.append(f"precision: weighting.method={n} does not run with fp16: its meta update's backward "
                          "passes have no loss scaling; use precision=bf16 or fp32")
        primary = (cfg.weighting.get("options") or {}).get("primary") or []  # every method's meta-objective tasks
        unknown = [t for t in primary if t not in cfg.tasks]
        if unknown:
            errors.append(f"weighting.options.primary: {', '.join(map(repr, unknown))} not in tasks "
                          f"({', '.join(cfg.tasks)}); name the meta-objective's tasks among them, or [] for every task")
        return errors + super().check(cfg)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        # the tasks of the meta-objective (``weighting.options.primary``; empty: every task), in task order
        self.primary = [t for t in self.tasks if t in self.options.primary] or list(self.tasks)

    @classmethod
    def allows_absent_tasks(cls) -> bool:  # its check above refuses multi-input mode as a whole
        return False

    @classmethod
    def fsdp2_problem(cls) -> str | None:  # parallel.engine=fsdp2 is refused with this reason (mtl/parallel/fsdp.py check_method)
        return cls.fsdp2_refusal

    def meta_step(self, meta: MetaInputs) -> dict:
        """The meta update (``MetaInputs``), before the step's forward passes; returns statistics to log."""
        raise NotImplementedError(f"{type(self).__name__} must define meta_step")

    def meta_gradient(self) -> Tensor | None:
        """After ``meta_step``: a term of the model's update beyond the gradient of the weighted losses (FORUM's
        held-out gradients), as one flat rank-averaged vector over the trainable parameters in ``ModelVector``'s
        order, which ``train_step`` adds to ``.grad`` after the backward passes; None (the default) for none.
        Returned once per meta update."""
        return None

    @classmethod
    def meta_cost(cls, num_tasks: int) -> dict:
        """A method whose cost grows with the tasks overrides it."""
        return {"meta_forwards": cls.meta_forwards, "meta_backwards": cls.meta_backwards,
                "meta_allreduces": cls.meta_allreduces, "meta_param_copies": cls.meta_param_copies}


class LearnedLambda(BilevelWeighting):
    """Task weights lambda (K,) that move by Adam along a meta direction every ``update_every`` steps, starting at
    ``init`` (Auto-Lambda, MOML). A subclass's ``meta_step`` computes the direction and calls ``adam_step``; its
    Options has ``init``, ``lr``, ``update_every`` and ``fd_eps``."""

    @classmethod
    def check(cls, cfg):
        return super().check(cfg) + option_range_errors(cfg, {
            "init": (lambda v: v > 0, "must be > 0"), "lr": (lambda v: v > 0, "must be > 0"),
            "update_every": (lambda v: v >= 1, "must be >= 1"), "fd_eps": (lambda v: v > 0, "must be > 0")})

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer("lam", torch.full((k,), float(self.options.init)))
        self.register_buffer("adam_m", torch.zeros(k))
        self.register_buffer("adam_v", torch.zeros(k))
        self.adam_t = 0

    def wants_heldout(self, step):
        return step % int(self.options.update_every) == 0

    def adam_step(self, direction: Tensor) -> None:
        """One Adam step of lambda along ``direction`` (rank-averaged, so the same on every rank); none when it is
        not finite (the same decision on every rank)."""
        if bool(torch.isfinite(direction).all()):
            with torch.no_grad():
                self.adam_t += 1
                adam_update(self.lam, direction, self.adam_m, self.adam_v, self.adam_t, float(self.options.lr))

    def weigh(self, task, loss):
        return self.lam[self.tasks.index(task)] * loss

    def weights(self):
        return dict(zip(self.tasks, self.lam.tolist()))

    def get_extra_state(self):
        return {"adam_t": self.adam_t}

    def set_extra_state(self, state):
        self.adam_t = int(state["adam_t"])
