"""Which rank stopped answering: a heartbeat per rank in the launcher's key-value store.

A rank that is stopped (SIGSTOP, a frozen node), or whose machine is lost, leaves its peers waiting in a
collective until ``ddp.timeout_s`` (600 s by default), after which torch raises an error that names no rank
("Timed out waiting 600000ms for recv operation"). So every rank runs a thread that, every ``PERIOD_S``, writes a
counter, its step and its last saved step to the store (and at once after each step). A stopped process's threads stop with it, while a rank
that merely waits in a collective keeps beating: the rank whose counter no longer moves is the one that did not
answer.

- While the job runs, rank 0 watches every rank's beat and rank 1 watches rank 0's; a beat that has not moved
  for ``warn_after_s`` (half of ``ddp.timeout_s``, at most 60 s) is named in one warning line, well before the
  collective times out.
- When a collective does time out, :func:`lost_peer` turns the error into one TrainingError naming the rank(s)
  whose beat stopped, their last step and the last checkpoint saved (the same text on every survivor, so it is
  printed once).

The store is the one torchrun's agent (or rank 0, without torchrun) serves at ``MASTER_ADDR:MASTER_PORT``; each
thread has a client of its own, and a store that cannot be reached only turns the heartbeat off.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time

from mtl.errors import TrainingError
from mtl.run.console import say

PERIOD_S = 2.0
TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)

_current: Heartbeat | None = None


def _client():
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.warn_after_s = min(timeout_s / 2, 60.0)
        self.step, self.saved = 0, None  # updated by the trainer (plain attribute writes: atomic in Python)
        self._prefix = f"mtl/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._count = 0
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._written = threading.Condition()
        self._stored: tuple[int, int | None] | None = None  # the (step, saved) the store has from this rank
        self._thread = threading.Thread(target=self._run, name="mtl-heartbeat", daemon=True)
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (its last beat, when this rank saw it change)
        self._warned: set[int] = set()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=PERIOD_S + 1)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            store = _client()
        except Exception:
            return  # no store to beat into: the job runs without heartbeats
        watched = range(self.world_size) if self.rank == 0 else [0] if self.rank == 1 else []
        last_watch = time.monotonic()
        while not self._closed.is_set():
            self._count += 1
            try:
                step, saved = self.step, self.saved
                store.set(self._key(self.rank), f"{self._count} {step} {saved}")
                with self._written:
                    self._stored = (step, saved)
                    self._written.notify_all()
                if time.monotonic() - last_watch >= PERIOD_S:
                    last_watch = time.monotonic()
                    for r in watched:
                        if r != self.rank:
                            self._watch(r, _read(store, self._key(r)))
            except Exception:
                pass  # a slow or restarting store: try again next beat
            self._wake.wait(PERIOD_S)  # a beat every PERIOD_S, and one at once after each step (progress)
            self._wake.clear()

    def _watch(self, rank: int, beat: str | None) -> None:
        now = time.monotonic()
        if beat is None:
            return
        last = self._seen.get(rank)
        if last is None or last[0] != beat:
            self._seen[rank] = (beat, now)
            self._warned.discard(rank)
            return
        silent = now - last[1]
        if silent >= self.warn_after_s and rank not in self._warned:
            self._warned.add(rank)
            _, step, saved = beat.split()
            say(f"[rank {self.rank}] warning: rank {rank} has not answered for {silent:.0f} s (stopped, hung or "
                f"its machine lost; its last heartbeat was at step {step}, the last checkpoint saved is "
                f"{_saved(saved)}); the job fails at ddp.timeout_s={self.timeout_s:g} s unless it comes back")

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    # ------------------------------------------------------------------ after a timeout

    def stalled(self) -> list[tuple[int, str, str]] | None:
        """(rank, its last step, its last saved step) of every other rank whose beat does not move over two
        periods, read with a client of this thread's own; None if the store cannot be read."""
        try:
            store = _client()
            before = {r: _read(store, self._key(r)) for r in range(self.world_size) if r != self.rank}
            time.sleep(2 * PERIOD_S + 0.5)
            after = {r: _read(store, self._key(r)) for r in before}
        except Exception:
            return None
        return [(r, *(after[r] or "0 ? None").split()[1:]) for r in before if after[r] == before[r]]


def _read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _saved(saved: str) -> str:
    return "none" if saved in (None, "None") else f"step_{saved}"


def start(rank: int, world_size: int, timeout_s: float) -> Heartbeat | None:
    """Start this process's heartbeat (several processes only, under a store at MASTER_ADDR:MASTER_PORT)."""
    global _current
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    _current = Heartbeat(rank, world_size, timeout_s).start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def progress(step: int, saved: int | None = None) -> None:
    """The trainer's step (and, after a save, the saved step) for the next beat."""
    if _current is not None:
        _current.step = step
        if saved is not None:
            _current.saved = saved
        _current._wake.set()


def flush(timeout_s: float = 5.0) -> bool:
    """Wait (at most ``timeout_s``) until the store has this rank's current step; whether it does. For
    ``trainer.poison``'s ``stop``, so the peers can name the step the frozen rank reached (a real freeze may come
    between a step and its beat: its peers then name the step before)."""
    hb = _current
    if hb is None:
        return False
    with hb._written:
        return hb._written.wait_for(lambda: hb._stored == (hb.step, hb.saved), timeout=timeout_s)


def lost_peer(error: BaseException) -> TrainingError | None:
    """A collective that timed out, as one TrainingError naming the rank(s) that did not answer; else None."""
    hb = _current
    if hb is None or not isinstance(error, RuntimeError) or not TIMEOUT_TEXT.search(str(error)):
        return None
    stalled = hb.stalled()
    timeout = f"ddp.timeout_s={hb.timeout_s:g} s"
    if stalled is None:
        return TrainingError(f"a collective timed out after {timeout}, and the job's key-value store at "
                             f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} no longer answers "
                             "either: the process or machine that hosts it (rank 0 without torchrun) has stopped or "
                             "is lost. Restart the job; resume=auto continues from the newest complete checkpoint")
    if not stalled:
        return TrainingError(f"a collective timed out after {timeout} and every rank's heartbeat still moves (a rank "
                             "slower than the timeout, or a network problem); raise ddp.timeout_s if a step or a save "
                             "really takes that long. resume=auto continues from the last complete checkpoint")
    who = "; ".join(f"rank {r} (its last heartbeat at step {step}, its last checkpoint {_saved(saved)})"
                    for r, step, saved in stalled)
    return TrainingError(f"a collective timed out after {timeout}: {who} did not answer (stopped, hung or its machine "
                         "lost). Restart the job; resume=auto continues from the newest complete checkpoint")
