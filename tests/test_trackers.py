"""logging.trackers: W&B (offline), MLflow (a local store in output_dir) and CSV each read back, through their own
libraries, the scalars metrics.jsonl holds at the same steps, the resolved config and a sample caption; a resume
continues the same tracker runs; only rank 0 writes; a tracker that is not installed is one message naming the extra
(exit 2) before anything starts; a benchmark sweep groups its runs. Nothing reaches the network."""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import struct
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FAST = ["trainer.max_steps=2", "trainer.eval_every=2", "checkpoint.every_steps=1", "trainer.num_samples=2"]
ALL = "logging.trackers=[tensorboard,wandb,mlflow,csv]"
TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RUN_GROUP",
               "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")


def _offline(mp: pytest.MonkeyPatch) -> None:
    for name in TRACKER_ENV:
        mp.delenv(name, raising=False)
    mp.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-step tiny run with every tracker, then a resume to step 3: (output_dir, trackers.json after the first run,
    the console of both)."""
    import train

    out = tmp_path_factory.mktemp("tracked") / "run"
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp)
        mp.chdir(tmp_path_factory.mktemp("cwd"))  # nothing may land in the working directory
        console = []
        import contextlib
        import io

        for extra in ([], ["trainer.max_steps=3", "trainer.eval_every=3", "resume=auto"]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = train.main(["--config", TINY, *FAST, ALL, "logging.group=sweep1", f"output_dir={out}", *extra])
            console.append(buf.getvalue())
            assert code == 0, buf.getvalue()[-3000:]
            if not extra:
                first = json.loads((out / "trackers.json").read_text())
        assert os.listdir(os.getcwd()) == [], os.listdir(os.getcwd())
    return out, first, "\n".join(console)


def _expected(out) -> dict[tuple[int, str], float]:
    """(step, name) -> value: the scalars metrics.jsonl holds, named as TensorBoard names them."""
    from mtl.run.trackers import scalars

    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        step, kind = rec.pop("step"), rec.pop("kind")
        rec.pop("time")
        for k, v in scalars(rec, kind).items():
            found[(step, k)] = v
    return found


def _captions(console: str) -> list[tuple[str, str]]:
    return re.findall(r"\[\d+\] pred: '(.*)'  ref: '(.*)'", console)


# ------------------------------------------------------------------ W&B's offline run file, decoded by wandb's protobuf

def _wandb_records(path: str):
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks (crc32, length, type: full/first/middle/last), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _wandb_run(out, run_id: str) -> tuple[dict, dict, list[dict], list[str]]:
    """(history by step, config, the run records' groups, the run folders) of every offline attempt of ``run_id``."""
    folders = sorted(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}")))
    history, config, groups = {}, {}, []
    for folder in folders:
        for r in _wandb_records(os.path.join(folder, f"run-{run_id}.wandb")):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                groups.append(r.run.run_group)
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                history.setdefault(row["_step"], {}).update({**row, "_folder": folder})
    return history, config, groups, folders


@pytest.mark.slow  # two training runs with every tracker (the module's fixture): not in the fast tier
def test_wandb_reads_back_the_scalars_config_and_captions_it_logged(tracked):
    out, first, console = tracked
    history, config, groups, folders = _wandb_run(out, first["wandb"])
    expected = _expected(out)
    assert {s for s, _ in expected} == {1, 2, 3}
    for (step, name), value in expected.items():
        assert history[step][name] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, name)
    assert config["trainer"]["max_steps"] in (2, 3) and config["logging"]["group"] == "sweep1"
    assert set(groups) == {"sweep1"}
    table = json.loads(open(os.path.join(history[2]["_folder"], "files", history[2]["samples/path"])).read())
    text = table["data"][0][0]
    for hyp, ref in _captions(console)[:2]:
        assert f"pred: `{hyp}`" in text and f"ref: `{ref}`" in text


