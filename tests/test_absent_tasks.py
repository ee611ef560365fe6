"""Weighting methods on steps that hold only some tasks (multi-input mode, mtl/weighting/base.py, docs/multi-input.md).

- A method told ``begin_step(step, present)`` on the present tasks' rows gives exactly what the same method
  built for those tasks alone gives, step after step (stateless Gram methods, GradDrop, GradVac, GradNorm, FAMO,
  DWA); an absent task's state does not move.
- A zero row is not "no task": MGDA with a zero row for the absent task has no update at all.
- FAMO's and GradNorm's subset updates against hand computations (plain floats, not the modules' functions).
- The config check allows exactly the methods that declare present-only updates, and names the others' reasons.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtl.setup.multi_input import present_only_methods
from mtl.weighting import weighting_types

from .weighting_cases import make, random_grads

ALL, PRESENT = ["a", "b", "c", "d"], ["a", "c", "d"]  # task b is absent from every step
STATELESS = ["mgda", "pcgrad", "cagrad", "imtlg", "upgrad", "alignedmtl", "fairgrad", "dualproj", "config"]
STATEFUL_GRAD = ["graddrop", "gradvac", "gradnorm", "nashmtl", "modo", "sdmgrad", "dbmtl", "excessmtl"]


def _state(m) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in m.state_dict().items()}


@pytest.mark.parametrize("name", STATELESS + STATEFUL_GRAD)
def test_a_gradient_method_on_the_present_tasks_is_the_method_on_those_tasks_alone(name):
    sub, alone = make(name, seed=5, tasks=ALL), make(name, seed=5, tasks=PRESENT)
    for step in range(4):
        g = random_grads(len(PRESENT), 40, step)
        g[1] = -0.6 * g[0] + 0.5 * g[1]  # a conflict, so the methods differ from the plain sum
        losses = torch.tensor([1.0 + 0.1 * step, 2.0 - 0.2 * step, 0.5 + 0.05 * step], dtype=torch.float64)
        sub.begin_step(step, PRESENT)
        alone.begin_step(step)
        d_sub, d_alone = sub.combine(g, losses), alone.combine(g, losses)
        torch.testing.assert_close(d_sub, d_alone, rtol=1e-12, atol=1e-12)
        assert sub.step_weights() == pytest.approx(alone.step_weights(), rel=1e-12)
        assert set(sub.step_weights()) == set(PRESENT)  # the absent task has no weight in the step, not a 0
        sub.end_step(dict(zip(PRESENT, losses.tolist())))
        alone.end_step(dict(zip(PRESENT, losses.tolist())))


def test_a_zero_row_is_not_an_absent_task():
    """MGDA's min-norm point of {g_a, 0, g_c} is 0: a zero row for the absent task would stop the step."""
    g = random_grads(2, 30, 1)
    with_zero = torch.stack([g[0], torch.zeros_like(g[0]), g[1]])
    m = make("mgda", tasks=["a", "b", "c"])
    m.begin_step(0)
    assert m.combine(with_zero).norm() < 1e-9 * g.norm()
    m.begin_step(1, ["a", "c"])
    assert m.combine(g).norm() > 1e-3 * g.norm()


def test_rows_that_are_not_the_present_tasks_are_refused():
    m = make("mgda", tasks=["a", "b", "c"])
    m.begin_step(0, ["a", "c"])
    with pytest.raises(ValueError, match="3 task gradient rows for the 2 present tasks"):
        m.combine(random_grads(3, 10, 0))


@pytest.mark.parametrize("name, buffers", [("gradvac", None), ("gradnorm", ["task_weights", "adam_m", "adam_v",
                                                                             "adam_t"]),
                                           ("famo", ["logits", "adam_m", "adam_v"]), ("modo", ["lambd"]),
                                           ("sdmgrad", ["w"]), ("excessmtl", ["task_weights"])])
def test_the_absent_tasks_state_does_not_move(name, buffers):
    m = make(name, tasks=ALL)
    before = _state(m)
    for step in range(4):
        m.begin_step(step, PRESENT)
        g = random_grads(3, 20, step)
        if m.level == "grad":
            m.combine(g)
        m.end_step({t: 1.0 / (step + 1) + i for i, t in enumerate(PRESENT)})
    after = _state(m)
    b = ALL.index("b")
    if name == "gradvac":  # row and column b of the K x K targets
        assert torch.equal(after["targets"][b], before["targets"][b])
        assert torch.equal(after["targets"][:, b], before["targets"][:, b])
        assert not torch.equal(after["targets"], before["targets"])
        return
    for key in buffers:
        assert after[key][b] == before[key][b], key
        assert not torch.equal(after[key], before[key]), key  # the present tasks' did move
    if name in ("modo", "sdmgrad"):  # the present part keeps its mass: the absent share is unchanged
        return
    if name == "excessmtl":  # b's accumulator row never filled, its normaliser never recorded
        assert not m.accum[b].any() and math.isnan(float(m.normaliser[b]))
        return
    extra = m.get_extra_state()
    assert all(v[b] is None for k, v in extra.items() if "losses" in k)  # never observed
    if name == "famo":
        assert extra["adam_t"] == [3, 0, 3, 3]


