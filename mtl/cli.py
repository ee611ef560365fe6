"""Turn user-facing errors into one message and an exit code, instead of a traceback per rank."""

from __future__ import annotations

import os
import sys

from mtl.errors import MTLError


def run_guarded(fn) -> int:
    try:
        fn()
    except MTLError as e:
        # Config and data errors are the same on every rank: rank 0 speaks for all of them.
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or getattr(e, "rank_specific", False):
            prefix = f"[rank {rank}] " if os.environ.get("WORLD_SIZE", "1") != "1" and rank != 0 else ""
            print(f"{prefix}error: {e.message}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
