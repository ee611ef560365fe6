"""Where the benchmark's runs train: ``bench.launcher: local`` (a process, or torchrun, per run on this machine) or
``slurm`` (one Slurm job per run through submitit; torchrun inside the job when ``bench.nproc`` > 1; at its time
limit or a preemption a job checkpoints its run, is requeued and resumes it: ``RunJob``).

Both are driven by ``drive``: at most ``bench.parallel`` runs at once, each run's output in its folder's ``log.txt``,
a failed run recorded with its error while the sweep goes on, and every run still in flight stopped (process
terminated, job cancelled) when the sweep itself is interrupted, so no run outlives it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from mtl.bench.options import bench_options
from mtl.bench.record import provenance, write_record
from mtl.bench.slurm_sizing import CAP_MESSAGE, DEFAULT_DELAY_S, measure_startup, requeue_cap, warning_delay
from mtl.errors import ConfigError


def _die_with_parent() -> None:
    """In a run's process (Linux): SIGTERM when the sweep's process dies, even by SIGKILL, so no run outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).strip()
    except OSError as e:  # the run's folder was removed under the sweep
        return f"(no log: {e})"


class LocalLauncher:
    """Each run a child process of the sweep (``train.py``, or torchrun for ``bench.nproc`` > 1)."""

    name = "local"

    def __init__(self, env: dict):
        self.env = env

    def start(self, run: dict, command: list[str], record) -> tuple:
        record()  # where it runs: this machine
        log = open(os.path.join(run["dir"], "log.txt"), "a" if run.get("resume") else "w")
        if run.get("resume"):  # the earlier attempt's output stays above
            log.write(f"{RESUMED}\n")
            log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        return proc, log

    def poll(self, handle, run: dict) -> str | None | bool:
        """None while running; True when it succeeded; else the error (str)."""
        proc, log = handle
        if proc.poll() is None:
            return None
        log.close()
        if proc.returncode == 0:
            return True
        return f"exit code {proc.returncode}: {tail(os.path.join(run['dir'], 'log.txt'))}"

    def stop(self, handle) -> None:
        proc, log = handle
        proc.terminate()
        proc.wait()
        log.close()


# Seconds a run's job waits, after submitit's warning signal (USR2, ``signal_delay_s`` before the time limit: 90
# on Slurm, 30 with the local executor, by submitit's default), for its run to save a checkpoint and exit before the
# job is requeued; a longer lead (``slurm_sizing.warning_delay``) adds its extra seconds to this wait.
GRACE_S = {"slurm": 60.0, "local": 20.0}
REQUEUED = "== requeued (time limit or preemption): resuming from the run's newest checkpoint (resume=auto)"
RESUMED = "== an unfinished earlier attempt of this run: resuming from its newest checkpoint (resume=auto)"


AT_CAP = "unfinished at the requeue cap"  # a run's outcome when submitit gave up on its job: resubmitted next time
CANCELLED = "bench_cancelled"  # in a run's folder: the sweep cancelled its job (``SlurmLauncher.stop``): no requeue


def warning_signal() -> int:
    """submitit's time-limit/preemption warning signal (USR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise)."""
    try:
        from submitit.core.job_environment import JobEnvironment

        return JobEnvironment._usr_sig()
    except (ImportError, RuntimeError):
        return signal.SIGUSR2


def _run_ignores_warning() -> None:
    """In a run's process: Slurm sends submitit's warning signal to every process of the job step, the run's too,
    whose default action for it is to die at once without a checkpoint. Ignored (inherited through exec, by torchrun
    and its workers too): the job's ``checkpoint`` stops the run with SIGTERM instead, and it saves its step."""
    signal.signal(warning_signal(), signal.SIG_IGN)


def started_before(run_dir: str) -> bool:
    """Whether an earlier attempt of this run's job started training in ``run_dir`` (it wrote ``run.json``, which
    a run writes once every check has passed; the sweep gives each run's first attempt an empty folder)."""
    return os.path.isfile(os.path.join(run_dir, "run.json"))


