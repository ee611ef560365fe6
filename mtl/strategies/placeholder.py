"""``placeholder``: per-task forward and backward, plus a zero-valued term over the unreached parameters.

The seed articles' "virtual gradient injection". Each task's forward runs only its own head; its
loss gets ``0 * sum(p[0])`` over exactly the parameters that task's graph does not reach, so every
parameter receives a (zero) gradient in every backward pass and DDP, built with
find_unused_parameters=False, completes a reduction per pass. The unreached set is found once per
task by walking the autograd graph of its first loss, not listed by hand. Cost: like
``find_unused`` (two forwards, two backbone backwards, two all-reduces) without the per-forward
graph walk.
"""

import torch

from mtl.strategies.base import Strategy


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors whose gradient ``loss.backward()`` would accumulate."""
    seen, reached, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return reached


class Placeholder(Strategy):
    name = "placeholder"
    summary = "per-task forward+backward, zero term over unreached params, find_unused_parameters=False"
    forwards = "K"
    per_task_forwards = True
    backbone_backwards = "K"
    allreduces = "K"
    covers_unused_parameters = True  # the zero term: a head a step does not use still gets a (zero) gradient
    fsdp2_refusal = ("it exists only for DDP's reducer (every parameter must get a gradient in every pass); under "
                     "FSDP2 the parameters outside a forward are DTensor shards, which a loss term cannot add, and "
                     "FSDP2 needs no placeholder: find_unused or accumulate do the same per-task passes")

    def __init__(self, cfg):
        super().__init__(cfg)
        self._unreached: dict[str, list[torch.nn.Parameter]] = {}

    @classmethod
    def tolerates_find_unused(cls, value):
        return True  # correct either way; True only adds the graph walk the placeholder makes unnecessary

    def forward_backward(self, s):
        params = [p for p in s.model.parameters() if p.requires_grad]
        losses = {}
        for t in s.tasks:
            loss = s.model(s.batch, tasks=[t])["losses"][t]
            if t not in self._unreached:
                reached = reached_parameters(loss)
                self._unreached[t] = [p for p in params if id(p) not in reached]
            term = s.weigh(t, loss)
            if self._unreached[t]:
                term = term + 0.0 * sum(p.view(-1)[0] for p in self._unreached[t])
            s.scale(term).backward()
            losses[t] = loss.detach()
        return losses, {}
