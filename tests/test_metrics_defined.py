"""Metrics that are defined on the data they score (issue 32.5): BLEU-4 on short captions, Δm against a zero or
non-finite baseline, and the logged task weights of the step that used them."""

from __future__ import annotations

import math

import pytest
import sacrebleu
from sacrebleu.metrics import BLEU

from mtl.delta_m import delta
from mtl.errors import DataError
from mtl.tasks.captioning import CaptioningHead

from .conftest import TINY

SHORT_HYPS = ["two red crosses", "one blue circle", "three green squares", "a red cross"]
SHORT_REFS = [["two red crosses"], ["one blue square"], ["three green squares"], ["two red crosses"]]
LONG_HYPS = ["there are two red crosses on the left", "a small blue circle at the top right",
             "three green squares in the middle", "one big yellow star at the bottom"]
LONG_REFS = [["there are two red crosses on the right"], ["a small blue circle at the top left"],
             ["three green squares in the middle"], ["two big yellow stars at the bottom", "a yellow star"]]


def reduce(hyps, refs) -> dict:
    """The caption head's evaluation of these captions (what training's evaluation, mtl.tools.evaluate and the
    benchmark read: one definition)."""
    parts = [{"nll": 1.0, "tokens": 4, "hyps": hyps, "refs": refs, "index": list(range(len(hyps)))}]
    return CaptioningHead.eval_reduce(None, parts)  # reads only its parts


def streams(refs):
    n = max(len(r) for r in refs)
    return [[r[k] if k < len(r) else None for r in refs] for k in range(n)]


def test_bleu4_of_short_captions_is_the_smoothed_effective_order_value_not_zero():
    out = reduce(SHORT_HYPS, SHORT_REFS)
    # the problem: plain corpus BLEU-4 (even with sacrebleu's exp smoothing) has no 4-gram to count: 0 for any quality
    assert sacrebleu.corpus_bleu(SHORT_HYPS, streams(SHORT_REFS)).score == 0.0 and out["exact"] == 0.5
    expected = BLEU(smooth_method="exp", effective_order=True).corpus_score(SHORT_HYPS, streams(SHORT_REFS)).score
    assert 0 < out["bleu4"] < 1 and math.isfinite(out["bleu4"])
    assert out["bleu4"] == pytest.approx(expected / 100, rel=1e-12)
    assert out["bleu4_order"] == 3  # the run reports the order the geometric mean ran over


def test_bleu4_of_long_captions_is_unchanged():
    for hyps, refs in ((LONG_HYPS, LONG_REFS), (LONG_HYPS[:1] + SHORT_HYPS, LONG_REFS[:1] + SHORT_REFS)):
        out = reduce(hyps, refs)
        assert out["bleu4"] == sacrebleu.corpus_bleu(hyps, streams(refs)).score / 100  # the definition before
        assert out["bleu4_order"] == 4 and out["bleu4"] > 0


def test_bleu4_of_a_perfect_match_is_exactly_one():
    """sacrebleu's score of a caption equal to its reference is 100.00000000000004: BLEU-4 stays in [0, 1] (issue 41.5)."""
    assert BLEU(tokenize="13a", smooth_method="exp", effective_order=True).corpus_score(
        ["a red square"], [["a red square"]]).score / 100 == 1.0000000000000004  # the case
    out = reduce(["a red square", "the cat sat on the mat"], [["a red square"], ["the cat sat on the mat"]])
    assert out["bleu4"] == 1.0 and out["exact"] == 1.0


@pytest.mark.parametrize("bad", [0.0, 0, float("inf"), float("-inf")])
def test_delta_m_refuses_a_zero_or_infinite_baseline(bad):
    specs = [("cls_acc", "cls", True), ("gen_bleu4", "gen", True)]
    with pytest.raises(DataError, match="gen_bleu4") as e:
        delta({"cls_acc": 0.5, "gen_bleu4": 0.3}, {"cls_acc": 0.8, "gen_bleu4": bad}, specs)
    assert "not defined" in e.value.message and e.value.exit_code == 3
    with pytest.raises(DataError, match="gen_bleu4"):  # partial too: it never divides by it
        delta({"cls_acc": 0.5}, {"cls_acc": 0.8, "gen_bleu4": bad}, specs, partial=True)


def test_delta_m_without_a_measured_baseline_is_nan_and_with_one_unchanged():
    specs = [("cls_acc", "cls", True), ("gen_bleu4", "gen", True)]
    run = {"cls_acc": 0.6, "gen_bleu4": 0.3}
    for missing in ({"cls_acc": 0.8}, {"cls_acc": 0.8, "gen_bleu4": None}, {"cls_acc": 0.8, "gen_bleu4": math.nan}):
        assert math.isnan(delta(run, missing, specs))  # not measured (the benchmark without baselines)
    assert delta(run, {"cls_acc": 0.8, "gen_bleu4": 0.6}, specs) == pytest.approx((25 + 50) / 2)


# ------------------------------------------------------------------ the logged weights are the ones the step used

