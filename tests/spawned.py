"""Starting (`spawn`) and ending (`end_worker`) test workers that talk over gloo.

A gloo process group's C++ worker threads can abort the process (SIGABRT, "terminate called without an active
exception") while the interpreter finalises, even after a clean ``destroy_process_group``. A worker whose results
are already on disk then fails the test for a reason that has nothing to do with what it checks. ``end_worker``
makes every rank finish its communication, tears the group down, flushes, and leaves without running the
interpreter's finalisers; an exception raised before it still fails the test through spawn's error file.
"""

import multiprocessing
import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

# What every worker imports anyway. A fork server started once per test process imports them, and each worker is
# forked from it: a worker starts in milliseconds instead of re-importing torch, open_clip and mmcl (seconds of CPU
# per process, most of a small multi-process test's cost under the default "spawn" start).
_PRELOAD = ["torch", "torch.distributed", "open_clip", "accelerate", "mmcl.losses", "mmcl.training.loop", "helpers"]


def spawn(fn, args=(), nprocs=2):
    """`torch.multiprocessing.spawn(fn, args, nprocs, join=True)` from a fork server with the heavy imports done.

    A worker sees the environment and working directory the fork server started with (the first call's), not the
    caller's at the time of the call: pass what a worker needs through ``args``."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


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


def _ddp_worker(rank, run, world, port, path):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.save(run(DistributedDataParallel, rank, world), f"{path}/rank{rank}.pt")
    end_worker()


def ranks_match_one_process(run, world, path):
    """`run(wrap, rank, world)` (a module-level function: it is pickled by name) on `world` gloo processes, each
    wrapping its model in DDP, against `run(identity, 0, 1)` in this process. `run` returns {case: (logged terms,
    {parameter: gradient})}; every rank's terms (the uniformity metrics aside, which read each rank's rows) and
    gradients must equal the single process's to float64 precision. Returns the single process's results."""
    import math

    import pytest
    import torch

    spawn(_ddp_worker, args=(run, world, free_port(), str(path)), nprocs=world)
    reference = run(lambda m: m, 0, 1)
    for rank in range(world):
        got = torch.load(f"{path}/rank{rank}.pt")
        for name, (terms, grads) in reference.items():
            got_terms, got_grads = got[name]
            for key, value in terms.items():
                if not key.startswith("uniform_"):
                    assert got_terms[key] == pytest.approx(value, rel=1e-10, abs=1e-12), (rank, name, key)
            for key, grad in grads.items():
                torch.testing.assert_close(got_grads[key], grad, rtol=1e-9, atol=1e-12, msg=f"{rank} {name} {key}")
            assert math.isfinite(terms["loss"])
    return reference
