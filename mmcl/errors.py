"""User-facing error types. `cli.main` turns any `MmclError` into one line and exit code 2."""


class MmclError(Exception):
    """An error caused by the user's input (config, data, paths), reported without a traceback."""


class ConfigError(MmclError):
    """A config file, key or value is invalid."""


class DataError(MmclError):
    """Input data is missing, empty or unreadable."""


class CheckpointError(MmclError):
    """A checkpoint or saved model cannot be used."""


class TrainingError(MmclError):
    """Training cannot go on (e.g. the loss became non-finite)."""