def test_famo_subset_update_by_hand():
    lr, gamma, b1, b2, eps = 0.025, 1e-3, 0.9, 0.999, 1e-8
    m = make("famo", tasks=["a", "b", "c"])
    steps = [({"a": 2.0, "b": 3.0, "c": 4.0}), ({"a": 1.5, "b": 2.0}), ({"b": 1.8, "c": 3.0})]
    for i, losses in enumerate(steps):
        m.begin_step(i, list(losses))
        m.end_step(losses)
    # step 1 ({a, b}): both seen at step 0; softmax over (0, 0); first Adam step of each: xi -= lr * g / (|g| + eps)
    da, db = math.log(2.0) - math.log(1.5), math.log(3.0) - math.log(2.0)
    ga = 0.5 * (da - 0.5 * (da + db))
    xa, xb = -lr * ga / (abs(ga) + eps), -lr * (-ga) / (abs(ga) + eps)
    ma, va = (1 - b1) * -ga, (1 - b2) * ga * ga  # b's moments after its first step (its g is -ga)
    # step 2 ({b, c}): b's second Adam step, c's first; softmax over (xb, 0)
    zb = math.exp(xb) / (math.exp(xb) + 1.0)
    zc = 1.0 - zb
    db2, dc2 = math.log(2.0) - math.log(1.8), math.log(4.0) - math.log(3.0)
    mean = zb * db2 + zc * dc2
    gb, gc = zb * (db2 - mean) + gamma * xb, zc * (dc2 - mean)
    mb, vb = b1 * ma + (1 - b1) * gb, b2 * va + (1 - b2) * gb * gb
    xb2 = xb - lr * (mb / (1 - b1**2)) / (math.sqrt(vb / (1 - b2**2)) + eps)
    xc = -lr * gc / (abs(gc) + eps)
    assert m.logits.tolist() == pytest.approx([xa, xb2, xc], rel=1e-5, abs=1e-9)
    assert m.get_extra_state() == {"adam_t": [1, 2, 1], "prev_losses": [1.5, 1.8, 3.0]}
    # the next step's coefficients over {a, c}: c z with z = softmax(xa, xc), c from their last observations
    m.begin_step(3, ["a", "c"])
    za = math.exp(xa) / (math.exp(xa) + math.exp(xc))
    c = 1.0 / (za / 1.5 + (1 - za) / 3.0)
    coef = m._coefficients()
    assert set(coef) == {"a", "c"}
    assert [float(coef["a"]), float(coef["c"])] == pytest.approx([c * za, c * (1 - za)], rel=1e-5)
    assert m.step_weights() == pytest.approx({"a": za, "c": 1 - za}, rel=1e-5)


def test_gradnorm_subset_update_by_hand():
    lr, alpha, b1, b2, eps = 0.025, 1.5, 0.9, 0.999, 1e-8
    m = make("gradnorm", tasks=["a", "b", "c"])
    gram3 = torch.diag(torch.tensor([4.0, 1.0, 9.0], dtype=torch.float64))
    m.begin_step(0)
    m.weights_for_gram(gram3)  # no losses yet: no move
    m.end_step({"a": 2.0, "b": 1.0, "c": 3.0})
    gram = torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64))  # ||g_a|| = 2, ||g_c|| = 1
    m.begin_step(1, ["a", "c"])
    assert m.weights_for_gram(gram).tolist() == [1.0, 1.0]
    m.end_step({"a": 1.0, "c": 2.4})  # L/L(0): a 0.5, c 0.8
    # step 1's move, over {a, c} only: r = 1 (one observation each), target = mean(G) = 1.5
    w, mom, vel = [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]
    norms = [2.0, 1.0]

    def adam_move(w, grad, t):
        for i in range(2):
            mom[i] = b1 * mom[i] + (1 - b1) * grad[i]
            vel[i] = b2 * vel[i] + (1 - b2) * grad[i] ** 2
        w = [w[i] - lr * (mom[i] / (1 - b1**t)) / (math.sqrt(vel[i] / (1 - b2**t)) + eps) for i in range(2)]
        s = sum(w)
        return [x * 2.0 / s for x in w]  # the present weights keep their sum: 3 - w_b = 2

    w = adam_move(w, [norms[0], -norms[1]], 1)  # sign(G - target) * ||g||
    assert m.task_weights.tolist() == pytest.approx([w[0], 1.0, w[1]], rel=1e-6)
    m.begin_step(2, ["a", "c"])
    out = m.weights_for_gram(gram)
    assert out.tolist() == pytest.approx(w, rel=1e-6)  # this step's combination uses the weights before the move
    g_ = [w[0] * 2.0, w[1] * 1.0]
    ratio = [0.5, 0.8]
    r = [x / (sum(ratio) / 2) for x in ratio]
    target = [(sum(g_) / 2) * x**alpha for x in r]
    grad = [math.copysign(1.0, g_[i] - target[i]) * norms[i] for i in range(2)]
    w = adam_move(w, grad, 2)
    assert m.task_weights.tolist() == pytest.approx([w[0], 1.0, w[1]], rel=1e-6)
    assert float(m.task_weights.sum()) == pytest.approx(3.0, rel=1e-6)
    assert m.adam_t.tolist() == [2.0, 0.0, 2.0]


