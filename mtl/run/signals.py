"""Stop signals during training: SIGTERM/SIGUSR1 (Slurm, torchrun), Ctrl-C (SIGINT), and a job torn down.

- The first SIGTERM, SIGUSR1 or SIGINT asks for a stop: every rank finishes the step in flight, the ranks
  agree through the step's own collective, a checkpoint is written, and the process exits: 0 after
  SIGTERM/SIGUSR1 (a preempted job that saved is not a failure; torchrun and Slurm's requeue rely on it),
  130 after Ctrl-C (the usual code of an interrupted command, so ``train.py && next`` does not go on).
- A second Ctrl-C aborts at once, without saving.
- After a stop signal, when another worker of this job on this machine has died, or the launcher that
  started this process is gone, the launcher is tearing the job down (torchrun sends SIGTERM to the
  survivors when one worker fails) and no checkpoint can be agreed any more. The process then exits
  at once instead of waiting in a collective for a peer that will never come, or for torchrun's
  SIGKILL 30 s later.

Python runs signal handlers only between bytecodes of the main thread, so a main thread blocked in a
collective would never see them. The handler's wake-up byte goes to a watcher thread, which acts at once.

Before training (``start_up_guard``, around train.py's ``main``, installed before anything slow is imported): no
step has been taken, so there is nothing to save. The first stop signal ends the run at once: ``StartupStop``
unwinds the start-up (the run folder's cleanup releases ``output_dir/run.lock``), one line names the signal and the
phase it arrived in, and the exit code is 128 + the signal (143 for SIGTERM, 138 for SIGUSR1, 130 for Ctrl-C): not
0, since nothing was trained, so ``train.py && next`` stops, and torchrun sees a failed worker (it tears the group
down, or restarts it under ``--max-restarts``) instead of a worker that claims to have finished. Slurm's requeue of a
preempted job does not depend on the code. After training (``finishing``) a stop signal is ignored: the run is
ending by itself, its final checkpoint saved.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import socket
import sys
import threading
import time

from mtl.run import error_report, faults
from mtl.run.console import say

STOP = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
POLL_S = 0.25
GRACE_S = 2.0  # a peer that exits normally (after the last barrier) leaves this rank this long to finish


_active: list = []  # the installed StopSignals of this process, if any
_phase = "start-up"  # what the run is doing now (enter_phase): a stop signal's message names it


def enter_phase(phase: str) -> None:
    """The run begins ``phase`` (start-up, build, step, evaluation, sample figure, save, finishing), which a stop
    signal's message names. Tests make the run send itself SIGTERM here (``faults.signal_at``)."""
    global _phase
    _phase = phase
    faults.signal_at(phase)


def phase() -> str:
    return _phase


STARTING = ("start-up", "build")  # the phases before training: a stop signal ends the run at once


class StartupStop(BaseException):
    """A stop signal before training (see the module docstring). A BaseException, as KeyboardInterrupt is, so that
    no ``except Exception`` on its way out swallows it; every ``finally`` and cleanup on the way runs."""

    def __init__(self, signum: int, phase: str):
        self.signum, self.phase, self.exit_code = signum, phase, 128 + signum
        where = "start-up, before output_dir was locked" if phase == "start-up" else f"start-up ({phase})"
        self.message = (f"{signal.Signals(signum).name} during {where}: no step taken, nothing to save; exiting with "
                        f"code {self.exit_code}" + ("" if phase == "start-up" else ", output_dir's lock released"))
        super().__init__(self.message)


def start_up_guard(main):
    """``main`` (train.py's) with stop signals handled from its first line on: before training they raise
    ``StartupStop``, which becomes one line and the exit code 128 + the signal; the trainer's ``StopSignals`` takes
    over for training. The previous handlers are back when ``main`` returns."""

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
            return main(*args, **kwargs)
        got: list[int] = []

        def handler(signum, _frame):
            if got:  # one stop at a time: the start-up's cleanup is not interrupted again
                return
            got.append(signum)
            if _phase in STARTING:
                raise StartupStop(signum, _phase)

        enter_phase("start-up")
        previous = {sig: signal.signal(sig, handler) for sig in STOP}
        try:
            return main(*args, **kwargs)
        except StartupStop as stop:
            error_report.say(stop.message)
            return stop.exit_code
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
            enter_phase("start-up")  # the next run in this process (tests) starts from the beginning

    return guarded


def keep_exit_code(code: int) -> None:
    """From now on a stop signal ends this process with ``code`` (its own error's exit code) at once, instead of
    killing it: under torchrun, once a rank has failed the others exit and torchrun sends SIGTERM to whoever is left,
    which can be the failed rank itself, still tearing down. Killed, it would show as -15 and hide its code. For
    train.py's ``__main__`` only: in a process that goes on (a test), it would end that process."""

    def end(_signum, _frame):
        _flush_std()
        os._exit(code)

    for sig in STOP:
        signal.signal(sig, end)


