"""Command-line tools over the core (``mtl.inference``): evaluate, predict and export a trained model.

Each tool is thin: it parses its arguments, calls the core, writes its output, and turns user errors
into one message and an exit code through ``mtl.run.error_report.run_guarded`` (2 config/option, 3 data, 4 checkpoint).
"""

from __future__ import annotations

import argparse
import os

from mtl.errors import ConfigError

MODEL_HELP = ("a checkpoint folder (output_dir/checkpoints/step_<N>), an export folder (mtl.tools.export), "
              "or a run's output_dir (its newest checkpoint)")


def write_text(path: str, text: str, option: str = "--out") -> None:
    """Write ``text`` to ``path`` (its folder is created); a failure is one ConfigError naming the option."""
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"{option}: cannot write {path!r}: {e.strerror or e}") from None


def tool_parser(module: str, doc: str, config: str | None = None, overrides: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``: the first line of the tool's docstring ``doc`` as its
    description and the rest as its epilog (as written); with ``config``, a ``--config`` option with that default;
    with ``overrides`` (its help), the trailing ``key=value`` config overrides."""
    lines = doc.strip().splitlines()
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=lines[0], epilog="\n".join(lines[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if config is not None:
        parser.add_argument("--config", default=config, help=f"the run's config (default: {config})")
    if overrides is not None:
        parser.add_argument("overrides", nargs="*", help=overrides)
    return parser
