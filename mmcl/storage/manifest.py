"""The folders a command writes file by file (`mmcl demo-data`, `mmcl shards`, `mmcl reinforce`), and the manifest
that tells the command's files from the user's.

A command takes a folder with `OutputManifest.claim`: a missing or empty folder is made its own; a folder whose
manifest names the same command is its own from an earlier run (a re-run, a resumed run); any other non-empty
folder is refused in one line, and nothing in it is touched. The manifest (JSON, written atomically) lists every
file the command wrote, each recorded *before* it is created (`will_write`), so that a run killed halfway still
owns what it left. A command deletes or replaces only files its manifest lists: a file of the user's that carries
a name it is about to write is an error, never overwritten. (`mmcl export`, `mmcl index` and saved models keep the
same rule with their own lists: `mmcl.storage.fsutil.atomic_dir`.) Every entry is a path inside the folder
(`mmcl.storage.fsutil.inside`): a manifest listing an absolute path, a ``..`` or a symbolic link is refused in one
line when the folder is claimed, before anything is touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

from ..errors import ConfigError
from .fsutil import HeldFolder, atomic_write_text, files_under, hold, inside, make_folder, unlink_inside
from .layout import MANIFEST


def _preview(names: List[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


class OutputManifest:
    """The manifest of a folder written by `command`: which files in it are the command's.

    Args:
        folder: the output folder.
        command: the command's name, as recorded (``demo-data``, ``shards``, ``reinforce``).
        name: the manifest's file name in `folder`.
    """

    def __init__(self, folder: Path, command: str, name: str = MANIFEST,
                 files: Iterable[str] = (), data: Optional[Dict[str, Any]] = None):
        self.folder, self.command, self.name = Path(folder), command, name
        self.files: Set[str] = set(files)
        self.data: Dict[str, Any] = dict(data or {})  # the command's own records (e.g. reinforce's shards)
        self.held: Optional[HeldFolder] = None  # the folder, held while this manifest lives (`claim`)

    @classmethod
    def claim(cls, folder, command: str, name: str = MANIFEST,
              legacy: Optional[Callable[[Dict[str, Any]], Optional[Iterable[str]]]] = None) -> "OutputManifest":
        """Take `folder` for `command` (created when missing); ConfigError, one line, when it is not empty and
        not the command's own. The manifest is written at once, so the folder is the command's from now on; the
        folder is held (`mmcl.storage.fsutil.hold`) while the manifest lives: a folder swapped for a link later is
        one error line at the next write, never written through.

        `legacy`: for a folder written before manifests listed files, (its parsed JSON file `name`, without a
        ``command`` key) -> the files the command wrote there, or None when it is not the command's record."""
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {folder} is a file, not a folder; choose a new or empty folder")
        found = cls._read(folder, command, name, legacy) if folder.is_dir() else None
        if found is None:
            present = sorted(files_under(folder)) if folder.is_dir() else []
            if present:
                raise ConfigError(f"--out {folder} is not empty and was not written by mmcl {command} (it holds "
                                  f"{_preview(present)}); nothing was changed: choose a new or empty folder")
            found = cls(folder, command, name)
        try:
            make_folder(folder)
            found.held = hold(folder)  # every later write of the command goes relative to it (`fsutil.hold`)
            found.save()
        except OSError as err:
            raise ConfigError(f"cannot write to {folder}: {err.strerror or err}") from None
        return found

    @classmethod
    def _read(cls, folder: Path, command: str, name: str, legacy) -> Optional["OutputManifest"]:
        path = folder / name
        if not path.is_file():
            return None
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        other = meta.get("command")
        if other == command and isinstance(meta.get("files"), list):
            return cls._checked(folder, command, name, [f for f in meta["files"] if isinstance(f, str)],
                                meta.get("data") if isinstance(meta.get("data"), dict) else {})
        if other is None and legacy is not None:
            files = legacy(meta)
            if files is not None:  # the whole legacy record becomes the command's data
                return cls._checked(folder, command, name, files, meta)
        if isinstance(other, str) and other != command:
            raise ConfigError(f"--out {folder} holds the output of mmcl {other}, not of mmcl {command}; nothing "
                              f"was changed: choose a new or empty folder")
        return None

    @classmethod
    def _checked(cls, folder: Path, command: str, name: str, files: Iterable[str], data) -> "OutputManifest":
        files = list(files)
        for rel in files:
            inside(folder, rel)
        return cls(folder, command, name, files, data)

    def save(self) -> None:
        meta = {"command": self.command, "files": sorted(self.files), "data": self.data}
        atomic_write_text(self.folder / self.name, json.dumps(meta, indent=1, sort_keys=True) + "\n")

    def will_write(self, rels: Iterable[str]) -> None:
        """Record `rels` (paths relative to the folder) before they are created. ConfigError naming them when
        files of those names exist that the manifest does not list (the user's): nothing is written then."""
        rels = [str(r).replace(os.sep, "/") for r in rels]
        theirs = sorted(r for r in rels if os.path.lexists(inside(self.folder, r)) and r not in self.files)
        if theirs:
            raise ConfigError(f"{self.folder} holds files mmcl {self.command} did not write with the names of files "
                              f"it is about to write: {_preview(theirs)}; nothing of theirs was changed (move them "
                              f"away or choose another --out)")
        new = set(rels) - self.files
        if new:
            self.files |= new
            self.save()

    def remove(self, rels: Iterable[str]) -> None:
        """Delete the listed files among `rels` (those the manifest does not list are left alone) and forget them."""
        gone = [r for r in rels if r in self.files]
        for rel in gone:
            unlink_inside(self.folder, rel)
        if gone:
            self.files -= set(gone)
            self.save()

    def keep_only(self, rels: Iterable[str]) -> None:
        """Delete every listed file not in `rels` (the rest of an earlier, larger run): never an unlisted one."""
        keep = set(rels)
        self.remove(sorted(f for f in self.files if f not in keep))
