"""Writing outputs so that a kill at any moment leaves either the old or the new version, never half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional


def new_temp_dir(out_dir: Path) -> Path:
    """An empty directory beside `out_dir` (same filesystem, so the final rename is atomic)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def swap_in(tmp: Path, out_dir: Path) -> Optional[Path]:
    """Rename `tmp` to `out_dir`. A directory already there is moved aside and returned (None if none was)."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    return old


def replace_dir(tmp: Path, out_dir: Path) -> None:
    """Swap `tmp` in as `out_dir` and delete what was there before."""
    old = swap_in(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file through a temp file, fsync, and rename. On failure (full disk, read-only directory) the
    temp file is removed, `path` is left as it was and the OSError is raised."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
