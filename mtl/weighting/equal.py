"""Equal weighting: every task's loss counts once. The baseline every method is compared with."""

from mtl.weighting.base import Weighting


class Equal(Weighting):
    name = "equal"
