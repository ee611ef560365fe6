"""Checkpoints: ``output_dir/checkpoints/step_<N>/``.

- ``model.safetensors``: the bare model's state dict (no DDP prefix), readable with
  ``safetensors.torch.load_file``;
- ``trainer_state.pt``: optimizer, scheduler, GradScaler, weighting method, step, epoch and the
  position in the epoch;
- ``rng_rank<r>.pt``: every RNG of rank r (Python, NumPy, torch, CUDA);
- ``config.yaml``: the resolved config of the run that wrote it.

A write is atomic: every file goes into ``.step_<N>.tmp/`` and rank 0 renames the folder once all
ranks have written their part. A folder named ``step_<N>`` is therefore always complete.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mtl.dist import barrier
from mtl.errors import CheckpointError

FORMAT = "mtl-checkpoint-v1"
STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, "trainer_state.pt")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


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


def bare_state_dict(model: torch.nn.Module) -> dict:
    # safetensors refuses tensors that share memory (GPT-2 ties lm_head to wte): save copies
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(output_dir: str, step: int, model: torch.nn.Module, trainer_state: dict, config_yaml: str,
                    rank: int, keep_last: int = 0) -> str:
    """Every rank calls this (collective); returns the final path."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".step_{step}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        save_file(bare_state_dict(model), os.path.join(tmp, "model.safetensors"), metadata={"format": FORMAT})
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        torch.save({"format": FORMAT, **trainer_state}, os.path.join(tmp, "trainer_state.pt"))
        if os.environ.get("MTL_TEST_SLOW_SAVE"):  # tests kill a run while it saves
            import time

            time.sleep(float(os.environ["MTL_TEST_SLOW_SAVE"]))
    barrier()
    if rank == 0:
        if os.path.isdir(final):  # re-saving the same step (e.g. the final step after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep_last > 0:
            for _, path in list_checkpoints(output_dir)[:-keep_last]:
                if path != final:
                    shutil.rmtree(path, ignore_errors=True)
    barrier()
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def read_trainer_state(path: str) -> dict:
    """The checkpoint's trainer state; a CheckpointError if the folder is incomplete, truncated or not ours."""
    for name in ("model.safetensors", "trainer_state.pt"):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {name} is missing. "
                                  "Point resume at another checkpoint, or use resume=auto")
    state_file = os.path.join(path, "trainer_state.pt")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {state_file!r} cannot be read ({type(e).__name__}); it is truncated or "
                              "not written by mtl. Point resume at another checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{state_file!r} is not an mtl checkpoint (format {FORMAT} expected)")
    return state


def load_checkpoint(path: str, model: torch.nn.Module, rank: int) -> tuple[dict, dict | None]:
    """Load the model weights in place; return (trainer_state, this rank's RNG state or None)."""
    trainer_state = read_trainer_state(path)
    model_file = os.path.join(path, "model.safetensors")
    try:
        weights = load_file(model_file)
    except Exception as e:
        raise CheckpointError(f"checkpoint {model_file!r} cannot be read ({e}); it is truncated or corrupt") from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {model_file!r} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}. Was it written with another model config?")
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    rng = None
    if os.path.isfile(rng_file):
        try:
            rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"{rng_file!r} cannot be read; the checkpoint is corrupt") from None
    return trainer_state, rng
