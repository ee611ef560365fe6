"""Reliability with real processes and real signals: exact resume after SIGKILL, a kill during a save,
SIGTERM, elastic restarts, non-finite steps, a crashing rank, and checkpoints that are not ours."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from .conftest import PY, ROOT, TINY, free_port, run_train
from .proctree import alive, children, kill_tree, state, tree
from .resume_check import Before, check_resume, metrics_records, snapshot

MULTI_INPUT = os.path.join(ROOT, "configs", "multi_input.yaml")
FAST = ["trainer.eval_every=1000", "trainer.eval_max_batches=1", "trainer.log_every=1", "checkpoint.every_steps=4",
        "resume=auto"]


def steps_logged(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip() and '"kind": "train"' in line]
    return max(steps, default=0)


def start(args, nproc=1, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [PY, os.path.join(ROOT, "train.py"), *args]
    else:
        cmd = [PY, "-m", "mtl.tools.launch", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", os.path.join(ROOT, "train.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_step(proc, run_dir, step, timeout=240):
    deadline = time.time() + timeout
    while steps_logged(run_dir) < step:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def kill_job(proc) -> list[int]:
    """SIGKILL the launcher and all its workers at once, as a lost node would; return the pids, all gone."""
    pids = kill_tree(proc.pid)
    proc.communicate(timeout=120)
    assert not any(alive(p) for p in pids)
    return pids


def resumed_from(stdout: str) -> int:
    """The step of the checkpoint a ``resume=auto`` run says it resumes from."""
    m = re.search(r"resuming from \S*step_(\d+)", stdout)
    assert m, stdout[-2000:]
    return int(m.group(1))


def model_bytes(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step_{step}", "model.safetensors"), "rb") as f:
        return f.read()


@pytest.mark.slow
@pytest.mark.parametrize("nproc, config, overrides", [
    # feature_leaf (one shared forward) at 1 and 2 processes: tests/test_chaos.py kills those 10 times
    # per-task forwards, in multi-input mode: each task's own sampler (its epochs roll over within the 10 steps,
    # gen's every 1-3 steps), per-sample mixing, so the ranks hold different numbers of each task's rows
    (2, MULTI_INPUT, ["ddp.strategy=find_unused", "data.sampling.policy=mixed", "data.per_task.gen.ratio=0.5",
                      "data.per_task.gen.train_size=15", "data.per_task.cls.train_size=40"]),
    (2, TINY, ["ddp.strategy=task_grads", "weighting.method=pcgrad"]),  # a gradient-level method
    # a bilevel method: its held-out stream (one global batch of 2 x 8: a new epoch every step) and its meta state
    (2, TINY, ["weighting.method=autolambda", "data.heldout=16"]),
    # an architecture with towers and task experts below its last level (mtl/architectures/ple.py), under MGDA
    (2, TINY, ["model.architecture.name=ple", "ddp.strategy=task_grads", "weighting.method=mgda"]),
], ids=["multi_input-find_unused", "task_grads-pcgrad", "bilevel-autolambda", "architecture-ple-mgda"])
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, nproc, config, overrides):
    args = ["--config", config, "trainer.max_steps=10", "model.decoder.dropout=0.1", *FAST, *overrides]
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    run_train([*args, f"output_dir={ref}"], nproc=nproc)
    proc = start([*args, f"output_dir={cut}"], nproc=nproc)
    wait_for_step(proc, cut, 5)  # past the step-4 checkpoint, before step 8's
    killed = kill_job(proc)
    assert len(killed) >= 1 + (nproc if nproc > 1 else 0)  # the launcher and every worker
    before = snapshot(cut)
    assert 0 < before.step < 10  # a real resume, from before the end
    run_train([*args, f"output_dir={cut}"], nproc=nproc)
    check_resume(cut, before, last_step=10)  # it went on from before.step: steps before.step + 1, ..., 10, once each
    assert model_bytes(ref, 10) == model_bytes(cut, 10)  # byte for byte


@pytest.mark.slow
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    args = ["--config", TINY, "trainer.max_steps=10", *FAST, f"output_dir={out}"]
    proc = start(args, env={"MTL_TEST_SLOW_SAVE": "30"})
    deadline = time.time() + 120
    while not os.path.isdir(os.path.join(out, "checkpoints", ".step_4.tmp", )) or not os.path.isfile(
            os.path.join(out, "checkpoints", ".step_4.tmp", "trainer_state.pt")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    kill_job(proc)
    assert not os.path.isdir(os.path.join(out, "checkpoints", "step_4"))  # never renamed: not complete
    # resume=auto must ignore the half-written save (and say so), start again, and finish
    done = run_train(args)
    assert "ignoring incomplete checkpoint(s) .step_4.tmp" in done.stdout
    assert "no checkpoint yet, starting fresh" in done.stdout
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_10"))


@pytest.mark.slow
def test_sigterm_checkpoints_within_a_step_and_exits_zero(tmp_path):
    out = str(tmp_path / "run")
    proc = start(["--config", TINY, "trainer.max_steps=500", *FAST, "checkpoint.every_steps=1000", f"output_dir={out}"],
                 nproc=2)
    wait_for_step(proc, out, 3)
    seen = steps_logged(out)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    for pid in workers:  # as Slurm's --signal does: the training processes get it
        os.kill(int(pid), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]  # the workers exited 0, so torchrun did too
    saved = sorted(int(n.split("_")[1]) for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_"))
    assert len(saved) == 1 and seen <= saved[0] <= seen + 3  # the step in flight, plus the one that agreed


def checkpoint_steps(run_dir) -> list[int]:
    root = os.path.join(run_dir, "checkpoints")
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []


def wait_for_file(proc, path, timeout=240):
    deadline = time.time() + timeout
    while not os.path.isfile(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    out = str(tmp_path / "run")
    args = ["--config", TINY, "trainer.max_steps=500", *FAST, "checkpoint.every_steps=1000", "data.num_workers=2",
            f"output_dir={out}"]
    proc = start(args)
    wait_for_step(proc, out, 3)
    seen = steps_logged(out)
    assert len(children(proc.pid)) >= 2  # the DataLoader workers
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: to every process of the group, loader workers too
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]  # interrupted, as a shell expects ...
    assert "Ctrl-C: finishing this step" in err and "Traceback" not in err
    saved = checkpoint_steps(out)
    assert len(saved) == 1 and seen <= saved[0] <= seen + 2  # ... but nothing lost: the step in flight is saved
    before = snapshot(out)
    assert before.step == saved[0]
    again = run_train(["--config", TINY, f"trainer.max_steps={saved[0] + 1}", *args[3:]])
    assert resumed_from(again.stdout) == saved[0]
    assert check_resume(out, before, last_step=saved[0] + 1) == [saved[0] + 1]  # the resumed run's one step


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    out = str(tmp_path / "run")
    proc = start(["--config", TINY, "trainer.max_steps=500", *FAST, "checkpoint.every_steps=1000", f"output_dir={out}"],
                 env={"MTL_TEST_SLOW_SAVE": "60"})
    wait_for_step(proc, out, 3)
    os.kill(proc.pid, signal.SIGINT)
    root = os.path.join(out, "checkpoints")
    deadline = time.time() + 120
    while not any(os.path.isfile(os.path.join(root, n, "trainer_state.pt"))
                  for n in (os.listdir(root) if os.path.isdir(root) else [])):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    # the first Ctrl-C's checkpoint is being written (and takes 60 s here): a second one must not wait for it
    tic = time.time()
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.time() - tic < 10, err[-3000:]
    assert "second Ctrl-C: aborting at once" in err
    assert checkpoint_steps(out) == []  # the save was abandoned; no complete checkpoint claims otherwise


def rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


@pytest.mark.slow
def test_a_survivor_exits_promptly_when_torchrun_tears_the_job_down(tmp_path):
    out = str(tmp_path / "run")
    proc = start(["--config", TINY, "trainer.max_steps=500", *FAST, "checkpoint.every_steps=2", f"output_dir={out}"],
                 nproc=2, env={"MTL_TEST_SLOW_SAVE": "60"})
    # rank 0 sleeps inside the step-2 save (its files written, before the barrier), rank 1 waits at the barrier
    wait_for_file(proc, os.path.join(out, "checkpoints", ".step_2.tmp", "trainer_state.pt"))
    workers = {rank_of(pid): pid for pid in children(proc.pid)}
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)  # a worker dies: torchrun sends SIGTERM to the survivor, SIGKILL 30 s later
    tic = time.time()
    while alive(workers[1]):
        assert time.time() - tic < 10
        time.sleep(0.02)
    while alive(workers[0]) and time.time() - tic < 60:
        time.sleep(0.05)
    took = time.time() - tic
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert took < 15, f"the survivor took {took:.0f} s to exit\n{err[-3000:]}"
    assert f"rank 1 (pid {workers[1]}) is gone" in err


@pytest.mark.slow
def test_elastic_restart_resumes_and_matches_an_uninterrupted_run(tmp_path):
    # torchrun's agent keeps one store server across restarts, so a restarted rank could read the address its peer
    # published in the previous attempt and fail with "Gloo connectFullMesh failed ... Connection refused"
    # (pytorch/pytorch#167288), more often the slower the peer starts. mtl.parallel.dist.attempt_store gives each attempt
    # its own key prefix. Here rank 1 of the restarted attempt starts 5 s late on purpose: without the prefix,
    # rank 0 reads rank 1's stale address at once and every restart fails (checked by removing the prefix).
    args = ["--config", TINY, "trainer.max_steps=10", *FAST, "ddp.timeout_s=30"]
    ref, el = str(tmp_path / "ref"), str(tmp_path / "elastic")
    run_train([*args, f"output_dir={ref}"], nproc=2)
    cmd = [PY, "-m", "mtl.tools.launch", "--nproc_per_node=2", "--max-restarts=4", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", os.path.join(ROOT, "train.py"), *args, f"output_dir={el}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                "MTL_TEST_RESTART_INIT_DELAY": "1:5"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(proc, el, 5)
    # step_4 was saved before step 5 ran, so a restart goes on from step 4 or later: the records up to step 4 stay
    before = Before(4, [r for r in metrics_records(el) if r["step"] <= 4])
    workers = subprocess.run(["pgrep", "-f", f"output_dir={el}"], capture_output=True, text=True).stdout.split()
    victim = max(int(p) for p in workers if int(p) != proc.pid)  # a worker, not the launcher
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    resumed = [int(m) for m in re.findall(r"resuming from \S*step_(\d+)", out)]
    assert resumed and all(step < 10 for step in resumed), out[-2000:]  # the restart really resumed mid-run
    # the first restart formed its group: two attempts started training (rank 0 prints one banner per attempt)
    assert len(re.findall(r"^mtl: 2 process\(es\) on", out, flags=re.M)) == 2, out[-3000:]
    check_resume(el, before, last_step=10)  # ... went on from its checkpoint, not from step 0
    assert model_bytes(ref, 10) == model_bytes(el, 10)


def optimizer_state(run_dir, step, tmp_path) -> dict:
    """The optimizer's per-parameter tensors in a checkpoint's sharded state (``state/``, torch.distributed.checkpoint),
    read back whole in this process (no process group), flattened to name -> tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from mtl.checkpoint.train_state import OPTIM

    whole = str(tmp_path / f"state_{step}.pt")
    dcp_to_torch_save(os.path.join(run_dir, "checkpoints", f"step_{step}", "state"), whole)
    flat = {}

    def walk(obj, prefix):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}")
        elif torch.is_tensor(obj):
            flat[prefix] = obj

    walk(torch.load(whole, weights_only=False)[OPTIM]["state"], "state")
    return flat


