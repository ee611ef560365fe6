"""The bilevel weighting methods (mtl/weighting/bilevel.py): Auto-Lambda's hypergradient against its paper's
definition on analytic problems, the held-out stream, the meta update's hygiene in a real trainer, the config's
refusals, and (slow) a bitwise resume across the held-out stream. The DDP parity is tests/test_bilevel_ddp.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtl.data.heldout import HeldoutStream
from mtl.data.loader import build_train_loader, set_epoch
from mtl.errors import DataError
from mtl.weighting import weighting_types
from mtl.weighting.autolambda import autolambda_hypergradient
from mtl.weighting.bilevel import adam_update, unrolled_hypergradients
from mtl.weighting.forum import forum_dual, forum_step, project_scaled_simplex
from mtl.weighting.moml import moml_direction

from .conftest import TINY
from .test_config import errors_of

BILEVEL = sorted(n for n, c in weighting_types().items() if c.needs_heldout_batch)


def _quad(theta, A, a):
    d = theta - a
    return 0.5 * d @ A @ d


def _spd(p, gen):
    m = torch.randn(p, p, generator=gen, dtype=torch.float64)
    return m @ m.T / p + 0.5 * torch.eye(p, dtype=torch.float64)


def _unrolled(task_losses, meta_loss, theta, lam, alpha):
    """The paper's definition by autograd: d/dlambda L_val(theta - alpha grad_theta sum_i lambda_i L_i(theta))."""
    lam = lam.clone().requires_grad_(True)
    th = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((lam * task_losses(th)).sum(), th, create_graph=True)
    (h,) = torch.autograd.grad(meta_loss(th - alpha * g), lam)
    return h


