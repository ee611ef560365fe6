"""The Trainer's three components, each alone: the RunFolder (its decisions and timing, and what a failed start-up
leaves behind), the Feed (a position saved and restored continues with the same batches: one data set, the
multi-input plans, the held-out stream; any batch value with ``.to`` moves) and the StepLog (what a step and an
evaluation write). Plus the console: the start-up data summary, and lines printed through the progress bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mtl.config.schema import config_summary
from mtl.data.heldout import HeldoutStream
from mtl.data.loader import build_train_loader, normalizing, to_device
from mtl.data.multi_input import MultiInputStream, seed_of
from mtl.errors import ConfigError, DataError
from mtl.parallel.amp import Amp
from mtl.parallel.dist import DistInfo
from mtl.run import runlock
from mtl.run.feed import LoaderFeed, PlanFeed, data_summary
from mtl.run.logger import RunLogger
from mtl.run.run_folder import RunFolder
from mtl.run.step import StepParts, StepResult
from mtl.run.step_log import StepLog, flat_metrics
from mtl.run.trainer import Trainer
from mtl.setup.build import build_optimizer, build_run_inputs, build_scheduler, build_weighting, run_task_types
from mtl.setup.checks import load_run_config

from .conftest import ROOT, TINY

MI = os.path.join(ROOT, "configs", "multi_input.yaml")


def config(out, *overrides, path=TINY):
    return load_run_config(path, [f"output_dir={out}", *overrides])


# ------------------------------------------------------------------ RunFolder


def test_the_run_folder_decides_when_to_save_and_when_the_run_ends(tmp_path):
    folder = RunFolder(config(tmp_path, "trainer.max_steps=10", "checkpoint.every_steps=4"), DistInfo())
    assert [s for s in range(1, 11) if folder.save_due(s)] == [4, 8]  # step 10 is the final save, not a periodic one
    assert [s for s in range(0, 12) if folder.is_last(s)] == [10, 11]
    never = RunFolder(config(tmp_path, "checkpoint.every_steps=0"), DistInfo())
    assert not any(never.save_due(s) for s in range(1, 20))


def test_the_run_folder_resumes_only_what_it_was_asked_to(tmp_path):
    first = RunFolder(config(tmp_path), DistInfo())
    first.lock()
    assert first.prepare() is None and (tmp_path / "config.yaml").is_file()
    root = tmp_path / "checkpoints" / "step_2"
    root.mkdir(parents=True)
    first.close()
    again = RunFolder(config(tmp_path), DistInfo())  # resume unset: another run's checkpoints are not overwritten
    again.lock()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        again.prepare()


def _missing_images(out, tmp_path):
    return config(out, "data.source=imagefolder", f"data.train_path={tmp_path / 'no_such_folder'}",
                  f"data.val_path={tmp_path / 'no_such_folder'}", "tasks=[cls]")


def test_a_data_error_leaves_nothing_in_output_dir(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(DataError, match="data.train_path"):
        Trainer(_missing_images(out, tmp_path), DistInfo())
    assert not out.exists() or os.listdir(out) == []  # no config.yaml, no lock, no tokenizer
    existing = tmp_path / "kept"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(DataError):
        Trainer(_missing_images(existing, tmp_path), DistInfo())
    assert os.listdir(existing) == ["notes.txt"]


def test_a_busy_output_dir_and_a_data_error_are_reported_together(tmp_path):
    out = tmp_path / "run"
    holder = RunFolder(config(out), DistInfo())
    holder.lock()
    try:
        with pytest.raises(DataError) as e:
            Trainer(_missing_images(out, tmp_path), DistInfo())
        assert "data.train_path" in e.value.message and "in use by another run" in e.value.message
        assert (out / runlock.LOCK_NAME).exists()  # still the holder's
    finally:
        holder.close()


# ------------------------------------------------------------------ Feed


def _index(batch) -> list[int]:
    return batch["index"].tolist()


def test_a_single_input_feed_continues_where_its_state_says(tmp_path):
    cfg = config(tmp_path, "data.synthetic.train_size=40", "data.batch_size=8")
    inputs = build_run_inputs(cfg)

    def feed():
        return LoaderFeed(build_train_loader(inputs.train_ds, inputs.collate, 8, 0, 1, cfg.seed), 8, 1)

    whole = feed()
    seen = [_index(whole.take(s)[1]) for s in range(7)]  # 5 batches an epoch: into the second epoch
    assert whole.epoch == 1 and whole.batch_in_epoch == 2
    cut = feed()
    for s in range(3):
        cut.take(s)
    state = cut.state_dict()
    assert state == {"data": {"epoch": 0, "samples": 24}}
    resumed = feed()
    assert resumed.load_state_dict(state) == []
    assert [_index(resumed.take(s)[1]) for s in range(3, 7)] == seen[3:]
    assert sorted(i for b in seen[:5] for i in b) == list(range(40))  # an epoch is every item once


def test_a_multi_input_feed_continues_where_its_state_says(tmp_path):
    cfg = config(tmp_path, path=MI)
    inputs = build_run_inputs(cfg)

    def feed():
        return PlanFeed(MultiInputStream(cfg, {t: tr for t, (tr, _) in inputs.task_sets.items()},
                                         inputs.task_collates, 0, 1))

    def rows(batch):
        return {t: _index(batch)[slice(*sub["rows"])] for t, sub in batch["multi_input"].items()}

    whole = feed()
    seen = [rows(whole.take(s)[1]) for s in range(40)]  # gen's 128 items at 4 a step: past its first epoch
    cut = feed()
    for s in range(33):
        cut.take(s)
    state = cut.state_dict()
    assert state["multi_input"]["gen"] == {"epoch": 1, "pos": 4, "size": 128}
    resumed = feed()
    resumed.load_state_dict(state)
    assert [rows(resumed.take(s)[1]) for s in range(33, 40)] == seen[33:]


def test_the_heldout_stream_continues_where_its_state_says_and_keeps_its_order(tmp_path):
    cfg = config(tmp_path, "weighting.method=autolambda", "data.heldout=32")
    inputs = build_run_inputs(cfg)
    collate = normalizing(inputs.collate, inputs.train_ds)
    n = len(inputs.train_ds)

    def stream(rank=0, world=1):
        return HeldoutStream(inputs.train_ds, collate, 32, 8, rank, world, cfg.seed)

    whole = stream()
    seen = [whole.indices()[0] for _ in range(6)]  # 4 global batches an epoch: into the second
    # the documented order: a permutation of the last 32 items per (seed, "heldout", epoch), sliced in order
    for epoch, batches in ((0, seen[:4]), (1, seen[4:])):
        g = torch.Generator().manual_seed(seed_of(cfg.seed, "heldout", epoch))
        perm = [n - 32 + int(i) for i in torch.randperm(32, generator=g)]
        assert [i for b in batches for i in b] == perm[: 8 * len(batches)]
    cut = stream()
    for _ in range(5):
        cut.indices()
    state = cut.state_dict()
    assert state == {"epoch": 1, "samples": 8, "size": 32}
    resumed = stream()
    resumed.load_state_dict(state)
    assert resumed.indices()[0] == seen[5]
    halves = [stream(r, 2) for r in (0, 1)]  # 2 ranks of 4: together the 1-process batch of 8
    for h in halves:
        h.batch_size = 4
    assert sorted(halves[0].indices()[0] + halves[1].indices()[0]) == sorted(seen[0])
    with pytest.raises(DataError, match="data.heldout"):
        HeldoutStream(inputs.train_ds, collate, 16, 8, 0, 1, cfg.seed).load_state_dict(state)


def test_every_value_that_can_move_moves_to_the_device():
    data = pytest.importorskip("torch_geometric.data", reason="the graph batches need the qm9 extra")
    Batch, Data = data.Batch, data.Data

    graphs = Batch.from_data_list([Data(x=torch.ones(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]))])
    batch = {"graph": graphs, "index": torch.arange(1), "captions": [["a b"]], "multi_input": {"cls": {
        "label": torch.zeros(1), "rows": (0, 1)}}}
    moved = to_device(batch, torch.device("meta"))
    assert moved["graph"].x.device.type == "meta" and moved["index"].device.type == "meta"
    assert moved["multi_input"]["cls"]["label"].device.type == "meta" and moved["multi_input"]["cls"]["rows"] == (0, 1)
    assert moved["captions"] == [["a b"]]


# ------------------------------------------------------------------ StepLog


def _step_log(tmp_path, *overrides):
    cfg = config(tmp_path, *overrides)
    net = torch.nn.Linear(2, 2)
    weighting = build_weighting(cfg)
    optimizer = build_optimizer(cfg, net, weighting)
    parts = StepParts(model=net, bare=net, tasks=list(cfg.tasks), strategy=None, weighting=weighting,
                      optimizer=optimizer, scheduler=build_scheduler(cfg, optimizer), amp=Amp("fp32", torch.device("cpu")),
                      params=list(net.parameters()), grad_clip=0.0)
    log = RunLogger(str(tmp_path), True, cfg.trainer.max_steps, False)
    return StepLog(cfg, parts, log, torch.device("cpu"), 2, True), log


def _records(tmp_path) -> list[dict]:
    with open(tmp_path / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_step_log_writes_a_steps_record_every_log_every(tmp_path):
    steplog, log = _step_log(tmp_path, "trainer.log_every=2")
    r = StepResult(losses={"cls": 1.5, "gen": 2.5}, grad_norm=0.75, stepped=True, nonfinite=False, stop_agreed=False,
                   stats={"feat_grad_cos/cls_gen": 0.25})
    batch = {"index": torch.arange(8)}
    for step in (1, 2, 3):
        steplog.after_step(step, r, 0.5, batch, epoch=0)
    log.close()
    rows = _records(tmp_path)
    assert [x["step"] for x in rows] == [1, 2]  # step 1, then every 2nd
    row = rows[-1]
    assert row["kind"] == "train" and row["loss_cls"] == 1.5 and row["loss_gen"] == 2.5 and row["grad_norm"] == 0.75
    assert row["weight_cls"] == row["weight_gen"] == 1.0 and row["feat_grad_cos/cls_gen"] == 0.25
    assert row["samples_per_s"] == 8 * 2 / 0.5 and row["skipped"] == 0 and row["epoch"] == 0


def test_the_step_log_counts_bad_steps_and_stops_at_the_limit(tmp_path):
    steplog, log = _step_log(tmp_path, "trainer.max_bad_steps=2", "ddp.nan_monitor=false")
    bad = StepResult(losses={"cls": float("nan"), "gen": 1.0}, grad_norm=float("nan"), stepped=False, nonfinite=True,
                     stop_agreed=False)
    steplog.after_step(3, bad, 0.1, {"index": torch.arange(2)})
    from mtl.errors import TrainingError

    with pytest.raises(TrainingError, match="2 consecutive non-finite steps"):
        steplog.after_step(4, bad, 0.1, {"index": torch.arange(2)})
    log.close()
    rows = [x for x in _records(tmp_path) if x["kind"] == "bad_step"]
    assert [(x["step"], x["nonfinite"], x["consecutive"]) for x in rows] == [(3, "cls", 1), (4, "cls", 2)]


def test_the_step_log_flattens_and_prints_an_evaluation(tmp_path, capsys):
    steplog, log = _step_log(tmp_path)
    flat = steplog.evaluation(6, flat_metrics({"cls": {"acc": 0.5}, "gen": {"bleu4": 0.125, "samples": [(0, "a", "b")]}},
                                              {"cls": {"acc": 0.25}}))
    log.close()
    assert flat == {"cls_acc": 0.5, "gen_bleu4": 0.125, "test_cls_acc": 0.25}
    assert "step 6 eval: cls_acc=0.5000, gen_bleu4=0.1250, test_cls_acc=0.2500" in capsys.readouterr().out
    row = _records(tmp_path)[-1]
    assert row["kind"] == "eval" and row["step"] == 6 and row["test_cls_acc"] == 0.25


# ------------------------------------------------------------------ the console


def test_the_start_up_summary_shows_the_data_and_not_the_keys_the_run_does_not_read(tmp_path):
    cfg = config(tmp_path, "data.synthetic.train_size=40")
    summary = data_summary(cfg, build_run_inputs(cfg), run_task_types(cfg))
    lines = summary.splitlines()
    assert lines[0] == "data:" and lines[1] == "  cls: train 40 items, val 64 items; 4 classes"
    assert lines[2].startswith("  gen: train 40 items, val 64 items; vocabulary ") and ", unknown tokens train " in lines[2]
    assert "synthetic.train_size=40" in config_summary(cfg)  # a synthetic run reads them
    # set before data.source chose a manifest: not read, left out (mtl/config/read_rules.py; tests/test_unused_keys.py)
    (tmp_path / "synthetic40.yaml").write_text(f"base: {TINY}\ndata: {{synthetic: {{train_size: 40}}}}\n")  # a file:
    manifest = config(tmp_path, "data.source=manifest", "data.train_path=t.jsonl",  # one command line is judged whole
                      "data.val_path=v.jsonl", path=str(tmp_path / "synthetic40.yaml"))
    *in_effect, left_out = config_summary(manifest).splitlines()
    assert "synthetic" not in "\n".join(in_effect) and "source=manifest" in "\n".join(in_effect)
    assert left_out.startswith("  not read by this run, left out: ") and "data.synthetic.train_size=40" in left_out


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_lines_printed_during_training_go_through_the_progress_bar(tmp_path):
    """stdout and stderr into one pipe (a log file, ``| tee``): each line lands where it was printed, between two
    drawings of the bar, not at the end of the run glued to the bar."""
    script = (f"from mtl.run.logger import RunLogger\nlog = RunLogger({str(tmp_path)!r}, True, 3, True, terminal=True)\n"
              "for step in (1, 2, 3):\n    log.progress(step, {'loss': 1.0})\n    log.info(f'message {step}')\n"
              "log.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         check=True, timeout=120).stdout.decode()
    for step in (1, 2):
        assert out.index(f"message {step}") < out.index(f"{step + 1}/3"), out
    assert all(line.split("\r")[-1].startswith("message") for line in out.split("\n")[:-1][:3]), out


@pytest.mark.slow  # seconds of training or start-ups: the fast tier stays under 2 minutes
def test_a_warning_from_another_thread_prints_through_the_bar(tmp_path):
    """The heartbeat's warning comes from its own thread, the signal handler's between two bytecodes: both print
    through ``mtl.run.console.say``, which clears the bar, writes the line and draws the bar again below it, so
    the warning starts its own line instead of being glued to a half-drawn bar."""
    script = (f"import threading\nfrom mtl.run import console\nfrom mtl.run.logger import RunLogger\n"
              f"log = RunLogger({str(tmp_path)!r}, True, 3, True, terminal=True)\n"
              "for step in (1, 2, 3):\n    log.progress(step, {'loss': 1.0})\n"
              "    t = threading.Thread(target=console.say, args=(f'warning {step}',))\n    t.start()\n    t.join()\n"
              "log.close()\nconsole.say('after the bar')\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         check=True, timeout=120).stdout.decode()
    lines = [line.split("\r")[-1] for line in out.split("\n")]
    for step in (1, 2, 3):
        assert f"warning {step}" in lines, out  # a whole line of its own, not after a bar on the same line
    assert out.index("warning 1") < out.index("2/3") and "after the bar" in lines, out


def _one_call_leaves_each_task_its_own_gradient(model, batch):
    """``leaf_per_task`` (``feature_leaf``'s forward): one backward call leaves each task's gradient of the features
    in its own leaf, bit for bit what a backward of that task alone gives."""
    torch.manual_seed(0)
    per = model(batch, leaf_per_task=True)
    assert set(per["leaves"]) == {"cls", "gen"} and per["leaves"]["cls"] is not per["leaves"]["gen"]
    (per["losses"]["cls"] + per["losses"]["gen"]).backward()
    torch.manual_seed(0)
    alone = model(batch, leaf_per_task=True)
    for t in ("cls", "gen"):
        (want,) = torch.autograd.grad(alone["losses"][t], alone["leaves"][t])
        assert torch.equal(per["leaves"][t].grad, want) and want.abs().sum() > 0
    model.zero_grad(set_to_none=False)


@pytest.mark.slow  # two runs of 3 steps: 4 s
def test_a_run_computes_its_gradient_statistics_on_the_steps_its_log_writes_and_steps_the_same(tmp_path):
    """The per-task feature-gradient norms and cosines (``feature_leaf``'s statistics) are computed on the steps the
    log writes (the first, then every ``log_every``), not on the others; the steps themselves are the same. And
    the heads' passes, taken in one backward call, give each task its own feature gradient."""
    runs = {}
    for every in (1, 2):
        tr = Trainer.from_config(TINY, [f"output_dir={tmp_path / str(every)}", f"trainer.log_every={every}",
                                        "ddp.strategy=feature_leaf", "weighting.method=equal"])
        try:
            batches = tr.batches()
            runs[every] = ([tr.step_once(next(batches)[1]) for _ in range(3)],
                           [p.detach().clone() for p in tr.params])
            if every == 1:
                _one_call_leaves_each_task_its_own_gradient(tr.bare, tr.batch)
        finally:
            tr.close()
    (every_step, params_1), (logged, params_2) = runs[1], runs[2]
    feature = {"feat_grad_norm/cls", "feat_grad_norm/gen", "feat_grad_cos/cls_gen"}
    assert all(feature <= set(r.stats) for r in every_step)
    assert [feature <= set(r.stats) for r in logged] == [True, True, False] and not set(logged[2].stats) & feature
    for a, b in zip(every_step, logged):
        assert a.losses == b.losses and a.grad_norm == b.grad_norm
    for a, b in zip(every_step[:2], logged[:2]):
        assert {k: float(v) for k, v in a.stats.items()} == {k: float(v) for k, v in b.stats.items()}
    assert all(torch.equal(a, b) for a, b in zip(params_1, params_2))
