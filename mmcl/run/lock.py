"""One run per output directory.

Two runs writing one ``train.output_dir`` delete each other's temporary checkpoints and interleave metrics. The
main process holds an exclusive POSIX record lock (``fcntl.lockf``) on ``<output_dir>/.lock`` for the whole run.
The kernel drops it when its holder exits in any way (SIGKILL included), so a lock is never left stale; the file
names the holder's host and PID so the second run can say who has it. A file that still names a holder while the
lock is free was left by a run that ended without releasing it (killed): it is taken over with a warning.

Not ``flock``: a flock belongs to the open file, which forked children (data loader workers) share, so after a
SIGKILL of the training process its workers would hold the directory until they notice and exit; record locks
are not inherited by fork. (They are also what NFS supports.)

Only the holder removes anything: a run that fails before it writes a file removes the folder it made, this file
included, before it releases the lock (`mmcl.training.loop`). A run that opened the file just before that locks it
only once the path still names the file it locked, so two runs never hold two locks of one folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

from ..errors import StorageError, TrainingError
from ..storage.fsutil import open_inside
from ..storage.layout import LOCK


class RunLock:
    """``acquire()`` returns a warning line (a lock taken over from a killed run) or None; ``release()``.

    Record locks of one process do not exclude each other: this guards against other processes (and hosts).
    """

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        fd = self._lock()
        while not _names(self.path, fd):  # its holder removed the file (and the folder it made) before releasing it
            os.close(fd)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._lock()
        previous, self._fd = _read(fd), fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()}, PID {os.getpid()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        except OSError as err:  # a full disk: still held, for the holder to remove what it made (`release` then)
            raise StorageError(f"output directory {self.path.parent} cannot be written: {err.strerror}") from None
        if previous:
            return f"warning: took over the lock of a run that ended without releasing it ({previous})"
        return None

    def _lock(self) -> int:
        try:
            # a link there is refused; a hard-linked file is replaced by a new one of its own, never written
            fd = open_inside(self.path.parent, LOCK, os.O_RDWR | os.O_CREAT, keep_bytes=False)
        except OSError as err:
            raise StorageError(f"output directory {self.path.parent} cannot be written: {err.strerror}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise StorageError(f"cannot lock {self.path}: {err.strerror}") from None
            holder = _read(fd) or "unknown holder"
            os.close(fd)
            raise TrainingError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end or "
                                f"choose another train.output_dir") from None
        return fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty file means released cleanly; the file stays (see below)
        except OSError:
            pass
        # Left in place: removed only by its holder, with the folder it made (see the module's notes).
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def in_use(out_dir: Path) -> Optional[str]:
    """The line refusing `out_dir` when another run holds its lock (probed with a shared lock, never taken; the file
    opened without following a link or blocking), else None. Asked before the folder's contents are judged, so a
    run that is starting is "in use", not a folder of unknown files."""
    path = Path(out_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file (or not one mmcl could hold): the folder's rule judges it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                return None
            holder = _read(fd) or "unknown holder"
            return (f"{path.parent} is in use by another run ({holder}); wait for it to end or choose another "
                    f"train.output_dir")
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        st, held = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""
