"""The inputs `mmcl shards` converts (`writer.shards_from_input`), read into the images they name before any image
is read: a folder of images with caption files (img2dataset's ``files`` output), an ImageFolder, or a CSV / TSV /
JSONL / parquet table of image paths and captions (open_clip's CSV layout included).

`input_items` picks the reader for an input; the reader yields one item per entry, in the input's order (a
folder's in sorted order): a `SourceImage` (its path, caption, label, metadata, key) or a `SkippedItem` (where in
the input, and its skip reason).
"""

from __future__ import annotations

import csv
import os
import re
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ..config import say
from ..errors import DataError, file_problem
from .eval_data import FOLDER_IMAGE_EXTS, class_folders, folder_classnames, walk_files
from .limits import (
    MAX_TEXT_FILE_BYTES,
    FileTooLarge,
    NotRegularFile,
    inside_folder,
    load_json,
    open_regular,
    read_regular_bytes,
    require_regular,
)
from .sources import SHARD_SUFFIXES, TABLE_EXTS

# img2dataset's bookkeeping beside its `files` output: NNNNN.parquet (the shard's metadata) and NNNNN_stats.json.
_IMG2DATASET_SIDE_FILE = re.compile(r"^\d+(_stats\.json|\.parquet)$")
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
    with open_regular(path, "r", newline="", encoding="utf-8") as f:
        header = f.readline()
    return "\t" if "\t" in header else ","


PARQUET_BATCH_ROWS = 1024


def _rows_from_table(path: str, sep: Optional[str] = None, image_col: Optional[str] = None,
                     caption_col: Optional[str] = None, negatives_col: Optional[str] = None
                     ) -> Iterator[Tuple[int, Any]]:
    """Yield (line or row number, row dict or an error string) from a CSV, TSV, JSONL or parquet file."""
    try:
        require_regular(path)  # a FIFO or device is one error line, never a wait
    except OSError as err:
        raise DataError(f"cannot read the table {path}: {err.strerror or type(err).__name__}") from None
    lower = path.lower()
    if lower.endswith((".csv", ".tsv")):
        delimiter = _csv_separator(path, sep)
        shown = "tab" if delimiter == "\t" else repr(delimiter)
        with open_regular(path, "r", newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            _check_columns(path, reader.fieldnames or [], image_col, caption_col, f"{shown}-separated", negatives_col)
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
        # Streamed in batches of PARQUET_BATCH_ROWS rows, as CSV is: memory follows the batch, not the row count the
        # file declares (a few KB of dictionary-encoded rows can declare millions of them).
        with open_regular(path) as f:
            try:
                table = pq.ParquetFile(f)
                _check_columns(path, table.schema_arrow.names, image_col, caption_col, negatives_col=negatives_col)
                i = 0
                for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                    for row in batch.to_pylist():
                        i += 1
                        yield i, row
            except DataError:
                raise
            except Exception as err:  # pyarrow raises its own error types for a damaged or foreign file
                raise DataError(f"cannot read {path} as parquet ({' '.join(str(err).split())[:200]})") from None
        return
    with open_regular(path, "r", encoding="utf-8") as f:
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
                   layout: str = "", negatives_col: Optional[str] = None) -> None:
    """Raise `DataError` unless the header `fields` hold an image column and a caption column (the given ones, or
    one of `_IMAGE_COLS` and one of `_CAPTION_COLS`), and `negatives_col` when one is named."""
    images = [image_col] if image_col else list(_IMAGE_COLS)
    captions = [caption_col] if caption_col else list(_CAPTION_COLS)
    if any(c in fields for c in images) and any(c in fields for c in captions):
        if negatives_col and negatives_col not in fields:
            raise DataError(f"{path} has no column {negatives_col!r} for --negatives-col (got {', '.join(fields)})")
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
    # one column read from a header that has several names: the separator is the likely fault; several columns: the
    # separator split the header, and the names are what to pick from
    read_as = ""
    if layout:
        read_as = (f", read as {layout}; set another separator with --sep" if len(fields) <= 1 else
                   f": {len(fields)} columns, read as {layout}; name yours with --image-col and --caption-col")
    raise DataError(f"{path} needs {wanted} (got {', '.join(fields) or 'none'}{read_as}){hint}")


