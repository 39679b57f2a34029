"""Bounds on what a file from elsewhere can cost: one constant per bound, and the function that applies it.

* A text becomes tokens only through `BoundedTokenizer` (every tokenizer `mmcl.models.build_tokenizer` makes):
  each text is first cut by `bound_text` to `MAX_TEXT_CHARS` characters, and each run of non-space characters
  (a "word", whose byte-pair encoding costs grow with its length) to `MAX_WORD_CHARS`: at most about 0.5 s of
  CLIP's byte-pair merges for any text. A 77-token context holds at most about 2,300 characters of words of
  CLIP's vocabulary, and a word of 320 letters fills most of it, so an ordinary caption keeps its token ids.
  Texts that were cut are counted (``BoundedTokenizer.cut``) and said once, in one warning.
* A JSON member of a sample is parsed by `load_json`: nesting too deep for the parser is a ``ValueError``, as
  any other text that is not JSON, which the callers count as a bad sample.
* Negative captions (``data.negatives``): a sample is read for at most `MAX_NEGATIVES` of them per batch, chosen
  from at most `MAX_NEGATIVE_CANDIDATES` it offers (the first lines of its ``neg.txt``, the first entries of its
  JSON ``negatives``); each is a text like any other (`BoundedTokenizer`).
* A list that expands (brace ranges, globs, shard lists whose YAML aliases repeat a list) is taken through
  `bounded`: more than `MAX_LIST_ENTRIES` entries is a `DataError`, found after reading that many entries.
* A file from elsewhere is read as a regular file only, opened without blocking (`open_regular`: a FIFO would
  make its reader wait forever), and its size is checked against the reader's bound before it is read
  (`read_regular_bytes`).
* What a file declares is checked before memory is spent on it: zero-shot templates (`MAX_TEMPLATES`, encoded
  `MAX_TEXTS_AT_ONCE` at a time, `mmcl.evaluation.evaluate`), an index's vector length (`MAX_EMBED_DIM`, from
  index.faiss's header, `mmcl.evaluation.index`), the caption and metadata files `mmcl shards` reads
  (`MAX_TEXT_FILE_BYTES`, from their size, `read_regular_bytes`), class names (`MAX_CLASSES`, a classnames file's
  lines or an ImageFolder's class folders) and the class names and templates files themselves
  (`MAX_NAMES_FILE_BYTES`, from their size, `read_names_file`).
* Why a path cannot be read is said in the same words by every option that names a file
  (`mmcl.errors.file_problem`); a link in a folder mmcl reads that leads out of it is never read (`inside_folder`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import warnings
from itertools import islice
from typing import Any, Callable, Iterable, List, Optional

from ..errors import DataError, file_kind, file_problem

MAX_TEXT_CHARS = 4096
MAX_WORD_CHARS = 320
MAX_LIST_ENTRIES = 1_000_000
MAX_NEGATIVES = 64
MAX_NEGATIVE_CANDIDATES = 1024
MAX_TEXT_FILE_BYTES = 1 << 20  # a caption or metadata file `mmcl shards` reads (KEY.txt, KEY.json), by its size
MAX_TEMPLATES = 1_000  # zero-shot templates of a set (open_clip's largest has 80), checked before any is encoded
MAX_TEXTS_AT_ONCE = 1_024  # texts encoded in one forward pass when building a zero-shot classifier
MAX_EMBED_DIM = 65_536  # an index's vector length (index.faiss's header), checked before faiss allocates
MAX_CLASSES = 100_000  # class names of a set: a classnames file's lines, an ImageFolder's class folders
MAX_NAMES_FILE_BYTES = 16 << 20  # a class names or templates file, by its size, before it is read

_LONG_WORD = re.compile(r"\S{%d,}" % (MAX_WORD_CHARS + 1))


def bound_text(text: str) -> str:
    """`text` cut to `MAX_TEXT_CHARS` characters, each word in it (a run of non-space characters) to
    `MAX_WORD_CHARS`; an ordinary caption is returned unchanged."""
    text = text[:MAX_TEXT_CHARS]
    return _LONG_WORD.sub(lambda m: m.group()[:MAX_WORD_CHARS], text)


class BoundedTokenizer:
    """A tokenizer that sees each text cut by `bound_text` first; ``cut`` counts the texts that were cut in this
    process. Picklable, so that data workers can use it; other attributes are the wrapped tokenizer's."""

    def __init__(self, tokenizer: Callable):
        self.wrapped, self.cut = tokenizer, 0

    def __call__(self, texts, *args, **kwargs):
        one = isinstance(texts, str)
        bounded = [bound_text(t) for t in ([texts] if one else texts)]
        cut = sum(b != t for b, t in zip(bounded, [texts] if one else texts))
        if cut:
            if not self.cut:
                warnings.warn(f"texts over {MAX_TEXT_CHARS:,} characters, or with a word over {MAX_WORD_CHARS} "
                              f"characters, are cut to that before tokenizing (the tokens past the context are "
                              f"dropped anyway)", stacklevel=2)
            self.cut += cut
        return self.wrapped(bounded[0] if one else bounded, *args, **kwargs)

    def __getattr__(self, name):  # context_length, .tokenizer, the wrapped tokenizer's methods
        if name == "wrapped":  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def load_json(data: Any) -> Any:
    """``json.loads`` of a member or file from elsewhere; nesting too deep to parse is a ``ValueError``."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check_entries(count: int, what: str) -> None:
    """`DataError` naming `what` when `count` (entries found so far) is over `MAX_LIST_ENTRIES`."""
    if count > MAX_LIST_ENTRIES:
        raise DataError(f"{what} expands to more than {MAX_LIST_ENTRIES:,} entries (name fewer, or split it)")


def bounded(items: Iterable, what: str) -> List:
    """The entries of `items` as a list, reading at most one over `MAX_LIST_ENTRIES` (`check_entries`)."""
    out = list(islice(items, MAX_LIST_ENTRIES + 1))
    check_entries(len(out), what)
    return out


# ---------------------------------------------------------------------------------------- regular files only
class NotRegularFile(OSError):
    """An input that is not a regular file (a FIFO, a device, a socket, a folder): never read, never waited on."""


def require_regular(path) -> os.stat_result:
    """The ``os.stat`` of `path` (a link is followed), NotRegularFile (an OSError) unless it is a regular file: for a
    file another library opens by name (safetensors, faiss), checked before it is handed over."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, f"{file_kind(st.st_mode)}, not a regular file", str(path))
    return st


