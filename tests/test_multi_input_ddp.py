"""Multi-input mode (each task its own data set), proven under DDP: 2 processes == 1 process on the same global
per-task batches, for every sampling policy, including ``mixed``, where a task is absent on ONE rank only.

In-process, ONE spawn of three workers (the pattern of tests/test_weighting_ddp.py): workers 0 and 1 are a 2-rank
gloo run, worker 2 a single process with twice the per-process batch sizes (so the same global rows: every rank
derives the step's plan from seed and step). Each worker builds a ``Trainer`` from configs/multi_input.yaml per
case and steps it 3 times. float64, GroupNorm and SGD for the reasons given in tests/test_weighting_ddp.py.

The ranks also record how many rows of each task they held per step, so the test checks that ``mixed`` really
put a task on one rank and not the other (and ``round_robin`` really left a task out of a step).

Negative control: the same ``mixed`` run on 2 ranks with each task's loss the mean over its LOCAL rows (what a
head returns; no rescaling to a share of the global mean) misses the bar.

Last, on the two ranks only: the seed articles' failure in this mode. ``combined`` (DDP without
find_unused_parameters, no zero term over the absent heads) with ``round_robin`` is refused at config time;
with ``ddp.unsafe=true`` the second step fails with "Expected to have finished reduction in the prior
iteration", and the trainer's message names the task the previous step left out, its module group and the fix.
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import ROOT, spawn_env, spawn_parity_runs

MI = os.path.join(ROOT, "configs", "multi_input.yaml")
B_CLS, B_GEN, B_MIXED = 2, 2, 4  # per process, at 2 processes (the single process takes twice these)
STEPS = 3
TOL = 1e-5  # the tolerance of tests/test_strategies_ddp.py and tests/test_weighting_ddp.py
DTYPE = torch.float64
DEADLINE_S = 300
# (case name, policy, strategy, extra overrides): every sampling policy x every strategy that serves multi-input steps
# (feature_leaf, find_unused, placeholder, accumulate, and task_grads with a gradient-level method, a different
# one per policy), plus two more: a stateful loss-level method on steps that leave a task out, and `weighted`
# with probabilities proportional to the data-set sizes.
POLICIES = {"all": [], "round_robin": [], "weighted": [], "temperature": ["data.sampling.temperature=0.5"],
            "mixed": []}
GRAD_METHOD = {"all": "cagrad", "round_robin": "pcgrad", "weighted": "mgda", "temperature": "gradnorm",
               "mixed": "pcgrad"}
CASES = [(f"{policy}/{strategy}", policy, strategy, extra)
         for policy, extra in POLICIES.items()
         for strategy in ("feature_leaf", "find_unused", "placeholder", "accumulate")] + [
    (f"{policy}/task_grads+{GRAD_METHOD[policy]}", policy, "task_grads",
     [*extra, f"weighting.method={GRAD_METHOD[policy]}"]) for policy, extra in POLICIES.items()] + [
    # tasks absent from whole steps, DDP without find_unused: the zero term over the absent heads
    # (mtl/strategies/absent.py), and a method that weighs the present tasks only (mtl/weighting/base.py)
    ("round_robin/feature_leaf+famo", "round_robin", "feature_leaf", ["weighting.method=famo"]),
    ("weighted_size/placeholder", "weighted", "placeholder", ["data.sampling.weights=size"]),
    # an architecture's towers (mtl/architectures/): an absent task's gate is in the zero term; a task's rows read
    # through its own tower (PLE: lower task experts in the trunk, reached by every task)
    ("round_robin/feature_leaf+mmoe", "round_robin", "feature_leaf", ["model.architecture.name=mmoe"]),
    ("mixed/task_grads+pcgrad+ple", "mixed", "task_grads", ["weighting.method=pcgrad", "model.architecture.name=ple"]),
]
NAIVE = "mixed/feature_leaf"  # the case the negative control repeats without the global-mean normalisation


def overrides(policy, strategy, extra, out_dir, world):
    k = 2 // world  # the single process takes the global batch
    return [f"output_dir={out_dir}", "optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0",
            "optim.warmup_steps=0", "trainer.progress=false", "ddp.timeout_s=60", "ddp.replica_check_every=1",
            f"ddp.strategy={strategy}", *sizes(policy, k, extra), f"data.sampling.policy={policy}",
            *extra]


def sizes(policy, k, extra):
    """The sizes ``policy`` reads (one command line is judged together: a size it does not read would be refused)."""
    if policy == "mixed":
        return [f"data.batch_size={B_MIXED * k}", "data.per_task.gen.ratio=0.25"]
    return [f"data.per_task.cls.batch_size={B_CLS * k}", f"data.per_task.gen.batch_size={B_GEN * k}",
            *(["data.per_task.gen.ratio=1"] if policy == "weighted" and "data.sampling.weights=size" not in extra else [])]


def _to(batch):
    return {k: _to(v) if isinstance(v, dict) else v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point()
            else v for k, v in batch.items()}


def _run(name, args, world, out_dir):
    from mtl.run.trainer import Trainer

    trainer = Trainer.from_config(MI, args)
    assert trainer.dist.world_size == world and trainer.feed.plan is not None
    batches, rows = trainer.batches(), []
    trainer.bare.train()
    try:
        for _ in range(STEPS):
            batch = _to(next(batches)[1])
            rows.append({t: sub["rows"][1] - sub["rows"][0] for t, sub in batch["multi_input"].items()})
            trainer.step_once(batch)
        return {"model": {k: v.detach().clone() for k, v in trainer.bare.state_dict().items()}, "rows": rows,
                "samplers": trainer.feed.state_dict()["multi_input"]}
    finally:
        trainer.close()


def _worker(index, port, out_dir):
    world = spawn_env(index, port)
    from mtl.data.multi_input import TaskSlices
    from mtl.errors import ConfigError, TrainingError
    from mtl.parallel import dist

    torch.set_num_threads(1)
    torch.set_default_dtype(DTYPE)
    who = f"rank{index}" if world > 1 else "single"
    results = {}
    try:
        for name, policy, strategy, extra in CASES:
            path = os.path.join(out_dir, f"world{world}", name.replace("/", "_"))
            results[name] = _run(name, overrides(policy, strategy, extra, path, world), world, out_dir)
        if world > 1:
            # negative control: each task's loss the mean over its local rows only
            proper = TaskSlices.loss
            TaskSlices.loss = lambda self, head, x, n, batch: (
                head(x[self.subs[n]["rows"][0]:self.subs[n]["rows"][1]], self.subs[n])
                if self.subs[n]["rows"][1] > self.subs[n]["rows"][0] else proper(self, head, x, n, batch))
            try:
                _, policy, strategy, extra = next(c for c in CASES if c[0] == NAIVE)
                path = os.path.join(out_dir, "naive")
                results["naive"] = _run("naive", overrides(policy, strategy, extra, path, world), world, out_dir)
            finally:
                TaskSlices.loss = proper
            # the seed articles' failure: refused at config time, reproduced with ddp.unsafe=true, explained
            args = overrides("round_robin", "combined", [], os.path.join(out_dir, "seed_error"), world)
            try:
                from mtl.setup.checks import load_run_config

                load_run_config(MI, args)
                results["refusal"] = None
            except ConfigError as e:
                results["refusal"] = str(e)
            try:
                _run("seed_error", args + ["ddp.unsafe=true"], world, out_dir)
                results["seed_error"] = None
            except TrainingError as e:
                results["seed_error"] = e.message
        torch.save(results, os.path.join(out_dir, f"{who}.pt"))
    finally:
        dist.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn_parity_runs(_worker, tmp_path_factory, "multi_input_ddp", DEADLINE_S, "multi-input DDP")


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp(min=1e-12))
               for k in a if a[k].is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_two_processes_equal_one_process_on_the_global_per_task_batches(runs, case):
    r0, r1, single = (runs[w][case] for w in ("rank0", "rank1", "single"))
    assert r0["samplers"] == r1["samplers"] == single["samplers"]  # the same global rows were consumed
    for k in r0["model"]:  # replicas, bit for bit
        assert torch.equal(r0["model"][k], r1["model"][k]), k
    assert max_rel_diff(single["model"], r0["model"]) <= TOL
    per_step = [(a, b) for a, b in zip(r0["rows"], r1["rows"])]
    if case.startswith("mixed"):  # a task held on one rank and not on the other, in some step
        assert any((a[t] == 0) != (b[t] == 0) for a, b in per_step for t in a), per_step
    if case.startswith("round_robin"):  # a whole task left out of a step, on both ranks
        assert all(len(a) == 1 and a.keys() == b.keys() for a, b in per_step), per_step
    if case.split("/")[0] in ("weighted", "temperature", "round_robin"):  # some step really left a task out
        assert any(len(a) < 2 for a in r0["rows"]), r0["rows"]
    if case.startswith("all"):
        assert all(a == b == {"cls": B_CLS, "gen": B_GEN} for a, b in per_step)


@pytest.mark.slow
def test_the_bar_is_not_trivial_local_means_miss_it(runs):
    """Where the ranks hold different numbers of a task's rows, averaging the ranks' LOCAL means is not the mean
    over the global rows: the same mixed run without the rescaling misses the bar."""
    assert max_rel_diff(runs["single"][NAIVE]["model"], runs["rank0"]["naive"]["model"]) > 1e-3


@pytest.mark.slow
def test_the_seed_articles_error_in_multi_input_mode_is_refused_then_reproduced_and_explained(runs):
    refusal = runs["rank0"]["refusal"]
    assert refusal and "ddp.strategy: combined builds DDP with find_unused_parameters=false" in refusal
    assert "data.sampling.policy=round_robin" in refusal and "ddp.strategy=find_unused" in refusal
    for rank in ("rank0", "rank1"):
        msg = runs[rank]["seed_error"]
        assert msg is not None, "the unsafe run did not fail"
        assert "Expected to have finished reduction in the prior iteration" in msg
        assert "multi-input: step 1 (data.sampling.policy=round_robin) held only task(s) cls" in msg
        assert "no gradient reached heads.gen" in msg
        assert "fix: set ddp.strategy=find_unused, accumulate, placeholder, feature_leaf or task_grads" in msg
