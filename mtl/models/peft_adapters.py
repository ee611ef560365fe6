"""``model.peft``: LoRA adapters through the ``peft`` library (``LoraConfig`` and ``inject_adapter_in_model``; no LoRA
layer is written here), on the shared encoder (``hf_vision``, ``timm``) and on a pretrained GPT-2 caption decoder.

The base weights are frozen (peft marks only its adapters trainable); the heads, and a pretrained decoder's
cross-attention (GPT-2 has none: it starts random), train. Adapter names:

- ``default``: one adapter per adapted model, active in every forward (``per_task: false``; and the decoder always,
  which belongs to the caption task alone);
- ``task_<task>``: with ``per_task: true``, one per task on the encoder, active only in that task's forward
  (``TaskAdapters.active``), so the encoder runs once per task; ``shared: true`` keeps ``default`` beside them,
  active in every task's forward (MTLoRA's task-agnostic and task-specific split).

Which adapters a forward uses is switched by setting each peft layer's active-adapter list, not with peft's
``set_adapter``, which also flips ``requires_grad`` (DDP and the optimizer are built on a fixed set of trainable
parameters).
"""

from __future__ import annotations

import contextlib
import importlib.util

from torch import nn

from mtl.errors import ConfigError

EXTRA = "the peft extra (pip install -e '.[peft]', or make install)"
SHARED = "default"  # the task-agnostic adapter's name (and peft's default, so an exported adapter loads as is)
WRAPPABLE = ("hf_vision", "timm")  # backbones made of layers peft adapts (Linear, Conv)
# target_modules: auto -> the attention's query and value projections, by the names the model families use
AUTO_TARGETS = ("q_proj", "v_proj", "query", "value", "qkv", "c_attn")
NEW_IN_DECODER = ("crossattention", "ln_cross_attn")  # GPT-2 + cross-attention: modules a GPT-2 folder lacks


def peft_on(cfg) -> bool:
    p = cfg.model.get("peft")
    return bool(p is not None and p.get("method"))


def per_task(cfg) -> bool:
    return peft_on(cfg) and bool(cfg.model.peft.per_task)


def task_adapter(task: str) -> str:
    return f"task_{task}"


def installed() -> bool:
    return importlib.util.find_spec("peft") is not None


def adaptable_layers() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, nn.Conv1d, nn.Conv2d, Conv1D)


def targets_of(cfg) -> list[str]:
    t = cfg.model.peft.target_modules
    return list(AUTO_TARGETS) if t in (None, "auto") else ([t] if isinstance(t, str) else list(t))


def matching(module: nn.Module, targets: list[str]) -> list[str]:
    """The names of ``module``'s layers that peft adapts and ``targets`` name (peft's rule: the name or its tail)."""
    kinds = adaptable_layers()
    return [n for n, m in module.named_modules() if isinstance(m, kinds)
            and any(n == t or n.endswith("." + t) for t in targets)]


def lora_config(cfg, targets: list[str]):
    from peft import LoraConfig

    p = cfg.model.peft
    return LoraConfig(r=int(p.r), lora_alpha=float(p.alpha), lora_dropout=float(p.dropout), target_modules=targets,
                      bias="none")


def inject(cfg, module: nn.Module, names: list[str], where: str, skip: tuple[str, ...] = ()) -> int:
    """Adapters ``names`` on ``module`` (its base frozen; ``skip``: layers inside modules of these names, which train
    whole, get none); the number of layers adapted."""
    from peft import inject_adapter_in_model

    layers = [n for n in matching(module, targets_of(cfg)) if not set(n.split(".")) & set(skip)]
    if not layers:
        raise ConfigError(target_errors(cfg, module, where))
    for name in names:  # the exact layer names: one target list per model, the same for each adapter
        with _quiet():
            inject_adapter_in_model(lora_config(cfg, layers), module, adapter_name=name)
    for n, p in module.named_parameters():  # peft leaves every adapter trainable, and the base frozen
        p.requires_grad_("lora_" in n)
    return len(layers)


@contextlib.contextmanager
def _quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*peft_config.*")
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        yield


def tuner_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


class TaskAdapters:
    """The encoder's peft layers and which adapters each task's forward uses (not a module: no state of its own)."""

    def __init__(self, layers: list[nn.Module], tasks: list[str], shared: bool):
        self.layers, self.tasks, self.shared = layers, list(tasks), shared
        self._set(self.idle())

    def idle(self) -> list[str]:
        """Outside a task's forward (a tool reading the encoder alone): the shared adapter, if any."""
        return [SHARED] if self.shared else []

    def names(self, task: str) -> list[str]:
        return [task_adapter(task)] + self.idle()

    def _set(self, names: list[str]) -> None:
        for layer in self.layers:
            layer._active_adapter = list(names)

    @contextlib.contextmanager
    def active(self, task: str):
        self._set(self.names(task))
        try:
            yield
        finally:
            self._set(self.idle())


