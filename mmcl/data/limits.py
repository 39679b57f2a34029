"""Bounds on what a file from elsewhere can cost: one constant per bound, and the function that applies it.

* A text becomes tokens only through `BoundedTokenizer` (every tokenizer `mmcl.models.build_tokenizer` makes):
  each text is first cut by `bound_text` to `MAX_TEXT_CHARS` characters, and each run of non-space characters
  (a "word", whose byte-pair encoding costs grow with its length) to `MAX_WORD_CHARS`: at most about 0.5 s of
  CLIP's byte-pair merges for any text. A 77-token context holds at most about 2,300 characters of words of
  CLIP's vocabulary, and a word of 320 letters fills most of it, so an ordinary caption keeps its token ids.
  Texts that were cut are counted (``BoundedTokenizer.cut``) and said once, in one warning.
* A JSON member of a sample is parsed by `load_json`: nesting too deep for the parser is a ``ValueError``, as
  any other text that is not JSON, which the callers count as a bad sample.
* A list that expands (brace ranges, globs, shard lists whose YAML aliases repeat a list) is taken through
  `bounded`: more than `MAX_LIST_ENTRIES` entries is a `DataError`, found after reading that many entries.
* What a file declares is checked before memory is spent on it: zero-shot templates (`MAX_TEMPLATES`, encoded
  `MAX_TEXTS_AT_ONCE` at a time, `mmcl.evaluation.evaluate`), an index's vector length (`MAX_EMBED_DIM`, from
  index.faiss's header, `mmcl.evaluation.index`), the caption and metadata files `mmcl shards` reads
  (`MAX_TEXT_FILE_BYTES`, from their size, `mmcl.storage.fsutil.read_regular_bytes`).
"""

from __future__ import annotations

import json
import re
import warnings
from itertools import islice
from typing import Any, Callable, Iterable, List

from ..errors import DataError

MAX_TEXT_CHARS = 4096
MAX_WORD_CHARS = 320
MAX_LIST_ENTRIES = 1_000_000
MAX_TEXT_FILE_BYTES = 1 << 20  # a caption or metadata file `mmcl shards` reads (KEY.txt, KEY.json), by its size
MAX_TEMPLATES = 1_000  # zero-shot templates of a set (open_clip's largest has 80), checked before any is encoded
MAX_TEXTS_AT_ONCE = 1_024  # texts encoded in one forward pass when building a zero-shot classifier
MAX_EMBED_DIM = 65_536  # an index's vector length (index.faiss's header), checked before faiss allocates

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
