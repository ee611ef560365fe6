"""A run's folder (``output_dir``): the one-run lock, the resume decision, save and load, and when to save.

Start-up, in order:
1. ``lock()`` (rank 0): take the run lock. A busy folder is not raised yet: the data is read first, so that one
   message names every error of the command (``after_data``), and nothing is written in the folder before the
   data is known good.
2. ``prepare()`` (every rank, once the data is good): rank 0 alone reads the folder and decides (recover an
   interrupted re-save, ``overwrite``, which checkpoint to resume, the checkpoint's tokenizer, ``metrics.jsonl``
   cut back to it, ``config.yaml``); every rank follows that one decision, an error included, so no rank's own
   view of the file system can send it down another collective path than its peers.

Then ``load`` (every rank) restores a checkpoint into the step's parts and the feed, and ``save`` writes one;
``save_due(step)`` / ``is_last(step)`` say when, as torchtitan's checkpointer does.
"""

from __future__ import annotations

import json
import os
import shutil

from mtl.config.resume import batch_statistics_layers, random_layers, reshard_problems, saved_config, verify_resume_config
from mtl.config.schema import config_summary, multi_input, task_data, to_yaml
from mtl.data.loader import data_position
from mtl.errors import CheckpointError, ConfigError, DataError
from mtl.files import write_atomic
from mtl.parallel.dist import DistInfo, barrier, broadcast_object
from mtl.parallel.fsdp import full_model_state, is_sharded
from mtl.registry import plugin_files
from mtl.run import checkpoint as ckpt
from mtl.run.logger import trim_metrics
from mtl.run.runlock import LockHeld, RunLock
from mtl.run.step import StepParts
from mtl.run.train_state import sharded_state

# what a run writes in output_dir; overwrite=true deletes these (and nothing else) before it starts
RUN_FILES = ("checkpoints", "tokenizer", "tb", "metrics.jsonl", "final_metrics.json", "curves.png", "config.yaml")


