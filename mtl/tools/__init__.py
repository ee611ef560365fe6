"""Command-line tools over the core (``mtl.inference``): evaluate, predict and export a trained model.

Each tool is thin: it parses its arguments, calls the core, writes its output, and turns user errors
into one message and an exit code through ``mtl.run.error_report.run_guarded`` (2 config/option, 3 data, 4 checkpoint).
An output file is checked before the work begins (``verify_out``) and written atomically after it (``write_out``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from mtl.errors import ConfigError, DataError
from mtl.files import free_bytes, write_atomic

MODEL_HELP = ("a checkpoint folder (output_dir/checkpoints/step_<N>, or checkpoints/best), an export folder "
              "(mtl.tools.export), a run's output_dir (its newest checkpoint) or output_dir@best (its best checkpoint: "
              "checkpoint.best_metric)")
TRUST_HELP = ("import the plug-in code the model folder carries (task_modules/, backbone_modules/, ...), which runs "
              "it: only for a folder you trust. Without it such a folder is refused (exit 2, each file named with its "
              "SHA-256) unless each file is identical to the one at its recorded path here (your own run's code)")


def verify_out(path: str, needed: int, option: str = "--out") -> int | None:
    """Before any work: ``path`` can be written (not a folder; a file can be made where it goes, whose missing
    folders can be made) and its file system has ``needed`` bytes free. Otherwise one ConfigError naming the
    option (exit 2: choose another one), with nothing computed or written. Returns the free bytes (None if unknown),
    for ``write_out``'s message."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ConfigError(f"{option}: {path!r} is a folder; name a file")
    if os.path.lexists(target) and not os.path.isfile(target):
        raise ConfigError(f"{option}: {path!r} exists and is not a regular file; name a new file or a regular one")
    existing = os.path.dirname(target)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{option}: cannot write {path!r}: {existing!r} is not a folder; choose another {option}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mtl-write-check.", dir=existing)  # what the write will need
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{option}: cannot write {path!r}: {e.strerror or e} (in {existing!r}); choose another "
                          f"{option}") from None
    free = free_bytes(existing)
    if free is not None and free < needed:
        raise ConfigError(f"{option}: {existing!r} has {free:,} bytes free, and {path!r} needs about {needed:,}; "
                          f"free space or choose another {option} (nothing was computed or written)")
    return free


def write_out(path: str, text: str, option: str = "--out", free: int | None = None) -> None:
    """Write ``text`` to ``path`` atomically (``mtl.files.write_atomic``: never a 0-byte or partial file, and a file
    already there stays whole; missing folders are made). A failure (the disk filled up while the tool worked) is
    an I/O error, not a bad option: one DataError (exit 3) naming the file, the cause, the bytes it needed and
    ``free``, the bytes free before the work began (``verify_out``)."""
    data = text.encode("utf-8")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        # import here: torch (under mtl.run) loads only when a write has failed, so --help answers at once
        from mtl.checkpoint.folder import describe_os_error

        room = f" ({len(data):,} bytes to write, {free:,} free before the work began)" if free is not None else ""
        raise DataError(f"cannot write {option} {path!r}: {describe_os_error(e)}{room}; it was left as it "
                        f"was (no partial file). Free space or choose another {option}") from None


def tool_parser(module: str, doc: str, config: str | None = None, overrides: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``: the first line of the tool's docstring ``doc`` as its
    description and the rest as its epilog (as written); with ``config``, a ``--config`` option with that default;
    with ``overrides`` (its help), the trailing ``key=value`` config overrides."""
    lines = doc.strip().splitlines()
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=lines[0], epilog="\n".join(lines[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if config is not None:
        parser.add_argument("--config", default=config, help=f"the run's config (default: {config})")
    if overrides is not None:
        parser.add_argument("overrides", nargs="*", help=overrides)
    return parser
