"""What a task-weighting method is.

A method is one file in ``mtl/weighting/`` defining a ``Weighting`` subclass with a ``name``.

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
rows (per-coordinate signs, as GradDrop's) subclasses ``Weighting`` with ``level = "grad"`` and
overrides ``combine`` itself.

Any state (learned weights, loss history, RNG) lives in ``state_dict()`` so that it goes into
checkpoints: learnable weights as parameters or buffers, everything else through ``get_extra_state``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor, nn

from mtl.config import NoOptions, options_of


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
    name: str = ""
    level: str = "loss"  # "loss" | "grad"
    # The method's hyperparameters, ``weighting.options``: a dataclass with the paper's defaults (checked like
    # every config key; the filled values are saved in config.yaml). ``self.options`` is its instance.
    Options: type = NoOptions

    def __init__(self, cfg, tasks: list[str]):
        super().__init__()
        self.tasks = list(tasks)
        self.options = options_of(type(self).Options, cfg.weighting.get("options"), "weighting.options")

    @classmethod
    def check(cls, cfg) -> list[str]:
        """Config errors specific to this method (each one names the key and the fix)."""
        return []

    def begin_step(self, step: int) -> None:
        """Called once before the step's forward passes."""

    def weigh(self, task: str, loss: torch.Tensor) -> torch.Tensor:
        """The term whose backward pass the step runs for ``task``."""
        return loss * self.weights()[task]

    def weights(self) -> dict[str, float]:
        """The current per-task loss weights (for the step and for logging)."""
        return {t: 1.0 for t in self.tasks}

    def end_step(self, losses: dict[str, float]) -> None:
        """Called after the step with each task's loss averaged over ranks (identical on every rank)."""

    def combine(self, grads: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """Gradient-level methods: (K, P) rank-averaged task gradients -> (P,) update direction."""
        raise NotImplementedError(f"{self.name} is a loss-level method")

    @classmethod
    def gram_only(cls) -> bool:
        """A gradient-level method that needs only the K x K Gram matrix (``weights_for_gram``), not the rows of G.
        Only such a method works with ``weighting.source: features``, which never forms the rows' update."""
        return False


def gram_matrix(grads: Tensor) -> Tensor:
    """The K x K Gram matrix ``grads @ grads.T`` in float64 (the product in float32 for lower precisions)."""
    g = grads.detach()
    g = g if g.dtype == torch.float64 else g.float()
    return (g @ g.T).double()


def apply_weights(alpha: Tensor, grads: Tensor) -> Tensor:
    """``alpha @ grads`` in the grads' dtype (accumulated in float32 for lower precisions)."""
    if grads.dtype in (torch.float32, torch.float64):
        return alpha.to(device=grads.device, dtype=grads.dtype) @ grads
    return (alpha.to(device=grads.device, dtype=torch.float32) @ grads.float()).to(grads.dtype)


def gram_numpy(gram: Tensor) -> np.ndarray | None:
    """The Gram matrix as a float64 numpy array for the small K x K solvers; None if an entry is not finite."""
    m = gram.detach().cpu().double().numpy()
    return m if np.isfinite(m).all() else None


def like_gram(x, gram: Tensor) -> Tensor:
    """A solver's numpy result as a tensor with the Gram matrix's dtype and device."""
    return torch.as_tensor(np.asarray(x, dtype=np.float64), dtype=gram.dtype, device=gram.device)


class GramWeighting(Weighting):
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
    """

    level = "grad"

    def __init__(self, cfg, tasks: list[str]):
        super().__init__(cfg, tasks)
        self._alpha: Tensor | None = None

    def weigh(self, task: str, loss: Tensor) -> Tensor:
        return loss  # the combination happens on the gradients

    def weights(self) -> dict[str, float]:
        """Coefficients of the last combination (d = sum_t w_t g_t); 1.0 before the first one."""
        if self._alpha is None:
            return {t: 1.0 for t in self.tasks}
        return dict(zip(self.tasks, self._alpha.tolist()))

    def weights_from_gram(self, gram: Tensor, losses: Tensor | None, dtype: torch.dtype) -> Tensor:
        """(K, K) float64 Gram matrix -> (K,) weights w of the update ``w^T G``."""
        raise NotImplementedError(f"{type(self).__name__} must define weights_from_gram")

    @torch.no_grad()
    def weights_for_gram(self, gram: Tensor, losses: Tensor | None = None,
                         dtype: torch.dtype = torch.float32) -> Tensor:
        """The method's weights for ``gram``, recorded for ``weights()``."""
        self._alpha = self.weights_from_gram(gram, losses, dtype)
        return self._alpha

    @classmethod
    def gram_only(cls) -> bool:
        return cls.combine is GramWeighting.combine

    @torch.no_grad()
    def combine(self, grads: Tensor, losses: Tensor | None = None) -> Tensor:
        return apply_weights(self.weights_for_gram(gram_matrix(grads), losses, grads.dtype), grads)
