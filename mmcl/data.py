"""WebDataset streaming for training and evaluation, and shard writing.

Shards follow the img2dataset / WebDataset convention: consecutive tar members sharing a key form one
sample (``KEY.jpg|jpeg|png|webp`` image, ``KEY.txt`` caption, optional ``KEY.cls`` label, optional
``KEY.json``). Shards are opened with ``webdataset.gopen`` (local paths, ``pipe:``, http, ...) and read with
the standard library's streaming tar reader, which lets the loader skip already-consumed samples by their
position without reading their image bytes into the decoder, and turn a cut-off tar into a counted skip.

Training pipeline, one stage per function, chained by `role_batches` (see `TrainStream`)::

    expand_sources        spec -> shard URLs per '::'-separated source
    epoch_shard_plan      (seed, epoch, slot) -> this slot's shards, in this epoch's order
    read_raw_samples      shards -> raw samples (bytes per extension), position after each
    shuffle_block         blocks of `shuffle_buffer` raw samples -> a permutation from a seeded RNG
    decode_sample         raw sample -> (image tensor, caption, label) or a skip reason
    collate               samples -> batch dict, captions tokenized

A *slot* is one (rank, worker) pair: ``slot = rank * workers + worker``. Each slot reads a disjoint set
of whole shards per epoch, the same number for every slot; the shards left over (all of them when there are
fewer shards than slots) are read by every slot, each taking the samples whose index is its slot modulo the
number of slots. Each sample is so seen once per epoch across all ranks and workers, and every slot gets an
equal share.

Shuffling permutes fixed blocks rather than sampling from a rolling buffer, so a worker's position is
three numbers: the epoch, where its current block starts (shard ordinal, sample index) and how many
samples of the block it has emitted. Resuming re-reads that one block from its start (tar headers only
for what comes before it) and drops the emitted part before decoding; nothing else is replayed.
"""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import io
import json
import lzma
import math
import os
import random
import re
import signal
import tarfile
import threading
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .config import DataConfig
from .errors import ConfigError, DataError, MmclError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SKIP_REASONS = (
    "decode", "missing_image", "missing_caption", "bad_caption", "bad_label", "too_large", "truncated_tar",
    "shard_open",
    "unsupported_mode",
)
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------------------
# URL expansion


def _split_spec(spec: Any) -> List[str]:
    """Flatten a spec (str, list, YAML list, '::'-joined) into one string per source."""
    if spec is None:
        raise DataError("no training data given (got data.train=None, expected a shard spec such as "
                        "'shards/shard-{000000..000009}.tar')")
    if isinstance(spec, (list, tuple)):
        out: List[str] = []
        for item in spec:
            out += _split_spec(item)
        return out
    if not isinstance(spec, str):
        raise DataError(f"shard spec must be a string or a list of strings (got {type(spec).__name__}: {spec!r})")
    text = spec.strip()
    if text.startswith("["):
        import yaml  # a dependency of omegaconf

        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise DataError(f"cannot parse shard spec as a YAML list: {text!r} ({str(err).splitlines()[0]})")
        return _split_spec(items)
    if text.lower().endswith((".yaml", ".yml")) and os.path.isfile(text):
        import yaml

        with open(text) as f:
            items = yaml.safe_load(f)
        if not isinstance(items, list):
            raise DataError(f"{text} must hold a YAML list of shard specs (got {type(items).__name__})")
        return _split_spec(items)
    return [part.strip() for part in text.split("::") if part.strip()]


def _has_scheme(url: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url)) and not re.match(r"^[a-zA-Z]:[\\/]", url)


def _expand_one(source: str) -> List[str]:
    import braceexpand  # a dependency of webdataset

    if source.startswith("pipe:"):
        # Braces in a pipe command address shard names; expand them but never glob a shell command.
        return list(braceexpand.braceexpand(source))
    urls: List[str] = []
    missing: List[str] = []
    for item in braceexpand.braceexpand(source):
        if item.startswith("file://"):
            item = item[len("file://"):]
        if _has_scheme(item):
            urls.append(item)
        elif any(ch in item for ch in "*?["):
            urls += sorted(glob.glob(os.path.expanduser(item)))
        elif os.path.isdir(os.path.expanduser(item)):
            folder = os.path.expanduser(item)
            urls += sorted(p for p in glob.glob(os.path.join(folder, "*")) if p.endswith(_SHARD_SUFFIXES))
        elif os.path.isfile(os.path.expanduser(item)):
            urls.append(os.path.expanduser(item))
        else:
            missing.append(item)
    if missing and urls:
        warnings.warn(f"{len(missing)} of {len(missing) + len(urls)} shards of '{source}' do not exist, "
                      f"e.g. {missing[0]}; using the {len(urls)} that do", stacklevel=3)
    return urls


def missing_shards(spec: Any) -> List[str]:
    """What a shard spec names that is not there, one description per source (empty when all is in place).

    Checks local paths only: a glob that matches nothing, a brace range or path naming files that do not exist,
    a directory without shards. URLs with a scheme (``pipe:``, ``http://``, ...) are not checked. Relative
    paths resolve against the current directory; the descriptions show them resolved.
    """
    import braceexpand  # a dependency of webdataset

    try:
        sources = _split_spec(spec)
    except (DataError, OSError) as err:
        return [str(err)]
    if not sources:
        return [f"empty shard spec (got {spec!r})"]
    listings: Dict[str, Dict[str, bool]] = {}

    def kind(path: str) -> Optional[str]:
        # One directory listing answers for all the shards in it: a brace range of 41,456 LAION shards is checked in
        # a fraction of a second, where one stat per shard on a network file system could take minutes.
        folder, name = os.path.split(os.path.abspath(path))
        if folder not in listings:
            try:
                with os.scandir(folder) as entries:
                    listings[folder] = {e.name: e.is_dir() for e in entries}
            except OSError:
                listings[folder] = {}
        if name not in listings[folder]:
            return None
        return "dir" if listings[folder][name] else "file"

    problems = []
    for source in sources:
        if _has_scheme(source) and not source.startswith("file://"):
            continue
        missing, named = [], 0
        for item in braceexpand.braceexpand(source):
            item = os.path.expanduser(item[len("file://"):] if item.startswith("file://") else item)
            named += 1
            if any(ch in item for ch in "*?["):
                if not glob.glob(item):
                    missing.append(f"no file matches {os.path.abspath(item)}")
                continue
            found = kind(item)
            if found == "dir":
                if not any(p.endswith(_SHARD_SUFFIXES) for p in os.listdir(item)):
                    missing.append(f"no {'/'.join(_SHARD_SUFFIXES)} shards in the directory {os.path.abspath(item)}")
            elif found is None:
                missing.append(os.path.abspath(item))
        if named == 1 and missing:
            problems.append(missing[0] + (" does not exist" if os.path.isabs(missing[0]) else ""))
        elif missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            problems.append(f"{'all' if len(missing) == named else len(missing)} of the {named} paths that "
                            f"'{source}' names are missing ({shown})")
    return problems


def expand_sources(spec: Any) -> List[List[str]]:
    """Expand a shard spec into one list of URLs per source.

    Sources are the '::'-separated parts of a string spec (or the items of a list). Each source may use
    brace expansion (``shard-{000000..000009}.tar``), a glob, a directory (its ``*.tar`` files), a local
    path, or a URL with a scheme (``pipe:``, ``http://``, ...). Raises `DataError` naming the source when a
    source matches nothing.
    """
    sources = _split_spec(spec)
    if not sources:
        raise DataError(f"empty shard spec (got {spec!r}, expected e.g. 'shards/shard-{{000000..000009}}.tar')")
    out = []
    for source in sources:
        urls = _expand_one(source)
        if not urls:
            raise DataError(f"no shards match '{source}' (expected existing .tar files, a glob, a directory of "
                            f"shards or a pipe:/http URL)")
        out.append(urls)
    return out


def expand_urls(spec: Any) -> List[str]:
    """Expand a shard spec into a flat list of URLs (see `expand_sources` for the accepted forms).

    >>> expand_urls("data/shard-{000000..000001}.tar")  # doctest: +SKIP
    ['data/shard-000000.tar', 'data/shard-000001.tar']
    """
    return [url for urls in expand_sources(spec) for url in urls]


# ----------------------------------------------------------------------------------------------------------
# Shard writing