def _quadratic_problem(k=3, p=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A = [_spd(p, gen) for _ in range(k)]
    a = [torch.randn(p, generator=gen, dtype=torch.float64) for _ in range(k)]
    C, c = _spd(p, gen), torch.randn(p, generator=gen, dtype=torch.float64)
    theta = torch.randn(p, generator=gen, dtype=torch.float64)
    lam = torch.rand(k, generator=gen, dtype=torch.float64) + 0.1
    return (lambda th: torch.stack([_quad(th, A[i], a[i]) for i in range(k)]), lambda th: _quad(th, C, c),
            theta, lam, A, a, C, c)


def test_autolambda_hypergradient_is_the_unrolled_derivative_on_a_quadratic():
    """On quadratic losses the central difference is exact for any eps, so h equals the closed form
    -alpha grad L_i(theta) . grad L_val(theta') and the derivative through the virtual step, to rounding."""
    task_losses, meta_loss, theta, lam, A, a, C, c = _quadratic_problem()
    alpha = 0.1
    h, val = autolambda_hypergradient(task_losses, meta_loss, theta, lam, alpha, fd_eps=0.5)
    virtual = theta - alpha * sum(lam[i] * A[i] @ (theta - a[i]) for i in range(len(A)))
    closed = torch.stack([-alpha * (A[i] @ (theta - a[i])) @ (C @ (virtual - c)) for i in range(len(A))])
    assert torch.allclose(h, closed, rtol=1e-9, atol=1e-12), (h, closed)
    assert torch.allclose(h, _unrolled(task_losses, meta_loss, theta, lam, alpha), rtol=1e-9, atol=1e-12)
    assert float(val) == pytest.approx(float(meta_loss(virtual)), rel=1e-12)


def test_autolambda_finite_difference_converges_to_the_hessian_vector_product_as_eps_squared():
    """Non-quadratic losses: the error of the finite-difference hypergradient falls as eps^2 (central differences)."""
    gen = torch.Generator().manual_seed(1)
    p, k = 5, 2
    B = torch.randn(k, p, generator=gen, dtype=torch.float64) * 0.5
    D = torch.randn(p, generator=gen, dtype=torch.float64) * 0.5

    def task_losses(th):
        return torch.stack([torch.exp(B[i] @ th) + (th ** 4).sum() * (i + 1) / 10 for i in range(k)])

    def meta_loss(th):
        return torch.cosh(D @ th) + (th ** 2).sum()

    theta, lam, alpha = torch.randn(p, generator=gen, dtype=torch.float64), torch.tensor([0.3, 0.7]).double(), 0.05
    exact = _unrolled(task_losses, meta_loss, theta, lam, alpha)
    errors = [float((autolambda_hypergradient(task_losses, meta_loss, theta, lam, alpha, fd_eps=e)[0] - exact)
                    .abs().max() / exact.abs().max()) for e in (1e-1, 1e-2)]
    assert errors[1] < 1e-4 and errors[0] / errors[1] > 50, errors  # eps / 10 -> error / 100


def test_autolambda_raises_a_task_that_helps_the_held_out_objective_and_leaves_an_unrelated_one():
    """The paper's reading of lambda: a task whose gradient agrees with the held-out objective's gets a negative
    hypergradient (its weight grows); a task on other parameters (orthogonal gradients) gets exactly 0."""
    eye = torch.eye(2, dtype=torch.float64)

    def task_losses(th):  # task 0 on coordinates 0-1, task 1 on coordinates 2-3
        return torch.stack([_quad(th[:2], eye, torch.tensor([1.0, 2.0]).double()),
                            _quad(th[2:], eye, torch.tensor([-1.0, 0.5]).double())])

    def meta_loss(th):  # held-out data of task 0: a nearby optimum
        return _quad(th[:2], eye, torch.tensor([1.2, 1.8]).double())

    h, _ = autolambda_hypergradient(task_losses, meta_loss, torch.zeros(4).double(), torch.ones(2).double(), 0.1)
    assert h[0] < 0 and h[1] == 0, h


def test_autolambda_hypergradient_is_zero_when_the_held_out_gradient_is():
    task_losses, _, theta, lam, *_ = _quadratic_problem()
    h, _ = autolambda_hypergradient(task_losses, lambda th: 0.0 * th.sum(), theta, lam, 0.1)
    assert torch.equal(h, torch.zeros_like(lam))


def test_unrolled_hypergradients_give_one_row_per_held_out_objective():
    """MOML's H (M x K): each row is the unrolled derivative of one held-out objective; with one objective it is
    Auto-Lambda's hypergradient (the same function serves both)."""
    task_losses, meta_loss, theta, lam, A, a, C, c = _quadratic_problem(seed=3)
    gen = torch.Generator().manual_seed(9)
    C2, c2 = _spd(len(theta), gen), torch.randn(len(theta), generator=gen, dtype=torch.float64)
    metas = [meta_loss, lambda th: _quad(th, C2, c2)]
    H, values = unrolled_hypergradients(task_losses, lambda th: torch.stack([f(th) for f in metas]), theta, lam, 0.2,
                                        fd_eps=0.3)
    assert H.shape == (2, 3) and values.shape == (2,)
    for m, f in enumerate(metas):
        assert torch.allclose(H[m], _unrolled(task_losses, f, theta, lam, 0.2), rtol=1e-9, atol=1e-12), m
    h, _ = autolambda_hypergradient(task_losses, meta_loss, theta, lam, 0.2, fd_eps=0.3)
    assert torch.equal(h, H[0])


def test_moml_direction_is_mgdas_min_norm_point_of_the_hypergradients():
    """Orthogonal rows: the midpoint; opposed rows: 0 (a Pareto-stationary alpha stays); otherwise the min-norm
    point of the hull, which no objective's hypergradient opposes: <d, H_m> >= ||d||^2 for every row."""
    d, gamma = moml_direction(torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    assert torch.allclose(d, torch.tensor([0.5, 0.5], dtype=torch.float64)) and torch.allclose(gamma.sum(), torch.ones(
        (), dtype=torch.float64))
    d, _ = moml_direction(torch.tensor([[2.0, 1.0], [-2.0, -1.0]], dtype=torch.float64))
    assert d.abs().max() < 1e-12
    H = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    H[2] = -0.3 * H[0] + H[2]
    d, gamma = moml_direction(H)
    assert (gamma >= -1e-12).all() and abs(float(gamma.sum()) - 1) < 1e-9
    assert ((H @ d) >= (d @ d) - 1e-9).all(), (H @ d, d @ d)
    for t in torch.linspace(0, 1, 11, dtype=torch.float64):  # no point of the segment H_0..H_1 is shorter
        assert (t * H[0] + (1 - t) * H[1]).norm() >= d.norm() - 1e-9


def _forum_case(m=3, p=7, seed=0, k=2):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, p, generator=gen, dtype=torch.float64)  # the held-out gradients (grad F_m: omega part)
    gf = torch.randn(p, generator=gen, dtype=torch.float64)  # grad_omega f
    gap = torch.rand(k, generator=gen, dtype=torch.float64)  # L(omega) - L(omega_T): grad q's alpha part
    return g, gf, gap


def _forum_direction(g, gf, gap, rho):
    """FORUM's d over z = (alpha, omega), and the rows (grad F_1..M; grad q) in z-space."""
    rows = torch.cat([g, gf[None]])
    lam, nu, phi = forum_step(rows @ rows.T, gap, rho)
    zF = torch.cat([torch.zeros(len(g), len(gap), dtype=g.dtype), g], dim=1)  # F does not depend on alpha
    zq = torch.cat([gap, gf])
    return -(lam @ zF + nu * zq), zF, zq, lam, nu, phi


@pytest.mark.parametrize("seed", range(6))
def test_forum_direction_solves_the_papers_constrained_direction_problem(seed):
    """d = -(sum lam_m grad F_m + nu grad q) solves min_d max_m <grad F_m, d> + |d|^2/2 s.t. <grad q, d> <= -phi:
    it is feasible, its value equals the dual's (strong duality), and no feasible perturbation does better."""
    g, gf, gap = _forum_case(seed=seed)
    d, zF, zq, lam, nu, phi = _forum_direction(g, gf, gap, rho=0.3 + 0.5 * seed)
    assert (lam >= 0).all() and abs(float(lam.sum()) - 1) < 1e-9 and nu >= 0
    assert float(zq @ d) <= -phi + 1e-9 * (1 + phi)

    def primal(x):
        return float((zF @ x).max() + 0.5 * x @ x)

    dual = -0.5 * float(d @ d) + nu * phi
    assert primal(d) == pytest.approx(dual, rel=1e-7, abs=1e-9)
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(200):
        x = d + 0.1 * torch.randn(d.shape, generator=gen, dtype=d.dtype)
        slack = float(zq @ x) + phi
        if slack > 0:  # pull it back onto the feasible set along grad q
            x = x - (slack / float(zq @ zq)) * zq
        assert primal(x) >= primal(d) - 1e-9


def test_forum_multiplier_cases():
    """grad q orthogonal to every grad F: nu = rho/2 (the constraint alone sets it) and lam is MGDA's; grad q a
    multiple of a common descent direction with a slack constraint: nu = 0 and d is MGDA's direction."""
    g = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    gf, gap = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    _, _, _, lam, nu, _ = _forum_direction(g, gf, gap, rho=0.4)
    assert nu == pytest.approx(0.2) and torch.allclose(lam, torch.tensor([0.5, 0.5], dtype=torch.float64))
    _, _, _, lam, nu, _ = _forum_direction(g, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64) * 0.1, gap, rho=0.1)
    assert nu == 0 and torch.allclose(lam, torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_forum_dual_matches_a_grid_search():
    g, gf, gap = _forum_case(m=2, seed=4)
    rows = torch.cat([g, gf[None]])
    q = (rows @ rows.T).numpy().copy()
    q[-1, -1] += float(gap @ gap)
    phi = 0.05 * q[-1, -1]
    lam, nu = forum_dual(q, phi)
    best = np.inf
    for t in np.linspace(0, 1, 2001):  # lam = (t, 1 - t), nu at its closed-form optimum for that lam
        u = np.array([t, 1 - t, 0.0])
        u[2] = max(0.0, (phi - q[2, :2] @ u[:2]) / q[2, 2])
        best = min(best, 0.5 * u @ q @ u - u[2] * phi)
    u = np.array([*lam, nu])
    assert 0.5 * u @ q @ u - nu * phi <= best + 1e-9


def test_project_scaled_simplex():
    x = torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64)
    y = project_scaled_simplex(x, 3.0)
    assert (y >= 0).all() and float(y.sum()) == pytest.approx(3.0) and torch.allclose(project_scaled_simplex(y, 3.0), y)
    assert torch.allclose(y, torch.tensor([2.75, 0.0, 0.25], dtype=torch.float64))
    ones = torch.ones(4, dtype=torch.float64)
    assert torch.equal(project_scaled_simplex(ones, 4.0), ones)