@pytest.mark.slow
def test_a_nan_in_one_task_on_one_rank_skips_the_step_everywhere(tmp_path):
    out = str(tmp_path / "run")
    # no periodic save inside a non-finite streak: step 3's checkpoint is the run's final one, then step 4 resumes it
    args = ["--config", TINY, *FAST, "checkpoint.every_steps=1", "trainer.poison=3:gen:1", f"output_dir={out}"]
    run_train([*args, "trainer.max_steps=3"], nproc=2)
    run_train([*args, "trainer.max_steps=4", "resume=auto"], nproc=2)
    assert model_bytes(out, 2) == model_bytes(out, 3)  # step 3 changed no parameter, bitwise
    s2, s3, s4 = (optimizer_state(out, step, tmp_path) for step in (2, 3, 4))  # nor any optimizer state
    assert s2 and s2.keys() == s3.keys() == s4.keys()
    assert all(torch.equal(s2[k], s3[k]) for k in s2)
    assert not all(torch.equal(s3[k], s4[k]) for k in s3)  # (a step that is taken does change it)
    assert model_bytes(out, 3) != model_bytes(out, 4)  # and training went on
    with open(os.path.join(out, "metrics.jsonl")) as f:
        bad = [json.loads(line) for line in f if '"bad_step"' in line]
    assert len(bad) == 1 and bad[0]["step"] == 3 and bad[0]["nonfinite"] == "gen"


