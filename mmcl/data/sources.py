"""Shard specs: which tar shards a spec names, and how one is opened.

A spec is a string or a list: '::'-separated sources, each a brace range (``shard-{000000..000009}.tar``), a
glob, a directory of shards, a local path, or a URL with a scheme (``pipe:``, ``http://``, ...). A YAML list, or a
``.yaml`` file holding one, is accepted too. `expand_sources` gives one URL list per source, `missing_shards`
describes what a spec names that is not there (for preflight checks), and `open_shard` opens any URL as a byte
stream through webdataset's ``gopen``.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Any, Dict, List, Optional

import braceexpand
import yaml

from ..errors import DataError

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


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
        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise DataError(f"cannot parse shard spec as a YAML list: {text!r} ({str(err).splitlines()[0]})")
        return _split_spec(items)
    if text.lower().endswith((".yaml", ".yml")) and os.path.isfile(text):
        with open(text) as f:
            items = yaml.safe_load(f)
        if not isinstance(items, list):
            raise DataError(f"{text} must hold a YAML list of shard specs (got {type(items).__name__})")
        return _split_spec(items)
    return [part.strip() for part in text.split("::") if part.strip()]


def has_scheme(url: str) -> bool:
    """Whether `url` starts with a URL scheme (``pipe:``, ``http:``, ...); a Windows drive letter is no scheme."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url)) and not re.match(r"^[a-zA-Z]:[\\/]", url)


def _expand_one(source: str) -> List[str]:
    if source.startswith("pipe:"):
        # Braces in a pipe command address shard names; expand them but never glob a shell command.
        return list(braceexpand.braceexpand(source))
    urls: List[str] = []
    missing: List[str] = []
    for item in braceexpand.braceexpand(source):
        if item.startswith("file://"):
            item = item[len("file://"):]
        if has_scheme(item):
            urls.append(item)
        elif any(ch in item for ch in "*?["):
            urls += sorted(glob.glob(os.path.expanduser(item)))
        elif os.path.isdir(os.path.expanduser(item)):
            folder = os.path.expanduser(item)
            urls += sorted(p for p in glob.glob(os.path.join(folder, "*")) if p.endswith(SHARD_SUFFIXES))
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
        if has_scheme(source) and not source.startswith("file://"):
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
                if not any(p.endswith(SHARD_SUFFIXES) for p in os.listdir(item)):
                    missing.append(f"no {'/'.join(SHARD_SUFFIXES)} shards in the directory {os.path.abspath(item)}")
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


def open_shard(url: str):
    """A readable binary stream of shard `url` (local path, ``pipe:`` command, http(s), ...)."""
    from webdataset import gopen

    return gopen(url, "rb")
