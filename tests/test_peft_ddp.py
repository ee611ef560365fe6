"""``model.peft`` proven under DDP and FSDP2: 2 processes x batch B == 1 process x batch 2B, with one shared LoRA
adapter and with per-task adapters (plus the shared one, MTLoRA's layout), for every strategy that runs the layout and
both gradient sources; the naive setup's failure (plain DDP, per-task adapters, one backward per task) reproduced; a
checkpoint.trainable_only checkpoint resumed exactly under FSDP2; and a SIGKILLed per-task LoRA run resumed byte for
byte.

ONE spawn of three workers (tests/test_strategies_ddp.py's harness): workers 0 and 1 are a 2-rank gloo run (batch B
each), worker 2 has no process group and runs the references on batch 2B. Per-task adapters need one encoder forward
per task, so the strategies that share one forward (detach, feature_leaf, task_grads) are refused with them at config
time (tests/test_peft.py) and are run here with the shared adapter only. A gradient-level method (MGDA) runs on both
sources with the shared adapter: ``parameters`` (task_grads: the adapters' gradients only) and ``features``
(feature_leaf). fp32, SGD; the bar is tests/test_strategies_ddp.py's (each tensor within 1e-5 of its largest entry,
floored at 1e-2)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from mtl.strategies import strategy_types

from .conftest import parity_worker, run_train, spawn_parity_runs
from .test_peft import LORA, VIT_GPT2

B = 4
STEPS = 2
TOL = 1e-5
DEADLINE_S = 400
COMMON = ["optim.name=sgd", "optim.lr=0.5", "optim.weight_decay=0", "optim.warmup_steps=0", "optim.grad_clip=0",
          "trainer.progress=false", "ddp.timeout_s=60", "checkpoint.every_steps=0", "trainer.eval_every=100",
          "trainer.num_samples=0", "data.synthetic.train_size=16", "data.synthetic.val_size=4",
          "model.decoder.dropout=0.0"]
LAYOUTS = {"shared": [*LORA], "per_task": [*LORA, "model.peft.per_task=true", "model.peft.shared=true"]}
USABLE = sorted(n for n, c in strategy_types().items() if not c.unsafe)
GRAD = {"mgda@parameters": ("task_grads", ["weighting.method=mgda", "weighting.source=parameters"]),
        "mgda@features": ("feature_leaf", ["weighting.method=mgda", "weighting.source=features"])}


def cases(world: int) -> list[tuple[str, str, list[str]]]:
    """(key, strategy, overrides) each worker runs: every usable strategy per layout and engine, and the gradient
    sources, on the ranks; the references (combined per layout, detach's own objective, each source's) alone."""
    if world == 1:
        out = [(f"{layout}/combined", "combined", LAYOUTS[layout]) for layout in LAYOUTS]
        out.append(("shared/detach", "detach", LAYOUTS["shared"]))
        return out + [(f"shared/{g}", s, [*LAYOUTS["shared"], *extra]) for g, (s, extra) in GRAD.items()]
    out = []
    for engine in ("ddp", "fsdp2"):
        for layout, extra in LAYOUTS.items():
            for s in USABLE:
                cls = strategy_types()[s]
                if (layout == "per_task" and not cls.per_task_forwards) or (
                        engine == "fsdp2" and cls.fsdp2_problem() is not None):
                    continue
                out.append((f"{engine}/{layout}/{s}", s, [*extra, f"parallel.engine={engine}"]))
        out += [(f"{engine}/shared/{g}", s, [*LAYOUTS["shared"], *extra, f"parallel.engine={engine}"])
                for g, (s, extra) in GRAD.items()]
    return out


def reference(key: str) -> str:
    """The single-process run a rank's ``key`` must equal."""
    _, layout, what = key.split("/")
    return f"{layout}/{what if what in ('detach', *GRAD) else 'combined'}"


