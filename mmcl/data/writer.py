"""Writing WebDataset shards: `ShardWriter` / `write_shards` for samples in memory, and `shards_from_input` for
`mmcl shards` (a folder of images with caption files such as img2dataset's ``files`` output, an ImageFolder, or a
CSV / TSV / JSONL / parquet table of image paths and captions, open_clip's CSV layout included).

Shards are written under a temporary name and renamed when complete, with fixed member metadata, so equal
samples give byte-identical shards and a crash never leaves a truncated shard under a final name.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tarfile
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from PIL import Image

from ..errors import DataError
from ..storage.fsutil import new_file
from ..storage.manifest import OutputManifest
from .decode import IMAGE_EXTS, SkipSample, decode_image
from .eval_sets import FOLDER_IMAGE_EXTS, class_folders, folder_classnames, walk_files
from .limits import load_json
from .sizes import SIZES_FILE
from .skips import SKIP_LOG, SkipLog, counts_text
from .skips import record as skip_record
from .sources import SHARD_SUFFIXES


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
        with open(path) as f:
            kept = json.load(f)
        if isinstance(kept, dict):
            sizes.update({k: v for k, v in kept.items() if isinstance(v, int)})
    except (OSError, ValueError):
        pass
    sizes.update(counts)
    with new_file(out_dir, SIZES_FILE + ".tmp") as f:
        f.write(json.dumps(dict(sorted(sizes.items())), indent=1).encode())
    os.replace(path + ".tmp", path)


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
    with open(path, "rb") as f:
        data = f.read()
    img = decode_image(data, Image.MAX_IMAGE_PIXELS * 2)  # a full decode: catches cut-off files too
    fmt = Image.open(io.BytesIO(data)).format
    if fmt in _PIL_TO_EXT:
        return data, _PIL_TO_EXT[fmt]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), "png"


# img2dataset's bookkeeping beside its `files` output: NNNNN.parquet (the shard's metadata) and NNNNN_stats.json.
_IMG2DATASET_SIDE_FILE = re.compile(r"^\d+(_stats\.json|\.parquet)$")
_TABLE_EXTS = (".csv", ".tsv", ".jsonl", ".json", ".ndjson", ".parquet")
# Column names tried when none is given, in order: mmcl's and img2dataset's, then open_clip's CSV layout
# (open_clip_train's --csv-img-key filepath, --csv-caption-key title).
_IMAGE_COLS = ("image", "url", "filepath")
_CAPTION_COLS = ("caption", "title")


def _img2dataset_command(path: str, url_col: str, caption_col: Optional[str] = "caption") -> str:
    """The img2dataset command line that downloads the URLs of table `path` into WebDataset shards with captions
    (img2dataset reads csv, tsv, parquet and JSON arrays; JSON lines go through parquet first)."""
    lower = path.lower()
    prefix, url_list, fmt = "", path, "tsv" if lower.endswith(".tsv") else "csv"
    if lower.endswith(".parquet"):
        fmt = "parquet"
    elif lower.endswith((".jsonl", ".ndjson", ".json")):
        url_list, fmt = os.path.splitext(path)[0] + ".parquet", "parquet"
        prefix = (f"python -c \"import pandas; pandas.read_json('{path}', lines=True).to_parquet('{url_list}')\" "
                  f"&& ")
    return (f"{prefix}img2dataset --url_list {url_list} --input_format {fmt} --url_col {url_col} "
            f"--caption_col {caption_col or 'YOUR_CAPTION_COLUMN'} --output_format webdataset --output_folder shards "
            f"--image_size 256 --resize_mode keep_ratio --processes_count 8 --thread_count 64 "
            f"(then train with data.train='shards/*.tar')")


def _csv_separator(path: str, sep: Optional[str]) -> str:
    """The field separator of a CSV / TSV file: `sep` if given (``\\t`` or ``tab`` for a tab, as typed for open_clip's
    --csv-separator), else a tab for a .tsv; for a .csv, a tab when its header line holds one (open_clip's layout:
    its --csv-separator defaults to a tab whatever the file's name), else a comma."""
    if sep is not None:
        sep = "\t" if sep in ("\\t", "tab", "TAB") else sep
        if len(sep) != 1:
            raise DataError(f"--sep must be one character, or \\t for a tab (got {sep!r})")
        return sep
    if path.lower().endswith(".tsv"):
        return "\t"
    with open(path, newline="", encoding="utf-8") as f:
        header = f.readline()
    return "\t" if "\t" in header else ","


def _rows_from_table(path: str, sep: Optional[str] = None, image_col: Optional[str] = None,
                     caption_col: Optional[str] = None) -> Iterator[Tuple[int, Any]]:
    """Yield (line or row number, row dict or an error string) from a CSV, TSV, JSONL or parquet file."""
    lower = path.lower()
    if lower.endswith((".csv", ".tsv")):
        delimiter = _csv_separator(path, sep)
        shown = "tab" if delimiter == "\t" else repr(delimiter)
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            _check_columns(path, reader.fieldnames or [], image_col, caption_col, f"{shown}-separated")
            try:
                for row in reader:
                    yield reader.line_num, row
            except csv.Error as err:  # e.g. a field over csv's limit of 128 KiB: the rows after it cannot be told
                raise DataError(f"cannot read {path} at line {reader.line_num + 1}: {err}") from None
        return
    if lower.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path} needs pyarrow (got no pyarrow module; pip install pyarrow, or give a "
                            f".csv or .jsonl)") from None
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises its own error types for a damaged or foreign file
            raise DataError(f"cannot read {path} as parquet ({' '.join(str(err).split())[:200]})") from None
        _check_columns(path, table.column_names, image_col, caption_col)
        for i, row in enumerate(table.to_pylist(), 1):
            yield i, row
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = load_json(line)
            except ValueError as err:
                yield line_no, f"not JSON ({getattr(err, 'msg', err)})"
                continue
            yield line_no, row if isinstance(row, dict) else f"not a JSON object (got {type(row).__name__})"