def resuming(command: list[str]) -> list[str]:
    """``command`` with ``resume=auto`` in place of its ``resume=`` override (added if it has none)."""
    out = [a for a in command if not a.startswith("resume=")]
    return [*out, "resume=auto"]


class RunJob:
    """What one Slurm job does (on its node), a checkpointable callable for submitit: record where it runs
    (``bench_run.json``), then train, the output in the run's ``log.txt``; returns the command's exit code.

    Checkpointable (submitit's ``checkpoint`` protocol, as ``submitit.helpers.Checkpointable``): at the time limit or
    a preemption submitit signals the job (USR2) and calls ``checkpoint``, which sends the run SIGTERM (the trainer
    finishes its step, saves a checkpoint and exits; torchrun passes it to every rank), waits for it to exit (at most
    ``grace_s``), and hands submitit this callable again, which requeues the job. An attempt that finds the run
    started before (``started_before``; whether requeued by submitit or by Slurm itself) runs it with ``resume=auto``,
    so it continues from the newest complete checkpoint, bit for bit as any resume (docs/reliability.md).

    Slurm signals every process of the job step, the run's too: the warning signal is ignored by the run
    (``_run_ignores_warning``); a SIGTERM that reaches the run itself (a preemption, the time limit, a cancel) makes
    it save its step and exit 0 without its ``final_metrics.json`` (or, before its handler is installed, die of it).
    Such a run is not finished and did not fail: the job is requeued as the warning signal would (submitit's own
    handler, which calls ``checkpoint``), unless the sweep cancelled it (``CANCELLED``); outside a submitit job, or
    cancelled by the sweep, it is an error."""

    def __init__(self, grace_s: float = GRACE_S["slurm"]):
        self.grace_s = grace_s
        self.attempt = 0  # how many times this job was requeued through ``checkpoint``
        self._proc: subprocess.Popen | None = None
        self._code: int | None = None

    def __getstate__(self) -> dict:  # pickled by submitit at submission and at each requeue: no process
        return {"grace_s": self.grace_s, "attempt": self.attempt}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["grace_s"])
        self.attempt = state["attempt"]

    def __call__(self, command: list[str], run_dir: str, env: dict, cwd: str, record_args: tuple | None = None) -> int:
        again = started_before(run_dir)
        if again:
            command = resuming(command)
        if record_args is not None:
            config, threads, code = record_args
            write_record(run_dir, config, provenance(threads), code)
        with open(os.path.join(run_dir, "log.txt"), "a" if again else "w") as log:
            if again:  # requeued through ``checkpoint``, or a new job of the sweep (or Slurm's own requeue)
                log.write(f"{REQUEUED} (attempt {self.attempt + 1})\n" if self.attempt else f"{RESUMED}\n")
                log.flush()
            self._code = None
            self._proc = proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                 env={**os.environ, **env}, cwd=cwd, preexec_fn=_run_ignores_warning)
            threading.Thread(target=self._wait, args=(proc,), daemon=True).start()
            try:
                while self._code is None:  # no lock held here: submitit's signal handler runs in this thread
                    time.sleep(0.2)
            finally:  # the job itself ends (requeued, cancelled): its run must not outlive it
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        # a stop signal reached the run itself, not through ``checkpoint``: it died of it (before the trainer's handler
        # was installed: what it saved before is kept), or it saved its step and exited 0 without its final metrics
        killed = self._code in (-signal.SIGTERM, 128 + signal.SIGTERM)
        saved = self._code == 0 and started_before(run_dir) and not os.path.isfile(os.path.join(run_dir,
                                                                                           "final_metrics.json"))
        if killed or saved:
            cancelled = os.path.isfile(os.path.join(run_dir, CANCELLED))
            if not cancelled:
                self._requeue(run_dir)  # returns only outside a submitit job
            raise RuntimeError(f"the run in {run_dir} stopped before its end (a stop signal"
                               + (": the sweep cancelled its job" if cancelled else ", outside a submitit job")
                               + "); its checkpoints are kept in the folder")
        return self._code

    def _requeue(self, run_dir: str) -> None:
        """Requeue this job as submitit does at its warning signal: its handler (installed in the job's process
        before this callable runs) calls ``checkpoint`` (the run has exited: nothing to stop), saves the requeued
        callable and requeues the job (SystemExit). Returns without a submitit job."""
        sig = warning_signal()
        handler = signal.getsignal(sig)
        if getattr(handler, "__name__", "") != "checkpoint_and_try_requeue":
            return
        with open(os.path.join(run_dir, "log.txt"), "a") as log:
            log.write(f"== the run was stopped by a signal (exit code {self._code}; a preemption or the time limit): "
                      "requeuing its job\n")
        handler(sig, None)

    def _wait(self, proc: subprocess.Popen) -> None:
        self._code = proc.wait()

    def checkpoint(self, *args, **kwargs):
        """submitit's hook at the time limit or a preemption (in the job's main thread, from its USR2 handler):
        stop the run so that it saves a checkpoint, then requeue this job (a ``DelayedSubmission`` of this callable
        with the same arguments)."""
        import submitit

        proc, deadline = self._proc, time.time() + self.grace_s
        if proc is not None and self._code is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except OSError:  # already gone
                pass
            while self._code is None and time.time() < deadline:
                time.sleep(0.1)
        self.attempt += 1
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def job_folder(output_dir: str, cluster: str) -> str:
    """Where submitit keeps the jobs' own files: ``output_dir/slurm/<job id>/`` on Slurm (sbatch expands ``%j``);
    with the local executor ``output_dir/slurm`` itself, its files named ``<job id>_...``: its job process makes its
    folder as given, so ``%j`` would leave a stray empty folder named ``%j``."""
    root = os.path.join(output_dir, "slurm")
    return os.path.join(root, "%j") if cluster == "slurm" else root


