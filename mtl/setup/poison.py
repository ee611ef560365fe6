"""``trainer.poison``'s hook on the model (the reliability tests' NaN loss), installed by the model builder
(``mtl.setup.build.build_model``) only when ``trainer.poison`` is set; the rest of the fault (which step, task and
rank; a crash or a stop) is ``mtl.run.faults.poison``, called by the trainer on the batch."""

from __future__ import annotations


def install_poison(model) -> None:
    """A forward hook on ``model`` (a ``MultiTaskModel``): the loss of the task a batch names in ``batch["poison"]``
    (set by ``poison``) becomes NaN. Only for ``trainer.poison``; a model without it has no such hook."""

    def hook(module, args, kwargs, output):
        task = (args[0] if args else kwargs["batch"]).get("poison")
        if task in output["losses"]:
            output["losses"][task] = output["losses"][task] * float("nan")
        return output

    model.register_forward_hook(hook, with_kwargs=True)
