"""The model and optimizer state of a checkpoint, sharded: ``torch.distributed.checkpoint`` (DCP).

``get_model_state_dict`` / ``get_optimizer_state_dict`` give each rank its part under either engine: under
FSDP2 its DTensor shards, under DDP (and in one process) the full tensors, which DCP writes once (deduplicated
over the ranks). Every rank writes its own file (``state/__<rank>_0.distcp``) and rank 0 the index
(``state/.metadata``): one writer per rank; under FSDP2 no rank gathers the whole optimizer state.

DCP stores every tensor with its global shape and each shard's offset, so a load can fill any layout: a
checkpoint written by W processes under one engine loads into W' processes under the other (2 -> 1, 1 -> 2,
DDP <-> FSDP2); each rank reads the parts it needs. Optimizer state is keyed by parameter name
(``model.backbone...``, ``weighting...``), never by position.

A checkpoint is data: DCP pickles its index (``state/.metadata``) and the non-tensor values of the state (the
optimizer's hyperparameters), and its own reader unpickles both with no restriction, so a crafted file could run
code. Here the index is read by :func:`read_metadata`, whose unpickler admits only the classes a DCP index is made
of (refusing anything else by name), and the values load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import warnings

import torch
from torch import nn

from mtl.errors import CheckpointError
from mtl.files import free_bytes
from mtl.parallel.fsdp import Owner  # the modules whose parameters the optimizer holds, for parameter names

MODEL, OPTIM = "model", "optim"


def _owner(model: nn.Module, weighting: nn.Module) -> nn.Module:
    return Owner(model, weighting)


def _no_dist() -> bool:
    import torch.distributed as tdist

    return not (tdist.is_available() and tdist.is_initialized())


@contextlib.contextmanager
def _quiet():
    """DCP warns that it 'assumes a single process' in every 1-process save and load: that is what it should do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def sharded_state(model: nn.Module, weighting: nn.Module, optimizer, kept: set[str] | None = None) -> dict:
    """This rank's part of the model and optimizer state (tensors shared with the live ones: no copy). An
    optimizer that has not stepped yet is saved with no per-parameter state, as it is (DCP's getter would
    otherwise fill it in with a zero-learning-rate step, which is not the state of this run)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    fresh = not optimizer.state
    optim = get_optimizer_state_dict(_owner(model, weighting), optimizer)
    if fresh:
        optimizer.state.clear()
        optim["state"] = {}
    state = get_model_state_dict(model)
    if kept is not None:  # checkpoint.trainable_only: the trained parameters and buffers alone
        state = {k: v for k, v in state.items() if k in kept}
    return {MODEL: state, OPTIM: optim}


def write_sharded(folder: str, state: dict) -> None:
    """Collective: every rank writes its part of ``state`` into ``folder``. A failed write on any rank is an
    OSError on every rank (DCP gathers the failures), naming the file where DCP says which."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
    free = free_bytes(folder)  # measured before the write: after a short one the disk is full ("0 free")
    try:
        with _quiet():
            dcp.save(state, storage_writer=writer, no_dist=_no_dist())
    except (CheckpointException, RuntimeError) as e:
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())] if isinstance(e, CheckpointException) else [e]
        for exc in failures:
            if isinstance(exc, OSError):
                if exc.filename is None:
                    exc.filename = folder
                raise exc from None
        # torch's writer reports a short write (a full disk) as a RuntimeError ("unexpected pos ..."): ask the disk
        needed, now = _tensor_bytes(state), free_bytes(folder)
        if free is not None and now is not None and min(free, now) < needed:
            raise OSError(errno.ENOSPC, f"no space left on device ({needed:,} bytes to write here, {free:,} free)",
                          folder) from None
        first = failures[0] if failures else e
        raise OSError(errno.EIO, f"torch.distributed.checkpoint failed: {type(first).__name__}: {first}",
                      folder) from None


def _tensor_bytes(tree) -> int:
    """The bytes of this rank's part of every tensor in ``tree`` (what its file holds, give or take the index)."""
    if torch.is_tensor(tree):
        t = tree.to_local() if hasattr(tree, "to_local") else tree
        return t.numel() * t.element_size()
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return sum(_tensor_bytes(v) for v in values)