@pytest.mark.slow
def test_too_many_bad_steps_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(["--config", TINY, "trainer.max_steps=6", *FAST, "checkpoint.every_steps=2",
                      "trainer.max_bad_steps=1", "trainer.poison=3:cls:*", "ddp.nan_monitor=true",
                      f"output_dir={out}"], check=False)
    assert proc.returncode == 5 and "consecutive non-finite steps" in proc.stderr and "Traceback" not in proc.stderr
    assert "first non-finite gradient in" in proc.stdout  # the NaN monitor names the parameter
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_2"]


@pytest.mark.slow
def test_a_stopped_rank_is_named_before_and_at_the_collective_timeout(tmp_path):
    """Rank 1 stops itself (SIGSTOP) after step 3: rank 0 names it in a warning at half the timeout,
    then, when the collective times out, in one line with its last step and checkpoint; no traceback; non-zero.

    Once that line is out, the test SIGKILLs the stopped rank itself, as torchrun would 30 s later (a stopped process
    never acts on the SIGTERM of its grace period): the test waits for what mtl does, not for torchrun's grace."""
    out = str(tmp_path / "run")
    final = ("[rank 0] error: a collective timed out after ddp.timeout_s=20 s: rank 1 (its last heartbeat at step 3, "
             "its last checkpoint step_2) did not answer")
    proc = start(["--config", TINY, "trainer.max_steps=50", *FAST, "checkpoint.every_steps=2",
                  "trainer.poison=4:stop:1", "ddp.timeout_s=20", f"output_dir={out}"], nproc=2)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    drain = threading.Thread(target=proc.stdout.read, daemon=True)
    drain.start()
    stopped: list[int] = []
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        if any(final in line for line in lines):
            stopped = [p for p in tree(proc.pid) if state(p) == "T"]
            for p in stopped:
                os.kill(p, signal.SIGKILL)
            break
        time.sleep(0.1)
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        kill_tree(proc.pid)
    reader.join(timeout=30)
    err = "".join(lines)
    assert len(stopped) == 1, (stopped, err[-3000:])  # the stop really happened, to one process
    assert proc.returncode == 5, err[-3000:]
    assert "Traceback" not in err
    warning = re.search(r"\[rank 0\] warning: rank 1 has not answered for (\d+) s \(.*its last heartbeat was at step "
                        r"3, the last checkpoint saved is step_2\)", err)
    assert warning and 10 <= int(warning.group(1)) < 20 and final in err, err[-3000:]
    assert err.index(warning.group(0)) < err.index(final) and err.count(final) == 1
    assert steps_logged(out) == 3  # the stop came after step 3


