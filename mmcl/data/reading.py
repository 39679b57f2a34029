"""Reading tar shards into raw samples: consecutive members sharing a key form one sample.

`TarReader` streams the regular files of a tar archive through the standard library's `tarfile` (ustar, pax and
GNU formats; plain, gzip, bzip2 or xz), with the endings `tarfile` keeps silent made errors: a damaged header
mid-shard or a cut-off member is reported rather than read as the end of the archive. `read_raw_samples` turns an
epoch's shard plan into `RawSample` items (a sample's undecoded files by extension, and its position), passing
over the samples a resumed stream has already consumed by their headers alone, and reporting a shard that cannot
be opened or breaks off as a counted item.

A shard cannot exhaust memory: only the members a reader needs are read (the others are passed over unread), a
member is read only when the size its header declares is within ``max_member_bytes`` (a 4 MB ``.tar.gz`` can hold
a 4 GiB member of zeros), and a sample with a larger member, or one whose reading runs out of memory, is a counted
``too_large`` item.

Why not webdataset's own tar iteration (``webdataset.tariterators.tarfile_samples``, under every ``wds.WebDataset``
pipeline; webdataset 1.0.2, of which mmcl uses ``gopen`` only), measured by ``bench/bench_reading.py``
(2026-11-26, Python 3.11, 2-core shared CPU at load 7-8; raw samples per CPU second, median of 7 rounds):

- speed: this reader is not slower: 4423 against 3345 (``tarfile_samples``) and 2915 (``wds.WebDataset``) on 4000
  samples of ~110 px JPEGs; 2439 against 1821 and 1881 on 400 LaionLike photos (~100 kB);
- member size limit: webdataset reads every selected member whole (its ``select_files`` sees the name, never the
  size): a 64 MiB member of zeros (64 kB gzipped) peaked at 131 MiB of Python allocations there, 0.1 MiB here,
  where it is a ``too_large`` item with its key;
- a truncated tar: cut inside a header, webdataset ends the shard silently as if complete (``tarfile``'s silent
  end); cut inside a member, it raises ``ReadError`` (its default handler) or, with a handler that goes on,
  drops the rest with a warning and no record. Here both are a counted ``truncated_tar`` item, never an exception;
- per-sample skip records: webdataset reports through an exception handler, with no sample key or reason;
- a position within a shard: webdataset has none, so a resumed stream must read and drop the samples before it
  (4.23 s to the last of 4000 samples, against 0.62 s here passing over them by their headers).

So mmcl keeps this reader. It relies on one private name of the standard library, ``tarfile.TarInfo._proc_member``
(`_CheckedTarInfo` bounds the extended headers there, before ``tarfile`` reads them whole), pinned by
tests/test_dependency_names.py.
"""

from __future__ import annotations

import inspect
import lzma
import os
import tarfile
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Iterator, Optional, Sequence, Tuple

import psutil

from ..config import DataConfig
from .sources import has_scheme, open_shard, redact

# Headers that tarfile reads whole before a member (pax records, GNU long names) are small in any real archive.
_MAX_HEADER_BYTES = 2 ** 20
_LONG_HEADER_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                      tarfile.GNUTYPE_LONGLINK)
# A `TarFile` lists every member it has read, for random access a stream never makes. `TarFile(stream=True)`
# (Python 3.13+) keeps none; before it, `_forget_members` empties that list after each member, so that a reader's
# memory stays flat over any number of members (tests/data/test_reading.py measures it).
_STREAM_KWARGS = {"stream": True} if "stream" in inspect.signature(tarfile.TarFile).parameters else {}


def _forget_members(tar: tarfile.TarFile) -> None:
    """Drop the members `tar` has listed so far, where `TarFile(stream=True)` does not exist to keep none."""
    if not _STREAM_KWARGS:
        tar.members.clear()


