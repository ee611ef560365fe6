"""Checkpoints that reshard: a run saved by W processes under one engine resumes with W'
processes under either engine, continues the same sample order, and ends where the uninterrupted run ends.

ONE spawn of three workers (tests/conftest.py ``spawn_env``): workers 0 and 1 are a 2-rank gloo run (batch B
each), worker 2 one process without a process group (batch 2B): the same global batch. tiny.yaml, fp32, SGD
with momentum (per-parameter optimizer state that must reshard), GroupNorm, no dropout, 4 steps:

- D  (1 process): 4 steps, saved at step 2: the uninterrupted run;
- E  (2 ranks, FSDP2) from D@2: 1 -> 2 and DDP -> FSDP2; saved at step 3, and its step-3 state written again
  in the mtl-checkpoint-v1 layout (full model and optimizer state gathered on rank 0, no state/), as mtl
  wrote FSDP2 checkpoints before;
- C  (2 ranks, DDP) from E@3: FSDP2 -> DDP;  F (1 process) from E@3: 2 -> 1 (and FSDP2 -> one process);
- V  (2 ranks, FSDP2) from the v1 checkpoint: an old checkpoint resumes as it was written, bitwise;
- K  (1 process, batch B: another global batch) from D@2 with resume_reshard=true: it runs, from the same
  position in global samples, and differs from D by far more than the bar (so the bar is not trivially met).

Each resumed run must consume, step by step, the same global set of samples as the uninterrupted run, and end
within the DDP parity tests' bar (max over tensors of max|a - b| / max|a| <= 1e-5, tests/test_strategies_ddp.py)
of it. A resume on the same world size and engine is bitwise: tests/test_fsdp.py (FSDP2, 2 ranks, AdamW),
tests/test_reliability.py and tests/test_chaos.py (DDP, SIGKILL), tests/test_weighting_resume.py (1 process).
The refusals (another global batch; dropout or BatchNorm on another world size; a v1 checkpoint elsewhere) are in-process
tests of ``reshard_problems`` below, with the DCP write's crash safety.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from .conftest import TINY, run_spawn, spawn_env
from .test_fsdp import RESUME_DECODER, TOL, _full_params, _sharding_facts, max_rel_diff

B = 4
DEADLINE_S = 300
COMMON = ["optim.name=sgd", "optim.lr=0.05", "optim.weight_decay=0", "optim.warmup_steps=0", "trainer.max_steps=4",
          "trainer.progress=false", "ddp.timeout_s=60", "checkpoint.every_steps=0", "data.num_workers=0",
          *RESUME_DECODER]  # two decoder blocks: under FSDP2 two units inside the caption head


def _wait_for(path: str) -> str:
    deadline = time.time() + DEADLINE_S
    while not os.path.isdir(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.2)
    return path


def _worker(index, port, out):
    world = spawn_env(index, port)
    from mtl.checkpoint import folder as ckpt
    from mtl.config.schema import to_yaml
    from mtl.parallel import dist
    from mtl.parallel.fsdp import full_model_state, full_optimizer_state
    from mtl.run.trainer import Trainer

    torch.set_num_threads(1)
    results = {}

    def ckpt_of(run, step):
        return f"{out}/{run}/checkpoints/step_{step}"

    def run(name, *args, steps, save_at=None, hook=None):
        t = Trainer.from_config(TINY, [f"output_dir={out}/{name}", *COMMON, *args])
        r = {"start": t.step, "indices": {}, "notes": list(t.resume_notes)}
        stream = t.batches()
        for _ in range(steps):
            if t.step == save_at:
                t.save()
                if hook:
                    hook(t)
            i, batch = next(stream)  # as Trainer._train takes it
            t.feed.train.batch_in_epoch = i + 1
            r["indices"][t.step + 1] = batch["index"].tolist()
            t.step_once(batch)
        r["params"] = _full_params(t)
        r["facts"] = _sharding_facts(t)
        t.close()
        results[name] = r

    def save_v1(t):  # FSDP2's trainer_state() and model file before sharded state (mtl-checkpoint-v1)
        state = {"format": ckpt.LEGACY_FORMAT, "step": t.step, "epoch": t.feed.train.epoch, "batch_in_epoch": t.feed.train.batch_in_epoch,
                 "world_size": 2, "engine": "fsdp2",
                 "optimizer": full_optimizer_state(t.bare, t.weighting, t.optimizer),
                 "scheduler": t.scheduler.state_dict(), "scaler": t.amp.state_dict(),
                 "weighting": t.weighting.state_dict()}
        ckpt.save_checkpoint(f"{out}/V", t.step, full_model_state(t.bare), state, to_yaml(t.cfg), t.dist.rank, 0,
                             t.folder.files)

    tic = time.perf_counter()
    if world > 1:
        run("E", f"data.batch_size={B}", "parallel.engine=fsdp2", f"resume={_wait_for(ckpt_of('D', 2))}", steps=2,
            save_at=3, hook=save_v1)
        run("V", f"data.batch_size={B}", "parallel.engine=fsdp2", f"resume={ckpt_of('V', 3)}", steps=1)
        run("C", f"data.batch_size={B}", f"resume={ckpt_of('E', 3)}", steps=1)
    else:
        run("D", f"data.batch_size={2 * B}", steps=4, save_at=2)
        run("K", f"data.batch_size={B}", f"resume={ckpt_of('D', 2)}", "resume_reshard=true", steps=1)
        run("F", f"data.batch_size={2 * B}", f"resume={_wait_for(ckpt_of('E', 3))}", steps=1)
    results["wall_s"] = time.perf_counter() - tic
    torch.save(results, os.path.join(out, f"worker{index}.pt"))
    dist.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    tic = time.perf_counter()
    run_spawn(_worker, out, DEADLINE_S, "the resharding")
    w = [torch.load(out / f"worker{i}.pt", weights_only=False) for i in range(3)]
    return {"rank0": w[0], "rank1": w[1], "single": w[2], "out": out, "wall_s": time.perf_counter() - tic}


def _run(runs, name):
    """A run's result, with each step's samples over all its ranks (a sorted global set)."""
    if name in runs["single"]:
        r = dict(runs["single"][name])
        r["samples"] = {s: sorted(i) for s, i in r["indices"].items()}
        return r
    r = dict(runs["rank0"][name])
    r["samples"] = {s: sorted(i + runs["rank1"][name]["indices"][s]) for s, i in r["indices"].items()}
    return r


@pytest.mark.slow
@pytest.mark.parametrize("name, start, what", [
    ("E", 2, "1 process -> 2 ranks, DDP -> FSDP2"),
    ("C", 3, "FSDP2 -> DDP, 2 ranks"),
    ("F", 3, "2 ranks (FSDP2) -> 1 process"),
])
def test_a_resume_on_another_world_size_or_engine_continues_the_uninterrupted_run(runs, name, start, what):
    r, ref = _run(runs, name), _run(runs, "D")
    assert r["start"] == start, what
    assert r["samples"] and all(r["samples"][s] == ref["samples"][s] for s in r["samples"]), what  # same order
    assert max_rel_diff(ref["params"], r["params"]) <= TOL, what
    assert any("not bitwise" in n for n in r["notes"]), r["notes"]  # it says what it is


@pytest.mark.slow
def test_the_decoder_blocks_are_units_and_the_tied_weight_stays_one_across_resharding_resumes(runs):
    """The state dict's keys do not depend on the units (FSDP2 keeps the module names), so a checkpoint written with
    the decoder sharded per block loads with any sharding; GPT-2's wte and LM head stay one parameter through each."""
    for name in ("E", "V", "C", "F"):
        f = _run(runs, name)["facts"]
        assert f["tied"], name
        sharded = name in ("E", "V")  # FSDP2 on 2 ranks; C is DDP, F one process
        assert f["blocks_are_units"] == [sharded] * 2 and f["tied_sharded"] == sharded, (name, f)


