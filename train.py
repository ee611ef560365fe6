"""Train one multi-task model: ``torchrun --nproc_per_node=N train.py --config configs/X.yaml [key=value ...]``.

Also runs as ``python train.py --config ...`` (one process) and under multi-node torchrun rendezvous.
"""

from __future__ import annotations

import argparse

from mtl.run.error_report import run_guarded
from mtl.run.signals import exit_process, keep_exit_code, start_up_guard


class HelpParser(argparse.ArgumentParser):
    """The config keys and the options (strategies, methods, ...) are listed under --help: built only when asked."""

    def format_help(self) -> str:
        from mtl.config.schema import keys_help
        from mtl.setup.checks import options_help

        self.epilog = f"{keys_help()}\n\n{options_help()}"
        return super().format_help()


@start_up_guard  # first of all: a stop signal during start-up ends the run cleanly (mtl/run/signals.py)
def main(argv: list[str] | None = None) -> int:
    parser = HelpParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config file (may name a base: file). Relative paths: "
                        "base: and the *_modules .py files from the config file's folder; every other path "
                        "(output_dir, data.*_path, init_from ...), and every path on the command line, from the "
                        "working directory (docs/config.md#relative-paths)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100 "
                        "(the keys are listed below)")
    args = parser.parse_args(argv)

    def run():
        from mtl.parallel import dist
        from mtl.run.trainer import Trainer
        from mtl.setup.checks import load_run_config

        cfg = load_run_config(args.config, args.overrides)
        info = dist.init_distributed(cfg)
        trainer = None
        try:
            trainer = Trainer(cfg, info)
            trainer.train()
        finally:
            if trainer is not None:
                trainer.close()
            dist.destroy()

    return run_guarded(run)


if __name__ == "__main__":
    code = main()
    if code:  # torchrun tears the job down once a rank has failed: this rank keeps its own code (mtl/run/signals.py)
        keep_exit_code(code)
    exit_process(code)  # sys.exit's, less the module-by-module teardown (a second and more: mtl/run/signals.py)