def _split_name(name: str) -> Tuple[str, str]:
    """'dir/abc.seg.jpg' -> ('dir/abc', 'seg.jpg'): the key ends at the first dot of the base name."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (os.path.join(folder, stem) if folder else stem), ext.lower()

@dataclass
class RawSample:
    """One item of the raw stream: a sample's undecoded files, or a shard-level problem.

    ``pos`` is the stream position just after this item: (shard ordinal in the epoch plan, raw samples of
    that shard consumed). ``index`` is the sample's ordinal in its shard; ``shard`` its ordinal in the plan.
    """

    pos: Tuple[int, int]
    shard: int
    index: int
    key: str = ""
    files: Optional[Dict[str, bytes]] = None
    # A SKIP_REASONS entry: for shard-level problems (no key), or ``too_large`` for a sample (with its key) that
    # has a member over the size limit.
    error: Optional[str] = None
    url: str = ""

class TarFormatError(Exception):
    """A tar stream that is cut off or whose header is damaged."""


class _CheckedTarInfo(tarfile.TarInfo):
    """A `tarfile.TarInfo` that notes on its archive why header reading stopped: `tarfile` ends an archive at a
    damaged or cut-off header without a word, as if it had reached the end-of-archive block."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except (tarfile.EOFHeaderError, tarfile.EmptyHeaderError):
            raise  # the end-of-archive block, or the end of an archive written without one
        except tarfile.InvalidHeaderError:
            tar.damage = "bad header checksum"
            raise
        except tarfile.TruncatedHeaderError:
            tar.damage = "truncated header"
            raise

    def _proc_member(self, tarfile_):
        # A pax or GNU long-name header is read whole into memory by tarfile; a real one is a few hundred bytes.
        if self.type in _LONG_HEADER_TYPES and self.size > _MAX_HEADER_BYTES:
            raise TarFormatError(f"a {self.size}-byte extended header (at most {_MAX_HEADER_BYTES} are read)")
        return super()._proc_member(tarfile_)


class TarReader:
    """Streaming reader of the regular files in a tar archive (POSIX ustar, pax and GNU formats; plain, gzip,
    bzip2 or xz compressed), the standard library's `tarfile` with its silent endings turned into errors.

    Iterating yields member names in archive order; `read` returns the current member's bytes, and a member that is
    not read is passed over (by seeking where the stream allows). A damaged header or an archive cut off inside a
    member raises `TarFormatError` instead of ending the archive early. Constructing the reader reads the first
    header: a 0-byte stream or one that is not a tar raises there; an archive with no members (its first block is
    an end-of-archive block) yields nothing.
    """

    def __init__(self, stream):
        try:
            seekable = bool(stream.seekable())
        except (AttributeError, OSError, ValueError):
            seekable = False
        try:
            # "r:*" seeks over members that are not read (a resumed stream passes over whole blocks of samples);
            # "r|*" reads through them, for pipes and HTTP.
            self._tar = tarfile.open(fileobj=stream, mode="r:*" if seekable else "r|*", tarinfo=_CheckedTarInfo,
                                     **_STREAM_KWARGS)
        except tarfile.ReadError as err:
            raise TarFormatError("empty file" if "empty file" in str(err) else "not a tar file") from None
        except tarfile.CompressionError as err:
            raise TarFormatError(f"not a tar file ({err})") from None
        self._tar.damage = None
        self._member: Optional[tarfile.TarInfo] = None

    def __iter__(self) -> Iterator[str]:
        tar = self._tar
        while True:
            try:
                member = tar.next()
            except tarfile.TarError as err:
                raise TarFormatError(str(err)) from None
            except MemoryError:
                raise TarFormatError("out of memory reading a member header") from None
            if member is None:
                if tar.damage is not None:
                    raise TarFormatError(tar.damage)
                return
            _forget_members(tar)
            if member.isfile():
                self._member = member
                yield member.name

    @property
    def size(self) -> int:
        """The size the header of the member just yielded declares (what `read` would return)."""
        return int(self._member.size)

    def read(self) -> bytes:
        """The bytes of the member just yielded."""
        try:
            return self._tar.extractfile(self._member).read()
        except tarfile.TarError as err:
            raise TarFormatError(str(err)) from None


