"""Console lines that keep the progress bar whole.

The run's progress bar (``trainer.progress``, drawn by rank 0's ``RunLogger``) is registered here while it is on
screen. A line from anywhere else in the process (the heartbeat's thread, the signal handler's warnings) goes
through ``say``: with a bar, the bar is cleared, the line written and flushed, and the bar drawn again below it;
without one, a plain line. So a warning is never glued to, or overdrawn by, a redrawn bar.
"""

from __future__ import annotations

import sys

_bar = None  # the progress bar on screen in this process, or None


def show_bar(bar) -> None:
    """``bar`` (a tqdm) is on screen now (None: no bar)."""
    global _bar
    _bar = bar


def say(message: str, file=None) -> None:
    """One console line (default: stderr), printed through the bar when one is on screen."""
    file = file or sys.stderr
    bar = _bar
    if bar is None:
        print(message, file=file, flush=True)
        return
    with bar.external_write_mode(file=file):
        file.write(message + "\n")
        file.flush()