def run_beside_alone(name: str, steps: int, losses_at, options=None):
    """A loss-level method over ALL with only PRESENT in each step, beside the same method over PRESENT alone:
    their step weights must agree at every step, and must move (else the comparison shows nothing)."""
    sub, alone = make(name, tasks=ALL, options=options), make(name, tasks=PRESENT, options=options)
    seen = []
    for step in range(steps):
        losses = losses_at(step)
        sub.begin_step(step, PRESENT)
        alone.begin_step(step)
        assert sub.step_weights() == pytest.approx(alone.step_weights(), rel=1e-12)
        seen.append(sub.step_weights())
        sub.end_step(losses)
        alone.end_step(losses)
    assert seen[-1] != pytest.approx(seen[0])
    return sub


def test_dwa_on_the_present_tasks_is_dwa_on_those_tasks_alone():
    sub = run_beside_alone("dwa", 4, lambda step: {t: 1.0 / (step + 1) + 0.3 * i * step for i, t in enumerate(PRESENT)})
    assert sub.prev[ALL.index("b")] is None and sub.last[ALL.index("b")] is None


def test_the_config_check_allows_exactly_the_methods_that_say_so_and_names_the_others_reasons():
    allowed = set(present_only_methods())
    assert {"famo", "gradnorm", "dwa", "gradvac", "graddrop", "equal", *STATELESS} <= allowed
    for name, cls in weighting_types().items():
        stateful = (cls.level == "grad" or cls.end_step is not weighting_types()["equal"].end_step
                    or cls.needs_heldout_batch)  # a bilevel method's meta update moves its weights
        if name not in allowed:
            assert stateful and cls.absent_task_refusal, name  # a refused method says why
        elif stateful:
            assert cls.updates_from_present_tasks, name


@pytest.mark.parametrize("name", ["rlw", "gls"])
def test_a_loss_method_whose_weights_depend_on_k_weighs_the_present_tasks_as_if_alone(name):
    sub, alone = make(name, seed=2, tasks=ALL), make(name, seed=2, tasks=PRESENT)
    for step in range(3):
        sub.begin_step(step, PRESENT)
        alone.begin_step(step)
        assert sub.step_weights() == pytest.approx(alone.step_weights(), rel=1e-12)
        for t in PRESENT:
            loss = torch.tensor(0.5 + step, dtype=torch.float64)
            assert float(sub.weigh(t, loss)) == pytest.approx(float(alone.weigh(t, loss)), rel=1e-12)


def test_nashmtl_reuses_its_alpha_only_for_the_tasks_it_was_solved_for():
    m = make("nashmtl", tasks=ALL, options={"update_every": 3})
    fresh = {tuple(p): make("nashmtl", tasks=p) for p in (["a", "c"], ["a", "d"])}
    g = random_grads(2, 30, 3)
    g[1] = -0.5 * g[0] + g[1]
    for step, present in enumerate((["a", "c"], ["a", "d"], ["a", "c"])):
        m.begin_step(step, present)
        ref = fresh[tuple(present)]
        ref.begin_step(0)  # a solve
        scale = 1.0 + step  # each step's rows differ, so a reused alpha would differ from a fresh solve
        torch.testing.assert_close(m.combine(g * torch.tensor([[1.0], [scale]], dtype=g.dtype)),
                                   ref.combine(g * torch.tensor([[1.0], [scale]], dtype=g.dtype)))
        assert m.cached_tasks == present
    kept = list(m.cached)
    m.begin_step(4, ["a", "c"])  # not a multiple of 3, the same tasks as the last solve: reused, not re-solved
    m.combine(g)
    assert m.cached == kept
    ref = fresh[("a", "c")]
    ref.begin_step(0)
    ref.combine(g)
    assert ref.cached != pytest.approx(kept)  # a fresh solve on these rows would have differed