_READ_ERRORS = (TarFormatError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError)


def _retryable(url: str) -> bool:
    """Remote shards (http(s), ``pipe:`` commands, other schemes) can fail for a moment; a local file that is
    truncated stays truncated."""
    return has_scheme(url)


class _StallWatch:
    """A pipe stream (``pipe:`` commands, http(s) through curl) whose reads may block for at most `timeout`
    seconds: a command that hangs (a stalled download, a credential prompt nobody answers) is killed with its
    children, which ends its output, so the shard breaks off and goes through retries like any other failure.
    Time spent outside `read` (the consumer training) never counts."""

    def __init__(self, stream, timeout: float):
        self._stream, self._timeout = stream, timeout
        self._since: Optional[float] = None  # when the read in progress began
        self._delivered = 0  # bytes returned so far
        self._done = threading.Event()
        self.stalled = False
        threading.Thread(target=self._watch, daemon=True, name="mmcl-shard-watch").start()

    def read(self, size: int = -1) -> bytes:
        # What has arrived is returned (read1), as a raw pipe does: tarfile asks again until it has what it needs,
        # and never for bytes past the archive's end, which a command that does not exit would never send. (A
        # buffered read(size) would wait for all `size` bytes.) The first 512 bytes come whole: tarfile tells a
        # compressed stream from a plain one by them. Each piece of data restarts the clock.
        pipe = getattr(self._stream, "stream", None)
        if size is None or size < 0 or not hasattr(pipe, "read1"):
            self._since = time.monotonic()
            try:
                return self._stream.read(size)
            finally:
                self._since = None
        want = min(size, max(1, 512 - self._delivered))
        parts, got = [], 0
        try:
            while got < want:
                self._since = time.monotonic()
                piece = pipe.read1(size - got)
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
        finally:
            self._since = None
        self._delivered += got
        if hasattr(self._stream, "check_status"):
            self._stream.check_status()  # a command that failed says so, as webdataset's own read does
        return b"".join(parts)

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self._timeout / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self._timeout:
                self.stalled = True
                _kill_tree(self._stream.proc.pid)
                return

    def drain(self) -> None:
        """Read what follows the archive's end (its zero padding) so that the command can finish writing and
        exit cleanly instead of on a broken pipe."""
        while self.read(1 << 16):
            pass

    def close(self) -> None:
        """The end of a shard read to its end: the command's exit is waited for (its status says whether the
        archive was whole), for at most the timeout, like a read."""
        self._since = time.monotonic()
        try:
            self._stream.close()
        finally:
            self._since = None
            self._done.set()

    def abort(self) -> None:
        """A shard left before its end (an error, or the consumer stopped): its output is no longer wanted, so
        the command is killed rather than waited for (a hung one would never exit)."""
        self._done.set()
        if self._stream.proc.poll() is None:
            _kill_tree(self._stream.proc.pid)
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _kill_tree(pid: int) -> None:
    """Kill process `pid` and its descendants (a shell's command holds the pipe open after the shell dies)."""

    try:
        proc = psutil.Process(pid)
        family = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # SIGKILL cannot be caught, but a busy machine may take a moment to deliver it: the descendants are gone when
    # this returns (psutil polls for them). `pid` itself is left for its Popen to reap, which reads its exit status.
    psutil.wait_procs(family[:-1], timeout=5)


def _open_watched(open_fn, url: str, timeout: float):
    stream = open_fn(url)
    if timeout > 0 and hasattr(getattr(stream, "proc", None), "pid"):
        return _StallWatch(stream, timeout)
    return stream


def _close(stream) -> None:
    try:
        getattr(stream, "abort", stream.close)()
    except Exception:  # a pipe that failed reports its problem when read; closing it may raise again
        pass