def open_regular(path, mode: str = "rb", encoding: Optional[str] = None, errors: Optional[str] = None,
                 newline: Optional[str] = None):
    """`path` opened for reading, as ``open(path, mode)`` does, but never blocking: ``O_NONBLOCK`` makes the open of
    a FIFO return at once (a reader would otherwise wait for a writer forever), and the open file must be a regular
    file (``fstat``), else NotRegularFile (an OSError) naming what it is. A link is followed (inputs may be links).

    Every reader of a file from elsewhere goes through it: shards, evaluation images, class names and templates,
    the inputs of `mmcl shards`, model folders' configs, index files."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only, not {mode!r}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{file_kind(st.st_mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding, errors=errors, newline=newline)
    except BaseException:
        os.close(fd)
        raise


class FileTooLarge(OSError):
    """A file over the bound its reader sets, found from its size before it is read."""


def read_regular_bytes(path, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` (`open_regular`), FileTooLarge (an OSError) when its size is over
    `max_bytes`: checked with ``fstat`` before a byte is read, and again on what is read (a file that grows)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"{size:,} bytes, over the bound of {max_bytes:,}", str(path))
        data = f.read(size + 1)  # (a buffer of the file's size: read(max_bytes) would allocate the bound)
        if len(data) > size:  # it grew meanwhile
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise FileTooLarge(errno.EFBIG, f"over the bound of {max_bytes:,} bytes", str(path))
    return data


def inside_folder(root, path) -> bool:
    """Whether `path` (a file found under the folder `root`), its links resolved, is still inside `root`: an input
    folder's link that leads out of it (``000001.txt -> ~/.netrc``) is never read as a part of that folder."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


def read_names_file(path, what: str, max_lines: int, unit: str, why: str, root=None) -> List[str]:
    """The non-empty lines of a class names or templates file (line ends removed), read within bounds. One
    `DataError` line, before memory is spent on it, when the path cannot be read (`mmcl.errors.file_problem`: "is
    not a regular file (a FIFO)", "not found"...), when it lies in the dataset folder `root` but is a link that
    leads out of it (`inside_folder`, the rule of `mmcl shards`' ``outside_link``), when its size is over
    `MAX_NAMES_FILE_BYTES` (from ``fstat``, before a byte is read), or when it has more than `max_lines` lines
    ("{what} PATH: N {unit}, more than the {max_lines} {why}"; past the bound lines are counted, not kept)."""
    problem = file_problem(path)
    if problem is not None:
        raise DataError(f"{what} {problem}: {path}")
    if root is not None and not inside_folder(root, path):
        raise DataError(f"{what} {path} is a symbolic link that leads out of {root}; mmcl never reads it (copy the "
                        f"file into the folder)")
    lines: List[str] = []
    count = 0
    try:
        with open_regular(path, "r", encoding="utf-8") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_NAMES_FILE_BYTES:
                raise DataError(f"{what} {path}: {size:,} bytes, over the {MAX_NAMES_FILE_BYTES:,} a class names or "
                                f"templates file may have")
            seen = 0
            while line := f.readline(MAX_NAMES_FILE_BYTES + 1):
                if line.strip():
                    count += 1
                    if count <= max_lines:
                        lines.append(line.rstrip("\r\n"))
                seen += len(line)  # characters: never more than the bytes they came from
                if seen > MAX_NAMES_FILE_BYTES:  # it grew meanwhile
                    raise DataError(f"{what} {path}: over the {MAX_NAMES_FILE_BYTES:,} bytes a class names or "
                                    f"templates file may have")
    except (OSError, UnicodeDecodeError) as err:
        detail = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise DataError(f"cannot read the {what} {path}: {detail}") from None
    if count > max_lines:
        raise DataError(f"{what} {path}: {count:,} {unit}, more than the {max_lines:,} {why}")
    return lines


def read_regular_text(path, encoding: str = "utf-8", errors: Optional[str] = None) -> str:
    """The text of the regular file `path` (`open_regular`)."""
    with open_regular(path, "r", encoding=encoding, errors=errors) as f:
        return f.read()
