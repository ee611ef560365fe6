"""What the run says at its start, about each step and each evaluation: metrics.jsonl and TensorBoard
(``RunLogger``), the console, the progress bar; the two ends a step's result can force (too many non-finite steps,
weights that blew up: a TrainingError naming the checkpoint that is kept); and the run's end: a final evaluation that
is non-finite refused, final_metrics.json, the curves and the summary line (``finish``)."""

from __future__ import annotations

import json
import os
import resource

import numpy as np
import torch

from mtl.checkpoint import folder as ckpt
from mtl.checkpoint.finite import first_blown_up, nonfinite_eval
from mtl.data.multi_input import task_rows
from mtl.errors import CheckpointError, TrainingError
from mtl.files import write_atomic
from mtl.models.blockwise import frozen_note as blocks_frozen
from mtl.optim.layer_groups import describe as describe_groups
from mtl.run import heartbeat
from mtl.run.logger import RunLogger
from mtl.run.runtime_checks import locate_nonfinite
from mtl.run.step import StepParts, StepResult


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS of this process


def flat_metrics(metrics: dict, test: dict) -> dict:
    """{task: {metric: value}} and the test split's as one flat dict: ``<task>_<metric>``, ``test_<task>_<metric>``."""
    flat = {f"{t}_{k}": v for t, m in metrics.items() for k, v in m.items() if k != "samples"}
    flat.update({f"test_{t}_{k}": v for t, m in test.items() for k, v in m.items() if k != "samples"})
    return flat


