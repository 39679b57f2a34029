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

Late swaps: a folder mmcl writes is opened once, when the command takes it, and held (`hold`: a run folder for the
whole run, a folder of `mmcl shards`, curate, reinforce, interpolate... while its manifest lives, the folder beside
an output directory while `atomic_dir` writes it). Every write below a held folder goes through one path: the
folders on the way are opened relative to its descriptor without following a link (`folder_fd`, `_entry`), files
are created new and renamed into place there with ``dir_fd`` (`new_file` then `replace_inside`, `atomic_write_text`,
`atomic_dir`), deletes too (`unlink_inside`), and a rename that finishes a write first checks that the folder's
path still names the descriptor's folder (its ``(st_dev, st_ino)``). So a folder replaced by a link (or by another
folder) after the start is one error line, and nothing of what the link names is written, renamed or deleted.
Libraries that write by path (safetensors, ONNX, faiss) write only into a temporary folder of a random name that
mmcl made in the held folder, which a swapped-in link does not hold.

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
import weakref
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from ..data.limits import open_regular
from ..errors import ConfigError


def _odd(path: Path, mode: int) -> Optional[ConfigError]:
    """The error for an entry mmcl does not write through or to: a symbolic link, or neither a regular file nor a
    folder (a device, a FIFO); None for a regular file or a folder."""
    if stat.S_ISLNK(mode):
        return ConfigError(f"{path} is a symbolic link; mmcl never writes through links inside a folder it writes "
                           f"(it was left as it is: remove it or choose another folder)")
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return ConfigError(f"{path} is not a regular file or folder; mmcl does not write to it (it was left as it "
                           f"is: remove it or choose another folder)")
    return None


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
        problem = _odd(path, mode)
        if problem is not None:
            raise problem
    return Path(folder).joinpath(*parts)


# ------------------------------------------------------------------------- folders held while mmcl writes them
def _ident(st: os.stat_result) -> Tuple[int, int]:
    return st.st_dev, st.st_ino


def _check_names(path: Path, fd: int) -> None:
    """ConfigError (one line) unless `path`, its links followed as a folder the user named is, is still the folder
    open as `fd`: a folder replaced (by a link, or by another folder) since mmcl opened it is never written."""
    try:
        now = _ident(os.stat(path))
    except OSError:
        now = None
    if now != _ident(os.fstat(fd)):
        how = " by a symbolic link" if os.path.islink(path) else ""
        raise ConfigError(f"{path} was replaced{how} while mmcl wrote into it; mmcl never follows a folder swapped "
                          f"in (nothing was written there: put the folder back, or write into another one)")


class HeldFolder:
    """A folder mmcl writes, opened once when a command takes it (a link the user gave as the folder itself is
    followed then, once): while it is held, every write below it (`folder_fd`, and so `open_inside`, `new_file`,
    `replace_inside`, `atomic_write_text`, `atomic_dir`) is made relative to this descriptor, part by part without
    following a link, once `check` has found that its path still names it. Held until `release` or until the
    object is dropped (the command that took the folder returns)."""

    def __init__(self, path, fd: int):
        self.path, self.fd = Path(os.path.abspath(path)), fd
        self.real = Path(os.path.realpath(self.path))
        self.ident = _ident(os.fstat(fd))
        self._close = weakref.finalize(self, os.close, fd)
        _HELD.add(self)

    def check(self) -> None:
        """ConfigError unless the folder's path still names this folder (`_check_names`)."""
        _check_names(self.path, self.fd)

    def release(self) -> None:
        _HELD.discard(self)
        self._close()


_HELD: "weakref.WeakSet[HeldFolder]" = weakref.WeakSet()


def _held_above(path) -> Optional[Tuple[HeldFolder, Tuple[str, ...]]]:
    """The innermost held folder that is `path` or lies above it, and the parts of `path` below it; else None."""
    p = os.path.abspath(path)
    best = None
    for held in list(_HELD):
        for base in (str(held.path), str(held.real)):
            if p == base or p.startswith(base.rstrip(os.sep) + os.sep):
                if best is None or len(base) > best[2]:
                    rel = os.path.relpath(p, base)
                    best = (held, () if rel == "." else tuple(Path(rel).parts), len(base))
    return None if best is None else (best[0], best[1])


