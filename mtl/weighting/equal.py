"""Equal weighting: every task's loss counts once. The baseline every method is compared with."""

from mtl.weighting.base import LossWeighting


class Equal(LossWeighting):
    name = "equal"