class SlurmLauncher:
    """Each run one job through submitit (``bench.slurm``: partition, time, GPUs, CPUs, memory per run; ``cluster:
    local`` runs the jobs with submitit's local executor). The jobs' own logs are under ``output_dir/slurm``
    (``job_folder``). Each job is a ``RunJob``: at its time limit or a preemption it checkpoints, is requeued and
    resumes."""

    name = "slurm"

    def __init__(self, cfg, env: dict, threads: int):
        try:
            import submitit  # an optional dependency (the slurm extra): imported only by this launcher
        except ImportError as e:
            raise ConfigError("bench.launcher=slurm needs submitit (pip install -e '.[slurm]'), or set "
                              "bench.launcher=local") from e
        b = bench_options(cfg)
        s, nproc = b.slurm, max(1, int(b.nproc))
        self.env, self.threads, self.cwd, self._dirs = env, threads, os.getcwd(), {}
        # the warning's lead over the limit, sized to this machine's start-up of a job (slurm_sizing); RunJob waits
        # for its run that much longer than with submitit's default lead, so submitit keeps the same time to requeue
        self.startup_s = measure_startup()
        self.delay_s, _ = warning_delay(s, self.startup_s)
        self.max_requeues, _ = requeue_cap(s, self.delay_s)
        default = DEFAULT_DELAY_S.get(s.cluster, DEFAULT_DELAY_S["slurm"])
        self.grace_s = GRACE_S.get(s.cluster, GRACE_S["slurm"]) + self.delay_s - default
        self.executor = submitit.AutoExecutor(folder=job_folder(cfg.output_dir, s.cluster), cluster=s.cluster,
                                              slurm_max_num_timeout=self.max_requeues,
                                              local_max_num_timeout=self.max_requeues)
        params = {"timeout_min": int(s.time_min), "nodes": 1, "tasks_per_node": 1, "name": "mtl-bench",
                  "cpus_per_task": int(s.cpus_per_run) or nproc * threads, "gpus_per_node": int(s.gpus_per_run)}
        if s.mem_gb:
            params["mem_gb"] = int(s.mem_gb)
        if s.cluster == "slurm":
            params["slurm_signal_delay_s"] = self.delay_s
            if s.partition:
                params["slurm_partition"] = s.partition
            if s.extra:
                params["slurm_additional_parameters"] = dict(s.extra)
        self.executor.update_parameters(**params)
        if s.cluster == "local":  # its signal_delay_s, which AutoExecutor does not pass on (local.py reads it here)
            self.executor._executor.parameters["signal_delay_s"] = self.delay_s

    def start(self, run: dict, command: list[str], record) -> object:
        marker = os.path.join(run["dir"], CANCELLED)
        if os.path.isfile(marker):  # an earlier sweep cancelled it: this one runs it
            os.remove(marker)
        job = self.executor.submit(RunJob(self.grace_s), command, run["dir"], self.env, self.cwd,
                                   (run["config"], self.threads, run.get("code")))
        self._dirs[job.job_id] = run["dir"]
        return job

    def poll(self, job, run: dict) -> str | None | bool:
        if not job.done():
            return None
        try:
            code = job.result()
        except Exception as e:  # the job itself failed: timeout, preemption, a node failure, an import error
            if CAP_MESSAGE in str(e):  # unfinished, not failed: its checkpoints are kept, the next bench resumes it
                return (f"{AT_CAP}: job {job.job_id} reached its time limit {self.max_requeues + 1} times "
                        f"({self.max_requeues} requeues, bench.slurm.max_requeues / longest_run_h); its checkpoints "
                        "are kept and the next bench invocation resubmits it from the newest")
            return f"job {job.job_id} failed: {str(e).strip()[-2000:]}"
        if code == 0:
            return True
        return f"job {job.job_id}, exit code {code}: {tail(os.path.join(run['dir'], 'log.txt'))}"

    def stop(self, job) -> None:
        """Cancel the job, marked first in its run's folder (``CANCELLED``): the SIGTERM Slurm's cancel sends the run
        must not requeue it."""
        run_dir = self._dirs.get(job.job_id)
        if run_dir and os.path.isdir(run_dir):
            with open(os.path.join(run_dir, CANCELLED), "w") as f:
                f.write("the sweep cancelled this run's job\n")
        job.cancel(check=False)