def _refuse_entry(dir_fd: int, name: str, path: Path) -> None:
    """ConfigError when the entry `name` of the folder open as `dir_fd` is a link, a FIFO or a device."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    problem = _odd(path, mode)
    if problem is not None:
        raise problem


def _open_below(base_fd: int, base: Path, parts: Sequence[str]) -> int:
    """A new descriptor of the folder `parts` below the one open as `base_fd` (at the path `base`), each part opened
    relative to the one before without following a link: a link swapped in there is ConfigError, never followed."""
    fd = os.dup(base_fd)
    try:
        for i, part in enumerate(parts):
            if part == "..":
                raise ConfigError(f"{base}: {'/'.join(parts)!r} is not a path inside it (nothing was changed)")
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    _refuse_entry(fd, part, base.joinpath(*parts[:i + 1]))
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def hold(path) -> HeldFolder:
    """Hold the folder `path` (`HeldFolder`): below a folder already held it is opened relative to that one
    without following a link; elsewhere a link the user named is followed, now and once."""
    return HeldFolder(path, _open_folder(path))


def _open_folder(path) -> int:
    """A new descriptor of the folder `path`: below a held folder opened relative to it part by part without
    following a link, once the held folder's path is found to still name it; elsewhere the folder its path names."""
    above = _held_above(path)
    if above is None:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    above[0].check()
    return _open_below(above[0].fd, above[0].path, above[1])


@contextmanager
def holding(path) -> Iterator[HeldFolder]:
    """``with holding(folder):`` holds `folder` while the block runs (`hold`)."""
    held = hold(path)
    try:
        yield held
    finally:
        held.release()


@contextmanager
def folder_fd(folder) -> Iterator[int]:
    """A descriptor of `folder` to write in: below a held folder (`hold`) opened relative to it part by part
    without following a link, once the held folder's path is found to still name it; elsewhere the folder its
    path names now."""
    fd = _open_folder(folder)
    try:
        yield fd
    finally:
        os.close(fd)


def make_folder(path) -> None:
    """Create the folder `path` and its missing parents (``mkdir -p``); below a held folder part by part relative to
    it, a link on the way refused, never followed."""
    above = _held_above(path)
    if above is None:
        Path(path).mkdir(parents=True, exist_ok=True)
        return
    held, parts = above
    held.check()
    fd = os.dup(held.fd)
    try:
        for i, part in enumerate(parts):
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = _open_below(fd, held.path.joinpath(*parts[:i]), [part])
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


@contextmanager
def _entry(folder, rel) -> Iterator[Tuple[int, str, Path]]:
    """(descriptor of the folder that holds ``folder / rel``, the entry's name there, its path), after `inside`: the
    folders on the way opened without following a link (relative to a held folder, `folder_fd`), and the entry
    refused when it is a link, FIFO or device."""
    path = inside(folder, rel)
    parts = path.relative_to(Path(folder)).parts
    with folder_fd(folder) as base:
        dir_fd = _open_below(base, Path(folder), parts[:-1])
    try:
        _refuse_entry(dir_fd, parts[-1], path)
        yield dir_fd, parts[-1], path
    finally:
        os.close(dir_fd)


def open_inside(folder, rel, flags: int, mode: int = 0o644, keep_bytes: bool = True) -> int:
    """``os.open`` of `inside` (folder, rel) relative to its folder's descriptor (`_entry`), without following a link
    (``O_NOFOLLOW``) and without blocking on a FIFO put there meanwhile; ConfigError unless it opens a regular file.
    Opened for writing, a file with other hard links is first given its own copy (`unshare`; `keep_bytes` False: an
    empty one), so that no other name of it ever changes."""
    truncate, flags = flags & os.O_TRUNC, flags & ~os.O_TRUNC  # truncated once it is known to be mmcl's own
    with _entry(folder, rel) as (dir_fd, name, path):
        for _ in range(3):
            try:
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENXIO):  # a link or a FIFO put there since `_entry` looked
                    _refuse_entry(dir_fd, name, path)
                raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise _odd(path, st.st_mode) or ConfigError(f"{path} is not a regular file; mmcl does not write it")
            if st.st_nlink <= 1 or not flags & (os.O_WRONLY | os.O_RDWR):
                os.set_blocking(fd, True)
                if truncate:
                    os.ftruncate(fd, 0)
                return fd
            os.close(fd)
            _unshare_at(dir_fd, name, path, keep_bytes and not truncate)
    raise ConfigError(f"{path} keeps getting other hard links while mmcl opens it; mmcl never writes through a "
                      f"hard link (it was left as it is)")