def _item(shard: int, index: int, key: str, files: Dict[str, bytes], oversize: bool, url: str) -> RawSample:
    if oversize:
        return RawSample(pos=(shard, index + 1), shard=shard, index=index, key=key, error="too_large", url=url)
    return RawSample(pos=(shard, index + 1), shard=shard, index=index, key=key, files=files, url=url)


@dataclass(frozen=True)
class _ReadSettings:
    """How `read_raw_samples` reads every shard (its arguments of the same names)."""

    open_fn: Callable[[str], Any]
    retries: int
    retry_delay: float
    read_timeout: float
    members: Optional[Collection[str]]
    max_member_bytes: int


@dataclass
class _ShardProgress:
    """Where the reading of one shard stands, over its attempts: ``next_index`` is the first sample index not yet
    yielded; ``index`` the sample the current attempt is reading (-1 before its first)."""

    shard: int
    url: str
    modulo: Optional[Tuple[int, int]]
    next_index: int
    index: int = -1


def read_raw_samples(plan: Sequence[Tuple[str, Optional[Tuple[int, int]]]], start: Tuple[int, int] = (0, 0),
                     open_fn: Callable[[str], Any] = open_shard, retries: int = 0,
                     retry_delay: float = 1.0, read_timeout: float = 300.0,
                     members: Optional[Collection[str]] = None,
                     max_member_bytes: int = DataConfig.max_member_bytes) -> Iterator[RawSample]:
    """Stream raw samples from the shards of `plan`, starting at position `start`.

    Args:
        plan: list of (url, modulo) where modulo is None (take every sample) or (slot, n_slots) (take the
            samples whose index in the shard is congruent to slot; shard-level problems are reported by the
            slot ``shard ordinal % n_slots`` only).
        start: (shard ordinal, samples to skip in it). Skipped samples are passed over by their tar headers;
            their bytes never reach a decoder.
        retries, retry_delay: a remote shard (`has_scheme`) that cannot be opened or breaks off mid-stream is
            opened again up to `retries` times, after `retry_delay` seconds doubling each time, and read on from
            the sample that broke (the samples already yielded are passed over by their headers, so none is seen
            twice and none is lost); only then is it reported.
        read_timeout: seconds a pipe shard (``pipe:`` command, http(s) through curl) may send nothing while it
            is read before its command is killed and the shard counts as broken (0: wait for ever).
        members: the extensions of the members a sample needs (``jpg``, ``txt``, ``teacher_image.npy``; see
            `decode.needed_members`); the others are passed over without reading their bytes. None reads all.
        max_member_bytes: the largest member read; a needed member whose header declares more, or whose reading
            runs out of memory, makes its sample a ``too_large`` item (``data.max_member_bytes``).
    Yields:
        `RawSample` items; shard-level problems (cannot open, truncated tar) and samples with a member over the
        size limit as items with ``error`` set.
    """
    settings = _ReadSettings(open_fn, retries, retry_delay, read_timeout, members, max_member_bytes)
    first_shard, skip = start
    for shard in range(first_shard, len(plan)):
        url, modulo = plan[shard]
        yield from _read_shard(_ShardProgress(shard, url, modulo, skip if shard == first_shard else 0), settings)


def _read_shard(at: _ShardProgress, settings: _ReadSettings) -> Iterator[RawSample]:
    """One shard of the plan from sample `at.next_index` on: read again while it breaks and may be retried, then
    reported (a warning, and a shard-level item from the slot that owns its problems)."""
    first_index = at.next_index
    owns_errors = at.modulo is None or at.shard % at.modulo[1] == at.modulo[0]
    attempt = 0
    while True:
        broken, opened = yield from _read_attempt(at, settings)
        if broken is None:
            return
        if opened and not isinstance(broken, _READ_ERRORS):
            raise broken  # not a damaged stream: a defect, shown as such
        if _retryable(at.url) and attempt < settings.retries:
            attempt += 1
            wait = settings.retry_delay * 2 ** (attempt - 1)
            warnings.warn(redact(f"shard {at.url} failed after {max(at.next_index, 0)} samples "
                                 f"({type(broken).__name__}: {broken}); retry {attempt} of {settings.retries} in "
                                 f"{wait:g} s"))
            time.sleep(wait)
            continue
        problem = _shard_problem(at, broken, opened, first_index)
        if owns_errors:
            yield problem
        return


