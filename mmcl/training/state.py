"""What changes while a run trains, in one small typed object: `RunState` (with its `TrainProgress`, the part a
checkpoint saves). The loop (`mmcl.training.loop`) and the end of a run (`mmcl.training.end`) read and advance it;
the run's parts (`mmcl.training.setup.Parts`) are frozen."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional, Tuple


class TrainProgress:
    """Global progress, saved in every checkpoint's rank states as plain ints (the resumed step is read from
    there, never from a folder name; not registered with accelerate, which would pickle and unpickle it)."""

    def __init__(self):
        self.step = 0
        self.samples = 0
        self.skipped_steps = 0

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step, "samples": self.samples, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


@dataclasses.dataclass
class RunState:
    """The one state that changes during a run: the progress (saved in checkpoints), the current logging window
    (its start, samples and time waiting for data), the step of the last checkpoint this run saved, what the data
    skipped by reason at the last logged step, when this invocation began, and the progress bar once shown."""

    progress: TrainProgress = dataclasses.field(default_factory=TrainProgress)
    window_start: float = 0.0
    window_samples: int = 0
    data_time: float = 0.0
    saved_at: int = -1
    skips: Dict[str, int] = dataclasses.field(default_factory=dict)
    started: Tuple[float, int] = (0.0, 0)  # (perf_counter, samples) when this invocation's training began
    bar: Any = None  # the progress bar, from the first step on (main process, train.progress)
    window_step: int = 0  # the optimiser steps done when the current window began
    windows: int = 0  # logging windows begun
    window_total: float = 0.0  # the time of the windows ended, and their time waiting for data (the summary's share)
    data_total: float = 0.0
    said_wait: bool = False  # the data-wait warning said (once per run)
    flops: Optional[float] = None  # FLOPs of a pair forward and backward, counted at the start; None: unknown
    peak: Optional[float] = None  # the device's peak TFLOP/s in the run's precision; None: unknown

    def start_window(self) -> None:
        now = time.perf_counter()
        if self.windows:
            self.window_total += now - self.window_start
            self.data_total += self.data_time
        self.windows += 1
        self.window_start, self.window_samples, self.data_time, self.window_step = now, 0, 0.0, self.progress.step