@pytest.mark.slow
def test_another_global_batch_runs_with_resume_reshard_from_the_same_position(runs):
    k, d = _run(runs, "K"), _run(runs, "D")
    assert k["start"] == 2 and any(n.startswith("resume_reshard=true") and "global batch" in n for n in k["notes"])
    # the position carries over in global samples: its first batch of 4 is the first half of D's third batch of 8
    assert len(k["samples"][3]) == B and set(k["samples"][3]) < set(d["samples"][3])
    assert max_rel_diff(d["params"], k["params"]) > 1e-3  # another run: the bar above is not met by just anything


@pytest.mark.slow
def test_an_old_format_checkpoint_resumes_as_it_was_written_bitwise(runs):
    v, e = _run(runs, "V"), _run(runs, "E")
    folder = os.path.join(runs["out"], "V", "checkpoints", "step_3")
    assert not os.path.isdir(os.path.join(folder, "state"))  # really the old layout
    assert torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=True)["format"] == "mtl-checkpoint-v1"
    assert v["start"] == 3 and v["notes"] == [] and v["samples"][4] == e["samples"][4]
    assert all(torch.equal(e["params"][k], v["params"][k]) for k in e["params"])


# ------------------------------------------------------------------ in-process: the decision, and the DCP write


def _checkpoint_dir(tmp_path, batch_size):
    """A checkpoint folder as far as ``reshard_problems`` reads it: a config.yaml with its data.batch_size."""
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / "config.yaml").write_text(f"data:\n  batch_size: {batch_size}\n")
    return str(folder)


