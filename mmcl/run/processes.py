"""Processes agree on failure before the next collective.

When one process raises (a refused resume, a full disk during its part of a save) while the others go on to a
barrier or an all-reduce, those others would wait for it and die much later with a long "connection closed by
peer" traceback. `agreed` runs a block on every process, then exchanges one small object per process: if any
block raised, every process raises, and rank 0 raises the failing process's own error type and message, so the
run ends with that one line.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list, gather_object

from .. import errors


def _describe(err: BaseException) -> Tuple[str, str, bool]:
    return type(err).__name__, str(err), isinstance(err, errors.MmclError)


def agreed(accelerator, fn: Callable[[], Any]) -> Any:
    """Return ``fn()`` when it succeeded on every process; otherwise raise on every process.

    The process whose `fn` raised re-raises its own exception. The others raise the same `MmclError` subclass
    with the same message (a bug elsewhere, i.e. not an `MmclError`, becomes a `TrainingError` naming the failed
    process; the failing process keeps its traceback). Costs one ``all_gather_object`` per call: use it at
    setup, checkpoint save and load, never per step.
    """
    failure: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - every failure must be agreed on, or the others hang
        failure = err
    if accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return result

    reports = gather_object([None if failure is None else (accelerator.process_index, *_describe(failure))])
    failed = [r for r in reports if r is not None]
    if not failed:
        return result
    rank, kind, message, user_error = failed[0]
    if user_error:
        cls = getattr(errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.MmclError)):
            cls = errors.MmclError
        agreed_error = cls(message)
    else:
        agreed_error = errors.TrainingError(f"process {rank} failed with {kind}: {message}")
    if failure is not None and (not isinstance(failure, errors.MmclError) or accelerator.process_index != 0):
        # A bug keeps its traceback on the process where it happened; an MmclError is printed by rank 0 only.
        if isinstance(failure, errors.MmclError):
            failure.everywhere = True
        raise failure
    agreed_error.everywhere = True
    raise agreed_error


# How gloo and NCCL word a collective that failed because another process is gone or stopped answering.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "NCCL error", "ProcessGroupNCCL", "Watchdog caught collective operation timeout", "Timed out waiting")


def lost_peer(err: BaseException) -> Optional[str]:
    """When `err` is a collective failing because another process is gone (or did not answer within the
    group's timeout), a short description of it, else None.

    A process that dies (an error outside an agreed block, a SIGKILL) leaves the others in their next collective;
    gloo then raises a RuntimeError such as ``[.../pair.cc:545] Read error [127.0.0.1]:47234: Connection reset
    by peer. This is typically caused by ...`` or ``[.../unbound_buffer.cc:81] Timed out waiting 1800000ms for
    recv operation to complete``; NCCL a ``DistBackendError`` such as ``NCCL error in: .../ProcessGroupNCCL.cpp:
    ..., remote process exited or there was a network error`` or its watchdog's ``Watchdog caught collective
    operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, ...) ran for 600010 milliseconds before timing out``.
    """

    text = str(err)
    if not (isinstance(err, getattr(dist, "DistError", ())) or any(s in text for s in _PEER_GONE)):
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else type(err).__name__)
    return first.split(". This is typically")[0]


def timed_out(description: str) -> bool:
    """Whether a `lost_peer` description is a collective's timeout (the peer may still be running) rather than a
    closed connection."""
    return bool(re.search(r"time(d)? ?out|timing out", description, re.IGNORECASE))


_WAIT_GROUPS: Dict[float, Any] = {}


@contextlib.contextmanager
def others_wait(accelerator, timeout_s: float) -> Iterator[None]:
    """For work on the main process alone (its evaluation, model/ save and plots): at the end of the block the
    other processes wait for it, up to `timeout_s`.

    In the default group the others would sit in the next collective (an all-reduce, a barrier) under that
    group's timeout, NCCL's 10 minutes by default: an ImageNet-size evaluation would end the run. They wait
    instead in a barrier of a separate CPU group (gloo, made once per timeout, on entry, while every process is
    still here) whose own timeout covers the work, so no default-group collective is pending meanwhile. A main
    process that fails or dies still ends the wait at once (its connections close). Every process must enter the
    block.
    """
    if accelerator.num_processes == 1:
        yield
        return


    group = _WAIT_GROUPS.get(timeout_s)
    if group is None:
        group = _WAIT_GROUPS[timeout_s] = dist.new_group(backend="gloo",
                                                         timeout=datetime.timedelta(seconds=timeout_s))
    yield
    dist.barrier(group=group)  # not after a failure: the others then learn of it when this process ends


def any_process(accelerator, flag: bool) -> bool:
    """True on every process when `flag` is true on at least one (one small all-reduce)."""
    if accelerator.num_processes == 1:
        return flag

    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def broadcast_from_main(accelerator, value: Any) -> Any:
    """The main process's `value` on every process."""
    if accelerator.num_processes == 1:
        return value

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]
