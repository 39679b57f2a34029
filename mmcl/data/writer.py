"""Writing WebDataset shards: `ShardWriter` / `write_shards` for samples in memory, and `shards_from_input` for
`mmcl shards` (an ImageFolder, a CSV or a JSONL file of image paths and captions).

Shards are written under a temporary name and renamed when complete, with fixed member metadata, so equal
samples give byte-identical shards and a crash never leaves a truncated shard under a final name.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from PIL import Image

from ..errors import DataError
from .decode import IMAGE_EXTS, SkipSample, decode_image
from .eval_sets import FOLDER_IMAGE_EXTS, class_folders, walk_files


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
        classnames = class_folders(input_path)
        if not classnames:
            raise DataError(f"{input_path} has no class folders (expected {input_path}/<class>/<image>)")
        for label, name in enumerate(classnames):
            text = caption_template.format(name.replace("_", " "))
            for path in walk_files(os.path.join(input_path, name)):
                if path.lower().endswith(FOLDER_IMAGE_EXTS):
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