def apply(cfg, backbone: nn.Module, heads: dict, tasks: list[str]) -> tuple[TaskAdapters | None, list[str]]:
    """``model.peft`` on a built backbone and heads, in place: (the per-task switch or None, the start-up lines)."""
    p, notes = cfg.model.peft, []
    names = [task_adapter(t) for t in tasks] + ([SHARED] if p.shared else []) if p.per_task else [SHARED]
    n = inject(cfg, backbone, names, f"{cfg.model.backbone.name} encoder")
    notes.append(f"model.peft: LoRA r={p.r} alpha={p.alpha} on {n} encoder layers, adapters {', '.join(names)}")
    for head_name, head in heads.items():
        for dname, dec in _pretrained_decoders(head):
            n = inject(cfg, dec.lm, [SHARED], f"heads.{head_name}.{dname} GPT-2 decoder", skip=NEW_IN_DECODER)
            for pname, param in dec.lm.named_parameters():
                if any(part in pname.split(".") for part in NEW_IN_DECODER) and "lora_" not in pname:
                    param.requires_grad_(True)  # cross-attention: not in a GPT-2 folder, trained as a head is
            notes.append(f"model.peft: LoRA on {n} layers of heads.{head_name}.{dname} (GPT-2), adapter {SHARED}")
    switch = TaskAdapters(tuner_layers(backbone), tasks, bool(p.shared)) if p.per_task else None
    return switch, notes


def _pretrained_decoders(head: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in head.named_modules() if hasattr(m, "lm") and getattr(m, "pretrained_base", False)]


def count_note(model: nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"model.peft: {trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"


def check(cfg, strategy: type | None) -> list[str]:
    """Static problems of ``model.peft`` (no model built): the library, the method, the backbone, per_task's strategy."""
    if not peft_on(cfg):
        if cfg.get("checkpoint") is not None and cfg.checkpoint.get("trainable_only"):
            return ["checkpoint.trainable_only: true keeps the adapters and heads alone, and this run trains no "
                    "adapters; set model.peft.method=lora, or checkpoint.trainable_only=false"]
        return []
    p, errors = cfg.model.peft, []
    if not installed():
        return [f"model.peft: the peft library is not installed; install {EXTRA}, or remove model.peft.method"]
    if p.method != "lora":
        errors.append(f"model.peft.method: {p.method!r} is not supported; set model.peft.method=lora (or null: off)")
    if cfg.model.backbone.name not in WRAPPABLE:
        errors.append(f"model.peft: the {cfg.model.backbone.name!r} backbone cannot be wrapped by peft here (only "
                      f"{' and '.join(WRAPPABLE)} backbones are); set model.backbone.name to one of them, or remove "
                      "model.peft.method")
    if int(p.r) < 1:
        errors.append(f"model.peft.r: {p.r} must be at least 1 (the adapters' rank)")
    if p.shared and not p.per_task:
        errors.append("model.peft.shared: true adds a task-agnostic adapter beside per-task ones; set "
                      "model.peft.per_task=true, or remove model.peft.shared (one adapter is shared already)")
    if p.per_task and strategy is not None and not getattr(strategy, "per_task_forwards", False):
        errors.append(f"model.peft.per_task: true needs one encoder forward per task, and ddp.strategy={strategy.name} "
                      "runs one forward shared by every task; set ddp.strategy to combined, find_unused, accumulate "
                      "or placeholder, or model.peft.per_task=false")
    if cfg.model.backbone.get("freeze"):
        errors.append("model.backbone.freeze: true would freeze the backbone's adapters too, and model.peft already "
                      "keeps the base frozen; remove model.backbone.freeze (or model.peft.method: a linear probe)")
    if p.per_task and cfg.model.get("activation_checkpointing"):
        errors.append("model.peft.per_task: true switches the encoder's adapters per task, and "
                      "model.activation_checkpointing would recompute a block under another task's adapters; set "
                      "model.activation_checkpointing=false, or model.peft.per_task=false")
    return errors


def target_errors(cfg, module: nn.Module, where: str) -> list[str]:
    """``target_modules`` against a built model: each named layer exists and is one peft adapts."""
    if not peft_on(cfg) or matching(module, targets_of(cfg)):
        return []
    kinds = adaptable_layers()
    tails = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, kinds)})
    return [f"model.peft.target_modules: {cfg.model.peft.target_modules} match no layer of the {where} that peft can "
            f"adapt; name some of its layers ({', '.join(tails[:12])}), or set model.peft.target_modules=auto"]