@pytest.mark.slow
def test_a_crashing_rank_makes_every_rank_exit(tmp_path):
    tic = time.time()
    proc = run_train(["--config", TINY, "trainer.max_steps=50", *FAST, "trainer.poison=3:crash:1", "ddp.timeout_s=30",
                      f"output_dir={tmp_path}"], nproc=2, check=False, timeout=180)
    assert proc.returncode != 0 and time.time() - tic < 120


@pytest.mark.slow
def test_a_failure_on_one_rank_reaches_the_user_in_one_line(tmp_path):
    out = str(tmp_path / "run")
    args = ["--config", TINY, "checkpoint.every_steps=2", "resume=auto", f"output_dir={out}"]
    run_train([*args, "trainer.max_steps=2"], nproc=2)
    # the same error on every rank (a config that breaks the resume): said once, not once per rank
    same = run_train([*args, "trainer.max_steps=4", "seed=3"], nproc=2, check=False)
    assert same.returncode == 4 and same.stderr.count("cannot resume from") == 1, same.stderr[-3000:]
    # rank 1's own file is garbled: rank 1 says so, rank 0 says in one line that it lost its peer
    step_dir = os.path.join(out, "checkpoints", "step_2")
    with open(os.path.join(step_dir, "rng_rank1.pt"), "wb") as f:
        f.write(b"garbled")
    # keep the checksum manifest in step with it: rank 0's verification would otherwise catch the file (and
    # whichever rank reached the launcher's store first would print that job-wide error); only rank 1, loading
    # its own file, may notice here
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"]["rng_rank1.pt"] = {"bytes": 7, "sha256": hashlib.sha256(b"garbled").hexdigest()}
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    proc = run_train([*args, "trainer.max_steps=4"], nproc=2, check=False)
    err = proc.stderr
    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    mine = [line for line in err.splitlines() if line.startswith("[rank 1] error:")]
    assert len(mine) == 1 and "rng_rank1.pt" in mine[0], err[-3000:]
    assert len([line for line in err.splitlines() if line.startswith("[rank 0]")]) <= 1
    summary = [line for line in err.splitlines() if line.startswith("mtl.tools.launch:")]
    assert len(summary) == 1 and "rank 1 failed with exit code 4" in summary[0], err[-3000:]


