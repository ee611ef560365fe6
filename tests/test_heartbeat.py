"""The heartbeat that names a rank which stopped answering (mtl/run/heartbeat.py), in-process against a real TCPStore:
one rank beats, one is frozen. The real SIGSTOP through train.py: tests/test_reliability.py."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import TCPStore

from mtl.run import heartbeat

from .conftest import free_port


@pytest.fixture
def store(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield master
    heartbeat.stop()


def test_a_timeout_names_the_rank_whose_beat_stopped_and_its_last_checkpoint(store, monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "PERIOD_S", 0.2)
    hb = heartbeat.start(0, 3, timeout_s=1.0)  # warns after 0.5 s of silence
    heartbeat.progress(5, saved=4)
    store.set("mtl/heartbeat/0/2", "7 3 2")  # rank 2: frozen since its step 3, after the save at step 2
    done = threading.Event()

    def beat():  # rank 1: alive, waiting in the collective like rank 0
        n = 0
        while not done.is_set():
            n += 1
            store.set("mtl/heartbeat/0/1", f"{n} 5 4")
            done.wait(0.05)

    threading.Thread(target=beat, daemon=True).start()
    try:
        import time

        time.sleep(1.5)
        assert heartbeat.lost_peer(ValueError("Timed out")) is None  # not a collective's error
        assert heartbeat.lost_peer(RuntimeError("Connection reset by peer")) is None  # not a timeout
        error = heartbeat.lost_peer(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete"))
    finally:
        done.set()
    warned = capsys.readouterr().err
    assert "[rank 0] warning: rank 2 has not answered for" in warned and "rank 1" not in warned
    assert "its last heartbeat was at step 3, the last checkpoint saved is step_2" in warned
    assert error is not None and error.exit_code == 5
    assert ("a collective timed out after ddp.timeout_s=1 s: rank 2 (its last heartbeat at step 3, its last "
            "checkpoint step_2) did not answer") in error.message and "rank 1" not in error.message
    assert store.get("mtl/heartbeat/0/0").decode().split()[1:] == ["5", "4"]  # this rank's own beat
    assert hb is heartbeat._current


def test_one_process_or_no_store_runs_without_a_heartbeat(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert heartbeat.start(0, 2, 10) is None and heartbeat.start(0, 1, 10) is None
    assert heartbeat.lost_peer(RuntimeError("Timed out waiting")) is None
