"""Use a trained model: load it with one call, preprocess images as training does, classify and caption.

``load_model(path, device)`` takes a checkpoint folder (``output_dir/checkpoints/step_<N>``), an export
folder (``python -m mtl.tools.export``), a run's ``output_dir`` (its newest checkpoint) or the
``model.safetensors`` in one of them. It rebuilds the model from the saved ``config.yaml``, loads the
weights exactly (any missing or misshapen key is named), and returns a ``Predictor``: the model in eval
mode on ``device``, its tokenizer, its class names, and ``predict(images)``.

Where the pieces come from (``mtl.setup.build.find_model_files``): the folder's own ``tokenizer/`` and
``class_names.json`` first, else the run folder's (``output_dir/tokenizer/``, ``output_dir/class_names.json``).
A run written before class names were saved falls back to the synthetic shape names or to "0", "1", ...

Images are read with the data code's own transform (``mtl.data.manifest.load_image``: RGB, the run's
``data.image_size``, the pretrained model's own resize and crop from its library where it has one,
``Predictor.transform``) and normalised as the loaders normalise them (``data.normalize``, e.g. the pretrained
weights' mean and std), so a file is seen exactly as the training and eval loaders see it.

The command-line tools in ``mtl/tools/`` (evaluate, predict, export) are thin wrappers over this package. Its parts,
by job: ``model`` (find, check and load a model folder: ``load_model``, ``Predictor``), ``evaluate`` (``eval_config``,
``evaluate_model``), ``export`` (``export_model``) and ``interop`` (an export's parts in transformers' and
torchvision's own layouts). Every name is offered here too, as it was when this package was one module.
"""

from mtl.inference.evaluate import EVAL_KEYS, eval_config, eval_dataset, eval_task_sets, evaluate_model
from mtl.inference.export import EXPORT_MARGIN, export_bytes, export_model
from mtl.inference.interop import interop_bytes, write_interop
from mtl.inference.model import LOAD_FIX, Predictor, image_paths, load_model, model_config, read_image, refuse_nonfinite, resolve_device

__all__ = [
    "EVAL_KEYS", "EXPORT_MARGIN", "LOAD_FIX", "Predictor", "eval_config", "eval_dataset", "eval_task_sets",
    "evaluate_model", "export_bytes", "export_model", "image_paths", "interop_bytes", "load_model", "model_config",
    "read_image", "refuse_nonfinite", "resolve_device", "write_interop",
]
