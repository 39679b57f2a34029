"""How many samples one pass over the training shards holds, from the counts that come with the shards.

A tar stream has no index: counting its samples means reading it. Shards come with their counts instead, in the
files open_clip and img2dataset leave beside them, looked up in this order for each shard:

* ``sizes.json`` in the shard's folder: ``{"shard-000000.tar": 10000, ...}`` (open_clip's ``get_dataset_size``);
* ``NNNNN_stats.json`` beside ``NNNNN.tar``: img2dataset's per-shard statistics, whose ``successes`` is the
  number of samples written into the shard;
* ``__len__`` in the folder: the folder's total (open_clip reads it for the whole spec; here it counts only for a
  source that uses every shard of its folder, since it cannot be split between shards).

Only local shards have such files to read; URLs and ``pipe:`` commands need ``data.train_num_samples`` (open_clip's
``--train-num-samples``).
"""

from __future__ import annotations

import ast
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

from ..errors import DataError
from .limits import load_json, open_regular
from .sources import SHARD_SUFFIXES, SIZES_FILE, expand_sources, has_scheme, redact, split_spec, table_problem

MAX_COUNT = 10 ** 12  # samples in one shard or folder: more is not a count but a damaged file


def _read_json(path: str) -> Any:
    try:
        with open_regular(path, "r", encoding="utf-8") as f:
            return load_json(f.read())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read the shard sizes in {path}: {err}") from None


def _count(value: Any, path: str, what: str) -> int:
    """`value` as a sample count (a whole number, or its digits in a string, as open_clip reads sizes.json), else
    `DataError` naming `path` and `what` is counted."""
    if isinstance(value, str) and value.strip().isdecimal() and len(value) < 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise DataError(f"{path}: the sample count of {what} must be a whole number from 0 to {MAX_COUNT:,} "
                        f"(got {repr(value)[:80]})")
    return value


def _folder_total(folder: str) -> Optional[int]:
    path = os.path.join(folder, "__len__")
    if not os.path.isfile(path):
        return None
    try:
        with open_regular(path, "r") as f:
            value = ast.literal_eval(f.read(4096).strip())  # a number, never code
    except (OSError, ValueError, SyntaxError, RecursionError, MemoryError) as err:
        raise DataError(f"cannot read the sample count in {path}: {err}") from None
    return _count(value, path, "the folder")


def _shard_count(url: str, sizes: Dict[str, Dict[str, Any]]) -> Optional[int]:
    """The sample count of the local shard `url` from sizes.json or img2dataset's stats file; None when unknown."""
    folder, name = os.path.split(os.path.abspath(url))
    if folder not in sizes:
        path = os.path.join(folder, SIZES_FILE)
        table = _read_json(path) if os.path.isfile(path) else {}
        if not isinstance(table, dict):
            raise DataError(f"{path} must map shard names to sample counts")
        sizes[folder] = table
    if name in sizes[folder]:
        return _count(sizes[folder][name], os.path.join(folder, SIZES_FILE), name)
    stem = name
    for suffix in SHARD_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[:-len(suffix)]
            break
    stats = os.path.join(folder, f"{stem}_stats.json")
    if os.path.isfile(stats):
        record = _read_json(stats)
        if isinstance(record, dict) and record.get("successes") is not None:
            return _count(record["successes"], stats, "its shard (successes)")
    return None


def known_total(urls: List[str]) -> Optional[int]:
    """The samples in the shards `urls` from sizes.json or img2dataset's stats files; None as soon as one shard's
    count is unknown (a URL, a ``pipe:`` command, a shard no file lists, an unreadable sizes file)."""
    sizes: Dict[str, Dict[str, Any]] = {}
    total = 0
    for url in urls:
        if has_scheme(url) and not url.startswith("file://"):
            return None
        try:
            count = _shard_count(url, sizes)
        except (DataError, ValueError, TypeError):
            return None
        if count is None:
            return None
        total += count
    return total


def shard_samples(spec: Any, allow_pipe: bool = False, require_all: bool = False) -> Tuple[int, str]:
    """(samples in one pass over the shards of `spec`, where the counts came from).

    Raises `DataError` naming a shard whose count is unknown and the way on (``data.train_num_samples``), or, before
    anything else, a table named as shards (`sources.table_problem`: the way on is `mmcl shards`, not a count).
    """
    table = table_problem(spec)
    if table is not None:
        raise DataError(table)
    total, used = 0, set()
    sizes: Dict[str, Dict[str, Any]] = {}
    with warnings.catch_warnings():  # a source with holes: the data layer gives its one warning when it reads them
        warnings.simplefilter("ignore")
        sources = expand_sources(spec, allow_pipe, require_all)
    for urls in sources:
        remote = next((u for u in urls if has_scheme(u) and not u.startswith("file://")), None)
        if remote is not None:
            raise DataError(f"the number of samples in {remote} is unknown (a URL or pipe: command has no sizes "
                            f"file to read): set data.train_num_samples to the samples in one epoch")
        counts: List[Optional[int]] = [_shard_count(u, sizes) for u in urls]
        if all(c is not None for c in counts):
            total += sum(counts)  # type: ignore[arg-type]
            used.add("img2dataset stats" if any(os.path.basename(u) not in sizes[os.path.dirname(os.path.abspath(u))]
                                                for u in urls) else "sizes.json")
            continue
        folders = {os.path.dirname(os.path.abspath(u)) for u in urls}
        folder = folders.pop() if len(folders) == 1 else None
        every = folder is not None and sorted(os.path.abspath(u) for u in urls) == sorted(
            os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(SHARD_SUFFIXES))
        count = _folder_total(folder) if every else None
        if count is None:
            unknown = urls[counts.index(None)]
            raise DataError(f"the number of samples in {unknown} is unknown (no sizes.json listing it, no "
                            f"img2dataset _stats.json beside it): add sizes.json ({{shard name: samples}}) beside "
                            f"the shards or set data.train_num_samples to the samples in one epoch")
        total += count
        used.add("__len__")
    return total, " and ".join(sorted(used))


def describe_sources(spec: Any, allow_pipe: bool = False, require_all: bool = False,
                     num_samples: Optional[int] = None) -> List[str]:
    """One line per source of `spec` for the start of a run: the shards it resolved to (how many, the first and
    last file) and, where known, their samples (``sizes.json``, img2dataset's ``_stats.json``); `num_samples`
    (``data.train_num_samples``) is said where it stands in for the counts."""
    with warnings.catch_warnings():  # the data stream gives each of these warnings when it expands the spec
        warnings.simplefilter("ignore")
        sources = expand_sources(spec, allow_pipe, require_all)
        names = split_spec(spec, allow_pipe)
    lines = []
    for i, (source, urls) in enumerate(zip(names, sources)):
        label = f"data.train source {i + 1} of {len(sources)}" if len(sources) > 1 else "data.train"
        shown = os.path.basename(urls[0]) if len(urls) == 1 else (
            f"{os.path.basename(urls[0])} .. {os.path.basename(urls[-1])}")
        kind = " (a folder: its shards)" if os.path.isdir(os.path.expanduser(source)) else ""
        total = known_total(urls)
        samples = "samples unknown" if total is None else f"{total:,} samples"
        lines.append(f"{label}: '{redact(source)}'{kind}: {len(urls)} shard(s) ({redact(shown)}), {samples}")
    if num_samples is not None:
        lines.append(f"data.train_num_samples={num_samples:,} samples per epoch")
    return lines