def _now(batch_size, **data):
    """This run's config, as far as ``reshard_problems`` reads it."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"data": {"batch_size": batch_size, **data}})


V2_STATE = {"format": "mtl-checkpoint-v2", "state": "state", "world_size": 2, "engine": "ddp"}


def test_the_same_global_batch_on_another_world_size_or_engine_is_exact_up_to_rounding(tmp_path):
    from mtl.setup.resume import reshard_problems

    folder = _checkpoint_dir(tmp_path, 4)  # 2 x 4
    assert reshard_problems(folder, V2_STATE, _now(4), 2, "ddp", []) == ([], "")
    problems, note = reshard_problems(folder, V2_STATE, _now(8), 1, "ddp", [])
    assert problems == [] and "2 process(es) with parallel.engine=ddp, resumed with 1" in note and "not bitwise" in note
    problems, note = reshard_problems(folder, V2_STATE, _now(4), 2, "fsdp2", [])
    assert problems == [] and "parallel.engine=fsdp2" in note


def test_where_the_resume_cannot_be_exact_it_says_why_and_how_to_keep_it(tmp_path):
    from mtl.setup.resume import reshard_problems

    folder = _checkpoint_dir(tmp_path, 4)
    (why,), _ = reshard_problems(folder, V2_STATE, _now(4), 1, "ddp", [])
    assert "global batch changes from 8 (4 x 2 process(es)) to 4 (4 x 1)" in why and "data.batch_size=8" in why
    (why,), _ = reshard_problems(folder, V2_STATE, _now(8), 1, "ddp",
                                 ["heads.gen.decoder.drop"])
    assert "random numbers" in why and "heads.gen.decoder.drop" in why and "2 process(es)" in why
    # dropout at the same world size: each rank's own random state is restored, so that stays exact
    assert reshard_problems(folder, V2_STATE, _now(4), 2, "fsdp2", ["drop"])[0] == []


def test_multi_input_mode_on_another_world_size_asks_for_the_key(tmp_path):
    """Per-task rows are set per process in multi-input mode: another world size draws other global batches.
    data.batch_size is the global batch of the mixed policy only: the others do not read it."""
    from mtl.setup.resume import reshard_problems

    folder = _checkpoint_dir(tmp_path, 4)
    per_task = {"cls": {}, "gen": {}}
    mi = _now(8, per_task=per_task, sampling={"policy": "round_robin"})
    (why,), note = reshard_problems(folder, V2_STATE, mi, 1, "ddp", [])
    assert "multi-input mode" in why and "the same number of processes" in why and note == ""
    assert reshard_problems(folder, V2_STATE, _now(4, per_task=per_task, sampling={"policy": "round_robin"}),
                            2, "fsdp2", [])[0] == []  # same world size: no problem
    for policy, problems in (("round_robin", 0), ("mixed", 1)):  # data.batch_size 4 -> 3 at the same world size
        found, _ = reshard_problems(folder, V2_STATE, _now(3, per_task=per_task, sampling={"policy": policy}),
                                    2, "ddp", [])
        assert len(found) == problems and all("global batch changes" in p for p in found), policy


def test_an_old_format_checkpoint_on_another_world_size_is_one_message_naming_the_file_and_the_fix(tmp_path):
    from mtl.errors import CheckpointError
    from mtl.setup.resume import reshard_problems

    folder = _checkpoint_dir(tmp_path, 4)
    old = {"format": "mtl-checkpoint-v1", "world_size": 2, "engine": "fsdp2"}
    assert reshard_problems(folder, old, _now(4), 2, "fsdp2", [])[0] == []
    with pytest.raises(CheckpointError) as e:
        reshard_problems(folder, old, _now(8), 1, "ddp", [])
    msg = e.value.message
    assert os.path.join(folder, "trainer_state.pt") in msg and "mtl-checkpoint-v1" in msg
    assert "with 2 process(es) with parallel.engine=fsdp2" in msg and "its next checkpoint" in msg


def test_random_layers_are_dropout_above_zero():
    from mtl.setup.resume import random_layers

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    assert random_layers(net) == ["1"]


def _net_and_optimizer(seed):
    torch.manual_seed(seed)
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(3, 2)})
    return net, torch.nn.Module(), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _stepped(seed):
    net, weighting, opt = _net_and_optimizer(seed)
    net["used"](torch.randn(5, 4)).pow(2).sum().backward()  # "unused" gets no gradient: no optimizer state
    opt.step()
    return net, weighting, opt


def test_the_sharded_state_round_trips_and_a_parameter_that_never_stepped_stays_without_state(tmp_path):
    from mtl.checkpoint import folder as ckpt
    from mtl.checkpoint.train_state import sharded_state

    net, weighting, opt = _stepped(0)
    path = ckpt.save_checkpoint(str(tmp_path), 2, net, {"step": 2, "world_size": 1}, "seed: 0\n", 0,
                                sharded=sharded_state(net, weighting, opt))
    assert ckpt.verify_checkpoint(path)["state"] == "state"
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        listed = json.load(f)["files"]
    assert {"state/.metadata", "state/__0_0.distcp"} <= set(listed)
    other, w2, opt2 = _net_and_optimizer(1)
    assert not torch.equal(other["used"].weight, net["used"].weight)
    ckpt.load_state(path, other, w2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters(), strict=True))
    assert torch.equal(opt2.state[other["used"].weight]["momentum_buffer"], opt.state[net["used"].weight]["momentum_buffer"])
    assert other["unused"].weight not in opt2.state  # as in the run that saved it (no zero-filled state)


def test_a_missing_sharded_index_is_refused_naming_it(tmp_path):
    from mtl.checkpoint import folder as ckpt
    from mtl.checkpoint.train_state import sharded_state
    from mtl.errors import CheckpointError

    net, weighting, opt = _stepped(0)
    path = ckpt.save_checkpoint(str(tmp_path), 2, net, {"step": 2, "world_size": 1}, "seed: 0\n", 0,
                                sharded=sharded_state(net, weighting, opt))
    os.remove(os.path.join(path, "state", ".metadata"))
    with pytest.raises(CheckpointError, match="state/.metadata is missing"):
        ckpt.verify_checkpoint(path)


def test_a_full_disk_while_the_sharded_state_is_written_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import contextlib
    from pathlib import Path

    from torch.distributed.checkpoint.filesystem import FileSystem

    from mtl.checkpoint import folder as ckpt
    from mtl.checkpoint.train_state import sharded_state
    from mtl.errors import CheckpointError

    from .test_checkpoint import FullDisk, _Filling

    net, weighting, opt = _stepped(0)
    previous = ckpt.save_checkpoint(str(tmp_path), 2, net, {"step": 2, "world_size": 1}, "seed: 0\n", 0,
                                    sharded=sharded_state(net, weighting, opt))
    disk, real = FullDisk("__0_"), FileSystem.create_stream

    @contextlib.contextmanager
    def filling(self, path, mode):
        with real(self, path, mode) as f:
            yield _Filling(f, disk) if "w" in mode and Path(path).name.startswith(disk.name) else f

    monkeypatch.setattr(FileSystem, "create_stream", filling)
    with pytest.raises(CheckpointError) as e:
        ckpt.save_checkpoint(str(tmp_path), 4, net, {"step": 4, "world_size": 1}, "seed: 0\n", 0,
                             sharded=sharded_state(net, weighting, opt))
    assert disk.fired, "the disk never filled up"
    assert "no space left on device" in e.value.message and ".step_4.tmp" in e.value.message
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_2"]
    assert ckpt.verify_checkpoint(previous)["step"] == 2


TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("free", [0, 1 << 40])
def test_torch_s_short_write_error_is_named_as_a_full_disk_in_its_own_words(tmp_path, monkeypatch, free):
    """On a full disk torch's writer raises a RuntimeError ("unexpected pos"), not an OSError: the
    message says "no space left on device", the path and the bytes, when the disk has less room than the state;
    otherwise torch's own text, in its own case. Either way the previous checkpoint stays and no .tmp is left."""
    import shutil as shutil_module
    from collections import namedtuple

    import torch.distributed.checkpoint.filesystem as fs

    from mtl.checkpoint import folder as ckpt
    from mtl.checkpoint.train_state import sharded_state
    from mtl.errors import CheckpointError

    net, weighting, opt = _stepped(0)
    previous = ckpt.save_checkpoint(str(tmp_path), 2, net, {"step": 2, "world_size": 1}, "seed: 0\n", 0,
                                    sharded=sharded_state(net, weighting, opt))
    fired = []

    def short_write(transforms, stream, data, *args, **kwargs):  # some bytes reach the disk, then it is full
        stream.write(b"x" * 64)
        fired.append(1)
        raise RuntimeError(TORCH_SHORT_WRITE)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fs, "_write_item", short_write)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(1 << 41, (1 << 41) - free, free))
    with pytest.raises(CheckpointError) as e:
        ckpt.save_checkpoint(str(tmp_path), 4, net, {"step": 4, "world_size": 1}, "seed: 0\n", 0,
                             sharded=sharded_state(net, weighting, opt))
    assert fired, "the writer never failed"
    msg = e.value.message
    where = os.path.join(str(tmp_path), "checkpoints", ".step_4.tmp", "state")
    if free == 0:
        assert f"{where}: no space left on device (" in msg and "bytes to write here, 0 free)" in msg
    else:
        assert TORCH_SHORT_WRITE in msg and "RuntimeError" in msg  # not lower-cased
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["step_2"]  # no .step_4.tmp
    assert ckpt.verify_checkpoint(previous)["step"] == 2