def has_adapters(model: nn.Module) -> bool:
    return installed() and bool(tuner_layers(model))


def merged_copy(model: nn.Module, task: str | None = None) -> nn.Module:
    """A copy of ``model`` whose LoRA adapters are merged into the base weights and peft's layers replaced by their
    base layers (peft's ``merge_and_unload``, layer by layer, with peft's own ``merge``): a plain model for export.
    Per-task adapters: ``task``'s and the shared one merged into the encoder (no task: the shared one alone)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    out = copy.deepcopy(model)
    switch, encoder = getattr(out, "adapters", None), set(map(id, tuner_layers(out.backbone)))
    for name, layer in list(out.named_modules()):
        if not isinstance(layer, BaseTunerLayer):
            continue
        names = (switch.names(task) if task else switch.idle()) if switch is not None and id(layer) in encoder \
            else [SHARED]
        if names:
            layer.merge(adapter_names=names)
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, child, layer.get_base_layer())
    out.adapters = None
    return out


ADAPTERS_DIR = "peft_adapters"  # an export's adapters, apart from the base: one peft adapter folder each


def write_encoder_adapters(folder: str, model: nn.Module) -> list[str]:
    """``folder/peft_adapters/encoder[/<adapter>]``: each encoder adapter as peft saves one (``adapter_config.json``,
    ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` loads onto the base folder
    (``model.backbone.pretrained``'s model). One adapter: ``encoder/``; per-task ones: ``encoder/<adapter>/``.
    Returns the folders written (none where the encoder has no adapters)."""
    import os

    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    written = _write_decoder_adapter(folder, model)
    encoder = getattr(model.backbone, "model", None)  # the library's model: the base folder's
    layers = tuner_layers(encoder) if encoder is not None and hasattr(model.backbone, "peft_config") else []
    if not layers:
        return written
    names = sorted({n for layer in layers for n in layer.lora_A.keys()})
    targets = [n for n, m in encoder.named_modules() if m in layers]
    for name in names:
        out = os.path.join(folder, ADAPTERS_DIR, "encoder", *([] if names == [SHARED] else [name]))
        os.makedirs(out, exist_ok=True)
        first = layers[0]
        config = LoraConfig(r=int(first.r[name]), lora_alpha=float(first.lora_alpha[name]), target_modules=targets,
                            lora_dropout=0.0, bias="none")
        config.save_pretrained(out)
        state = get_peft_model_state_dict(model.backbone, adapter_name=name)  # peft_config is the backbone's
        save_file({f"base_model.model.{k.removeprefix('model.')}": v.detach().cpu().contiguous()
                   for k, v in state.items()},
                  os.path.join(out, "adapter_model.safetensors"))
        written.append(out)
    return written


def _write_decoder_adapter(folder: str, model: nn.Module) -> list[str]:
    """``folder/peft_adapters/decoder/``: the caption head's GPT-2 adapter, with its cross-attention (which a GPT-2
    folder lacks, trained whole) as peft's ``modules_to_save``: ``PeftModel.from_pretrained`` loads it onto
    ``GPT2LMHeadModel.from_pretrained(base, add_cross_attention=True)``."""
    import os

    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    written = []
    for hname, head in getattr(model, "heads", {}).items():
        for _, dec in _pretrained_decoders(head):
            layers = tuner_layers(dec.lm)
            if not layers or not hasattr(dec.lm, "peft_config"):
                continue
            out = os.path.join(folder, ADAPTERS_DIR, "decoder" if hname == "gen" else f"decoder_{hname}")
            os.makedirs(out, exist_ok=True)
            targets = [n for n, m in dec.lm.named_modules() if m in layers]
            LoraConfig(r=int(layers[0].r[SHARED]), lora_alpha=float(layers[0].lora_alpha[SHARED]), bias="none",
                       target_modules=targets, modules_to_save=list(NEW_IN_DECODER)).save_pretrained(out)
            state = get_peft_model_state_dict(dec.lm, adapter_name=SHARED)
            state.update({k: v for k, v in dec.lm.state_dict().items() if set(k.split(".")) & set(NEW_IN_DECODER)})
            save_file({f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()},
                      os.path.join(out, "adapter_model.safetensors"))
            written.append(out)
    return written