def test_the_launcher_names_the_rank_that_failed_first():
    from types import SimpleNamespace

    from mtl.tools.launch import exit_code, summary

    failures = {0: SimpleNamespace(exitcode=-15), 1: SimpleNamespace(exitcode=4)}  # rank 0 was stopped by torchrun
    assert exit_code(failures) == 4
    assert summary(failures).startswith("rank 1 failed with exit code 4")
    lost = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=3)}  # rank 0 lost its peer (exit 1)
    assert exit_code(lost) == 3 and summary(lost).startswith("rank 1 failed with exit code 3")


def test_only_a_lost_peer_counts_as_a_secondary_failure(monkeypatch):
    from mtl.run.error_report import peer_failure

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert peer_failure(RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:39089")) == \
        "Connection closed by peer"
    assert peer_failure(RuntimeError("CUDA out of memory")) is None  # a rank's own failure keeps its traceback
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert peer_failure(RuntimeError("Connection closed by peer")) is None  # no peers, no peer to lose


def train_main(args, capsys) -> tuple[int, str, str]:
    """train.py's main in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    import train

    capsys.readouterr()
    code = train.main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
def test_resume_with_a_changed_config_lists_each_differing_key(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train_main(["--config", TINY, "trainer.max_steps=2", "checkpoint.every_steps=2", f"output_dir={out}"],
                      capsys)[0] == 0
    code, _, err = train_main(["--config", TINY, "trainer.max_steps=4", "resume=auto", "optim.lr=0.1", "seed=3",
                               f"output_dir={out}"], capsys)
    assert code == 4, err
    assert "optim.lr: checkpoint 0.003, now 0.1" in err and "seed: checkpoint 0, now 3" in err
    assert "trainer.max_steps" not in err.split("Keys that may change")[0]  # safe to change
    code, stdout, err = train_main(["--config", TINY, "trainer.max_steps=4", "resume=auto", "trainer.log_every=2",
                                    f"output_dir={out}"], capsys)
    assert code == 0 and "resuming from" in stdout, err


def test_a_checkpoint_that_is_not_ours_is_a_clear_error(tmp_path, capsys):
    from mtl.checkpoint.folder import load_checkpoint
    from mtl.errors import CheckpointError

    bad = tmp_path / "step_5"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    (bad / "trainer_state.pt").write_bytes(b"\x80\x04 truncated pickle")
    with pytest.raises(CheckpointError, match="truncated or not written by mtl"):
        load_checkpoint(str(bad), torch.nn.Linear(2, 2), 0)
    torch.save({"format": "something-else"}, bad / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="not an mtl checkpoint"):
        load_checkpoint(str(bad), torch.nn.Linear(2, 2), 0)
    (bad / "config.yaml").write_text("seed: 0\n")
    code, _, err = train_main(["--config", TINY, f"resume={bad}", f"output_dir={tmp_path / 'run'}"], capsys)
    assert code == 4 and "Traceback" not in err and "step_5" in err


def _train_in_process(args):
    import train

    assert train.main(args) == 0


@pytest.mark.slow  # in-process, but seconds long: kept out of the fast tier
def test_evaluation_and_the_nan_monitor_draw_no_training_randomness(tmp_path, capsys):
    # both keys may change on resume (mtl/setup/resume.py), so neither may move the dropout stream
    base = ["--config", TINY, "trainer.max_steps=4", "model.decoder.dropout=0.1", "trainer.max_bad_steps=5"]
    runs = {
        "rare_eval": ["trainer.eval_every=1000"],
        "eval_every_step": ["trainer.eval_every=1"],
        "nan": ["trainer.eval_every=1000", "trainer.poison=2:cls:*"],
        "nan_monitored": ["trainer.eval_every=1000", "trainer.poison=2:cls:*", "ddp.nan_monitor=true"],
    }
    for name, extra in runs.items():
        _train_in_process([*base, *extra, f"output_dir={tmp_path / name}"])
    out = capsys.readouterr().out
    with open(tmp_path / "eval_every_step" / "metrics.jsonl") as f:
        evals = [json.loads(line)["step"] for line in f if '"kind": "eval"' in line]
    assert evals == [1, 2, 3, 4]  # the evaluations really ran
    assert out.count("first non-finite gradient in") >= 1  # and so did the monitor's extra passes
    assert model_bytes(tmp_path / "rare_eval", 4) == model_bytes(tmp_path / "eval_every_step", 4)
    assert model_bytes(tmp_path / "nan", 4) == model_bytes(tmp_path / "nan_monitored", 4)
    assert model_bytes(tmp_path / "rare_eval", 4) != model_bytes(tmp_path / "nan", 4)  # the NaN step was skipped


def test_a_skipped_step_leaves_batchnorm_running_stats_as_they_were(tmp_path):
    from mtl.data.loader import to_device
    from mtl.run.trainer import Trainer

    trainer = Trainer.from_config(TINY, [f"output_dir={tmp_path}", "model.backbone.norm=batch", "ddp.nan_monitor=true",
                                         "trainer.max_bad_steps=5"])
    try:
        batches = trainer.batches()
        buffers = {n: b for n, b in trainer.bare.named_buffers() if "running_" in n or "num_batches" in n}
        assert buffers
        batch = to_device(next(batches)[1], trainer.device)
        batch["image"][0, 0, 0, 0] = float("nan")  # one bad pixel
        before = {n: b.clone() for n, b in buffers.items()}
        result = trainer.step_once(batch)
        assert result.nonfinite and not result.stepped  # the fault happened and the step was skipped
        trainer.steplog.after_step(trainer.step, result, 0.1, batch)  # with the NaN monitor's own forward passes
        for n, b in buffers.items():
            assert torch.equal(b, before[n]), n
        good = trainer.step_once(next(batches)[1])
        assert good.stepped and all(torch.isfinite(b.float()).all() for b in buffers.values())
    finally:
        trainer.close()


@pytest.mark.slow  # two in-process runs: the full suite, not the fast tier
def test_a_resumed_run_keeps_the_batchnorm_buffers_its_step_restores(tmp_path):
    """The step finds BatchNorm's buffers once (RunningStats); a resume loads the checkpoint into those same
    tensors, so a skipped step after a resume still puts back the statistics the model uses."""
    from mtl.run.step import running_stat_buffers
    from mtl.run.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "model.backbone.norm=batch", "trainer.max_steps=2",
                 "checkpoint.every_steps=1"]
    first = Trainer.from_config(TINY, overrides)
    try:
        first.train()
    finally:
        first.close()
    trainer = Trainer.from_config(TINY, [*overrides, "trainer.max_steps=3", "resume=auto"])
    try:
        assert trainer.step == 2  # the fault of interest needs a real resume
        found, live = trainer.parts.running_stats.buffers, running_stat_buffers(trainer.bare)
        assert live and len(found) == len(live) and all(a is b for a, b in zip(found, live))
        assert int(live[-1]) == 2  # num_batches_tracked came from the checkpoint, into the same tensor
    finally:
        trainer.close()


@pytest.mark.slow  # seconds-long in-process runs: the full suite, not the fast tier
def test_keep_last_prunes_old_checkpoints(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train_main(["--config", TINY, "trainer.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
                       f"output_dir={out}"], capsys)[0] == 0
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_5", "step_6"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
