"""Shared ending for test workers started with torch.multiprocessing.spawn over gloo.

A gloo process group's C++ worker threads can abort the process (SIGABRT, "terminate called without an active
exception") while the interpreter finalises, even after a clean ``destroy_process_group``. A worker whose results
are already on disk then fails the test for a reason that has nothing to do with what it checks. ``end_worker``
makes every rank finish its communication, tears the group down, flushes, and leaves without running the
interpreter's finalisers; an exception raised before it still fails the test through spawn's error file.
"""

import os
import socket
import sys

import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_worker():
    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while a peer still sends to it
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