def _local_image_path(value: Any, table: str, url_col: bool) -> str:
    """A table's image reference as a local path, as written (a path or a ``file://`` URI): `TablePaths` resolves a
    relative one. Raises `DataError` for a web URL, which img2dataset downloads (the message gives its command)."""
    text = str(value).strip()
    if text.lower().startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlparse(text).path)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+://", text):
        col = "url" if url_col else "image"
        raise DataError(f"{table} names images by URL (got {text[:100]}); mmcl shards reads local files: download "
                        f"them into shards with img2dataset: {_img2dataset_command(table, col)}")
    return os.path.expanduser(text)


class TablePaths:
    """Where a table's relative image paths are read: as open_clip's ``CsvDataset`` reads them, relative to the current
    directory; where only the path relative to the table's own folder exists, that one. `resolve` picks per row and
    counts; `line` says once which rule applied to how many rows."""

    def __init__(self, table: str):
        self.table = table
        self.folder = os.path.dirname(table)  # as given: the paths tried are shown as the user would type them
        self.counts = {"cwd": 0, "table": 0, "missing": 0}  # relative paths, by where they were found

    def resolve(self, path: str) -> Tuple[str, Optional[str]]:
        """(the path to read, None) or, when no candidate exists, (the path open_clip would read, the skip detail
        naming every path tried)."""
        if os.path.isabs(path):
            return path, None if os.path.isfile(path) else f"no file {path}"
        beside = os.path.join(self.folder, path)
        if os.path.isfile(path):
            self.counts["cwd"] += 1
            return path, None
        if self.folder and os.path.isfile(beside):
            self.counts["table"] += 1
            return beside, None
        self.counts["missing"] += 1
        tried = f"no file {path}" + (f" (nor {beside})" if self.folder else "")
        return path, tried + f" relative to {os.getcwd()}"

    def line(self) -> Optional[str]:
        """The rule the relative paths were read by, with the counts; None when the table names no relative path."""
        c = self.counts
        if not (c["cwd"] or c["table"] or c["missing"]):
            return None
        parts = []
        if c["cwd"]:
            parts.append(f"{c['cwd']} relative to the current directory {os.getcwd()}, as open_clip reads them")
        if c["table"]:
            parts.append(f"{c['table']} relative to the table's folder {os.path.abspath(self.folder)} (the only place "
                         f"they exist; open_clip would not find them: run from that folder or give paths from here)")
        if c["missing"]:
            parts.append(f"{c['missing']} found in neither (missing_file)")
        return f"image paths of {self.table}: " + "; ".join(parts)


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
    outside = []
    for path in walk_files(root):
        if not inside_folder(root, path):  # a link out of the folder (KEY.txt -> ~/.netrc) is never read
            outside.append((path, "outside_link"))
            continue
        folder, name = os.path.split(os.path.normpath(path))
        stem, ext = os.path.splitext(name)
        groups.setdefault((folder, stem), {})[ext.lower()] = path
    image_exts = tuple(FOLDER_IMAGE_EXTS)
    # img2dataset writes KEY.json for every image, KEY.txt only when it has captions: either marks the layout
    if not any((".txt" in g or ".json" in g) and any(e in g for e in image_exts) for g in groups.values()):
        return None
    samples, orphans = [], outside
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