def unshare(path: Path, keep_bytes: bool = True) -> None:
    """Give the name `path` a file of its own: a new file (its bytes when `keep_bytes`, its mode) renamed over it, so
    that the file's other hard links keep it unchanged. A link or a non-regular file there is refused."""
    path = Path(path)
    with _entry(path.parent, path.name) as (dir_fd, name, full):
        _unshare_at(dir_fd, name, full, keep_bytes)


def _unshare_at(dir_fd: int, name: str, path: Path, keep_bytes: bool) -> None:
    tmp = f".{name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}"
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise _odd(path, st.st_mode) or ConfigError(f"{path} is not a regular file")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dst = os.open(tmp, flags, stat.S_IMODE(st.st_mode), dir_fd=dir_fd)
        try:
            while keep_bytes and (block := os.read(src, 1 << 20)):
                os.write(dst, block)
            os.fsync(dst)
        finally:
            os.close(dst)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(src)


def open_dir_inside(folder, rel) -> int:
    """A descriptor of the directory ``folder / rel``, each part of `rel` opened relative to the one before without
    following a link (``O_NOFOLLOW``): a link swapped in there at any time is ConfigError (one line), never followed.
    `folder` itself is opened by `folder_fd` (relative to a held folder; else the folder the user named, which may
    be a link). Close it with ``os.close``."""
    path = inside(folder, rel)
    with folder_fd(folder) as base:
        return _open_below(base, Path(folder), path.relative_to(Path(folder)).parts)


