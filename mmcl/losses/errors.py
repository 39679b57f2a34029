"""`LossInputError`: the one exception the losses raise, for tensors or arguments they cannot take.

The losses import torch and nothing else of mmcl: a caller that meets users (training, the command line) turns
this error into its own one-line error; configuration values are checked before any loss is built
(`mmcl.config.validate`).
"""


class LossInputError(ValueError):
    """Bad tensors or arguments given to a loss function or the objective (shape, dtype, range)."""