class RunFolder:
    def __init__(self, cfg, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self._lock: RunLock | None = None  # rank 0's lock on output_dir, released by close()
        self._lock_error: str | None = None  # rank 0: why the lock could not be taken (reported with the data's)
        self._made = False  # rank 0 made output_dir (a start-up that fails leaves no empty folder behind)
        self.saved_step: int | None = None  # the step this folder holds a checkpoint of, as this process knows it
        self.files: dict[str, bytes] = {}  # the small files every checkpoint carries (rank 0's are written)

    # ------------------------------------------------------------------ start-up

    def lock(self) -> None:
        """Rank 0: take the run lock; a busy or unwritable folder is kept as an error for ``prepare``. Every rank
        learns that error, so that a data error found with it is the same message on every rank (said once)."""
        if self.dist.is_main:
            self._take_lock()
        self._lock_error = broadcast_object(self._lock_error)

    def _take_lock(self) -> None:
        out = self.cfg.output_dir
        try:
            self._made = not os.path.isdir(out)
            os.makedirs(out, exist_ok=True)
            self._lock = RunLock.acquire(out)
        except LockHeld as e:
            self._lock_error = f"output_dir: {e}"
        except OSError as e:
            self._lock_error = (f"output_dir: cannot write {e.filename or out!r}: {ckpt.describe_os_error(e)}. "
                                "Choose a writable output_dir with free space")

    def after_data(self, build):
        """``build()`` (reading the data); a data error is raised with the folder's own error, if any, at once."""
        try:
            return build()
        except (ConfigError, DataError) as e:
            if self._lock_error is None or self._lock_error in e.message:  # the folder's error alone (prepare's)
                raise
            if isinstance(e, ConfigError):
                raise ConfigError([self._lock_error, *e.errors]) from None
            raise DataError(f"{e.message}\nand {self._lock_error}") from None

    def prepare(self) -> str | None:
        """Every rank, once the data is good: the checkpoint to resume from, or None (see the module docstring)."""
        decision = self._decide() if self.dist.is_main else None
        kind, error, path, notes = broadcast_object(decision)
        if kind:
            self.close()
            raise CheckpointError(error) if kind == "checkpoint" else ConfigError(error)
        if self.dist.is_main:
            print(config_summary(self.cfg, os.path.join(self.cfg.output_dir, "config.yaml"), skip=unused_keys(self.cfg)),
                  flush=True)
            for note in notes:
                print(note, flush=True)
        barrier()
        return path

    def _decide(self) -> tuple:
        """(error kind or None, error, checkpoint to resume from or None, notes to print), from what rank 0 sees."""
        cfg = self.cfg
        if self._lock_error:
            return "config", self._lock_error, None, []
        try:
            notes = [self._lock.note] if self._lock.note else []
            notes += ckpt.recover(cfg.output_dir)
            if cfg.overwrite:
                notes += start_over(cfg.output_dir)
            path = self._choose_checkpoint(notes)
            if path:
                verify_resume_config(path, cfg)  # the world size, engine and global batch: load (reshard_problems)
                notes += restore_tokenizer(path, cfg.output_dir)
            trim_metrics(cfg.output_dir, ckpt.read_trainer_state(path)["step"] if path else 0)
            write_atomic(os.path.join(cfg.output_dir, "config.yaml"), to_yaml(cfg).encode("utf-8"))
        except ConfigError as e:
            return "config", e.errors, None, []
        except CheckpointError as e:
            return "checkpoint", e.message, None, []
        except OSError as e:
            return "config", (f"output_dir: cannot write {e.filename or cfg.output_dir!r}: {ckpt.describe_os_error(e)}."
                              " Choose a writable output_dir with free space"), None, []
        self._made = False  # the folder now holds this run
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

    def write_run_files(self, class_names: list) -> None:
        """Rank 0: the class list (for mtl.inference) and what every checkpoint carries: the class names, the
        plug-in files (``mtl.registry.plugin_files``) and the run's tokenizer, so a checkpoint folder alone resumes,
        exports or predicts."""
        if not self.dist.is_main:
            return
        names = json.dumps(list(class_names)).encode("utf-8")
        with open(os.path.join(self.cfg.output_dir, "class_names.json"), "wb") as f:
            f.write(names)
        self.files = {"class_names.json": names, **plugin_files(self.cfg)}
        run_copy = os.path.join(self.cfg.output_dir, "tokenizer")
        for name in sorted(os.listdir(run_copy)):
            path = os.path.join(run_copy, name)
            if os.path.isfile(path) and not name.endswith(".tmp"):
                with open(path, "rb") as f:
                    self.files[f"tokenizer/{name}"] = f.read()

    # ------------------------------------------------------------------ when

    def save_due(self, step: int) -> bool:
        """A periodic checkpoint at ``step`` (the last step's is the run's final save, not a periodic one)."""
        every = self.cfg.checkpoint.every_steps
        return bool(every) and step % every == 0 and not self.is_last(step)

    def is_last(self, step: int) -> bool:
        return step >= self.cfg.trainer.max_steps

    # ------------------------------------------------------------------ save and load

    def trainer_state(self, step: int, parts: StepParts, feed) -> dict:
        return {"step": step, "world_size": self.dist.world_size,
                "engine": "fsdp2" if is_sharded(parts.bare) else "ddp", **feed.state_dict(),
                "scheduler": parts.scheduler.state_dict(), "scaler": parts.amp.state_dict(),
                "weighting": parts.weighting.state_dict()}

    def save(self, step: int, parts: StepParts, feed) -> tuple[str, bool]:
        """(the checkpoint of ``step``, whether it was written now): not when this folder already holds exactly
        it (a stop signal on a checkpoint step, a resume with nothing left to do)."""
        path = os.path.join(ckpt.checkpoint_root(self.cfg.output_dir), f"step_{step}")
        if self.saved_step == step:
            return path, False
        sharded = is_sharded(parts.bare)
        model = full_model_state(parts.bare) if sharded else parts.bare  # FSDP2: gathered on rank 0 (collective)
        path = ckpt.save_checkpoint(self.cfg.output_dir, step, model, self.trainer_state(step, parts, feed),
                                    to_yaml(self.cfg), self.dist.rank, self.cfg.checkpoint.keep_last, self.files,
                                    sharded=sharded_state(parts.bare, parts.weighting, parts.optimizer))
        self.saved_step = step
        return path, True

    def load(self, path: str, parts: StepParts, feed) -> tuple[int, list[str]]:
        """Every rank: load the checkpoint rank 0 verified into the parts and the feed, resharded to this run's
        world size and engine when they differ (exact up to rounding; otherwise only with resume_reshard).
        Returns (its step, notes to print)."""
        cfg, state = self.cfg, ckpt.read_trainer_state(path)
        engine = "fsdp2" if is_sharded(parts.bare) else "ddp"
        problems, note = reshard_problems(path, state, cfg, self.dist.world_size, engine, random_layers(parts.bare),
                                          batch_statistics_layers(parts.bare))
        if problems and not cfg.resume_reshard:
            raise CheckpointError(f"cannot resume {path!r} exactly: " + "; ".join(problems) + ". Set "
                                  "resume_reshard=true to resume anyway (the weights, optimizer state and position "
                                  "in the data carry over; the run will not match the uninterrupted one)")
        if problems:
            note = "resume_reshard=true: resuming although the run will differ from the interrupted one: " + "; ".join(
                problems)
        notes = [note] if note else []
        rng = ckpt.load_model_and_optimizer(path, state, parts.bare, parts.weighting, parts.optimizer, self.dist.rank)
        try:
            parts.scheduler.load_state_dict(state["scheduler"])
            parts.amp.load_state_dict(state["scaler"])
            parts.weighting.load_state_dict(state["weighting"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path!r} does not fit this run's optimizer/weighting: {e}") from None
        if not state.get("data") and "epoch" in state:  # v1: batches per rank, at its own batch size
            state = {**state, "data": data_position(state["epoch"], state["batch_in_epoch"],
                                                    saved_config(path)["data"]["batch_size"],
                                                    int(state.get("world_size") or 1))}
        notes += feed.load_state_dict(state)
        ckpt.set_rng_state(rng)
        own = os.path.join(ckpt.checkpoint_root(cfg.output_dir), f"step_{state['step']}")
        if os.path.abspath(path) == os.path.abspath(own):
            self.saved_step = state["step"]
        return state["step"], notes

    def close(self) -> None:
        """Release the lock; a start-up that made output_dir and failed before writing to it removes it again."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._made:
            self._made = False
            try:
                os.rmdir(self.cfg.output_dir)  # only if empty
            except OSError:
                pass


def unused_keys(cfg) -> tuple[str, ...]:
    """Config sections the run does not read, left out of the start-up summary: the synthetic data's settings in
    a run whose every data set is a manifest or an image folder."""
    sources = {task_data(cfg, t).source for t in cfg.tasks} if multi_input(cfg) else {cfg.data.source}
    return () if "synthetic" in sources else ("data.synthetic.",)


def start_over(output_dir: str) -> list[str]:
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


def restore_tokenizer(checkpoint: str, output_dir: str) -> list[str]:
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
