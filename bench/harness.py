"""The timing harness shared by the benchmarks: CPU accounting, log-arrival timing, process groups held and
resumed in turn, and each run's own clock of running time.

- `tree_cpu_seconds`: CPU seconds of a process and its live descendants (data-loader workers), read from /proc.
  On a machine shared with other jobs, wall time depends on what else runs; the CPU time per sample measures
  the work itself.
- `LineTimer`: stamps each new line of a growing log file with the time it was first seen and that CPU reading.
- `steady_rate`, `common_interval`: samples/s and CPU ms per sample over a run's steady-state window.
- `Run`: a subprocess in its own process group, its log being timed.
- `Slicer`: only one run's process group at a time may run (the others held with SIGSTOP), in turns of a few
  seconds; `running_time` / `on_own_clock` then put each run's records on its own clock of running time.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# ------------------------------------------------------------------------------------------- CPU accounting
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


# ------------------------------------------------------------------------------------------ log-arrival timer
class LineTimer:
    """Polls a growing text file; stamps each complete new line with the monotonic time it was first seen
    and the CPU seconds used so far by the process tree of `pid`."""

    def __init__(self, path: Path, pid: int, interval: float = 0.005):
        self.path, self.pid, self.interval = path, pid, interval
        self.lines: List[Tuple[float, Tuple[float, float], str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LineTimer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()  # the thread reads the file once more after the stop flag, so nothing is missed

    def _run(self) -> None:
        offset, partial = 0, b""
        while True:
            stopping = self._stop.is_set()
            try:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            if chunk:
                now = time.monotonic()
                cpu = tree_cpu_seconds(self.pid) if not stopping else (float("nan"), float("nan"))
                offset += len(chunk)
                data = partial + chunk
                *complete, partial = data.split(b"\n")
                self.lines += [(now, cpu, ln.decode("utf-8", "replace")) for ln in complete if ln.strip()]
            if stopping:
                return
            time.sleep(self.interval)


def steady_rate(points: List[Tuple[float, Tuple[float, float], int]], skip_samples: int,
                interval: Optional[Tuple[float, float]] = None) -> Dict[str, float]:
    """samples/s and CPU ms per sample over the steady-state window of one run's log records.

    Without `interval`: from the first record with samples >= skip_samples to the last record. With `interval`
    (t0, t1): over exactly that span, the samples and CPU seconds at t0 and t1 interpolated linearly between
    the records around them (used to give two concurrent runs the same window).
    """
    # A line first seen after the process exited has no CPU reading; such a line only ends a run.
    window = sorted((p for p in points if p[2] >= skip_samples and math.isfinite(p[1][0])), key=lambda p: p[0])
    if len(window) < 2:
        raise RuntimeError(f"too few log records after the warm-up window ({len(window)}): {points}")
    if interval is None:
        (t0, c0, s0), (t1, c1, s1) = window[0], window[-1]
    else:
        t0, t1 = interval

        def at(t: float) -> Tuple[Tuple[float, float], float]:
            for (ta, ca, sa), (tb, cb, sb) in zip(window, window[1:]):
                if ta <= t <= tb:
                    w = (t - ta) / (tb - ta) if tb > ta else 0.0
                    return (ca[0] + w * (cb[0] - ca[0]), ca[1] + w * (cb[1] - ca[1])), sa + w * (sb - sa)
            raise RuntimeError(f"time {t} outside the records' span {window[0][0]}..{window[-1][0]}")

        (c0, s0), (c1, s1) = at(t0), at(t1)
    main_ms = 1000.0 * (c1[0] - c0[0]) / (s1 - s0)
    workers_ms = 1000.0 * (c1[1] - c0[1]) / (s1 - s0)
    return {"samples_per_s": (s1 - s0) / (t1 - t0), "cpu_ms_per_sample": main_ms + workers_ms,
            "main_cpu_ms_per_sample": main_ms, "workers_cpu_ms_per_sample": workers_ms,
            "window_samples": s1 - s0, "window_s": t1 - t0}


def common_interval(runs_points: List[List[Tuple[float, Tuple[float, float], int]]], skips: List[int]
                    ) -> Tuple[float, float]:
    """The span in which every run is past its warm-up and still logging: (latest first, earliest last) time."""
    spans = []
    for points, skip_samples in zip(runs_points, skips):
        ts = [p[0] for p in points if p[2] >= skip_samples and math.isfinite(p[1][0])]
        if len(ts) < 2:
            raise RuntimeError(f"too few log records after the warm-up window ({len(ts)})")
        spans.append((min(ts), max(ts)))
    t0, t1 = max(s[0] for s in spans), min(s[1] for s in spans)
    if t1 <= t0:
        raise RuntimeError("the concurrent runs' steady-state windows do not overlap; use more --steps")
    return t0, t1


class Run:
    """A subprocess (run from directory `cwd`) whose log records are being timed (see `LineTimer`)."""

    def __init__(self, name: str, cmd: List[str], log_path: Path, env: Dict[str, str], out: Path, cwd: Path):
        self.name, self.cmd, self.out = name, cmd, out
        self.t0 = time.monotonic()
        self.sink = open(out, "w")
        # Its own process group (with its data-loader workers), so that `Slicer` can hold and resume it whole.
        self.proc = subprocess.Popen(cmd, stdout=self.sink, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        self.timer = LineTimer(log_path, self.proc.pid).__enter__()
        self.running: Optional[List[Tuple[float, float]]] = None  # set by `Slicer`: the spans it ran in

    def finish(self, stop: bool = False) -> Tuple[List[Tuple[float, Tuple[float, float], str]], float]:
        """Wait for the process (or end it when `stop`); returns (stamped log lines, wall seconds)."""
        if stop:
            self.timer.__exit__(None, None, None)  # the last reading is taken while the process still runs
            self.proc.terminate()
            signal_group(self.proc, signal.SIGCONT)  # a held process acts on SIGTERM only once resumed
            self.proc.wait()
            self.sink.close()
            return self.timer.lines, time.monotonic() - self.t0
        code = self.proc.wait()
        wall = time.monotonic() - self.t0
        self.timer.__exit__(None, None, None)
        self.sink.close()
        if code != 0:
            raise RuntimeError(f"{self.name} failed with exit code {code}:\n{self.out.read_text()[-3000:]}")
        return self.timer.lines, wall


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group of `proc` (started with its own session); a group already gone is fine."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Slicer:
    """Lets one run's process group at a time use the machine, `slice_s` seconds each, in turn.

    `run` goes on until every run in `finite` has exited; the others (the endless pure-step loop) are held from
    then on. Each run's ``running`` is the list of (start, end) monotonic spans in which it was allowed to run.
    """

    def __init__(self, runs: List[Run], finite: List[Run], slice_s: float):
        self.runs, self.finite, self.slice_s = runs, finite, slice_s
        for run in runs:
            run.running = []
            signal_group(run.proc, signal.SIGSTOP)

    def run(self) -> None:
        live = list(self.runs)
        turn = 0
        while any(r.proc.poll() is None for r in self.finite) and live:
            run = live[turn % len(live)]
            signal_group(run.proc, signal.SIGCONT)
            start = time.monotonic()
            try:
                run.proc.wait(timeout=self.slice_s)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
                signal_group(run.proc, signal.SIGSTOP)
            run.running.append((start, time.monotonic()))
            if exited:
                live.remove(run)
            else:
                turn += 1


def running_time(spans: List[Tuple[float, float]], t: float) -> float:
    """Seconds a sliced run had been allowed to run by monotonic time `t` (its own clock)."""
    return sum(min(b, t) - a for a, b in spans if a < t)


def on_own_clock(run: Run, points: List[Tuple[float, Tuple[float, float], int]]
                 ) -> List[Tuple[float, Tuple[float, float], int]]:
    """A sliced run's records with their times on its own running-time clock (unchanged for other runs)."""
    if run.running is None:
        return points
    return [(running_time(run.running, t), cpu, n) for t, cpu, n in points]