def test_adam_update_is_adams_step():
    x, ref = torch.tensor([0.1, 0.1, 0.1]), torch.nn.Parameter(torch.tensor([0.1, 0.1, 0.1]))
    opt = torch.optim.Adam([ref], lr=1e-2)
    m, v = torch.zeros(3), torch.zeros(3)
    for t, g in enumerate([torch.tensor([1.0, -2.0, 0.0]), torch.tensor([0.5, 1.0, 3.0])], start=1):
        adam_update(x, g, m, v, t, 1e-2)
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(x, ref.detach(), rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------- held-out stream


class _Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"index": int(i)}


def _collate(records):
    return [r["index"] for r in records]


def test_the_held_out_part_is_the_last_items_and_the_train_loader_never_draws_them():
    ds, h = _Items(40), 12
    loader = build_train_loader(ds, lambda recs: [r["index"] for r in recs], 4, 0, 1, seed=0, heldout=h)
    seen = set()
    for epoch in range(3):
        set_epoch(loader, epoch)
        seen |= {i for batch in loader for i in batch}
    assert seen == set(range(40 - h))
    stream = HeldoutStream(ds, _collate, h, 4, 0, 1, seed=0)
    assert {i for _ in range(9) for i in stream.next_batch()} == set(range(40 - h, 40))


