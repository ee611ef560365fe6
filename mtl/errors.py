"""User-facing errors.

Anything the user can fix (config, data, checkpoints, a bad option combination) is raised as an
``MTLError``. ``train.py`` prints its message once (rank 0, or the rank that saw it) and exits with
``exit_code`` instead of a traceback from every rank.
"""


class MTLError(Exception):
    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(MTLError):
    """Bad config file, unknown key, wrong type, bad value or invalid combination (exit 2)."""

    exit_code = 2

    def __init__(self, errors):
        if isinstance(errors, str):
            errors = [errors]
        self.errors = list(errors)
        lines = ["config error" + ("s" if len(self.errors) > 1 else "") + ":"]
        lines += [f"  - {e}" for e in self.errors]
        super().__init__("\n".join(lines))


class DataError(MTLError):
    """Bad data: a missing or corrupt image, a bad manifest line, an empty caption."""

    exit_code = 3


class CheckpointError(MTLError):
    """A checkpoint that is missing, truncated, not ours, or incompatible with the config."""

    exit_code = 4


class TrainingError(MTLError):
    """Training cannot go on (too many non-finite steps, DDP reduction errors, replica divergence)."""

    exit_code = 5
