"""Static weighting: fixed per-task weights from YAML (``weighting.weights: {cls: 1.0, gen: 0.5}``)."""

from mtl.weighting.base import LossWeighting


class Static(LossWeighting):
    name = "static"
    reads = ("weighting.weights",)  # shared keys it reads (mtl/config/read_rules.py)

    def __init__(self, cfg, tasks):
        super().__init__(cfg, tasks)
        self._weights = {t: float(cfg.weighting.weights[t]) for t in self.tasks}

    @classmethod
    def check(cls, cfg):
        given = dict(cfg.weighting.weights)
        errors = []
        missing = [t for t in cfg.tasks if t not in given]
        if missing:
            errors.append(f"weighting.weights: static weighting needs a weight for every task; missing "
                          f"{', '.join(missing)} (e.g. weighting.weights.{missing[0]}=1.0)")
        extra = [t for t in given if t not in cfg.tasks]
        if extra:
            errors.append(f"weighting.weights: {', '.join(extra)} is not a task of this run (tasks: {list(cfg.tasks)})")
        negative = [t for t, w in given.items() if w < 0]
        if negative:
            errors.append(f"weighting.weights: weights must be >= 0 (got {', '.join(negative)} < 0)")
        return errors

    def weights(self):
        return dict(self._weights)
