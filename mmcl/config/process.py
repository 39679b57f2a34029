"""The process world: this process's place in its launch, read from the launcher's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE) here and nowhere else, and what follows from it before any distributed state exists
(the main process, the one that speaks: `say`; the data workers a process may start)."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple, Optional

from ..errors import printable


class World(NamedTuple):
    rank: int
    local_rank: int
    size: int  # processes in the run
    local_size: int  # processes on this machine


def world() -> World:
    """This process's place in its launch, as the launcher (accelerate launch, torchrun) sets it in the environment:
    read here alone, as it is known before accelerate's state exists (and where it never does). No launcher: one
    process."""
    env = os.environ
    return World(int(env.get("RANK") or 0), int(env.get("LOCAL_RANK") or 0), int(env.get("WORLD_SIZE") or 1),
                 int(env.get("LOCAL_WORLD_SIZE") or 1))


def is_main_process() -> bool:
    """Whether this is the launch's main process (rank 0), the one that says what every process finds alike: the
    rank of torch.distributed's group where one is set up (accelerate's ``is_main_process`` reads the same), else
    the launcher's RANK. Never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return world().rank == 0


def say(line: str, warning: bool = False) -> None:
    """The one way mmcl says a line on the console: ``mmcl: <line>`` (``mmcl: warning: <line>`` on stderr, which
    keeps a command's results on stdout clean), its text escaped (`printable`: what came from a file cannot move the
    cursor), on the main process alone (what every process finds alike is said once), flushed so that it is in order
    with the progress bar's redraws and in out.log."""
    if is_main_process():
        print(printable(f"mmcl: warning: {line}" if warning else f"mmcl: {line}"),
              file=sys.stderr if warning else sys.stdout, flush=True)


def data_workers(configured: Optional[int]) -> int:
    """``data.workers``: a set value as it is; null: the CPUs this process may run on, shared by the processes on
    its machine (LOCAL_WORLD_SIZE), less one for the training thread, at least 1. No fixed cap: a GPU step of
    ViT-B-32 in bf16 takes more than 16 workers' JPEGs (BENCHMARKS.md, GPU), so every CPU a process is given goes
    to its loader."""
    if configured is not None:
        return int(configured)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // world().local_size - 1)