# A loss-level method's term is linear in its loss (weight * L + a term without L: the weight is dterm/dL) except
# these, whose term is coef * log L (the weight is the coefficient of log L: L dterm/dL). FAMO logs the paper's z,
# which is that coefficient up to c, one factor common to the tasks (mtl/weighting/famo.py).
LOG_TERM = {"gls", "si", "stch", "famo"}
UP_TO_A_COMMON_FACTOR = {"famo"}
OPTIONS = {"stch": ["weighting.options.warmup_steps=1", "weighting.options.nadir_steps=1"],
           "static": ["weighting.weights={cls: 0.25, count: 2.0}"]}


def loss_level_methods() -> list:
    """Every registered loss-level method; DWA (the issue's case) in the fast tier, the others slow (a few seconds
    each: a run is built and stepped)."""
    from mtl.weighting import weighting_types

    return [m if m == "dwa" else pytest.param(m, marks=pytest.mark.slow)
            for m in sorted(n for n, c in weighting_types().items() if c.level == "loss")]


def gram_methods_with_their_own_weights() -> list[str]:
    """Gram methods whose ``weights()`` is not the last combination's coefficients (``last_weights``) but their
    state: where a weight can be one step ahead of the step that logs it."""
    from mtl.weighting import weighting_types
    from mtl.weighting.base import GradientWeighting, GramWeighting

    return sorted(n for n, c in weighting_types().items()
                  if issubclass(c, GramWeighting) and c.weights is not GradientWeighting.weights)


def trainer_for(method: str, tmp_path):
    from mtl.run.trainer import Trainer
    from mtl.weighting import weighting_types

    bilevel = ["data.heldout=32"] if weighting_types()[method].needs_heldout_batch else []
    return Trainer.from_config(TINY, [f"output_dir={tmp_path}", "tasks=[cls,count]", f"weighting.method={method}",
                                      "checkpoint.every_steps=0", "trainer.log_every=1", "data.batch_size=4", *bilevel,
                                      *OPTIONS.get(method, [])])


def logged_weights(tr, r) -> dict:
    """The step record's ``weight_<task>`` values, through the run's own step log."""
    return {k.removeprefix("weight_"): v for k, v in tr.steplog.step_values(r, 1.0, tr.batch, 0).items()
            if k.startswith("weight_")}


@pytest.mark.parametrize("method", loss_level_methods())
def test_a_steps_logged_weights_are_those_its_losses_were_weighed_with(method, tmp_path):
    """Every loss-level method (the registered ones, enumerated): at each step the logged ``weight_<task>`` is the
    weight that multiplied that task's loss in that step, read off the term ``weigh`` returned (its derivative
    in the loss), and the weight the method reported while it weighed. DWA, FAMO, STCH (``end_step``), UW (the
    optimizer step) and FORUM (its meta update) logged the next step's weights before."""
    import torch

    tr = trainer_for(method, tmp_path)
    w = tr.weighting
    weigh, seen = w.weigh, {}

    def spy(task, loss):
        term = weigh(task, loss)
        (d,) = torch.autograd.grad(term, loss, retain_graph=True)
        seen[task] = {"d": float(d.detach()), "loss": float(loss.detach()), "reported": w.step_weights()[task]}
        return term

    w.weigh = spy
    try:
        moved = set()
        for step in range(3):
            seen.clear()
            r = tr.step_once()
            assert r.stepped and set(seen) == {"cls", "count"}
            logged = logged_weights(tr, r)
            assert set(logged) == set(seen)
            moved.add(tuple(logged.values()))
            for t, s in seen.items():
                assert logged[t] == s["reported"], (step, t)
            used = {t: s["d"] * (s["loss"] if method in LOG_TERM else 1.0) for t, s in seen.items()}
            if method in UP_TO_A_COMMON_FACTOR:
                factor = used["cls"] / logged["cls"]
                assert factor > 0 and used["count"] / logged["count"] == pytest.approx(factor, rel=1e-5), step
            else:
                assert logged == pytest.approx(used, rel=1e-5), step
        if method in {"dwa", "famo", "stch", "uw", "forum"}:  # stateful: the weights moved, so the check could fail
            assert len(moved) > 1
    finally:
        tr.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", gram_methods_with_their_own_weights())
def test_a_gram_methods_logged_weights_are_its_combinations_coefficients(method, tmp_path):
    """A Gram method whose ``weights()`` reports its state (GradNorm moves w right after computing this step's):
    the logged weights are the coefficients the step's combination used."""
    tr = trainer_for(method, tmp_path)
    w = tr.weighting
    inner, seen = w.weights_for_gram, {}

    def spy(*args, **kwargs):
        alpha = inner(*args, **kwargs)
        seen.update(zip(w.present, alpha.tolist()))
        return alpha

    w.weights_for_gram = spy
    try:
        moved = set()
        for step in range(3):
            seen.clear()
            r = tr.step_once()
            logged = logged_weights(tr, r)
            assert seen and logged == pytest.approx(seen, rel=1e-12), step
            moved.add(tuple(logged.values()))
        assert len(moved) > 1
    finally:
        tr.close()
