"""The best checkpoint (``checkpoint.best_metric``) and early stopping (``trainer.early_stopping``).

After each recorded evaluation (``RunFolder.evaluated``) the run's ``RunWatch`` compares the watched metrics with
their best values so far:

- a best checkpoint: when ``checkpoint.best_metric`` improves (strictly: above the best so far under
  ``checkpoint.best_mode: max``, below under ``min``), the step is checkpointed as ``output_dir/checkpoints/best/``,
  written and replaced atomically as a ``step_<N>`` folder is (``mtl.checkpoint.folder.save_checkpoint``, a complete
  checkpoint with its manifest), with ``best.json`` inside: the metric, the mode, the value and the step. It is no
  ``step_<N>``: ``checkpoint.keep_last`` never prunes it and ``resume=auto`` never picks it.
- early stopping: the evaluations since ``trainer.early_stopping.metric`` last improved by more than ``min_delta``
  (in the direction of its ``mode``) are counted; at ``patience`` the run stops at that evaluation, on every rank
  together (every rank holds the same gathered metrics, and every rank follows rank 0's decision), writes its final
  checkpoint and records why (a line, and ``stopped_early`` in ``final_metrics.json``). The final evaluation at
  ``trainer.max_steps`` counts, but stops nothing.

A metric that is NaN or inf never improves. Both watches live in every checkpoint's ``trainer_state.pt`` (``watch``), so
a resume compares against the same best values with the same counter, and stops at the same evaluation as the
uninterrupted run. The best value is restored only while ``output_dir`` holds ``checkpoints/best/`` (else the next
evaluation writes one); a watch of another metric or mode than the checkpoint's starts afresh (a note says so).
"""

from __future__ import annotations

import json
import math

from mtl.errors import ConfigError

BEST_FILE = "best.json"  # in checkpoints/best/: {"metric", "mode", "value", "step"}


class Watch:
    """One watched metric: its best value so far, the step of that value, and the evaluations since it improved."""

    def __init__(self, metric: str, mode: str, min_delta: float = 0.0):
        self.metric, self.mode, self.min_delta = metric, mode, float(min_delta)
        self.value: float | None = None
        self.step: int | None = None
        self.waited = 0

    def improves(self, value) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value + self.min_delta if self.mode == "max" else value < self.value - self.min_delta

    def update(self, value, step: int) -> bool:
        """Count one evaluation; whether ``value`` improved on the best so far (then it is the best)."""
        if self.improves(value):
            self.value, self.step, self.waited = float(value), step, 0
            return True
        self.waited += 1
        return False

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                "waited": self.waited}

    def load_state_dict(self, state: dict | None, what: str) -> list[str]:
        """Restore a checkpoint's watch of the same metric and mode; another one's is dropped, with a note."""
        if not state:
            return []
        if (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            return [f"resume: {what} now watches {self.metric} ({self.mode}), the checkpoint's run watched "
                    f"{state.get('metric')} ({state.get('mode')}): it starts afresh"]
        self.value, self.step, self.waited = state.get("value"), state.get("step"), int(state.get("waited") or 0)
        return []


class RunWatch:
    """A run's best-checkpoint and early-stopping watches (either may be off: None)."""

    def __init__(self, cfg):
        best, es = cfg.checkpoint, cfg.trainer.early_stopping
        self.best = Watch(best.best_metric, best.best_mode) if best.best_metric else None
        self.early = Watch(es.metric, es.mode, es.min_delta) if es.metric else None
        self.patience = int(es.patience)
        self.stopped: dict | None = None  # why the run stopped early (final_metrics.json's stopped_early), once it did

    def evaluated(self, step: int, metrics: dict, last: bool = False) -> tuple[bool, list[str]]:
        """Count the evaluation at ``step``: (whether the best checkpoint is due, lines to log). ``last``: the final
        evaluation (at trainer.max_steps), which stops nothing."""
        if self.stopped:
            return False, []
        for key, watch in (("checkpoint.best_metric", self.best), ("trainer.early_stopping.metric", self.early)):
            if watch is not None and watch.metric not in metrics:
                raise ConfigError(f"{key}: {watch.metric!r} is not a metric this run logs (it logs: "
                                  f"{', '.join(metrics)})")
        due = self.best is not None and self.best.update(metrics[self.best.metric], step)
        notes = []
        if self.early is not None:
            self.early.update(metrics[self.early.metric], step)
            if self.early.waited >= self.patience and not last:
                e = self.early
                self.stopped = {"step": step, "metric": e.metric, "mode": e.mode, "patience": self.patience,
                                "min_delta": e.min_delta, "best": e.value, "best_step": e.step}
                best = f"its best, {e.value:.4f} at step {e.step}" if e.value is not None else "no finite value yet"
                notes.append(f"step {step}: early stopping: {e.metric} has not improved by more than {e.min_delta} "
                             f"({e.mode}) for {self.patience} evaluation(s) ({best}); saving a checkpoint and stopping")
        return due, notes

    def best_file(self) -> bytes:
        """``best.json`` of the best checkpoint now due."""
        b = self.best
        return json.dumps({"metric": b.metric, "mode": b.mode, "value": b.value, "step": b.step}, indent=1).encode()

    def state_dict(self) -> dict:
        """What ``trainer_state.pt`` keeps (``watch``)."""
        return {"best": self.best.state_dict() if self.best else None,
                "early_stopping": self.early.state_dict() if self.early else None, "stopped": self.stopped}

    def load_state_dict(self, state: dict | None, best_held: bool) -> list[str]:
        """Restore a checkpoint's watches (``best_held``: output_dir holds checkpoints/best/); returns notes."""
        state, notes = state or {}, []
        if self.best is not None and best_held:
            notes += self.best.load_state_dict(state.get("best"), "checkpoint.best_metric")
        if self.early is not None:
            notes += self.early.load_state_dict(state.get("early_stopping"), "trainer.early_stopping")
            if state.get("stopped") and self.early.waited >= self.patience:
                self.stopped = state["stopped"]
                notes.append(f"resume: this run stopped early at step {self.stopped['step']} "
                             f"(trainer.early_stopping: {self.early.metric} did not improve for {self.patience} "
                             "evaluation(s)); nothing left to do. Raise trainer.early_stopping.patience to go on")
        return notes