def _check_columns(path: str, fields: List[str], image_col: Optional[str] = None, caption_col: Optional[str] = None,
                   layout: str = "") -> None:
    """Raise `DataError` unless the header `fields` hold an image column and a caption column (the given ones, or
    one of `_IMAGE_COLS` and one of `_CAPTION_COLS`)."""
    images = [image_col] if image_col else list(_IMAGE_COLS)
    captions = [caption_col] if caption_col else list(_CAPTION_COLS)
    if any(c in fields for c in images) and any(c in fields for c in captions):
        return
    hint = ""
    url_cols = [c for c in fields if c.lower() == "url"]
    if url_cols and not image_col:
        found = next((c for c in fields if c.lower() in ("caption", "text", "captions", "alt")), None)
        hint = (f"; a table of image URLs is what img2dataset downloads into shards mmcl trains on: "
                f"{_img2dataset_command(path, url_cols[0], found)}")
    if image_col or caption_col:
        wanted = f"columns {' and '.join(repr(c) for c in (image_col, caption_col) if c)}"
    else:
        wanted = ("columns 'image' and 'caption' (or 'url' and 'caption', with local paths or file:// URIs; or "
                  "open_clip's 'filepath' and 'title'; other names with --image-col and --caption-col)")
    read_as = f", read as {layout}; set another separator with --sep" if layout else ""
    raise DataError(f"{path} needs {wanted} (got {', '.join(fields) or 'none'}{read_as}){hint}")


def _local_image_path(value: Any, base: str, table: str, url_col: bool) -> str:
    """A table's image reference as a local path: a path (relative to the table's folder) or a ``file://`` URI.
    Raises `DataError` for a web URL, which img2dataset downloads (the message gives its command)."""
    text = str(value).strip()
    if text.lower().startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlparse(text).path)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+://", text):
        col = "url" if url_col else "image"
        raise DataError(f"{table} names images by URL (got {text[:100]}); mmcl shards reads local files: download "
                        f"them into shards with img2dataset: {_img2dataset_command(table, col)}")
    return os.path.join(base, os.path.expanduser(text))


