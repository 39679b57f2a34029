"""Writing outputs so that a kill at any moment leaves either the old or the new version, never half of one, and
never deletes a file the user put in an output directory.

An output directory (a saved model, an export, an index) is written complete into a temporary directory beside
it, then swapped in by two renames. The files of the old directory that mmcl did not write (a ``results.json``
the user added, notes, their own subfolders) are hard-linked into the new directory before the swap (copied
where the filesystem has no hard links), so they survive it unchanged. New directories get the mode the user's
umask gives (``os.mkdir``); a directory replaced keeps the mode it had.

Temporary names carry the host and PID of their writer, so a later write to the same place can tell leftovers
of a killed process from those of a running one: it removes them, and puts an old directory back when the kill
came between the two renames.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Set

from ..errors import ConfigError


def _owner_tag() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_leftovers(out_dir: Path, kind: str) -> List[Path]:
    """Siblings ``.NAME.<kind>-<host>-<pid>[-<random>]`` of `out_dir` left by a process of this host that is gone."""
    prefix = f".{out_dir.name}.{kind}-{socket.gethostname().split('.')[0]}-"  # host names may hold '-'
    out = []
    try:
        names = os.listdir(out_dir.parent)
    except OSError:
        return []
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            out.append(out_dir.parent / name)
    return out


def recover(out_dir: Path) -> None:
    """Undo what a killed writer of `out_dir` left: an old version moved aside is put back when `out_dir` is
    missing (the kill came between the two renames) and deleted otherwise; unfinished temporary dirs are deleted."""
    for old in sorted(_dead_leftovers(out_dir, "old")):
        if not out_dir.exists():
            os.replace(old, out_dir)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in _dead_leftovers(out_dir, "tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def output_dir(path) -> Path:
    """The directory an output path names: a symlink's target (the swap then replaces the target's contents and
    leaves the user's link as it is), else the path itself."""
    path = Path(path)
    return path.resolve() if path.is_symlink() else path


def new_temp_dir(out_dir: Path) -> Path:
    """An empty directory beside `out_dir` (same filesystem, so the final rename is atomic).

    Created by ``os.mkdir`` with mode 0o777, so the kernel applies the process umask exactly as for any
    directory the user creates (``tempfile.mkdtemp`` would leave 0o700 once it is swapped in).
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover(out_dir)
    for _ in range(100):
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary directory beside {out_dir}")


def files_under(root: Path) -> Set[str]:
    """Relative paths ('/'-separated) of the files and symlinks under `root`."""
    out = set()
    for dirpath, dirnames, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return out


def foreign_files(out_dir: Path, ours: Iterable[str]) -> List[str]:
    """Files in `out_dir` that are not in `ours` (relative paths of what mmcl wrote there), sorted."""
    if not out_dir.is_dir():
        return []
    return sorted(files_under(out_dir) - set(ours))


def _keep_user_files(out_dir: Path, tmp: Path, names: List[str]) -> None:
    for dirpath, dirnames, _ in os.walk(out_dir):  # the user's folders, empty ones too, with their modes
        for d in dirnames:
            src = Path(dirpath) / d
            dst = tmp / src.relative_to(out_dir)
            if not src.is_symlink() and not dst.exists():
                dst.mkdir(parents=True)
                shutil.copymode(src, dst)
    for name in names:
        src, dst = out_dir / name, tmp / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:  # no hard links on this filesystem (or across a mount inside out_dir)
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copy2(src, dst)


def swap_in(tmp: Path, out_dir: Path, ours: Iterable[str] = ()) -> Optional[Path]:
    """Move `tmp` into place as `out_dir`, keeping the files of an existing `out_dir` that are not in `ours`.

    Args:
        tmp: the complete new directory, beside `out_dir` (`new_temp_dir`).
        ours: relative paths of the files mmcl wrote in `out_dir` before; every other file there is the user's
            and is kept (hard-linked into the new directory).
    Returns:
        The old directory, moved aside (None if there was none): delete it with `shutil.rmtree` once the new one
        is accepted, or put it back with `roll_back`.
    Raises:
        ConfigError naming the user's files that have the name of a file the new directory holds (nothing is
        changed then).
    """
    old = None
    if out_dir.is_dir():
        keep = foreign_files(out_dir, ours)
        clash = sorted(set(keep) & files_under(tmp))
        if clash:
            raise ConfigError(f"{out_dir} holds files mmcl did not write with the names of files it is about to "
                              f"write: {', '.join(clash[:5])}{' ...' if len(clash) > 5 else ''} (move them away or "
                              f"choose another output directory)")
        _keep_user_files(out_dir, tmp, keep)
        shutil.copymode(out_dir, tmp)
        old = out_dir.with_name(f".{out_dir.name}.old-{_owner_tag()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    return old


def roll_back(out_dir: Path, old: Optional[Path]) -> None:
    """Undo `swap_in`: remove the new `out_dir` and put the old directory back (the user's files are in both)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    if old is not None:
        os.replace(old, out_dir)


@contextmanager
def atomic_dir(out_dir, ours: Iterable[str] = (), check: Optional[Callable[[Path], None]] = None) -> Iterator[Path]:
    """Write a whole output directory or nothing: ``with atomic_dir(out_dir, ours) as tmp:`` yields an empty
    directory beside `out_dir`; when the block ends normally it is swapped in (`swap_in`, keeping the user's
    files: those of the old `out_dir` that are not in `ours`).

    Args:
        ours: relative paths of the files mmcl wrote in `out_dir` before (see `swap_in`).
        check: called with `out_dir` once the new version is in place and the old one still aside, for checks
            that need the final path (an export that names its own directory); when it raises, the new version
            is removed and the old one put back.
    On any exception in the block (or from the swap) the temporary directory is removed, `out_dir` is left as
    it was, and the exception propagates: callers turn OSError into their own one-line error.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(out_dir)
    try:
        yield tmp
        old = swap_in(tmp, out_dir, ours)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if check is not None:
        try:
            check(out_dir)
        except BaseException:
            roll_back(out_dir, old)
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file through a temp file, fsync, and rename. On failure (full disk, read-only directory) the
    temp file is removed, `path` is left as it was and the OSError is raised."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in 4 MiB blocks (weights and checkpoint files are gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def os_error_text(err: Exception) -> str:
    """'No space left on device (/path)' from an OSError (safetensors' own errors give their message)."""
    strerror, filename = getattr(err, "strerror", None), getattr(err, "filename", None)
    if strerror:
        return f"{strerror} ({filename})" if filename else strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__