# what a DCP index is made of: its own dataclasses, torch.Size and dtypes, the layout helper, the folder's path
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_INDEX_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Admits only the globals of a DCP index (``_INDEX_GLOBALS``, the metadata module's classes, torch dtypes)."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as md

        if (module, name) in _INDEX_GLOBALS or (module == _METADATA_MODULE and (name in md.__all__
                                                                                 or name == "_MEM_FORMAT_ENCODING")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(folder: str):
    """The DCP index of ``folder`` (``.metadata``), read through :class:`_IndexUnpickler`; a CheckpointError naming
    the file if it holds anything a DCP index never holds (a crafted file: nothing in it is run) or is unreadable."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        # no fix here: each caller says its own (resume=<path>: point resume elsewhere; resume=auto: skipped; a tool)
        raise CheckpointError(f"{path!r} refers to {e}, which a checkpoint index never holds: refused unread (a "
                              "crafted or corrupt file; loading it could run code)") from None
    except Exception as e:
        raise CheckpointError(f"{path!r} cannot be read ({type(e).__name__}): it is truncated or corrupt") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path!r} is not a checkpoint index (it holds a {type(metadata).__name__})")
    return metadata


def _safe_reader(folder: str):
    """DCP's file reader, reading its index through :func:`read_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank index files: mtl writes one index only
                raise CheckpointError(f"{folder!r}: a per-rank checkpoint index was asked for; mtl writes one")
            metadata = read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def _safe_planner(folder: str):
    """DCP's load planner, loading the non-tensor values with ``weights_only=True`` (DCP's own uses False)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise CheckpointError(f"{folder!r}: the saved value of {read_item.dest_index.fqn} is not plain data "
                                      "(a crafted or corrupt file; loading it could run code): refused unloaded. "
                                      "Point resume at another checkpoint") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


def load_failure(folder: str, error: BaseException) -> str:
    """One line for a failed DCP load of ``folder`` (DCP's own message holds every rank's traceback text): a shard
    file shorter than its index says, a shard that cannot be read, or a state that does not fit this run; each
    names the file or the tensor, and what is wrong."""
    where = f"checkpoint {os.path.dirname(folder.rstrip(os.sep))!r}: {os.path.basename(folder.rstrip(os.sep))}"
    files = _referred_sizes(folder)
    for name, needed in sorted(files.items()):
        size = os.path.getsize(os.path.join(folder, name)) if os.path.isfile(os.path.join(folder, name)) else 0
        if size < needed:
            return (f"{where}/{name} has {size:,} bytes; its index ({os.path.basename(folder)}/.metadata) refers to "
                    f"{needed:,}: the file is truncated or was altered after the save. Point resume at another "
                    "checkpoint")
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, its stack)}
    cause, stack = sorted(failures.items())[0][1] if failures else (error, ())
    reason = f"{type(cause).__name__}: {_first_sentence(cause)}"
    if any(frame.name == "read_data" for frame in stack or ()):  # raised reading a shard, not fitting the state
        which = (f"{where}/{next(iter(files))}" if len(files) == 1 else
                 f"{where}: one of {', '.join(sorted(files))}")
        return (f"{which} cannot be read ({reason}): the file is corrupt or was altered after the save. Point resume "
                "at another checkpoint")
    return (f"checkpoint {folder!r} does not fit this run's model and optimizer ({reason}). Was it written with "
            "another model or optimizer config?")


def _referred_sizes(folder: str) -> dict[str, int]:
    """{shard file: the bytes its index's entries reach} for the files ``folder``'s index refers to ({} if unread)."""
    try:
        storage = read_metadata(folder).storage_data or {}
    except CheckpointError:
        return {}
    sizes: dict[str, int] = {}
    for info in storage.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


def _first_sentence(error: BaseException) -> str:
    """The first sentence of an exception's message, on one line (torch's carry paragraphs of advice)."""
    text = " ".join(str(error).split("\n")[0].split())
    return text.split(". ")[0].rstrip(".")[:300]


def saved_keys(folder: str) -> set[str]:
    """The flattened keys in a DCP folder's index (``optim.state.<parameter>.<name>`` ...)."""
    return set(read_metadata(folder).state_dict_metadata)


def load_sharded(folder: str, model: nn.Module, weighting: nn.Module, optimizer) -> None:
    """Collective: fill the model and optimizer from ``folder``, whatever world size and engine wrote it.

    The live state is the template DCP fills (each rank's shards, or the full tensors); a parameter the saved
    optimizer holds no state for (it had not stepped) gets none here either, as in the run that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = saved_keys(folder)
    owner = _owner(model, weighting)
    # a fresh optimizer's template: DCP's getter fills in its per-parameter state (a zero-learning-rate step)
    state = {MODEL: get_model_state_dict(model), OPTIM: get_optimizer_state_dict(owner, optimizer)}
    stepped = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith(f"{OPTIM}.state.")}
    state[OPTIM]["state"] = {p: v for p, v in state[OPTIM]["state"].items() if p in stepped}
    partial = _trainable_only(state, keys, model)
    with _quiet():
        dcp.load(state, storage_reader=_safe_reader(folder), planner=_safe_planner(folder), no_dist=_no_dist())
    set_model_state_dict(model, state[MODEL], options=StateDictOptions(strict=not partial))
    # strict=False: a parameter without saved state (it had not stepped) is left without state, not refused
    set_optimizer_state_dict(owner, optimizer, state[OPTIM], options=StateDictOptions(strict=False))


def _trainable_only(state: dict, keys: set[str], model: nn.Module) -> bool:
    """A checkpoint.trainable_only checkpoint (its model state lacks frozen parameters only): drop those from the
    template, so that they keep the base's values; True if it is one. A trained parameter missing is refused."""
    missing = [k for k in state[MODEL] if f"{MODEL}.{k}" not in keys]
    if not missing:
        return False
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    lost = [k for k in missing if k in trained]
    if lost:
        raise CheckpointError(f"the checkpoint's state lacks trained parameters ({', '.join(lost[:3])}); it was written "
                              "by another model. Resume from a checkpoint of this run's model")
    state[MODEL] = {k: v for k, v in state[MODEL].items() if k not in missing}
    return True
