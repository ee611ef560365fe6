"""Evaluate a trained model on a data set and write its metrics as JSON.

  python -m mtl.tools.evaluate --checkpoint runs/x/checkpoints/step_1000 [--config X] [data.key=value ...] \
      [--out metrics.json]

One process is enough (no torchrun): the trainer's own evaluation (mtl.run.evaluate.evaluate_run) runs over
the whole eval data. What is evaluated: the data section (data.* and seed) of --config X, or of the
checkpoint's own config, with the key=value overrides; the model always comes from the checkpoint.
The data is data.val_path (manifest or ImageFolder), the built-in synthetic validation split, or QM9's
validation split (data.source=qm9: the run's split of the molecules, from data.qm9.* and the seed); a
multi-input model (data.per_task) scores each task on its own data.per_task.<task>.val_path (or its
synthetic set), exactly as its training run evaluated, and "images" gives each task's count. Nothing
falls back to other data: a set that cannot be read is an error naming the task and the key.

Checked before the model loads: --device (a CUDA device this machine lacks) and --out (writable, with
room); before the evaluation: the data.* and seed keys, by train.py's own checks. Each is exit 2. The metrics
are printed first; --out is then written whole or not at all (a write that fails, e.g. on a disk that
filled up meanwhile, is exit 3). A model folder that carries plug-in code (task_modules/ ...) is loaded only with
--trust-plugins (importing the code runs it), unless each file is identical to the one at its recorded path here
(your own run's code): else exit 2, naming each file and its SHA-256. Weights holding a NaN or inf: exit 5.
"""

from __future__ import annotations

import json
import sys

from mtl.errors import ConfigError
from mtl.run.error_report import run_guarded
from mtl.tools import MODEL_HELP, TRUST_HELP, tool_parser, verify_out, write_out

OUT_BYTES = 1 << 16  # room asked for --out before the evaluation: its metrics are a few hundred bytes


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("mtl.tools.evaluate", __doc__)
    parser.add_argument("--checkpoint", required=True, help=MODEL_HELP)
    parser.add_argument("--trust-plugins", action="store_true", help=TRUST_HELP)
    parser.add_argument("--config", help="take the data to evaluate on (data.*, seed) from this config")
    parser.add_argument("overrides", nargs="*", help="data.* / seed overrides, e.g. data.source=manifest "
                        "data.val_path=test.jsonl")
    parser.add_argument("--out", help="write the metrics here as JSON (they are printed in any case)")
    parser.add_argument("--max-batches", type=int, default=0, help="evaluate only this many batches (0: all)")
    parser.add_argument("--beams", type=int, default=None,
                        help="beam width for the captions (default: the checkpoint's task_options.gen.num_beams)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    args = parser.parse_args(argv)

    def run():
        # import here: torch and the model code load after the arguments parse, so --help and a usage error answer at once
        from mtl.inference import eval_config, evaluate_model, load_model, resolve_device

        if args.max_batches < 0 or (args.beams is not None and args.beams < 1):
            raise ConfigError("--max-batches must be >= 0 and --beams >= 1")
        device = resolve_device(args.device, "--device")  # before any work
        free = verify_out(args.out, OUT_BYTES) if args.out else None
        predictor = load_model(args.checkpoint, device, args.trust_plugins)
        cfg = eval_config(predictor, args.config, args.overrides)  # with train.py's checks of data.* and seed
        metrics = evaluate_model(predictor, cfg, args.max_batches, args.beams)
        text = json.dumps({"checkpoint": predictor.files.folder, **metrics}, indent=2) + "\n"
        print(text, end="", flush=True)  # first: a failed --out loses nothing
        if args.out:
            write_out(args.out, text, free=free)

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