def _runs(world, out_dir, folders=()):
    from mtl.parallel.fsdp import full_model_state, is_sharded
    from mtl.run.trainer import Trainer

    results = {}
    for key, strategy, extra in cases(world):
        trainer = Trainer.from_config(VIT_GPT2, [*folders, *COMMON, *extra, f"ddp.strategy={strategy}",
                                                 f"data.batch_size={2 * B // world}",
                                                 f"output_dir={os.path.join(out_dir, f'w{world}', key)}"])
        assert trainer.dist.world_size == world
        trainer.bare.train()
        for _ in range(STEPS):
            trainer.step_once()
        state = full_model_state(trainer.bare) if is_sharded(trainer.bare) else trainer.bare.state_dict()
        results[key] = {k: v.detach().cpu().clone() for k, v in state.items() if v.is_floating_point()}
        trainer.close()
    if world > 1:  # FSDP2, per-task adapters, a trainable-only checkpoint after step 1, resumed for step 2
        results[RESUMED] = _resumed(out_dir, folders)
    if world > 1:  # last: the naive setup, which leaves DDP's reducer in error
        for layout in LAYOUTS:
            results[f"naive/{layout}"] = _naive(layout, os.path.join(out_dir, "naive", layout), folders)
    return results


RESUMED = "fsdp2/per_task/accumulate/trainable_only_resumed"


def _resumed(out_dir: str, folders) -> dict:
    """``fsdp2/per_task/accumulate`` cut after step 1 (a checkpoint.trainable_only checkpoint, sharded state of the
    adapters and heads alone) and resumed for step 2: its full state on rank 0."""
    from mtl.parallel.fsdp import full_model_state
    from mtl.run.trainer import Trainer

    args = [*folders, *COMMON, *LAYOUTS["per_task"], "parallel.engine=fsdp2", "ddp.strategy=accumulate",
            "checkpoint.trainable_only=true", f"data.batch_size={B}", f"output_dir={os.path.join(out_dir, 'resumed')}"]
    trainer = Trainer.from_config(VIT_GPT2, args)
    trainer.step_once()
    path, _ = trainer.folder.save(trainer.step, trainer.parts, trainer.feed)
    trainer.close()
    trainer = Trainer.from_config(VIT_GPT2, [*args, f"resume={path}"])
    assert trainer.step == 1
    trainer.step_once()
    state = {k: v.detach().cpu().clone() for k, v in full_model_state(trainer.bare).items() if v.is_floating_point()}
    trainer.close()
    return state


def _naive(layout: str, out_dir: str, folders) -> str:
    """Plain DDP (find_unused_parameters=false), one forward and backward per task; the heads of the other tasks get
    a zero term (``absent_heads_term``), so that only the encoder's adapters can be left without a gradient. Returns
    "ok", or the error DDP raised."""
    from mtl.run.trainer import Trainer
    from mtl.strategies.absent import absent_heads_term

    trainer = Trainer.from_config(VIT_GPT2, [*folders, *COMMON, *LAYOUTS[layout], "ddp.strategy=find_unused",
                                             "ddp.find_unused_parameters=false", "ddp.unsafe=true",
                                             f"data.batch_size={B}", f"output_dir={out_dir}"])
    batches = trainer.batches()
    try:
        for _ in range(2):
            batch = next(batches)[1]
            for t in trainer.tasks:
                loss = trainer.model(batch, tasks=[t])["losses"][t]
                (loss + absent_heads_term(trainer.model, [t])).backward()
        return "ok"
    except RuntimeError as e:
        return str(e)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from mtl.config.schema import load_config

    from .pretrained_folders import local_pretrained

    return local_pretrained(load_config(VIT_GPT2), tmp_path_factory.mktemp("pretrained"))


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    run = functools.partial(_runs, folders=folders)
    return spawn_parity_runs(functools.partial(parity_worker, run), tmp_path_factory, "peft_ddp", DEADLINE_S,
                             "peft DDP/FSDP2")


def close(ref: dict, got: dict) -> list[str]:
    return [k for k in ref if float((ref[k] - got[k]).abs().max()) > TOL * max(float(ref[k].abs().max()), 1e-2)]


def test_the_cases_cover_every_strategy_layout_engine_and_source():
    keys = [k for k, _, _ in cases(2)]
    for engine in ("ddp", "fsdp2"):
        assert {f"{engine}/per_task/{s}" for s in ("combined", "find_unused", "accumulate")} <= set(keys)
        assert {f"{engine}/shared/{s}" for s in ("feature_leaf", "task_grads", "detach", "combined")} <= set(keys)
        assert {f"{engine}/shared/{g}" for g in GRAD} <= set(keys)
    assert "ddp/per_task/placeholder" in keys and "ddp/shared/placeholder" in keys


