"""``detach``: graph detachment. One shared forward; only the owner task trains the backbone.

The heads of the other tasks read ``features.detach()``, so their losses train their heads only.
This CHANGES THE OBJECTIVE: the backbone gets the owner's gradient alone (``ddp.detach_owner``),
the other tasks learn on whatever features the owner's task makes. It is not the combined-loss
gradient. Use it when one task is primary and the others are read-outs. One all-reduce per step,
spread over the backward passes (every parameter still gets exactly one gradient).
"""

from mtl.strategies.base import Strategy, detached


class Detach(Strategy):
    name = "detach"
    reads = ("ddp.detach_owner",)  # shared keys it reads (mtl/config/read_rules.py)
    summary = "one forward; non-owner heads read detached features (changes the objective)"
    changes_objective = True

    @classmethod
    def check(cls, cfg):
        errors = super().check(cfg)
        if cfg.ddp.detach_owner not in cfg.tasks:
            errors.append(f"ddp.detach_owner: {cfg.ddp.detach_owner!r} is not a task of this run "
                          f"(tasks: {', '.join(cfg.tasks)})")
        return errors

    def forward_backward(self, s):
        owner = self.cfg.ddp.detach_owner
        others = [t for t in s.tasks if t != owner]
        losses = s.model(s.batch, detach=others)["losses"]
        for t in others + [owner]:  # the owner's pass, through the backbone, goes last
            s.scale(s.weigh(t, losses[t])).backward(retain_graph=t != owner)
        return detached(losses), {}