def _encode_image(image: Any, ext: Optional[str], image_format: str, quality: int) -> Tuple[bytes, str]:
    if isinstance(image, (bytes, bytearray, memoryview)):
        if not ext:
            raise DataError("sample image given as bytes without 'ext' (expected e.g. ext='jpg')")
        ext = ext.lower().lstrip(".")
        if ext not in IMAGE_EXTS:
            raise DataError(f"unsupported image extension '{ext}' (expected one of {', '.join(IMAGE_EXTS)})")
        return bytes(image), ext
    if isinstance(image, tuple) and len(image) == 2:
        return _encode_image(image[0], image[1], image_format, quality)
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        if image_format in ("jpg", "jpeg"):
            image.convert("RGB").save(buf, format="JPEG", quality=quality)
            return buf.getvalue(), "jpg"
        if image_format == "webp":
            image.save(buf, format="WEBP", quality=quality)
            return buf.getvalue(), "webp"
        image.save(buf, format="PNG")
        return buf.getvalue(), "png"
    raise DataError(f"sample image must be a PIL.Image or encoded bytes (got {type(image).__name__})")


class ShardWriter:
    """Write samples into numbered tar shards ``<out_dir>/<prefix>-000000.tar``, ... atomically.

    Each shard is written to a temporary name and renamed when complete, so a crash never leaves a
    truncated shard under a final name. Member metadata is fixed (mtime 0, uid 0), so equal samples give
    byte-identical shards.
    """

    def __init__(self, out_dir: str, shard_size: int = 1000, prefix: str = "shard",
                 image_format: str = "png", quality: int = 95):
        if shard_size <= 0:
            raise DataError(f"shard_size must be > 0 (got {shard_size})")
        if image_format not in ("png", "jpg", "jpeg", "webp"):
            raise DataError(f"image_format must be png, jpg or webp (got {image_format!r})")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_size, self.prefix = out_dir, shard_size, prefix
        self.image_format, self.quality = image_format, quality
        self.shards: List[str] = []
        self.n_samples = 0
        self._tar: Optional[tarfile.TarFile] = None
        self._tmp = ""
        self._in_shard = 0

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
        self._tar.addfile(info, io.BytesIO(data))

    def _open_next(self) -> None:
        path = os.path.join(self.out_dir, f"{self.prefix}-{len(self.shards):06d}.tar")
        self._tmp = path + ".tmp"
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.GNU_FORMAT)
        self.shards.append(path)
        self._in_shard = 0

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            os.replace(self._tmp, self.shards[-1])
            self._tar = None

    def write(self, sample: Dict[str, Any]) -> None:
        """Append one sample dict: key, image (PIL.Image or bytes with 'ext'), caption, label?, json?."""
        key = str(sample.get("key", ""))
        if not key or "." in os.path.basename(key):
            raise DataError(f"sample key must be non-empty and contain no '.' (got {key!r})")
        data, ext = _encode_image(sample.get("image"), sample.get("ext"), self.image_format, self.quality)
        caption = sample.get("caption")
        if not isinstance(caption, str):
            raise DataError(f"sample {key}: caption must be a string (got {type(caption).__name__})")
        if self._tar is None or self._in_shard >= self.shard_size:
            self._close_current()
            self._open_next()
        self._add(f"{key}.{ext}", data)
        self._add(f"{key}.txt", caption.encode("utf-8"))
        if sample.get("label") is not None:
            self._add(f"{key}.cls", str(int(sample["label"])).encode())
        if sample.get("json") is not None:
            self._add(f"{key}.json", json.dumps(sample["json"], sort_keys=True).encode())
        self._in_shard += 1
        self.n_samples += 1

    def close(self) -> Dict[str, Any]:
        """Finish the last shard; return the summary {out_dir, shards, n_shards, n_samples}."""
        self._close_current()
        return {"out_dir": self.out_dir, "shards": list(self.shards), "n_shards": len(self.shards),
                "n_samples": self.n_samples}

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self._tar is not None:
            self._tar.close()
            os.remove(self._tmp)
            self.shards.pop()
            self._tar = None
        self.close()


def write_shards(samples: Iterable[Dict[str, Any]], out_dir: str, shard_size: int = 1000, prefix: str = "shard",
                 image_format: str = "png", quality: int = 95) -> Dict[str, Any]:
    """Write samples as WebDataset shards ``out_dir/<prefix>-000000.tar``, ...

    Args:
        samples: iterable of dicts with ``key`` (str, no '.'), ``image`` (a PIL.Image, encoded with
            `image_format`, or encoded bytes with ``ext`` such as 'jpg'), ``caption`` (str), optional
            ``label`` (int, written as ``.cls``) and ``json`` (dict).
        shard_size: samples per shard.
    Returns:
        {"out_dir", "shards": [paths], "n_shards", "n_samples"}.
    """
    with ShardWriter(out_dir, shard_size, prefix, image_format, quality) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.close()


# ----------------------------------------------------------------------------------------------------------
# Reading raw samples


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


def _open_shard(url: str):
    from webdataset import gopen

    return gopen(url, "rb")


class TarFormatError(Exception):
    """A tar stream that is cut off or whose header is damaged."""


