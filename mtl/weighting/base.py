"""What a task-weighting method is.

A method is one file in ``mtl/weighting/`` defining a subclass of one family with a ``name``. Each family shows
a method file only what that kind of method defines (the step keeps owning the backward passes):

- ``LossWeighting``: ``weigh``, ``end_step``, ``check`` and ``Options``;
- ``GramWeighting``: ``weights_from_gram`` (with ``check`` and ``Options``); ``SimplexGramWeighting``, one whose
  state is a point of the simplex over the tasks: ``simplex_step``;
- ``RowWeighting``: ``combine`` on the rows of G, and ``combine_shard`` for FSDP2 where that is exact;
- ``BilevelWeighting`` (mtl/weighting/bilevel.py): ``meta_step`` on a held-out batch, and ``weigh``.

``Weighting``, their common base, holds the task bookkeeping and the questions the step, the strategies and the
config check ask of any method (``grad_hooks``, ``gram_only``, ``fsdp2_problem``, ``wants_heldout``,
``meta_cost``), each answered by the family (a bilevel method states its own ``wants_heldout`` and ``meta_cost``).

Loss-level methods (``level = "loss"``) turn each task's loss into the term whose backward pass the
step runs: ``weigh(task, loss)``. They see only scalars, so they cost next to nothing under DDP; a
method whose term is nonlinear in the loss (gls, famo: log L) must use the rank-averaged loss value
(one scalar all-reduce in ``weigh``), or DDP's average of the ranks' gradients is not the gradient
of the global batch's objective. Every strategy calls ``weigh`` once per task, in task order, on
every rank, so such a collective is safe. Their
weights may depend on the step (``begin_step``) and on the rank-averaged losses of earlier steps
(``end_step``), but never on another task's *current* loss, which is what lets a strategy run one
backward pass per task.

Gradient-level methods (``level = "grad"``) combine the K x P matrix G of each task's *rank-averaged*
gradient of the shared parameters into one gradient: ``combine(grads, losses)``, the entry the
strategies call. Every method we ship returns ``w^T G`` with weights w (K,) that depend only on the
K x K Gram matrix ``G G^T`` (plus the losses and the method's state), so they subclass
``GramWeighting`` and define ``weights_from_gram``; see its docstring. A method that truly needs the
rows (per-coordinate signs, as GradDrop's; a K x P average kept between steps, as DB-MTL's) subclasses
``RowWeighting`` and defines ``combine`` itself.

Steps that hold only some tasks (multi-input mode, docs/multi-input.md): ``begin_step(step, present)`` names the
step's tasks, kept in ``self.present`` (every task when ``present`` is None; their positions in ``self.tasks`` in
``self.present_index``). A loss-level method then weighs only those tasks (``weigh`` is called for them only,
``end_step`` gets their losses only); a gradient-level method gets the K' x P rows of the present tasks only, in
task order, and combines them as the K'-task problem (its Gram matrix is K' x K'): an absent task is no row at all,
never a zero row, since a zero row changes most methods' answer (MGDA's min-norm point is then 0). ``weights()``
does not filter: it reports every task the method has a weight for (a method with a weight per task in its state:
every task, an absent one at its current value; a weight made for one step, a combination's coefficients or RLW's
draw: the step's tasks). ``step_weights()``, what the trainer logs, is the one filter to the present tasks: an
absent task has no weight in that step, and is left out rather than reported as 0. A method is allowed with policies
that leave tasks out (mtl/setup/multi_input.py, ``allows_absent_tasks()``) when its update reads the present tasks
only: loss-level methods whose ``end_step`` keeps nothing, and every method that sets
``updates_from_present_tasks = True``, which says that its state moves only from the present tasks (DWA, FAMO,
GradNorm) or that it keeps none (the stateless Gram methods). A method that does not says why in
``absent_task_refusal``, which the refusal quotes.

Any state (learned weights, loss history, RNG) lives in ``state_dict()`` so that it goes into
checkpoints: learnable weights as parameters or buffers, everything else through ``get_extra_state``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
from scipy.special import softmax
from torch import Tensor, nn

from mtl.config.keys import NoOptions, options_of
from mtl.weighting.checks import option_errors


def stream_seed(seed: int, step: int, salt: str) -> int:
    """A 63-bit seed for the random stream of (seed, step) of one method (``salt``), the same in every process:
    what a method that draws random numbers (rlw, pcgrad's order) seeds a ``torch.Generator`` with."""
    digest = hashlib.blake2b(f"{salt}:{int(seed)}:{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: int, salt: str, device=None) -> torch.Generator:
    """A ``torch.Generator`` (on ``device``) seeded with ``stream_seed(seed, step, salt)``: the same draws on every rank."""
    gen = torch.Generator(device=device) if device is not None else torch.Generator()
    return gen.manual_seed(stream_seed(seed, step, salt))


class Weighting(nn.Module):
    """What every method is, and what the step, the strategies and the config check ask of any method.

    A method file subclasses one family and overrides only that family's few members:
    ``LossWeighting`` (``weigh``, ``end_step``), ``GramWeighting`` (``weights_from_gram``), ``RowWeighting``
    (``combine``, and for FSDP2 ``combine_shard``), ``BilevelWeighting`` (mtl/weighting/bilevel.py: ``meta_step``),
    each with ``check`` and ``Options``. The queries below (``grad_hooks``, ``gram_only``, ``fsdp2_problem``,
    ``wants_heldout``, ``meta_cost``) answer from the family; a method file defines none of them but a bilevel
    method's own ``wants_heldout`` and ``meta_cost``.
    """

    name: str = ""
    level: str = "loss"  # "loss" | "grad"
    # The method's hyperparameters, ``weighting.options``: a dataclass with the paper's defaults (checked like
    # every config key; the filled values are saved in config.yaml). ``self.options`` is its instance.
    Options: type = NoOptions
    # correct when a step holds only some tasks (see the module docstring); else why not, for the config refusal
    updates_from_present_tasks: bool = False
    absent_task_refusal: str = ""
    # a bilevel method (mtl/weighting/bilevel.py): the trainer draws a held-out batch when ``wants_heldout(step)``
    needs_heldout_batch: bool = False

    def __init__(self, cfg, tasks: list[str]):
        super().__init__()
        self.tasks = list(tasks)
        self.present = list(self.tasks)  # the tasks of the current step (begin_step)
        self.present_index = list(range(len(self.tasks)))  # their positions in self.tasks
        self.step = 0  # the step begin_step was last called for (the trainer's step count before it)
        self.options = options_of(type(self).Options, cfg.weighting.get("options"), "weighting.options")

    # ------------------------------------------------------------------ what a method file defines

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this method (each one names the key and the fix): by default, the options given
        outside the ranges and choices its ``Options`` fields declare (mtl/weighting/checks.py). A method that
        checks more calls ``super().check(cfg)`` first."""
        return option_errors(cfg, cls.Options)

    def weigh(self, task: str, loss: torch.Tensor) -> torch.Tensor:
        """The term whose backward pass the step runs for ``task``."""
        return loss * self.weights()[task]

    def weights(self) -> dict[str, float]:
        """The current per-task weights, unfiltered (an absent task's too, where the method keeps one: see the
        module docstring); ``step_weights()`` is what the trainer logs."""
        return {t: 1.0 for t in self.tasks}

    def end_step(self, losses: dict[str, float]) -> None:
        """Called after the step with each present task's loss averaged over ranks (identical on every rank)."""

    # ------------------------------------------------------------------ what the step and the config check ask

    def begin_step(self, step: int, present: list[str] | None = None) -> None:
        """Called once before the step's forward passes, with the tasks the step holds (None: all of them): sets
        ``self.step``, ``self.present`` and ``self.present_index``. A subclass that overrides it calls
        ``super().begin_step(step, present)``."""
        self.step = int(step)
        if present is None and len(self.present) == len(self.tasks):
            return  # every task, as at the last step (the common case: nothing to rebuild)
        self.present = list(self.tasks) if present is None else [t for t in self.tasks if t in present]
        self.present_index = [self.tasks.index(t) for t in self.present]

    def step_weights(self) -> dict[str, float]:
        """``weights()`` of the step's present tasks only: the one filter (what the trainer logs; an absent task is
        left out)."""
        w = self.weights()
        return {t: w[t] for t in self.present if t in w}

    @classmethod
    def allows_absent_tasks(cls) -> bool:
        """Whether the method is correct on steps that hold only some tasks (module docstring): a loss-level method
        whose ``end_step`` keeps nothing, or one that sets ``updates_from_present_tasks``. The config check
        (mtl/setup/multi_input.py) refuses any other with a policy that leaves tasks out, quoting
        ``absent_task_refusal``."""
        return (cls.level == "loss" and cls.end_step is Weighting.end_step) or cls.updates_from_present_tasks

    def grad_hooks(self) -> dict[str, Callable | None]:
        """What a strategy calls to combine the task gradients, as the ``StepInputs`` fields of those names:
        ``combine`` (a gradient-level method), ``gram_weights`` (a Gram-only one's ``weights_for_gram``),
        ``combine_shard`` and ``finish_shard`` (one exact per FSDP2 shard), ``head_weights`` (a Gram method's
        ``weights_for_heads`` with ``weighting.heads: weighted``); None where the method has no such form (all five
        for a loss-level method)."""
        return dict.fromkeys(("combine", "gram_weights", "combine_shard", "finish_shard", "head_weights"))

    @classmethod
    def gram_only(cls) -> bool:
        """A gradient-level method that needs only the K x K Gram matrix (``weights_for_gram``), not the rows of G.
        Only such a method works with ``weighting.source: features``, which never forms the rows' update."""
        return False

    @classmethod
    def fsdp2_problem(cls) -> str | None:
        """Why this method cannot run under ``parallel.engine=fsdp2``, or None."""
        return None

    def wants_heldout(self, step: int) -> bool:
        """A bilevel method: whether step ``step`` begins with a meta update (the trainer draws a held-out batch)."""
        return False

    @classmethod
    def meta_cost(cls, num_tasks: int) -> dict:
        """What one meta update adds to a step with ``num_tasks`` tasks: forwards, backwards and gradient all-reduces
        over the whole model, and whole-model-sized tensors held (all 0 for a method without one: every method but
        the bilevel ones, mtl/weighting/bilevel.py)."""
        return {"meta_forwards": 0, "meta_backwards": 0, "meta_allreduces": 0, "meta_param_copies": 0}


class LossWeighting(Weighting):
    """A loss-level method: ``weigh(task, loss)`` gives the term whose backward pass the step runs, ``end_step``
    sees the rank-averaged losses after the step; with ``check`` and ``Options``, that is all such a file defines
    (module docstring)."""


class GradientWeighting(Weighting):
    """What the two gradient-level families (``RowWeighting``, ``GramWeighting``) share: the combination happens on
    the gradients, so ``weigh`` hands the loss on as it is, and ``weights()`` reports ``last_weights``, what the last
    combination set: one coefficient per present task (1.0 per task before the first)."""

    level = "grad"

    def __init__(self, cfg, tasks: list[str]):
        super().__init__(cfg, tasks)
        self.last_weights: Tensor | None = None  # the last combination's coefficients, one per present task

    def weigh(self, task: str, loss: Tensor) -> Tensor:
        return loss  # the combination happens on the gradients

    def weights(self) -> dict[str, float]:
        if self.last_weights is None:
            return {t: 1.0 for t in self.tasks}
        return dict(zip(self.present, self.last_weights.tolist()))


ROWS_REFUSAL = ("it needs the rows of G whole (it overrides combine), and under FSDP2 each rank holds only its "
                "columns of them")


def kept_rows_refusal(state: str) -> str:
    """``fsdp2_refusal`` of a row method that keeps ``state``, a K x P tensor, between steps."""
    return (f"its {state} is kept between steps; under FSDP2 it would be sharded with G, one part per rank, and the "
            "checkpoint holds a weighting's state as one full copy from rank 0")


class RowWeighting(GradientWeighting):
    """A gradient-level method that needs the rows of G themselves (per-coordinate signs, a K x P average kept
    between steps), not only their Gram matrix: it defines ``combine(grads, losses)``, (K', P) rank-averaged
    gradients of the present tasks -> the (P,) update, and works only where the strategy hands it the rows
    (``task_grads``).

    ``parallel.engine=fsdp2`` (``task_grads`` on sharded gradients, mtl/strategies/task_grads.py): each rank holds only
    its columns of G. Such a method runs only if its update is exact column by column: it defines
    ``combine_shard`` (and ``finish_shard``); any other says why not in ``fsdp2_refusal``."""

    fsdp2_refusal: str | None = None

    def combine(self, grads: Tensor, losses: Tensor | None) -> Tensor:
        """(K', P) rank-averaged gradients of the present tasks -> (P,) update direction."""
        raise NotImplementedError(f"{type(self).__name__} must define combine")

    def combine_shard(self, rows: Tensor, index: Tensor, total: int) -> tuple[Tensor, Tensor]:
        """FSDP2: this rank's columns of the update from its columns ``rows`` (K, n) of G, whose positions in the
        full (K, P) matrix are ``index`` (n,) of ``total`` = P. Returns (the (n,) columns of the update, a (J,)
        vector of partial sums that the strategy sums over the ranks, in the same collective as the Gram matrix,
        and hands to ``finish_shard``). Called only where ``shards_exactly()``."""
        raise NotImplementedError(f"{self.name} does not combine per shard")

    def finish_shard(self, sums: Tensor, gram: Tensor) -> None:
        """FSDP2: after ``combine_shard``, the partial sums summed over the ranks and the global Gram matrix (to
        record what ``weights()`` reports)."""

    @classmethod
    def shards_exactly(cls) -> bool:
        """A method whose update FSDP2 ranks can form on their own columns of G, exactly (see ``combine_shard``)."""
        return cls.combine_shard is not RowWeighting.combine_shard

    @classmethod
    def fsdp2_problem(cls) -> str | None:
        return None if cls.shards_exactly() else (cls.fsdp2_refusal or ROWS_REFUSAL)

    def grad_hooks(self) -> dict[str, Callable | None]:
        shards = self.shards_exactly()
        return {"combine": self.combine, "gram_weights": None,
                "combine_shard": self.combine_shard if shards else None,
                "finish_shard": self.finish_shard if shards else None, "head_weights": None}


def k_softmax(scores: list[float]) -> list[float]:
    """K * softmax(scores): weights that sum to the number of tasks K (DWA's and STCH's), stable for any scores."""
    return (len(scores) * softmax(np.asarray(scores, dtype=np.float64))).tolist()


def gram_matrix(grads: Tensor) -> Tensor:
    """The K x K Gram matrix ``grads @ grads.T`` in float64 (the product in float32 for lower precisions), exactly
    symmetric: a matrix product does not sum entry (i, j) in the order it sums (j, i), so the float32 product is
    asymmetric by up to ~1e-6 of its entries (issue 44), which no solver's optimality conditions can meet to 1e-12.
    The mean of the product and its transpose, taken in float64 (exact for float32 entries)."""
    g = grads.detach()
    g = g if g.dtype == torch.float64 else g.float()
    m = (g @ g.T).double()
    return (m + m.T) / 2


def gram_round_off(dtype: torch.dtype) -> float:
    """The relative round-off of a Gram matrix computed from rows of ``dtype``: float64's machine epsilon for
    float64 rows, float32's for anything else (``gram_matrix`` forms their product in float32). A solver's
    optimality conditions cannot be met more tightly than this relative to the entries."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def apply_weights(alpha: Tensor, grads: Tensor) -> Tensor:
    """``alpha @ grads`` in the grads' dtype (accumulated in float32 for lower precisions)."""
    if grads.dtype in (torch.float32, torch.float64):
        return alpha.to(device=grads.device, dtype=grads.dtype) @ grads
    return (alpha.to(device=grads.device, dtype=torch.float32) @ grads.float()).to(grads.dtype)


def all_finite(x: Tensor) -> bool:
    """Whether every entry of ``x`` is finite, from its smallest and largest entries (a NaN or an inf is one of
    them): a reduction with no temporary the size of ``x``, where ``torch.isfinite(x).all()`` makes two or three
    (it matters for the K x P rows and states of the row methods)."""
    if x.numel() == 0:
        return True
    lo, hi = x.aminmax()
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def gram_numpy(gram: Tensor) -> np.ndarray | None:
    """The Gram matrix as a float64 numpy array for the small K x K solvers, symmetrised (a Gram matrix given by a
    caller, or summed over ranks chunk by chunk, need not be exactly symmetric; ``gram_matrix``'s is); None if an
    entry is not finite."""
    m = gram.detach().cpu().double().numpy()
    return (m + m.T) / 2 if np.isfinite(m).all() else None


def like_gram(x, gram: Tensor) -> Tensor:
    """A solver's numpy result as a tensor with the Gram matrix's dtype and device."""
    return torch.as_tensor(np.asarray(x, dtype=np.float64), dtype=gram.dtype, device=gram.device)


def verify_present(method: Weighting, rows: int) -> None:
    """A step that named a subset of the tasks gave one row per present task (else the caller's rows are not the
    present tasks'). Without a subset the rows are not checked against the tasks (direct calls, tools)."""
    if len(method.present) < len(method.tasks) and rows != len(method.present):
        raise ValueError(f"{method.name}: {rows} task gradient rows for the {len(method.present)} present tasks "
                         f"{method.present}; call begin_step(step, present) with the step's tasks first")


class GramWeighting(GradientWeighting):
    """A gradient-level method whose update is ``w^T G`` with w a function of the Gram matrix ``G G^T``.

    A subclass defines ``weights_from_gram(gram, losses, dtype)``: ``gram`` is the K x K float64 Gram
    matrix of the task gradients, ``losses`` the (K,) rank-averaged losses (or None), ``dtype`` the dtype
    of the rows the Gram matrix was computed from (it sets the method's rank and round-off tolerances:
    float32 rows give Gram entries with ~1e-7 relative error); it returns w (K,). Its state (learned
    weights, RNG streams) stays on the module as for any ``Weighting``, and it may move that state
    (GradNorm steps its weights after returning them), so it is called exactly once per step.

    ``combine(grads, losses)`` computes the Gram matrix once (float64 on the K x K), calls
    ``weights_from_gram`` through ``weights_for_gram`` and returns ``w^T G`` in the grads' dtype. A gradient
    source that only has the Gram matrix (for example one all-reduced K x K matrix) calls
    ``weights_for_gram`` itself and forms the update however it can. ``weights()`` reports the last w
    (1.0 per task before the first combination), so the logged weights are the update's coefficients.

    A method that needs the rows themselves (GradDrop's per-coordinate signs, for example) overrides
    ``combine``; it then works only where the strategy hands it the rows (``task_grads``): ``gram_only()``
    says so from the class (it is False once ``combine`` is overridden), and the config check refuses such a
    method with ``weighting.source: features``.

    ``weighting.heads`` (read by every Gram method, ``reads``): ``unweighted`` (the default) leaves head t's gradient
    the gradient of its own loss; ``weighted`` multiplies it by w_t after the combination, as a backward pass of the
    weighted loss ``sum_t w_t L_t`` would (the Nash-MTL authors' code for Nash-MTL, MGDA and IMTL-G): the strategy
    calls ``weights_for_heads`` (``StepInputs.head_weights``) for the step's w. A method whose weights for the
    shared parameters are rescaled after solving (nashmtl's ``max_norm``, the authors' clip of the shared
    gradient only) reports the unrescaled ones for the heads (``head_weights_of``).
    """

    reads = ("weighting.heads",)  # shared keys it reads (mtl/config/read_rules.py)

    def __init__(self, cfg, tasks: list[str]):
        super().__init__(cfg, tasks)
        self.heads = str(cfg.weighting.get("heads", "unweighted"))

    def weights_from_gram(self, gram: Tensor, losses: Tensor | None, dtype: torch.dtype) -> Tensor:
        """(K, K) float64 Gram matrix -> (K,) weights w of the update ``w^T G``."""
        raise NotImplementedError(f"{type(self).__name__} must define weights_from_gram")

    @torch.no_grad()
    def weights_for_gram(self, gram: Tensor, losses: Tensor | None = None,
                         dtype: torch.dtype = torch.float32) -> Tensor:
        """The method's weights for ``gram`` (K' x K', the present tasks), recorded for ``weights()``."""
        verify_present(self, gram.shape[0])
        self.last_weights = self.weights_from_gram(gram, losses, dtype)
        return self.last_weights

    def head_weights_of(self, weights: Tensor) -> Tensor:
        """The weights of the heads for the step whose shared weights are ``weights`` (the same, unless a method
        rescales the shared ones after solving)."""
        return weights

    def weights_for_heads(self) -> Tensor:
        """(K',) the last combination's weights for the heads of the present tasks (``weighting.heads: weighted``)."""
        if self.last_weights is None:
            raise RuntimeError(f"{self.name}: weights_for_heads before any combination")
        return self.head_weights_of(self.last_weights)

    @classmethod
    def gram_only(cls) -> bool:
        return cls.combine is GramWeighting.combine

    @classmethod
    def fsdp2_problem(cls) -> str | None:  # Gram-only: one K x K all-reduce of the shards' local products
        return None if cls.gram_only() else ROWS_REFUSAL

    def grad_hooks(self) -> dict[str, Callable | None]:
        return {"combine": self.combine, "gram_weights": self.weights_for_gram if self.gram_only() else None,
                "combine_shard": None, "finish_shard": None,
                "head_weights": self.weights_for_heads if self.heads == "weighted" else None}

    @torch.no_grad()
    def combine(self, grads: Tensor, losses: Tensor | None = None) -> Tensor:
        return apply_weights(self.weights_for_gram(gram_matrix(grads), losses, grads.dtype), grads)


class SimplexGramWeighting(GramWeighting):
    """A Gram method whose state is a point of the simplex over the tasks, kept as the buffer ``state_name`` from the
    centre 1/K (MoDo's lambda, SDMGrad's w). It defines ``simplex_step(gram, point)`` -> (the weights w, the new
    point), for the present tasks' Gram matrix and their part of the state.

    On a step that holds only some tasks (``present_index``), ``point`` is the present tasks' part renormalised to
    sum 1, and the new point is written back at the same mass: the absent tasks' shares do not move, and the
    method over K tasks of which only S appear is the method over S."""

    updates_from_present_tasks = True  # its simplex state moves over the present tasks only (above)
    state_name = "point"

    def __init__(self, cfg, tasks: list[str]):
        super().__init__(cfg, tasks)
        k = len(self.tasks)
        self.register_buffer(self.state_name, torch.full((k,), 1.0 / k, dtype=torch.float64))

    def simplex_step(self, gram: Tensor, point: Tensor) -> tuple[Tensor, Tensor]:
        """(K', K') Gram matrix and (K',) point of the present tasks' simplex -> (weights w, the new point)."""
        raise NotImplementedError(f"{type(self).__name__} must define simplex_step")

    def weights_from_gram(self, gram, losses, dtype):
        state = getattr(self, self.state_name)
        if len(self.present_index) == state.shape[0]:
            weights, new = self.simplex_step(gram, state)
            state.copy_(new.to(state))
            return weights
        idx = torch.tensor(self.present_index, device=state.device)
        mass = state[idx].sum()
        weights, new = self.simplex_step(gram, state[idx] / mass)
        state[idx] = new.to(state) * mass
        return weights
