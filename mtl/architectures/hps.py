"""``hps``: hard parameter sharing (Caruana 1997). Every head reads the backbone's features; the trunk is the
backbone itself and there are no towers, so the model, its parameter names and its checkpoints are those of a run
that names no architecture."""

from mtl.architectures.base import Architecture


class HardSharing(Architecture):
    name = "hps"
    summary = "one shared backbone, a head per task"

    @classmethod
    def build(cls, backbone, tasks, feature_shape, options, cfg):
        return backbone, {}