@pytest.mark.slow
def test_two_processes_equal_one_process_with_lora_shared_and_per_task_under_ddp_and_fsdp2(runs):
    failed = {}
    for key in [k for k in runs["rank0"] if not k.startswith("naive/") and k != RESUMED]:
        got, other = runs["rank0"][key], runs["rank1"][key]
        if key.startswith("ddp/"):  # DDP's replicas are equal; FSDP2 gathers the full state on rank 0 only
            assert all(torch.equal(got[k], other[k]) for k in got), f"{key}: the two ranks' replicas differ"
        bad = close(runs["single"][reference(key)], got)
        if bad:
            failed[key] = bad[:3]
    assert not failed, failed
    assert len(runs["rank0"]) == len(cases(2)) + len(LAYOUTS) + 1


@pytest.mark.slow
def test_the_bar_is_not_trivial_the_adapters_moved_and_each_task_s_is_its_own(runs, folders):
    """Each adapter trained (LoRA's B starts at 0: it moved), and the two tasks' adapters and the shared one ended
    apart: a run that synced or switched the wrong adapters would not match the reference."""
    ref = runs["single"]["per_task/combined"]
    names = [k for k in ref if k.startswith("backbone.") and ".lora_B." in k]
    assert {k.split(".lora_B.")[1].split(".")[0] for k in names} == {"task_cls", "task_gen", "default"}
    assert all(float(ref[k].abs().max()) > 0 for k in names)  # every adapter moved off its zero start
    q = "backbone.model.layers.0.attention.v_proj.lora_B."
    assert not torch.allclose(ref[q + "task_cls.weight"], ref[q + "task_gen.weight"])
    # the per-task layout trains another model than the shared one, and detach another objective
    shared = runs["single"]["shared/combined"]
    assert close({k: v for k, v in shared.items() if k.startswith("heads.")}, ref)
    assert len(close(runs["single"]["shared/combined"], runs["single"]["shared/detach"])) > 0


@pytest.mark.slow
def test_a_trainable_only_checkpoint_resumes_fsdp2_per_task_lora_exactly(runs):
    """Under FSDP2 with per-task adapters: one step, a checkpoint of the adapters and heads alone, a fresh trainer
    resumed from it for the second step: the same model, bit for bit, as the uninterrupted two steps."""
    got, ref = runs["rank0"][RESUMED], runs["rank0"]["fsdp2/per_task/accumulate"]
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_the_naive_setup_with_per_task_adapters_fails_under_ddp_and_the_strategies_pass(runs):
    """Plain DDP, per-task adapters, one backward per task, the other heads covered by a zero term: in task cls's pass
    task gen's adapter gets no gradient and DDP raises its reduction error; the same loop with one shared adapter runs
    (so the adapters are what fails). combined, find_unused, accumulate and placeholder pass the parity test above
    with the same per-task adapters."""
    for rank in ("rank0", "rank1"):
        assert runs[rank]["naive/shared"] == "ok"
        assert "Expected to have finished reduction in the prior iteration" in runs[rank]["naive/per_task"]
    assert {f"ddp/per_task/{s}" for s in ("combined", "find_unused", "accumulate", "placeholder")} <= set(runs["rank0"])


@pytest.mark.slow
def test_sigkill_then_resume_with_per_task_lora_is_bitwise_identical(tmp_path, folders):
    """tests/test_reliability.py's kill test on per-task + shared LoRA (one process, accumulate; the DDP side of the
    per-task step is the parity run's, and of the checkpoint tests/test_reliability.py's): the job SIGKILLed
    past its step-4 checkpoint, then resumed; it continues from that checkpoint and ends byte for byte where the
    uninterrupted run ends."""
    from .resume_check import check_resume, snapshot
    from .test_reliability import FAST, kill_job, model_bytes, start, wait_for_step

    args = ["--config", VIT_GPT2, *folders, *LAYOUTS["per_task"], "ddp.strategy=accumulate", "trainer.max_steps=8",
            "model.decoder.dropout=0.1", "model.peft.dropout=0.1", "data.batch_size=4",
            "data.synthetic.train_size=64", "data.synthetic.val_size=4", "trainer.num_samples=0",
            "data.num_workers=0", *FAST]
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"])
    proc = start([*args, f"output_dir={cut}"])
    wait_for_step(proc, cut, 5)  # past the step-4 checkpoint
    assert kill_job(proc)
    before = snapshot(cut)
    assert 0 < before.step < 8
    run_train([*args, f"output_dir={cut}"])
    check_resume(cut, before, last_step=8)
    assert model_bytes(ref, 8) == model_bytes(cut, 8)