@pytest.mark.slow  # two training runs with every tracker (the module's fixture): not in the fast tier
def test_mlflow_reads_back_the_scalars_config_and_captions_it_logged(tracked):
    from mlflow.tracking import MlflowClient

    out, first, console = tracked
    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    run = client.get_run(first["mlflow"])
    expected = _expected(out)
    for name in {n for _, n in expected}:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        want = {s: v for (s, n), v in expected.items() if n == name}
        assert got == pytest.approx(want, rel=1e-12), name
    assert run.data.params["trainer.max_steps"] == "2"  # params are immutable: the first run's
    assert run.data.params["logging.group"] == "sweep1" and run.data.tags["mtl.group"] == "sweep1"
    assert client.get_experiment(run.info.experiment_id).name == "sweep1"
    config = json.loads(open(client.download_artifacts(run.info.run_id, "config.json", str(out.parent))).read())
    assert config["trainer"]["max_steps"] == 3  # the resolved config of the latest attempt
    text = open(client.download_artifacts(run.info.run_id, "samples/step_00000002.md", str(out.parent))).read()
    for hyp, ref in _captions(console)[:2]:
        assert f"pred: `{hyp}`" in text and f"ref: `{ref}`" in text
    assert run.info.artifact_uri.startswith(f"file://{out}/mlartifacts")


@pytest.mark.slow  # two training runs with every tracker (the module's fixture): not in the fast tier
def test_csv_holds_the_scalars_and_the_captions(tracked):
    out, _, console = tracked
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value"]
    got = {(int(s), n): float(v) for s, n, v in rows[1:]}
    assert got == _expected(out)
    with open(out / "samples.csv", newline="") as f:
        samples = list(csv.DictReader(f))
    assert [s["step"] for s in samples] == ["2", "3"]
    hyp, ref = _captions(console)[0]
    assert f"pred: `{hyp}`" in samples[0]["text"] and f"ref: `{ref}`" in samples[0]["text"]


@pytest.mark.slow  # two training runs with every tracker (the module's fixture): not in the fast tier
def test_a_resume_continues_the_same_tracker_runs(tracked):
    out, first, _ = tracked
    state = json.loads((out / "trackers.json").read_text())
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert state == first and state["run_id"] == run_id and set(state) == {"run_id", "wandb", "mlflow"}
    history, _, _, folders = _wandb_run(out, first["wandb"])
    assert len(folders) == 2 and history[3]["_folder"] == folders[1]  # the resumed attempt logged under the same id
    assert len(glob.glob(str(out / "wandb" / "offline-run-*"))) == 2

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweep1").experiment_id])
    assert [r.info.run_id for r in runs] == [first["mlflow"]] and runs[0].info.status == "FINISHED"


def test_a_resumed_csv_drops_the_rows_after_its_checkpoint(tmp_path):
    from mtl.run.trackers import CsvTracker

    t = CsvTracker(str(tmp_path), 0)
    t.log_scalars(1, {"a": 1.0})
    t.log_scalars(2, {"a": 2.0})
    t.log_text(2, "samples", "x")
    t.close()
    CsvTracker(str(tmp_path), 1).close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,name,value", "1,a,1.0"]
    assert (tmp_path / "samples.csv").read_text().splitlines() == ["step,name,text"]


def _cfg(out, *overrides):
    from mtl.setup.checks import load_run_config

    return load_run_config(TINY, [f"output_dir={out}", *overrides], announce=False)


@pytest.mark.slow  # wandb and mlflow start-ups (25 s on a loaded machine): not in the fast tier
def test_only_rank_0_writes_to_the_trackers(tmp_path, monkeypatch):
    """The logger of another rank (enabled=False, as the Trainer makes it where dist.is_main is False) opens no tracker
    and writes nothing; rank 0's, with the same config, writes every tracker."""
    from mtl.run.logger import RunLogger

    _offline(monkeypatch)
    cfg = _cfg(tmp_path / "other", "logging.trackers=[wandb,mlflow,csv]")
    os.makedirs(cfg.output_dir)
    log = RunLogger(cfg.output_dir, False, 2, False, cfg=cfg)
    log.record(1, {"loss_cls": 1.0})
    log.text("samples", "x", 1)
    log.close()
    assert os.listdir(cfg.output_dir) == []

    cfg = _cfg(tmp_path / "main", "logging.trackers=[wandb,mlflow,csv]")
    os.makedirs(cfg.output_dir)
    log = RunLogger(cfg.output_dir, True, 2, False, cfg=cfg)
    log.record(1, {"loss_cls": 1.0})
    log.close()
    assert {"metrics.csv", "mlflow.db", "wandb", "trackers.json"} <= set(os.listdir(cfg.output_dir))
    assert "tb" not in os.listdir(cfg.output_dir)  # tensorboard is a tracker like the others: not listed, not written


