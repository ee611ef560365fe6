"""Turn user-facing errors into one message and an exit code, instead of a traceback per rank.

Under torchrun every rank runs this. A failure that only one rank sees (a corrupt file of its own, a bad
image in its shard) is printed by that rank, prefixed with its rank; a failure every rank sees (a bad
config, a checkpoint that does not fit) is printed once, by whichever rank gets there first. The other
ranks then fail in a collective because a peer is gone: they say so in one line that points at the
cause, instead of a traceback.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys

from mtl.errors import MTLError

PEER_LOST = 1  # exit code of a rank that stopped because another rank failed first (secondary)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _first_to_say(message: str) -> bool:
    """True on the first rank of the job to report ``message`` (through the launcher's key-value store).

    Falls back to True (say it) when the store cannot be reached: a message twice beats none.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return True
    try:
        from torch.distributed import TCPStore

        store = TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=3),
                         wait_for_workers=False)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"mtl/said/{attempt}/{hashlib.sha1(message.encode()).hexdigest()}"
        return store.add(key, 1) == 1
    except Exception:
        return True


def say(message: str) -> None:
    """Print one line (or message) to stderr, prefixed with the rank when there are several."""
    rank, world = _rank()
    prefix = f"[rank {rank}] " if world > 1 else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


def peer_failure(error: BaseException) -> str | None:
    """The short reason when ``error`` is a collective failing because another rank is gone, else None."""
    if _rank()[1] <= 1:
        return None
    text = str(error)
    reason = next((p for p in PEER_GONE if p in text), None)
    if reason is None:
        try:
            from torch.distributed import DistBackendError
        except ImportError:  # pragma: no cover
            return None
        if not isinstance(error, DistBackendError):  # e.g. NCCL's watchdog after a peer died
            return None
        reason = (text.splitlines() or [type(error).__name__])[0][:120]
    return reason


def run_guarded(fn) -> int:
    try:
        fn()
    except MTLError as e:
        rank, world = _rank()
        if world == 1 or getattr(e, "rank_specific", False) or _first_to_say(e.message):
            say(f"error: {e.message}")
        return e.exit_code
    except KeyboardInterrupt:
        if _rank()[0] == 0:
            say("interrupted")
        return 130
    except Exception as e:
        reason = peer_failure(e)
        if reason is None:
            raise
        say(f"stopped: a collective failed ({reason}), most likely because another rank failed; that rank's own "
            "error, printed above or below, is the cause")
        return PEER_LOST
    return 0
