"""What changes while a run trains (mmcl/training/state.py): the progress a checkpoint saves, as plain ints that
survive any checkpoint format, and the logging window `RunState` restarts."""

import json
import time

from mmcl.training.state import RunState, TrainProgress


def test_progress_round_trips_as_plain_ints_and_reads_older_states():
    p = TrainProgress()
    assert p.state_dict() == {"step": 0, "samples": 0, "skipped_steps": 0}
    p.step, p.samples, p.skipped_steps = 12, 768, 1
    saved = json.loads(json.dumps(p.state_dict()))
    q = TrainProgress()
    q.load_state_dict(saved)
    assert q.state_dict() == {"step": 12, "samples": 768, "skipped_steps": 1}
    q.load_state_dict({"step": "3", "samples": 24.0})  # written before skipped steps were counted
    assert q.state_dict() == {"step": 3, "samples": 24, "skipped_steps": 0}
    assert all(type(v) is int for v in q.state_dict().values())


def test_a_run_state_starts_fresh_and_restarts_its_window():
    a, b = RunState(), RunState()
    assert a.progress is not b.progress and a.skips is not b.skips
    assert (a.saved_at, a.window_samples, a.data_time, a.bar) == (-1, 0, 0.0, None)
    a.window_samples, a.data_time = 64, 1.5
    before = time.perf_counter()
    a.start_window()
    assert (a.window_samples, a.data_time) == (0, 0.0) and before <= a.window_start <= time.perf_counter()