def test_famo_on_the_present_tasks_is_famo_on_those_tasks_alone():
    sub, alone = make("famo", tasks=ALL), make("famo", tasks=PRESENT)
    for step in range(5):
        losses = {t: 2.0 / (step + 1) ** (0.5 + 0.4 * i) for i, t in enumerate(PRESENT)}
        sub.begin_step(step, PRESENT)
        alone.begin_step(step)
        assert {t: float(v) for t, v in sub._coefficients().items()} == \
            pytest.approx({t: float(v) for t, v in alone._coefficients().items()}, rel=1e-6)
        sub.end_step(losses)
        alone.end_step(losses)
    idx = [ALL.index(t) for t in PRESENT]
    torch.testing.assert_close(sub.logits[idx], alone.logits)
    assert alone.logits.abs().max() > 1e-3  # the logits did move


def test_dbmtl_keeps_an_absent_tasks_average_and_count():
    m = make("dbmtl", tasks=ALL, options={"sigma": 0.5})
    for step, present in enumerate((ALL, PRESENT, PRESENT)):
        m.begin_step(step, present)
        m.combine(random_grads(len(present), 20, step), torch.linspace(1.0, 2.0, len(present), dtype=torch.float64))
        if step == 0:
            row_b = m.average[ALL.index("b")].clone()
    assert m.updates == [3, 1, 3, 3]
    assert torch.equal(m.average[ALL.index("b")], row_b)


def test_stch_on_the_present_tasks_is_stch_on_those_tasks_alone():
    sub = run_beside_alone("stch", 6, lambda step: {t: 2.0 / (step + 1) ** (0.3 + 0.5 * i) for i, t in enumerate(PRESENT)},
                           options={"warmup_steps": 2, "nadir_steps": 1})  # past the warm-up: the weights move
    b = ALL.index("b")
    assert sub.steps[b] == 0 and sub.prev[b] is None and sub.nadir_sum[b] == 0.0


def test_graddrop_per_shard_on_a_subset_names_the_present_tasks():
    """FSDP2 with a step that holds K' < K tasks: the kept fractions ``finish_shard`` records are the present
    tasks', under their own names, and equal ``combine``'s on the whole rows."""
    whole, shards = make("graddrop", seed=3, tasks=ALL), make("graddrop", seed=3, tasks=ALL)
    whole.begin_step(2, PRESENT)
    shards.begin_step(2, PRESENT)
    grads = random_grads(len(PRESENT), 31, 2)
    grads[2, :15] = -grads[0, :15]  # conflicting coordinates: something is dropped, by task
    whole.combine(grads)
    sums = 0
    for index in (torch.arange(0, 31, 2), torch.arange(1, 31, 2)):
        sums = sums + shards.combine_shard(grads[:, index], index, 31)[1]
    shards.finish_shard(sums, grads @ grads.T)
    assert set(shards.step_weights()) == set(PRESENT)
    assert shards.step_weights() == pytest.approx(whole.step_weights(), rel=1e-12)
    assert min(whole.step_weights().values()) < 0.99


@pytest.mark.parametrize("name", ["famo", "stch", "gls", "excessmtl", "gradnorm", "dwa", "uw"])
def test_weights_reports_every_task_and_step_weights_is_the_filter(name):
    """A method with a weight per task in its state reports an absent task's too (at its unchanged value);
    ``step_weights()``, what the trainer logs, is ``weights()`` on the present tasks."""
    m = make(name, tasks=ALL, options={"warmup_steps": 1, "nadir_steps": 1} if name == "stch" else None)
    for step in range(4):
        m.begin_step(step, PRESENT)
        if m.level == "grad":
            m.combine(random_grads(len(PRESENT), 20, step), torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64))
        m.end_step({t: 1.0 / (step + 1) + i for i, t in enumerate(PRESENT)})
    m.begin_step(4, PRESENT)
    w = m.weights()
    assert list(w) == ALL
    assert m.step_weights() == {t: w[t] for t in PRESENT}
    if name in ("excessmtl", "gradnorm"):
        assert w["b"] == 1.0 and w != pytest.approx(dict.fromkeys(ALL, 1.0))  # b's weight never moved; others did
    if name == "famo":  # b's logit (0) on the present tasks' scale; the present ones sum to 1
        assert sum(w[t] for t in PRESENT) == pytest.approx(1.0, rel=1e-6)
        assert w["b"] == pytest.approx(1.0 / float(m.logits[[0, 2, 3]].exp().sum()), rel=1e-6)
