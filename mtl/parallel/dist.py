"""The process group, from torchrun's environment; plain ``python train.py`` runs as one process.

Backend ``auto`` is nccl when the run uses CUDA and gloo on the CPU. gloo has no ReduceOp.AVG, so
averages here are a sum and a division.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtl.errors import ConfigError


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this machine now, for a local process group's MASTER_PORT."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(cfg_device: str, local_rank: int) -> torch.device:
    if cfg_device == "cuda" or (cfg_device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was asked for but no CUDA device is visible; set device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg) -> DistInfo:
    """Start the process group when launched by torchrun (RANK and WORLD_SIZE set)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.device, local_rank)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=device)
    backend = cfg.ddp.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("ddp.backend: nccl needs CUDA devices; use ddp.backend=gloo (or auto) on the CPU")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.ddp.timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout, store=attempt_store(timeout),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(),
                    device=device, backend=backend)


def attempt_store(timeout: datetime.timedelta):
    """The process group's store, with a key prefix of its own per torchrun restart attempt.

    torchrun's agent hosts ONE TCPStore server for the whole job and hands it to every attempt's workers
    (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py keeps ``_shared_tcp_store_server`` across rounds),
    while ``init_process_group`` writes each rank's gloo/NCCL address under the same keys in every attempt. After
    an elastic restart a new rank could read the address its peer published in the PREVIOUS attempt, a dead
    process, and fail with "Gloo connectFullMesh failed ... Connection refused" (the slower its peer starts, the
    likelier; pytorch/pytorch#167288). A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) makes every key new.
    Outside torchrun's elastic agent: None (``init_process_group``'s own env:// store)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    delay = os.environ.get("MTL_TEST_RESTART_INIT_DELAY")  # tests: "rank:seconds", a slow peer after a restart
    if delay and int(attempt) > 0 and delay.split(":")[0] == os.environ["RANK"]:
        import time

        time.sleep(float(delay.split(":")[1]))
    return dist.PrefixStore(f"mtl/attempt_{attempt}/", store)


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        return all_reduce_sum(t) / dist.get_world_size()
    return t


def average_grads(params: list) -> None:
    """Average the gradients of parameters that DDP does not manage, in one collective."""
    params = [p for p in params if p.grad is not None]
    if not params or not (dist.is_available() and dist.is_initialized()):
        return
    flat = all_reduce_mean(torch.cat([p.grad.reshape(-1) for p in params]))
    for p, piece in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p))


class Comm:
    """The collectives a step strategy may call, handed to it in ``StepInputs.comm``.

    A strategy calls ``s.comm.all_reduce_mean(t)`` instead of importing a module function, so a tool or
    a test can count or inspect its communication by handing it another ``Comm`` (``CountingComm``)
    instead of patching a module.
    """

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(t)

    def start_all_reduce_mean_(self, t: torch.Tensor) -> Pending:
        """Start averaging ``t`` over the ranks IN PLACE, asynchronously; ``.wait()`` on the result finishes it.

        For a strategy that overlaps a reduction with the rest of its backward passes; ``t`` must not be
        read or written until the wait."""
        work = None
        if dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
        return Pending(work, t, self.world_size())


class Pending:
    """An in-place all-reduce under way (``Comm.start_all_reduce_mean_``)."""

    def __init__(self, work, t: torch.Tensor, world: int):
        self.work, self.t, self.world = work, t, world

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.t.div_(self.world)
            self.work = None
        return self.t


class CountingComm(Comm):
    """A ``Comm`` that counts its reductions and their bytes into ``counts['manual']`` / ``counts['bytes']``."""

    def __init__(self, counts: dict | None = None):
        self.counts = counts if counts is not None else {}

    def _count(self, t: torch.Tensor) -> None:
        self.counts["manual"] = self.counts.get("manual", 0) + 1
        self.counts["bytes"] = self.counts.get("bytes", 0) + t.numel() * t.element_size()

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return super().all_reduce_mean(t)

    def start_all_reduce_mean_(self, t: torch.Tensor) -> Pending:
        self._count(t)
        return super().start_all_reduce_mean_(t)


def all_gather_objects(obj) -> list:
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank: for decisions one rank takes (e.g. from what it sees on disk)
    that every rank must follow, so that all ranks take the same collective path."""
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return obj


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
