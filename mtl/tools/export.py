"""Export a trained model as a self-contained folder: model.safetensors, config.yaml, tokenizer/, class_names.json.

The folder also holds the parts in other libraries' layouts (its README.md says how to use them): hf_decoder/
for transformers, torchvision_backbone/ for torchvision, and image_program.pt2, a torch.export program of the
image path (backbone and classification head) that plain torch runs.

  python -m mtl.tools.export --checkpoint runs/x/checkpoints/step_1000 --out runs/x/export

The folder needs nothing else: mtl.inference.load_model(folder) rebuilds the model in one call, and
python -m mtl.tools.predict / evaluate accept it wherever they take a checkpoint. The checkpoint is
loaded first (a broken one is refused, not copied), and the folder appears whole or not at all. Plug-in code the
checkpoint carries (task_modules/ ...) is imported, and copied on, only with --trust-plugins, unless each file is
identical to the one at its recorded path here (your own run's code): else exit 2, naming each file and its SHA-256.
"""

from __future__ import annotations

import sys

from mtl.run.error_report import run_guarded
from mtl.tools import MODEL_HELP, TRUST_HELP, tool_parser


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("mtl.tools.export", __doc__)
    parser.add_argument("--checkpoint", required=True, help=MODEL_HELP)
    parser.add_argument("--trust-plugins", action="store_true", help=TRUST_HELP)
    parser.add_argument("--out", required=True, help="the folder to create (new, or empty)")
    args = parser.parse_args(argv)

    def run():
        # import here: torch and the model code load after the arguments parse, so --help and a usage error answer at once
        from mtl.inference import export_model

        print(f"exported to {export_model(args.checkpoint, args.out, args.trust_plugins)}", flush=True)

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
