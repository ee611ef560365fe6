"""A checkpoint is data: what a load path reads from one is checked, and nothing in it runs.

In-process: a checkpoint with sharded state written as the trainer writes it, then tampered with as an attacker
would (the manifest refreshed, since it is a checksum, not a signature)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mtl.checkpoint import folder as ckpt
from mtl.checkpoint import train_state as ts
from mtl.errors import CheckpointError

from .test_checkpoint import config, decide, to_yaml


def _parts(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    weighting = torch.nn.Module()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    return net, weighting, opt


def save_sharded(out, step, tamper_state=None):
    """A checkpoint with ``state/`` (``mtl.checkpoint.train_state``); ``tamper_state(state)`` may edit the sharded state first."""
    net, weighting, opt = _parts(step)
    state = ts.sharded_state(net, weighting, opt)
    if tamper_state:
        tamper_state(state)
    trainer_state = {"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1}
    return ckpt.save_checkpoint(str(out), step, net, trainer_state, to_yaml(config(out)), 0, sharded=state)


def refresh_manifest(path):
    """What an attacker does after editing a file: the manifest is a checksum, not a signature."""
    with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
        json.dump(ckpt._manifest(path), f)


class Evil:
    """Pickles as a call of os.system: what a crafted checkpoint holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_index_is_refused_and_runs_nothing(tmp_path):
    good = save_sharded(tmp_path, 2)
    newest = save_sharded(tmp_path, 4)
    marker = tmp_path / "pwned"
    index = os.path.join(newest, ckpt.STATE_DIR, ".metadata")
    with open(index, "rb") as f:
        real = f.read()
    # os.system("touch marker"), its result dropped, then the real index: the load returns the real metadata
    crafted = b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR0" + real
    with open(index, "wb") as f:
        f.write(crafted)
    refresh_manifest(newest)
    import pickle

    assert pickle.loads(crafted).state_dict_metadata  # the fault: a plain unpickler returns the real index ...
    assert marker.exists()  # ... and runs the command
    marker.unlink()

    with pytest.raises(CheckpointError) as e:
        ckpt.verify_checkpoint(newest)
    assert e.value.exit_code == 4 and "os.system" in e.value.message and ".metadata" in e.value.message
    with pytest.raises(CheckpointError, match="os.system"):
        decide(tmp_path, f"resume={newest}")
    assert decide(tmp_path, "resume=auto") == good  # resume=auto skips it, naming why
    net, weighting, opt = _parts(9)
    with pytest.raises(CheckpointError, match="os.system"):  # the loader itself reads the index the same way
        ckpt.load_state(newest, net, weighting, opt)
    assert not marker.exists()


def test_a_crafted_value_in_the_sharded_state_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    def plant(state):
        state[ts.OPTIM]["param_groups"][0]["weight_decay"] = Evil(marker)

    path = save_sharded(tmp_path, 2, plant)
    assert not marker.exists()
    net, weighting, opt = _parts(9)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_state(path, net, weighting, opt)
    assert e.value.exit_code == 4 and "weight_decay is not plain data" in e.value.message
    assert not marker.exists()


def test_an_honest_sharded_checkpoint_still_loads(tmp_path):
    path = save_sharded(tmp_path, 2)
    ckpt.verify_checkpoint(path)
    net, weighting, opt = _parts(9)
    ckpt.load_state(path, net, weighting, opt)
    ref, _, ref_opt = _parts(2)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_a_shard_removed_from_the_folder_and_the_manifest_is_caught_and_skipped(tmp_path):
    """The index names every shard file; each must be in the manifest."""
    good = save_sharded(tmp_path, 2)
    newest = save_sharded(tmp_path, 4)
    shards = [n for n in os.listdir(os.path.join(newest, ckpt.STATE_DIR)) if n.endswith(".distcp")]
    assert shards == ["__0_0.distcp"]
    os.remove(os.path.join(newest, ckpt.STATE_DIR, shards[0]))
    refresh_manifest(newest)  # the manifest no longer lists it either
    with pytest.raises(CheckpointError) as e:
        ckpt.verify_checkpoint(newest)
    assert "state/__0_0.distcp, which state/.metadata refers to, is not in its manifest.json" in e.value.message
    assert decide(tmp_path, "resume=auto") == good


def _tensor_bytes_overwritten(data: bytes, folder: str) -> bytes:
    """The shard with the first bytes of its last stored item overwritten (a tensor's pickle: no longer readable)."""
    last = max(ts.read_metadata(folder).storage_data.values(), key=lambda info: info.offset)
    return data[:last.offset] + b"\xff" * 8 + data[last.offset + 8:]


@pytest.mark.parametrize("tamper, reason", [
    (lambda data, folder: data[:len(data) // 2], "has 20,502 bytes; its index (state/.metadata) refers to 41,004"),
    (_tensor_bytes_overwritten, "cannot be read (UnpicklingError: Weights only load failed)"),
])
def test_a_tampered_shard_is_one_line_naming_the_file(tmp_path, tamper, reason):
    """A shard file altered after the save (the manifest refreshed, so it verifies) used to be refused with DCP's
    whole traceback text inside the message; now one line names the file and what is wrong with it."""
    path = save_sharded(tmp_path, 2)
    folder = os.path.join(path, ckpt.STATE_DIR)
    shard = os.path.join(folder, "__0_0.distcp")
    with open(shard, "rb") as f:
        data = f.read()
    assert len(data) == 41_004  # the sizes the first case names
    with open(shard, "wb") as f:
        f.write(tamper(data, folder))
    refresh_manifest(path)
    ckpt.verify_checkpoint(path)  # the manifest cannot tell
    net, weighting, opt = _parts(9)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_state(path, net, weighting, opt)
    message = e.value.message
    assert e.value.exit_code == 4 and "\n" not in message and "Traceback" not in message and len(message) < 400
    assert f"checkpoint {path!r}: state/__0_0.distcp " in message and reason in message, message


def test_a_state_that_does_not_fit_is_one_line_naming_the_tensor(tmp_path):
    """The same for a checkpoint that is whole but of another model: DCP's own reason, without its traceback."""
    path = save_sharded(tmp_path, 2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 5))
    with pytest.raises(CheckpointError) as e:
        ckpt.load_state(path, net, torch.nn.Module(), torch.optim.AdamW(net.parameters()))
    message = e.value.message
    assert "\n" not in message and "Traceback" not in message, message
    assert "does not fit this run's model and optimizer (ValueError: Size mismatch between saved torch.Size([3, 8]) " \
           "and current: torch.Size([5, 8]) for model.1.weight)" in message
