"""CPU seconds of a process tree, read from /proc (Linux), shared by the benchmarks.

On a machine shared with other jobs, wall time depends on what else runs; the CPU time a process and its
data-loader workers use per sample measures the work itself.
"""

from __future__ import annotations

import os
from typing import Tuple

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(root: int) -> Tuple[float, float]:
    """(user + system CPU seconds of process `root`, the same summed over all its live descendants)."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        # After the command name: state ppid ... utime (11th) stime (12th), counted from the state field.
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    members, frontier = {root}, [root]
    while frontier:
        nxt = [p for p, pp in parent.items() if pp in frontier and p not in members]
        members.update(nxt)
        frontier = nxt
    return cpu.get(root, 0.0), sum(cpu.get(p, 0.0) for p in members if p != root)
