"""The training loop: build the run, then step, log, evaluate and checkpoint until ``max_steps``.

A thin loop over three components, each testable alone: the ``RunFolder`` (mtl/run/run_folder.py: the lock, the
resume decision, save and load, when to save), the ``Feed`` (mtl/run/feed.py: the training batches, multi-input
plans and held-out batches, on the device) and the ``StepLog`` (mtl/run/step_log.py: what a step, an
evaluation and the run's end write). The step itself is ``mtl.run.step.train_step``.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from mtl.parallel.amp import Amp
from mtl.parallel.dist import DistInfo, all_gather_objects, init_distributed
from mtl.parallel.fsdp import gathered, is_sharded
from mtl.run import heartbeat
from mtl.run.evaluate import EvaluationStopped, evaluate_run
from mtl.run.faults import poison
from mtl.run.feed import build_eval_feeds, build_feed, check_feed_data, data_summary
from mtl.run.logger import RunLogger
from mtl.run.run_folder import RunFolder
from mtl.run.runtime_checks import explain_ddp_error, verify_replicas
from mtl.run.signals import StopSignals, enter_phase
from mtl.run.step import StepParts, StepResult, train_step
from mtl.run.step_log import StepLog, flat_metrics
from mtl.setup.build import (
    build_optimizer,
    build_run_inputs,
    build_scheduler,
    build_strategy,
    build_weighting,
    init_from_weights,
    run_method_types,
    run_task_types,
    wrap_model,
)
from mtl.setup.checks import load_run_config


class Trainer:
    def __init__(self, cfg, dist: DistInfo):
        self.folder = RunFolder(cfg, dist)
        try:
            self._setup(cfg, dist)
        except BaseException:
            self.folder.close()
            raise

    def _setup(self, cfg, dist: DistInfo) -> None:
        self.cfg, self.dist, self.device, self.tasks = cfg, dist, dist.device, list(cfg.tasks)
        self.folder.lock()  # rank 0; a busy output_dir is reported with the data's errors, after reading the data
        enter_phase("build")  # a stop signal from here until train() ends the run at once (mtl/run/signals.py)

        def tokenizer_for(captions):  # the data is read and good: now the folder's decision, nothing written yet
            self._resume = self.folder.prepare(commit=False)
            return self.folder.tokenizer(captions)

        def check_data(train_ds, task_sets):  # what the feeds would refuse, before anything is written
            self._test_ds = check_feed_data(cfg, train_ds, task_sets, dist.world_size,
                                             run_method_types(cfg)[cfg.weighting.method].needs_heldout_batch)

        # seed, data, the run's own tokenizer (written to output_dir), model and collate: the tools' builder too
        inputs = self.folder.after_data(lambda: build_run_inputs(cfg, tokenizer_for, check_data))
        self.train_ds, self.val_ds, self.tokenizer = inputs.train_ds, inputs.val_ds, inputs.tokenizer
        self.skipped_lines = inputs.skipped_lines()  # (count, reasons) over every data set the run reads
        self.folder.prepare_run_files(self.train_ds.class_names)
        self.bare, resume = inputs.model, self._resume
        if cfg.init_from and dist.is_main:  # warm start: these weights, a fresh optimizer and schedule, step 0
            print("init_from: " + (f"not used, resuming from {resume}" if resume else
                                   f"a new run from the weights {init_from_weights(self.bare, cfg.init_from)}"),
                  flush=True)
        elif cfg.init_from and not resume:
            init_from_weights(self.bare, cfg.init_from)
        self.bare.to(self.device)
        self.heads = dict(self.bare.heads.items())
        self.strategy, self.weighting = build_strategy(cfg), build_weighting(cfg).to(self.device)
        self.amp = Amp(cfg.precision, self.device, sharded=cfg.parallel.engine == "fsdp2" and dist.distributed)
        self.bare.autocast_dtype = self.amp.dtype
        self.model = wrap_model(cfg, self.bare, self.strategy, dist)
        self.sharded = is_sharded(self.bare)  # parallel.engine=fsdp2 with a process group
        self.params = [p for p in self.bare.parameters() if p.requires_grad] + list(self.weighting.parameters())
        self.optimizer = build_optimizer(cfg, self.bare, self.weighting)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        # what a step touches, and nothing else (tools may swap in a CountingComm as parts.comm)
        self.parts = StepParts(model=self.model, bare=self.bare, tasks=self.tasks, strategy=self.strategy,
                               weighting=self.weighting, optimizer=self.optimizer, scheduler=self.scheduler,
                               amp=self.amp, params=self.params, grad_clip=cfg.optim.grad_clip)
        self.feed = build_feed(cfg, inputs, dist, self.weighting)
        self.val_loaders, self.test_loader = build_eval_feeds(cfg, inputs, dist, self._test_ds)
        self.step, self.last_eval, self.poison_spec = 0, {}, cfg.trainer.poison  # read once: a config read is ~10 µs
        self.stop_requested = self.stop_agreed = False  # set by SIGTERM/SIGUSR1; agreed through a collective
        self.stop_signal_step = 0  # the steps done when this rank's stop signal came (its message names it)
        self.resume_notes: list[str] = []
        if resume:
            self.step, self.resume_notes = self.folder.load(resume, self.parts, self.feed)
        self.folder.commit()  # nothing can refuse the run now: output_dir is written (a refused run writes nothing)
        self.log = RunLogger(cfg.output_dir, dist.is_main, cfg.trainer.max_steps, cfg.trainer.progress, self.step,
                             every=cfg.trainer.log_every, cfg=cfg)  # no terminal: a progress line every log_every steps
        self.steplog = StepLog(cfg, self.parts, self.log, self.device, dist.world_size, dist.is_main,
                               bad_steps=self.folder.resumed_bad_steps)  # a streak goes on where it stopped
        self.steplog.announce(self.resume_notes, dist.backend, self.feed.describe(cfg, dist.world_size),
                              data_summary(cfg, inputs, run_task_types(cfg)))  # the run's first lines

    @classmethod
    def from_config(cls, config: str, overrides: list[str] | tuple = ()) -> Trainer:
        """The public way to build a run: a config file plus ``key=value`` overrides, validated (exit-2 errors
        as ConfigError), in the process group torchrun's environment describes (none without torchrun)."""
        cfg = load_run_config(config, list(overrides))
        return cls(cfg, init_distributed(cfg))

    # ------------------------------------------------------------------ a step, and the loop

    def batches(self):
        """(index in the epoch, training batch on the host) from the run's position on: for tools and tests that
        look at a batch, or change it, before they hand it to ``step_once``."""
        while True:
            yield self.feed.take(self.step)

    def step_once(self, batch: dict | None = None) -> StepResult:
        """The public way to step a run: one optimizer step on ``batch`` (default: the run's next training
        batch), exactly as the training loop takes it. Advances ``self.step``; returns the step's result."""
        batch = self.feed.take(self.step)[1] if batch is None else batch
        self.batch_ready = time.perf_counter()  # the step's time runs from here: its batch in hand
        poison(batch, self.poison_spec, self.step + 1, self.dist.rank)  # testing only: a NaN or a crash
        self.batch = batch = self.feed.on_device(batch)  # the last batch stepped on (the step log reads it)
        try:
            result = train_step(self.parts, batch, self.step, self.stop_requested, self.feed.heldout_batch(self.step),
                                log_stats=self.steplog.writes(self.step + 1))  # the statistics its log shows
        except RuntimeError as e:
            raise explain_ddp_error(e, self, batch) or e from None
        self.step += 1
        self.stop_agreed = result.stop_agreed
        return result

    def train(self) -> dict:
        start = time.perf_counter()
        self.bare.train()
        peers = all_gather_objects((socket.gethostname(), os.getpid()))  # to tell a torn-down job (mtl/run/signals.py)
        self.signals = StopSignals(self.dist.rank, self.dist.world_size, peers, on_request=self._request_stop,
                                   under_launcher="TORCHELASTIC_RUN_ID" in os.environ).install()
        heartbeat.start(self.dist.rank, self.dist.world_size, self.cfg.ddp.timeout_s)  # names a rank that stops
        try:
            return self._train(start)
        except RuntimeError as e:  # a collective that timed out: one line naming the rank that did not answer
            lost = heartbeat.lost_peer(e)
            if lost is None:
                raise
            raise lost from None
        finally:
            heartbeat.stop()
            self.signals.uninstall()
            enter_phase("finishing")  # a stop signal now changes nothing: the run is ending (mtl/run/signals.py)

    def _request_stop(self) -> None:  # SIGTERM/SIGUSR1/SIGINT: acted on after the current step by every rank together
        if not self.stop_requested:
            self.stop_signal_step = self.step
        self.stop_requested = True

    def _train(self, start: float) -> dict:
        cfg, trainer_cfg = self.cfg, self.cfg.trainer
        skipped, reasons = self.skipped_lines
        if skipped:
            self.log.info(f"data.on_error=skip: skipped {skipped} bad data line(s): " + "; ".join(reasons[:5]))
        first = self.step  # 0, or the resumed checkpoint's step: the summary counts the steps this run took
        if self.folder.is_last(self.step):
            self.log.info(f"nothing to do: step {self.step} >= trainer.max_steps {trainer_cfg.max_steps}")
        while not self.folder.is_last(self.step) and not self.folder.watch.stopped:  # trainer.early_stopping
            enter_phase("step")
            result = self.step_once()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.batch_ready
            self.steplog.after_step(self.step, result, seconds, self.batch, self.feed.epoch)
            every = cfg.ddp.replica_check_every
            if self.dist.distributed and every and self.step % every == 0:
                verify_replicas(self.bare, self.step)
            if self.step % trainer_cfg.eval_every == 0 and not self.folder.is_last(self.step):
                self.run_eval(stoppable=True)
            # no periodic save in a non-finite streak: its weights may have blown up, and keep_last would delete
            # the checkpoint from before it, the one to go back to
            if self.folder.save_due(self.step) and not self.steplog.bad_steps:
                self.save()
            if self.stop_agreed:  # a rank got SIGTERM/SIGUSR1/SIGINT: all finish this step, save, exit
                self.log.info(f"step {self.step}: stop signal received "
                              f"({self.signals.describe(self.stop_signal_step)}); "
                              "saving a checkpoint and exiting")
                self.save()
                self.signals.done = True
                if self.signals.interrupted:  # Ctrl-C on this rank: saved, and exits 130 (mtl/run/signals.py)
                    raise KeyboardInterrupt
                return self.last_eval
        final = self.last_eval if self.folder.watch.stopped and self.last_eval else self.run_eval()
        self.steplog.refuse_nonfinite_final(self.step, final)  # a final evaluation that is NaN/inf: exit 5
        self.save()
        self.steplog.finish(self.step, final, time.perf_counter() - start, first, self.skipped_lines[0])
        return final

    def run_eval(self, stoppable: bool = False) -> dict:
        """The validation (and test) metrics, recorded. ``stoppable`` (a periodic evaluation): a stop signal cuts
        it short, unrecorded, so that the stop's checkpoint comes within torchrun's and Slurm's grace (30 s)."""
        enter_phase("evaluation")
        limit = self.cfg.trainer.eval_max_batches
        stop = (lambda: self.stop_requested) if stoppable else None
        try:
            with gathered(self.bare):  # FSDP2: the full parameters once, so no rank waits on another's batch count
                metrics = evaluate_run(self.bare, self.val_loaders, self.device, limit, stop)
                test = {} if self.test_loader is None else evaluate_run(
                    self.bare, dict.fromkeys(self.tasks, self.test_loader), self.device, limit, stop)
        except EvaluationStopped:
            self.log.info(f"step {self.step}: evaluation cut short by a stop signal (not recorded): saving first")
            return self.last_eval
        flat = flat_metrics(metrics, test)
        if hasattr(self.scheduler, "evaluated"):  # optim.scheduler=plateau: the rate follows the validation Δm
            flat["plateau_delta_m"] = self.scheduler.evaluated(flat)
        self.last_eval = self.steplog.evaluation(self.step, flat)  # then the best checkpoint, early stopping:
        self.steplog.watched(*self.folder.evaluated(self.step, flat, self.parts, self.feed, self.steplog.bad_steps))
        enter_phase("sample figure")
        self.steplog.samples(self.step, metrics, {t: loader.dataset for t, loader in self.val_loaders.items()})
        return self.last_eval

    def trainer_state(self) -> dict:
        return self.folder.trainer_state(self.step, self.parts, self.feed, self.steplog.bad_steps)

    def save(self) -> str:
        """Checkpoint this step (unless output_dir already holds exactly it), with the non-finite streak at it."""
        enter_phase("save")
        path, written = self.folder.save(self.step, self.parts, self.feed, self.steplog.bad_steps)
        if written:
            heartbeat.progress(self.step, saved=self.step)
            self.log.info(f"step {self.step}: checkpoint {path}")
        return path

    def close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
        self.folder.close()
