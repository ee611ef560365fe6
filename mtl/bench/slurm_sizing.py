"""How many time-limit requeues a run's Slurm job may have, and how early its warning signal comes (``bench.slurm``).

submitit requeues a job at most ``max_num_timeout`` times at its time limit (3 by default; preemptions do not count),
then gives up with "timed-out too many times" and leaves the run unfinished. ``requeue_cap`` derives the cap from the
sizing of the longest run (``bench.slurm.longest_run_h``, an upper estimate): the jobs it needs at
``bench.slurm.time_min`` a job (``planned_jobs``), with a margin of ``MARGIN`` x those jobs, at least ``SPARE`` more
requeues than planned; ``bench.slurm.max_requeues`` sets it outright.

submitit's warning signal (USR2, ``signal_delay_s`` before the limit) reaches the job's process, whose handler
submitit installs only after unpickling the job (which imports torch). A signal before that kills the job with no
requeue; a signal too close to the limit leaves the run no time to save. ``warning_delay`` makes the warning come at
least ``MARGIN`` x (the job's measured start-up + ``bench.slurm.save_s``) before the limit (never earlier than
submitit's own default), and refuses a limit so short that the warning would come before the start-up has ended.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import time

from mtl.errors import ConfigError

DEFAULT_REQUEUES = 3  # submitit's max_num_timeout
DEFAULT_DELAY_S = {"slurm": 90, "local": 30}  # submitit's signal_delay_s (Slurm; its local executor)
MARGIN = 2
SPARE = 3
CAP_MESSAGE = "timed-out too many times"  # submitit's reason for not requeuing a job at its cap
# what a job's process imports before submitit's handler is installed: the unpickling of a RunJob
STARTUP_CODE = "import submitit, submitit.core.submission, mtl.bench.launch"


def planned_jobs(s, delay_s: float) -> int:
    """The jobs the longest run needs (``bench.slurm.longest_run_h`` at ``time_min`` a job, each stopped at its
    warning, ``delay_s`` before the limit); 0 when not sized."""
    if s.longest_run_h <= 0:
        return 0
    usable_min = s.time_min - delay_s / 60
    return max(1, math.ceil(s.longest_run_h * 60 / usable_min)) if usable_min > 0 else 0


def requeue_cap(s, delay_s: float) -> tuple[int, str]:
    """``(submitit's max_num_timeout for each run's job, how it was set)``."""
    if s.max_requeues > 0:
        return s.max_requeues, "bench.slurm.max_requeues"
    jobs = planned_jobs(s, delay_s)
    if not jobs:
        return DEFAULT_REQUEUES, ("submitit's default: not sized (set bench.slurm.longest_run_h, the upper estimate "
                                  "of the longest run, or bench.slurm.max_requeues)")
    cap = max(MARGIN * jobs, jobs - 1 + SPARE)
    return cap, (f"the longest run, {s.longest_run_h:g} h (bench.slurm.longest_run_h), needs {jobs} job(s) of "
                 f"{s.time_min} min, {jobs - 1} requeue(s); the cap is {MARGIN} x the jobs, at least {SPARE} more "
                 f"than planned: {cap} requeues, {cap + 1} jobs, {(cap + 1) * s.time_min / 60:g} h")


@functools.cache
def measure_startup(python: str = sys.executable) -> float:
    """Seconds a job's process takes, on this machine now, to import what unpickling its RunJob imports (torch
    among them): the time before submitit's handler of the warning signal is installed."""
    tic = time.perf_counter()
    subprocess.run([python, "-c", STARTUP_CODE], check=True, capture_output=True, env=os.environ.copy())
    return time.perf_counter() - tic


def warning_delay(s, startup_s: float) -> tuple[int, str]:
    """``(submitit's signal_delay_s, how it was set)``: at least ``MARGIN`` x (``startup_s`` + ``bench.slurm.save_s``)
    and submitit's default. ConfigError when the time limit cannot hold the start-up before the warning."""
    default = DEFAULT_DELAY_S.get(s.cluster, DEFAULT_DELAY_S["slurm"])
    need = math.ceil(MARGIN * (startup_s + s.save_s))
    delay = max(default, need)
    limit_s = s.time_min * 60
    if limit_s - delay < startup_s * MARGIN:
        raise ConfigError(f"bench.slurm.time_min={s.time_min}: the warning signal, {delay} s before the limit, would "
                          f"come {limit_s - delay} s into the job, before {MARGIN} x its start-up ({startup_s:.1f} s "
                          "measured here) has passed, and the job would die without a requeue; give the jobs a "
                          f"longer limit (at least {math.ceil((delay + MARGIN * startup_s) / 60)} min)")
    return delay, (f"{delay} s before the limit: {MARGIN} x (the job's start-up, {startup_s:.1f} s measured here, + "
                   f"a checkpoint's save, bench.slurm.save_s = {s.save_s:g} s) = {need} s, at least submitit's "
                   f"{default} s")


def describe_slurm_sizing(b) -> list[str]:
    """``--plan``'s lines on the jobs' requeue cap and warning signal. The start-up is measured (here, now) only with
    ``bench.launcher: slurm``; otherwise the rule is stated and the launch measures it."""
    s = b.slurm
    if b.launcher == "slurm":
        try:
            startup = measure_startup()
        except subprocess.CalledProcessError as e:  # the job's imports fail here (submitit missing?): so would a job
            return [f"  warning signal: the job's start-up could not be measured ({STARTUP_CODE!r} failed: "
                    f"{e.stderr.decode(errors='replace').strip().splitlines()[-1:]})"]
        try:
            delay, how = warning_delay(s, startup)
        except ConfigError as e:
            return [f"  warning signal: REFUSED: {str(e).splitlines()[-1].lstrip(' -')}"]
        cap, why = requeue_cap(s, delay)
        return [f"  warning signal (submitit's signal_delay_s, USR2): {how}",
                f"  time-limit requeues per job (submitit's max_num_timeout): at most {cap}: {why}; a run still "
                "unfinished at the cap is named in the sweep's summary and resubmitted by the next bench invocation"]
    default = DEFAULT_DELAY_S.get(s.cluster, DEFAULT_DELAY_S["slurm"])
    cap, why = requeue_cap(s, default)
    return [f"  warning signal (with bench.launcher=slurm): at least {MARGIN} x (the job's start-up, measured at "
            f"launch, + a checkpoint's save, bench.slurm.save_s = {s.save_s:g} s) before the limit, at least "
            f"submitit's {default} s",
            f"  time-limit requeues per job (with bench.launcher=slurm; submitit's max_num_timeout): at most {cap}: "
            f"{why}; a run still unfinished at the cap is named in the sweep's summary and resubmitted by the next "
            "bench invocation"]
