"""Where each task's gradient goes: the facts behind the DDP error messages and the gradient doctor.

Everything here runs on the bare model in one process, with ``torch.autograd.grad`` (which leaves
``.grad`` and DDP alone).
"""

from __future__ import annotations

import torch


def group_of(name: str, depth: int = 3) -> str:
    """``heads.gen.decoder.lm.transformer.h.0.attn.c_attn.weight`` -> ``heads.gen.decoder``."""
    return ".".join(name.split(".")[:depth][: max(1, len(name.split(".")) - 1)])


def task_gradients(model, batch: dict, tasks: list[str]) -> dict[str, dict[str, torch.Tensor | None]]:
    """{task: {parameter name: d loss_task / d parameter, or None when the task does not reach it}}."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {}
    for t in tasks:
        loss = model(batch, tasks=[t])["losses"][t]
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        out[t] = {n: g for (n, _), g in zip(named, grads)}
    return out


def reach_table(grads: dict[str, dict[str, torch.Tensor | None]], depth: int = 3) -> dict[str, dict[str, str]]:
    """{task: {module group: 'non-zero' | 'zero' | 'none'}} from ``task_gradients``."""
    table = {}
    for t, per_param in grads.items():
        status: dict[str, str] = {}
        for name, g in per_param.items():
            grp = group_of(name, depth)
            s = "none" if g is None else ("zero" if not bool(g.any()) else "non-zero")
            prev = status.get(grp)
            # a group is 'non-zero' if any parameter is, 'none' only if every parameter is
            rank = {"non-zero": 2, "zero": 1, "none": 0}
            status[grp] = s if prev is None or rank[s] > rank[prev] else prev
        table[t] = status
    return table


def nonfinite_parameters(grads: dict[str, torch.Tensor | None]) -> list[str]:
    return [n for n, g in grads.items() if g is not None and not bool(torch.isfinite(g).all())]
