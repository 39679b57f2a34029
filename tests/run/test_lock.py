"""mmcl.run.lock: one run per output folder. The lock names its holder, is refused to another process
with that name in the message, is left as an empty file on release, and a file naming a holder whose lock is free
(a killed run) is taken over with a warning."""

import os
import subprocess
import sys

import pytest

from mmcl.errors import TrainingError
from mmcl.run.lock import RunLock
from mmcl.storage.layout import LOCK as LOCK_NAME

HOLD = """
import sys
from mmcl.run.lock import RunLock
lock = RunLock(sys.argv[1])
assert lock.acquire() is None
print("held", flush=True)
sys.stdin.readline()
lock.release()
"""


def test_acquire_names_this_process_and_release_leaves_an_empty_file(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and lock.held
    assert f"PID {os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
    lock.release()
    assert not lock.held and (tmp_path / LOCK_NAME).read_text() == ""
    with RunLock(tmp_path) as again:
        assert again.acquire() is None  # released cleanly: nothing to take over
    assert not again.held


def test_another_process_holding_the_folder_is_named_in_the_refusal(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainingError, match=rf"is in use by another run \(host .*, PID {holder.pid}, since "):
            RunLock(tmp_path).acquire()
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    assert RunLock(tmp_path).acquire() is None  # free once its holder ended


def test_a_lock_file_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path):
    (tmp_path / LOCK_NAME).write_text("host elsewhere, PID 4242, since 2026-01-01 00:00:00")
    lock = RunLock(tmp_path)
    said = lock.acquire()
    assert said == ("warning: took over the lock of a run that ended without releasing it "
                    "(host elsewhere, PID 4242, since 2026-01-01 00:00:00)")
    assert f"PID {os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
    lock.release()
