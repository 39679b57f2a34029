"""Reading tar shards into raw samples: consecutive members sharing a key form one sample.

`TarReader` streams the regular files of a tar archive through the standard library's `tarfile` (ustar, pax and
GNU formats; plain, gzip, bzip2 or xz), with the endings `tarfile` keeps silent made errors: a damaged header
mid-shard or a cut-off member is reported rather than read as the end of the archive. `read_raw_samples` turns an
epoch's shard plan into `RawSample` items (a sample's undecoded files by extension, and its position), passing
over the samples a resumed stream has already consumed by their headers alone, and reporting a shard that cannot
be opened or breaks off as a counted item.
"""

from __future__ import annotations

import lzma
import os
import tarfile
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from .sources import open_shard

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
    error: Optional[str] = None  # a SKIP_REASONS entry for shard-level problems
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
            self._tar = tarfile.open(fileobj=stream, mode="r:*" if seekable else "r|*", tarinfo=_CheckedTarInfo)
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
            if member is None:
                if tar.damage is not None:
                    raise TarFormatError(tar.damage)
                return
            tar.members.clear()  # tarfile keeps every member it met; a stream needs none of them again
            if member.isfile():
                self._member = member
                yield member.name

    def read(self) -> bytes:
        """The bytes of the member just yielded."""
        try:
            return self._tar.extractfile(self._member).read()
        except tarfile.TarError as err:
            raise TarFormatError(str(err)) from None


def read_raw_samples(plan: Sequence[Tuple[str, Optional[Tuple[int, int]]]], start: Tuple[int, int] = (0, 0),
                     open_fn: Callable[[str], Any] = open_shard) -> Iterator[RawSample]:
    """Stream raw samples from the shards of `plan`, starting at position `start`.

    Args:
        plan: list of (url, modulo) where modulo is None (take every sample) or (slot, n_slots) (take the
            samples whose index in the shard is congruent to slot; shard-level problems are reported by the
            slot ``shard ordinal % n_slots`` only).
        start: (shard ordinal, samples to skip in it). Skipped samples are passed over by their tar headers;
            their bytes never reach a decoder.
    Yields:
        `RawSample` items; shard-level problems (cannot open, truncated tar) as items with ``error`` set.
    """
    first_shard, skip = start
    for shard in range(first_shard, len(plan)):
        url, modulo = plan[shard]
        skip_here = skip if shard == first_shard else 0
        owns_errors = modulo is None or shard % modulo[1] == modulo[0]
        stream = None
        try:
            stream = open_fn(url)
            tar = TarReader(stream)
        except Exception as err:  # a missing file, a failing pipe, a non-tar file: all mean the shard is lost
            if stream is not None:
                try:
                    stream.close()
                except Exception:  # the shard is reported as lost either way
                    pass
            warnings.warn(f"cannot open shard {url}: {type(err).__name__}: {err}; skipping it")
            if owns_errors:
                yield RawSample(pos=(shard + 1, 0), shard=shard, index=-1, error="shard_open", url=url)
            continue
        index, key, files = -1, None, None
        try:
            try:
                for name in tar:
                    name_key, ext = _split_name(name)
                    if name_key != key:
                        if key is not None and files is not None:
                            yield RawSample(pos=(shard, index + 1), shard=shard, index=index, key=key,
                                            files=files, url=url)
                        index += 1
                        key = name_key
                        wanted = index >= skip_here and (modulo is None or index % modulo[1] == modulo[0])
                        files = {} if wanted else None
                    if files is not None:
                        files[ext] = tar.read()
            except (TarFormatError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as err:
                # The sample being read when the tar broke is lost; report it once.
                warnings.warn(f"shard {url} is truncated or corrupt after {max(index, 0)} samples "
                              f"({type(err).__name__}: {err})")
                if owns_errors:
                    yield RawSample(pos=(shard + 1, 0), shard=shard, index=index, error="truncated_tar",
                                    url=url)
                continue
            if key is not None and files is not None:
                yield RawSample(pos=(shard, index + 1), shard=shard, index=index, key=key, files=files, url=url)
        finally:
            try:
                stream.close()
            except Exception:  # a pipe that failed already reported its problem above
                pass