def exit_process(code: int):
    """End this process with ``code`` as the interpreter's own exit would, without its last part: non-daemon threads
    are joined, the atexit handlers run (trackers, loader workers, temporary folders, weakref finalizers), logging
    and the standard streams are flushed; then ``os._exit``. What is skipped is the teardown of every module and
    object one by one, which takes over a second once torch, torchvision and transformers are imported
    (``python -c "import torch, torchvision, transformers.models.gpt2"``: 4.3 s, 3.3 s with ``os._exit(0)`` at its
    end), paid by every process of every run. For the ``__main__`` of train.py and mtl.tools.launch only (a test that runs
    a tool in its own process, through runpy, replaces it: tests/test_tool_exit_codes.py)."""
    import atexit
    import logging

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    _flush_std()
    os._exit(code or 0)  # main's None is 0, as sys.exit(None) is


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not wake this process's watcher with its own signals:
    Ctrl-C reaches every process of the terminal's group, and N workers would look like N more Ctrl-Cs."""
    if _active:
        _active.clear()
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class StopSignals:
    """Installed by the trainer for the length of ``train()`` (main thread only)."""

    def __init__(self, rank: int = 0, world_size: int = 1, peers: list | None = None, on_request=None,
                 under_launcher: bool = False):
        self.rank, self.world_size = rank, world_size
        self.on_request = on_request  # called in the main thread when a stop is asked for
        self.signum: int | None = None  # the first stop signal this rank got
        self.phase: str | None = None  # the phase of the run it arrived in (enter_phase)
        self.done = False  # set once the stop checkpoint is written, or training ended: nothing left to protect
        host = socket.gethostname()
        self._local_peers = [(r, pid) for r, (h, pid) in enumerate(peers or []) if h == host and r != rank]
        self._ppid = os.getppid() if under_launcher else None
        self._sigints = 0
        self._stop_at: float | None = None
        self._closed = threading.Event()
        self._previous: dict = {}
        self._previous_fd = -1
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ main thread

    def install(self) -> StopSignals:
        self._pair = socket.socketpair()
        for s in self._pair:
            s.setblocking(False)
        self._previous = {sig: signal.signal(sig, self._handler) for sig in STOP}
        self._previous_fd = signal.set_wakeup_fd(self._pair[1].fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="mtl-stop-signals", daemon=True)
        self._thread.start()
        _active.append(self)
        return self

    def uninstall(self) -> None:
        if self in _active:
            _active.remove(self)
        self.done = True
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for s in self._pair or ():
            s.close()

    def _handler(self, signum, _frame) -> None:
        if self.on_request is not None:
            self.on_request()
        if self.signum is None:
            self.signum, self.phase = signum, _phase

    @property
    def interrupted(self) -> bool:
        return self.signum == signal.SIGINT

    def describe(self, step: int) -> str:
        """The first stop signal and when it came, ``step``: the steps done then, e.g. "SIGTERM, during the
        evaluation at step 30" (a peer's signal, agreed through the step: "from another rank")."""
        if self.signum is None:
            return "from another rank"
        when = f"during step {step + 1}" if self.phase == "step" else f"during the {self.phase} at step {step}"
        return f"{signal.Signals(self.signum).name}, {when}"

    # ------------------------------------------------------------------ watcher thread

    def _watch(self) -> None:
        reader = self._pair[0]
        while not self._closed.is_set():
            ready, _, _ = select.select([reader], [], [], POLL_S)
            if ready:
                try:
                    data = reader.recv(64)
                except (BlockingIOError, OSError):
                    data = b""
                for signum in data:
                    self._on_signal(signum)
            if self._stop_at is not None and not self.done:
                gone = self._torn_down()
                if gone:
                    deadline = time.monotonic() + GRACE_S
                    while not self.done and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if not self.done:
                        self._exit(128 + (self.signum or signal.SIGTERM),
                                   f"{gone} while stopping: exiting now without a checkpoint; resume=auto continues "
                                   "from the last complete one")

    def _on_signal(self, signum: int) -> None:
        if signum not in STOP:
            return
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        if signum != signal.SIGINT:
            return
        self._sigints += 1
        if self._sigints >= 2:
            self._exit(130, "second Ctrl-C: aborting at once, without a checkpoint; resume=auto continues from "
                            "the last complete one")
        elif self.rank == 0:
            self._say("Ctrl-C: finishing this step, then saving a checkpoint and exiting (Ctrl-C again aborts at "
                      "once, without saving)")

    def _torn_down(self) -> str | None:
        """Why the job is being torn down (a local peer died, the launcher is gone), or None."""
        for r, pid in self._local_peers:
            if not alive(pid):
                return f"rank {r} (pid {pid}) is gone"
        if self._ppid is not None and os.getppid() != self._ppid:
            return "the launcher is gone"
        return None

    def _say(self, message: str) -> None:
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        say(f"{prefix}{message}")

    def _exit(self, code: int, message: str) -> None:
        self._say(message)
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(code)