def _read_caption_file(path: str) -> Union[str, SkippedItem, None]:
    """The caption in `path`; None when it is empty or not UTF-8; a `SkippedItem` (``too_large``, ``missing_file``)
    for a file over `MAX_TEXT_FILE_BYTES` (never read) or not a regular file (a FIFO is never waited on)."""
    try:
        text = read_regular_bytes(path, MAX_TEXT_FILE_BYTES).decode("utf-8").strip()
    except FileTooLarge as err:
        return SkippedItem(path, "too_large", err.strerror)
    except NotRegularFile as err:
        return SkippedItem(path, "missing_file", err.strerror)
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def _read_meta_file(path: str) -> Optional[Dict[str, Any]]:
    try:
        meta = load_json(read_regular_bytes(path, MAX_TEXT_FILE_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class SourceImage:
    """One image an input names for a shard, before the image is read.

    ``where`` names it in the summary and in skip reports (a path relative to the input, or ``table:line``);
    ``key`` is the shard key the input gives it (a caption folder's file name), None to number it; ``named`` the
    path a skip record names beside ``where`` (a table row's image, read where `TablePaths` found it), empty where
    ``where`` is the file's own path; ``tried`` where the file was looked for (a table row's paths), the detail of
    its ``missing_file`` record.
    """

    path: str
    caption: str
    where: str
    label: Optional[int] = None
    meta: Optional[Dict[str, Any]] = None
    key: Optional[str] = None
    named: str = ""
    tried: str = ""


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
        if isinstance(text, SkippedItem):
            yield SkippedItem(os.path.relpath(txt, root), text.reason, text.detail)
            continue
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
    evaluation scores the folder by (`eval_data.folder_classnames`: the root's ``classnames.txt``, ImageNet-1k's
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
            if not inside_folder(root, path):  # a link out of the input folder is never read
                yield SkippedItem(where, "outside_link")
            elif path.lower().endswith(FOLDER_IMAGE_EXTS):
                yield SourceImage(path, text, where, label=label)
            else:
                yield SkippedItem(where, "not_image")


def table_negatives(value: Any) -> List[str]:
    """The negative captions of a table's cell: a list of texts (JSONL, parquet), a JSON list in a string, or texts
    one a line; whitespace collapsed, empty ones dropped. ``ValueError`` for anything else."""
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            value = load_json(stripped)
        else:
            value = stripped.splitlines()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"negatives must be texts, a list of them or a JSON list (got {type(value).__name__})")
    return [" ".join(v.split()) for v in value if v.strip()]


def _table_items(table: str, sep: Optional[str], image_col: Optional[str],
                 caption_col: Optional[str], negatives_col: Optional[str] = None) -> Iterator[_Item]:
    """The rows of a CSV / TSV / JSONL / parquet table: the first named image column with a value (a path, read
    where `TablePaths` finds it, or a ``file://`` URI), the caption column, an optional non-negative integer
    ``label``, and with `negatives_col` the row's negative captions (`table_negatives`; the sample's JSON
    ``negatives``). A row whose image is in no place tried carries the paths tried (its ``missing_file`` record's
    detail); once the table is read, one line says where its relative paths were read."""
    if sep is not None and not table.lower().endswith((".csv", ".tsv")):
        raise DataError(f"--sep is for a .csv or .tsv input (got {table})")
    image_cols = [image_col] if image_col else list(_IMAGE_COLS)
    caption_cols = [caption_col] if caption_col else list(_CAPTION_COLS)
    paths = TablePaths(table)
    for line_no, row in _rows_from_table(table, sep, image_col, caption_col, negatives_col):
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
        negatives = []
        if negatives_col:
            try:
                negatives = table_negatives(row.get(negatives_col))
            except ValueError as err:
                yield SkippedItem(where, "bad_caption", f"{negatives_col}: {err}")
                continue
        path, tried = paths.resolve(_local_image_path(image, table, url_col))
        meta = {"source": where, **({"url": str(image).strip()} if url_col else {}),
                **({"negatives": negatives} if negatives else {})}
        yield SourceImage(path, text.strip(), where, label=label, meta=meta, named=path, tried=tried or "")
    line = paths.line()
    if line:
        say(line)


def input_items(input_path: str, caption_template: str, sep: Optional[str], image_col: Optional[str],
                caption_col: Optional[str], negatives_col: Optional[str] = None
                ) -> Tuple[Iterable[_Item], Optional[List[str]]]:
    """The items of `input_path` (see `writer.shards_from_input` for the layouts), and the class names of an
    ImageFolder (None for the other inputs): raises `DataError` for a missing or unsupported input."""
    problem = file_problem(input_path, folder_ok=True)
    if problem is not None:
        raise DataError(f"input {problem}: {input_path} (expected a folder of images with captions, an ImageFolder "
                        f"directory, a .csv, .tsv, .jsonl or .parquet)")
    if negatives_col and (os.path.isdir(input_path) or not input_path.lower().endswith(TABLE_EXTS)):
        raise DataError(f"--negatives-col names a column of a table (got {input_path}; a caption folder's KEY.json "
                        "may hold a negatives list)")
    paired = _paired_files(input_path) if os.path.isdir(input_path) else None
    if paired is not None:
        return _caption_folder_items(input_path, paired), None
    if os.path.isdir(input_path):
        folders, classnames = _image_folder_classes(input_path)
        if "{}" not in caption_template:
            raise DataError(f"caption_template needs a '{{}}' for the class name (got {caption_template!r})")
        return _image_folder_items(input_path, folders, classnames, caption_template), classnames
    if input_path.lower().endswith(TABLE_EXTS):
        return _table_items(input_path, sep, image_col, caption_col, negatives_col), None
    raise DataError(f"unsupported input {input_path} (expected a folder of images with captions, an ImageFolder "
                    f"directory, a .csv, .tsv, .jsonl or .parquet)")
