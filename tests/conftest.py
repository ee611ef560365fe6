import os
import subprocess
import sys

import pytest

from mtl.parallel.dist import free_port  # noqa: F401  (the tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TINY = os.path.join(ROOT, "configs", "tiny.yaml")

# keep every process to one thread: the suite runs several processes on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are selected by name (``-m gpu``, ``-m "not gpu"``) and skipped, with the reason, on a
    machine without a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def spawn_env(index: int, port: int) -> int:
    """For a spawned parity worker: index 0 and 1 become the two ranks of a process group (torchrun's
    variables), index 2 the single process (no process group). Returns the world size."""
    world = 2 if index < 2 else 1
    os.environ["OMP_NUM_THREADS"] = "1"
    if world > 1:
        os.environ.update({"RANK": str(index), "WORLD_SIZE": "2", "LOCAL_RANK": str(index),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    else:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key, None)
    return world


def join_spawned(worker, args: tuple, nprocs: int, deadline_s: float, what: str) -> None:
    """Run ``worker(index, *args)`` in ``nprocs`` spawned processes until all end; a failed worker fails at once (the
    others are terminated), and past ``deadline_s`` every worker is killed and this raises, naming ``what``."""
    import time

    import torch.multiprocessing as mp

    deadline = time.monotonic() + deadline_s
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn", join=False)
    try:
        while not ctx.join(timeout=0.5):  # raises if a worker failed (and terminates the others)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} workers still running after {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_spawn(worker, out_dir, deadline_s: float, what: str) -> None:
    """Run ``worker(index, port, out_dir)`` in three spawned processes (see ``spawn_env``: two ranks and a single
    process), as ``join_spawned`` does."""
    join_spawned(worker, (free_port(), str(out_dir)), 3, deadline_s, what)


def end_state(trainer, **extra) -> dict:
    """What a parity test compares after a run's steps: the model's state (cloned), the weighting method's state and
    weights, and ``extra``. Closes the trainer."""
    out = {"model": {k: v.detach().clone() for k, v in trainer.bare.state_dict().items()},
           "weighting": trainer.weighting.state_dict(), "weights": trainer.weighting.weights(), **extra}
    trainer.close()
    return out


def copy_outside(example: str, tmp_path, name: str) -> str:
    """A plug-in file (``example``) copied to ``tmp_path/plugins/<name>``, where no mtl code is: the file alone must
    be enough. Returns its path."""
    import shutil

    path = tmp_path / "plugins" / name
    path.parent.mkdir(exist_ok=True)
    shutil.copy(example, path)
    return str(path)


def example_outside(example: str, name: str):
    """A fixture: docs/examples/<example> copied outside the package as ``name`` (``copy_outside``); its path."""

    @pytest.fixture
    def fixture(tmp_path) -> str:
        return copy_outside(os.path.join(ROOT, "docs", "examples", example), tmp_path, name)

    return fixture


def spawn_ranks(target, folder, timeout_s: float, world: int = 2) -> dict:
    """Run ``target(rank, port, folder, results)`` in ``world`` spawned processes (a free port for their process
    group); each puts one ``(rank, *result)`` on the ``results`` queue. Returns {rank: result}; a rank that reports
    nothing within ``timeout_s`` fails the test (queue.Empty), and every process is ended before this returns."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, str(folder), results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, *rest = results.get(timeout=timeout_s)
            got[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def parity_worker(run, index: int, port: int, out_dir: str) -> None:
    """A spawned worker of a 2-processes-equal-1-process test, given to ``spawn_parity_runs`` as
    ``functools.partial(parity_worker, run)``: index 0 and 1 are the two ranks, 2 the single process (``spawn_env``),
    one thread each. Saves what ``run(world, out_dir)`` returns as ``<who>.pt``; the process group ends in any case."""
    import torch

    from mtl.parallel import dist

    world = spawn_env(index, port)
    torch.set_num_threads(1)
    try:
        torch.save(run(world, out_dir), os.path.join(out_dir, f"rank{index}.pt" if world > 1 else "single.pt"))
    finally:
        dist.destroy()


def spawn_parity_runs(worker, tmp_path_factory, name: str, deadline_s: float, what: str) -> dict:
    """``run_spawn`` in a fresh folder ``name``, then what each worker saved there as ``<who>.pt``: the
    {"rank0", "rank1", "single"} results a 2-processes-equal-1-process test compares."""
    import torch

    out = tmp_path_factory.mktemp(name)
    run_spawn(worker, out, deadline_s, what)
    return {who: torch.load(out / f"{who}.pt", weights_only=False) for who in ("rank0", "rank1", "single")}


def run_train(args: list[str], nproc: int = 1, timeout: int = 300, env: dict | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """Run the real train.py, in one process or under torchrun with gloo (no fixed ports)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [PY, os.path.join(ROOT, "train.py"), *args]
    else:
        cmd = [PY, "-m", "mtl.tools.launch", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(ROOT, "train.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def tiny():
    return TINY


def make_collate(tok, max_tokens: int = 16, tasks=("cls", "gen", "count")):
    """The loaders' collate for ``tasks`` (each task makes its own batch fields), captions cut at ``max_tokens``."""
    from omegaconf import OmegaConf

    from mtl.config.schema import Config
    from mtl.setup.build import build_collate

    cfg = OmegaConf.structured(Config)
    cfg.tasks = list(tasks)
    cfg.task_options = {"gen": {"max_tokens": max_tokens}} if "gen" in tasks else {}
    return build_collate(cfg, 4, ["a", "b", "c", "d"], tok)
