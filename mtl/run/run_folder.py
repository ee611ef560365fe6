"""A run's folder (``output_dir``): the one-run lock, the resume decision, save and load, and when to save.

Start-up, in order:
1. ``lock()`` (rank 0): take the run lock. A busy folder is not raised yet: the data is read first, so that one
   message names every error of the command (``after_data``), and nothing is written in the folder before the
   data is known good.
2. ``prepare(commit=False)`` (every rank, once the data is good): rank 0 alone reads the folder and decides
   (recover an interrupted re-save, ``overwrite``, which checkpoint to resume, the run's identity); every rank
   follows that one decision, an error included, so no rank's own view of the file system can send it down
   another collective path than its peers. ``tokenizer()`` then gives the run's tokenizer, written nowhere yet.
3. ``commit()`` (every rank, once nothing can refuse the run any more: the resume's checks on the model in
   ``load``, ``init_from``): rank 0 writes what was decided: ``overwrite``'s deletion, ``metrics.jsonl`` cut back
   to the checkpoint, ``tokenizer/``, ``class_names.json``, ``config.yaml``, ``run.json``. So a refused run leaves
   output_dir as it was (the lock it took is gone again; an interrupted re-save's checkpoint, put back by
   ``recover``, is the one repair made before). ``prepare()`` alone (commit=True) decides and writes at once.

A run's identity: a fresh run gets a random id, kept in ``output_dir/run.json`` and in every checkpoint's
``trainer_state.pt`` (``run_id``). A resume continues the checkpoint's run, and may write over that run's
checkpoints only: a checkpoint of another folder resumes into a folder with no checkpoints (it becomes a new run
there, with a new id; ``run.json`` names the checkpoint it started from) or into one whose checkpoints are its
own run's, never over another run's (``_identity``; a ConfigError, exit 2, as ``resume=null`` on a folder with
checkpoints). A checkpoint is a folder's own when it lies in its ``checkpoints/`` (links followed), or is a
byte-identical copy (``checkpoint.same_checkpoint``: the same manifest) of the folder's own checkpoint of that step;
a checkpoint of the folder's run that is neither (a copy of the run that went on its own way) is refused too: one
folder never holds two histories. A checkpoint without an id (written before ids) is its own folder's run's.

Then ``load`` (every rank) restores a checkpoint into the step's parts and the feed, and ``save`` writes one;
``save_due(step)`` / ``is_last(step)`` say when, as torchtitan's checkpointer does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

from omegaconf import OmegaConf

from mtl.checkpoint import folder as ckpt
from mtl.checkpoint import trainable
from mtl.checkpoint.train_state import sharded_state
from mtl.config.schema import config_summary, to_yaml
from mtl.data.loader import data_position
from mtl.data.tokenizer import FILE_NAME as TOKENIZER_FILE
from mtl.data.tokenizer import CaptionTokenizer
from mtl.errors import CheckpointError, ConfigError, DataError, MTLError
from mtl.files import write_atomic
from mtl.models.backbones.hf_vision import carried_files
from mtl.parallel.dist import DistInfo, barrier, broadcast_object
from mtl.parallel.fsdp import full_model_state, is_sharded
from mtl.registry import plugin_files
from mtl.run.best import BEST_FILE, RunWatch
from mtl.run.logger import trim_metrics
from mtl.run.runlock import LockHeld, RunLock
from mtl.run.step import StepParts
from mtl.setup.build import resolve_tokenizer, tokenizer_source
from mtl.setup.resume import batch_statistics_layers, random_layers, reshard_problems, saved_config, verify_resume_config

RUN_ID_FILE = "run.json"  # the run's identity: {"run_id": ..., "resumed_from": the checkpoint it started from or null}
# what a run writes in output_dir; overwrite=true deletes these (and nothing else) before it starts
RUN_FILES = ("checkpoints", "tokenizer", "tb", "metrics.jsonl", "final_metrics.json", "curves.png", "config.yaml",
             RUN_ID_FILE)


class RunFolder:
    def __init__(self, cfg, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self._lock: RunLock | None = None  # rank 0's lock on output_dir, released by close()
        self._lock_error: str | None = None  # rank 0: why the lock could not be taken (reported with the data's)
        self._made = False  # rank 0 made output_dir (a start-up that fails leaves no empty folder behind)
        self.saved_step: int | None = None  # the step this folder holds a checkpoint of, as this process knows it
        self.files: dict[str, bytes] = {}  # the small files every checkpoint carries (rank 0's are written)
        self.run_id: str | None = None  # this run's identity (prepare), saved in every checkpoint
        self.resumed_bad_steps = 0  # the non-finite streak at the step resumed from (load)
        self._resume: str | None = None  # the checkpoint to resume from (prepare)
        self._trim_step = 0  # rank 0: metrics.jsonl is cut back to this step (commit)
        self._tokenizer: dict[str, bytes] | None = None  # rank 0: the run's tokenizer files (tokenizer)
        self._tokenizer_from_checkpoint = False  # rank 0: they are the resumed checkpoint's (commit says so)
        self._class_names: bytes | None = None  # rank 0: class_names.json (prepare_run_files)
        self.watch = RunWatch(cfg)  # the best checkpoint and early stopping (mtl/run/best.py), in trainer_state.pt

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

    def prepare(self, commit: bool = True) -> str | None:
        """Every rank, once the data is good: the checkpoint to resume from, or None (see the module docstring).
        ``commit=False``: write nothing yet; the caller calls ``commit()`` once nothing can refuse the run."""
        decision = self._decide() if self.dist.is_main else None
        kind, error, path, notes, self.run_id = broadcast_object(decision)
        self._resume = path
        if kind:
            self.close()
            raise CheckpointError(error) if kind == "checkpoint" else ConfigError(error)
        if self.dist.is_main:
            # only the keys the run reads (mtl/config/read_rules.py)
            print(config_summary(self.cfg, os.path.join(self.cfg.output_dir, "config.yaml")), flush=True)
            for note in notes:
                print(note, flush=True)
        barrier()
        if commit:
            self.commit()
        return path

    def _decide(self) -> tuple:
        """(error kind or None, error, checkpoint to resume from or None, notes to print, the run's id), from what
        rank 0 sees. Writes nothing (but ``recover``'s repair)."""
        cfg = self.cfg
        if self._lock_error:
            return "config", self._lock_error, None, [], None
        try:
            notes = [self._lock.note] if self._lock.note else []
            notes += ckpt.recover(cfg.output_dir)
            if cfg.overwrite:
                refuse_linked_checkpoints(cfg.output_dir)
            path = self._choose_checkpoint(notes)
            state = ckpt.read_trainer_state(path) if path else None
            if path:
                verify_resume_config(path, cfg)  # the world size, engine and global batch: load (reshard_problems)
            run_id, self._trim_step, note = self._identity(path, state)
        except ConfigError as e:
            return "config", e.errors, None, [], None
        except CheckpointError as e:
            return "checkpoint", e.message, None, [], None
        except OSError as e:
            return "config", (f"output_dir: cannot write {e.filename or cfg.output_dir!r}: {ckpt.describe_os_error(e)}."
                              " Choose a writable output_dir with free space"), None, [], None
        return None, None, path, notes + ([note] if note else []), run_id

    def _identity(self, path: str | None, state: dict | None) -> tuple[str, int, str]:
        """(this run's id, the step metrics.jsonl is cut back to, a note or ""), or a ConfigError when resuming
        ``path`` here would write over the checkpoints of another run (see the module docstring)."""
        cfg, out = self.cfg, self.cfg.output_dir
        if path is None:
            return new_run_id(), 0, ""
        theirs, step = ckpt.checkpoint_run_id(path), int(state["step"])
        if in_checkpoint_root(path, out):  # this folder's own checkpoint: resume=auto, or a step of it named
            return theirs or folder_run_id(out) or new_run_id(), step, ""
        held = ckpt.list_checkpoints(out)
        if not held:  # a new folder (or one whose run saved nothing): a new run from that checkpoint
            if theirs and folder_run_id(out) == theirs:  # this folder's run, its checkpoints gone: resumed from a copy
                return theirs, step, ""
            run_id = new_run_id()
            return run_id, 0, (f"resume: {path} is another folder's checkpoint: {out} starts a new run from it "
                               f"(run id {run_id}, in {RUN_ID_FILE})")
        own = own_checkpoint(out, step)
        if own and ckpt.same_checkpoint(path, own):  # a byte-identical copy of one of this folder's own checkpoints
            return theirs or folder_run_id(out) or new_run_id(), step, ""
        mine = [p for _, p in held if in_checkpoint_root(p, out)] or [p for _, p in held]  # not links out of it
        ids = {ckpt.checkpoint_run_id(p) for p in mine} - {None}
        names = ", ".join(os.path.basename(p) for p in mine)
        if theirs and theirs in ids:  # this folder's run, but another history of it (a copy that went on its own way)
            differs = (f"its step_{step} differs from this folder's {own}" if own else
                       f"this folder holds no step_{step} to compare it with (its checkpoints: {names})")
            raise ConfigError(f"output_dir: resume={cfg.resume!r} is not one of {out!r}'s own checkpoints: it is of "
                              f"this folder's run {theirs}, but {differs} (a copy of the run that went on its own "
                              f"way): resuming it here would leave two histories in one folder, spliced in its "
                              f"checkpoints, metrics.jsonl and config.yaml. To continue that checkpoint, give it a new "
                              f"folder: output_dir=<new folder> resume={cfg.resume}; to continue this folder's own "
                              f"run: resume=auto")
        why = (f"this folder's run {', '.join(sorted(ids))}; the checkpoint's run {theirs}" if theirs and ids else
               "one of them was written before mtl saved run ids, so they cannot be told to be one run")
        raise ConfigError(f"output_dir: {out!r} holds checkpoints ({names}) of another run than resume={cfg.resume!r} "
                          f"({why}): resuming it here would write over them and mix the two runs' metrics.jsonl and "
                          f"config.yaml. To continue that checkpoint, give it a new folder: output_dir=<new folder> "
                          f"resume={cfg.resume}; to continue this folder's own run: resume=auto")

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
            if existing and not cfg.overwrite:  # overwrite=true deletes them (commit)
                raise ConfigError(f"output_dir: {cfg.output_dir!r} already holds checkpoints "
                                  f"({os.path.basename(existing)}) of another run. Set resume=auto to continue it, "
                                  "overwrite=true to delete them and start over, or choose another output_dir")
            return None
        try:
            ckpt.verify_checkpoint(cfg.resume)
        except CheckpointError as e:
            raise CheckpointError(f"resume={cfg.resume!r}: {e.message}. Point resume at another checkpoint") from None
        return cfg.resume

    def tokenizer(self, captions) -> CaptionTokenizer:
        """Every rank, after ``prepare``: the run's tokenizer, written nowhere yet (``commit`` writes the run's copy,
        ``output_dir/tokenizer/``). On a resume the checkpoint's own (so a damaged run's copy does not block it);
        else the run's copy (not with overwrite=true, which deletes it); else ``mtl.setup.build.resolve_tokenizer``'s
        (``tokenizer.path``'s, ``init_from``'s or one trained on ``captions()``). Rank 0 finds it; every rank
        loads those same bytes, or raises the same error."""
        found = None
        if self.dist.is_main:
            try:
                found = "ok", self._find_tokenizer(captions)
            except MTLError as e:
                found = type(e).__name__, (e.errors if isinstance(e, ConfigError) else e.message)
        kind, value = broadcast_object(found)
        if kind != "ok":
            raise {"ConfigError": ConfigError, "CheckpointError": CheckpointError}.get(kind, DataError)(value)
        if self.dist.is_main:
            self._tokenizer = value
        return tokenizer_from_files(value)

    def _find_tokenizer(self, captions) -> dict[str, bytes]:
        """Rank 0: the files of the run's tokenizer (see ``tokenizer``); a damaged one is refused, naming its file."""
        cfg = self.cfg
        source = tokenizer_source(cfg)  # looked up even when unused: a missing init_from tokenizer is an error at once
        run_copy = os.path.join(cfg.output_dir, "tokenizer")
        if self._resume and os.path.isfile(os.path.join(self._resume, "tokenizer", TOKENIZER_FILE)):
            found = os.path.join(self._resume, "tokenizer")
            self._tokenizer_from_checkpoint = True
        elif not cfg.overwrite and os.path.isfile(os.path.join(run_copy, TOKENIZER_FILE)):
            found = run_copy
        else:
            view = OmegaConf.merge(cfg, {"output_dir": os.path.join(cfg.output_dir, ".none")}) if cfg.overwrite else cfg
            with tempfile.TemporaryDirectory() as folder:  # resolve_tokenizer does not read the run's copy here
                resolve_tokenizer(view, captions, source).save(folder)
                return folder_files(folder)
        CaptionTokenizer.load(found)  # a damaged file is refused here, by its own name
        return folder_files(found)

    def prepare_run_files(self, class_names: list) -> None:
        """Rank 0: the class list (for mtl.inference; ``commit`` writes it) and what every checkpoint carries: the
        class names, the plug-in files (``mtl.registry.plugin_files``) and the run's tokenizer, so a checkpoint
        folder alone resumes, exports or predicts."""
        if not self.dist.is_main:
            return
        names = self._class_names = json.dumps(list(class_names)).encode("utf-8")
        self.files = {"class_names.json": names, **plugin_files(self.cfg), **carried_files(self.cfg)}
        self.files.update({f"tokenizer/{name}": data for name, data in (self._tokenizer or {}).items()})

    def commit(self) -> None:
        """Every rank, once nothing can refuse the run any more: rank 0 writes what the start-up decided (see the
        module docstring); a failed write is one ConfigError on every rank."""
        error, notes = self._write_start() if self.dist.is_main else (None, [])
        error = broadcast_object(error)
        if error:
            self.close()
            raise ConfigError(error)
        for note in notes:
            print(note, flush=True)

    def _write_start(self) -> tuple[str | None, list[str]]:
        cfg, out = self.cfg, self.cfg.output_dir
        notes = []
        try:
            if cfg.overwrite:
                notes += start_over(out)
            trim_metrics(out, self._trim_step)
            if self._tokenizer is not None:
                run_copy = os.path.join(out, "tokenizer")
                restored = write_changed(run_copy, self._tokenizer)
                if restored and self._tokenizer_from_checkpoint:
                    notes.append(f"tokenizer: restored {', '.join(restored)} in {run_copy} from the checkpoint")
            if self._class_names is not None:
                write_atomic(os.path.join(out, "class_names.json"), self._class_names)
            write_atomic(os.path.join(out, "config.yaml"), to_yaml(cfg).encode("utf-8"))
            identity = {"run_id": self.run_id, "resumed_from": os.path.abspath(self._resume) if self._resume else None}
            write_atomic(os.path.join(out, RUN_ID_FILE), json.dumps(identity, indent=1).encode("utf-8"))
        except ConfigError as e:  # a checkpoints link that appeared since prepare (refuse_linked_checkpoints)
            return e.errors, []
        except OSError as e:
            return (f"output_dir: cannot write {e.filename or out!r}: {ckpt.describe_os_error(e)}. Choose a writable "
                    "output_dir with free space"), []
        self._made = False  # the folder now holds this run
        return None, notes

    # ------------------------------------------------------------------ when

    def save_due(self, step: int) -> bool:
        """A periodic checkpoint at ``step`` (the last step's is the run's final save, not a periodic one)."""
        every = self.cfg.checkpoint.every_steps
        return bool(every) and step % every == 0 and not self.is_last(step)

    def is_last(self, step: int) -> bool:
        return step >= self.cfg.trainer.max_steps

    # ------------------------------------------------------------------ save and load

    def trainer_state(self, step: int, parts: StepParts, feed, bad_steps: int = 0) -> dict:
        """What ``trainer_state.pt`` holds (mtl/checkpoint/folder.py); ``bad_steps``: the non-finite streak at ``step``."""
        return {"step": step, "world_size": self.dist.world_size,
                "engine": "fsdp2" if is_sharded(parts.bare) else "ddp", **feed.state_dict(),
                "scheduler": parts.scheduler.state_dict(), "scaler": parts.amp.state_dict(),
                "weighting": parts.weighting.state_dict(), "run_id": self.run_id, "bad_steps": bad_steps,
                "watch": self.watch.state_dict(), **self._base()}

    def _base(self) -> dict:
        """checkpoint.trainable_only: {"base": the pretrained folders and their hashes}, computed once."""
        if not trainable.trainable_only(self.cfg):
            return {}
        if getattr(self, "_base_record", None) is None:
            self._base_record = trainable.base_record(self.cfg)
        return {"base": self._base_record}

    def save(self, step: int, parts: StepParts, feed, bad_steps: int = 0) -> tuple[str, bool]:
        """(the checkpoint of ``step``, whether it was written now): not when this folder already holds exactly
        it (a stop signal on a checkpoint step, a resume with nothing left to do). In a non-finite streak
        (``bad_steps`` > 0) ``checkpoint.keep_last`` deletes nothing: the checkpoint from before the streak stays."""
        path = os.path.join(ckpt.checkpoint_root(self.cfg.output_dir), f"step_{step}")
        if self.saved_step == step:
            return path, False
        path = self._write(step, parts, feed, bad_steps, 0 if bad_steps else self.cfg.checkpoint.keep_last)
        self.saved_step = step
        return path, True

    def _write(self, step: int, parts: StepParts, feed, bad_steps: int, keep_last: int, name: str | None = None,
               extra: dict | None = None) -> str:
        sharded = is_sharded(parts.bare)
        model = full_model_state(parts.bare) if sharded else parts.bare  # FSDP2: gathered on rank 0 (collective)
        # checkpoint.trainable_only: the trained parameters and buffers alone (mtl/checkpoint/trainable.py)
        kept = trainable.kept_names(parts.bare) if trainable.trainable_only(self.cfg) else None
        if kept is not None:
            model = trainable.keep(model if isinstance(model, dict) else model.state_dict(), kept)
        return ckpt.save_checkpoint(self.cfg.output_dir, step, model, self.trainer_state(step, parts, feed, bad_steps),
                                    to_yaml(self.cfg), self.dist.rank, keep_last, {**self.files, **(extra or {})},
                                    sharded=sharded_state(parts.bare, parts.weighting, parts.optimizer, kept), name=name)

    def evaluated(self, step: int, metrics: dict, parts: StepParts, feed, bad_steps: int = 0) -> tuple[dict | None,
                                                                                                        list[str]]:
        """Every rank, after a recorded evaluation: the watches count it (mtl/run/best.py), rank 0's decision holds on
        every rank, and an improved ``checkpoint.best_metric`` writes ``checkpoints/best/`` (collective). Returns
        (why the run stops early, or None; lines to log)."""
        due, notes = self.watch.evaluated(step, metrics, last=self.is_last(step))
        due, self.watch.stopped = broadcast_object((due, self.watch.stopped))  # one decision on every rank
        if due:
            best = self.watch.best
            path = self._write(step, parts, feed, bad_steps, 0, ckpt.BEST_DIR, {BEST_FILE: self.watch.best_file()})
            notes.insert(0, f"step {step}: best checkpoint {path} ({best.metric}={best.value:.4f})")
        return self.watch.stopped, notes

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
        trainable.refuse_other_base(state.get("base"), cfg, f"the checkpoint {path!r}")  # its base: the same weights
        rng = ckpt.load_model_and_optimizer(path, state, parts.bare, parts.weighting, parts.optimizer, self.dist.rank)
        try:
            parts.scheduler.load_state_dict(state["scheduler"])
            parts.amp.load_state_dict(state["scaler"])
            parts.weighting.load_state_dict(state["weighting"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path!r} does not fit this run's optimizer/weighting: {e}") from None
        notes += schedule_change(cfg, path, parts.scheduler, int(state["step"]))
        if not state.get("data") and "epoch" in state:  # v1: batches per rank, at its own batch size
            state = {**state, "data": data_position(state["epoch"], state["batch_in_epoch"],
                                                    saved_config(path)["data"]["batch_size"],
                                                    int(state.get("world_size") or 1))}
        notes += feed.load_state_dict(state)
        self.resumed_bad_steps = int(state.get("bad_steps") or 0)  # so the streak ends where it would have
        best_held = os.path.isdir(os.path.join(ckpt.checkpoint_root(cfg.output_dir), ckpt.BEST_DIR))
        notes += self.watch.load_state_dict(state.get("watch"), broadcast_object(best_held))  # rank 0's view
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


def schedule_change(cfg, checkpoint: str, scheduler, step: int) -> list[str]:
    """A resume with another ``trainer.max_steps`` under a schedule that ends there (cosine, linear): the new schedule
    holds from the resumed ``step`` on (the next step's learning rate is the new schedule's at ``step``, set here;
    it was the old one's), and one line says so: the old and new end step, and the rate at ``step`` on both."""
    kind, new_end = cfg.optim.scheduler, int(cfg.trainer.max_steps)
    old_end = (saved_config(checkpoint).get("trainer") or {}).get("max_steps")
    if kind not in ("cosine", "linear") or old_end is None or int(old_end) == new_end:
        return []
    was = scheduler.get_last_lr()[0]
    rates = [base * rule(step) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() (the step log's lr) reports until the next step
    return [f"resume: trainer.max_steps changed from {old_end} to {new_end}: the {kind} learning-rate schedule now "
            f"ends at step {new_end} instead of {old_end}, from the resumed step {step} on: the learning rate at step "
            f"{step} is {rates[0]:.4g} (it was {was:.4g} on the old schedule)"]


def refuse_linked_checkpoints(output_dir: str) -> None:
    """overwrite=true does not delete through a symbolic link ``output_dir/checkpoints``: the checkpoints it points
    to may be another folder's (a ConfigError naming the link, its target and the fix)."""
    root = ckpt.checkpoint_root(output_dir)
    if os.path.islink(root):
        raise ConfigError(f"overwrite: {root!r} is a symbolic link (to {os.readlink(root)!r}): overwrite=true deletes "
                          "what an earlier run wrote in output_dir and does not follow a link into another folder. "
                          f"Delete those checkpoints yourself and remove the link (rm {root}), or choose another "
                          "output_dir")


def start_over(output_dir: str) -> list[str]:
    """overwrite=true: delete what an earlier run wrote in ``output_dir`` (RUN_FILES only; other files stay; a
    linked ``checkpoints`` is refused, ``refuse_linked_checkpoints``; any other link is removed, never followed)."""
    refuse_linked_checkpoints(output_dir)
    trash = os.path.join(output_dir, ".checkpoints.deleting")  # left by a start-over that was killed
    if os.path.islink(trash):
        os.unlink(trash)
    shutil.rmtree(trash, ignore_errors=True)
    found = [n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]
    if not found:
        return []
    steps = [os.path.basename(p) for _, p in ckpt.list_checkpoints(output_dir)]
    root = ckpt.checkpoint_root(output_dir)
    if os.path.isdir(root):  # one rename: no half-deleted set of checkpoints is ever visible
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


def new_run_id() -> str:
    return uuid.uuid4().hex


def folder_run_id(output_dir: str) -> str | None:
    """The id ``output_dir/run.json`` names (the run that last started there), or None."""
    try:
        with open(os.path.join(output_dir, RUN_ID_FILE), encoding="utf-8") as f:
            run_id = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def in_checkpoint_root(path: str, output_dir: str) -> bool:
    """Whether checkpoint ``path`` is one of ``output_dir``'s own (``output_dir/checkpoints/step_<N>``), links
    followed: a link in that folder to another folder's checkpoint is the other folder's."""
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(ckpt.checkpoint_root(output_dir))


def own_checkpoint(output_dir: str, step: int) -> str | None:
    """``output_dir``'s own checkpoint of ``step`` (not a link out of its checkpoints folder), or None."""
    for held, path in ckpt.list_checkpoints(output_dir):
        if held == step and in_checkpoint_root(path, output_dir):
            return path
    return None


def folder_files(folder: str) -> dict[str, bytes]:
    """{name: bytes} of the files directly in ``folder`` (no sub-folders, no ``.tmp`` leftovers)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not name.endswith(".tmp"):
            with open(path, "rb") as f:
                files[name] = f.read()
    return files


def tokenizer_from_files(files: dict[str, bytes]) -> CaptionTokenizer:
    """A tokenizer from its folder's files (``folder_files``), through a private temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        return CaptionTokenizer.load(folder)


def write_changed(folder: str, files: dict[str, bytes]) -> list[str]:
    """Write each of ``files`` into ``folder`` whose bytes there differ (atomically); return their names."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for name, data in files.items():
        target = os.path.join(folder, name)
        try:
            with open(target, "rb") as f:
                same = f.read() == data
        except FileNotFoundError:
            same = False
        if not same:
            write_atomic(target, data)
            written.append(name)
    return written
