"""Stopping on a scheduler's signal at a step boundary instead of dying mid-step.

SLURM (``--signal``, and SIGTERM before its SIGKILL), Kubernetes and spot instances give a running job a signal
and a grace period. `StopSignals` turns SIGTERM, SIGUSR1 and SIGINT into a flag; the training loop all-reduces
it with the per-step finite-loss flag (no extra collective), so every process stops after the same step, saves a
checkpoint and exits with `exit_code`. A checkpoint save in progress is never interrupted: the handler only sets
the flag. A second SIGINT (Ctrl-C pressed twice) stops at once: it raises KeyboardInterrupt.

A data read that does not return (a shard on a hung network mount, a ``pipe:`` command that stalls) never holds a
stop back past the grace period: when a signal finds the loop waiting for data, or the loop starts waiting after one,
and that wait is still going on `DATA_GRACE_S` seconds later, the process says so in one line, ends its data workers
and exits with `exit_code` without a new checkpoint (the last one saved stays; re-running resumes from it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import threading
import warnings
from typing import Dict, Iterator, List, Optional

import torch
from accelerate.commands.config import default_config_file
from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ..config import say
from ..errors import ConfigError

# EX_TEMPFAIL (sysexits.h): "temporary failure, try again"; the code a requeueing script checks. Ctrl-C keeps the
# shell's 128 + SIGINT, since a user who stopped a run by hand does not want it requeued.
REQUEUE_EXIT_CODE = 75
INTERRUPT_EXIT_CODE = 130
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# How long a stop waits for a data read in progress: well inside SLURM's default grace (KillWait, 30 s).
DATA_GRACE_S = 10.0


def exit_code(received: str) -> int:
    """The exit code of a run stopped by the signal named `received` (SIGINT, SIGTERM...)."""
    return INTERRUPT_EXIT_CODE if received == "SIGINT" else REQUEUE_EXIT_CODE


def launch(argv: List[str]) -> int:
    """``accelerate launch ARGV`` in this process, ending as its training processes did, without a traceback.

    accelerate's launcher (torch elastic's agent, as torchrun) forwards a SIGINT or SIGTERM it gets to the training
    processes, waits for them, then raises ``SignalException`` (and ``ChildFailedError`` when a process exits
    non-zero): a traceback and exit code 1 whatever the processes did. Here the processes have already said what
    happened in one line, so the launcher exits with their code: `exit_code` of the signal it passed on, the code
    the processes agree on, else 1.
    """

    try:
        launch_command(_launch_args(launch_command_parser().parse_args(argv)))
    except SignalException as err:
        return exit_code(err.sigval.name)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1
    except subprocess.CalledProcessError as err:  # one process: accelerate runs it as a plain subprocess
        return err.returncode if err.returncode > 0 else 1
    return 0


def _launch_args(args):
    """accelerate launch's parsed `args`, checked and completed where accelerate would do what was not asked.

    A script that is not a file (``mmcl`` without ``-m`` before it) is one error line, not Python's "can't open
    file" from every process. ``--num_processes N`` without a launch file on a machine without GPUs starts N CPU
    processes (accelerate alone would start one, silently), with a line saying so; with fewer GPUs than asked, a
    warning gives both numbers.
    """
    script = args.training_script
    if not args.module and not args.no_python and not os.path.isfile(script):
        hint = f" (to run mmcl, put -m before it: ... -m {script} train --config ...)" if script == "mmcl" else ""
        raise ConfigError(f"mmcl launch: the training script {script} is not a file{hint}")
    asked = args.num_processes or 0
    if (asked < 2 or args.config_file or os.path.isfile(default_config_file) or args.multi_gpu or args.use_fsdp
            or args.use_deepspeed or args.tpu or (args.num_machines or 1) > 1):
        return args
    if torch.cuda.is_available():
        if torch.cuda.device_count() < asked:
            warnings.warn(f"--num_processes {asked} without a launch file: this machine has "
                          f"{torch.cuda.device_count()} GPU(s), and accelerate starts one process per GPU")
        return args
    args.multi_gpu, args.cpu, args.use_cpu = True, False, True  # torchrun's launcher, each process on the CPU (gloo)
    say(f"launching {asked} CPU processes (--num_processes {asked} without a launch file; accelerate alone would "
        f"start 1 on a machine without GPUs)")
    return args


class StopSignals:
    """Context manager: while active, SIGTERM/SIGUSR1/SIGINT set `received` (the first signal's name)."""

    def __init__(self, data_grace_s: float = DATA_GRACE_S):
        self.received: Optional[str] = None
        self.data_grace_s = data_grace_s
        self._previous: Dict[int, object] = {}
        self._waiting: Optional[object] = None  # a token for the data wait in progress

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            if self._waiting is not None:
                self._watch(self._waiting)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        """Around a read of the next batches: a stop requested during it (or before it) ends the process once the
        read has not returned for `data_grace_s` seconds (see the module's text)."""
        token = self._waiting = object()
        if self.received is not None:
            self._watch(token)
        try:
            yield
        finally:
            self._waiting = None

    def _watch(self, token: object) -> None:
        timer = threading.Timer(self.data_grace_s, self._expire, args=(token,))
        timer.daemon = True
        timer.start()

    def _expire(self, token: object) -> None:
        if self._waiting is not token:  # the read returned: the loop stops at its step boundary
            return
        say(f"stopped ({self.received}) while waiting for data: the read in progress did not return within "
            f"{self.data_grace_s:g} s of the signal, so no checkpoint was saved now (the last one saved is kept); "
            f"re-run the same command to resume")
        for child in multiprocessing.active_children():  # the data workers, maybe blocked in the same read
            child.kill()
        os._exit(exit_code(self.received or "SIGTERM"))

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
