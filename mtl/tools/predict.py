"""Classify and caption images with a trained model; one JSON line per image.

  python -m mtl.tools.predict --model runs/x/export photos/ cat.jpg [--beams 3] [--out preds.jsonl]

Each line: {"image": path, "class": name, "class_index": i, "prob": p, "caption": text} (and "count"
for a model with the count task). Folders are searched recursively for image files; files named
directly are used whatever their extension. Images are preprocessed exactly as in training (the data
code's transform). Captions are greedy by default, beam search with --beams N > 1. An image file that
cannot be read, or is not a regular file (a FIFO, a device), is skipped with a warning saying which, and the
summary on stderr counts the skipped files (exit 3 only when none could be read). --device and --out
(writable, with room for the lines) are checked before the model loads (exit 2); --out is written whole or
not at all, and if that write fails (a disk that filled up meanwhile: exit 3) the predictions are printed
to stdout instead. Image models only: a model whose backbone reads something else (QM9's molecule
graphs) is refused with exit 2; evaluate it on its data with python -m mtl.tools.evaluate.
A model folder that carries plug-in code (task_modules/ ...) is loaded only with --trust-plugins (importing the
code runs it), unless each file is identical to the one at its recorded path here (your own run's code): else
exit 2, naming each file and its SHA-256. Weights holding a NaN or inf are refused (exit 5, naming the tensor).
"""

from __future__ import annotations

import json
import sys

from mtl.errors import ConfigError, DataError
from mtl.run.error_report import run_guarded
from mtl.tools import MODEL_HELP, TRUST_HELP, tool_parser, verify_out, write_out

LINE_BYTES = 512  # room asked for --out per image before predicting, beside its path: a line's class, caption, count


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("mtl.tools.predict", __doc__)
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--trust-plugins", action="store_true", help=TRUST_HELP)
    parser.add_argument("images", nargs="+", help="image files and/or folders of images")
    parser.add_argument("--beams", type=int, default=1, help="beam width for the captions (1: greedy, the default)")
    parser.add_argument("--out", help="write the JSON lines here (default: print them)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default: 32)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    args = parser.parse_args(argv)

    def run():
        # import here: torch and the model code load after the arguments parse, so --help and a usage error answer at once
        from mtl.inference import image_paths, load_model, resolve_device

        if args.beams < 1 or args.batch_size < 1:
            raise ConfigError("--beams and --batch-size must be >= 1")

        device = resolve_device(args.device, "--device")  # before any work
        paths = image_paths(args.images)  # before loading the model: a typo fails fast
        free = None
        if args.out:  # before predicting: a full disk or an unwritable --out is known now, not after the work
            free = verify_out(args.out, sum(len(p.encode()) + LINE_BYTES for p in paths))
        predictor = load_model(args.model, device, args.trust_plugins)
        skipped: list[str] = []

        def unreadable(path: str, error) -> None:  # one file does not stop the job: a warning, and it is counted
            skipped.append(path)
            print(f"warning: skipped: {error.message}", file=sys.stderr, flush=True)

        preds = predictor.predict(paths, num_beams=args.beams, batch_size=args.batch_size, on_unreadable=unreadable)
        if len(skipped) == len(paths):
            raise DataError(f"none of the {len(paths)} image(s) could be used (see the warnings above); pass image "
                            "files that open")
        text = "".join(json.dumps({"image": p, **r}) + "\n" for p, r in zip(paths, preds) if r is not None)
        done = len(paths) - len(skipped)
        if args.out:
            try:
                write_out(args.out, text, free=free)
            except DataError as e:  # the predictions are made: print them rather than lose them
                print(text, end="", flush=True)
                raise DataError(f"{e.message}. The {done} prediction(s) were printed to stdout instead") from None
        else:
            print(text, end="", flush=True)
        if args.out or skipped:
            print(f"{done} prediction(s)" + (f" written to {args.out}" if args.out else "")
                  + f"; {len(skipped)} image(s) skipped (each named in a warning above)", file=sys.stderr, flush=True)

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