def test_two_ranks_draw_together_the_single_process_held_out_batches_and_resume_where_they_stopped():
    ds, h, b = _Items(50), 20, 3
    single = HeldoutStream(ds, _collate, h, 2 * b, 0, 1, seed=5)
    ranks = [HeldoutStream(ds, _collate, h, b, r, 2, seed=5) for r in range(2)]
    batches = []
    for step in range(7):  # 20 // 6 = 3 global batches per epoch: crosses two epoch boundaries
        one = single.next_batch()
        two = [r.next_batch() for r in ranks]
        assert sorted(one) == sorted(two[0] + two[1]) and not set(two[0]) & set(two[1]), step
        batches.append(one)
        if step == 3:
            state = single.state_dict()
    assert len({tuple(sorted(x)) for x in batches[:3]}) == 3 and batches[3] != batches[0]  # a new epoch's order
    again = HeldoutStream(ds, _collate, h, 2 * b, 0, 1, seed=5)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(3)] == batches[4:]
    assert again.state_dict() == {**single.state_dict()}
    with pytest.raises(DataError, match="data.heldout"):
        HeldoutStream(ds, _collate, h + 1, 2 * b, 0, 1, seed=5).load_state_dict(state)


def test_a_held_out_part_smaller_than_a_global_batch_is_refused():
    with pytest.raises(DataError, match="data.heldout=5 holds out fewer items than one global batch"):
        HeldoutStream(_Items(50), _collate, 5, 3, 0, 2, seed=0)
    with pytest.raises(DataError, match="leaves 4 of the 50 training items"):
        HeldoutStream(_Items(50), _collate, 46, 3, 0, 2, seed=0)


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("method", BILEVEL)
def test_the_config_refuses_what_a_bilevel_method_cannot_do(method):
    m = f"weighting.method={method}"
    (err,) = errors_of(TINY, [m])
    assert err.startswith("data.heldout:") and "data.heldout=32" in err
    (err,) = errors_of(TINY, [m, "data.heldout=16", "precision=fp16"])
    assert err.startswith("precision:") and "bf16" in err
    (err,) = errors_of(TINY, [m, "data.heldout=16", "parallel.engine=fsdp2", "ddp.strategy=feature_leaf"])
    assert err.startswith("weighting.method:") and "whole parameter vector" in err
    errs = errors_of("configs/multi_input.yaml", [m, "data.heldout=16"])
    assert any(e.startswith("data.per_task:") and "multi-input" in e for e in errs), errs
    (err,) = errors_of(TINY, [m, "data.heldout=256"])
    assert err.startswith("data.heldout: 256 is not fewer than data.synthetic.train_size")


def test_a_held_out_part_without_a_method_that_reads_it_is_refused():
    (err,) = errors_of(TINY, ["data.heldout=16"])
    assert err.startswith("data.heldout: 16 training items would be held out") and "autolambda" in err
    (err,) = errors_of(TINY, ["weighting.method=autolambda", "data.heldout=-1"])
    assert err == "data.heldout: must be >= 0 (got -1)"


