"""User-facing error types. `cli.main` turns any `MmclError` into one line and exit code 2."""


class MmclError(Exception):
    """An error caused by the user's input (config, data, paths), reported without a traceback.

    `quiet` is set on the other processes of a multi-process run, so that the line is printed once (by rank 0).
    """

    quiet = False


class ConfigError(MmclError):
    """A config file, key or value is invalid."""


class DataError(MmclError):
    """Input data is missing, empty or unreadable."""


class CheckpointError(MmclError):
    """A checkpoint or saved model cannot be used."""


class StorageError(MmclError):
    """An output path cannot be written: read-only, no space left, no permission."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or altered (it is kept; resume uses an older one)."""


class TrainingError(MmclError):
    """Training cannot go on (e.g. the loss became non-finite)."""


class RunStopped(Exception):
    """Training stopped early on a signal after saving a checkpoint; re-running the same command resumes.

    Not an error: ``cli.main`` prints the message as one line (no ``error:``) and exits with `exit_code`, which
    tells a requeueing script what happened (75, EX_TEMPFAIL from sysexits.h, for SIGTERM/SIGUSR1; 130 for SIGINT).
    """

    quiet = False

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
