"""One sweep per ``output_dir``: while a sweep trains it holds ``output_dir/run.lock``, the run's own lock
(mtl/run/runlock.py), so a second sweep (or a ``train.py``) on that folder is refused at once, naming the holder's
PID, host and start; a lock left by a sweep that died is taken over as a run's is (docs/reliability.md).

Two sweeps on one folder each removed the runs the other was training and recorded every run twice, once failed."""

from __future__ import annotations

import contextlib
import os

from mtl.errors import ConfigError
from mtl.run.runlock import LockHeld, RunLock


@contextlib.contextmanager
def sweep_lock(output_dir: str):
    """Hold ``output_dir``'s lock for the ``with`` block; ConfigError (exit 2) when another process holds it or the
    folder cannot be written. A stale lock taken over is said on stdout."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        lock = RunLock.acquire(output_dir)
    except LockHeld as e:
        raise ConfigError(f"{e} (a benchmark sweep holds this lock while it trains: one sweep per "
                          "output_dir)") from None
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write {e.filename or output_dir!r}: {e.strerror or e}. Choose a "
                          "writable output_dir") from None
    if lock.note:
        print(f"bench: {lock.note}", flush=True)
    try:
        yield lock
    finally:
        lock.release()