class _Prefixed(io.RawIOBase):
    """A stream with bytes already read from it put back in front (for compression sniffing)."""

    def __init__(self, head: bytes, stream):
        self.head, self.stream = head, stream

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.head:
            n = min(len(buf), len(self.head))
            buf[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = self.stream.read(len(buf))
        buf[:len(data)] = data
        return len(data)


_TAR_FILE_TYPES = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file


class TarReader:
    """Streaming reader of the regular files in a tar archive (POSIX ustar, pax and GNU formats; plain, gzip,
    bzip2 or xz compressed), 3-6x faster per member than `tarfile` in stream mode (BENCHMARKS.md).

    Iterating yields member names; `read` returns the current member's bytes, and a member that is not read
    is passed over (by seeking where the stream allows). Every header's checksum is verified, so a damaged
    header or an archive cut off inside a member raises `TarFormatError` instead of ending the archive early.
    Constructing the reader reads the first header: a 0-byte stream or one that is not a tar raises there; an
    archive with no members (its first block is an end-of-archive block) yields nothing.
    """

    def __init__(self, stream):
        head = _read_exact(stream, 512)
        compressed = False
        for magic, module in ((b"\x1f\x8b", gzip), (b"BZh", bz2), (b"\xfd7zXZ\x00", lzma)):
            if head.startswith(magic):
                stream = module.open(io.BufferedReader(_Prefixed(head, stream)), "rb")
                head = _read_exact(stream, 512)
                compressed = True  # decompressors "seek" by decompressing: passed-over members are read instead
                break
        if not head:
            # tarfile and webdataset refuse a 0-byte file too ("empty file"): nothing marks it as an archive.
            raise TarFormatError("empty file")
        self.stream, self._first = stream, head
        if head == bytes(512):
            # A valid archive without members (only end-of-archive blocks), as `tar -cf x.tar -T /dev/null` or
            # img2dataset after a shard's every download failed writes: it holds no sample, and tarfile reads
            # it as empty too.
            self._end, self._pending, self._size = None, 0, 0
            return
        self._end = None  # the stream's length where it can seek, to tell a cut-off member when skipping it
        try:
            if not compressed and stream.seekable():
                here = stream.tell()
                self._end = stream.seek(0, io.SEEK_END)
                stream.seek(here)
        except (AttributeError, OSError, ValueError):
            self._end = None
        self._pending = 0  # unread payload + padding of the current member
        self._size = 0
        self._parse(head, first=True)  # fail now on a stream that is not a tar

    def _skip(self, n: int) -> None:
        if n <= 0:
            return
        if self._end is not None:
            if self.stream.seek(n, io.SEEK_CUR) > self._end:
                raise TarFormatError("unexpected end of data")
            return
        while n > 0:
            got = len(self.stream.read(min(n, 1 << 20)))
            if got == 0:
                raise TarFormatError("unexpected end of data")
            n -= got

    def _parse(self, h: bytes, first: bool = False) -> Tuple[bytes, int, Optional[str]]:
        """(type flag, payload size, name) of a header block; raises on a bad checksum."""
        if len(h) < 512:
            raise TarFormatError("not a tar file" if first else "truncated header")
        stored = h[148:156].split(b"\0", 1)[0].strip()
        unsigned = sum(h[:148]) + 256 + sum(h[156:])
        try:
            want = int(stored, 8) if stored else -1
        except ValueError:
            want = -1
        # Some old writers summed the bytes as signed chars; tarfile accepts both, and so does this.
        ok = want == unsigned or want == unsigned - 256 * sum(1 for b in h[:148] + h[156:] if b > 127)
        if not ok:
            raise TarFormatError("not a tar file" if first else "bad header checksum")
        field = h[124:136]
        if field[0] & 0x80:  # GNU base-256 size
            size = int.from_bytes(field[1:], "big")
        else:
            size = int(field.split(b"\0", 1)[0].strip() or b"0", 8)
        name = h[:100].split(b"\0", 1)[0]
        if h[257:263] == b"ustar\0":  # POSIX ustar: a path longer than 100 bytes is split into prefix/name
            prefix = h[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix + b"/" + name
        return h[156:157], size, name.decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        head, long_name, pax_name, pax_size = self._first, None, None, None
        self._first = None
        while True:
            if head is None:
                self._skip(self._pending)
                self._pending = 0
                head = _read_exact(self.stream, 512)
                if len(head) == 0:
                    return  # an archive without its end-of-archive blocks ends here, as tarfile does
            if head == bytes(512):
                return
            kind, size, name = self._parse(head)
            head = None
            padded = size + (-size) % 512
            if kind in (b"L", b"x", b"g"):  # GNU long name, pax extended header, pax global header
                payload = _read_exact(self.stream, padded)
                if len(payload) < padded:
                    raise TarFormatError("unexpected end of data")
                payload = payload[:size]
                if kind == b"L":
                    long_name = payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                elif kind == b"x":
                    pax_name, pax_size = _parse_pax(payload, pax_name, pax_size)
                continue
            if pax_size is not None:
                size, padded = pax_size, pax_size + (-pax_size) % 512
            name = pax_name or long_name or name
            long_name = pax_name = pax_size = None
            self._size, self._pending = size, padded
            if kind in _TAR_FILE_TYPES:
                yield name

    def read(self) -> bytes:
        """The bytes of the member just yielded."""
        data = _read_exact(self.stream, self._size)
        if len(data) < self._size:
            raise TarFormatError("unexpected end of data")
        self._pending -= self._size
        self._size = 0
        return data


def _read_exact(stream, n: int) -> bytes:
    """Up to n bytes; fewer only at the end of the stream (pipes and decompressors may return short reads)."""
    data = stream.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _parse_pax(payload: bytes, name: Optional[str], size: Optional[int]) -> Tuple[Optional[str], Optional[int]]:
    """The path and size records of a pax extended header ('LEN key=value\\n' records)."""
    pos = 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(payload[pos:space])
        except ValueError:
            raise TarFormatError("bad pax header")
        if length <= 0:
            raise TarFormatError("bad pax header")
        key, _, value = payload[space + 1:pos + length - 1].partition(b"=")
        if key == b"path":
            name = value.decode("utf-8", "surrogateescape")
        elif key == b"size":
            size = int(value)
        pos += length
    return name, size


def read_raw_samples(plan: Sequence[Tuple[str, Optional[Tuple[int, int]]]], start: Tuple[int, int] = (0, 0),
                     open_fn: Callable[[str], Any] = _open_shard) -> Iterator[RawSample]:
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


# ----------------------------------------------------------------------------------------------------------
# Decoding


class SkipSample(Exception):
    """Raised by `decode_sample` for a bad sample; ``reason`` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def draft_size_of(preprocess: Any) -> Optional[Tuple[int, int]]:
    """The (width, height) a JPEG may be draft-decoded to without losing what `preprocess` keeps.

    Reads the first resizing step of a torchvision ``Compose`` (Resize, CenterCrop, RandomResizedCrop,
    open_clip's ResizeKeepRatio); returns None when the output size cannot be inferred.
    """
    from torchvision import transforms as T

    steps = getattr(preprocess, "transforms", [preprocess])
    for step in steps:
        if isinstance(step, T.RandomResizedCrop):
            h, w = step.size
            # The crop keeps at least `scale[0]` of the area, so each side shrinks by at most sqrt(scale[0]).
            grow = 1.0 / math.sqrt(max(step.scale[0], 1e-3))
            return int(math.ceil(w * grow)), int(math.ceil(h * grow))
        size = getattr(step, "size", None)
        if isinstance(step, (T.Resize, T.CenterCrop)) or type(step).__name__ in ("ResizeKeepRatio", "CenterCropOrPad"):
            if isinstance(size, int):
                return size, size
            if isinstance(size, (list, tuple)) and len(size) == 1:
                return int(size[0]), int(size[0])
            if isinstance(size, (list, tuple)) and len(size) == 2:
                side = max(size)  # aspect-keeping resizes fit one side; the larger bound is the safe one
                return int(side), int(side)
    return None


# Pixel modes: what `to_rgb` does with each mode Pillow can open. Alpha is composited on white, as
# transformers' CLIP image processor and img2dataset do: the colour under a fully transparent pixel is undefined
# (often black), so dropping alpha, as a bare ``convert("RGB")`` does, would show a transparent logo on black.
_CONVERTED_MODES = ("1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX")
_ALPHA_MODES = ("LA", "PA", "RGBA")
_PREMULTIPLIED_MODES = ("La", "RGBa")
_WHITE = 255


def _composite_on_white(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGBA", rgba.size, (_WHITE, _WHITE, _WHITE, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _to_uint8(values: np.ndarray, mode: str) -> np.ndarray:
    """Integer or float pixel values (H, W) -> uint8 (H, W), by the value range the mode or the data implies."""
    if mode.startswith("I;16"):
        # 16-bit: 0..65535 onto 0..255, rounded (v * 255 / 65535); Pillow's convert would clip at 255.
        return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "F" and not np.isfinite(values).all():
        raise SkipSample("unsupported_mode", "F (32-bit float) image with NaN or infinite pixel values")
    lo, hi = (values.min(), values.max()) if values.size else (0, 0)
    if mode == "I" and lo >= 0 and hi <= 255:
        return values.astype(np.uint8)  # 8-bit values in a 32-bit container
    if mode == "I" and lo >= 0 and hi <= 65535:
        return ((values.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "F" and lo >= 0 and hi <= 1:
        return np.rint(values.astype(np.float64) * 255).astype(np.uint8)
    # Any other range (signed or > 16-bit integers, floats outside [0, 1]): the image's own min..max onto 0..255,
    # as image viewers show scientific data; a constant image becomes black.
    span = float(hi) - float(lo)
    if span <= 0:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.rint((values.astype(np.float64) - float(lo)) * (255.0 / span)).astype(np.uint8)


def to_rgb(img: Image.Image) -> Image.Image:
    """A decoded PIL image of any mode Pillow opens -> 8-bit RGB, the one pixel conversion of mmcl.

    - RGB as it is; 1, L, P, CMYK, YCbCr, LAB, HSV, RGBX by Pillow's conversion.
    - Alpha (LA, PA, RGBA, and P with a transparent colour) composited on white; premultiplied La / RGBa likewise
      (colour + 255 - alpha).
    - 16-bit grey (I;16, I;16B, I;16L, I;16N) scaled 0..65535 -> 0..255. Pillow reads 48-bit RGB PNGs as 8-bit
      RGB itself (the high byte of each value).
    - I (32-bit integer): values in 0..255 as they are; in 0..65535 as 16-bit; otherwise stretched.
    - F (32-bit float): values in [0, 1] times 255; otherwise stretched. Stretched means the image's own
      min..max mapped onto 0..255 (a constant image becomes black).
    Grey results are repeated over the three channels.

    Raises `SkipSample` ``unsupported_mode`` for a mode not listed (or an F image holding NaN or infinity).
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P" and "transparency" in img.info:
        return _composite_on_white(img.convert("RGBA"))
    if mode in _CONVERTED_MODES:
        return img.convert("RGB")
    if mode in _ALPHA_MODES:
        return _composite_on_white(img.convert("RGBA"))
    if mode in _PREMULTIPLIED_MODES:
        values = np.asarray(img, dtype=np.int32)  # (H, W, C) with alpha last, colour already times alpha
        colour = values[..., :-1] + (_WHITE - values[..., -1:])
        colour = np.clip(colour, 0, 255).astype(np.uint8)
        if colour.shape[-1] == 1:
            colour = np.repeat(colour, 3, axis=-1)
        return Image.fromarray(np.ascontiguousarray(colour))  # (H, W, 3) uint8 is RGB
    if mode.startswith("I;16") or mode in ("I", "F"):
        grey = _to_uint8(np.asarray(img), mode)  # (H, W)
        return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1))  # (H, W, 3) uint8 is RGB
    raise SkipSample("unsupported_mode", f"pixel mode {mode} has no RGB conversion")


def decode_image(data: bytes, max_pixels: int, draft_size: Optional[Tuple[int, int]] = None) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image (pixel modes converted by `to_rgb`).

    Raises `SkipSample` with reason ``too_large`` when width*height > max_pixels (checked from the header,
    before any pixel is decoded), ``unsupported_mode`` for pixels `to_rgb` cannot map and ``decode`` for anything
    pillow cannot read. JPEGs are decoded at a reduced DCT scale when `draft_size` (w, h) is given and the image
    is at least twice as large.
    """
    with warnings.catch_warnings():
        # Pillow warns above its own global limit; ours is cfg.max_image_pixels and is counted instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise SkipSample("too_large", str(err))
        except UnidentifiedImageError:
            raise SkipSample("decode", "not an image format Pillow can identify")
        except Exception as err:  # pillow raises several types for unreadable data
            raise SkipSample("decode", f"{type(err).__name__}: {err}")
        width, height = img.size
        if width * height > max_pixels:
            raise SkipSample("too_large", f"{width}x{height} pixels > {max_pixels}")
        try:
            if draft_size is not None and img.format == "JPEG":
                img.draft("RGB", draft_size)
            img.load()  # decode now, so a cut-off file is reported here and not by a later conversion
        except Exception as err:
            raise SkipSample("decode", f"{type(err).__name__}: {err}")
        try:
            return to_rgb(img)
        except SkipSample:
            raise
        except Exception as err:
            raise SkipSample("decode", f"{type(err).__name__}: {err}")


def parse_caption(data: Optional[bytes]) -> str:
    """UTF-8 caption bytes -> stripped text; `SkipSample` when missing, empty or not UTF-8."""
    if data is None:
        raise SkipSample("missing_caption")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise SkipSample("bad_caption", f"not UTF-8 ({err})")
    if not text:
        raise SkipSample("bad_caption", "empty caption")
    return text


def parse_label(data: Optional[bytes]) -> int:
    """``.cls`` bytes -> non-negative int; -1 when absent; `SkipSample` ``bad_label`` otherwise."""
    if data is None:
        return -1
    try:
        label = int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SkipSample("bad_label", f"not an integer: {data[:32]!r}")
    if label < 0:
        raise SkipSample("bad_label", f"negative label {label}")
    return label


def image_bytes(files: Dict[str, bytes]) -> Optional[bytes]:
    """The encoded image of a raw sample (first of jpg, jpeg, png, webp), or None when it has none."""
    for ext in IMAGE_EXTS:
        if ext in files:
            return files[ext]
    return None


def decode_sample(files: Dict[str, bytes], preprocess: Callable, max_pixels: int,
                  draft_size: Optional[Tuple[int, int]] = None,
                  aug_seed: Optional[int] = None, as_uint8: bool = False) -> Tuple[torch.Tensor, str, int]:
    """Raw files of one sample -> (image tensor (3, H, W), caption str, label int (-1 if none)).

    Cheap checks (image/caption present, caption and label valid) run before the image is decoded. When
    `aug_seed` is given, random transforms in `preprocess` draw from torch's RNG seeded with it, so a sample
    gets the same augmentation when it is replayed after a resume; outside a DataLoader worker the caller's RNG
    state is restored (a worker's RNG serves nothing else). With `as_uint8`, `preprocess` is the PIL stage of a
    split transform (`split_transform`) and the image comes back as uint8 RGB. Raises `SkipSample` for bad
    samples and `TransformOutputError` when the PIL stage gives no RGB image.
    """
    data = image_bytes(files)
    if data is None:
        raise SkipSample("missing_image")
    caption = parse_caption(files.get("txt"))
    label = parse_label(files.get("cls"))
    img = decode_image(data, max_pixels, draft_size)
    if aug_seed is None:
        out = preprocess(img)
    elif torch.utils.data.get_worker_info() is not None:
        torch.default_generator.manual_seed(aug_seed)
        random.seed(aug_seed)
        out = preprocess(img)
    else:
        # Only the CPU generator and Python's `random` (used by some open_clip transforms) are reseeded, and
        # both are restored, so the caller's RNG streams (including CUDA's) are untouched.
        py_state, torch_state = random.getstate(), torch.get_rng_state()
        try:
            torch.default_generator.manual_seed(aug_seed)
            random.seed(aug_seed)
            out = preprocess(img)
        finally:
            random.setstate(py_state)
            torch.set_rng_state(torch_state)
    return (pil_to_uint8(out) if as_uint8 else out), caption, label


class TransformOutputError(Exception):
    """The PIL stage of a split transform returned something other than an RGB PIL image."""


def pil_to_uint8(img: Any) -> torch.Tensor:
    """RGB PIL image -> uint8 tensor (3, H, W), the pixels `ToTensor` would scale by 1/255."""
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        what = f"a PIL image of mode {img.mode}" if isinstance(img, Image.Image) else type(img).__name__
        raise TransformOutputError(
            f"the image transform before ToTensor gave {what}, not an RGB PIL image, so images cannot travel as "
            f"uint8; set data.uint8_transfer=false")
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)


class ImageFinish:
    """The tail of an image transform, ToTensor [+ Normalize], applied to a batch of uint8 images (B, 3, H, W)
    where the model runs. Elementwise the same float32 operations in the same order as torchvision's, so the
    result is bitwise equal to transforming each image in the data worker. Float input is returned unchanged.
    """

    def __init__(self, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self._cache: Dict[Tuple[Any, Any], Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            return images
        x = images.to(torch.get_default_dtype()).div_(255)
        if self.mean is not None:
            key = (x.device, x.dtype)
            if key not in self._cache:
                self._cache[key] = (torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1),
                                    torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1))
            mean, std = self._cache[key]
            x.sub_(mean).div_(std)
        return x

    def __repr__(self) -> str:
        return f"ImageFinish(mean={self.mean}, std={self.std})"


def split_transform(preprocess: Callable) -> Tuple[Callable, Optional[ImageFinish]]:
    """Split a torchvision ``Compose`` ending in ToTensor [+ Normalize] into (PIL stage, `ImageFinish`).

    Workers then run only the PIL stage and send uint8 images; the float conversion and normalisation run on
    the batch where the model is. Returns ``(preprocess, None)`` for transforms of any other shape.
    """
    from torchvision import transforms as T

    to_tensor_types: Tuple[type, ...] = (T.ToTensor,)
    try:
        from open_clip.transform import MaybeToTensor

        to_tensor_types += (MaybeToTensor,)
    except ImportError:  # an older open_clip without it
        pass
    if not isinstance(preprocess, T.Compose):
        return preprocess, None
    steps = list(preprocess.transforms)
    normalize = steps.pop() if steps and type(steps[-1]) is T.Normalize else None
    if not steps or type(steps[-1]) not in to_tensor_types:
        return preprocess, None
    steps.pop()
    if normalize is not None and any(float(s) == 0 for s in normalize.std):
        return preprocess, None  # torchvision raises on a zero std; keep its error
    finish = ImageFinish(normalize.mean, normalize.std) if normalize is not None else ImageFinish()
    return T.Compose(steps), finish


class _ConvertIfNeeded:
    """PIL ``convert(mode)`` that returns an image already in `mode` as it is (convert would only copy it)."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, img: Any) -> Any:
        if isinstance(img, Image.Image) and img.mode != self.mode:
            return img.convert(self.mode)
        return img

    def __repr__(self) -> str:
        return f"ConvertIfNeeded({self.mode!r})"


def _skip_same_mode_convert(step: Callable) -> Callable:
    """open_clip's RGB conversion steps (MaybeConvertMode, _convert_to_rgb) as `_ConvertIfNeeded`."""
    if type(step).__name__ == "MaybeConvertMode" and isinstance(getattr(step, "mode", None), str):
        return _ConvertIfNeeded(step.mode)
    if getattr(step, "__name__", "") == "_convert_to_rgb" and getattr(step, "__module__", "") == "open_clip.transform":
        return _ConvertIfNeeded("RGB")
    return step


def random_crop_box(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
                    rng: Any = random) -> Tuple[int, int, int, int]:
    """A random-resized-crop box (top, left, height, width) for a `width` x `height` image.

    The distribution of torchvision's ``RandomResizedCrop``: up to ten tries of an area fraction uniform in
    `scale` and an aspect ratio log-uniform in `ratio`, the first box that fits placed uniformly; when none
    fits, the largest centred box whose aspect ratio is clamped into `ratio`. Draws come from `rng` (Python's
    `random` by default): a few float operations instead of torchvision's tiny torch tensors, which cost
    45-80 us per image in a data worker.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    image_ratio = width / height
    if image_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif image_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _python_rng_crop(step: Callable) -> Callable:
    """torchvision's RandomResizedCrop as `PyRandomResizedCrop` (same distribution, cheaper draws)."""
    from torchvision import transforms as T

    return PyRandomResizedCrop(step) if type(step) is T.RandomResizedCrop else step


class PyRandomResizedCrop:
    """A torchvision ``RandomResizedCrop`` whose box is drawn by `random_crop_box` from Python's RNG (seeded
    per sample in the training stream, as torch's is); cropping and resizing are torchvision's own."""

    def __init__(self, crop: Any):
        self.crop = crop

    def __call__(self, img: Any) -> Any:
        from torchvision.transforms import functional as F

        c = self.crop
        _, height, width = F.get_dimensions(img)
        top, left, h, w = random_crop_box(width, height, c.scale, c.ratio)
        return F.resized_crop(img, top, left, h, w, c.size, c.interpolation, antialias=c.antialias)

    def __repr__(self) -> str:
        return f"Py{self.crop!r}"


def training_sample_transform(preprocess: Callable) -> Callable:
    """The per-sample transform the training stream runs: `preprocess` with its steps made cheaper where that
    changes no output distribution (RGB conversion of an RGB image skipped; RandomResizedCrop's box drawn
    with Python's RNG). Anything but a torchvision ``Compose`` is returned as it is."""
    from torchvision import transforms as T

    if not isinstance(preprocess, T.Compose):
        return preprocess
    return T.Compose([_python_rng_crop(_skip_same_mode_convert(step)) for step in preprocess.transforms])


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (order matters), for per-sample RNGs: splitmix64 (Steele et al. 2014)
    folded over the values; a few integer operations, so it costs nothing next to decoding."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & mask)) + 0x9E3779B97F4A7C15 & mask
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & mask
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & mask
        h ^= h >> 31
    return h >> 1


# ----------------------------------------------------------------------------------------------------------
# Shard plans and the training stream


def epoch_shard_plan(sources: List[List[str]], epoch: int, seed: int, slot: int, n_slots: int,
                     resampled: bool = False, weights: Optional[Sequence[float]] = None
                     ) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """The shards slot `slot` of `n_slots` reads in `epoch`, in order, as (url, modulo) pairs.

    Without resampling, all slots permute the full shard list with the same RNG (seed, epoch). Of the first
    n_slots * floor(n_shards / n_slots) shards slot k takes shards k, k + n_slots, ... whole; each of the
    remaining n_shards mod n_slots shards is read by every slot, which takes the samples whose index is k
    modulo n_slots. Every sample is then read once per epoch and, with shards of equal size, every slot gets
    the same number of samples (within one per remaining shard): with a slot holding one whole shard more
    than another, the smaller slot would wrap into its next epoch sooner and its samples would be seen more
    often. With fewer shards than slots all shards are split this way. With resampling, each slot draws
    ceil(n_shards / n_slots) shards with replacement, the source picked by `weights`, from an RNG of
    (seed, slot, epoch).
    """
    urls = [u for src in sources for u in src]
    if resampled:
        rng = np.random.default_rng([seed & 0xFFFFFFFF, slot, epoch, 1])
        p = np.asarray(weights if weights is not None else [len(s) for s in sources], dtype=np.float64)
        p = p / p.sum()
        n_draws = max(1, math.ceil(len(urls) / n_slots))
        plan = []
        for _ in range(n_draws):
            src = sources[int(rng.choice(len(sources), p=p))]
            plan.append((src[int(rng.integers(len(src)))], None))
        return plan
    order = np.random.default_rng([seed & 0xFFFFFFFF, epoch, 0]).permutation(len(urls))
    n_whole = len(urls) // n_slots * n_slots
    return ([(urls[i], None) for i in order[:n_whole][slot::n_slots]]
            + [(urls[i], (slot, n_slots)) for i in order[n_whole:]])


def _zero_skips() -> Dict[str, int]:
    return {reason: 0 for reason in SKIP_REASONS}


def _fresh_position() -> Dict[str, Any]:
    return {"epoch": 0, "shard": 0, "sample": 0, "emitted": 0, "skipped": _zero_skips(),
            "skipped_before_epoch": _zero_skips()}


def _copy_position(p: Dict[str, Any]) -> Dict[str, Any]:
    before = p.get("skipped_before_epoch", p["skipped"])
    return dict(p, skipped=dict(p["skipped"]), skipped_before_epoch=dict(before))


# How long a data worker goes on serving after a stop signal meant for the whole process group: time for the
# training process to finish its step and save (a scheduler's SIGKILL ends everything later anyway).
WORKER_STOP_GRACE_S = 60.0


def _worker_stop_signal(signum, frame) -> None:
    """SIGTERM in a data worker: the first one (a scheduler's, sent to the whole group) is outlived for
    `WORKER_STOP_GRACE_S`; a second one (the loader's own shutdown) ends the worker at once."""
    if getattr(_worker_stop_signal, "seen", False):
        os._exit(0)
    _worker_stop_signal.seen = True
    timer = threading.Timer(WORKER_STOP_GRACE_S, os._exit, (0,))
    timer.daemon = True
    timer.start()


class _SlotStreams(torch.utils.data.IterableDataset):
    """The per-worker batch generator; one instance is copied into each DataLoader worker."""

    def __init__(self, stream: "TrainStream", starts: List[Dict[str, Any]], role_offset: int):
        super().__init__()
        self.s = stream._spec()
        self.starts = starts
        self.role_offset = role_offset

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        role = (worker + self.role_offset) % self.s["n_roles"]
        if info is not None and self.s["worker_nice"]:
            os.nice(self.s["worker_nice"])
        if info is not None:
            # A scheduler's stop signal often goes to the whole process group (SLURM at a time limit, `kill --
            # -PGID`): the training process stops at a step boundary and saves; its workers must not die first.
            # They end with the training process (the DataLoader shuts them down, or they see it gone).
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, _worker_stop_signal)
        if info is None:
            yield from role_batches(self.s, role, self.starts[role])
            return
        # A worker's warnings travel with its next batch to the training process, which shows them there once
        # (`TrainStream.__iter__`): printed here, every worker would repeat them, in its own format.
        sent = set()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the training process's filters decide what is shown
            for batch in role_batches(self.s, role, self.starts[role]):
                new = [w for w in caught if (str(w.message), w.category) not in sent]
                del caught[:]
                if new:
                    sent.update((str(w.message), w.category) for w in new)
                    batch["__warnings__"] = [(str(w.message), _picklable_category(w.category), w.filename,
                                              w.lineno) for w in new]
                yield batch


def _picklable_category(category: type) -> type:
    """`category`, or UserWarning for a warning class that cannot travel between processes."""
    import pickle

    try:
        pickle.dumps(category)
        return category
    except Exception:  # e.g. a class defined inside a function
        return UserWarning


def shuffle_block(n: int, seed: int, slot: int, epoch: int, start: Tuple[int, int]) -> np.ndarray:
    """The order (int64 (n,), a permutation) in which a block of n raw samples is emitted.

    Seeded by the block's identity (seed, slot, epoch, start position), so a resumed stream that re-reads
    the block from `start` emits it in the same order.
    """
    return np.random.default_rng([seed & 0xFFFFFFFF, slot, epoch, start[0], start[1], 2]).permutation(n)


def role_batches(s: Dict[str, Any], role: int, start: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """Infinite batches of one worker role, starting at position `start`; each carries ``__state__``."""
    rank, n_roles = s["rank"], s["n_roles"]
    slot, n_slots = rank * n_roles + role, s["world_size"] * n_roles
    block_size = max(1, s["shuffle_buffer"])
    epoch, shard, sample, emitted = start["epoch"], start["shard"], start["sample"], start["emitted"]
    skipped = dict(_zero_skips(), **start["skipped"])
    skipped_before_epoch = dict(_zero_skips(), **start.get("skipped_before_epoch", start["skipped"]))
    images: List[torch.Tensor] = []
    captions: List[str] = []
    labels: List[int] = []
    keys: List[str] = []
    empty_epochs = 0
    while True:
        plan = epoch_shard_plan(s["sources"], epoch, s["seed"], slot, n_slots, s["resampled"], s["weights"])
        full_epoch = (shard, sample, emitted) == (0, 0, 0)
        raw_seen, good_seen = 0, 0
        reader = read_raw_samples(plan, (shard, sample))
        while True:
            block: List[RawSample] = []
            for item in reader:
                block.append(item)
                if len(block) == block_size:
                    break
            if not block:
                break
            perm = shuffle_block(len(block), s["seed"], slot, epoch, (shard, sample))
            for j in range(emitted, len(block)):
                item = block[perm[j]]
                emitted = j + 1
                if item.error is not None:
                    skipped[item.error] += 1
                    continue
                raw_seen += 1
                try:
                    tensor, caption, label = decode_sample(
                        item.files, s["preprocess"], s["max_pixels"], s["draft_size"],
                        aug_seed=_mix(s["seed"], slot, epoch, item.shard, item.index), as_uint8=s["as_uint8"])
                except SkipSample as skip:
                    skipped[skip.reason] += 1
                    continue
                except TransformOutputError as err:
                    yield {"__error__": str(err)}
                    return
                good_seen += 1
                images.append(tensor)
                captions.append(caption)
                labels.append(label)
                keys.append(item.key)
                if len(images) == s["batch_size"]:
                    batch = collate(images, captions, labels, keys, s["tokenizer"])
                    batch["__state__"] = {"role": role, "epoch": epoch, "shard": shard, "sample": sample,
                                          "emitted": emitted, "skipped": dict(skipped),
                                          "skipped_before_epoch": dict(skipped_before_epoch)}
                    images, captions, labels, keys = [], [], [], []
                    yield batch
            emitted = 0
            shard, sample = block[-1].pos
        if full_epoch and good_seen == 0:
            empty_epochs += 1
            problem = _empty_epoch_problem(s, rank, role, n_slots, raw_seen, skipped, plan, empty_epochs)
            if problem is not None:
                yield {"__error__": problem}
                return
        elif good_seen:
            empty_epochs = 0
        epoch, shard, sample, emitted = epoch + 1, 0, 0, 0
        skipped_before_epoch = dict(skipped)


_MAX_EMPTY_EPOCHS = 50  # a slot that drew only bad shards this often, while good ones exist, stops the run


def _first_valid_sample(s: Dict[str, Any]) -> Optional[str]:
    """The key of the first sample that decodes, over all shards in order; None when no shard has one."""
    urls = [(u, None) for src in s["sources"] for u in src]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slots' own reading already warned about these shards
        for item in read_raw_samples(urls):
            if item.error is None:
                try:
                    decode_sample(item.files, s["preprocess"], s["max_pixels"], s["draft_size"],
                                  as_uint8=s["as_uint8"])
                    return item.key
                except SkipSample:
                    continue
    return None


def _empty_epoch_problem(s: Dict[str, Any], rank: int, role: int, n_slots: int, raw_seen: int,
                         skipped: Dict[str, int], plan: Sequence, empty_epochs: int) -> Optional[str]:
    """Why a slot's epoch without a valid sample must stop the stream, or None to go on to the next epoch.

    Going on is right when other shards hold valid samples and the next epoch's shard draw may reach them;
    stopping is right when no shard holds one, or when the split gives this slot the same samples every
    epoch (fewer shards than slots), since it would otherwise spin forever without a batch.
    """
    n_urls = sum(len(src) for src in s["sources"])
    counts = ", ".join(f"{k}={v}" for k, v in skipped.items() if v) or "none"
    if _first_valid_sample(s) is None:
        return f"no valid sample in any of the {n_urls} shards (skipped so far: {counts})"
    within_shards = all(modulo is not None for _, modulo in plan)  # the same samples in every epoch
    if within_shards and raw_seen == 0:
        return (f"no samples reach rank {rank} worker {role}: {n_urls} shards for {n_slots} rank x worker slots "
                f"and too few samples to split within shards; use fewer workers or more data")
    if within_shards:
        return (f"no valid sample reaches rank {rank} worker {role} ({raw_seen} read, all skipped: {counts}); "
                f"with {n_urls} shards for {n_slots} rank x worker slots each slot always gets the same samples")
    if empty_epochs >= _MAX_EMPTY_EPOCHS:
        return (f"rank {rank} worker {role} found no valid sample in {empty_epochs} consecutive passes over its "
                f"shards (skipped so far: {counts}); most shards are unreadable")
    return None


def collate(images: List[torch.Tensor], captions: List[str], labels: List[int], keys: List[str],
            tokenizer: Callable[[List[str]], torch.Tensor]) -> Dict[str, Any]:
    """Stack decoded samples into a batch: image (B,3,H,W) float, text (B,L) long, label (B,) long, key list."""
    text = tokenizer(captions)
    if not isinstance(text, torch.Tensor):
        text = torch.as_tensor(text)
    out = None
    if torch.utils.data.get_worker_info() is not None:
        # Stacking straight into shared memory saves the copy the DataLoader's queue would make to send it.
        out = torch.empty((len(images),) + tuple(images[0].shape), dtype=images[0].dtype).share_memory_()
    return {"image": torch.stack(images, out=out), "text": text.long(),
            "label": torch.tensor(labels, dtype=torch.long), "key": list(keys)}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class TrainStream:
    """An infinite stream of training batches for one process (see `build_train_stream`).

    Iterating yields dicts ``image`` (B,3,H,W), ``text`` LongTensor (B,L), ``label`` LongTensor (B,) (-1 where
    a sample has no ``.cls``) and ``key`` (list of B sample keys). ``image`` is what the transform gives, or,
    with ``data.uint8_transfer`` and a transform ending in ToTensor [+ Normalize], uint8 pixels:
    `finish_images` turns either into the float model input (call it where the model runs). Each new
    iteration continues after the last batch consumed. `skipped`, `epoch` and `state_dict` describe the
    batches consumed so far, not those prefetched by workers.
    """

    def __init__(self, cfg: DataConfig, preprocess: Callable, tokenizer: Callable, *, seed: int, rank: int = 0,
                 world_size: int = 1, pin_memory: bool = False):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank must be in [0, world_size) (got rank={rank}, world_size={world_size})")
        self.sources = expand_sources(cfg.train)
        self.urls = [u for src in self.sources for u in src]
        if cfg.weights is not None:
            if not cfg.resampled:
                raise ConfigError("data.weights needs data.resampled=true (got weights with resampled=false)")
            if len(cfg.weights) != len(self.sources):
                raise ConfigError(f"data.weights needs one weight per '::'-separated source (got "
                                  f"{len(cfg.weights)} weights for {len(self.sources)} sources)")
            if sum(cfg.weights) <= 0:
                raise ConfigError(f"data.weights must not all be zero (got {list(cfg.weights)})")
        self.cfg, self.preprocess, self.tokenizer = cfg, preprocess, tokenizer
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.workers = int(cfg.workers)
        self.n_roles = max(1, self.workers)
        self.pin_memory = pin_memory
        self.worker_nice = int(cfg.worker_nice)
        self.draft_size = draft_size_of(preprocess) if cfg.fast_decode else None
        sample_transform = training_sample_transform(preprocess)
        self.sample_transform, finish = (split_transform(sample_transform) if cfg.uint8_transfer
                                         else (sample_transform, None))
        self.uint8 = finish is not None
        self.finish_images: Callable[[torch.Tensor], torch.Tensor] = finish if finish is not None else _identity
        self._positions = [_fresh_position() for _ in range(self.n_roles)]
        self._next_role = 0
        self.batches = 0
        self._warned: Dict[Any, Any] = {}  # the workers' warnings already shown (a `warnings` registry)
        slots = self.world_size * self.n_roles
        leftover = len(self.urls) % slots if not cfg.resampled else 0
        if leftover and rank == 0 and any(_has_scheme(u) for u in self.urls):
            # Local shards are skipped through by seeking; remote ones are downloaded in full by every slot.
            warnings.warn(f"{leftover} of {len(self.urls)} shards do not divide among the {slots} rank x worker "
                          f"slots and are read by every slot (each keeping 1/{slots} of their samples); with "
                          f"remote shards use a multiple of {slots} shards or data.resampled=true")

    def _spec(self) -> Dict[str, Any]:
        return {"sources": self.sources, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "n_roles": self.n_roles, "resampled": bool(self.cfg.resampled),
                "weights": None if self.cfg.weights is None else list(self.cfg.weights),
                "shuffle_buffer": int(self.cfg.shuffle_buffer), "batch_size": int(self.cfg.batch_size),
                "max_pixels": int(self.cfg.max_image_pixels), "draft_size": self.draft_size,
                "preprocess": self.sample_transform, "as_uint8": self.uint8, "tokenizer": self.tokenizer,
                "worker_nice": self.worker_nice}

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        starts = [_copy_position(p) for p in self._positions]
        if self.workers == 0:
            source: Iterable = role_batches(self._spec(), 0, starts[0])
        else:
            # Workers deliver batches round-robin starting at worker 0; shifting roles by the next expected
            # role makes a new loader continue the exact batch order of the previous one.
            source = torch.utils.data.DataLoader(
                _SlotStreams(self, starts, self._next_role), batch_size=None, num_workers=self.workers,
                pin_memory=self.pin_memory)
        for batch in source:
            for message, category, filename, lineno in batch.pop("__warnings__", ()):
                warnings.warn_explicit(message, category, filename, lineno, registry=self._warned)
            if "__error__" in batch:
                raise DataError(batch["__error__"])
            state = batch.pop("__state__")
            role = state.pop("role")
            self._positions[role] = state
            self._next_role = (role + 1) % self.n_roles
            self.batches += 1
            yield batch

    @property
    def skipped(self) -> Dict[str, int]:
        """Running totals of skipped samples of this process: ``total`` and one count per reason."""
        out = _zero_skips()
        for pos in self._positions:
            for reason, n in pos["skipped"].items():
                out[reason] = out.get(reason, 0) + n
        out["total"] = sum(out.values())
        return out

    @property
    def epoch(self) -> int:
        """The lowest epoch any worker of this process is in (data passes completed by all workers)."""
        return min(p["epoch"] for p in self._positions)

    def _layout(self) -> Dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "workers": self.n_roles, "seed": self.seed,
                "n_shards": len(self.urls), "batch_size": int(self.cfg.batch_size),
                "shuffle_buffer": int(self.cfg.shuffle_buffer), "resampled": bool(self.cfg.resampled),
                "shard_split": self._shard_split()}

    def _shard_split(self) -> str:
        """How `epoch_shard_plan` deals shards here: "balanced" where the shards that do not divide evenly among
        the slots are split by sample index (states saved before that rule, which dealt them whole, lack the
        key), "whole" where both rules give the same plan."""
        n, slots = len(self.urls), self.world_size * self.n_roles
        return "whole" if self.cfg.resampled or n < slots or n % slots == 0 else "balanced"

    def state_dict(self) -> Dict[str, Any]:
        """The position after the last consumed batch (per worker: epoch, shard, sample, skips); plain types."""
        return {"version": _STATE_VERSION, "layout": self._layout(), "next_role": self._next_role,
                "batches": self.batches, "positions": [_copy_position(p) for p in self._positions]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state`. With the same data, seed and layout the next batches equal those an
        uninterrupted stream would yield; after a layout change (workers, ranks, batch size, shards) the
        stream restarts the earliest saved epoch and warns, since exact continuation is then impossible.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise DataError(f"unrecognised data stream state (got version {got}, expected {_STATE_VERSION})")
        layout = self._layout()
        saved = dict({"shard_split": "whole"}, **state["layout"])
        if saved != layout:
            changed = sorted(k for k in layout if saved.get(k) != layout[k])
            warnings.warn("data stream layout changed since the checkpoint (" + ", ".join(
                f"{k}: {saved.get(k)} -> {layout[k]}" for k in changed) +
                "); restarting the earliest saved epoch, exact data order is not preserved")
            epoch = min(p["epoch"] for p in state["positions"])
            totals = _zero_skips()
            for p in state["positions"]:
                for k, v in p["skipped"].items():
                    totals[k] = totals.get(k, 0) + v
            self._positions = [_fresh_position() for _ in range(self.n_roles)]
            for p in self._positions:
                p["epoch"] = epoch
            self._positions[0]["skipped"] = totals
            self._positions[0]["skipped_before_epoch"] = dict(totals)
            self._next_role = 0
        else:
            self._positions = [_copy_position(p) for p in state["positions"]]
            self._next_role = int(state["next_role"])
        self.batches = int(state.get("batches", 0))


def build_train_stream(cfg: DataConfig, preprocess: Callable, tokenizer: Callable, *, seed: int, rank: int = 0,
                       world_size: int = 1, pin_memory: bool = False) -> TrainStream:
    """Build this process's infinite training stream from ``cfg.train``.

    Args:
        cfg: data config (train spec, batch_size per process, workers, shuffle_buffer, resampled, weights,
            max_image_pixels, fast_decode).
        preprocess: PIL.Image -> FloatTensor (3, H, W), e.g. open_clip's train transform (with
            ``cfg.uint8_transfer`` its ToTensor/Normalize tail runs in `TrainStream.finish_images` instead).
        tokenizer: list[str] (B) -> LongTensor (B, L).
        seed: base seed; shard order, shuffling and augmentation derive from (seed, rank, worker, epoch).
        rank, world_size: this process's place among data-parallel processes.
        pin_memory: page-locked batches (for a GPU).
    Raises:
        DataError when the spec matches no shards (and, when iterated, when no valid sample exists).
    """
    return TrainStream(cfg, preprocess, tokenizer, seed=seed, rank=rank, world_size=world_size,
                       pin_memory=pin_memory)


# ----------------------------------------------------------------------------------------------------------
# Evaluation datasets

_FOLDER_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _read_lines(path: str) -> Optional[List[str]]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _visible(name: str) -> bool:
    """Hidden names (``.ipynb_checkpoints``, ``.DS_Store``, macOS ``._*`` files) are neither classes nor samples."""
    return not name.startswith(".")


def _class_folders(root: str) -> List[str]:
    """The visible subfolders of an ImageFolder root, sorted (their order gives the labels)."""
    return sorted(d for d in os.listdir(root) if _visible(d) and os.path.isdir(os.path.join(root, d)))


def _walk_files(folder: str) -> Iterator[str]:
    """Paths of the visible files under `folder` in sorted order, hidden folders not entered."""
    for dirpath, dirnames, names in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if _visible(d))
        for name in sorted(names):
            if _visible(name):
                yield os.path.join(dirpath, name)


def _is_image_folder(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if any(name.endswith(_SHARD_SUFFIXES) for name in os.listdir(path)):
        return False
    return bool(_class_folders(path))


@dataclass
class EvalSkip:
    """An evaluation sample that cannot be used; it travels through the DataLoader in place of the sample.

    ``reason`` is a skip reason (``decode``, ``unsupported_mode``, ``too_large``, ``missing_file``, ...) and
    ``where`` names the file or shard sample.
    """

    reason: str
    where: str
    detail: str = ""


@dataclass
class EvalFailure:
    """A user error (`MmclError`) raised while reading evaluation data, carried out of a DataLoader worker so the
    main process re-raises the original error (a worker's exception would come back wrapped in its traceback)."""

    error: Exception


def _decode_file(path: str, max_pixels: int) -> Image.Image:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SkipSample("missing_file", "the file is gone")
    except OSError as err:
        raise SkipSample("decode", f"{type(err).__name__}: {err}")
    return decode_image(data, max_pixels)


def open_rgb(path: str, max_pixels: int = DataConfig.max_image_pixels) -> Image.Image:
    """An image file decoded by `decode_image` (RGB, any pixel mode converted by `to_rgb`).

    Raises `DataError` naming the file and the skip reason when it cannot be used.
    """
    try:
        return _decode_file(path, max_pixels)
    except SkipSample as skip:
        raise DataError(f"cannot read image {path} ({skip})") from None


class ImageFolderDataset(torch.utils.data.Dataset):
    """An ImageFolder (``root/<class>/<image>``) for evaluation: items (image (3,H,W) float, label, "", key).

    Labels are the index of the class folder in sorted order; ``classnames`` are the folder names, or
    the lines of ``root/classnames.txt`` when it has one line per folder (human-readable names for folders
    such as WordNet ids). ``templates`` are the lines of ``root/templates.txt`` when present, else None.
    Hidden folders and files (names starting with '.') are ignored. An image that cannot be decoded gives an
    `EvalSkip` item instead (`eval_collate` separates them), so evaluation counts it and goes on.
    """

    def __init__(self, root: str, preprocess: Callable, max_pixels: int = DataConfig.max_image_pixels):
        self.root, self.preprocess, self.max_pixels = root, preprocess, max_pixels
        self.folders = _class_folders(root)
        self.items: List[Tuple[str, int]] = []
        for label, folder in enumerate(self.folders):
            for path in _walk_files(os.path.join(root, folder)):
                if path.lower().endswith(_FOLDER_IMAGE_EXTS):
                    self.items.append((path, label))
        if not self.items:
            raise DataError(f"no images found in ImageFolder {root} (expected {root}/<class>/<image>.jpg|png|...)")
        names = _read_lines(os.path.join(root, "classnames.txt"))
        self.classnames = names if names is not None and len(names) == len(self.folders) else list(self.folders)
        self.templates = _read_lines(os.path.join(root, "templates.txt"))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        key = os.path.relpath(path, self.root)
        try:
            img = _decode_file(path, self.max_pixels)
            return self.preprocess(img), label, "", key
        except SkipSample as skip:
            return EvalSkip(skip.reason, key, str(skip))
        except MmclError as err:
            return EvalFailure(err)


class ShardEvalDataset(torch.utils.data.IterableDataset):
    """WebDataset shards for evaluation: each sample once, in shard order; items (image, label, caption, key).

    ``label`` is the ``.cls`` value (-1 when absent), ``caption`` the ``.txt`` text ("" when absent).
    Samples without a readable image give an `EvalSkip` item instead (`eval_collate` separates them) and are
    counted in ``skipped`` (of this process); a user error while reading gives an `EvalFailure` item that ends
    the iteration. Under a DataLoader with workers, shards (or, with fewer shards than workers, samples) are
    split across them. ``classnames``/``templates`` come from ``classnames.txt`` and ``templates.txt`` (or
    CLIP_benchmark's ``zeroshot_classification_templates.txt``) next to the shards, when present.
    """

    def __init__(self, spec: Any, preprocess: Callable, max_pixels: int = DataConfig.max_image_pixels):
        self.urls = expand_urls(spec)
        self.preprocess, self.max_pixels = preprocess, max_pixels
        self.skipped = _zero_skips()
        folder = os.path.dirname(self.urls[0]) if not _has_scheme(self.urls[0]) else None
        self.classnames = _read_lines(os.path.join(folder, "classnames.txt")) if folder is not None else None
        self.templates = None
        if folder is not None:
            self.templates = (_read_lines(os.path.join(folder, "templates.txt"))
                              or _read_lines(os.path.join(folder, "zeroshot_classification_templates.txt")))

    def __iter__(self):
        try:
            yield from self._samples()
        except MmclError as err:
            yield EvalFailure(err)

    def _samples(self):
        info = torch.utils.data.get_worker_info()
        n, k = (1, 0) if info is None else (info.num_workers, info.id)
        if len(self.urls) >= n:
            plan = [(u, None) for u in self.urls[k::n]]
        else:
            plan = [(u, (k, n)) for u in self.urls]
        for item in read_raw_samples(plan):
            if item.error is not None:
                self.skipped[item.error] += 1
                yield EvalSkip(item.error, item.url)
                continue
            files = item.files
            try:
                data = image_bytes(files)
                if data is None:
                    raise SkipSample("missing_image")
                label = parse_label(files.get("cls"))
                try:
                    caption = parse_caption(files.get("txt"))
                except SkipSample:
                    caption = ""
                img = decode_image(data, self.max_pixels)
            except SkipSample as skip:
                self.skipped[skip.reason] += 1
                yield EvalSkip(skip.reason, f"{item.url}:{item.key}", str(skip))
                continue
            yield self.preprocess(img), label, caption, item.key


def eval_collate(items: List[Any]):
    """Collate evaluation items, setting aside the `EvalSkip` / `EvalFailure` ones.

    Returns:
        (images (B,3,H,W) float or None when B == 0, labels (B,) int64, captions [B str], keys [B str],
        problems: the `EvalSkip` and `EvalFailure` items in order).
    """
    good = [it for it in items if not isinstance(it, (EvalSkip, EvalFailure))]
    problems = [it for it in items if isinstance(it, (EvalSkip, EvalFailure))]
    if not good:
        return None, torch.zeros(0, dtype=torch.long), [], [], problems
    images = torch.stack([it[0] for it in good])
    labels = torch.tensor([int(it[1]) for it in good], dtype=torch.long)
    return images, labels, [it[2] for it in good], [it[3] for it in good], problems


def build_eval_dataset(path: Any, preprocess: Callable):
    """An evaluation dataset from an ImageFolder directory or a shard spec.

    Returns a torch Dataset (ImageFolder) or IterableDataset (shards) yielding
    (image FloatTensor (3,H,W), label int (-1 if none), caption str ("" if none), key str), with
    ``classnames`` (list or None) and ``templates`` (list or None). Finite: each sample exactly once.
    """
    if isinstance(path, str) and _is_image_folder(path):
        return ImageFolderDataset(path, preprocess)
    return ShardEvalDataset(path, preprocess)


# ----------------------------------------------------------------------------------------------------------
# Converting folders and tables to shards

_PIL_TO_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def _load_for_shard(path: str) -> Tuple[bytes, str]:
    """Read an image file for a shard: original bytes for JPEG/PNG/WebP, re-encoded PNG otherwise.

    The original bytes keep every pixel the file has (a 16-bit PNG stays 16-bit; `decode_image` converts it when
    it is read); other formats are written as the RGB image `to_rgb` makes of them. Raises `SkipSample` (reasons
    ``decode``, ``too_large``, ``unsupported_mode``) for a file that would be skipped when read.
    """
    with open(path, "rb") as f:
        data = f.read()
    img = decode_image(data, Image.MAX_IMAGE_PIXELS * 2)  # a full decode: catches cut-off files too
    fmt = Image.open(io.BytesIO(data)).format
    if fmt in _PIL_TO_EXT:
        return data, _PIL_TO_EXT[fmt]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), "png"


def _rows_from_table(path: str) -> Iterator[Tuple[int, Any]]:
    """Yield (line number, row dict or an error string) from a CSV or JSONL file."""
    if path.lower().endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames or []
            if "image" not in fields or "caption" not in fields:
                raise DataError(f"{path} needs columns 'image' and 'caption' (got {', '.join(fields) or 'none'})")
            for row in reader:
                yield reader.line_num, row
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, f"not JSON ({err.msg})"
                continue
            yield line_no, row if isinstance(row, dict) else f"not a JSON object (got {type(row).__name__})"


def shards_from_input(input_path: str, out_dir: str, shard_size: int = 1000,
                      caption_template: str = "a photo of a {}.", progress: bool = True) -> Dict[str, Any]:
    """Convert an ImageFolder, a CSV or a JSONL file into WebDataset shards in `out_dir`.

    ImageFolder: captions are `caption_template` filled with the class folder name (underscores as
    spaces), ``.cls`` is the sorted folder index, and ``classnames.txt`` is written next to the shards.
    CSV/JSONL: rows carry ``image`` (a path relative to the file), ``caption`` and optionally ``label``.
    Unreadable images and bad rows are skipped, counted per reason and reported; a summary line is printed.

    Returns:
        {"out_dir", "shards", "n_shards", "n_samples", "n_skipped", "skipped": {reason: n},
         "skipped_examples": [first few "item: reason" strings]}.
    """
    if not os.path.exists(input_path):
        raise DataError(f"input not found: {input_path} (expected an ImageFolder directory, a .csv or a .jsonl)")
    if "{}" not in caption_template:
        raise DataError(f"caption_template needs a '{{}}' for the class name (got {caption_template!r})")
    jobs: List[Tuple[str, str, Any, str]] = []  # (image path, caption, label, where) or problems
    problems: List[Tuple[str, str]] = []
    classnames: Optional[List[str]] = None
    if os.path.isdir(input_path):
        classnames = _class_folders(input_path)
        if not classnames:
            raise DataError(f"{input_path} has no class folders (expected {input_path}/<class>/<image>)")
        for label, name in enumerate(classnames):
            text = caption_template.format(name.replace("_", " "))
            for path in _walk_files(os.path.join(input_path, name)):
                if path.lower().endswith(_FOLDER_IMAGE_EXTS):
                    jobs.append((path, text, label, os.path.relpath(path, input_path)))
                else:
                    problems.append((os.path.relpath(path, input_path), "not_image"))
    elif input_path.lower().endswith((".csv", ".jsonl", ".json", ".ndjson")):
        base = os.path.dirname(os.path.abspath(input_path))
        for line_no, row in _rows_from_table(input_path):
            where = f"{os.path.basename(input_path)}:{line_no}"
            if isinstance(row, str):
                problems.append((where, "bad_row"))
                continue
            image, text, label = row.get("image"), row.get("caption"), row.get("label")
            if not image:
                problems.append((where, "missing_image"))
                continue
            if not isinstance(text, str) or not text.strip():
                problems.append((where, "bad_caption"))
                continue
            if label in ("", None):
                label = None
            else:
                try:
                    label = int(label)
                    if label < 0:
                        raise ValueError
                except (TypeError, ValueError):
                    problems.append((where, "bad_label"))
                    continue
            jobs.append((os.path.join(base, str(image)), text.strip(), label, where))
    else:
        raise DataError(f"unsupported input {input_path} (expected an ImageFolder directory, a .csv or a .jsonl)")

    def samples() -> Iterator[Dict[str, Any]]:
        items: Iterable = jobs
        if progress:
            from tqdm import tqdm

            items = tqdm(jobs, desc="shards", unit="img")
        for path, text, label, where in items:
            if not os.path.isfile(path):
                problems.append((where, "missing_file"))
                continue
            try:
                data, ext = _load_for_shard(path)
            except SkipSample as skip:
                problems.append((where, skip.reason))
                continue
            yield {"key": f"{len(written):09d}", "image": data, "ext": ext, "caption": text, "label": label,
                   "json": {"source": where}}
            written.append(where)

    written: List[str] = []
    os.makedirs(out_dir, exist_ok=True)
    summary = write_shards(samples(), out_dir, shard_size=shard_size, prefix="shard")
    if classnames is not None:
        with open(os.path.join(out_dir, "classnames.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(n.replace("_", " ") for n in classnames) + "\n")
    counts: Dict[str, int] = {}
    for _, reason in problems:
        counts[reason] = counts.get(reason, 0) + 1
    summary.update(n_skipped=len(problems), skipped=counts,
                   skipped_examples=[f"{where}: {reason}" for where, reason in problems[:10]])
    detail = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"wrote {summary['n_samples']} samples in {summary['n_shards']} shards to {out_dir}; "
          f"skipped {len(problems)}" + (f" ({detail})" if detail else ""))
    if summary["n_samples"] == 0:
        raise DataError(f"no valid sample in {input_path} (skipped {len(problems)}: {detail or 'no images found'})")
    return summary