def test_autolambda_primary_tasks_must_be_tasks():
    (err,) = errors_of(TINY, ["weighting.method=autolambda", "data.heldout=16", "weighting.options.primary=[cls,det]"])
    assert err.startswith("weighting.options.primary: 'det' not in tasks")


# ---------------------------------------------------------------------------------------------- in a trainer


def test_the_meta_update_moves_lambda_only_and_leaves_no_gradient(tmp_path):
    """In a real trainer: the meta update changes neither a parameter nor a .grad nor BatchNorm's statistics,
    and the step it precedes weighs the losses with the new lambda."""
    from mtl.parallel.dist import all_reduce_sum
    from mtl.run.step import restore_running_stats, snapshot_running_stats
    from mtl.run.trainer import Trainer
    from mtl.weighting.bilevel import MetaInputs

    tr = Trainer.from_config(TINY, [f"output_dir={tmp_path}", "weighting.method=autolambda", "data.heldout=32",
                                    "optim.warmup_steps=0", "model.backbone.norm=batch", "weighting.options.lr=0.01"])
    try:
        batch, heldout = next(tr.batches())[1], tr.feed.heldout.next_batch()
        for head in tr.bare.heads.values():
            head.prepare(batch, all_reduce_sum)
            head.prepare(heldout, all_reduce_sum)
        before = {k: v.clone() for k, v in tr.bare.state_dict().items()}
        stats_before = snapshot_running_stats(tr.bare)
        lam = tr.weighting.lam.clone()
        stats = tr.weighting.meta_step(MetaInputs(tr.bare, batch, heldout, tr.tasks, tr.scheduler.get_last_lr()[0]))
        assert all(p.grad is None for p in tr.bare.parameters())
        assert not torch.equal(tr.weighting.lam, lam) and set(stats) >= {"meta_heldout_loss", "meta_hypergrad/cls"}
        restore_running_stats(stats_before)  # what train_step does after it
        after = tr.bare.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        loss = torch.tensor(2.0)
        assert float(tr.weighting.weigh("gen", loss)) == pytest.approx(2.0 * float(tr.weighting.lam[1]))
        result = tr.step_once()
        assert result.stepped and "meta_heldout_loss" in result.stats
        assert tr.trainer_state()["heldout"]["samples"] == 16  # two held-out batches drawn
    finally:
        tr.close()


def test_forum_moves_the_model_along_its_direction(tmp_path):
    """One real FORUM step (SGD's first step is theta - lr grad): the model moves by -lr (nu sum_k alpha_k grad L_k +
    sum_m lam_m g_m), the weighted training gradient through the strategy plus the held-out term the step adds;
    the held-out term is handed over once."""
    from mtl.parallel.dist import all_reduce_sum
    from mtl.run.trainer import Trainer

    tr = Trainer.from_config(TINY, [f"output_dir={tmp_path}", "weighting.method=forum", "data.heldout=32",
                                    "optim.name=sgd", "optim.lr=0.05", "optim.warmup_steps=0", "optim.weight_decay=0",
                                    "optim.grad_clip=0", "optim.scheduler=constant"])
    try:
        w, seen = tr.weighting, {}
        take = w.meta_gradient

        def spy():
            seen["extra"] = take()
            seen["again"] = take()
            return seen["extra"]

        w.meta_gradient = spy
        batch = next(tr.batches())[1]
        before = [p.detach().clone() for p in tr.bare.parameters() if p.requires_grad]
        tr.step_once(batch)
        assert seen["extra"] is not None and seen["again"] is None
        for head in tr.bare.heads.values():
            head.prepare(batch, all_reduce_sum)
        params = [p for p in tr.bare.parameters() if p.requires_grad]
        with torch.no_grad():
            moved = [p.detach().clone() for p in params]
            for p, b in zip(params, before):
                p.copy_(b)
        losses = tr.bare(batch)["losses"]
        grads = torch.autograd.grad(sum(w.coef[i] * losses[t] for i, t in enumerate(w.tasks)), params)
        expected = torch.cat([g.reshape(-1) for g in grads]) + seen["extra"]
        step = torch.cat([(b - m).reshape(-1) for b, m in zip(before, moved)]) / 0.05
        # float32 parameters ~1 moved by lr * step: the step recovered from them carries ~|theta| 6e-8 / lr rounding
        tol = 4 * float(torch.cat([b.reshape(-1) for b in before]).abs().max()) * 6e-8 / 0.05
        assert float((step - expected).abs().max()) <= tol, (float((step - expected).abs().max()), tol)
        assert float(seen["extra"].norm()) > 0.1 * float(expected.norm())  # the held-out term is not negligible
    finally:
        tr.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in BILEVEL if m != "autolambda"])  # autolambda: SIGKILL-tested, 2 ranks
