"""Stopping on a scheduler's signal at a step boundary instead of dying mid-step.

SLURM (``--signal``, and SIGTERM before its SIGKILL), Kubernetes and spot instances give a running job a signal
and a grace period. `StopSignals` turns SIGTERM, SIGUSR1 and SIGINT into a flag; the training loop all-reduces
it with the per-step finite-loss flag (no extra collective), so every process stops after the same step, saves a
checkpoint and exits with `exit_code`. A checkpoint save in progress is never interrupted: the handler only sets
the flag. A second SIGINT (Ctrl-C pressed twice) stops at once: it raises KeyboardInterrupt.
"""

from __future__ import annotations

import signal
import threading
from typing import Dict, Optional

# EX_TEMPFAIL (sysexits.h): "temporary failure, try again"; the code a requeueing script checks. Ctrl-C keeps the
# shell's 128 + SIGINT, since a user who stopped a run by hand does not want it requeued.
REQUEUE_EXIT_CODE = 75
INTERRUPT_EXIT_CODE = 130
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """Context manager: while active, SIGTERM/SIGUSR1/SIGINT set `received` (the first signal's name)."""

    def __init__(self):
        self.received: Optional[str] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.received is not None
