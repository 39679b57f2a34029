"""``skipped.jsonl``: every sample or shard left out, with its reason, written by `SkipLog` (training runs in the run
folder, `mmcl shards` and `mmcl curate` in their output folders).

One JSON object a line: ``reason``, ``source`` (the shard URL, redacted, or the input file), ``key``, ``member`` (the
member or file at fault, where one is) and ``detail``. The reasons, a fixed vocabulary:

    decode              the image cannot be decoded (not an image, cut off, damaged)
    missing_image       no image member (or, for `mmcl shards`, a caption or metadata file without its image, a
                        table row without an image)
    missing_caption     no caption member or caption file
    bad_caption         the caption is empty, not UTF-8, or its JSON field is not text
    bad_label           the ``.cls`` member (a table's ``label``) is not a non-negative integer
    too_large           a member over ``data.max_member_bytes``, or an image over the pixel limit
    unsupported_mode    a pixel mode with no RGB conversion (or float pixels that are not finite)
    no_teacher_features the teacher members of reinforced shards are missing or unreadable
    truncated_tar       a shard breaks off: the rest of it is lost (``key`` null; one record per shard)
    shard_open          a shard cannot be opened or is not a tar (``key`` null; one record per shard)
    missing_file        `mmcl shards`: a table row names a file that does not exist
    not_image           `mmcl shards`: a file in the input folder that is not an image
    duplicate_key       `mmcl shards`: a second image with the key of another in a caption folder
    bad_json            `mmcl shards`: a ``KEY.json`` that is not a JSON object
    bad_row             `mmcl shards`: a table row that cannot be parsed
    outside_link        `mmcl shards`: a symbolic link in the input folder that leads out of it (never followed)
    left_out            not a skip: the file reached `MAX_BYTES`; ``count`` records were left out, ``reasons``
                        counts them by reason (one such line per writing process)

Several processes append to one file: each record is one ``os.write`` of a whole line on a file opened with
``O_APPEND``, so lines never interleave. The file is bounded: once it holds `MAX_BYTES`, records are counted, not
written, and `SkipLog.close` appends the ``left_out`` line. The counts by reason (metrics, summaries) are exact
whatever the file holds.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .decode import IMAGE_EXTS, SKIP_REASONS
from .sources import redact

MAX_BYTES = 4 << 20  # about 20,000 records
REASONS = SKIP_REASONS + ("missing_file", "not_image", "duplicate_key", "bad_json", "bad_row", "outside_link",
                          "left_out")
_IMAGE_REASONS = ("decode", "too_large", "unsupported_mode")
_SHARD_REASONS = ("truncated_tar", "shard_open")
# The sample reasons in words, for the warning a training run gives the first time each one skips a sample.
_SAMPLE_REASONS = {"decode": "an image cannot be decoded", "missing_image": "a sample has no image member",
                   "missing_caption": "a sample has no caption member (data.caption_key)",
                   "bad_caption": "a caption is empty, not UTF-8 or not text", "bad_label": "a .cls label is not a "
                   "non-negative integer", "too_large": "a member or image is over the size limit",
                   "unsupported_mode": "an image's pixel mode has no RGB conversion",
                   "no_teacher_features": "the teacher members are missing or unreadable"}


def member_of(reason: str, key: str, files: Optional[Dict[str, bytes]]) -> Optional[str]:
    """The member of sample `key` a skip `reason` is about: its image, its caption or its label (None for others)."""
    exts = [e for e in IMAGE_EXTS if e in (files or {})] if reason in _IMAGE_REASONS else \
        ["txt", "json"] if reason == "bad_caption" else ["cls"] if reason == "bad_label" else []
    found = next((e for e in exts if e in (files or {})), None)
    return f"{key}.{found}" if key and found else None


def record(reason: str, source: str, key: Optional[str] = None, member: Optional[str] = None,
           detail: str = "") -> Dict[str, Any]:
    """One skip as the plain dict `SkipLog.write` takes (it travels from data workers to the training process)."""
    if reason not in REASONS:
        raise ValueError(f"unknown skip reason {reason!r}")
    return {"reason": reason, "source": redact(str(source))[:500], "key": key or None, "member": member,
            "detail": redact(str(detail))[:200]}


class SkipLog:
    """A bounded ``skipped.jsonl`` at `path`, appended to (`fresh`: emptied first, for a command that rewrites its
    folder). The file is created on the first record by `open_fn` (folder, name, flags) -> fd: the commands pass
    `mmcl.storage.fsutil.open_inside`, which follows no link and writes through no hard link; without it the file
    is opened with ``O_NOFOLLOW`` alone."""

    def __init__(self, path, fresh: bool = False, max_bytes: int = MAX_BYTES, warn: bool = False,
                 open_fn: Optional[Callable[[Path, str, int], int]] = None):
        self.path, self.fresh, self.max_bytes, self.open_fn = Path(path), fresh, max_bytes, open_fn
        self.fd: Optional[int] = None
        self.left_out: Dict[str, int] = {}
        self.warn, self.warned = warn, set()  # warn: one warning per sample reason (a training run's log)

    def _line(self, rec: Dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(rec) + "\n").encode("utf-8"))

    def write(self, rec: Dict[str, Any]) -> None:
        """Append one `record`, or count it as left out once the file holds `max_bytes`. With `warn`, the first
        sample skipped for each reason is also one warning (the same words on every process: shown once a run);
        shards that cannot be read have their own warning where they are read."""
        reason = rec["reason"]
        if self.warn and reason not in self.warned and reason not in _SHARD_REASONS:
            self.warned.add(reason)
            warnings.warn(f"samples are being skipped: {reason} ({_SAMPLE_REASONS.get(reason, reason)}); each is "
                          f"counted in data/skipped_samples and named in {self.path}")
        if self.fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if self.fresh else 0)
            if self.open_fn is not None:
                self.fd = self.open_fn(self.path.parent, self.path.name, flags)
            else:
                self.fd = os.open(self.path, flags | os.O_NOFOLLOW, 0o644)
        if os.fstat(self.fd).st_size >= self.max_bytes:
            self.left_out[rec["reason"]] = self.left_out.get(rec["reason"], 0) + 1
        else:
            self._line(rec)

    def close(self) -> None:
        """Append the ``left_out`` line, if any record was left out, and close the file."""
        if self.left_out:
            self._line({"reason": "left_out", "count": sum(self.left_out.values()), "reasons": self.left_out})
            self.left_out = {}
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def first_records(path, n: int = 3) -> List[Dict[str, Any]]:
    """The first `n` records of the skip log at `path` (none when it is missing or unreadable)."""
    out: List[Dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(out) >= n:
                    break
                rec = json.loads(line)
                if rec.get("reason") != "left_out":
                    out.append(rec)
    except (OSError, ValueError):
        pass
    return out


def describe(rec: Dict[str, Any]) -> str:
    """One record as text: ``source key-or-member: reason (detail)``."""
    where = " ".join(str(x) for x in (os.path.basename(rec.get("source") or ""), rec.get("member") or rec.get("key"))
                     if x)
    return f"{where}: {rec['reason']}" + (f" ({rec['detail']})" if rec.get("detail") else "")


def counts_text(counts: Dict[str, int]) -> str:
    """``decode=30, truncated_tar=1``: the non-zero counts by reason."""
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()) if v and k != "total")