def test_the_default_is_tensorboard_alone(tmp_path):
    from mtl.run.logger import RunLogger

    cfg = _cfg(tmp_path / "run")
    assert list(cfg.logging.trackers) == ["tensorboard"] and cfg.logging.group is None
    os.makedirs(cfg.output_dir)
    log = RunLogger(cfg.output_dir, True, 2, False, cfg=cfg)
    log.record(1, {"loss_cls": 1.0})
    log.close()
    assert sorted(os.listdir(cfg.output_dir)) == ["metrics.jsonl", "tb"]


@pytest.mark.parametrize("missing", [["wandb"], ["mlflow"], ["wandb", "mlflow"]])
def test_a_tracker_not_installed_is_one_message_naming_the_extra_before_anything_starts(tmp_path, monkeypatch, capsys,
                                                                                        missing):
    import train

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import wandb` now fails as where it is not installed
        with pytest.raises(ImportError):
            __import__(name)
    out = tmp_path / "run"
    code = train.main(["--config", TINY, *FAST, "logging.trackers=[csv,wandb,mlflow]", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("pip install -e '.[trackers]'") == 1, err
    assert "logging.trackers: " + " and ".join(missing) in err
    assert not out.exists()  # nothing started


def test_an_unknown_tracker_is_refused_naming_the_nearest(tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, *FAST, "logging.trackers=[wandbb]", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "logging.trackers: 'wandbb' is not one of tensorboard, wandb, mlflow, csv" in err
    assert "did you mean 'wandb'" in err


def test_a_sweep_groups_its_runs_and_the_group_is_not_a_runs_identity(tmp_path):
    from omegaconf import OmegaConf

    from mtl.bench.record import run_identity
    from mtl.bench.runs import sweep_group

    cfg = OmegaConf.create({"output_dir": str(tmp_path / "my_sweep"), "logging": {"group": None}})
    assert sweep_group(cfg) == ['logging.group="my_sweep"']
    cfg.logging.group = "chosen"
    assert sweep_group(cfg) == []  # the config's own group goes to every run as it is
    a = run_identity(TINY, ['logging.group="my_sweep"', "logging.trackers=[csv]"], 1)
    b = run_identity(TINY, [], 1)
    assert a[0] == b[0]  # a finished run is reused whatever trackers logged it


@pytest.mark.slow  # two in-process start-ups
@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_cannot_start_its_run_is_one_message_naming_the_fix(tmp_path, monkeypatch, capsys, tracker):
    """Real failures of the libraries, nothing faked: wandb online with no login (HOME without a .netrc, no
    WANDB_API_KEY), mlflow at a tracking server that is not there (a closed port, no retries). Exit 2 and one line
    naming the tracker, the library's reason and the fix; never the library's traceback."""
    import train
    from tests.conftest import free_port

    _offline(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings: not logged in
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    if tracker == "mlflow":
        monkeypatch.setenv("WANDB_MODE", "offline")
    else:
        import wandb

        wandb.teardown()  # wandb keeps its settings (WANDB_MODE=offline) for the process: read them again
    out = tmp_path / "run"
    code = train.main(["--config", TINY, *FAST, f"logging.trackers=[{tracker}]", f"output_dir={out}"])
    captured = capsys.readouterr()
    err = captured.err + captured.out
    assert code == 2, err[-3000:]
    line = next(ln for ln in err.splitlines() if f"logging.trackers: {tracker} could not start its run" in ln)
    assert ("wandb login" in line and "WANDB_MODE=offline" in line) if tracker == "wandb" else "MLFLOW_TRACKING_URI" in line
    assert "Traceback" not in err
    assert not (out / "checkpoints").exists()  # nothing trained; the folder keeps its config for resume=auto