def _paired_files(root: str) -> Optional[Dict[str, Any]]:
    """img2dataset's ``files`` layout under `root`: images beside a same-named ``KEY.txt`` caption (and
    ``KEY.json`` metadata), usually in numbered folders (``00000/000000000.jpg``). None when no image under
    `root` has a caption or metadata file beside it (then the folder is an ImageFolder).

    Returns ``{"samples": [(key, image, txt or None, json or None)], "orphans": [(file, skip reason)]}`` in
    sorted order: a caption or metadata file without its image is ``missing_image``, another file ``not_image``,
    a second image with the same key ``duplicate_key``; img2dataset's ``NNNNN.parquet`` / ``NNNNN_stats.json``
    beside the folders are left out.
    """
    root = os.path.normpath(root)
    groups: Dict[Tuple[str, str], Dict[str, str]] = {}
    for path in walk_files(root):
        folder, name = os.path.split(os.path.normpath(path))
        stem, ext = os.path.splitext(name)
        groups.setdefault((folder, stem), {})[ext.lower()] = path
    image_exts = tuple(FOLDER_IMAGE_EXTS)
    # img2dataset writes KEY.json for every image, KEY.txt only when it has captions: either marks the layout
    if not any((".txt" in g or ".json" in g) and any(e in g for e in image_exts) for g in groups.values()):
        return None
    samples, orphans = [], []
    for (folder, stem), files in sorted(groups.items()):
        images = [files[e] for e in image_exts if e in files]
        if not images:
            for ext, path in sorted(files.items()):
                if not (folder == root and _IMG2DATASET_SIDE_FILE.match(os.path.basename(path))):
                    orphans.append((path, "missing_image" if ext in (".txt", ".json") else "not_image"))
            continue
        samples.append((stem, images[0], files.get(".txt"), files.get(".json")))
        orphans += [(path, "duplicate_key") for path in images[1:]]
        orphans += [(path, "not_image") for ext, path in sorted(files.items())
                    if ext not in image_exts and ext not in (".txt", ".json")]
    return {"samples": samples, "orphans": orphans}


