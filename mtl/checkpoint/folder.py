"""Checkpoints: ``output_dir/checkpoints/step_<N>/``.

- ``state/``: the model and optimizer state, sharded (``torch.distributed.checkpoint``: one file per
  rank and an index, ``mtl/checkpoint/train_state.py``); what a resume loads, on any world size and either engine;
- ``model.safetensors``: the full, unsharded model (gathered on rank 0 under FSDP2; no DDP prefix),
  for inference and export, readable with ``safetensors.torch.load_file``;
- ``trainer_state.pt``: scheduler, GradScaler, weighting method, step, the position in the data (in
  global samples: independent of the world size), the world size and engine that wrote it, the id of the run
  that wrote it (``run_id``: a resume never writes over another run's checkpoints, mtl/run/run_folder.py) and
  the non-finite streak at that step (``bad_steps``: a resume stops where the uninterrupted run would);
- ``rng_rank<r>.pt``: every RNG of rank r (Python, NumPy, torch, CUDA);
- ``config.yaml``: the resolved config of the run that wrote it;
- any extra files the trainer passes (``tokenizer/tokenizer.json``, ``class_names.json``);
- ``manifest.json``, written last: the size and SHA-256 of every other file.

A write is atomic: every file goes into ``.step_<N>.tmp/`` and rank 0 renames the folder once all
ranks have written their part. Re-saving a step that exists (a SIGTERM on a checkpoint step, a
resume with nothing left to do) first renames the old folder to ``.step_<N>.old`` and deletes it
only once the new one is in place; a run killed in between leaves that complete copy, which
:func:`recover` puts back. So at every moment a complete checkpoint is on disk.

A checkpoint is trusted only once :func:`verify_checkpoint` has checked its manifest: a missing,
truncated or bit-flipped file is refused by name, and ``resume=auto`` falls back past it
(:func:`find_resumable`). A failed write (full disk, read-only folder) is one CheckpointError naming
the path and the cause, on every rank; the half-written folder is removed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import yaml
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from mtl.checkpoint.finite import first_nonfinite
from mtl.checkpoint.train_state import load_failure, load_sharded, read_metadata, write_sharded
from mtl.config.yaml_read import SAVED_YAML_FIX, YamlRefusal, load_saved_yaml
from mtl.errors import CheckpointError, TrainingError
from mtl.files import sha256_file
from mtl.parallel.dist import all_gather_objects
from mtl.parallel.fsdp import is_sharded, load_full_model_state, load_full_optimizer_state

FORMAT = "mtl-checkpoint-v2"
# before sharded state: the optimizer in trainer_state.pt, the model only in model.safetensors (``load_checkpoint``)
LEGACY_FORMAT = "mtl-checkpoint-v1"
STATE_DIR = "state"  # the sharded model and optimizer state; its index file is STATE_DIR/.metadata
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
ASIDE_DIR = re.compile(r"^\.step_(\d+)\.old$")  # a complete checkpoint moved aside while its step is re-saved
# the best checkpoint by checkpoint.best_metric (mtl/run/best.py): no step_<N>, so resume=auto and pruning pass it over
BEST_DIR = "best"
CORE_FILES = ("model.safetensors", "trainer_state.pt", "config.yaml")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Published checkpoints, oldest first: every ``step_<N>`` folder (broken ones included: see
    :func:`verify_checkpoint`), and a ``.step_<N>.old`` copy whose ``step_<N>`` is missing (a re-save
    interrupted between its two renames)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    published, aside = {}, {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if m := STEP_DIR.match(name):
            published[int(m.group(1))] = path
        elif m := ASIDE_DIR.match(name):
            aside[int(m.group(1))] = path
    return sorted({**aside, **published}.items())


def checkpoint_run_id(path: str) -> str | None:
    """The id of the run that wrote the checkpoint (``trainer_state.pt``'s ``run_id``); None when it has none (written
    before mtl saved run ids) or cannot be read."""
    try:
        run_id = read_trainer_state(path).get("run_id")
    except CheckpointError:
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def recover(output_dir: str) -> list[str]:
    """Put back a checkpoint moved aside by an interrupted re-save; drop leftover copies. Rank 0, under
    the run lock. Returns one note per action."""
    root = checkpoint_root(output_dir)
    notes = []
    if not os.path.isdir(root):
        return notes
    for name in sorted(os.listdir(root)):
        m = ASIDE_DIR.match(name)
        if not m and name != f".{BEST_DIR}.old":
            continue
        kept = f"step_{m.group(1)}" if m else BEST_DIR
        aside, final = os.path.join(root, name), os.path.join(root, kept)
        if os.path.isdir(final):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)
            _fsync_dir(root)
            notes.append(f"restored {kept} from {name} (a re-save of that checkpoint was interrupted)")
    return notes


# ---------------------------------------------------------------------------------------------
# RNG and model state


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def bare_state_dict(model: torch.nn.Module | dict) -> dict:
    """The model's state dict (or an already gathered one: FSDP2's full state, mtl/parallel/fsdp.py) as CPU copies."""
    state = model if isinstance(model, dict) else model.state_dict()
    # safetensors refuses tensors that share memory (GPT-2 ties lm_head to wte): save copies
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# writing


def describe_os_error(e: OSError) -> str:
    """The cause in words a user acts on (what mtl's own writers add, such as the bytes a full disk lacked, kept)."""
    causes = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EROFS: "read-only file system", errno.EACCES: "permission denied (read-only folder?)",
              errno.EPERM: "permission denied (read-only folder?)"}
    if e.errno in causes and e.strerror and e.strerror.startswith(causes[e.errno]):
        return e.strerror
    return causes.get(e.errno, e.strerror or str(e))


