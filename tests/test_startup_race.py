"""Start-up collectives do not depend on what one rank sees on disk: every rank meets every other rank at every
collective, whatever the tokenizer files look like to it.

A former ``build_tokenizer`` called its barrier only on a rank that did not yet see ``tokenizer.json``; a rank that
looked after rank 0 had written the file skipped the barrier and entered the next collective while rank 0 waited:
a deadlock. Today the run's tokenizer comes from ``RunFolder.tokenizer``: rank 0 looks, every rank takes the same
broadcast and loads the same bytes, or raises the same error. Checked here with 2 ranks, under a short
process-group timeout so that a deadlock fails the test in seconds: a fresh folder (both ranks get one tokenizer and
reach the next collective), and a damaged run copy that only rank 0 reads (both ranks raise the same error, and
neither hangs).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from .conftest import TINY, spawn_ranks

pytestmark = pytest.mark.slow
TIMEOUT_S = 15


def _worker(rank, port, out_dir, results):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch.distributed as tdist

    from mtl.parallel.dist import DistInfo, all_reduce_sum
    from mtl.run.run_folder import RunFolder
    from mtl.setup.checks import load_run_config

    torch.set_num_threads(1)
    damaged = os.path.isfile(os.path.join(out_dir, "tokenizer", "tokenizer.json"))
    cfg = load_run_config(TINY, [f"output_dir={out_dir}", "trainer.progress=false"]
                          + (["resume=auto"] if damaged else []))
    tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    folder = RunFolder(cfg, DistInfo(rank=rank, world_size=2, backend="gloo"))
    try:
        folder.lock()  # rank 0, as the trainer does first
        folder.prepare(commit=False)
        try:
            tok = folder.tokenizer(lambda: ["a red circle", "two blue squares"] * 10)
            outcome = ("ok", tok.vocab_size)
        except Exception as e:
            outcome = (type(e).__name__, str(e)[:300])
        total = all_reduce_sum(torch.tensor([float(rank + 1)]))  # the next collective, as DDP's set-up would be
        results.put((rank, *outcome, float(total)))
    except Exception as e:  # a deadlock shows as gloo's timeout error
        results.put((rank, "collective failed", f"{type(e).__name__}: {e}"[:300], None))
    finally:
        folder.close()
        tdist.destroy_process_group()


def test_every_rank_gets_the_same_tokenizer_and_reaches_the_next_collective(tmp_path):
    got = spawn_ranks(_worker, tmp_path / "run", TIMEOUT_S * 6)
    assert [got[r][0] for r in (0, 1)] == ["ok", "ok"], got
    assert got[0][1] == got[1][1] and [got[r][2] for r in (0, 1)] == [3.0, 3.0]


def test_a_damaged_run_tokenizer_is_one_error_on_every_rank_and_no_hang(tmp_path):
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.json").write_text("{ not json")  # the fault: only rank 0 reads it
    got = spawn_ranks(_worker, run, TIMEOUT_S * 6)
    assert got[0][0] == got[1][0] != "ok" and got[0][1] == got[1][1], got
    assert "tokenizer" in got[0][1] and [got[r][2] for r in (0, 1)] == [3.0, 3.0], got
