"""``parallel.engine: fsdp2``, proven: 2 processes x batch B == 1 process x batch 2B, FSDP2 == DDP, the collectives
per step, the global gradient norm over shards, and an exact save/resume; plus the config-time refusals.

ONE spawn of three workers (as tests/test_weighting_ddp.py): workers 0 and 1 are a 2-rank gloo run (batch B
each), worker 2 has no process group and runs the references on batch 2B. In each rank, one ``Trainer`` per
(strategy, method) for every strategy whose class says it runs under FSDP2 (``Strategy.fsdp2_problem()`` is
None) and the loss-level methods ``equal`` and ``gls`` (nonlinear: each task's term is divided by its
rank-averaged loss), stepped 3 times with ``Trainer.step_once``; then the same runs under DDP.

float64, GroupNorm, SGD, for the reason tests/test_weighting_ddp.py gives: in float32 a 2-rank run's other
summation order can move a ReLU pre-activation within rounding of zero across the kink, and the 1e-5 bar would
then measure rounding, not the engine. The bar is the DDP parity tests' (max over tensors of max|a - b| / max|a|
<= 1e-5).

Collectives are counted with a ``TorchDispatchMode`` that sees every c10d op the step dispatches (FSDP2's
all-gathers and reduce-scatters, ``dist.all_reduce``, DTensor's functional collectives); DDP's reducer calls
the process group from C++ and is not seen, which is why DDP's gradient all-reduces are counted with a comm
hook in tests/test_allreduce_counts.py and not here.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os

import pytest
import torch

from mtl.errors import ConfigError
from mtl.strategies import strategy_types
from mtl.weighting import weighting_types

from .conftest import TINY, spawn_env, spawn_parity_runs

B = 4
STEPS = 3
TOL = 1e-5
DTYPE = torch.float64
METHODS = ["equal", "gls"]
# task_grads (gradient-level weighting) runs in the sweep below, one trainer for all its methods
STRATEGIES = sorted(n for n, c in strategy_types().items()
                    if not c.unsafe and c.fsdp2_problem() is None and not c.task_gradients)
DDP_TOO = ["accumulate", "feature_leaf"]  # FSDP2 == DDP directly (DDP == 1 process is tests/test_strategies_ddp.py's)
DEADLINE_S = 400
# activation checkpointing on every block, the stem and layer1 frozen, layer-wise lr decay (docs/scale.md)
BLOCKWISE = ["model.activation_checkpointing=true", "model.backbone.freeze_blocks=1", "optim.layer_decay=0.5"]


def overrides(out_dir, batch, strategy, method, engine):
    return [f"output_dir={out_dir}", f"data.batch_size={batch}", "optim.name=sgd", "optim.lr=0.05",
            "optim.weight_decay=0", "optim.warmup_steps=0", "trainer.progress=false", "ddp.timeout_s=60",
            f"ddp.strategy={strategy}", f"weighting.method={method}", f"parallel.engine={engine}", "optim.grad_clip=1.0"]


def _counting_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if "c10d" in name:
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def _full_params(trainer) -> dict:
    from mtl.parallel.fsdp import full_model_state, is_sharded

    state = full_model_state(trainer.bare) if is_sharded(trainer.bare) else trainer.bare.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _worker(index, port, out_dir):
    world = spawn_env(index, port)
    from mtl.parallel import dist
    from mtl.run.runtime_checks import verify_replicas
    from mtl.run.trainer import Trainer

    torch.set_num_threads(1)
    torch.set_default_dtype(DTYPE)
    results = {}

    def run(key, strategy, method, engine, batch, extra=()):
        trainer = Trainer.from_config(TINY, overrides(f"{out_dir}/{key}", batch, strategy, method, engine) + list(extra))
        frozen = {n: p.detach().clone() for n, p in trainer.bare.named_parameters() if not p.requires_grad}
        steps, batches = [], trainer.batches()
        trainer.bare.train()
        for _ in range(STEPS):
            batch = {k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v
                     for k, v in next(batches)[1].items()}
            mode = _counting_mode()
            with mode:
                r = trainer.step_once(batch)
            steps.append({"counts": dict(mode.counts), "grad_norm": r.grad_norm, "losses": r.losses,
                          "stepped": r.stepped, "stats": {k: float(v) for k, v in r.stats.items()}})
            if world > 1:
                verify_replicas(trainer.bare, trainer.step)
        results[key] = {"steps": steps, "params": _full_params(trainer), "frozen": frozen if world == 1 else {},
                        "groups": [(g["lr_scale"], len(g["params"])) for g in trainer.optimizer.param_groups
                                   if "lr_scale" in g]}
        trainer.close()
        return trainer

    if world > 1:
        for strategy in STRATEGIES:
            for method in METHODS:
                run(f"fsdp2/{strategy}/{method}", strategy, method, "fsdp2", B)
        for strategy in DDP_TOO:
            for method in METHODS:
                run(f"ddp/{strategy}/{method}", strategy, method, "ddp", B)
        for engine in ("fsdp2", "ddp"):  # per-block settings (tests/test_scale.py): checkpointing, freezing, lr decay
            run(f"{engine}/feature_leaf/equal/blocks", "feature_leaf", "equal", engine, B, BLOCKWISE)
        results["resume"] = _resume_exactly(out_dir, world)
        results.update(_fp16_overflow(out_dir))
        results["example"] = _example_config(out_dir)
    else:
        for strategy in ("combined", "detach"):
            for method in METHODS:
                run(f"single/{strategy}/{method}", strategy, method, "ddp", 2 * B)
        run("single/combined/equal/blocks", "combined", "equal", "ddp", 2 * B, BLOCKWISE)
    results.update(_weighting_sweep(world, out_dir))
    torch.save(results, os.path.join(out_dir, f"rank{index}.pt" if world > 1 else "single.pt"))
    dist.destroy()


def _resume_exactly(out_dir, world):
    """FSDP2, float32, AdamW (per-parameter state: sharded): 2 steps, save, 2 more; and a resume of that
    checkpoint, 2 more. Returns whether the two ends are bitwise equal, and the checkpoint's model file keys."""
    from safetensors.torch import load_file

    from mtl.parallel.fsdp import watch_gathered
    from mtl.run.trainer import Trainer

    torch.set_default_dtype(torch.float32)

    # 33 validation images in batches of 8: rank 0 evaluates 3 batches, rank 1 2 (a collective per batch would hang)
    args = [f"output_dir={out_dir}/resume", f"data.batch_size={B}", "trainer.progress=false", "parallel.engine=fsdp2",
            "ddp.timeout_s=60", "optim.name=adamw", "checkpoint.every_steps=0", "data.synthetic.val_size=33",
            "data.eval_batch_size=8", "trainer.eval_max_batches=0", "trainer.num_samples=0", *RESUME_DECODER]
    a = Trainer.from_config(TINY, args)
    facts = [_sharding_facts(a)]
    a.step_once()
    with watch_gathered(a.bare) as gathered:
        a.step_once()
    path = a.save()
    at_save = _full_params(a)
    evaluated = a.run_eval()  # draws no training randomness: the run below stays bitwise comparable
    a.step_once()
    a.step_once()
    end_a = _full_params(a)
    replica = _replica_check_sees_a_buffer(a, world)
    facts.append(_sharding_facts(a))
    a.close()
    b = Trainer.from_config(TINY, [*args, "resume=auto"])
    resumed_at = b.step
    facts.append(_sharding_facts(b))
    b.step_once()
    b.step_once()
    facts.append(_sharding_facts(b))
    end_b = _full_params(b)
    b.close()
    saved = load_file(os.path.join(path, "model.safetensors"))
    same = all(torch.equal(end_a[k], end_b[k]) for k in end_a) if end_a else None
    return {"resumed_at": resumed_at, "bitwise": same, "eval": evaluated, "replica": replica,
            "keys": sorted(saved), "file": os.path.join(path, "model.safetensors"), "at_save": at_save,
            "facts": facts, "gathered": [(phase, name, sorted(units)) for phase, name, units in gathered]}


