"""The sweep's progress while its runs train (issue 32.8): steps done of max_steps and the time left, per run in
flight and for the sweep, read from each run's metrics.jsonl; printed by the sweep's loop, not only between runs."""

import json

from omegaconf import OmegaConf

from mtl.bench import progress, runs
from mtl.bench.progress import Progress, progress_lines, run_progress


def _run(tmp_path, label="uw", max_steps=130, records=((10, 100.0), (20, 120.0), (30, 140.0)), partial=False):
    d = tmp_path / label
    d.mkdir()
    lines = [json.dumps({"step": s, "kind": "train", "time": t, "loss_cls": 1.0}) for s, t in records]
    lines.insert(1, json.dumps({"step": 10, "kind": "eval", "time": 101.0, "cls_acc": 0.5}))
    text = "\n".join(lines) + "\n" + ('{"step": 40, "kind": "tr' if partial else "")
    (d / "metrics.jsonl").write_text(text if records else "")
    return {"dir": str(d), "regime": "natural", "label": label, "seed": 0,
            "config": {"trainer": {"max_steps": max_steps}}}


def test_progress_reads_steps_and_rate_from_metrics_jsonl(tmp_path):
    run = _run(tmp_path, partial=True)  # the last line still being written is skipped
    assert run_progress(run["dir"]) == ((10, 100.0), (30, 140.0))
    # 20 steps in 40 s: 100 steps left take 200 s; one run in flight, 2 waiting at the 200 + 60 s it will have taken
    lines = progress_lines([(run, 80.0)], pending=2, finished_s=[], parallel=1, now=140.0)
    assert lines[1] == "  natural uw seed 0: step 30/130 (23%), 1.0 min running, about 3.3 min left", lines
    assert lines[0] == "bench: 1 run(s) training, 2 waiting; the sweep: about 12.0 min left", lines
    # with finished runs, the waiting ones take their mean length; two at once halve the sum
    lines = progress_lines([(run, 80.0)], pending=2, finished_s=[100.0, 300.0], parallel=2, now=140.0)
    assert lines[0].endswith("the sweep: about 5.0 min left"), lines


def test_progress_says_when_it_has_no_estimate(tmp_path):
    none = _run(tmp_path, "none", records=())
    one = _run(tmp_path, "one", records=((1, 100.0),))
    assert run_progress(none["dir"]) is None and run_progress(str(tmp_path / "absent")) is None
    lines = progress_lines([(none, 90.0), (one, 90.0)], pending=0, finished_s=[], parallel=2, now=100.0)
    assert lines == ["bench: 2 run(s) training, 0 waiting; no estimate for the sweep yet",
                     "  natural none seed 0: no step recorded yet, 10 s running; no estimate yet",
                     "  natural one seed 0: step 1/130 (1%), 10 s running; no estimate yet"], lines


def test_the_sweep_prints_progress_while_a_run_trains(tmp_path, monkeypatch, capsys):
    """mtl.bench.runs._drive hands drive a Progress that reads the run in flight's metrics.jsonl (a fake launcher writes it
    and reports the run still running for a few polls); with the period at 0 it prints at each poll."""
    polls = []

    class Fake:
        name = "fake"

        def start(self, run, command, record):
            record()
            with open(f"{run['dir']}/metrics.jsonl", "w") as f:
                for step, t in ((5, 1000.0), (25, 1010.0)):
                    f.write(json.dumps({"step": step, "kind": "train", "time": t}) + "\n")
            return run

        def poll(self, handle, run):
            polls.append(1)
            return True if len(polls) > 3 else None

        def stop(self, handle):
            pass

    monkeypatch.setattr(runs, "make_launcher", lambda cfg, env, threads: Fake())
    monkeypatch.setattr(progress, "PERIOD_S", 0.0)
    out = tmp_path / "bench"
    cfg = OmegaConf.create({"output_dir": str(out), "bench": {"parallel": 1, "threads": 1}})
    run = {"index": 1, "regime": "natural", "label": "equal", "seed": 0, "dir": str(out / "runs" / "equal"),
           "overrides": [], "config": {"trainer": {"max_steps": 105}}, "code": None}
    runs._drive(cfg, "configs/tiny.yaml", [], [run], 1, str(out / "runs.jsonl"))
    printed = capsys.readouterr().out
    # 20 steps in 10 s: the 80 left take 40 s
    assert "  natural equal seed 0: step 25/105 (24%)" in printed and "about 40 s left" in printed, printed
    assert "bench: 1 run(s) training, 0 waiting; the sweep: about 40 s left" in printed, printed
    assert run["status"] == "ok"


def test_progress_is_printed_at_most_once_a_period(tmp_path):
    run = _run(tmp_path)
    said = []
    p = Progress(parallel=1, finished_s=[], period_s=3600.0, out=lambda text, flush: said.append(text))
    p([(run, 80.0)], 0)
    assert said == []  # the first report only after a period
    p.last -= 3600.0
    p([(run, 80.0)], 0)
    p([(run, 80.0)], 0)
    assert len(said) == 1 and "natural uw seed 0: step 30/130" in said[0]