class StepLog:
    """Formats and writes a run's first lines, its step and evaluation records and its end; counts bad steps and fp16
    overflows."""

    def __init__(self, cfg, parts: StepParts, log: RunLogger, device: torch.device, world_size: int, is_main: bool,
                 bad_steps: int = 0):
        self.cfg, self.parts, self.log, self.device = cfg, parts, log, device
        self.world_size, self.is_main = world_size, is_main
        self.bad_steps = bad_steps  # the current streak of non-finite steps (a resumed run's goes on)
        self.overflows = 0
        self.log_every = cfg.trainer.log_every
        self.stopped_early: dict | None = None  # why trainer.early_stopping stopped the run (final_metrics.json)

    def announce(self, resume_notes: list[str], backend: str | None, feed: str, data: str) -> None:
        """The run's first lines: the resume's notes, the processes and the run's choices (``feed``: the feed's own
        description), the per-block settings and the optimizer's groups, the data (``data``: its summary)."""
        cfg, bare = self.cfg, self.parts.bare
        for note in resume_notes:
            self.log.info(note)
        self.log.info(f"mtl: {self.world_size} process(es) on {self.device} ({backend or 'no process group'}), "
                      f"strategy={cfg.ddp.strategy}, weighting={cfg.weighting.method}, precision={cfg.precision}, "
                      f"{feed}, {sum(p.numel() for p in self.parts.params):,} parameters")
        for line in [*getattr(bare, "peft_notes", []), *bare.block_notes, *blocks_frozen(bare), describe_groups(self.parts.optimizer)]:
            self.log.info(line)  # per-block settings and the optimizer's groups (mtl/optim/layer_groups.py)
        self.log.info(data)

    def writes(self, step: int) -> bool:
        """Whether step ``step`` (1-based) gets a record: the first, and every ``trainer.log_every``."""
        return step % self.log_every == 0 or step == 1

    def after_step(self, step: int, r: StepResult, seconds: float, batch: dict, epoch: int = 0) -> None:
        """Step ``step`` (1-based) is done: its bad-step bookkeeping, every ``log_every`` its record, the bar."""
        t, bare = self.cfg.trainer, self.parts.bare
        heartbeat.progress(step)
        if r.weights_nonfinite:
            self._stop_for_nonfinite_weights(step)
        if r.nonfinite:
            self.bad_steps += 1
            bad = [k for k, v in r.losses.items() if not np.isfinite(v)] or ["gradient"]
            where = (locate_nonfinite(bare, batch, task_rows(batch).present(self.parts.tasks))
                     if self.cfg.ddp.nan_monitor else "")
            self.log.record(step, {"bad_step": 1, "nonfinite": ",".join(bad), "consecutive": self.bad_steps,
                                   "where": where}, kind="bad_step")
            self.log.info(f"step {step}: non-finite {', '.join(bad)}; optimizer step skipped on every rank"
                          + (f"\n{where}" if where else ""))
            if self.bad_steps >= t.max_bad_steps:
                first = step - self.bad_steps
                raise TrainingError(
                    f"{self.bad_steps} consecutive non-finite steps (trainer.max_bad_steps={t.max_bad_steps}). "
                    f"Lower optim.lr, use precision=bf16/fp32, or check the data; {self.kept_checkpoint()}. The "
                    f"skipped steps changed no weight, so every checkpoint from step {first} on holds the weights "
                    f"that gave the first non-finite step ({first + 1}): if they blew up, resume from a checkpoint "
                    f"before step {first}")
        else:
            self.bad_steps = 0
            if not r.stepped:  # an fp16 overflow: the GradScaler skipped the step and backed off
                self.overflows += 1
                self.log.record(step, {"fp16_overflow": 1, "total": self.overflows}, kind="overflow")
        if self.writes(step):
            self.log.record(step, self.step_values(r, seconds, batch, epoch))
        self.log.progress(step, {f"loss_{k}": v for k, v in r.losses.items()})  # the bar moves every step

    def step_values(self, r: StepResult, seconds: float, batch: dict, epoch: int) -> dict:
        """A step's record: losses, weights, the strategy's and method's statistics, lr, speed and memory."""
        p = self.parts
        scale = p.amp.loss_scale()
        values = {f"loss_{k}": v for k, v in r.losses.items()}
        used = r.weights if r.weights is not None else p.weighting.step_weights()  # the weights the step used
        values.update({f"weight_{k}": v for k, v in used.items()})
        values.update({k: float(v) / (scale if "grad_norm" in k else 1.0) for k, v in r.stats.items()})
        values.update({
            "lr": p.scheduler.get_last_lr()[0], "grad_norm": r.grad_norm, "step_time_s": seconds,
            # the rows of this step (multi-input: they vary with the policy; every rank holds as many)
            "samples_per_s": int(batch["index"].shape[0]) * self.world_size / max(seconds, 1e-9),
            "peak_mem_mb": peak_memory_mb(self.device), "epoch": epoch, "skipped": int(not r.stepped),
        })
        if p.amp.scaler is not None:
            values["loss_scale"] = scale
        return values

    def evaluation(self, step: int, flat: dict) -> dict:
        """Record an evaluation's flat metrics (``flat_metrics``) and return them."""
        self.log.record(step, flat, kind="eval")
        self.log.info(f"step {step} eval: " + ", ".join(f"{k}={v:.4f}" for k, v in flat.items()))
        return flat

    def watched(self, stopped: dict | None, notes: list[str]) -> None:
        """After an evaluation, the best checkpoint's and early stopping's lines (mtl/run/best.py); ``stopped``: why
        the run stops early (final_metrics.json's ``stopped_early``), or None."""
        for note in notes:
            self.log.info(note)
        self.stopped_early = stopped

    def samples(self, step: int, metrics: dict, val_sets: dict) -> None:
        """The first ``trainer.num_samples`` generated samples: console, TensorBoard text and a figure."""
        n = self.cfg.trainer.num_samples
        task, samples = next(((t, m["samples"][:n]) for t, m in metrics.items() if "samples" in m), (None, []))
        if not samples or not self.is_main:
            return
        lines = [f"  [{idx}] pred: {hyp!r}  ref: {ref!r}" for idx, hyp, ref in samples]
        self.log.info("samples:\n" + "\n".join(lines))
        self.log.text("samples", "\n\n".join(f"**{i}** pred: `{h}` — ref: `{r}`" for i, h, r in samples), step)
        from mtl.run.plots import sample_figure  # import here: matplotlib, only when there are samples to draw

        images = [val_sets[task][idx]["image"] for idx, _, _ in samples]
        self.log.figure("samples", sample_figure(images, samples), step)

    def kept_checkpoint(self) -> str:
        newest = ckpt.latest_checkpoint(self.cfg.output_dir)
        return f"the newest checkpoint, {newest}, is kept" if newest else "no checkpoint was written"

    def _stop_for_nonfinite_weights(self, step: int) -> None:
        """The optimizer step made a weight NaN/inf: a bad step that cannot be skipped (the weights are gone)."""
        bad = first_blown_up(dict(self.parts.bare.named_parameters())) or "a learned loss weight"
        self.log.record(step, {"bad_step": 1, "nonfinite": "weights", "where": bad}, kind="bad_step")
        raise TrainingError(f"step {step}: the optimizer step made the weights non-finite or blew them up past "
                            f"what float32 holds (on this rank first in {bad}); they cannot be restored, so the run "
                            f"stops and saves nothing. Lower optim.lr or set optim.grad_clip; {self.kept_checkpoint()}")

    # ------------------------------------------------------------------ the run's end

    def refuse_nonfinite_final(self, step: int, final: dict) -> None:
        """A run whose final evaluation is NaN/inf diverged: a TrainingError (exit 5), before its final checkpoint."""
        bad = nonfinite_eval(final, self.parts.tasks)
        if bad:
            raise TrainingError(f"the final evaluation at step {step} is non-finite ("
                                + ", ".join(f"{k}={final[k]}" for k in bad) + "): the model diverged, so its final "
                                f"checkpoint was not written. Lower optim.lr or set optim.grad_clip; "
                                f"{self.kept_checkpoint()}")

    def finish(self, step: int, final: dict, wall: float, first: int = 0, data_skipped: int = 0) -> None:
        """The run's end at ``step`` (``first``: the step it started from; ``data_skipped``: the bad data lines
        skipped): final_metrics.json, the curves, the hyperparameters, the summary line."""
        cfg, out = self.cfg, self.cfg.output_dir
        if self.is_main:
            summary = {"step": step, "wall_time_s": round(wall, 1), "world_size": self.world_size,
                       "fp16_overflows": self.overflows, "data_skipped": data_skipped, **final}
            if self.stopped_early:
                summary["stopped_early"] = self.stopped_early
            self._write_final_metrics(os.path.join(out, "final_metrics.json"), summary)
            self._write_curves(os.path.join(out, "metrics.jsonl"), os.path.join(out, "curves.png"))
            hp = {"strategy": cfg.ddp.strategy, "weighting": cfg.weighting.method, "precision": cfg.precision,
                  "lr": cfg.optim.lr, "global_batch": cfg.data.batch_size * self.world_size}
            self.log.hparams(hp, {f"hparam/{k}": v for k, v in final.items()})
        taken = step - first
        what = (f"nothing to do (step {step}, trainer.max_steps {cfg.trainer.max_steps})" if not taken else
                f"{taken} steps ({first + 1}-{step}) in {wall:.0f} s" if first else f"{taken} steps in {wall:.0f} s")
        self.log.info(f"done: {what}; " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))

    def _write_final_metrics(self, target: str, summary: dict) -> None:
        """``final_metrics.json``, whole or not at all. When it cannot be written (a full disk), its content goes to
        the console instead and the run ends with one message (exit 4): the final checkpoint is saved already."""
        text = json.dumps(summary, indent=2)
        try:
            write_atomic(target, text.encode("utf-8"))
        except OSError as e:
            self.log.info(f"final metrics (not saved): {json.dumps(summary)}")
            raise CheckpointError(f"cannot write {target}: {ckpt.describe_os_error(e)}. The run finished and its final "
                                  "checkpoint is saved; its final metrics are printed above (or run mtl.tools.evaluate "
                                  "on the checkpoint once there is space)") from None

    def _write_curves(self, metrics: str, target: str) -> None:
        """``curves.png``, a convenience: a failure to draw or write it (a full disk) is one warning line, and the
        run, whose checkpoint and final_metrics.json are written, still ends well."""
        from mtl.run.plots import curves_png  # import here: matplotlib, at the end of a run only

        try:
            write_atomic(target, curves_png(metrics, [key for head in self.parts.bare.heads.values()
                                                      for key, _ in head.metric_keys()]))
        except (OSError, ValueError) as e:  # ValueError: a metrics.jsonl line it cannot read or draw
            cause = ckpt.describe_os_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            self.log.info(f"warning: could not write {target}: {cause}; the loss curves are left out, the run's "
                          f"results (checkpoints, final_metrics.json, metrics.jsonl) are intact")
