"""``python -m mtl.tools.launch [torchrun options] train.py --config X [key=value ...]``: torchrun, quieter on failure.

What ``make train`` uses. It checks the config once, before any worker starts (a config error is one
message and exit code 2), and refuses a re-run on an output_dir that holds checkpoints at once (exit 2, with
the ways out; under ``make train``, which sets ``MTL_MAKE_TARGET=train``, in the form ``make train ARGS="..."``),
then runs torchrun's own launcher in this process. When a worker fails it
has already printed its one-line error; instead of torchrun's launcher traceback this prints one
summary line and exits with the worker's exit code. Plain ``torchrun`` works too; it only prints
more on failure.
"""

from __future__ import annotations

import os
import sys

from mtl.checkpoint.folder import latest_checkpoint
from mtl.errors import ConfigError, MTLError
from mtl.run.error_report import run_guarded
from mtl.setup.checks import load_run_config

# the exit codes of mtl's own errors (2-5): a rank that exits with one of these failed for a reason of its own
EXIT_CODES = {cls.exit_code for cls in MTLError.__subclasses__()}


def _config_args(argv: list[str]) -> tuple[str | None, list[str]]:
    if "--config" not in argv:
        return None, []
    i = argv.index("--config")
    return argv[i + 1] if i + 1 < len(argv) else None, [a for a in argv[i + 2:] if "=" in a and not a.startswith("-")]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config, overrides = _config_args(argv)
    if config is not None:
        code = run_guarded(lambda: refuse_a_re_run(load_run_config(config, overrides, announce=False), overrides))
        if code:
            return code
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except SignalException as e:  # the launcher itself got SIGTERM/SIGINT (e.g. from Slurm)
        print(f"mtl.tools.launch: got {e.sigval.name}; the workers were sent it too and save a checkpoint before they "
              "exit (resume with resume=auto)", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(f"mtl.tools.launch: {summary(e.failures)}", file=sys.stderr)
        return exit_code(e.failures)
    return 0


def refuse_a_re_run(cfg, overrides: list[str]) -> None:
    """The workers' own refusal of an output_dir that holds checkpoints (mtl/run/run_folder.py), said before they
    start, with the ways out as this command takes them: under ``make train`` (``MTL_MAKE_TARGET``), its ARGS."""
    existing = latest_checkpoint(cfg.output_dir) if cfg.resume is None and not cfg.overwrite else None
    if existing is None:
        return
    target = os.environ.get("MTL_MAKE_TARGET")
    if target:
        given = " ".join(overrides)

        def way(override: str) -> str:
            return f'make {target} ARGS="{given} {override}"' if given else f'make {target} ARGS="{override}"'
    else:
        def way(override: str) -> str:
            return f"the same command with {override}"
    raise ConfigError(f"output_dir: {cfg.output_dir!r} already holds checkpoints ({os.path.basename(existing)}) of "
                      f"another run. To continue it: {way('resume=auto')}; to delete them and start over: "
                      f"{way('overwrite=true')}; or choose another output_dir")


def _root_causes(failures: dict) -> dict:
    """{rank: code} of the ranks that failed for a reason of their own (an mtl error, exit 2-5).

    The others stopped because of them: killed by torchrun (a negative code) or lost a peer (exit 1).
    """
    return {r: f.exitcode for r, f in failures.items() if f.exitcode in EXIT_CODES}


def summary(failures: dict) -> str:
    """One line: which rank failed and how, pointing at its error above."""
    root = _root_causes(failures)
    if not root:
        codes = sorted({f.exitcode for f in failures.values()})
        return f"worker(s) {sorted(failures)} exited with code(s) {codes}; the error is above"
    ranks, codes = sorted(root), ", ".join(map(str, sorted(set(root.values()))))
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    return f"{who} failed with exit code {codes}; its error is above" + (
        " (the other ranks stopped because of it)" if len(ranks) == 1 else "")


def exit_code(failures: dict) -> int:
    root = _root_causes(failures)
    if root:
        return root[min(root)]
    return next((c for c in sorted({f.exitcode for f in failures.values()}) if c > 0), 1)


if __name__ == "__main__":
    from mtl.run.signals import exit_process

    exit_process(main())  # sys.exit's, less the module-by-module teardown (a second and more: mtl/run/signals.py)
