"""Start-up collectives do not depend on what one rank sees on disk: a rank that sees the tokenizer late or early
still meets every other rank at every collective.

``build_tokenizer`` used to call its barrier only on a rank that did not yet see ``tokenizer.json``. A rank
that looked after rank 0 had written the file skipped the barrier and entered the next collective (DDP's
start-up parameter check) while rank 0 still waited in the barrier: a deadlock, then an opaque gloo error.

The race is forced here rather than hoped for: rank 1 waits until rank 0 has written the file, checks that
it sees it (the fault's precondition really holds), and only then calls ``build_tokenizer``. Both ranks
then run the same collectives the trainer runs next; each must complete with the right values, under a
short process-group timeout so that a deadlock fails the test in seconds, not minutes.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch

from .conftest import TINY, spawn_ranks

pytestmark = pytest.mark.slow
TIMEOUT_S = 15


def _worker(rank, port, out_dir, results):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch.distributed as tdist

    from mtl.build import build_tokenizer
    from mtl.config.checks import load_run_config
    from mtl.parallel.dist import DistInfo, all_reduce_sum

    torch.set_num_threads(1)
    cfg = load_run_config(TINY, [f"output_dir={out_dir}", "trainer.progress=false"])
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    info = DistInfo(rank=rank, world_size=2, backend="gloo")
    target = os.path.join(out_dir, "tokenizer", "tokenizer.json")
    saw_file = None
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.isfile(target) and time.monotonic() < deadline:
            time.sleep(0.01)
        saw_file = os.path.isfile(target)
    try:
        tok = build_tokenizer(cfg, lambda: ["a red circle", "two blue squares"] * 10, info)
        total = all_reduce_sum(torch.tensor([float(rank + 1)]))  # the next collective, as DDP's set-up would be
        marker = [None, None]
        tdist.all_gather_object(marker, f"after-tokenizer-{rank}")
        results.put((rank, "ok", saw_file, float(total), marker, tok.vocab_size))
    except Exception as e:  # the deadlock shows as gloo's timeout error
        results.put((rank, "error", saw_file, f"{type(e).__name__}: {e}"[:300], None, None))
    finally:
        tdist.destroy_process_group()


def test_a_rank_that_sees_the_tokenizer_file_still_takes_the_barrier(tmp_path):
    got = spawn_ranks(_worker, tmp_path, TIMEOUT_S * 6)
    assert got[1][1] is True, "rank 1 never saw rank 0's tokenizer.json: the race was not forced"
    for rank in (0, 1):
        status, _, total, marker, vocab = got[rank]
        assert status == "ok", f"rank {rank} failed after build_tokenizer: {total}"
        assert total == 3.0
        assert marker == ["after-tokenizer-0", "after-tokenizer-1"]
    assert got[0][4] == got[1][4]
