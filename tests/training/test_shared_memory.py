"""A data worker sends each batch as a shared-memory segment (a uint8 batch of 4096 images at 224 px is about 616 MB):
with workers, training checks at its start that /dev/shm has room for the batches in flight, and says in one line
what to change when it has not (Docker's default is 64 MB)."""

import os
import re

import pytest

from mmcl.training import preflight


class _Vfs:
    def __init__(self, free_bytes):
        self.f_frsize, self.f_bavail = 4096, free_bytes // 4096


@pytest.fixture
def shm(monkeypatch):
    """Set the free bytes /dev/shm reports (os.statvfs) for the rest of the test; other paths unchanged."""
    real = os.statvfs

    def set_free(free_bytes):
        monkeypatch.setattr(os.path, "isdir", lambda p, _real=os.path.isdir: p == "/dev/shm" or _real(p))
        monkeypatch.setattr(os, "statvfs", lambda p: _Vfs(free_bytes) if p == "/dev/shm" else real(p))

    return set_free


def test_a_batch_of_4096_uint8_images_at_224_px_is_about_616_mb(shm):
    shm(64 * 10 ** 6)
    line = preflight.shared_memory_problem(4096, 224, 3, 1, workers=1, prefetch=1)
    assert line.startswith("/dev/shm has 64 MB free; data.workers=1 with batches of 4096 images need about 617 MB")
    assert "--shm-size=1g or lower data.workers/data.batch_size" in line


def test_enough_space_or_no_workers_is_no_problem(shm):
    shm(64 * 10 ** 9)
    assert preflight.shared_memory_problem(4096, 224, 3, 1, workers=8) is None
    shm(1)
    assert preflight.shared_memory_problem(4096, 224, 3, 1, workers=0) is None


def test_the_need_counts_workers_prefetch_processes_and_float_batches(shm):
    shm(10 ** 6)
    line = preflight.shared_memory_problem(64, (32, 48), 3, 4, workers=3, processes=2)
    need = 64 * 3 * 32 * 48 * 4 * 3 * preflight.PREFETCH * 2
    assert f"need about {-(-need // 10 ** 6)} MB" in line and "x 2 processes" in line


def test_training_with_workers_and_a_small_dev_shm_stops_with_one_line(demo, tmp_path, shm, capsys):
    from mmcl.cli import main

    from helpers import run_args

    shm(2 * 10 ** 6)  # batches of 64 uint8 images at 64 px: about 0.8 MB each, 4 in flight
    code = main(["train", *run_args(demo, tmp_path / "run", "data.workers=2", "data.batch_size=64")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1, err
    assert re.fullmatch(r"mmcl: error: /dev/shm has 1 MB free; data\.workers=2 with batches of 64 images need "
                        r"about \d+ MB .*: run docker with --shm-size=\d+g or lower data\.workers/data\.batch_size",
                        err[0]), err[0]