def write_text_at(dir_fd: int, name: str, text: str, where: Optional[Path] = None) -> None:
    """`atomic_write_text` relative to a directory descriptor (`open_dir_inside`): a new file renamed over `name`;
    with `where` (the folder's path), only once that path is found to still name the folder (`_check_names`)."""
    tmp = f".{name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if where is not None:
            _check_names(where, dir_fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def new_file(folder, rel) -> BinaryIO:
    """`rel` in `folder`, created new for writing (``O_EXCL``) relative to its folder's descriptor (`_entry`): a file
    of that name is deleted first (callers name only their own files: recorded in a manifest, or temporary names of
    theirs); a link there is refused. Put it in place with `replace_inside`."""
    with _entry(folder, rel) as (dir_fd, name, _):
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.fdopen(os.open(name, flags, 0o644, dir_fd=dir_fd), "wb")


def replace_inside(folder, tmp_rel, rel) -> None:
    """Rename `tmp_rel` (a file mmcl wrote, `new_file`) over `rel`, both in the same folder below `folder`, relative
    to that folder's descriptor, once its path is found to still name it (`_check_names`): a folder swapped for a
    link meanwhile is one error line, and the rename never lands in what the link names."""
    with _entry(folder, rel) as (dir_fd, name, path):
        src = inside(folder, tmp_rel)
        if src.parent != path.parent:
            raise ValueError(f"replace_inside renames within one folder, not {src} to {path}")
        _check_names(path.parent, dir_fd)
        os.replace(src.name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def unlink_inside(folder, rel, quiet: bool = False) -> None:
    """Delete the file `rel` of `folder` relative to its folder's descriptor (a missing file is no error); a link
    there is refused, never followed nor deleted. `quiet`: no error at all (clearing a temporary file after a
    failure, whose own error is the one to report)."""
    try:
        with suppress(FileNotFoundError), _entry(folder, rel) as (dir_fd, name, _):
            os.unlink(name, dir_fd=dir_fd)
    except (OSError, ConfigError):
        if not quiet:
            raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file through a temp file, fsync, and rename, relative to its folder's descriptor (`_entry`,
    `write_text_at`). On failure (full disk, read-only directory) the temp file is removed, `path` is left as it was
    and the OSError is raised. A link at `path` is refused."""
    path = Path(path)
    with _entry(path.parent, path.name) as (dir_fd, name, full):
        write_text_at(dir_fd, name, text, where=full.parent)


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


def _dead_leftovers(parent_fd: int, name: str, kind: str) -> List[str]:
    """Names ``.NAME.<kind>-<host>-<pid>[-<random>]`` beside `name` left by a process of this host that is gone."""
    prefix = f".{name}.{kind}-{socket.gethostname().split('.')[0]}-"  # host names may hold '-'
    out = []
    for entry in os.listdir(parent_fd):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            out.append(entry)
    return out


def _rmtree_at(dir_fd: int, name: str) -> None:
    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)  # a link there is not followed (rmtree refuses it)


def _recover_at(parent_fd: int, name: str) -> None:
    for old in sorted(_dead_leftovers(parent_fd, name, "old")):
        if name not in os.listdir(parent_fd):
            os.replace(old, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        else:
            _rmtree_at(parent_fd, old)
    for tmp in _dead_leftovers(parent_fd, name, "tmp"):
        _rmtree_at(parent_fd, tmp)


def recover(out_dir: Path) -> None:
    """Undo what a killed writer of `out_dir` left: an old version moved aside is put back when `out_dir` is
    missing (the kill came between the two renames) and deleted otherwise; unfinished temporary dirs are deleted."""
    out_dir = Path(out_dir)
    try:
        with folder_fd(out_dir.parent) as fd:
            _recover_at(fd, out_dir.name)
    except FileNotFoundError:
        pass


def output_dir(path) -> Path:
    """The directory an output path names: a symlink the user gave there is resolved to its target (the swap then
    replaces the target's contents and leaves the user's link as it is); below a held folder nothing is resolved
    (a link there is refused when it is written)."""
    path = Path(path)
    above = _held_above(path)
    if above is not None and above[1]:
        return path
    return path.resolve() if path.is_symlink() else path


def files_under(root: Path) -> Set[str]:
    """Relative paths ('/'-separated) of the files and symlinks under `root`."""
    out = set()
    for dirpath, dirnames, names in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return out


def _walk_at(fd: int) -> Tuple[Set[str], List[str]]:
    """(files and links, folders) below the folder open as `fd`, relative and '/'-separated; no link followed."""
    files, folders = set(), []
    for dirpath, dirnames, names, dfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
        rel = os.path.relpath(dirpath, ".")
        join = (lambda n: n) if rel == "." else (lambda n: f"{rel}/{n}".replace(os.sep, "/"))
        for d in dirnames:
            if stat.S_ISLNK(os.stat(d, dir_fd=dfd, follow_symlinks=False).st_mode):
                files.add(join(d))
            else:
                folders.append(join(d))
        files.update(join(n) for n in names)
    return files, folders


def foreign_files(out_dir: Path, ours: Iterable[str]) -> List[str]:
    """Files in `out_dir` that are not in `ours` (relative paths of what mmcl wrote there), sorted."""
    if not out_dir.is_dir():
        return []
    return sorted(files_under(out_dir) - set(ours))


def _keep_user_files_at(out_fd: int, tmp_fd: int, folders: List[str], names: List[str]) -> None:
    for d in folders:  # the user's folders, empty ones too, with their modes
        with suppress(FileExistsError):
            os.mkdir(d, stat.S_IMODE(os.stat(d, dir_fd=out_fd, follow_symlinks=False).st_mode), dir_fd=tmp_fd)
    for name in names:
        parent = os.path.dirname(name)
        if parent:
            for i in range(1, len(parent.split("/")) + 1):
                with suppress(FileExistsError):
                    os.mkdir("/".join(parent.split("/")[:i]), dir_fd=tmp_fd)
        try:
            os.link(name, name, src_dir_fd=out_fd, dst_dir_fd=tmp_fd, follow_symlinks=False)
        except OSError:  # no hard links on this filesystem (or across a mount inside the folder)
            mode = os.stat(name, dir_fd=out_fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(name, dir_fd=out_fd), name, dir_fd=tmp_fd)
                continue
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=out_fd)
            try:
                dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              stat.S_IMODE(mode), dir_fd=tmp_fd)
                try:
                    while block := os.read(src, 1 << 20):
                        os.write(dst, block)
                finally:
                    os.close(dst)
            finally:
                os.close(src)


def _swap_in_at(parent_fd: int, tmp: str, out_dir: Path, ours: Iterable[str]) -> Optional[str]:
    """Move the folder `tmp` into place as `out_dir` (both entries of the folder open as `parent_fd`), keeping the
    files of an existing `out_dir` that are not in `ours` (hard-linked into `tmp`); returns the old folder's name,
    moved aside, or None. ConfigError naming the user's files that have the name of a file `tmp` holds."""
    name, ours = out_dir.name, list(ours)
    try:
        out_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except FileNotFoundError:
        out_fd = None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_entry(parent_fd, name, out_dir)
        raise
    old = None
    if out_fd is not None:
        try:
            for rel in ours:  # what mmcl replaces there is never a link of the user's (nor reached through one)
                inside(out_dir, rel)
            theirs, folders = _walk_at(out_fd)
            keep = sorted(theirs - set(ours))
            tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
            try:
                clash = sorted(set(keep) & _walk_at(tmp_fd)[0])
                if clash:
                    raise ConfigError(f"{out_dir} holds files mmcl did not write with the names of files it is about "
                                      f"to write: {', '.join(clash[:5])}{' ...' if len(clash) > 5 else ''} (move them "
                                      f"away or choose another output directory)")
                _keep_user_files_at(out_fd, tmp_fd, folders, keep)
                os.fchmod(tmp_fd, stat.S_IMODE(os.fstat(out_fd).st_mode))
            finally:
                os.close(tmp_fd)
        finally:
            os.close(out_fd)
        old = f".{name}.old-{_owner_tag()}"
        _rmtree_at(parent_fd, old)
        os.replace(name, old, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    os.replace(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    return old


def _entry_ident(parent_fd: int, name: str, path: Path) -> Optional[Tuple[int, int]]:
    """(st_dev, st_ino) of the entry `name` (None when missing); ConfigError for a link, FIFO or device there."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    problem = _odd(path, st.st_mode)
    if problem is not None:
        raise problem
    return _ident(st)


def _roll_back_at(parent_fd: int, name: str, old: Optional[str]) -> None:
    """Undo `_swap_in_at`: the new folder `name` removed and the `old` one put back; a link swapped in at `name`
    meanwhile is left as it is (not followed, not removed), and the old folder then stays aside for `_recover_at`."""
    try:
        mode = os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        _rmtree_at(parent_fd, name)
        mode = None
    if mode is None and old is not None:
        with suppress(OSError):
            os.replace(old, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)


@contextmanager
def atomic_dir(out_dir, ours: Iterable[str] = (), check: Optional[Callable[[Path], None]] = None) -> Iterator[Path]:
    """Write a whole output directory or nothing: ``with atomic_dir(out_dir, ours) as tmp:`` yields an empty
    directory beside `out_dir`; when the block ends normally it is swapped in (keeping the user's files: those of
    the old `out_dir` that are not in `ours`).

    The folder that holds `out_dir` is held (`hold`) from the start to the end: the temporary directory is made,
    and the swap's renames are done, relative to its descriptor, and the swap happens only once its path still
    names it and `out_dir` is still the folder it was at the start (a link or another folder swapped in meanwhile
    is one ConfigError line, and nothing of what it names is changed).

    Args:
        ours: relative paths of the files mmcl wrote in `out_dir` before; every other file there is the user's
            and is kept (hard-linked into the new directory).
        check: called with `out_dir` once the new version is in place (held) and the old one still aside, for
            checks that need the final path (an export that names its own directory); when it raises, the new
            version is removed and the old one put back.
    On any exception in the block (or from the swap) the temporary directory is removed, `out_dir` is left as
    it was, and the exception propagates: callers turn OSError into their own one-line error.
    """
    out_dir = Path(out_dir)
    make_folder(out_dir.parent)
    with holding(out_dir.parent) as parent:
        pfd, name = parent.fd, out_dir.name
        before = _entry_ident(pfd, name, out_dir)
        _recover_at(pfd, name)
        for _ in range(100):
            tmp = f".{name}.tmp-{_owner_tag()}-{secrets.token_hex(4)}"
            try:
                os.mkdir(tmp, 0o777, dir_fd=pfd)  # the umask applies, as for any directory the user creates
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"cannot create a temporary directory beside {out_dir}")
        try:
            yield out_dir.parent / tmp
            parent.check()
            if _entry_ident(pfd, name, out_dir) != before:
                raise ConfigError(f"{out_dir} was replaced while mmcl wrote it; nothing was written there (put the "
                                  f"folder back, or write into another one)")
            old = _swap_in_at(pfd, tmp, out_dir, ours)
        except BaseException:
            _rmtree_at(pfd, tmp)
            raise
        if check is not None:
            try:
                with holding(out_dir):
                    check(out_dir)
            except BaseException:
                _roll_back_at(pfd, name, old)
                raise
        if old is not None:
            _rmtree_at(pfd, old)


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