def test_batchnorm_on_another_world_size_asks_for_the_key(tmp_path):
    """BatchNorm normalises over each process's own batch: another world size is another run."""
    from mtl.setup.resume import reshard_problems

    folder = _checkpoint_dir(tmp_path, 4)
    bn = ["backbone.layers.0.1.bn1", "backbone.stem.1"]
    (why,), note = reshard_problems(folder, V2_STATE, _now(8), 1, "ddp", [], bn)
    assert "BatchNorm" in why and "backbone.layers.0.1.bn1" in why and "model.backbone.norm=group" in why
    assert note == ""
    assert reshard_problems(folder, V2_STATE, _now(4), 2, "fsdp2", [], bn)[0] == []  # same world size: exact


def _tiny_model(norm):
    from mtl.data.tokenizer import train_tokenizer
    from mtl.setup.build import build_model
    from mtl.setup.checks import load_run_config

    # SyncBatchNorm needs CUDA in a run, and frozen norms pretrained weights (the config refuses them without):
    # both are converted here as model.backbone.norm=sync / frozen does
    converted = norm in ("sync", "frozen")
    cfg = load_run_config(TINY, [f"model.backbone.norm={'batch' if converted else norm}", "tasks=[cls,gen,count]"])
    tok = train_tokenizer(["one small red object in the centre", "two large blue objects"], 64)
    torch.manual_seed(0)
    model = build_model(cfg, 4, ["a", "b", "c", "d"], tok)
    if converted:
        from mtl.models.backbones.torchvision_cnn import convert_norm

        model.backbone = convert_norm(model.backbone, norm)
    return model, tok, cfg


