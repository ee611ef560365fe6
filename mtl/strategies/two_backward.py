"""``two_backward``: the naive pattern, kept to reproduce its failure. Refused unless ``ddp.unsafe=true``.

One shared forward, then ``l_cls.backward(retain_graph=True); l_gen.backward()``. Correct in one
process; under DDP the backbone parameters get a gradient in both passes and the reducer raises
"Expected to mark a variable ready only once" (find_unused_parameters=False), or worse (see
docs/strategies.md). ``feature_leaf`` is the working version of this idea.
"""

from mtl.strategies.base import Strategy, detached


class TwoBackward(Strategy):
    name = "two_backward"
    summary = "UNSAFE under DDP: one shared forward, one backward per task through the shared graph"
    backbone_backwards = "K"
    allreduces = 0  # it never completes one
    unsafe = True
    fsdp2_refusal = "it is kept only to reproduce a DDP failure (ddp.unsafe=true) and is not ported to FSDP2"

    @classmethod
    def check(cls, cfg):
        errors = super().check(cfg)
        if not cfg.ddp.unsafe:
            errors.append("ddp.strategy: two_backward fails under DDP (\"Expected to mark a variable ready only once\"): "
                          "the backbone gets a gradient from each backward pass. Use ddp.strategy=feature_leaf (same "
                          "idea, one backbone backward), or set ddp.unsafe=true to reproduce the failure")
        return errors

    def forward_backward(self, s):
        losses = s.model(s.batch)["losses"]
        for i, t in enumerate(s.tasks):
            s.scale(s.weigh(t, losses[t])).backward(retain_graph=i < len(s.tasks) - 1)
        return detached(losses), {}