def make_launcher(cfg, env: dict, threads: int):
    return SlurmLauncher(cfg, env, threads) if bench_options(cfg).launcher == "slurm" else LocalLauncher(env)


def drive(launcher, pending: list[dict], parallel: int, begin, finish, poll_s: float = 0.2, report=None) -> None:
    """Run ``pending`` through ``launcher``, ``parallel`` at once. ``begin(run)`` prepares a run's folder and returns
    ``(command, record)`` (``record()`` writes where it runs); ``finish(run, outcome)`` records it (outcome: True or
    the error); ``report([(run, its start time), ...], runs waiting)``, if given, is called after each poll with the
    runs in flight (``progress.Progress``: it decides when to print). Whatever is still in flight when this is
    interrupted (Ctrl-C, or SIGTERM: ``scancel`` of a driver job) is stopped."""
    running: list = []
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: the finally below runs
    try:
        while pending or running:
            while pending and len(running) < parallel:
                r = pending.pop(0)
                command, record = begin(r)
                running.append((r, launcher.start(r, command, record), time.time()))
            time.sleep(poll_s)
            for item in list(running):
                r, handle, tic = item
                outcome = launcher.poll(handle, r)
                if outcome is None:
                    continue
                running.remove(item)
                r["wall_s"] = round(time.time() - tic, 1)
                finish(r, outcome)
            if report is not None and running:
                report([(r, tic) for r, _, tic in running], len(pending))
    finally:  # interrupted (Ctrl-C, SIGTERM, an error here): no run may outlive the sweep
        for _, handle, _ in running:
            launcher.stop(handle)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