def _read_attempt(at: _ShardProgress, settings: _ReadSettings) -> Iterator[RawSample]:
    """Open the shard and yield its samples from `at.next_index` on. Returns (None, True) when it was read to its
    end, else (the exception that broke it, whether its tar was opened)."""
    stream, watched, opened = None, None, False
    at.index = -1
    try:
        stream = watched = _open_watched(settings.open_fn, at.url, settings.read_timeout)
        tar = TarReader(stream)
        opened = True
        last = yield from _tar_samples(tar, at, settings)
        # A pipe (curl for http, any pipe: command) reports its exit status when closed: a download cut off at a
        # member boundary reads like a complete archive until then. The last sample is held back until the stream
        # has closed cleanly.
        if hasattr(stream, "drain"):
            stream.drain()
        finished, stream = stream, None
        finished.close()
        if last is not None:
            yield last
        return None, opened
    except Exception as err:  # a missing file, a failing pipe, a non-tar file, a dropped connection
        if getattr(watched, "stalled", False):
            return TimeoutError(f"no data for {settings.read_timeout:g} s (data.read_timeout); its command was "
                                "killed"), opened
        return err, opened
    finally:
        if stream is not None:
            _close(stream)


def _tar_samples(tar: TarReader, at: _ShardProgress, settings: _ReadSettings) -> Iterator[RawSample]:
    """The samples of an opened tar from `at.next_index` on that `at.modulo` takes, each yielded when the next
    sample's first member shows it complete; returns the last one (None when there is none), which is complete only
    once the stream has closed cleanly. A needed member is read only when its header's size is within the limit."""
    members, max_member_bytes = settings.members, settings.max_member_bytes
    shard, url, modulo = at.shard, at.url, at.modulo
    key, files, oversize = None, None, False
    for name in tar:
        name_key, ext = _split_name(name)
        if name_key != key:
            if key is not None and files is not None:
                yield _item(shard, at.index, key, files, oversize, url)
            if key is not None:
                at.next_index = max(at.next_index, at.index + 1)
            at.index += 1
            key = name_key
            wanted = at.index >= at.next_index and (modulo is None or at.index % modulo[1] == modulo[0])
            files, oversize = ({} if wanted else None), False
        if files is not None and not oversize and (members is None or ext in members):
            if tar.size > max_member_bytes:
                oversize = True  # never read: its header's size is enough to know
            else:
                try:
                    files[ext] = tar.read()
                except MemoryError:
                    oversize = True
    if key is not None and files is not None:
        return _item(shard, at.index, key, files, oversize, url)
    return None


def _shard_problem(at: _ShardProgress, broken: BaseException, opened: bool, first_index: int) -> RawSample:
    """Warn about a shard that failed for good, and its shard-level item: ``shard_open`` when nothing of it was
    read in any attempt, else ``truncated_tar`` (the sample being read when the tar broke is lost; reported once)."""
    shard, url = at.shard, at.url
    if not opened and at.next_index == first_index:
        warnings.warn(redact(f"cannot open shard {url}: {type(broken).__name__}: {broken}; skipping it"))
        return RawSample(pos=(shard + 1, 0), shard=shard, index=-1, error="shard_open", url=url)
    warnings.warn(redact(f"shard {url} is truncated or corrupt after {max(at.index, at.next_index, 0)} samples "
                         f"({type(broken).__name__}: {broken})"))
    return RawSample(pos=(shard + 1, 0), shard=shard, index=max(at.index, at.next_index), error="truncated_tar",
                     url=url)
