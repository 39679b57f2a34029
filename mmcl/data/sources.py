"""Shard specs: which tar shards a spec names, and how one is opened.

A spec is a string or a list: '::'-separated sources, each a brace range (``shard-{000000..000009}.tar``), a
glob, a directory of shards, a local path, or a URL with a scheme (``pipe:``, ``http://``, ...). A YAML list, or a
``.yaml`` file holding one, is accepted too. `expand_sources` gives one URL list per source, `missing_shards`
describes what a spec names that is not there (for preflight checks), and `open_shard` opens a URL as a byte stream.

Names are data, not commands. Only text the user typed (a config value, an override, a command-line argument) may
be a ``pipe:`` command or a URL: a name found on disk (by a glob or a directory listing) is expanded to its absolute
path, and `open_shard` opens every name without a scheme with ``open()``, so a downloaded file named
``pipe:cmd;#.tar`` is read as the (empty) file it is. A shard list file (``shards.yaml``) ships with the data and
may list ``pipe:`` commands only with ``data.allow_pipe=true``. `redact` hides the credentials a ``pipe:`` command
or URL may carry wherever mmcl writes or prints it.
"""

from __future__ import annotations

import glob
import os
import re
import string
import warnings
from typing import Any, Dict, Iterator, List, Optional

import braceexpand
import yaml
from webdataset import gopen

from ..errors import DataError, redact, redact_values  # noqa: F401 (redact_values: for importers)
from .limits import MAX_LIST_ENTRIES, bounded, check_entries, load_json, open_regular

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
SIZES_FILE = "sizes.json"  # each shard's sample count, beside the shards (open_clip's layout; `mmcl shards` writes it)
# Tables `mmcl shards` reads (open_clip's CSV among them): named as training data, they are what to convert first.
TABLE_EXTS = (".csv", ".tsv", ".jsonl", ".json", ".ndjson", ".parquet")


def split_spec(spec: Any, allow_pipe: bool = False) -> List[str]:
    """Flatten a spec (str, list, YAML list, '::'-joined) into one string per source, at most `MAX_LIST_ENTRIES`
    (a list whose YAML aliases repeat another list is refused after that many, never expanded whole)."""
    shown = redact(spec if isinstance(spec, str) else repr(spec)[:200])
    return bounded(_spec_parts(spec, allow_pipe), f"the shard spec {shown!r}")


def _spec_parts(spec: Any, allow_pipe: bool = False, listed_in: Optional[str] = None) -> Iterator[str]:
    """The sources of `spec`, one at a time (`split_spec`).

    Entries read from a shard list file (`listed_in`) are the data's, not the user's: a ``pipe:`` command there is
    refused unless `allow_pipe` (``data.allow_pipe``)."""
    if spec is None:
        raise DataError("no training data given (got data.train=None, expected a shard spec such as "
                        "'shards/shard-{000000..000009}.tar')")
    if isinstance(spec, (list, tuple)):
        for item in spec:
            yield from _spec_parts(item, allow_pipe, listed_in)
        return
    if not isinstance(spec, str):
        raise DataError(f"shard spec must be a string or a list of strings (got {type(spec).__name__}: "
                        f"{redact(repr(spec))[:200]})")
    text = spec.strip()
    if text.startswith("["):
        try:
            items = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as err:
            raise DataError(f"cannot parse shard spec as a YAML list: {redact(text)[:200]!r} "
                            f"({redact(str(err).splitlines()[0] if str(err) else type(err).__name__)})")
        check_entries(_entries(items, {}), "the shard spec")
        yield from _spec_parts(items, allow_pipe, listed_in)
        return
    if text.lower().endswith((".yaml", ".yml")) and os.path.isfile(text):
        try:
            with open_regular(text, "r") as f:
                items = yaml.safe_load(f)
        except (yaml.YAMLError, RecursionError) as err:
            raise DataError(f"cannot read the shard list {text}: "
                            f"{str(err).splitlines()[0] if str(err) else 'nested too deeply'}")
        if not isinstance(items, list):
            raise DataError(f"{text} must hold a YAML list of shard specs (got {type(items).__name__})")
        check_entries(_entries(items, {}), f"the shard list {text}")
        yield from _spec_parts(items, allow_pipe, listed_in=text)
        return
    parts = [part.strip() for part in text.split("::") if part.strip()]
    if listed_in is not None and not allow_pipe:
        for part in parts:
            if part[:5].lower() == "pipe:":  # webdataset reads the scheme in any case
                raise DataError(f"the shard list {listed_in} runs a command ({redact(part)}); a list that comes "
                                f"with data may name files and URLs only, set data.allow_pipe=true if you trust it")
    yield from parts


