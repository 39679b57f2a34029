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

A folder mmcl writes is never a way out of it. Every file it writes, truncates, appends to or deletes there is
named by a path relative to the folder, checked by `inside`: no absolute path, no ``..``, and no symbolic link
(nor device or FIFO) on the way, which is refused in one line, never followed, replaced or deleted. Files are
opened with ``O_NOFOLLOW`` (`open_inside`), and temporary files are created new (``O_EXCL``, `new_file`). The
folder itself may be a link the user gave (``--out link-to-dir``): only what is inside it is checked. Files
copied out of a folder (a model's tokenizer files) are read by the same rule.

Hard links: a file there with more than one link (a backup made with ``cp -al`` or ``rsync --link-dest``, or a
link to a file of the user's put there) is never written through. `open_inside` first gives the folder's name its
own file (`unshare`: a copy of the bytes, for a file mmcl appends to; an empty file for one it rewrites, as the run
lock), renamed into place, and writes that; the other names keep the file as it was. Every other write is a new
file renamed into place (`new_file`, `atomic_write_text`, `atomic_dir`), which no link reaches.

Late swaps: where mmcl deletes and renames inside a folder during a run (checkpoint rotation, ``latest``), it opens
the folder once per operation without following links below the folder it owns (`open_dir_inside`) and works
relative to that descriptor (``dir_fd=``), so a link swapped in after the start checks is refused, never followed.

Inputs: files read from elsewhere are regular files, opened without blocking, bounded by their size before they
are read (`mmcl.data.limits.open_regular`, `read_regular_bytes`, below every reader).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, List, Optional, Set

from ..data.limits import open_regular
from ..errors import ConfigError


def inside(folder, rel) -> Path:
    """``folder / rel``, where mmcl may write: ConfigError (one line) when `rel` is absolute or holds ``..``, or
    when a part of it that exists is a symbolic link, or neither a regular file nor a folder (a device, a FIFO)."""
    rel = str(rel).replace(os.sep, "/")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if rel.startswith("/") or ".." in parts or not parts:
        raise ConfigError(f"{folder}: {rel!r} is not a path inside it; mmcl writes only inside the folders it "
                          f"owns (nothing was changed)")
    path = Path(folder)
    for part in parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break  # nothing below a missing part exists yet: no link to refuse there
        if stat.S_ISLNK(mode):
            raise ConfigError(f"{path} is a symbolic link; mmcl never writes through links inside a folder it "
                              f"writes (it was left as it is: remove it or choose another folder)")
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(f"{path} is not a regular file or folder; mmcl does not write to it (it was left as "
                              f"it is: remove it or choose another folder)")
    return Path(folder).joinpath(*parts)


def open_inside(folder, rel, flags: int, mode: int = 0o644, keep_bytes: bool = True) -> int:
    """``os.open`` of `inside` (folder, rel) without following a link (``O_NOFOLLOW``) and without blocking on a
    FIFO put there meanwhile; ConfigError unless it opens a regular file. Opened for writing, a file with other
    hard links is first given its own copy (`unshare`; `keep_bytes` False: an empty one), so that no other name
    of it ever changes."""
    path = inside(folder, rel)
    truncate, flags = flags & os.O_TRUNC, flags & ~os.O_TRUNC  # truncated once it is known to be mmcl's own
    for _ in range(3):
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):  # a link or a FIFO put there since `inside` looked
                inside(folder, rel)
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            inside(folder, rel)  # raises: not a regular file
        if st.st_nlink <= 1 or not flags & (os.O_WRONLY | os.O_RDWR):
            os.set_blocking(fd, True)
            if truncate:
                os.ftruncate(fd, 0)
            return fd
        os.close(fd)
        unshare(path, keep_bytes and not truncate)
    raise ConfigError(f"{path} keeps getting other hard links while mmcl opens it; mmcl never writes through a "
                      f"hard link (it was left as it is)")


def unshare(path: Path, keep_bytes: bool = True) -> None:
    """Give the name `path` a file of its own: a new file (its bytes when `keep_bytes`, its mode) renamed over it, so
    that the file's other hard links keep it unchanged. A link or a non-regular file there is refused (`inside`)."""
    path = inside(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}")
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            inside(path.parent, path.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dst = os.open(tmp, flags, stat.S_IMODE(st.st_mode))
        try:
            while keep_bytes and (block := os.read(src, 1 << 20)):
                os.write(dst, block)
            os.fsync(dst)
        finally:
            os.close(dst)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(src)


def open_dir_inside(folder, rel) -> int:
    """A descriptor of the directory ``folder / rel``, each part of `rel` opened relative to the one before without
    following a link (``O_NOFOLLOW``): a link swapped in there at any time is ConfigError (one line), never followed.
    `folder` itself (the output folder the user named) may be a link. Close it with ``os.close``."""
    path = inside(folder, rel)
    parts = Path(os.path.relpath(path, folder)).parts
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    inside(folder, rel)  # raises for a link (or a FIFO, device)
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_text_at(dir_fd: int, name: str, text: str) -> None:
    """`atomic_write_text` relative to a directory descriptor (`open_dir_inside`): a new file renamed over `name`."""
    tmp = f".{name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def new_file(folder, rel) -> BinaryIO:
    """`rel` in `folder`, created new for writing (``O_EXCL``): a file of that name is deleted first (callers name
    only their own files: recorded in a manifest, or temporary names of theirs); a link there is refused."""
    path = inside(folder, rel)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(open_inside(folder, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


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
        for rel in ours:  # what mmcl replaces there is never a link of the user's (nor reached through one)
            inside(out_dir, rel)
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
    temp file is removed, `path` is left as it was and the OSError is raised. A link at `path` is refused (`inside`)."""
    path = inside(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}")
    try:
        with os.fdopen(open_inside(path.parent, tmp.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
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
    with open_regular(path) as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def os_error_text(err: Exception) -> str:
    """'No space left on device (/path)' from an OSError (safetensors' own errors give their message)."""
    strerror, filename = getattr(err, "strerror", None), getattr(err, "filename", None)
    if strerror:
        return f"{strerror} ({filename})" if filename else strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__