def _read_caption_file(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def _read_meta_file(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            meta = load_json(f.read())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class SourceImage:
    """One image an input names for a shard, before the image is read.

    ``where`` names it in the summary and in skip reports (a path relative to the input, or ``table:line``);
    ``key`` is the shard key the input gives it (a caption folder's file name), None to number it.
    """

    path: str
    caption: str
    where: str
    label: Optional[int] = None
    meta: Optional[Dict[str, Any]] = None
    key: Optional[str] = None


@dataclass(frozen=True)
class SkippedItem:
    """An item of the input that gives no sample, and the skip reason (one of `mmcl.data.skips.REASONS`)."""

    where: str
    reason: str
    detail: str = ""


_Item = Union[SourceImage, SkippedItem]


def _caption_folder_items(root: str, paired: Dict[str, Any]) -> Iterator[_Item]:
    """The samples of a caption folder (`_paired_files`): ``KEY.txt`` is the caption, ``KEY.json`` the metadata, the
    file name's key the shard key. An image without its caption file is skipped (``missing_caption``, with one
    warning line once the folder is read): it gets no made-up caption."""
    no_caption = []
    for stem, image, txt, meta_path in paired["samples"]:
        where = os.path.relpath(image, root)
        if txt is None:
            no_caption.append(where)
            yield SkippedItem(where, "missing_caption")
            continue
        text = _read_caption_file(txt)
        if text is None:
            yield SkippedItem(where, "bad_caption")
            continue
        meta = None
        if meta_path is not None:
            meta = _read_meta_file(meta_path)
            if meta is None:
                yield SkippedItem(os.path.relpath(meta_path, root), "bad_json")
                continue
        yield SourceImage(image, text, where, meta=meta, key=stem)
    for path, reason in paired["orphans"]:
        yield SkippedItem(os.path.relpath(path, root), reason)
    if no_caption:
        warnings.warn(f"{len(no_caption)} images in {root} have no caption file beside them (KEY.txt) and are "
                      f"skipped, e.g. {no_caption[0]}")


def _image_folder_classes(root: str) -> Tuple[List[str], List[str]]:
    """An ImageFolder's class folders and the class names of its captions and ``classnames.txt``: the names
    evaluation scores the folder by (`eval_sets.folder_classnames`: the root's ``classnames.txt``, ImageNet-1k's
    names for WordNet-id folders), else the folder names with underscores as spaces."""
    shards = sorted(n for n in os.listdir(root) if n.endswith(SHARD_SUFFIXES))
    if shards:  # e.g. img2dataset's webdataset output: nothing to convert
        raise DataError(f"{root} already holds WebDataset shards (got {shards[0]}, ...; train on them: "
                        f"data.train='{os.path.join(root, '*.tar')}')")
    folders = class_folders(root)
    if not folders:
        raise DataError(f"{root} has no class folders nor images with caption files (expected "
                        f"{root}/<class>/<image>, or KEY.jpg beside KEY.txt)")
    names, source = folder_classnames(root, folders)
    return folders, [n.replace("_", " ") for n in names] if source == "folders" else names


def _image_folder_items(root: str, folders: List[str], classnames: List[str],
                        caption_template: str) -> Iterator[_Item]:
    """The images of an ImageFolder: the caption is `caption_template` filled with the class name, the label the
    sorted folder index; a file that is not an image is skipped (``not_image``)."""
    for label, (folder, name) in enumerate(zip(folders, classnames)):
        text = caption_template.format(name)
        for path in walk_files(os.path.join(root, folder)):
            where = os.path.relpath(path, root)
            if path.lower().endswith(FOLDER_IMAGE_EXTS):
                yield SourceImage(path, text, where, label=label)
            else:
                yield SkippedItem(where, "not_image")


def _table_items(table: str, sep: Optional[str], image_col: Optional[str],
                 caption_col: Optional[str]) -> Iterator[_Item]:
    """The rows of a CSV / TSV / JSONL / parquet table: the first named image column with a value (a path or a
    ``file://`` URI), the caption column, an optional non-negative integer ``label``."""
    base = os.path.dirname(os.path.abspath(table))
    if sep is not None and not table.lower().endswith((".csv", ".tsv")):
        raise DataError(f"--sep is for a .csv or .tsv input (got {table})")
    image_cols = [image_col] if image_col else list(_IMAGE_COLS)
    caption_cols = [caption_col] if caption_col else list(_CAPTION_COLS)
    for line_no, row in _rows_from_table(table, sep, image_col, caption_col):
        where = f"{os.path.basename(table)}:{line_no}"
        if isinstance(row, str):
            yield SkippedItem(where, "bad_row")
            continue
        # the first named column with a value: a row may give 'image' or 'url', as the default columns allow
        found = next((c for c in image_cols if row.get(c)), None)
        url_col = found == "url"
        image = row.get(found) if found else None
        text = next((row[c] for c in caption_cols if c in row and row[c] is not None), None)
        label = row.get("label")
        if not image:
            yield SkippedItem(where, "missing_image")
            continue
        if not isinstance(text, str) or not text.strip():
            yield SkippedItem(where, "bad_caption")
            continue
        if label in ("", None):
            label = None
        else:
            try:
                label = int(label)
                if label < 0:
                    raise ValueError
            except (TypeError, ValueError):
                yield SkippedItem(where, "bad_label")
                continue
        path = _local_image_path(image, base, table, url_col)
        meta = {"source": where, **({"url": str(image).strip()} if url_col else {})}
        yield SourceImage(path, text.strip(), where, label=label, meta=meta)


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
                      image_col: Optional[str] = None, caption_col: Optional[str] = None) -> Dict[str, Any]:
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
    Tables: rows carry ``image`` (a path relative to the file, or a ``file://`` URI) or ``url`` (the same, as
    img2dataset's input names it) or ``filepath`` (open_clip's), ``caption`` or ``title`` (open_clip's), and
    optionally ``label``; `image_col` / `caption_col` name other columns (open_clip's --csv-img-key /
    --csv-caption-key). A .tsv is tab-separated, a .csv too when its header holds a tab (open_clip's layout), else
    comma-separated; `sep` sets the separator (open_clip's --csv-separator). Relative image paths resolve against
    the table's folder (open_clip resolves them against the current directory: give absolute paths to be read
    alike by both). Web URLs are a `DataError` naming the img2dataset command that downloads them.
    Unreadable images and bad rows are skipped, counted per reason and reported; a summary line is printed.

    Returns:
        {"out_dir", "shards", "n_shards", "n_samples", "n_skipped", "skipped": {reason: n},
         "skipped_examples": [first few "item: reason" strings]}.
    """
    if not os.path.exists(input_path):
        raise DataError(f"input not found: {input_path} (expected a folder of images with captions, an ImageFolder "
                        f"directory, a .csv, .tsv, .jsonl or .parquet)")
    classnames: Optional[List[str]] = None
    paired = _paired_files(input_path) if os.path.isdir(input_path) else None
    if paired is not None:
        items: Iterable[_Item] = _caption_folder_items(input_path, paired)
    elif os.path.isdir(input_path):
        folders, classnames = _image_folder_classes(input_path)
        if "{}" not in caption_template:
            raise DataError(f"caption_template needs a '{{}}' for the class name (got {caption_template!r})")
        items = _image_folder_items(input_path, folders, classnames, caption_template)
    elif input_path.lower().endswith(_TABLE_EXTS):
        items = _table_items(input_path, sep, image_col, caption_col)
    else:
        raise DataError(f"unsupported input {input_path} (expected a folder of images with captions, an ImageFolder "
                        f"directory, a .csv, .tsv, .jsonl or .parquet)")
    records: List[SourceImage] = []
    problems: List[SkippedItem] = []
    for item in items:
        (problems if isinstance(item, SkippedItem) else records).append(item)
    # The input's own keys when every sample has one and they are unique and valid; numbered keys otherwise.
    keys = [r.key for r in records]
    own_keys = all(k and "." not in k for k in keys) and len(set(keys)) == len(keys)

    def samples() -> Iterator[Dict[str, Any]]:
        todo: Iterable[SourceImage] = records
        if progress:
            from tqdm import tqdm

            todo = tqdm(records, desc="shards", unit="img")
        for record in todo:
            if not os.path.isfile(record.path):
                problems.append(SkippedItem(record.where, "missing_file"))
                continue
            try:
                data, ext = _load_for_shard(record.path)
            except SkipSample as skip:
                problems.append(SkippedItem(record.where, skip.reason, str(skip).partition(": ")[2]))
                continue
            yield {"key": record.key if own_keys else f"{len(written):09d}", "image": data, "ext": ext,
                   "caption": record.caption, "label": record.label,
                   "json": record.meta if record.meta is not None else {"source": record.where}}
            written.append(record.where)

    written: List[str] = []
    # `out_dir` must be new, empty or an earlier conversion's: its manifest lists the files written there, and
    # the files of an earlier, larger conversion are deleted (a glob would mix them in); nothing else is touched.
    owned = OutputManifest.claim(out_dir, "shards")
    before = _conversion_in(owned)
    summary = write_shards(samples(), out_dir, shard_size=shard_size, prefix="shard", manifest=owned)
    ours = summary.pop("files")  # what this conversion wrote: all that is kept
    if classnames is not None:
        owned.will_write(["classnames.txt"])
        ours.append("classnames.txt")
        with new_file(out_dir, "classnames.txt") as f:
            f.write(("\n".join(classnames) + "\n").encode())
    if problems:
        owned.will_write([SKIP_LOG])
        ours.append(SKIP_LOG)
        log = SkipLog(os.path.join(out_dir, SKIP_LOG), fresh=True)
        for p in problems:
            log.write(skip_record(p.reason, input_path, member=p.where, detail=p.detail))
        log.close()
    owned.keep_only(ours)
    counts: Dict[str, int] = {}
    for problem in problems:
        counts[problem.reason] = counts.get(problem.reason, 0) + 1
    summary.update(n_skipped=len(problems), skipped=counts,
                   skipped_examples=[f"{p.where}: {p.reason}" for p in problems[:10]])
    if before is not None:
        print(f"replaced the earlier conversion in {out_dir}: {before} -> {summary['n_shards']} shards, "
              f"{summary['n_samples']} samples")
    detail = counts_text(counts)
    first = "; ".join(f"{p.where}: {p.reason}" for p in problems[:3])
    print(f"wrote {summary['n_samples']} samples in {summary['n_shards']} shards to {out_dir}; "
          f"skipped {len(problems)}" + (f" ({detail}; each in {os.path.join(out_dir, SKIP_LOG)}; first: {first})"
                                         if problems else ""))
    if summary["n_samples"] == 0:
        raise DataError(f"no valid sample in {input_path} (skipped {len(problems)}: {detail or 'no images found'})")
    return summary
