"""Small file-system helpers shared by the run's writers."""

from __future__ import annotations

import hashlib
import os
import shutil


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` atomically (a temporary file, fsync, rename): a reader sees the old file or the whole new
    one, and a failed write (e.g. a full disk) leaves no partial file behind. An OSError names the file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        e.filename = e.filename or tmp  # name the file in the message
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent); None if unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def sha256_file(path: str) -> str:
    """The SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