class _Sink:
    """A file for torch.save that remembers the OSError behind torch's generic 'iostream error'."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self.f.flush()


def _write_file(path: str, fill) -> None:
    """Create ``path``, let ``fill(file)`` write it, and make it durable; an OSError names the file and why."""
    try:
        with open(path, "wb") as f:
            sink = _Sink(f)
            try:
                fill(sink)
            except RuntimeError:  # torch.save reports a failed write as a RuntimeError without its cause
                if sink.error is not None:
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = path
        raise


def _write_bytes(path: str, data: bytes) -> None:
    _write_file(path, lambda f: f.write(data))


def _torch_file(obj):
    return lambda f: torch.save(obj, f)


def _agree(error: str | None, tmp: str, rank: int, root: str) -> None:
    """A collective: every rank learns whether any rank failed; then all raise the same error and rank 0
    removes the half-written folder. (A rank that raised alone would leave its peers in a barrier.)"""
    errors = [e for e in all_gather_objects(error) if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(root)
        raise CheckpointError(errors[0])


def _attempt(what, path_of_error, rank: int) -> str | None:
    """Run ``what()``; an OSError becomes one message naming the path and the cause."""
    try:
        what()
    except OSError as e:
        where = e.filename or path_of_error
        who = f" (rank {rank})" if rank else ""
        return (f"cannot write checkpoint file {where}{who}: {describe_os_error(e)}. The half-written checkpoint "
                "was removed and the previous ones are intact; free space or make output_dir writable, then "
                "resume with resume=auto")
    return None


def _verify_extra_name(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm in (*CORE_FILES, MANIFEST) or norm.startswith("rng_rank"):
        raise ValueError(f"extra checkpoint file name {name!r} is not a free relative name")
    return norm


def save_checkpoint(output_dir: str, step: int, model: torch.nn.Module | dict, trainer_state: dict, config_yaml: str,
                    rank: int, keep_last: int = 0, extra_files: dict[str, bytes] | None = None,
                    sharded: dict | None = None, name: str | None = None) -> str:
    """Every rank calls this (collective); returns the final path.

    ``model``: the bare model, or its state dict already gathered (FSDP2; only rank 0's is written), for
    ``model.safetensors``. ``sharded``: this rank's part of the model and optimizer state
    (``mtl.checkpoint.train_state.sharded_state``), written by every rank into ``state/``; without it the checkpoint
    has no ``state/`` (the trainer always passes it).
    ``extra_files`` (rank 0's are used): small files to store too, ``{relative name: bytes}``, e.g.
    ``{"class_names.json": b"[...]"}``; sub-folders are allowed (``tokenizer/tokenizer.json``).
    ``name``: the folder's name instead of ``step_<step>`` (``BEST_DIR``), written and replaced the same way.
    """
    root = checkpoint_root(output_dir)
    folder_name = name or f"step_{step}"
    final, tmp = os.path.join(root, folder_name), os.path.join(root, f".{folder_name}.tmp")
    extra = {_verify_extra_name(k): v for k, v in (extra_files or {}).items()}
    _refuse_nonfinite(step, model, sharded, rank)

    def start():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    _agree(_attempt(start, tmp, rank) if rank == 0 else None, tmp, rank, root)

    if sharded is not None:
        trainer_state = {**trainer_state, "state": STATE_DIR}

    def write_parts():
        if sharded is not None:  # first: a collective, so every rank reaches it
            write_sharded(os.path.join(tmp, STATE_DIR), sharded)
        _write_file(os.path.join(tmp, f"rng_rank{rank}.pt"), _torch_file(rng_state()))
        if rank != 0:
            return
        _write_bytes(os.path.join(tmp, "model.safetensors"),
                     safetensors_bytes(bare_state_dict(model), metadata={"format": FORMAT}))
        _write_bytes(os.path.join(tmp, "config.yaml"), config_yaml.encode("utf-8"))
        _write_file(os.path.join(tmp, "trainer_state.pt"), _torch_file({"format": FORMAT, **trainer_state}))
        for name, data in extra.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            _write_bytes(os.path.join(tmp, name), data)
        if os.environ.get("MTL_TEST_SLOW_SAVE"):  # tests kill a run while it saves
            import time

            time.sleep(float(os.environ["MTL_TEST_SLOW_SAVE"]))

    _agree(_attempt(write_parts, tmp, rank), tmp, rank, root)

    def publish():
        write_manifest(tmp)
        _publish(tmp, final, root)
        if keep_last > 0:
            for _, path in list_checkpoints(output_dir)[:-keep_last]:
                if path != final:
                    shutil.rmtree(path, ignore_errors=True)

    _agree(_attempt(publish, tmp, rank) if rank == 0 else None, tmp, rank, root)
    return final


def _refuse_nonfinite(step: int, model, sharded: dict | None, rank: int) -> None:
    """A collective, before anything is written: a TrainingError on every rank if any rank's part of the model or
    optimizer state holds a NaN or inf (resume=auto must never pick up a diverged model). (A weighting method's
    state may hold NaN on purpose: ExcessMTL's normaliser of a task not yet seen.)"""
    if sharded is not None:  # this rank's part of the model and optimizer state (the full model under DDP)
        bad = first_nonfinite(sharded)
    else:
        bad = first_nonfinite({"model": model if isinstance(model, dict) else model.state_dict()}) if rank == 0 else None
    found = [(r, b) for r, b in enumerate(all_gather_objects(bad)) if b]
    if found:
        r, where = found[0]
        raise TrainingError(f"step {step}: the state to checkpoint holds non-finite values (rank {r}: {where}); the "
                            "checkpoint was not written, so resume=auto never picks a diverged model. Lower optim.lr "
                            "or set optim.grad_clip")


def _publish(tmp: str, final: str, root: str) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first and deleted only after."""
    aside = os.path.join(root, "." + os.path.basename(final) + ".old")
    if os.path.isdir(final):  # re-saving the same step (e.g. the final step after a resume)
        shutil.rmtree(aside, ignore_errors=True)  # a leftover of an earlier interrupted re-save
        os.rename(final, aside)
        try:
            os.replace(tmp, final)
        except OSError:
            os.rename(aside, final)  # the old one stays the checkpoint
            raise
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def write_manifest(folder: str) -> None:
    """``folder/manifest.json``: the size and SHA-256 of every other file in it (written last, made durable)."""
    _write_bytes(os.path.join(folder, MANIFEST), json.dumps(_manifest(folder), indent=1).encode("utf-8"))
    _fsync_dir(folder)


def _manifest(folder: str) -> dict:
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return {"format": FORMAT, "files": dict(sorted(files.items()))}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# checking and reading


def verify_manifest(path: str) -> dict[str, tuple[int, str]]:
    """Every file the folder's ``manifest.json`` lists is present with its size and SHA-256 (``verify_checkpoint``'s
    first part; an export folder's whole check): {relative name: (bytes, sha256)}, or a CheckpointError naming the
    file."""
    name = os.path.basename(path.rstrip(os.sep))
    manifest_file = os.path.join(path, MANIFEST)
    try:
        with open(manifest_file, encoding="utf-8") as f:
            files = json.load(f)["files"]
        listed = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in files.items()}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {name}: {MANIFEST} is missing (the save did not finish, or an mtl "
                              "without checksums wrote it)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"checkpoint {name}: {MANIFEST} is unreadable or truncated") from None
    for rel, (size, digest) in listed.items():
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise CheckpointError(f"checkpoint {name}: its {MANIFEST} names {rel!r}, outside the checkpoint")
        file = os.path.join(path, *rel.split("/"))
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {name}: {rel} is missing")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"checkpoint {name}: {rel} has {os.path.getsize(file)} bytes, {size} were "
                                  "written (truncated?)")
        if sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint {name}: {rel} does not match its SHA-256 checksum (corrupt)")
    return listed


def manifest_files(path: str) -> dict | None:
    """What the folder's ``manifest.json`` lists ({relative name: {"bytes", "sha256"}}), unchecked; None when it is
    missing or unreadable."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def same_checkpoint(a: str, b: str) -> bool:
    """Whether two checkpoint folders were written as one: their manifests list the same files with the same sizes
    and SHA-256 (a copy of a checkpoint, not another run's or another history's checkpoint of the same step)."""
    files = manifest_files(a)
    return files is not None and files == manifest_files(b)


def verify_checkpoint(path: str) -> dict:
    """The checkpoint's trainer state once every file is present and matches the manifest's digest;
    otherwise a CheckpointError whose message is the reason, naming the file."""
    name = os.path.basename(path.rstrip(os.sep))
    for core in CORE_FILES:
        if not os.path.isfile(os.path.join(path, core)):
            raise CheckpointError(f"checkpoint {name}: {core} is missing")
    listed = verify_manifest(path)
    try:
        state = read_trainer_state(path)
    except CheckpointError:
        raise CheckpointError(f"checkpoint {name}: trainer_state.pt cannot be read as an mtl trainer state") from None
    needed = [*CORE_FILES, *(f"rng_rank{r}.pt" for r in range(state.get("world_size") or 1))]
    if state.get("state"):
        if state["state"] != STATE_DIR:
            raise CheckpointError(f"checkpoint {name}: trainer_state.pt names the sharded state {state['state']!r}, "
                                  f"not {STATE_DIR!r}")
        needed.append(f"{STATE_DIR}/.metadata")
    for rel in needed:
        if rel not in listed:
            raise CheckpointError(f"checkpoint {name}: {rel} is not in its {MANIFEST}")
    if state.get("state"):
        _verify_index(path, name, listed)
    _verify_config(path, name)
    return state


def _verify_config(path: str, name: str) -> None:
    """The checkpoint's config.yaml reads as data mtl wrote (``mtl.config.yaml_read.load_saved_yaml``: no anchor, alias or
    repeated key), so no later reader of it can be made to expand a bomb: resume=auto passes over it."""
    try:
        with open(os.path.join(path, "config.yaml"), encoding="utf-8") as f:
            load_saved_yaml(f)
    except YamlRefusal as e:
        raise CheckpointError(f"checkpoint {name}: config.yaml, {e}: {SAVED_YAML_FIX}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"checkpoint {name}: config.yaml cannot be read as YAML ({type(e).__name__})") from None


def _verify_index(path: str, name: str, listed: dict) -> None:
    """The sharded state's index reads as data (``mtl.checkpoint.train_state.read_metadata``: a crafted one is refused unrun),
    and every file it refers to is in the manifest (so present and checked): a shard removed from both the folder
    and the manifest is caught here, not when the resume loads it."""
    try:
        metadata = read_metadata(os.path.join(path, STATE_DIR))
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {name}: {e.message}") from None
    referred = sorted({f"{STATE_DIR}/{info.relative_path}" for info in (metadata.storage_data or {}).values()})
    for rel in referred:
        if rel not in listed:
            raise CheckpointError(f"checkpoint {name}: {rel}, which {STATE_DIR}/.metadata refers to, is not in its "
                                  f"{MANIFEST} (removed?)")


def find_resumable(output_dir: str) -> tuple[str | None, list[str]]:
    """``resume=auto``'s one rule: the newest checkpoint that verifies, and one warning per newer one that
    does not (naming it and why). (None, []) when there is none yet; a CheckpointError when there are
    checkpoints but every one is broken (starting fresh would silently lose them)."""
    warnings, broken = [], []
    for _, path in reversed(list_checkpoints(output_dir)):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            warnings.append(f"resume=auto: skipping broken {e.message}")
            broken.append(e.message)
            continue
        return path, warnings
    if broken:
        raise CheckpointError(f"resume=auto: no complete checkpoint in {checkpoint_root(output_dir)!r}: "
                              + "; ".join(broken) + ". Delete the broken folders, or set overwrite=true to start over")
    return None, warnings


def read_trainer_state(path: str) -> dict:
    """The checkpoint's trainer state; a CheckpointError if the folder is incomplete, truncated or not ours."""
    for name in ("model.safetensors", "trainer_state.pt"):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {name} is missing. "
                                  "Point resume at another checkpoint")
    state_file = os.path.join(path, "trainer_state.pt")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {state_file!r} cannot be read ({type(e).__name__}); it is truncated or "
                              "not written by mtl. Point resume at another checkpoint") from None
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{state_file!r} is not an mtl checkpoint (format {FORMAT} expected)")
    return state


def load_checkpoint(path: str, model: torch.nn.Module, rank: int) -> tuple[dict, dict]:
    """Load the model weights from ``model.safetensors`` in place; return (trainer_state, this rank's RNG
    state). How an mtl-checkpoint-v1 checkpoint (no ``state/``) is resumed; a v2 one loads :func:`load_state`."""
    trainer_state = read_trainer_state(path)
    model_file = os.path.join(path, "model.safetensors")
    try:
        weights = load_file(model_file)
    except Exception as e:
        raise CheckpointError(f"checkpoint {model_file!r} cannot be read ({e}); it is truncated or corrupt") from None

    own = model.state_dict().keys()
    missing, unexpected = [k for k in own if k not in weights], [k for k in weights if k not in own]
    if not (missing or unexpected):
        if is_sharded(model):  # FSDP2: every rank reads the full file and keeps its shard
            load_full_model_state(model, weights)
        else:
            model.load_state_dict(weights)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {model_file!r} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}. Was it written with another model config?")
    return trainer_state, read_rng(path, rank)


def read_rng(path: str, rank: int) -> dict:
    """The RNG state ``rng_rank<rank>.pt`` holds."""
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.isfile(rng_file):  # without it the resumed run draws other random numbers: not exact
        raise CheckpointError(f"checkpoint {path!r}: {os.path.basename(rng_file)} is missing, so rank {rank}'s "
                              "random state cannot be restored and the resume would not be exact. Point resume at "
                              "another checkpoint")
    try:
        return torch.load(rng_file, map_location="cpu", weights_only=True)
    except Exception:
        raise CheckpointError(f"{rng_file!r} cannot be read; the checkpoint is corrupt") from None


def load_model_and_optimizer(path: str, trainer_state: dict, model: torch.nn.Module, weighting: torch.nn.Module,
                             optimizer, rank: int) -> dict:
    """Collective: the model and optimizer state into this run's layout; returns the RNG state this rank
    continues with (its own rank's; on a larger world size than the checkpoint's, rank 0's for the new
    ranks: a fresh run seeds every rank alike). An mtl-checkpoint-v1 checkpoint loads as it was written (the
    same world size and engine: ``mtl.setup.resume.reshard_problems`` refuses others)."""
    saved_world = int(trainer_state.get("world_size") or 1)
    if trainer_state.get("state"):
        load_state(path, model, weighting, optimizer)
        return read_rng(path, rank if rank < saved_world else 0)
    _, rng = load_checkpoint(path, model, rank)

    try:
        if is_sharded(model):  # a full, name-keyed optimizer state: each rank keeps its shard
            load_full_optimizer_state(model, weighting, optimizer, trainer_state["optimizer"])
        else:
            optimizer.load_state_dict(trainer_state["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path!r} does not fit this run's optimizer: {e}") from None
    return rng


def load_state(path: str, model: torch.nn.Module, weighting: torch.nn.Module, optimizer) -> None:
    """Collective: the model and optimizer state from the checkpoint's sharded ``state/``, into this run's layout
    (any world size, either engine)."""
    from torch.distributed.checkpoint.api import CheckpointException as DcpError  # a BaseException

    folder = os.path.join(path, STATE_DIR)
    try:
        load_sharded(folder, model, weighting, optimizer)
    except CheckpointError:
        raise
    except (Exception, DcpError) as e:  # DCP names the missing or misfitting key
        refused = [x for x, _ in getattr(e, "failures", {}).values() if isinstance(x, CheckpointError)]
        if refused:  # mtl.checkpoint.train_state refused a value that is not plain data
            raise CheckpointError(refused[0].message) from None
        raise CheckpointError(load_failure(folder, e)) from None  # one line: DCP's message holds tracebacks