def test_a_resumed_bilevel_run_ends_bitwise_equal_to_an_unbroken_one(tmp_path, method):
    """Cut at step 3 and resumed: the same bytes at step 5 as the unbroken run, through the held-out stream's
    position (16 held-out items = 2 global batches of 8: the stream changes epoch between the legs) and the
    method's own meta state. Auto-Lambda's is proven by tests/test_reliability.py (SIGKILL of a 2-process run)."""
    import train

    common = ["--config", TINY, f"weighting.method={method}", "data.heldout=16", "checkpoint.every_steps=3",
              "trainer.eval_every=1000", "trainer.progress=false", "optim.scheduler=constant", "optim.warmup_steps=0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train.main([*common, f"output_dir={whole}", "trainer.max_steps=5"]) == 0
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=3"]) == 0
    state = torch.load(cut / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=True)
    assert state["heldout"] == {"epoch": 1, "samples": 8, "size": 16}
    assert train.main([*common, f"output_dir={cut}", "trainer.max_steps=5", "resume=auto"]) == 0
    a = (whole / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    assert a == (cut / "checkpoints" / "step_5" / "model.safetensors").read_bytes()
    wa = torch.load(whole / "checkpoints" / "step_5" / "trainer_state.pt", weights_only=True)["weighting"]
    wb = torch.load(cut / "checkpoints" / "step_5" / "trainer_state.pt", weights_only=True)["weighting"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) if torch.is_tensor(wa[k]) else wa[k] == wb[k]
                                          for k in wa)


def test_the_benchmark_gives_a_bilevel_method_its_held_out_items_and_states_its_cost():
    """bench.methods accepts a bilevel method: the tool sets data.heldout on its runs (a tenth of the synthetic
    training set in whole global batches, or bench.heldout), the run's own config check accepts them, the method's
    refusals reach the sweep's config check, and the cost note names its extra passes."""
    from mtl.setup.checks import load_run_config
    from mtl.tools.bench.sweep import meta_cost_note, method_errors, plan

    cfg = load_run_config(TINY, ["bench.methods=[equal, autolambda, 'autolambda(update_every=2)']", "bench.seeds=[0]",
                                 "bench.baselines=false"])
    assert method_errors(cfg) == []
    runs = {r["label"]: r for r in plan(cfg)}
    assert "data.heldout=32" in runs["autolambda"]["overrides"]  # 256 // 10 = 25 -> whole batches of 8
    assert not any(o.startswith("data.heldout") for o in runs["equal"]["overrides"])
    assert load_run_config(TINY, runs["autolambda(update_every=2)"]["overrides"]).data.heldout == 32
    assert "data.heldout=24" in plan(load_run_config(TINY, ["bench.methods=[autolambda]", "bench.seeds=[0]",
                                                            "bench.baselines=false", "bench.heldout=24"]))[0]["overrides"]
    bad = load_run_config(TINY, ["bench.methods=[autolambda]", "precision=bf16", "bench.heldout=4"])
    assert method_errors(bad) == []  # bf16 runs; a too small held-out part is the run's DataError, at its start
    fp16 = load_run_config(TINY, ["bench.methods=[equal]", "precision=fp16"])
    (err,) = method_errors(fp16, ["autolambda"])
    assert err.startswith("bench.methods[0] 'autolambda': precision:")
    note = meta_cost_note(weighting_types()["autolambda"], {"update_every": 2}, 32, 2)
    assert note.startswith("+4 forwards and +2 backward passes") and "once every 2 steps" in note and "32 held-out" in note
