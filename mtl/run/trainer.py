"""The training loop: build the run, then step, log, evaluate and checkpoint until ``max_steps``."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import time

import numpy as np
import torch

from mtl.build import (
    build_eval_loaders,
    build_optimizer,
    build_run_pieces,
    build_scheduler,
    build_strategy,
    build_tokenizer,
    build_weighting,
    init_from_weights,
    task_code_files,
    wrap_model,
)
from mtl.config.resume import batch_statistics_layers, check_resume_config, random_layers, reshard_problems, saved_config
from mtl.config.schema import config_summary, to_yaml
from mtl.data.heldout import HeldoutStream
from mtl.data.loader import (
    build_eval_loader,
    build_test_dataset,
    build_train_loader,
    data_position,
    normalizing,
    resume_position,
    set_epoch,
)
from mtl.data.multi_input import MultiInputStream
from mtl.errors import CheckpointError, ConfigError, TrainingError
from mtl.files import write_atomic
from mtl.parallel.amp import Amp
from mtl.parallel.dist import DistInfo, all_gather_objects, barrier, broadcast_object, init_distributed
from mtl.parallel.fsdp import full_model_state, gathered, is_sharded
from mtl.parallel.runtime_checks import check_replicas, explain_ddp_error, locate_nonfinite
from mtl.run import checkpoint as ckpt
from mtl.run import heartbeat
from mtl.run.evaluate import evaluate_run, to_device
from mtl.run.faults import poison
from mtl.run.finite import first_blown_up, nonfinite_eval
from mtl.run.logger import RunLogger, trim_metrics
from mtl.run.runlock import LockHeld, RunLock
from mtl.run.signals import StopSignals
from mtl.run.step import StepParts, StepResult, present_tasks, train_step
from mtl.run.train_state import sharded_state


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS of this process


# what a run writes in output_dir; overwrite=true deletes these (and nothing else) before it starts
RUN_FILES = ("checkpoints", "tokenizer", "tb", "metrics.jsonl", "final_metrics.json", "curves.png", "config.yaml")


class Trainer:
    def __init__(self, cfg, dist: DistInfo):
        self._lock: RunLock | None = None  # rank 0's lock on output_dir, released by close()
        try:
            self._setup(cfg, dist)
        except BaseException:
            self._release_lock()
            raise

    def _setup(self, cfg, dist: DistInfo) -> None:
        self.cfg, self.dist = cfg, dist
        self.device = dist.device
        self.tasks = list(cfg.tasks)
        resume_path = self._prepare_output_dir()
        # seed, data, the run's own tokenizer (written to output_dir), model and collate: the same builder as the tools'
        pieces = build_run_pieces(cfg, lambda captions: build_tokenizer(cfg, captions, dist))
        self.train_ds, self.val_ds, self.tokenizer = pieces.train_ds, pieces.val_ds, pieces.tokenizer
        self.skipped_lines = pieces.skipped_lines()  # (count, reasons) over every data set the run reads
        if dist.is_main:  # the class list, for mtl.inference (which reads a checkpoint's own copy first)
            with open(os.path.join(cfg.output_dir, "class_names.json"), "w", encoding="utf-8") as f:
                json.dump(list(self.train_ds.class_names), f)
        self.checkpoint_files = self._checkpoint_files()
        self.bare = pieces.model
        if cfg.init_from and not resume_path:  # warm start: these weights, a fresh optimizer and schedule, step 0
            weights = init_from_weights(self.bare, cfg.init_from)
        if cfg.init_from and dist.is_main:
            print("init_from: " + (f"not used, resuming from {resume_path}" if resume_path
                                   else f"a new run from the weights {weights}"), flush=True)
        self.bare.to(self.device)
        self.heads = dict(self.bare.heads.items())
        self.strategy = build_strategy(cfg)
        self.weighting = build_weighting(cfg).to(self.device)
        self.amp = Amp(cfg.precision, self.device, sharded=cfg.parallel.engine == "fsdp2" and dist.distributed)
        self.bare.autocast_dtype = self.amp.dtype
        self.model = wrap_model(cfg, self.bare, self.strategy, dist)
        self.sharded = is_sharded(self.bare)  # ddp.engine=fsdp2 with a process group
        self.params = [p for p in self.bare.parameters() if p.requires_grad] + list(self.weighting.parameters())
        self.optimizer = build_optimizer(cfg, self.bare, self.weighting)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        # what a step touches, and nothing else (tools may swap in a CountingComm as parts.comm)
        self.parts = StepParts(model=self.model, bare=self.bare, tasks=self.tasks, strategy=self.strategy,
                               weighting=self.weighting, optimizer=self.optimizer, scheduler=self.scheduler,
                               amp=self.amp, params=self.params, grad_clip=cfg.optim.grad_clip)

        pin = self.device.type == "cuda"
        collate = pieces.collate
        self.mi: MultiInputStream | None = None  # multi-input mode: each task its own data set and sampler
        self.heldout: HeldoutStream | None = None  # a bilevel method's held-out batches (data.heldout)
        if pieces.task_sets is None:
            if self.weighting.needs_heldout_batch:  # first: its size check names data.heldout
                self.heldout = HeldoutStream(self.train_ds, normalizing(collate, self.train_ds), cfg.data.heldout,
                                             cfg.data.batch_size, dist.rank, dist.world_size, cfg.seed)
            self.train_loader = build_train_loader(self.train_ds, collate, cfg.data.batch_size, dist.rank,
                                                   dist.world_size, cfg.seed, cfg.data.num_workers, pin,
                                                   heldout=cfg.data.heldout)
            test_ds = build_test_dataset(cfg, self.train_ds)  # optional: evaluated beside val as test_<metric>
            self.test_loader = None if test_ds is None else build_eval_loader(
                test_ds, collate, cfg.data.eval_batch_size, dist.rank, dist.world_size, cfg.data.num_workers, pin)
        else:
            if build_test_dataset(cfg, self.train_ds) is not None:
                raise ConfigError("data.synthetic.test_size / data.test_path: a test split is not supported in "
                                  "multi-input mode (data.per_task) yet; set it to 0 / null")
            self.test_loader = None
            self.mi = MultiInputStream(cfg, {t: tr for t, (tr, _) in pieces.task_sets.items()},
                                       pieces.task_collates, dist.rank, dist.world_size)
        # {task: its validation loader}: the one val set, or in multi-input mode each task's own (mtl.inference too)
        self.val_loaders = build_eval_loaders(cfg, self.val_ds, collate, pieces.task_vals(), dist.rank,
                                              dist.world_size, pin)
        self.val_loader = self.val_loaders[self.tasks[0]]
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.bad_steps = self.overflows = 0
        self.stop_requested = self.stop_agreed = False  # set by SIGTERM/SIGUSR1; agreed through a collective
        self.last_eval: dict = {}
        self._stream = None  # step_once's own batch stream, made on its first call without a batch
        self._saved_step = None  # the step this run's output_dir holds a checkpoint of, as this process knows it
        self._resume_notes: list[str] = []
        if resume_path:
            self._load(resume_path)
            own = os.path.join(ckpt.checkpoint_root(cfg.output_dir), f"step_{self.step}")
            if os.path.abspath(resume_path) == os.path.abspath(own):
                self._saved_step = self.step
        self.log = RunLogger(cfg.output_dir, dist.is_main, cfg.trainer.max_steps, cfg.trainer.progress, self.step)
        for note in self._resume_notes:
            self.log.info(note)
        self.log.info(f"mtl: {dist.world_size} process(es) on {self.device} ({dist.backend or 'no process group'}), "
                      f"strategy={cfg.ddp.strategy}, weighting={cfg.weighting.method}, precision={cfg.precision}, "
                      + (f"global batch={cfg.data.batch_size * dist.world_size} ({cfg.data.batch_size} per process)"
                         if self.mi is None else
                         f"multi-input, sampling.policy={cfg.data.sampling.policy}, "
                         + (f"{cfg.data.batch_size} rows per process, each task's drawn per row"
                            if cfg.data.sampling.policy == "mixed" else "per-task rows per process: "
                            + ", ".join(f"{t}={self.mi.plan.batch_sizes[t]}" for t in self.tasks)))
                      + (f", {cfg.data.heldout} training items held out for {cfg.weighting.method}'s meta update"
                         if self.heldout is not None else "")
                      + f", {sum(p.numel() for p in self.params):,} parameters")

    # ------------------------------------------------------------------ set-up

    def _prepare_output_dir(self) -> str | None:
        """Lock output_dir, decide what to resume from, refuse to write over another run's checkpoints.

        Rank 0 alone reads the folder and decides; every rank follows that one decision (an error included),
        so no rank's own view of the file system can send it down another collective path than its peers.
        """
        decision = self._resume_decision() if self.dist.is_main else None
        kind, error, path, notes = broadcast_object(decision)
        if kind:
            self._release_lock()
            raise CheckpointError(error) if kind == "checkpoint" else ConfigError(error)
        if self.dist.is_main:
            print(config_summary(self.cfg, os.path.join(self.cfg.output_dir, "config.yaml")), flush=True)
            for note in notes:
                print(note, flush=True)
        barrier()
        return path

    def _resume_decision(self) -> tuple:
        """(error kind or None, error, checkpoint to resume from or None, notes to print), from what rank 0
        sees on disk. Takes the run lock first, so nothing below races another run."""
        cfg = self.cfg
        try:
            os.makedirs(cfg.output_dir, exist_ok=True)
            self._lock = RunLock.acquire(cfg.output_dir)
            notes = [self._lock.note] if self._lock.note else []
            notes += ckpt.recover(cfg.output_dir)
            if cfg.overwrite:
                notes += _start_over(cfg.output_dir)
            path = self._choose_checkpoint(notes)
            if path:
                check_resume_config(path, cfg)  # the world size, engine and global batch: _load (reshard_problems)
                notes += _restore_tokenizer(path, cfg.output_dir)
            trim_metrics(cfg.output_dir, ckpt.read_trainer_state(path)["step"] if path else 0)
            write_atomic(os.path.join(cfg.output_dir, "config.yaml"), to_yaml(cfg).encode("utf-8"))
        except LockHeld as e:
            return "config", f"output_dir: {e}", None, []
        except ConfigError as e:
            return "config", e.errors, None, []
        except CheckpointError as e:
            return "checkpoint", e.message, None, []
        except OSError as e:
            return "config", (f"output_dir: cannot write {e.filename or cfg.output_dir!r}: {ckpt.describe_os_error(e)}."
                              " Choose a writable output_dir with free space"), None, []
        return None, None, path, notes

    def _choose_checkpoint(self, notes: list[str]) -> str | None:
        cfg = self.cfg
        if cfg.resume == "auto":
            path, warnings = ckpt.find_resumable(cfg.output_dir)
            notes += warnings
            notes.append(f"resume=auto: {'resuming from ' + path if path else 'no checkpoint yet, starting fresh'}")
            root = ckpt.checkpoint_root(cfg.output_dir)
            partial = sorted(n for n in os.listdir(root) if n.endswith(".tmp")) if os.path.isdir(root) else []
            if partial:
                notes.append(f"resume=auto: ignoring incomplete checkpoint(s) {', '.join(partial)} (a save was "
                             "interrupted)")
            return path
        if cfg.resume is None:
            existing = ckpt.latest_checkpoint(cfg.output_dir)
            if existing:
                raise ConfigError(f"output_dir: {cfg.output_dir!r} already holds checkpoints "
                                  f"({os.path.basename(existing)}) of another run. Set resume=auto to continue it, "
                                  "overwrite=true to delete them and start over, or choose another output_dir")
            return None
        try:
            ckpt.verify_checkpoint(cfg.resume)
        except CheckpointError as e:
            raise CheckpointError(f"resume={cfg.resume!r}: {e.message}. Point resume at another checkpoint") from None
        return cfg.resume

    def _load(self, path: str) -> None:
        """Every rank: load the checkpoint rank 0 verified (files, checksums, config), resharded to this run's
        world size and engine when they differ (exact up to rounding; otherwise only with resume_reshard)."""
        state = ckpt.read_trainer_state(path)
        rank, engine = self.dist.rank, "fsdp2" if self.sharded else "ddp"
        problems, note = reshard_problems(path, state, self.cfg, self.dist.world_size, engine, random_layers(self.bare),
                                          batch_statistics_layers(self.bare))
        if problems and not self.cfg.resume_reshard:
            raise CheckpointError(f"cannot resume {path!r} exactly: " + "; ".join(problems) + ". Set "
                                  "resume_reshard=true to resume anyway (the weights, optimizer state and position "
                                  "in the data carry over; the run will not match the uninterrupted one)")
        if problems:
            note = "resume_reshard=true: resuming although the run will differ from the interrupted one: " + "; ".join(
                problems)
        self._resume_notes += [note] if note else []
        rng = ckpt.load_model_and_optimizer(path, state, self.bare, self.weighting, self.optimizer, rank)
        try:
            self.scheduler.load_state_dict(state["scheduler"])
            self.amp.load_state_dict(state["scaler"])
            self.weighting.load_state_dict(state["weighting"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path!r} does not fit this run's optimizer/weighting: {e}") from None
        self.step = state["step"]
        if self.mi is not None:  # multi-input: each task's sampler state is the position
            self.mi.load_state_dict(state.get("multi_input", {}))
        else:
            self._load_data_state(state.get("data") or data_position(  # v1: batches per rank, its own batch size
                state["epoch"], state["batch_in_epoch"], saved_config(path)["data"]["batch_size"],
                int(state.get("world_size") or 1)))
        if self.heldout is not None:
            self.heldout.load_state_dict(state["heldout"])
        ckpt.set_rng_state(rng)

    def data_state(self) -> dict:
        """Where the training data stands, for ``trainer_state.pt`` ("data"): in global samples, so that it means
        the same on any world size (mtl.data.loader.data_position)."""
        return data_position(self.epoch, self.batch_in_epoch, self.cfg.data.batch_size, self.dist.world_size)

    def _load_data_state(self, position: dict) -> None:
        """Continue the training data where ``data_state`` says, at this run's batch size and world size."""
        self.epoch, self.batch_in_epoch, again = resume_position(position, self.cfg.data.batch_size,
                                                                 self.dist.world_size)
        if again:
            self._resume_notes.append(f"resume: the checkpoint's position falls inside a batch of this run's global "
                                      f"batch; its last {again} sample(s) are seen again")

    def _checkpoint_files(self) -> dict[str, bytes]:
        """Small files every checkpoint carries (rank 0's are written): the class names and the run's tokenizer,
        so a checkpoint folder alone is enough to resume, export or predict."""
        if not self.dist.is_main:
            return {}
        files = {"class_names.json": json.dumps(list(self.train_ds.class_names)).encode("utf-8"),
                 **task_code_files(self.cfg)}  # the task_modules files: the checkpoint loads anywhere
        run_copy = os.path.join(self.cfg.output_dir, "tokenizer")
        for name in sorted(os.listdir(run_copy)):
            path = os.path.join(run_copy, name)
            if os.path.isfile(path) and not name.endswith(".tmp"):
                with open(path, "rb") as f:
                    files[f"tokenizer/{name}"] = f.read()
        return files

    def trainer_state(self) -> dict:
        return {
            "step": self.step, "world_size": self.dist.world_size, "engine": "fsdp2" if self.sharded else "ddp",
            "data": self.data_state(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.amp.state_dict(),
            "weighting": self.weighting.state_dict(),
            **({"multi_input": self.mi.state_dict()} if self.mi is not None else {}),
            **({"heldout": self.heldout.state_dict()} if self.heldout is not None else {}),
        }

    def save(self) -> str:
        """Checkpoint this step, unless this run's output_dir already holds exactly it (a stop signal that lands
        on a checkpoint step, a resume with nothing left to do): a second write would only rewrite the same state."""
        if self._saved_step == self.step:
            return os.path.join(ckpt.checkpoint_root(self.cfg.output_dir), f"step_{self.step}")
        model = full_model_state(self.bare) if self.sharded else self.bare  # FSDP2: gathered on rank 0 (collective)
        path = ckpt.save_checkpoint(self.cfg.output_dir, self.step, model, self.trainer_state(), to_yaml(self.cfg),
                                    self.dist.rank, self.cfg.checkpoint.keep_last, self.checkpoint_files,
                                    sharded=sharded_state(self.bare, self.weighting, self.optimizer))
        self._saved_step = self.step
        heartbeat.progress(self.step, saved=self.step)
        self.log.info(f"step {self.step}: checkpoint {path}")
        return path

    # ------------------------------------------------------------------ loop

    def batches(self):
        """(epoch, index in epoch, batch), starting where a resumed run left off."""
        while self.mi is not None:  # multi-input: each task's sampler keeps its own epoch (mtl/data/multi_input.py)
            yield 0, self.mi.next_batch(self.step)
        while True:
            set_epoch(self.train_loader, self.epoch)
            skip = self.batch_in_epoch
            self.train_loader.sampler.set_start(skip * self.cfg.data.batch_size)
            yield from enumerate(self.train_loader, start=skip)
            self.epoch += 1
            self.batch_in_epoch = 0

    @classmethod
    def from_config(cls, config: str, overrides: list[str] | tuple = ()) -> Trainer:
        """The public way to build a run: a config file plus ``key=value`` overrides, validated (exit-2 errors
        as ConfigError), in the process group torchrun's environment describes (none without torchrun)."""
        from mtl.config.checks import load_run_config

        cfg = load_run_config(config, list(overrides))
        return cls(cfg, init_distributed(cfg))

    def step_once(self, batch: dict | None = None) -> StepResult:
        """The public way to step a run: one optimizer step on ``batch`` (default: the run's next training
        batch), exactly as the training loop takes it. Advances ``self.step``; returns the step's result."""
        if batch is None:
            if self._stream is None:
                self._stream = self.batches()
            i, batch = next(self._stream)
            self.batch_in_epoch = i + 1
        poison(batch, self.cfg.trainer.poison, self.step + 1, self.dist.rank)  # testing only: a NaN or a crash
        batch = to_device(batch, self.device)
        heldout = None
        if self.heldout is not None and self.weighting.wants_heldout(self.step):
            heldout = to_device(self.heldout.next_batch(), self.device)
        try:
            result = train_step(self.parts, batch, self.step, self.stop_requested, heldout)
        except RuntimeError as e:
            raise explain_ddp_error(e, self, batch) or e from None
        self.step += 1
        self.stop_agreed = result.stop_agreed
        return result

    def _stop_signals(self) -> StopSignals:
        """SIGTERM/SIGUSR1/SIGINT set ``stop_requested``, acted on after the current step by every rank together."""
        peers = all_gather_objects((socket.gethostname(), os.getpid()))  # to tell a torn-down job (mtl/run/signals.py)
        return StopSignals(self.dist.rank, self.dist.world_size, peers, on_request=self._request_stop,
                           under_launcher="TORCHELASTIC_RUN_ID" in os.environ).install()

    def _request_stop(self) -> None:
        self.stop_requested = True

    def train(self) -> dict:
        start = time.perf_counter()
        self.bare.train()
        self.signals = self._stop_signals()
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

    def _train(self, start: float) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        skipped, reasons = self.skipped_lines
        if skipped:
            self.log.info(f"data.on_error=skip: skipped {skipped} bad data line(s): " + "; ".join(reasons[:5]))
        if self.step >= t.max_steps:
            self.log.info(f"nothing to do: step {self.step} >= trainer.max_steps {t.max_steps}")
        batches = self.batches()
        while self.step < t.max_steps:
            i, batch = next(batches)
            tic = time.perf_counter()
            batch = to_device(batch, self.device)
            result = self.step_once(batch)
            self.batch_in_epoch = i + 1
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self._after_step(result, time.perf_counter() - tic, batch)
            every = cfg.ddp.replica_check_every
            if self.dist.distributed and every and self.step % every == 0:
                check_replicas(self.bare, self.step)
            if self.step % t.eval_every == 0 and self.step < t.max_steps:
                self.run_eval()
            if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0 and self.step < t.max_steps:
                self.save()
            if self.stop_agreed:  # a rank got SIGTERM/SIGUSR1/SIGINT: all finish this step, save, exit
                self.log.info(f"step {self.step}: stop signal received; saving a checkpoint and exiting")
                self.save()
                self.signals.done = True
                if self.signals.interrupted:  # Ctrl-C on this rank: saved, and exits 130 (mtl/run/signals.py)
                    raise KeyboardInterrupt
                return self.last_eval
        final = self.run_eval()
        self._check_final_eval(final)
        self.save()
        wall = time.perf_counter() - start
        self._finish(final, wall)
        return final

    def _after_step(self, r, seconds: float, batch: dict) -> None:
        t = self.cfg.trainer
        heartbeat.progress(self.step)
        if r.weights_nonfinite:
            self._stop_for_nonfinite_weights()
        if r.nonfinite:
            self.bad_steps += 1
            bad = [k for k, v in r.losses.items() if not np.isfinite(v)] or ["gradient"]
            where = locate_nonfinite(self.bare, batch, present_tasks(batch, self.tasks)) if self.cfg.ddp.nan_monitor else ""
            self.log.record(self.step, {"bad_step": 1, "nonfinite": ",".join(bad), "consecutive": self.bad_steps,
                                        "where": where}, kind="bad_step")
            self.log.info(f"step {self.step}: non-finite {', '.join(bad)}; optimizer step skipped on every rank"
                          + (f"\n{where}" if where else ""))
            if self.bad_steps >= t.max_bad_steps:
                raise TrainingError(
                    f"{self.bad_steps} consecutive non-finite steps (trainer.max_bad_steps={t.max_bad_steps}). "
                    f"Lower optim.lr, use precision=bf16/fp32, or check the data; {self._kept_checkpoint()}. The "
                    f"skipped steps changed no weight, so every checkpoint from step {self.step - self.bad_steps} on "
                    f"holds the weights that gave the first non-finite step ({self.step - self.bad_steps + 1}): if "
                    f"they blew up, resume from a checkpoint before step {self.step - self.bad_steps}")
        else:
            self.bad_steps = 0
            if not r.stepped:  # an fp16 overflow: the GradScaler skipped the step and backed off
                self.overflows += 1
                self.log.record(self.step, {"fp16_overflow": 1, "total": self.overflows}, kind="overflow")
        if self.step % t.log_every == 0 or self.step == 1:
            scale = self.amp.loss_scale()
            values = {f"loss_{k}": v for k, v in r.losses.items()}
            values.update({f"weight_{k}": v for k, v in self.weighting.step_weights().items()})
            values.update({k: float(v) / (scale if "grad_norm" in k else 1.0) for k, v in r.stats.items()})
            values.update({
                "lr": self.scheduler.get_last_lr()[0], "grad_norm": r.grad_norm, "step_time_s": seconds,
                # the rows of this step (multi-input: they vary with the policy; every rank holds as many)
                "samples_per_s": int(batch["image"].shape[0]) * self.dist.world_size / max(seconds, 1e-9),
                "peak_mem_mb": peak_memory_mb(self.device), "epoch": self.epoch, "skipped": int(not r.stepped),
            })
            if self.amp.scaler is not None:
                values["loss_scale"] = scale
            self.log.record(self.step, values)
        self.log.progress(self.step, {f"loss_{k}": v for k, v in r.losses.items()})  # the bar moves every step

    # ------------------------------------------------------------------ a diverged model is never kept

    def _kept_checkpoint(self) -> str:
        newest = ckpt.latest_checkpoint(self.cfg.output_dir)
        return f"the newest checkpoint, {newest}, is kept" if newest else "no checkpoint was written"

    def _stop_for_nonfinite_weights(self) -> None:
        """The optimizer step made a weight NaN/inf: a bad step that cannot be skipped (the weights are gone)."""
        bad = first_blown_up(dict(self.bare.named_parameters())) or "a learned loss weight"
        self.log.record(self.step, {"bad_step": 1, "nonfinite": "weights", "where": bad}, kind="bad_step")
        raise TrainingError(f"step {self.step}: the optimizer step made the weights non-finite or blew them up past "
                            f"what float32 holds (on this rank first in {bad}); they cannot be restored, so the run "
                            f"stops and saves nothing. Lower optim.lr or set optim.grad_clip; "
                            f"{self._kept_checkpoint()}")

    def _check_final_eval(self, final: dict) -> None:
        """A run whose final evaluation is NaN/inf diverged: no final checkpoint, not a success (exit 5)."""
        bad = nonfinite_eval(final, self.tasks)
        if bad:
            raise TrainingError(f"the final evaluation at step {self.step} is non-finite ("
                                + ", ".join(f"{k}={final[k]}" for k in bad) + "): the model diverged, so its final "
                                f"checkpoint was not written. Lower optim.lr or set optim.grad_clip; "
                                f"{self._kept_checkpoint()}")

    def run_eval(self) -> dict:
        with gathered(self.bare):  # FSDP2: the full parameters once, so no rank waits on another's batch count
            metrics = evaluate_run(self.bare, self.val_loaders, self.device, self.cfg.trainer.eval_max_batches)
            test = {} if self.test_loader is None else evaluate_run(
                self.bare, dict.fromkeys(self.tasks, self.test_loader), self.device, self.cfg.trainer.eval_max_batches)
        flat = {f"{t}_{k}": v for t, m in metrics.items() for k, v in m.items() if k != "samples"}
        flat.update({f"test_{t}_{k}": v for t, m in test.items() for k, v in m.items() if k != "samples"})
        self.last_eval = flat
        self.log.record(self.step, flat, kind="eval")
        self.log.info(f"step {self.step} eval: " + ", ".join(f"{k}={v:.4f}" for k, v in flat.items()))
        self._log_samples(metrics)
        return flat

    def _log_samples(self, metrics: dict) -> None:
        n = self.cfg.trainer.num_samples
        task, samples = next(((t, m["samples"][:n]) for t, m in metrics.items() if "samples" in m), (None, []))
        if not samples or not self.dist.is_main:
            return
        lines = [f"  [{idx}] pred: {hyp!r}  ref: {ref!r}" for idx, hyp, ref in samples]
        self.log.info("samples:\n" + "\n".join(lines))
        self.log.text("samples", "\n\n".join(f"**{i}** pred: `{h}` — ref: `{r}`" for i, h, r in samples), self.step)
        from mtl.plots import sample_figure

        val = self.val_ds if self.mi is None else self.val_loaders[task].dataset
        images = [val[idx]["image"] for idx, _, _ in samples]
        self.log.figure("samples", sample_figure(images, samples), self.step)

    def _finish(self, final: dict, wall: float) -> None:
        summary = {"step": self.step, "wall_time_s": round(wall, 1), "world_size": self.dist.world_size,
                   "fp16_overflows": self.overflows,
                   "data_skipped": self.skipped_lines[0], **final}
        if self.dist.is_main:
            with open(os.path.join(self.cfg.output_dir, "final_metrics.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
            from mtl.plots import plot_curves

            plot_curves(os.path.join(self.cfg.output_dir, "metrics.jsonl"),
                        os.path.join(self.cfg.output_dir, "curves.png"),
                        [key for head in self.heads.values() for key, _ in head.metric_keys()])
            hp = {"strategy": self.cfg.ddp.strategy, "weighting": self.cfg.weighting.method,
                  "precision": self.cfg.precision, "lr": self.cfg.optim.lr,
                  "global_batch": self.cfg.data.batch_size * self.dist.world_size}
            self.log.hparams(hp, {f"hparam/{k}": v for k, v in final.items()})
        self.log.info(f"done: {self.step} steps in {wall:.0f} s; " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))

    def close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _start_over(output_dir: str) -> list[str]:
    """overwrite=true: delete what an earlier run wrote in ``output_dir`` (RUN_FILES only; other files stay)."""
    found = [n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]
    if not found:
        return []
    steps = [os.path.basename(p) for _, p in ckpt.list_checkpoints(output_dir)]
    root = ckpt.checkpoint_root(output_dir)
    if os.path.isdir(root):  # one rename: no half-deleted set of checkpoints is ever visible
        trash = os.path.join(output_dir, ".checkpoints.deleting")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(root, trash)
        shutil.rmtree(trash)
    for name in found:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    return [f"overwrite=true: deleted the earlier run's {', '.join(found)} in {output_dir}"
            + (f" (checkpoints {', '.join(steps)})" if steps else "")]


def _restore_tokenizer(checkpoint: str, output_dir: str) -> list[str]:
    """Resume with the checkpoint's own tokenizer: copy it over the run's copy (which may be damaged)."""
    src = os.path.join(checkpoint, "tokenizer")
    if not os.path.isdir(src):
        return []
    dst = os.path.join(output_dir, "tokenizer")
    os.makedirs(dst, exist_ok=True)
    restored = []
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        target = os.path.join(dst, name)
        try:
            with open(target, "rb") as f:
                same = f.read() == data
        except FileNotFoundError:
            same = False
        if not same:
            write_atomic(target, data)
            restored.append(name)
    return [f"tokenizer: restored {', '.join(restored)} in {dst} from the checkpoint"] if restored else []