RESUME_DECODER = ["model.decoder.n_layer=2"]  # two transformer blocks: two FSDP2 units inside the caption head


def _sharding_facts(trainer) -> dict:
    """How the caption decoder is sharded now: each transformer block its own ``fully_shard`` unit (FSDP2's state on
    the block, its parameters DTensor shards between passes), and GPT-2's tied weight one parameter (``wte`` is the
    LM head's), a DTensor of the head's own unit."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from mtl.parallel.fsdp import shard_units

    decoder = trainer.bare.heads["gen"].decoder
    blocks = [m for _, m in decoder.blocks()]
    lm = decoder.lm
    return {"units": [n for n, _ in shard_units(trainer.bare)],
            "blocks_are_units": [isinstance(m, FSDPModule) and fully_shard.state(m) is not None for m in blocks],
            "block_params_sharded": [all(isinstance(p, DTensor) for p in m.parameters()) for m in blocks],
            "head_is_unit": isinstance(trainer.bare.heads["gen"], FSDPModule),
            "tied": lm.lm_head.weight is lm.transformer.wte.weight,
            "tied_sharded": isinstance(lm.lm_head.weight, DTensor)}


def _fp16_overflow(out_dir) -> dict:
    """precision=fp16 (float32, the model's fp16 autocast) under FSDP2 and under DDP, 3 steps on the same batches,
    each with a scaler that starts at 2^40 (every scaled gradient overflows fp16) and backs off by 2^-30 (to 2^10,
    where nothing overflows): step 0 is an overflow, skipped, steps 1 and 2 are taken. Then a 4th step whose gen
    loss is NaN on rank 1 only (``trainer.poison``): a non-finite step, skipped on every rank."""
    from mtl.run.trainer import Trainer

    torch.set_default_dtype(torch.float32)
    out = {}
    for engine in ("fsdp2", "ddp"):
        t = Trainer.from_config(TINY, [*overrides(f"{out_dir}/fp16-{engine}", B, "feature_leaf", "equal", engine),
                                       "precision=fp16", f"trainer.poison={STEPS + 1}:gen:1"])
        kind = type(t.amp.scaler)
        t.amp.scaler = kind("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -30)
        t.bare.train()
        steps, unchanged, initial = [], [], _full_params(t)
        for i in range(STEPS + 1):
            before = _full_params(t)
            r = t.step_once()
            steps.append({"stepped": r.stepped, "nonfinite": r.nonfinite, "scale": t.amp.loss_scale(),
                          "grad_norm": r.grad_norm})
            if i in (0, STEPS):
                unchanged.append(all(torch.equal(a, b) for a, b in zip(before.values(), _full_params(t).values())))
        out[f"fp16/{engine}"] = {"scaler": kind.__name__, "steps": steps, "unchanged_by_skips": unchanged,
                                 "params": _full_params(t), "initial": initial}
        t.close()
    return out


def _example_config(out_dir) -> dict:
    """configs/fsdp2.yaml (ResNet-152 + a GPT-2-medium-sized decoder, bf16, FSDP2) shrunk as
    tests/test_configs_run.py shrinks it (the CPU keys, tiny sizes, the backbone's first stage), a step on 2 ranks."""
    from mtl.parallel.fsdp import is_sharded, shard_units
    from mtl.run.trainer import Trainer

    from .test_configs_run import SMALL, cpu_overrides, shrink

    path = os.path.join(os.path.dirname(TINY), "fsdp2.yaml")
    torch.set_default_dtype(torch.float32)
    t = Trainer.from_config(path, [*cpu_overrides(path), *SMALL, *shrink(path), f"output_dir={out_dir}/example",
                                   "ddp.timeout_s=60", "model.decoder.n_layer=2",
                                   "data.synthetic.train_size=8"])  # SMALL's set is one process's batch; 2 ranks
    steps = [t.step_once()]
    out = {"sharded": is_sharded(t.bare), "units": [n for n, _ in shard_units(t.bare)], "precision": t.cfg.precision,
           "backbone": t.cfg.model.backbone.name, "stepped": [r.stepped for r in steps],
           "losses": [r.losses for r in steps]}
    t.close()
    return out


def _replica_check_sees_a_buffer(trainer, world):
    """Under FSDP2 every tiny.yaml parameter is sharded and it has no buffer: nothing replicated to compare. Give
    the backbone a float buffer, equal on both ranks (the check passes), then different (it names the buffer)."""
    from mtl.errors import TrainingError
    from mtl.run.runtime_checks import replicated, verify_replicas

    before = [n for n, _ in replicated(trainer.bare)]
    trainer.bare.backbone.register_buffer("probe", torch.ones(3))
    verify_replicas(trainer.bare, trainer.step)
    trainer.bare.backbone.probe.fill_(float(int(os.environ["RANK"])))
    try:
        verify_replicas(trainer.bare, trainer.step)
        caught = None
    except TrainingError as e:
        caught = str(e)
    del trainer.bare.backbone.probe
    return {"before": before, "caught": caught}


# ---------------------------------------------------------------------------- gradient-level weighting under FSDP2
#
# Every gradient-level method that runs under FSDP2 (``Weighting.fsdp2_problem()`` is None), with
# ``ddp.strategy=task_grads`` (each rank its shard of each task's gradient, one K x K all-reduce), and a Gram-only
# method with ``weighting.source=features``; plus DDP's task_grads for a Gram method and for GradDrop (the row
# method that combines per shard). To keep the spawn short, each worker builds ONE Trainer per engine and, per
# method, swaps in fresh ``parts`` (the method's weighting, strategy, optimizer and schedule, built from the
# method's own checked config by the trainer's builders), puts the parameters back to their initial values and
# steps it SWEEP_STEPS times with ``Trainer.step_once`` on the same batches.

SWEEP_STEPS = 2
GRAD_METHODS = sorted(m for m, c in weighting_types().items() if c.level == "grad" and c.fsdp2_problem() is None)
FEATURE_METHODS = ["mgda"]  # weighting.source=features (feature_leaf): the strategy's code is method-agnostic
GRAD_DDP_TOO = ["pcgrad", "graddrop"]
LOSS_METHODS = ["gls"]  # task_grads with a loss-level method: the rows just add up (w = 1)
# the other loss-level methods (equal and gls run with every strategy above), under feature_leaf; uw's learned
# loss weights are plain parameters beside the model's DTensors (averaged by hand, in the global gradient norm)
# (bilevel methods are refused under FSDP2: tests/test_bilevel.py)
OTHER_LOSS_METHODS = sorted(m for m, c in weighting_types().items() if c.level == "loss" and m not in METHODS
                            and c.fsdp2_problem() is None)
COUNTED = "pcgrad"  # its steps run under the counting dispatch mode


def _sweep_runs(world: int) -> list[tuple[str, str, str, str]]:
    """(key, engine, strategy, method) in the order a worker runs them; ``method@features``: weighting.source."""
    engine = "fsdp2" if world > 1 else "single"
    out = [(f"{engine}/task_grads/{m}", engine, "task_grads", m) for m in [*GRAD_METHODS, *LOSS_METHODS]]
    out += [(f"{engine}/feature_leaf/{m}@features", engine, "feature_leaf", f"{m}@features") for m in FEATURE_METHODS]
    out += [(f"{engine}/feature_leaf/{m}", engine, "feature_leaf", m) for m in OTHER_LOSS_METHODS]
    if world > 1:
        out += [(f"ddp/task_grads/{m}", "ddp", "task_grads", m) for m in GRAD_DDP_TOO]
    return out


def _sweep_args(out_dir, batch, engine, strategy, method):
    from .test_weighting_ddp import EXTRA  # the methods' options the DDP parity test runs them with

    method, _, source = method.partition("@")
    return [*overrides(out_dir, batch, strategy, method, "ddp" if engine == "single" else engine),
            f"weighting.source={source or 'parameters'}", *EXTRA.get(method, [])]


def _fresh_parts(trainer, args):
    """New StepParts for the run ``args`` around ``trainer``'s model, from the trainer's own builders."""
    from mtl.run.step import StepParts
    from mtl.setup.build import build_optimizer, build_scheduler, build_strategy, build_weighting
    from mtl.setup.checks import load_run_config

    cfg = load_run_config(TINY, args)
    weighting = build_weighting(cfg).to(trainer.device)
    optimizer = build_optimizer(cfg, trainer.bare, weighting)
    params = [p for p in trainer.bare.parameters() if p.requires_grad] + list(weighting.parameters())
    return StepParts(model=trainer.model, bare=trainer.bare, tasks=trainer.tasks, strategy=build_strategy(cfg),
                     weighting=weighting, optimizer=optimizer, scheduler=build_scheduler(cfg, optimizer),
                     amp=trainer.amp, params=params, grad_clip=cfg.optim.grad_clip)


def _weighting_sweep(world, out_dir) -> dict:
    from mtl.run.runtime_checks import verify_replicas
    from mtl.run.trainer import Trainer

    torch.set_default_dtype(DTYPE)  # _resume_exactly, before, sets float32
    results, trainers, batches = {}, {}, None
    for key, engine, strategy, method in _sweep_runs(world):
        args = _sweep_args(f"{out_dir}/sweep-{engine}", 2 * B // world, engine, strategy, method)
        if engine not in trainers:
            t = trainers[engine] = Trainer.from_config(TINY, args)
            t.bare.train()
            t.initial = [p.detach().clone() for p in t.bare.parameters()]
            if batches is None:
                stream = t.batches()
                batches = [{k: v.to(DTYPE) if torch.is_tensor(v) and v.is_floating_point() else v
                            for k, v in next(stream)[1].items()} for _ in range(SWEEP_STEPS)]
        t = trainers[engine]
        with torch.no_grad():
            for p, p0 in zip(t.bare.parameters(), t.initial):
                p.copy_(p0)
        t.parts, t.step = _fresh_parts(t, args), 0
        steps = []
        for batch in batches:
            mode = _counting_mode()
            with mode if method == COUNTED else contextlib.nullcontext():
                r = t.step_once(batch)
            steps.append({"counts": dict(mode.counts), "grad_norm": r.grad_norm, "stepped": r.stepped,
                          "stats": {k: float(v) for k, v in r.stats.items()}})
            if world > 1:
                verify_replicas(t.bare, t.step)
        results[key] = {"steps": steps, "params": _full_params(t), "weights": t.parts.weighting.weights(),
                        "kind": type(t.parts.weighting).__name__}
    for t in trainers.values():
        t.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn_parity_runs(_worker, tmp_path_factory, "fsdp", DEADLINE_S, "the FSDP2")


def max_rel_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def test_the_supported_strategies_are_the_ones_the_docs_name():
    assert STRATEGIES == ["accumulate", "combined", "detach", "feature_leaf", "find_unused"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp2_two_processes_equal_one_process_on_the_global_batch(runs, strategy, method):
    got = runs["rank0"][f"fsdp2/{strategy}/{method}"]
    ref = runs["single"][f"single/{'detach' if strategy == 'detach' else 'combined'}/{method}"]
    assert max_rel_diff(ref["params"], got["params"]) <= TOL
    # the gradient norm the finite check and the clipping use is the global one, over both ranks' shards
    # (1e-6: gls divides by float32 rank-averaged losses, whose rounding reaches the gradient; equal: ~1e-15)
    for s, r in zip(got["steps"], ref["steps"]):
        assert s["stepped"] and abs(s["grad_norm"] - r["grad_norm"]) <= 1e-6 * r["grad_norm"], (s, r)
    assert max(r["grad_norm"] for r in ref["steps"]) > 1.0  # so clipping at 1.0 took part
    if strategy == "detach":  # and the detached objective really is another objective
        assert max_rel_diff(runs["single"][f"single/combined/{method}"]["params"], got["params"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", DDP_TOO)
def test_fsdp2_equals_ddp_on_the_same_run(runs, strategy, method):
    a, b = runs["rank0"][f"fsdp2/{strategy}/{method}"], runs["rank0"][f"ddp/{strategy}/{method}"]
    assert max_rel_diff(b["params"], a["params"]) <= 1e-12
    for x, y in zip(a["steps"], b["steps"]):
        assert x["losses"] == pytest.approx(y["losses"], rel=1e-12)
        assert x["stats"] == pytest.approx(y["stats"], rel=1e-12)  # feature_leaf's per-task feature-gradient norms
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-12)
    if strategy == "feature_leaf":
        assert {"feat_grad_norm/cls", "feat_grad_norm/gen"} <= set(a["steps"][0]["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_per_block_settings_two_processes_equal_one_process(runs, engine):
    """Activation checkpointing per block, the first block and the stem frozen and layer-wise lr decay, under FSDP2
    (a frozen unit, per-block units) and DDP (no gradient for the frozen parameters: DDP is built without them):
    2 processes == 1 process on the global batch, the frozen parameters unchanged, the lr groups the same."""
    got, ref = runs["rank0"][f"{engine}/feature_leaf/equal/blocks"], runs["single"]["single/combined/equal/blocks"]
    assert max_rel_diff(ref["params"], got["params"]) <= TOL
    for s, r in zip(got["steps"], ref["steps"]):
        # the logged losses are averaged over the ranks in float32 (one rounding: ~1e-7)
        assert s["stepped"] and s["losses"] == pytest.approx(r["losses"], rel=1e-6)
    assert ref["frozen"] and all(torch.equal(v, ref["params"][k]) for k, v in ref["frozen"].items())
    assert not any(k.startswith("backbone.layers.1.") for k in ref["frozen"])
    assert got["groups"] == ref["groups"] and {s for s, _ in ref["groups"]} == {0.5, 1.0}  # layer1 frozen: L=2


def _tiny_model(*overrides):
    from mtl.data.tokenizer import train_tokenizer
    from mtl.setup.build import build_model
    from mtl.setup.checks import load_run_config

    return build_model(load_run_config(TINY, list(overrides)), 4, list("abcd"), train_tokenizer(["a b c"], 64))


@functools.cache
def tiny_units() -> tuple[int, int]:
    """tiny.yaml's FSDP2 units (``mtl.parallel.fsdp.shard_units``): (backbone units, head units). Backbone: the stem, layer1,
    layer2 (3). Heads: the classification head (one unit), and the caption head's units: one per transformer block
    (tiny.yaml: 1) and the head itself, which keeps the embeddings (wte tied to the LM head), the final norm and the
    memory projection (2): 3. U = 6."""
    from mtl.parallel.fsdp import shard_units

    names = [n for n, _ in shard_units(_tiny_model())]
    return sum(n.startswith("backbone.") for n in names), sum(n.startswith("heads.") for n in names)


def expected_counts() -> dict[str, tuple[int, int]]:
    """Per step on tiny.yaml, (all-gathers, reduce-scatters) for each strategy, from the units (``tiny_units``):
    with BK backbone units, H head units, U = BK + H and P backbone passes per step (2 for accumulate and
    find_unused, one per task; 1 otherwise), FSDP2 all-gathers a unit once for each forward through it and once for
    each backward, 2 (P BK + H); feature_leaf and detach gather one unit once more (measured: their head-only
    backward passes end before the backbone's, and FSDP2 gathers the last backbone stage again for that pass; most
    likely its backward prefetch, resharded at the end of the head pass). It reduce-scatters a unit once per
    backward pass that reduces it: U, and P BK + H for find_unused (each task's pass reduces the backbone;
    accumulate's no_sync passes reduce nothing, its last reduces each unit once)."""
    bk, h = tiny_units()
    u = bk + h
    return {"combined": (2 * u, u), "feature_leaf": (2 * u + 1, u), "detach": (2 * u + 1, u),
            "accumulate": (2 * (2 * bk + h), u), "find_unused": (2 * (2 * bk + h), 2 * bk + h)}


# the DDP run's all-reduces beyond the small ones: its gradient bucket (tiny.yaml fits one), and for accumulate
# (find_unused_parameters=True) the map of the parameters used in the step
DDP_EXTRA = {"feature_leaf": 1, "accumulate": 2}


def test_the_counts_cover_every_supported_strategy_and_the_units_are_the_documented_ones():
    assert set(expected_counts()) == set(STRATEGIES)
    from mtl.parallel.fsdp import shard_units

    assert [n for n, _ in shard_units(_tiny_model())] == [
        "backbone.stem", "backbone.layers.0", "backbone.layers.1", "heads.cls",
        "heads.gen.decoder.lm.transformer.h.0", "heads.gen"]
    assert tiny_units() == (3, 3)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_step(runs, strategy, method):
    """FSDP2 reduce-scatters the gradients and never all-reduces them: its all-reduces are the step's own small
    ones (the caption-token count, the losses with the stop flag, and gls's per-task loss averages) and, after the
    optimizer step, the ranks' agreement that every weight shard is finite (each rank holds other shards; under DDP
    each rank checks the same full weights alone); the DDP run's one more is its gradient all-reduce. (The global gradient norm's
    collective runs inside DTensor and is not seen by the dispatch mode; that the norm is global is tested by
    comparing it with the single process's above.)"""
    small = 2 + (2 if method == "gls" else 0)
    for i, step in enumerate(runs["rank0"][f"fsdp2/{strategy}/{method}"]["steps"]):
        c = step["counts"]
        gathers, scatters = expected_counts()[strategy]
        assert c.get("c10d._allgather_base_", 0) == gathers, (strategy, c)
        assert c.get("c10d._reduce_scatter_base_", 0) == scatters, (strategy, c)
        assert c.get("c10d.allreduce_", 0) == small + 1, (strategy, c)  # + the finite-weights agreement
        if f"ddp/{strategy}/{method}" in runs["rank0"]:
            d = runs["rank0"][f"ddp/{strategy}/{method}"]["steps"][i]["counts"]
            assert d.get("c10d.allreduce_", 0) == small + DDP_EXTRA[strategy] and "c10d._reduce_scatter_base_" not in d, d


@pytest.mark.slow
def test_fsdp2_save_and_resume_is_bitwise_exact_the_model_file_is_full_and_eval_runs_on_unequal_shards(runs):
    r = runs["rank0"]["resume"]
    assert r["resumed_at"] == 2 and r["bitwise"] is True
    assert 0.0 <= r["eval"]["cls_acc"] <= 1.0 and r["eval"] == runs["rank1"]["resume"]["eval"]  # unequal shards
    assert r["keys"] == sorted(_tiny_model(*RESUME_DECODER).state_dict())  # every key, unsharded (shapes: on resume)


@pytest.mark.slow
def test_the_decoder_blocks_are_fsdp2_units_gathered_one_at_a_time_and_the_tied_weight_stays_one(runs):
    """Per-block sharding of the caption head (``TaskHead.shard_units``): after sharding, after 2 steps, after the
    DCP resume and 2 steps more, each transformer block has FSDP2's state and holds DTensor shards between passes,
    and GPT-2's wte and LM head are still one parameter (sharded once, in the head's own unit)."""
    blocks = ["heads.gen.decoder.lm.transformer.h.0", "heads.gen.decoder.lm.transformer.h.1"]
    for rank in ("rank0", "rank1"):
        for f in runs[rank]["resume"]["facts"]:  # a: built, trained; b: resumed, trained
            assert f["units"][-3:] == [*blocks, "heads.gen"], f
            assert f["blocks_are_units"] == [True, True] and f["block_params_sharded"] == [True, True], f
            assert f["head_is_unit"] and f["tied"] and f["tied_sharded"], f
    # during a feature_leaf step (forward, then each head's backward): whenever a block runs, forward or backward,
    # its own unit is gathered and no other block's is (the head's unit stays gathered around its blocks' forward)
    seen = runs["rank0"]["resume"]["gathered"]
    for block in blocks:
        for phase in ("forward", "backward"):
            inside = [units for p, name, units in seen if p == phase and name.startswith(block + ".")]
            assert inside, (block, phase)
            assert all(block in units and not (set(blocks) - {block}) & set(units) for units in inside), inside
    assert not any(set(blocks) <= set(units) for _, _, units in seen)  # never both blocks at once


@pytest.mark.slow
def test_the_model_file_gathered_on_rank_0_round_trips_with_the_tied_weight(runs):
    """model.safetensors of the per-block-sharded run is the full state gathered at the save, bitwise, with the tied
    weight under both keys, and loads into a fresh unsharded model (as mtl.inference and init_from do), where the
    weight is tied again."""
    from mtl.inference import load_model
    from mtl.setup.build import read_model_weights

    r = runs["rank0"]["resume"]
    state = read_model_weights(r["file"], "test")
    assert state.keys() == r["at_save"].keys() and all(torch.equal(state[k], r["at_save"][k]) for k in state)
    lm = "heads.gen.decoder.lm."
    assert torch.equal(state[lm + "lm_head.weight"], state[lm + "transformer.wte.weight"])
    model = load_model(os.path.dirname(r["file"])).model  # the checkpoint folder, as mtl.inference reads it
    assert model.heads["gen"].decoder.lm.lm_head.weight is model.heads["gen"].decoder.lm.transformer.wte.weight
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_the_replica_check_under_fsdp2_compares_what_the_ranks_replicate(runs):
    r = runs["rank0"]["resume"]["replica"]
    assert r["before"] == []  # tiny.yaml: every parameter sharded, no buffer
    assert r["caught"] and "'backbone.probe'" in r["caught"], r


def test_the_methods_under_fsdp2_are_every_gradient_level_method_but_those_with_a_kxp_state():
    grad = {m for m, c in weighting_types().items() if c.level == "grad"}
    assert grad - set(GRAD_METHODS) == {"dbmtl", "excessmtl", "moco"}
    assert all("K x P" in weighting_types()[m].fsdp2_problem() for m in grad - set(GRAD_METHODS))
    assert "graddrop" in GRAD_METHODS and not weighting_types()["graddrop"].gram_only()


@pytest.mark.slow
@pytest.mark.parametrize("method", GRAD_METHODS + LOSS_METHODS + [f"{m}@features" for m in FEATURE_METHODS]
                         + [f"{m}/loss" for m in OTHER_LOSS_METHODS])
def test_every_weighting_method_fsdp2_two_processes_equal_one_process(runs, method):
    loss_level = method.endswith("/loss")
    strategy = "feature_leaf" if "@" in method or loss_level else "task_grads"
    method = method.removesuffix("/loss")
    got, ref = runs["rank0"][f"fsdp2/{strategy}/{method}"], runs["single"][f"single/{strategy}/{method}"]
    assert got["kind"] == ref["kind"]  # the method really was swapped in
    assert max_rel_diff(ref["params"], got["params"]) <= TOL
    assert got["weights"] == runs["rank1"][f"fsdp2/{strategy}/{method}"]["weights"]  # the same weights on every rank
    assert got["weights"] == pytest.approx(ref["weights"], rel=TOL, abs=TOL)
    for s, r in zip(got["steps"], ref["steps"]):
        assert s["stepped"] and abs(s["grad_norm"] - r["grad_norm"]) <= 1e-6 * r["grad_norm"], (s, r)
        if loss_level:  # feature_leaf's plain feat_grad_norm/<task> are each rank's own (compared with DDP above)
            continue
        # the per-task gradient statistics (norms, cosine) from the global Gram matrix
        assert s["stats"].keys() == r["stats"].keys()
        for k in s["stats"]:
            if "grad_norm/" in k or "grad_cos/" in k:
                assert s["stats"][k] == pytest.approx(r["stats"][k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_the_swapped_in_methods_give_different_updates(runs):
    """So that the parity above is not one run compared with itself."""
    r = runs["rank0"]
    assert max_rel_diff(r["fsdp2/task_grads/pcgrad"]["params"], r["fsdp2/task_grads/graddrop"]["params"]) > 1e-4
    assert r["fsdp2/task_grads/graddrop"]["weights"] != {"cls": 1.0, "gen": 1.0}  # GradDrop dropped something
    assert {"grad_norm/cls", "grad_norm/gen", "grad_cos/cls_gen"} <= set(r["fsdp2/task_grads/pcgrad"]["steps"][0]["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("method", GRAD_DDP_TOO)
def test_gradient_level_fsdp2_equals_ddp(runs, method):
    a, b = runs["rank0"][f"fsdp2/task_grads/{method}"], runs["rank0"][f"ddp/task_grads/{method}"]
    assert max_rel_diff(b["params"], a["params"]) <= 1e-12
    assert a["weights"] == pytest.approx(b["weights"], rel=1e-12)
    for x, y in zip(a["steps"], b["steps"]):
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-12)


@pytest.mark.slow
def test_task_grads_collectives_one_kxk_all_reduce_and_the_reduce_scatters(runs):
    """task_grads under FSDP2 on tiny.yaml (BK = 3 backbone units, H = 3 head units, K = 2; ``tiny_units``).
    Reduce-scatters: each head's pass its head's units (H), each task's backbone pass the backbone units (K x BK):
    9, and no gradient all-reduce. All-reduces: the step's two small ones (caption-token count; losses and stop
    flag) and ONE for the K x K Gram matrix (the losses ride in it). All-gathers: feature_leaf's, plus the backbone
    units again for the second task's backbone pass. The DDP run of the same step reduce-scatters nothing."""
    bk, h = tiny_units()
    for step in runs["rank0"][f"fsdp2/task_grads/{COUNTED}"]["steps"]:
        c = step["counts"]
        assert c.get("c10d._reduce_scatter_base_", 0) == 2 * bk + h, c
        assert c.get("c10d.allreduce_", 0) == 2 + 1 + 1, c  # ... + the finite-weights agreement after the step
        assert c.get("c10d._allgather_base_", 0) == expected_counts()["feature_leaf"][0] + bk, c
    for step in runs["rank0"][f"ddp/task_grads/{COUNTED}"]["steps"]:
        assert "c10d._reduce_scatter_base_" not in step["counts"] and step["counts"], step["counts"]


@pytest.mark.slow
def test_fp16_under_fsdp2_uses_the_sharded_scaler_skips_an_overflow_and_a_nan_on_every_rank_and_equals_ddp(runs):
    a, b = runs["rank0"]["fp16/fsdp2"], runs["rank0"]["fp16/ddp"]
    assert a["scaler"] == "ShardedGradScaler" and b["scaler"] == "GradScaler"
    for r in (a, b, runs["rank1"]["fp16/fsdp2"]):
        # the overflow really happened: step 0 skipped, not counted as a non-finite step, the scale backed off;
        # the NaN on rank 1 at the last step: skipped on both ranks as a non-finite step; neither moved a parameter
        assert [s["stepped"] for s in r["steps"]] == [False, True, True, False]
        assert [s["nonfinite"] for s in r["steps"]] == [False, False, False, True]
        assert [s["scale"] for s in r["steps"][:STEPS]] == [2.0 ** 10] * STEPS and r["unchanged_by_skips"] == [True] * 2
    # the same gradients (their norms within 1e-5) and the same two updates: under fp16 autocast the engines round
    # in other orders (and, on some CPUs, with other fp16 kernels for DTensor shards), and AdamW turns a rounding-level
    # difference in a near-zero gradient entry into an lr-sized one (measured on this project's CPU: 6.6e-4 of the
    # largest update, 2.2e-4 of the largest weight; 2e-6 on the grad norms). A missing reduction or a wrong scale
    # moves the update by tens of percent.
    assert all(torch.equal(a["initial"][k], b["initial"][k]) for k in b["initial"])  # one start
    update_a = {k: a["params"][k] - a["initial"][k] for k in a["params"]}
    update_b = {k: b["params"][k] - b["initial"][k] for k in b["params"]}
    assert max_rel_diff(update_b, update_a) <= 1e-2
    for x, y in zip(a["steps"][1:STEPS], b["steps"][1:STEPS]):
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_the_fsdp2_example_config_shrunk_trains_on_two_ranks(runs):
    r = runs["rank0"]["example"]
    assert r["sharded"] and r["precision"] == "bf16" and r["backbone"] == "resnet152"
    assert r["units"] == ["backbone.stem", "backbone.layers.0", "heads.cls", "heads.gen.decoder.lm.transformer.h.0",
                          "heads.gen.decoder.lm.transformer.h.1", "heads.gen"]
    assert r["stepped"] == [True]
    assert all(math.isfinite(v) for losses in r["losses"] for v in losses.values())
    assert r["losses"] == runs["rank1"]["example"]["losses"]  # rank-averaged, the same on both


# ---------------------------------------------------------------------------- refusals (in-process, fast)

REFUSED = [
    (["ddp.strategy=placeholder"], "ddp.strategy: placeholder does not run with parallel.engine=fsdp2"),
    (["ddp.strategy=task_grads", "weighting.method=dbmtl"], "weighting.method: dbmtl does not run with parallel.engine=fsdp2"),
    (["ddp.strategy=task_grads", "weighting.method=excessmtl"], "its K x P accumulator S is kept between steps"),
    (["ddp.find_unused_parameters=true"], "ddp.find_unused_parameters: a DistributedDataParallel option"),
    (["ddp.static_graph=true"], "ddp.static_graph: a DistributedDataParallel option"),
    (["ddp.nan_monitor=true"], "ddp.nan_monitor: not supported with parallel.engine=fsdp2"),
    (["model.backbone.norm=batch"], "model.backbone.norm: batch keeps per-rank running statistics"),
    (["parallel.engine=fsdp"], "parallel.engine: 'fsdp' is not one of ddp, fsdp2"),
]


@pytest.mark.parametrize("extra, says", REFUSED)
def test_refused_combinations_are_one_config_error_naming_the_key(tmp_path, extra, says):
    from mtl.setup.checks import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config(TINY, [f"output_dir={tmp_path}", "parallel.engine=fsdp2", *extra])
    errors = e.value.errors
    assert sum(says in m for m in errors) == 1, errors
    assert len(errors) == 1, errors


def test_a_refusal_exits_2_through_train_py(tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, f"output_dir={tmp_path}", "parallel.engine=fsdp2", "ddp.strategy=placeholder"])
    assert code == 2
    assert "ddp.strategy: placeholder does not run with parallel.engine=fsdp2" in capsys.readouterr().err


def test_graddrop_per_shard_is_graddrop_of_the_whole_matrix():
    """What makes GradDrop run under FSDP2: its update on any set of columns (a rank's shard, here two uneven,
    interleaved parts) is GradDrop of those columns with U's entries at the same coordinates; the kept fractions
    from the summed partial sums and the Gram diagonal equal the whole matrix's."""
    from mtl.setup.checks import load_run_config
    from mtl.weighting import weighting_types

    cfg = load_run_config(TINY, ["weighting.method=graddrop", "ddp.strategy=task_grads"])
    whole, shards = (weighting_types()["graddrop"](cfg, ["cls", "gen"]) for _ in range(2))
    whole.begin_step(3)
    shards.begin_step(3)
    grads = torch.randn(2, 101, dtype=torch.float64)
    grads[1, :50] = -grads[0, :50]  # conflicting coordinates: something is dropped
    expected = whole.combine(grads)
    parts = [torch.arange(0, 101, 3), torch.tensor([i for i in range(101) if i % 3])]
    got, sums = torch.zeros(101, dtype=torch.float64), 0
    for index in parts:
        d, partial = shards.combine_shard(grads[:, index], index, 101)
        got[index] = d
        sums = sums + partial
    shards.finish_shard(sums, grads @ grads.T)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert shards.weights() == pytest.approx(whole.weights(), rel=1e-12)
    assert min(whole.weights().values()) < 0.99  # something was dropped


def test_a_head_whose_shard_units_split_a_tied_weight_is_refused():
    """A parameter lives in one FSDP2 unit: a head that declares the block holding one end of a tied weight as its
    own unit (here GPT-2's LM head, tied to wte) is refused by name, before anything is sharded; the caption head's
    own declaration (its transformer blocks) keeps the tied pair in the head's unit."""
    from mtl.parallel.fsdp import shard_units

    model = _tiny_model()
    head = model.heads["gen"]
    assert [n for n, _ in head.shard_units()] == ["decoder.lm.transformer.h.0"]
    assert model.heads["cls"].shard_units() == []  # the default: the whole head is one unit
    head.shard_units = lambda: [("decoder.lm.lm_head", head.decoder.lm.lm_head)]
    with pytest.raises(ConfigError, match=r"heads.gen: its parameter decoder.lm.transformer.wte.weight is tied to a "
                                          r"parameter of the shard unit decoder.lm.lm_head that its TaskHead.shard_units "
                                          r"declares; keep tied weights in one FSDP2 unit") as e:
        shard_units(model)
    assert e.value.exit_code == 2 and len(e.value.errors) == 1
    head.shard_units = lambda: [("decoder.lm.lm_head", head.decoder.lm.lm_head),
                                ("decoder.lm.transformer.wte", head.decoder.lm.transformer.wte)]
    with pytest.raises(ConfigError, match=r"heads.gen: the shard units decoder.lm.lm_head and "
                                          r"decoder.lm.transformer.wte its TaskHead.shard_units declares share a "
                                          r"parameter"):
        shard_units(model)


def test_gathered_now_counts_each_units_own_parameters_once():
    """``mtl.parallel.fsdp.gathered_now`` (the memory tool's and the block test's probe): on a model that is not sharded every
    unit holds its full parameters; each unit counts only its own (an inner unit's are its own), the tied weight
    once, and together they are the whole model."""
    from mtl.parallel.fsdp import gathered_now, shard_units

    model = _tiny_model("model.decoder.n_layer=2")
    units = [*shard_units(model), ("", model)]
    got = gathered_now(model, units)
    head = model.heads["gen"]
    block = sum(p.numel() * p.element_size() for p in head.decoder.lm.transformer.h[0].parameters())
    assert got["heads.gen.decoder.lm.transformer.h.0"] == got["heads.gen.decoder.lm.transformer.h.1"] == block
    assert got["heads.gen"] == sum(p.numel() * p.element_size() for p in head.parameters()) - 2 * block
    assert "" not in got  # the root owns no parameter of its own
    assert sum(got.values()) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_task_grads_builds_the_shard_index_once_per_set_of_parameters(monkeypatch):
    """The FSDP2 path's coordinates of this rank's shards (``shard_index``) are built the first step and kept; other
    parameters get their own."""
    import mtl.strategies.task_grads as tg
    from mtl.setup.checks import load_run_config

    calls = []
    monkeypatch.setattr(tg, "shard_index", lambda params: calls.append(1) or torch.arange(sum(p.numel() for p in params)))
    strategy = tg.TaskGrads(load_run_config(TINY, ["ddp.strategy=task_grads"]))
    shared = [torch.zeros(3, 2), torch.zeros(4)]
    first = strategy._shard_index(shared, torch.device("cpu"))
    again = strategy._shard_index(shared, torch.device("cpu"))
    assert again[0] is first[0] and first[1] == 10 and len(calls) == 1
    other = strategy._shard_index([torch.zeros(5)], torch.device("cpu"))
    assert other[1] == 5 and len(calls) == 2


def test_only_the_sharded_scaler_unscales_under_a_warning_filter(monkeypatch):
    """The ShardedGradScaler's DTensor warning is filtered around its ``unscale_`` only: a DDP fp16 step (the plain
    GradScaler) enters no ``warnings.catch_warnings`` and unscales as before."""
    import contextlib
    import types

    import mtl.parallel.amp as amp

    entered = []
    monkeypatch.setattr(amp, "warnings", types.SimpleNamespace(
        catch_warnings=lambda: entered.append(1) or contextlib.nullcontext(), filterwarnings=lambda *a, **k: None))
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    a = amp.Amp("fp16", torch.device("cpu"))
    a.scale((2.0 * p).sum()).backward()
    assert torch.equal(p.grad, torch.full((3,), 2.0 * a.loss_scale()))
    a.unscale_(opt)
    assert entered == [] and torch.equal(p.grad, torch.full((3,), 2.0))