def _entries(items: Any, counted: Dict[int, int]) -> int:
    """The entries a loaded YAML list flattens to, counted without flattening: a list that YAML aliases repeat is
    one object, counted once (`counted`, by id), so a small file cannot make this count take long."""
    if not isinstance(items, list):
        return 1
    if id(items) not in counted:
        counted[id(items)] = sum(_entries(item, counted) for item in items)
    return counted[id(items)]


def table_problem(spec: Any) -> Optional[str]:
    """The line for a table (a CSV open_clip trains from, or any table `mmcl shards` reads) named as a training
    source of `spec`: the command that makes shards of it. None when no source is a local table (or the spec cannot
    be read: the shards' own checks say why)."""
    try:
        sources = split_spec(spec)
    except (DataError, OSError):
        return None
    for source in sources:
        if source.lower().endswith(TABLE_EXTS) and not (has_scheme(source) and not source.startswith("file://")):
            return (f"data.train: {redact(source)} is a table, not WebDataset shards: make shards of it with "
                    f"`mmcl shards --input {redact(source)} --out DIR`, then train with data.train=DIR")
    return None


def has_scheme(url: str) -> bool:
    """Whether `url` starts with a URL scheme (``pipe:``, ``http:``, ...); a Windows drive letter is no scheme."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url)) and not re.match(r"^[a-zA-Z]:[\\/]", url)


def _found(paths: List[str]) -> List[str]:
    """Names a glob or a directory listing returned, as absolute paths: a file's name is data, and one that reads
    like a command or URL (``pipe:cmd;#.tar``, ``http:x.tar``) must stay a local path."""
    return sorted(os.path.abspath(p) for p in paths)


_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?")  # braceexpand's range forms
_CHAR_RANGE = re.compile(r"([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
_MAX_BRACE_DEPTH = 8  # braceexpand reads a pattern once per level of nesting


def _braces(source: str) -> List[str]:
    """``braceexpand(source)`` as a list. braceexpand holds each range whole in memory, so the names a pattern
    expands to are counted from the pattern first, and more than `MAX_LIST_ENTRIES` is refused unexpanded."""
    shown = f"'{redact(source)[:200]}'"
    try:
        check_entries(_brace_count(source), shown)
        return list(braceexpand.braceexpand(source))
    except ValueError as err:  # unbalanced, or nested too deep
        raise DataError(f"cannot expand the braces of {shown} ({err})") from None


def _brace_count(pattern: str) -> int:
    """How many names braceexpand makes of `pattern` (ranges, comma lists, nesting, backslash escapes), in one pass;
    a count over `MAX_LIST_ENTRIES` is given as `MAX_LIST_ENTRIES` + 1."""
    cap = MAX_LIST_ENTRIES + 1
    frames = [[0, 1, 0]]  # per open brace: (sum of the alternatives before the last comma, product since, start)
    pos = 0
    while pos < len(pattern):
        ch = pattern[pos]
        if ch == "\\":
            pos += 1
        elif ch == "{":
            frames.append([0, 1, pos + 1])
            if len(frames) > _MAX_BRACE_DEPTH:
                raise ValueError(f"braces nested more than {_MAX_BRACE_DEPTH} deep")
        elif ch == "," and len(frames) > 1:
            frames[-1][:2] = [min(cap, frames[-1][0] + frames[-1][1]), 1]
        elif ch == "}" and len(frames) > 1:
            alternatives, product, begin = frames.pop()
            found = _INT_RANGE.fullmatch(pattern, begin, pos) or _CHAR_RANGE.fullmatch(pattern, begin, pos)
            if found:
                ends = [int(v) if v.lstrip("-").isdigit() else _LETTERS.index(v) for v in found.groups()[:2]]
                product = abs(ends[1] - ends[0]) // (int(found.group(3) or 1) or 1) + 1
            frames[-1][1] = min(cap, frames[-1][1] * min(cap, alternatives + product if alternatives else product))
        pos += 1
    return frames[0][1]


def _holes_are_fatal(missing: int, named: int, require_all: bool) -> bool:
    """The one rule for a source naming shards that are not there (a LAION download with holes): train on those that
    exist, with one warning giving the count missing; refuse only when none exists or with `require_all`
    (``data.require_all_shards``). `missing_shards` (preflight) and `_expand_one` (the data layer) both ask it."""
    return missing > 0 and (require_all or missing >= named)


def folder_shards(folder: str) -> List[str]:
    """The shards a folder source takes: every shard file directly in it (``*.tar``, ``*.tar.gz``, ``*.tgz``; not
    its subfolders), as absolute paths. Where the folder has a ``sizes.json`` (written by ``mmcl shards``, ``mmcl
    demo-data`` and open_clip's tools for the shards of one set) that does not list some of them (an evaluation or
    retrieval shard copied in beside the set), one warning names those: they are trained on too, and a glob or
    brace range in ``data.train`` is the way to take some shards of a folder only."""
    shards = _found(bounded((p for p in glob.iglob(os.path.join(folder, "*")) if p.endswith(SHARD_SUFFIXES)),
                            f"the folder {folder}"))
    try:
        with open_regular(os.path.join(folder, SIZES_FILE), "r", encoding="utf-8") as f:
            listed = load_json(f.read())
    except (OSError, ValueError):
        return shards  # no sizes.json (or an unreadable one, which the sample count reports where it needs it)
    if not isinstance(listed, dict) or not any(os.path.basename(p) in listed for p in shards):
        return shards
    left = [os.path.basename(p) for p in shards if os.path.basename(p) not in listed]
    if left:
        shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
        warnings.warn(f"{len(left)} of the {len(shards)} shard files in {folder} are not listed in its {SIZES_FILE} "
                      f"({shown}) and are read too, as every shard of a folder source is (an evaluation shard copied "
                      f"in?): name the shards you mean with a glob or brace range to leave them out", stacklevel=2)
    return shards


def _expand_one(source: str, require_all: bool = False) -> List[str]:
    if source.startswith("pipe:"):
        # Braces in a pipe command address shard names; expand them but never glob a shell command.
        return _braces(source)
    urls: List[str] = []
    missing: List[str] = []
    for item in _braces(source):
        local = item.startswith("file://")
        if local:
            item = item[len("file://"):]
        if has_scheme(item) and not local:
            urls.append(item)
        elif any(ch in item for ch in "*?["):
            urls += _found(bounded(glob.iglob(os.path.expanduser(item)), f"the glob '{item}'"))
        elif os.path.isdir(os.path.expanduser(item)):
            urls += folder_shards(os.path.expanduser(item))
        elif os.path.isfile(os.path.expanduser(item)):
            path = os.path.expanduser(item)
            # A path given after file:// is a path even where it reads like a command (file://pipe:x.tar).
            urls.append(os.path.abspath(path) if has_scheme(path) else path)
        else:
            missing.append(item)
        check_entries(len(urls), f"'{redact(source)}'")
    if missing and urls:
        if _holes_are_fatal(len(missing), len(missing) + len(urls), require_all):
            raise DataError(f"{len(missing)} of {len(missing) + len(urls)} shards of '{redact(source)}' do not "
                            f"exist, e.g. {missing[0]} (data.require_all_shards=true)")
        warnings.warn(f"{len(missing)} of {len(missing) + len(urls)} shards of '{redact(source)}' do not exist, "
                      f"e.g. {missing[0]}; using the {len(urls)} that do (data.require_all_shards=true refuses "
                      f"the run instead)", stacklevel=3)
    return urls


def missing_shards(spec: Any, allow_pipe: bool = False, require_all: bool = True) -> List[str]:
    """What a shard spec names that is not there, one description per source (empty when all is in place).

    Checks local paths only: a glob that matches nothing, a brace range or path naming files that do not exist,
    a directory without shards. URLs with a scheme (``pipe:``, ``http://``, ...) are not checked. Relative
    paths resolve against the current directory; the descriptions show them resolved. A shard list file that
    runs a command without `allow_pipe` is a problem too. Without `require_all`, a source of which some paths
    exist is no problem: the data layer trains on those and warns once with the count missing.
    """
    try:
        sources = split_spec(spec, allow_pipe)
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

    problems, total = [], 0
    for source in sources:
        if has_scheme(source) and not source.startswith("file://"):
            continue
        try:
            names = _braces(source)
            total += len(names)
            check_entries(total, "the shard spec")
        except DataError as err:
            return problems + [str(err)]
        missing, named = [], 0
        for item in names:
            item = os.path.expanduser(item[len("file://"):] if item.startswith("file://") else item)
            named += 1
            if any(ch in item for ch in "*?["):
                if next(glob.iglob(item), None) is None:
                    missing.append(f"no file matches {os.path.abspath(item)}")
                continue
            found = kind(item)
            if found == "dir":
                if not any(p.endswith(SHARD_SUFFIXES) for p in os.listdir(item)):
                    missing.append(f"no {'/'.join(SHARD_SUFFIXES)} shards in the directory {os.path.abspath(item)}")
            elif found is None:
                missing.append(os.path.abspath(item))
        if not _holes_are_fatal(len(missing), named, require_all):
            continue
        if named == 1:
            problems.append(missing[0] + (" does not exist" if os.path.isabs(missing[0]) else ""))
        else:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            problems.append(f"{'all' if len(missing) == named else len(missing)} of the {named} paths that "
                            f"'{source}' names are missing ({shown})")
    return problems


def expand_sources(spec: Any, allow_pipe: bool = False, require_all: bool = False) -> List[List[str]]:
    """Expand a shard spec into one list of URLs per source.

    Sources are the '::'-separated parts of a string spec (or the items of a list). Each source may use
    brace expansion (``shard-{000000..000009}.tar``), a glob, a directory (its ``*.tar`` files), a local
    path, or a URL with a scheme (``pipe:``, ``http://``, ...). Files found by a glob or in a directory are
    given as absolute paths, whatever their names. Raises `DataError` naming the source when a source matches
    nothing, and when a shard list file (``.yaml``) names a ``pipe:`` command without `allow_pipe`. A source
    with some of its shards missing gives those that exist and one warning with the count missing, or a
    `DataError` with `require_all` (``data.require_all_shards``).
    """
    sources = split_spec(spec, allow_pipe)
    if not sources:
        raise DataError(f"empty shard spec (got {redact(repr(spec))}, expected e.g. "
                        f"'shards/shard-{{000000..000009}}.tar')")
    out, total = [], 0
    for source in sources:
        urls = _expand_one(source, require_all)
        if not urls:
            raise DataError(f"no shards match '{redact(source)}' (expected existing .tar files, a glob, a "
                            f"directory of shards or a pipe:/http URL)")
        out.append(urls)
        total += len(urls)
        check_entries(total, "the shard spec")
    return out


def expand_urls(spec: Any, allow_pipe: bool = False) -> List[str]:
    """Expand a shard spec into a flat list of URLs (see `expand_sources` for the accepted forms).

    >>> expand_urls("data/shard-{000000..000001}.tar")  # doctest: +SKIP
    ['data/shard-000000.tar', 'data/shard-000001.tar']
    """
    return [url for urls in expand_sources(spec, allow_pipe) for url in urls]


def open_shard(url: str):
    """A readable binary stream of shard `url`: a name without a scheme is a local file, opened with ``open()``
    whatever it looks like; only a URL (``pipe:`` command, http(s), gs, ...) goes through webdataset's
    ``gopen``."""
    if not has_scheme(url):
        return open_regular(url)  # a FIFO or device is a shard that cannot be opened, never a wait

    return gopen(url, "rb")