def _split(value, k, b):
    """``value`` with every tensor whose first dimension is the batch ``b`` cut to its first ``k`` rows (the others
    copied)."""
    if torch.is_tensor(value):
        return value[:k] if value.ndim and value.shape[0] == b else value.detach().clone()
    if isinstance(value, dict):
        return {key: _split(v, k, b) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_split(v, k, b) for v in value)
    return value


@pytest.mark.slow  # seconds per model: the full suite, not the fast tier
@pytest.mark.parametrize("norm", ["batch", "group", "frozen", "sync"])
def test_every_module_that_mixes_the_samples_of_a_batch_is_refused_on_another_world_size(norm):
    """The reshard check is complete: run every module of a model mtl builds (each backbone norm; the
    classification, captioning and counting heads) in training mode on the first half of the batch it saw; a
    module whose output rows then differ mixes the samples of its process's batch, and must be (or hold) a module
    ``batch_statistics_layers`` or ``random_layers`` names. SyncBatchNorm is the one exemption: its statistics are
    over the global batch (here, without a process group, it falls back to the local one)."""
    from mtl.setup.resume import batch_statistics_layers, random_layers

    from .conftest import make_collate

    model, tok, cfg = _tiny_model(norm)
    model.train()
    b, k = 6, 3
    items = [{"image": torch.rand(3, 32, 32), "label": i % 4, "captions": ["two large blue objects"], "count": 1 + i % 3,
              "index": i} for i in range(b)]
    batch = make_collate(tok, 10, tasks=cfg.tasks)(items)
    seen = {}

    def record(name):
        def hook(module, args, kwargs, out):  # returns None: the output stays as it was
            if name not in seen:  # copies: a later in-place op (ReLU(inplace=True)) must not change them
                seen[name] = _split((args, kwargs, out), None, -1)
        return hook

    hooks = [m.register_forward_hook(record(name), with_kwargs=True) for name, m in model.named_modules()]
    model(batch)
    for h in hooks:
        h.remove()
    mixing = []
    modules = dict(model.named_modules())
    for name, (args, kwargs, out) in seen.items():
        if not (torch.is_tensor(out) and out.ndim and out.shape[0] == b and out.is_floating_point()):
            continue  # a loss or a non-batch output: its rows cannot be compared
        with torch.no_grad():
            half = modules[name](*_split(args, k, b), **_split(kwargs, k, b))
        if not torch.allclose(half, out[:k].detach(), rtol=1e-4, atol=1e-5):
            mixing.append(name)
    flagged = set(batch_statistics_layers(model)) | set(random_layers(model))
    sync = {n for n, m in modules.items() if isinstance(m, torch.nn.SyncBatchNorm)}
    unexplained = [n for n in mixing if not any(f == n or f.startswith(n + ".") if n else True
                                                for f in flagged | sync)]
    assert unexplained == []
    if norm == "batch":  # the check can fail: here BatchNorm mixes the samples and is named
        assert mixing and flagged and all(f in mixing for f in flagged)
    if norm in ("group", "frozen"):
        assert mixing == [] and flagged == set()


