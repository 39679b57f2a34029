"""Writing WebDataset shards: `ShardWriter` / `write_shards` for samples in memory, and `shards_from_input` for
`mmcl shards` (a folder of images with caption files such as img2dataset's ``files`` output, an ImageFolder, or a
CSV / TSV / JSONL / parquet table of image paths and captions, open_clip's CSV layout included; `shard_inputs`
reads those inputs, this module their images and the shards).

Shards are written under a temporary name and renamed when complete, with fixed member metadata, so equal
samples give byte-identical shards and a crash never leaves a truncated shard under a final name.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from PIL import Image
from tqdm import tqdm

from ..config import DataConfig, say
from ..data.decode import IMAGE_EXTS, SkipSample, decode_image
from ..data.limits import FileTooLarge, NotRegularFile, read_regular_bytes, read_regular_text
from ..data.shard_inputs import SkippedItem, SourceImage, input_items
from ..data.sizes import SIZES_FILE
from ..data.skips import SkipLog, counts_text
from ..data.skips import record as skip_record
from ..errors import DataError
from ..storage.fsutil import new_file, open_inside, os_error_text, replace_inside
from ..storage.layout import SKIP_LOG
from ..storage.manifest import OutputManifest


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


def add_tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add `data` to a shard as member `name` with fixed metadata (mtime 0, uid 0, mode 644), so that equal
    samples give byte-identical shards whoever writes them and whenever."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    tar.addfile(info, io.BytesIO(data))


def write_sizes(out_dir, counts: Dict[str, int], manifest=None) -> None:
    """Record `counts` ({shard name: samples}) in `out_dir`'s sizes.json, as open_clip reads it (what train.epochs
    needs), keeping the entries of other shards; every command that writes shards writes it here."""
    sizes: Dict[str, int] = {}
    path = os.path.join(out_dir, SIZES_FILE)
    if manifest is not None:
        manifest.will_write([os.path.relpath(p, manifest.folder) for p in (path, path + ".tmp")])
    try:
        kept = json.loads(read_regular_text(path))  # a FIFO put there is never waited on
        if isinstance(kept, dict):
            sizes.update({k: v for k, v in kept.items() if isinstance(v, int)})
    except (OSError, ValueError):
        pass
    sizes.update(counts)
    with new_file(out_dir, SIZES_FILE + ".tmp") as f:
        f.write(json.dumps(dict(sorted(sizes.items())), indent=1).encode())
    replace_inside(out_dir, SIZES_FILE + ".tmp", SIZES_FILE)


class ShardWriter:
    """Write samples into numbered tar shards ``<out_dir>/<prefix>-000000.tar``, ... atomically.

    Each shard is written to a temporary name and renamed when complete, so a crash never leaves a
    truncated shard under a final name. Member metadata is fixed (mtime 0, uid 0), so equal samples give
    byte-identical shards. With a `manifest` (`mmcl.storage.manifest.OutputManifest` of `out_dir`), each shard's names
    are recorded before it is created, and a file of the user's with such a name is an error, never replaced.
    """

    def __init__(self, out_dir: str, shard_size: int = 1000, prefix: str = "shard",
                 image_format: str = "png", quality: int = 95, manifest=None):
        if shard_size <= 0:
            raise DataError(f"shard_size must be > 0 (got {shard_size})")
        if image_format not in ("png", "jpg", "jpeg", "webp"):
            raise DataError(f"image_format must be png, jpg or webp (got {image_format!r})")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_size, self.prefix = out_dir, shard_size, prefix
        self.image_format, self.quality = image_format, quality
        self.manifest = manifest
        self.shards: List[str] = []
        self.counts: List[int] = []  # samples per shard, written to sizes.json
        self.files: List[str] = []  # every file written, relative to out_dir: the shards and sizes.json
        self.n_samples = 0
        self._tar: Optional[tarfile.TarFile] = None
        self._file = None
        self._tmp = ""
        self._in_shard = 0
        self._sizes_written = False

    def _write_sizes(self) -> None:
        write_sizes(self.out_dir, {os.path.basename(p): n for p, n in zip(self.shards, self.counts)}, self.manifest)
        self._sizes_written = True
        self.files.append(SIZES_FILE)

    def _add(self, name: str, data: bytes) -> None:
        add_tar_member(self._tar, name, data)

    def _open_next(self) -> None:
        path = os.path.join(self.out_dir, f"{self.prefix}-{len(self.shards):06d}.tar")
        self._tmp = path + ".tmp"
        if self.manifest is not None:
            self.manifest.will_write([os.path.relpath(p, self.manifest.folder) for p in (path, self._tmp)])
        self._file = new_file(self.out_dir, os.path.basename(self._tmp))  # TarFile leaves it open
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.GNU_FORMAT)
        self.shards.append(path)
        self.files.append(os.path.basename(path))
        self.counts.append(0)
        self._in_shard = 0

    def _close_current(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._file.close()
            replace_inside(self.out_dir, os.path.basename(self._tmp), os.path.basename(self.shards[-1]))
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
        self.counts[-1] += 1
        self.n_samples += 1

    def close(self) -> Dict[str, Any]:
        """Finish the last shard and record every shard's sample count in ``sizes.json`` beside them (open_clip's
        layout, which ``train.epochs`` reads: `mmcl.data.sizes`; entries of other shards already listed there are
        kept); return the summary {out_dir, shards, n_shards, n_samples, files (every file written, relative to
        out_dir)}."""
        self._close_current()
        if self.shards and not self._sizes_written:
            self._write_sizes()
        return {"out_dir": self.out_dir, "shards": list(self.shards), "n_shards": len(self.shards),
                "n_samples": self.n_samples, "files": list(self.files)}

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self._tar is not None:
            self._tar.close()
            self._file.close()
            os.remove(self._tmp)
            self.shards.pop()
            self.files.pop()
            self.counts.pop()
            self._tar = None
        self.close()


def write_shards(samples: Iterable[Dict[str, Any]], out_dir: str, shard_size: int = 1000, prefix: str = "shard",
                 image_format: str = "png", quality: int = 95, manifest=None) -> Dict[str, Any]:
    """Write samples as WebDataset shards ``out_dir/<prefix>-000000.tar``, ...

    Args:
        samples: iterable of dicts with ``key`` (str, no '.'), ``image`` (a PIL.Image, encoded with
            `image_format`, or encoded bytes with ``ext`` such as 'jpg'), ``caption`` (str), optional
            ``label`` (int, written as ``.cls``) and ``json`` (dict).
        shard_size: samples per shard.
        manifest: the `mmcl.storage.manifest.OutputManifest` of `out_dir`, when a command owns it (see `ShardWriter`).
    Returns:
        {"out_dir", "shards": [paths], "n_shards", "n_samples", "files": [every file written, relative to
        out_dir]}.
    """
    with ShardWriter(out_dir, shard_size, prefix, image_format, quality, manifest) as writer:
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
    try:  # bounded by its size before a byte is read; a FIFO or device is never waited on
        data = read_regular_bytes(path, DataConfig.max_member_bytes)
    except FileTooLarge as err:
        raise SkipSample("too_large", err.strerror) from None
    except NotRegularFile as err:
        raise SkipSample("missing_file", err.strerror) from None
    except OSError as err:
        raise SkipSample("decode", os_error_text(err)) from None
    img = decode_image(data, Image.MAX_IMAGE_PIXELS * 2)  # a full decode: catches cut-off files too
    fmt = Image.open(io.BytesIO(data)).format
    if fmt in _PIL_TO_EXT:
        return data, _PIL_TO_EXT[fmt]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), "png"


def _conversion_in(owned: OutputManifest) -> Optional[str]:
    """The shards and samples an earlier conversion left in `owned`'s folder (its sizes.json counts them), as text;
    None when it holds none."""
    shards = sorted(f for f in owned.files if f.endswith(".tar") and (owned.folder / f).is_file())
    if not shards:
        return None
    try:
        sizes = json.loads((owned.folder / SIZES_FILE).read_text())
        samples = str(sum(int(sizes[name]) for name in shards))
    except (OSError, ValueError, KeyError, TypeError):
        samples = "an unknown number of"
    return f"{len(shards)} shards, {samples} samples"


def shards_from_input(input_path: str, out_dir: str, shard_size: int = 1000,
                      caption_template: str = "a photo of a {}.", progress: bool = True, sep: Optional[str] = None,
                      image_col: Optional[str] = None, caption_col: Optional[str] = None,
                      negatives_col: Optional[str] = None) -> Dict[str, Any]:
    """Convert an image-caption folder, an ImageFolder, or a CSV / TSV / JSONL / parquet table into WebDataset
    shards.

    Caption folder (img2dataset's ``files`` output, or any folder of ``KEY.jpg`` + ``KEY.txt`` [+ ``KEY.json``]):
    the caption is ``KEY.txt``, ``KEY.json``'s fields (img2dataset's ``url``, ``caption``, ``status``, sizes)
    become the sample's ``.json``; the shard keys are the file names' keys when they are unique. An image without
    its caption file is skipped and counted (``missing_caption``), with one warning line: it gets no made-up
    caption. Any ``.txt`` or ``.json`` beside an image makes a folder a caption folder, never an ImageFolder.
    ImageFolder (class folders of images only): captions are `caption_template` filled with the class name, the name
    evaluation scores the folder by (the root's ``classnames.txt``, ImageNet-1k's readable names for WordNet-id
    folders such as ``n01440764``, else the folder name with underscores as spaces); ``.cls`` is the sorted folder
    index, and ``classnames.txt`` is written next to the shards.
    Tables: rows carry ``image`` (a path, or a ``file://`` URI) or ``url`` (the same, as
    img2dataset's input names it) or ``filepath`` (open_clip's), ``caption`` or ``title`` (open_clip's), and
    optionally ``label``; `image_col` / `caption_col` name other columns (open_clip's --csv-img-key /
    --csv-caption-key). A .tsv is tab-separated, a .csv too when its header holds a tab (open_clip's layout), else
    comma-separated; `sep` sets the separator (open_clip's --csv-separator). Relative image paths are read as
    open_clip's CsvDataset reads them, relative to the current directory, or relative to the table's folder where
    only that path exists (`shard_inputs.TablePaths`; one line says which rule applied to how many rows). Web URLs
    are a `DataError` naming the img2dataset command that downloads them.
    `negatives_col` names a column of negative captions (NegCLIP, ``data.negatives``: a list, a JSON list, or texts
    one a line), written into each sample's ``.json`` as its ``negatives`` list (a caption folder's ``KEY.json`` may
    hold one).
    Unreadable images and bad rows are skipped, counted per reason and reported; a summary line is printed.

    Returns:
        {"out_dir", "shards", "n_shards", "n_samples", "n_skipped", "skipped": {reason: n},
         "skipped_examples": [first few "item: reason" strings]}.
    """
    items, classnames = input_items(input_path, caption_template, sep, image_col, caption_col, negatives_col)
    records: List[SourceImage] = []
    problems: List[SkippedItem] = []
    for item in items:
        (problems if isinstance(item, SkippedItem) else records).append(item)
    # `out_dir` must be new, empty or an earlier conversion's: its manifest lists the files written there, and
    # the files of an earlier, larger conversion are deleted (a glob would mix them in); nothing else is touched.
    owned = OutputManifest.claim(out_dir, "shards")
    before = _conversion_in(owned)
    summary = write_shards(_shard_samples(records, problems, progress), out_dir, shard_size=shard_size,
                           prefix="shard", manifest=owned)
    _finish_conversion(owned, out_dir, input_path, summary.pop("files"), classnames, problems)
    return _report(summary, input_path, out_dir, problems, before)


def _shard_samples(records: List[SourceImage], problems: List[SkippedItem], progress: bool
                   ) -> Iterator[Dict[str, Any]]:
    """The samples `write_shards` writes for `records`, in order; an image that is missing or would be skipped when
    read is appended to `problems` instead. The keys are the input's own when every sample has one and they are
    unique and valid, numbered otherwise."""
    keys = [r.key for r in records]
    own_keys = all(k and "." not in k for k in keys) and len(set(keys)) == len(keys)
    todo: Iterable[SourceImage] = records
    if progress:

        todo = tqdm(records, desc="shards", unit="img")
    written = 0
    for record in todo:
        if not os.path.isfile(record.path):
            problems.append(SkippedItem(record.where, "missing_file",
                                        record.tried or f"no file {record.named or record.path}"))
            continue
        try:
            data, ext = _load_for_shard(record.path)
        except SkipSample as skip:
            detail = str(skip).partition(": ")[2]
            if record.named:  # a table row: the file it named, then why it was not read
                detail = f"{record.named}: {detail}" if detail else record.named
            problems.append(SkippedItem(record.where, skip.reason, detail))
            continue
        yield {"key": record.key if own_keys else f"{written:09d}", "image": data, "ext": ext,
               "caption": record.caption, "label": record.label,
               "json": record.meta if record.meta is not None else {"source": record.where}}
        written += 1


def _finish_conversion(owned: OutputManifest, out_dir: str, input_path: str, ours: List[str],
                       classnames: Optional[List[str]], problems: List[SkippedItem]) -> None:
    """Beside the shards in `out_dir`: an ImageFolder's ``classnames.txt`` and the skip log; then the files an
    earlier conversion wrote there and this one did not (`ours` lists this one's) are deleted."""
    if classnames is not None:
        owned.will_write(["classnames.txt"])
        ours.append("classnames.txt")
        with new_file(out_dir, "classnames.txt") as f:
            f.write(("\n".join(classnames) + "\n").encode())
    if problems:
        owned.will_write([SKIP_LOG])
        ours.append(SKIP_LOG)
        log = SkipLog(os.path.join(out_dir, SKIP_LOG), fresh=True, open_fn=open_inside)
        for p in problems:
            log.write(skip_record(p.reason, input_path, member=p.where, detail=p.detail))
        log.close()
    owned.keep_only(ours)


def _report(summary: Dict[str, Any], input_path: str, out_dir: str, problems: List[SkippedItem],
            before: Optional[str]) -> Dict[str, Any]:
    """Add the skips to `summary` and print the conversion's lines; raise `DataError` when no sample was written."""
    counts: Dict[str, int] = {}
    for problem in problems:
        counts[problem.reason] = counts.get(problem.reason, 0) + 1
    summary.update(n_skipped=len(problems), skipped=counts,
                   skipped_examples=[f"{p.where}: {p.reason}" for p in problems[:10]])
    if before is not None:
        say(f"replaced the earlier conversion in {out_dir}: {before} -> {summary['n_shards']} shards, "
            f"{summary['n_samples']} samples")
    detail = counts_text(counts)
    first = "; ".join(f"{p.where}: {p.reason}" + (f" ({p.detail})" if p.detail else "") for p in problems[:3])
    say(f"wrote {summary['n_samples']} samples in {summary['n_shards']} shards to {out_dir}; skipped {len(problems)}"
        + (f" ({detail}; each in {os.path.join(out_dir, SKIP_LOG)}; first: {first})" if problems else ""))
    if summary["n_samples"] == 0:
        raise DataError(f"no valid sample in {input_path} (skipped {len(problems)}: {detail or 'no images found'})")
    return summary
