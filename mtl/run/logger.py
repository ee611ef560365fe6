"""Run logs, written by rank 0 only: ``metrics.jsonl``, TensorBoard under ``tb/`` and the other trackers
``logging.trackers`` names (W&B, MLflow, CSV: mtl/run/trackers.py), and the console.

The progress (``trainer.progress``) is a bar on a terminal. Where the bar's stream (stderr) is not a terminal (a log
file, a pipe, ``make train > log``), its redrawn frames would fill the file, so the progress is a plain line every
``trainer.log_every`` steps and at the last step instead, as HF Trainer and Lightning do (``ProgressLines``)."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from mtl.checkpoint.folder import describe_os_error
from mtl.errors import TrainingError
from mtl.files import write_atomic
from mtl.run import console
from mtl.run.trackers import open_trackers, scalars


class RunLogger:
    def __init__(self, output_dir: str, enabled: bool, max_steps: int, progress: bool, start_step: int = 0,
                 every: int = 10, terminal: bool | None = None, cfg=None):
        """``every``: the steps between two progress lines without a terminal; ``terminal``: draw the bar (True) or
        print the lines (False) whatever stderr is (None: the bar where stderr is a terminal); ``cfg``: the run's
        config, whose ``logging.trackers`` are written (None: TensorBoard only)."""
        self.enabled = enabled
        self.output_dir = output_dir
        self._tb = None
        self._bar = None
        self._lines: ProgressLines | None = None  # the progress without a terminal
        self._jsonl = None
        self._failed = False  # a failed write was reported
        self._trackers: list = []  # W&B, MLflow, CSV (mtl/run/trackers.py)
        if not enabled:
            return
        path = os.path.join(output_dir, "metrics.jsonl")
        trim_metrics(output_dir, start_step)  # a resumed run redoes the steps after its checkpoint
        self._jsonl = open(path, "a", encoding="utf-8")
        if cfg is None or "tensorboard" in cfg.logging.trackers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tb"))
        self._trackers = open_trackers(cfg, start_step) if cfg is not None else []
        if progress and not (is_terminal(sys.stderr) if terminal is None else terminal):
            self._lines = ProgressLines(max_steps, start_step, every)
        elif progress:
            from tqdm import tqdm

            self._bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=1.0)
            console.show_bar(self._bar)  # warnings from elsewhere in the process print through it

    def info(self, message: str) -> None:
        """A console line (stdout). With the bar on screen it is printed through the bar: the bar is cleared, the
        line written AND flushed, then the bar drawn again below it. Unflushed, a block-buffered stdout (a pipe, a
        log file that stdout and stderr share) would land the line later, glued to a redrawn bar."""
        if not self.enabled:
            return
        console.say(message, file=sys.stdout)

    def record(self, step: int, values: dict, kind: str = "train") -> None:
        """One line in metrics.jsonl and one scalar per numeric value in TensorBoard."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        line = {"step": step, "kind": kind, "time": round(time.time(), 3), **clean}
        try:
            self._jsonl.write(json.dumps(line) + "\n")
            self._jsonl.flush()
        except OSError as e:
            self._failed = True
            raise TrainingError(f"cannot write {self._jsonl.name}: {describe_os_error(e)}. The last checkpoint is "
                                "intact; free space or make output_dir writable, then resume with resume=auto") from None
        numbers = scalars(values, kind)
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        for tracker in self._trackers:
            tracker.log_scalars(step, numbers)

    def progress(self, step: int, postfix: dict) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=True)
        elif self._lines is not None and self._lines.due(step):
            self.info(self._lines.line(step, postfix))

    def image(self, tag: str, image, step: int) -> None:
        if self._tb is not None:
            self._tb.add_image(tag, image, step)

    def figure(self, tag: str, figure, step: int) -> None:
        if self._tb is not None:
            self._tb.add_figure(tag, figure, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        for tracker in self._trackers:
            tracker.log_text(step, tag, text)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        if self._tb is not None:
            self._tb.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        """Close every log; a write that fails now (e.g. the disk is full) costs log lines, not the run's exit
        message: one warning, unless a failed write was already reported."""
        if self._bar is not None:
            console.show_bar(None)
            self._bar.close()
        for closer in (self._tb, self._jsonl, *self._trackers):
            if closer is None:
                continue
            try:
                closer.close()
            except Exception as e:  # noqa: BLE001 - a tracker's own error (its service, its store) costs its log only
                if not isinstance(e, OSError):
                    print(f"warning: could not close the tracker {type(closer).__name__}: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
                    continue
                if not self._failed:
                    print(f"warning: could not finish writing the logs in {self.output_dir}: {describe_os_error(e)}",
                          file=sys.stderr, flush=True)
                self._failed = True


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressLines:
    """The progress as plain lines (see the module docstring): every ``every`` steps and the last, each with the
    step, the losses, the time a step has taken on average since this run began, and the time left."""

    def __init__(self, total: int, start_step: int, every: int):
        self.total, self.start_step, self.every = total, start_step, max(1, every)
        self.start = time.perf_counter()

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def line(self, step: int, postfix: dict) -> str:
        per_step = (time.perf_counter() - self.start) / max(step - self.start_step, 1)
        losses = ", ".join(f"{k}={v:.3g}" for k, v in postfix.items())
        percent = 100 * step // max(self.total, 1)
        return (f"progress: step {step}/{self.total} ({percent}%) {losses}; {per_step:.2f} s/step, "
                f"{duration(per_step * max(self.total - step, 0))} left")


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``12s``."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def trim_metrics(output_dir: str, step: int) -> None:
    """Drop ``metrics.jsonl``'s records after ``step`` (rank 0, before a resumed run logs again). A failed
    rewrite (e.g. a full disk) raises the OSError and leaves ``metrics.jsonl`` as it was, and no ``.tmp``."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    if len(keep) != len(lines):
        write_atomic(path, "".join(keep).encode("utf-8"))