@pytest.mark.slow  # in-process runs, seconds long
def test_a_batchnorm_run_saved_by_two_processes_is_refused_on_one_naming_the_cause(tmp_path):
    """The trainer asks: a BatchNorm run's checkpoint as 2 processes write it (world_size 2, two RNG files), resumed
    by 1 process with the global batch kept, stops naming BatchNorm and resume_reshard (exit 4)."""
    import shutil

    from mtl.errors import CheckpointError
    from mtl.run.trainer import Trainer

    from .test_trust import refresh_manifest

    common = ["model.backbone.norm=batch", "trainer.max_steps=1", "checkpoint.every_steps=0", "data.num_workers=0",
              f"output_dir={tmp_path}/run"]
    t = Trainer.from_config(TINY, [*common, "data.batch_size=4"])
    t.save()
    path = f"{tmp_path}/run/checkpoints/step_0"
    t.close()
    state = torch.load(f"{path}/trainer_state.pt", weights_only=True)
    torch.save({**state, "world_size": 2}, f"{path}/trainer_state.pt")
    shutil.copy(f"{path}/rng_rank0.pt", f"{path}/rng_rank1.pt")
    refresh_manifest(path)
    with pytest.raises(CheckpointError) as e:
        Trainer.from_config(TINY, [*common, "data.batch_size=8", f"resume={path}", f"output_dir={tmp_path}/again"])
    msg = e.value.message
    assert e.value.exit_code == 4 and "BatchNorm" in msg and "backbone.stem.1" in msg and "resume_reshard" in msg
    t = Trainer.from_config(TINY, [*common, "data.batch_size=8", f"resume={path}", "resume_reshard=true",
                                   f"output_dir={tmp_path}/again"])
    assert any("BatchNorm" in n for n in t.resume_notes)
    t.close()
