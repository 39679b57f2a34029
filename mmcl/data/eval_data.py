"""Reading evaluation data: an ImageFolder or WebDataset shards, each sample exactly once.

`build_eval_dataset` picks `ImageFolderDataset` for a directory of class folders and `ShardEvalDataset` for a
shard spec. A sample that cannot be used travels through the DataLoader as an `EvalSkip` item and a user error
raised in a worker as an `EvalFailure`; `eval_collate` sets both aside so evaluation counts them. The folder
walking helpers here (hidden names ignored, sorted class folders) also serve `mmcl shards` (shard_inputs.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
from PIL import Image
from timm.data import ImageNetInfo

from ..config import DataConfig, say
from ..errors import DataError, MmclError
from .decode import SampleKeys, SkipSample, decode_image, needed_members, parse_negatives, parse_sample, zero_skips
from .limits import MAX_CLASSES, MAX_TEMPLATES, inside_folder, open_regular, read_names_file
from .naflex import stack_patch_dicts
from .reading import read_raw_samples
from .sources import SHARD_SUFFIXES, expand_urls, has_scheme, redact

FOLDER_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def read_classnames(path: str, root: Optional[str] = None) -> List[str]:
    """The class names of a classnames file, one a line (`limits.read_names_file`: at most `MAX_CLASSES`, the file
    within its byte bound, a regular file, and inside the dataset folder `root` when it is one of its files)."""
    return read_names_file(path, "classnames file", MAX_CLASSES, "class names",
                           "mmcl takes (ImageNet-21k has 21,841)", root)


def read_templates_file(path: str, root: Optional[str] = None) -> List[str]:
    """The templates of a templates file, one a line (`limits.read_names_file`, at most `MAX_TEMPLATES`)."""
    return read_names_file(path, "templates", MAX_TEMPLATES, "templates",
                           "a zero-shot classifier takes (open_clip's sets have up to 80)", root)


def _beside(folder: str, name: str, read: Callable[[str, Optional[str]], List[str]]) -> Optional[List[str]]:
    """`read` of the file `name` of a dataset folder, None when there is none; a link there that leads out of the
    folder, a FIFO, a file over its bound: one `DataError` line naming it."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    return read(path, folder)


def _visible(name: str) -> bool:
    """Hidden names (``.ipynb_checkpoints``, ``.DS_Store``, macOS ``._*`` files) are neither classes nor samples."""
    return not name.startswith(".")


def class_folders(root: str) -> List[str]:
    """The visible subfolders of an ImageFolder root, sorted (their order gives the labels). More than `MAX_CLASSES`
    is one `DataError` line, found while listing (at most that many names are kept)."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if _visible(entry.name) and entry.is_dir():
                found.append(entry.name)
                if len(found) > MAX_CLASSES:
                    raise DataError(f"{root} has more than {MAX_CLASSES:,} class folders, more than mmcl takes "
                                    f"(ImageNet-21k has 21,841)")
    return sorted(found)


def walk_files(folder: str) -> Iterator[str]:
    """Paths of the visible files under `folder` in sorted order, hidden folders not entered."""
    for dirpath, dirnames, names in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if _visible(d))
        for name in sorted(names):
            if _visible(name):
                yield os.path.join(dirpath, name)


# A WordNet noun id, the way ImageNet names its class folders (n01440764 is "tench").
_WNID = re.compile(r"n\d{8}")


def imagenet_classnames(folders: List[str], where: str = "") -> Optional[List[str]]:
    """Readable names for class folders named by ImageNet-1k WordNet ids: open_clip's ImageNet class names
    (CLIP's curated list) for the ids, else None (folders not named by WordNet ids).

    ImageNet-1k's class index is the position of the WordNet id in the sorted list of its 1000 ids (timm ships
    that list, and open_clip depends on timm), so a folder holding any subset of the classes maps each folder
    to its own name. Folders named by WordNet ids outside ImageNet-1k keep their ids, with one warning.
    """
    if not folders or not all(_WNID.fullmatch(f) for f in folders):
        return None

    wnids = sorted(ImageNetInfo("imagenet-1k").label_names())
    if len(wnids) != len(IMAGENET_CLASSNAMES):  # the two lists index the same 1000 classes
        raise DataError(f"ImageNet-1k has {len(wnids)} WordNet ids but {len(IMAGENET_CLASSNAMES)} class names "
                        f"(expected 1000 each from timm and open_clip)")
    index = {wnid: i for i, wnid in enumerate(wnids)}
    outside = [f for f in folders if f not in index]
    if outside:
        say(f"{len(outside)} class folders{' of ' + where if where else ''} are WordNet ids outside ImageNet-1k "
            f"(first {outside[0]}): every class is scored by its folder name; give readable names in "
            f"classnames.txt, one per folder in sorted order", warning=True)
        return None
    return [IMAGENET_CLASSNAMES[index[f]] for f in folders]


def folder_classnames(root: str, folders: Optional[List[str]] = None) -> Tuple[List[str], str]:
    """The class names of an ImageFolder and where they come from: ``root/classnames.txt`` (one line per class
    folder, in sorted folder order), ImageNet-1k's names for WordNet-id folders (`imagenet_classnames`), or the
    folder names. Returns (names, source) with source ``"classnames.txt"``, ``"imagenet-1k"`` or ``"folders"``.

    Raises `DataError` when classnames.txt does not hold one name per class folder: its names would pair with
    the wrong folders.
    """
    folders = class_folders(root) if folders is None else folders
    path = os.path.join(root, "classnames.txt")
    names = _beside(root, "classnames.txt", read_classnames)
    if names is not None:
        if len(names) != len(folders):
            raise DataError(f"{path} has {len(names)} class names but {root} has {len(folders)} class folders "
                            f"(expected one name per folder, in sorted folder order)")
        return names_for_folders(names, folders, path), "classnames.txt"
    readable = imagenet_classnames(folders, root)
    if readable is not None:
        return readable, "imagenet-1k"
    return list(folders), "folders"


def names_for_folders(names: List[str], folders: List[str], where: str) -> List[str]:
    """The class names `where` (a classnames.txt, --classnames) gives, one per class folder, for folders whose labels
    are their sorted order: the folder names when every name is a folder's (matched by name, one line says so when
    the order differs), else the names as given, in sorted folder order.

    Raises `DataError` when a name is the name of another position's folder (it would score that folder's images
    against the wrong label).
    """
    if sorted(names) == sorted(folders):
        if names != folders:
            say(f"{where}: its class names are the class folders' names in another order; each folder is scored "
                f"against its own name", warning=True)
        return list(folders)
    misplaced = [i for i, name in enumerate(names) if name in folders and folders[i] != name]
    if misplaced:
        i = misplaced[0]
        raise DataError(f"{where}: line {i + 1} '{names[i]}' is the name of class folder {folders.index(names[i]) + 1} "
                        f"in sorted order, not of folder {i + 1} ('{folders[i]}'); give one name per folder in sorted "
                        f"folder order, or exactly the folder names")
    return names


def _preview(names: List[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def scan_image_folder(root: str) -> Tuple[List[str], List[Tuple[str, int]]]:
    """The class folders of an ImageFolder (sorted: their order gives the labels) and its (image path, label) items.

    Raises `DataError` when a class folder holds no image, as torchvision's ImageFolder does: its class would be
    scored as a candidate that no image can confirm, and dropping it would shift every later label. Images are the
    visible files with an image extension (`FOLDER_IMAGE_EXTS`), in subfolders of a class folder too.
    """
    folders = class_folders(root)
    items: List[Tuple[str, int]] = []
    empty = []
    for label, folder in enumerate(folders):
        found = [path for path in walk_files(os.path.join(root, folder)) if path.lower().endswith(FOLDER_IMAGE_EXTS)]
        if not found:
            empty.append(folder)
        items += [(path, label) for path in found]
    if not items:
        raise DataError(f"no images found in ImageFolder {root} (expected {root}/<class>/<image>.jpg|png|...)")
    if empty:
        raise DataError(f"ImageFolder {root}: {len(empty)} of {len(folders)} class folders hold no images "
                        f"({_preview(empty)}); every class folder needs at least one "
                        f"{'|'.join(e.lstrip('.') for e in FOLDER_IMAGE_EXTS[:4])}|... image, as in torchvision's "
                        f"ImageFolder (add images, or move the folder out)")
    return folders, items


def folder_problem(path: str) -> Optional[str]:
    """Why a directory is neither an ImageFolder nor a folder of shards, or None when it may be one of them: a
    flat folder of images (no class folders, so no labels) or a folder with no images or shards at all."""
    names = [n for n in os.listdir(path) if _visible(n)]
    if any(n.endswith(SHARD_SUFFIXES) for n in names) or class_folders(path):
        return None
    images = [n for n in names if n.lower().endswith(FOLDER_IMAGE_EXTS)]
    if images:
        return (f"{path} holds {len(images)} images but no class folders: an evaluation folder is an ImageFolder, "
                f"{path}/<class>/<image>, one folder per class (or .tar shards with .cls labels)")
    return (f"no images or shards in {path} (expected an ImageFolder {path}/<class>/<image>.jpg|png|... or .tar "
            f"shards)")


def is_image_folder(path: str) -> bool:
    """Whether `path` is a directory of class folders (and holds no shards)."""
    if not os.path.isdir(path):
        return False
    if any(name.endswith(SHARD_SUFFIXES) for name in os.listdir(path)):
        return False
    return bool(class_folders(path))


@dataclass
class EvalSkip:
    """An evaluation sample that cannot be used; it travels through the DataLoader in place of the sample.

    ``reason`` is a skip reason (``decode``, ``unsupported_mode``, ``too_large``, ``missing_file``, ...) and
    ``where`` names the file or shard sample.
    """

    reason: str
    where: str
    detail: str = ""


@dataclass
class EvalFailure:
    """A user error (`MmclError`) raised while reading evaluation data, carried out of a DataLoader worker so the
    main process re-raises the original error (a worker's exception would come back wrapped in its traceback)."""

    error: Exception


def _decode_file(path: str, max_pixels: int, max_bytes: int = DataConfig.max_member_bytes) -> Image.Image:
    try:
        with open_regular(path) as f:  # a FIFO or device is skipped (decode, "a FIFO, not a regular file")
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:  # the same limit as a shard member's (data.max_member_bytes)
                raise SkipSample("too_large", f"{size} bytes > {max_bytes}")
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise SkipSample("missing_file", "the file is gone")
    except OSError as err:
        raise SkipSample("decode", f"{type(err).__name__}: {err}")
    if len(data) > max_bytes:  # a file that grew, or a device that reports no size
        raise SkipSample("too_large", f"more than {max_bytes} bytes")
    return decode_image(data, max_pixels)


def open_rgb(path: str, max_pixels: int = DataConfig.max_image_pixels) -> Image.Image:
    """An image file decoded by `decode_image` (RGB, any pixel mode converted by `to_rgb`).

    Raises `DataError` naming the file and the skip reason when it cannot be used.
    """
    try:
        return _decode_file(path, max_pixels)
    except SkipSample as skip:
        raise DataError(f"cannot read image {path} ({skip})") from None


class ImageFolderDataset(torch.utils.data.Dataset):
    """An ImageFolder (``root/<class>/<image>``) for evaluation: items (image (3,H,W) float, label, "", key).

    Labels are the index of the class folder in sorted order; ``classnames`` are the lines of
    ``root/classnames.txt`` (one per folder, else a `DataError`), ImageNet-1k's readable names for folders named
    by its WordNet ids, or else the folder names (`folder_classnames`; ``classnames_source`` says which).
    ``templates`` are the lines of ``root/templates.txt`` when present, else None.
    Hidden folders and files (names starting with '.') are ignored. A class folder without images is a `DataError`
    (`scan_image_folder`). An image that cannot be decoded gives an `EvalSkip` item instead (`eval_collate`
    separates them), so evaluation counts it and goes on. `preprocess` may be None to open and check the folder only.
    """

    def __init__(self, root: str, preprocess: Optional[Callable], max_pixels: int = DataConfig.max_image_pixels):
        self.root, self.preprocess, self.max_pixels = root, preprocess, max_pixels
        self.folders, self.items = scan_image_folder(root)
        self.classnames, self.classnames_source = folder_classnames(root, self.folders)
        self.templates = _beside(root, "templates.txt", read_templates_file)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        key = os.path.relpath(path, self.root)
        if not inside_folder(self.root, path):  # a link out of the folder is never read (as in `mmcl shards`)
            return EvalSkip("outside_link", key, "a symbolic link that leads out of the folder")
        try:
            img = _decode_file(path, self.max_pixels)
            return self.preprocess(img), label, "", key
        except SkipSample as skip:
            return EvalSkip(skip.reason, key, str(skip))
        except MmclError as err:
            return EvalFailure(err)


class ImageFilesDataset(torch.utils.data.Dataset):
    """Every image file under a folder (``.jpg``, ``.png``, ... at any depth, hidden names left out, sorted), for
    commands that read images without labels (`mmcl caption`): items (image, -1, "", the path relative to the
    folder). A file that cannot be used gives an `EvalSkip` item naming it and the reason, as `ImageFolderDataset`
    does; each is read as a regular file (`open_regular`) of at most `max_bytes`. A folder with no image is a
    `DataError`."""

    def __init__(self, root: str, preprocess: Optional[Callable], max_pixels: int = DataConfig.max_image_pixels,
                 max_bytes: int = DataConfig.max_member_bytes):
        self.root, self.preprocess, self.max_pixels, self.max_bytes = root, preprocess, max_pixels, max_bytes
        self.paths = [p for p in walk_files(root) if p.lower().endswith(FOLDER_IMAGE_EXTS)]
        if not self.paths:
            raise DataError(f"no images in {root} (expected .jpg, .png, ... files, or .tar shards)")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        path = self.paths[i]
        key = os.path.relpath(path, self.root)
        try:
            img = _decode_file(path, self.max_pixels, self.max_bytes)
        except SkipSample as skip:
            return EvalSkip(skip.reason, path, str(skip))
        return self.preprocess(img), -1, "", key


def build_image_set(path: Any, preprocess: Callable, keys: Optional[SampleKeys] = None,
                    max_member_bytes: int = DataConfig.max_member_bytes, allow_pipe: bool = False):
    """The images of a folder (`ImageFilesDataset`: every image file in it, class folders or not) or of shards
    (`ShardEvalDataset`, a folder of shards included), each item keyed by its relative path or sample key."""
    folder = os.path.expanduser(path) if isinstance(path, str) else None
    if folder is not None and os.path.isdir(folder) and not any(
            n.endswith(SHARD_SUFFIXES) for n in os.listdir(folder) if _visible(n)):
        return ImageFilesDataset(folder, preprocess, max_bytes=max_member_bytes)
    return ShardEvalDataset(path, preprocess, keys=keys, max_member_bytes=max_member_bytes, allow_pipe=allow_pipe)


class ShardEvalDataset(torch.utils.data.IterableDataset):
    """WebDataset shards for evaluation: each sample once, in shard order; items (image, label, caption, key).

    ``label`` is the ``.cls`` value (-1 when absent), ``caption`` the ``.txt`` text ("" when absent), or with
    `keys` every caption of the chosen members, one per line.
    Samples without a readable image give an `EvalSkip` item instead (`eval_collate` separates them) and are
    counted in ``skipped`` (of this process); a user error while reading gives an `EvalFailure` item that ends
    the iteration. Under a DataLoader with workers, shards (or, with fewer shards than workers, samples) are
    split across them. ``classnames``/``templates`` come from ``classnames.txt`` and ``templates.txt`` (or
    CLIP_benchmark's ``zeroshot_classification_templates.txt``) next to the shards, when present.
    Only the members a sample needs are read (`needed_members`, plus ``json``), each at most `max_member_bytes`
    (a sample with a larger one is a ``too_large`` skip); a shard list file runs ``pipe:`` commands only with
    `allow_pipe`. With `negatives` > 0 (a run's ``data.negatives``) an item has a fifth element, the sample's
    negative captions (at most that many, the same ones at every pass: `parse_negatives` with draw 0).
    """

    def __init__(self, spec: Any, preprocess: Callable, max_pixels: int = DataConfig.max_image_pixels,
                 keys: Optional[SampleKeys] = None, max_member_bytes: int = DataConfig.max_member_bytes,
                 allow_pipe: bool = False, negatives: int = 0):
        self.urls = expand_urls(spec, allow_pipe)
        self.keys = keys  # data.image_key / data.caption_key; every caption is kept, one per line
        self.preprocess, self.max_pixels = preprocess, max_pixels
        self.negatives = negatives
        # json: an index's source URLs (and a sample's negatives list)
        self.members = needed_members(keys, extra=("json",), negatives=negatives > 0)
        self.max_member_bytes = max_member_bytes
        self.skipped = zero_skips()
        folder = os.path.dirname(self.urls[0]) if not has_scheme(self.urls[0]) else None
        self.classnames = _beside(folder, "classnames.txt", read_classnames) if folder is not None else None
        self.templates = None
        if folder is not None:
            self.templates = (_beside(folder, "templates.txt", read_templates_file)
                              or _beside(folder, "zeroshot_classification_templates.txt", read_templates_file))

    def __iter__(self):
        try:
            yield from self._samples()
        except MmclError as err:
            yield EvalFailure(err)

    def _samples(self):
        info = torch.utils.data.get_worker_info()
        n, k = (1, 0) if info is None else (info.num_workers, info.id)
        if len(self.urls) >= n:
            plan = [(u, None) for u in self.urls[k::n]]
        else:
            plan = [(u, (k, n)) for u in self.urls]
        for item in read_raw_samples(plan, members=self.members, max_member_bytes=self.max_member_bytes):
            where = redact(f"{item.url}:{item.key}" if item.key else item.url)
            if item.error is not None:
                self.skipped[item.error] += 1
                yield EvalSkip(item.error, where)
                continue
            try:
                data, caption, label = parse_sample(item.files, caption_required=False, keys=self.keys,
                                                    all_captions=True)
                negs = parse_negatives(item.files, self.negatives) if self.negatives > 0 else None
                img = decode_image(data, self.max_pixels)
            except SkipSample as skip:
                self.skipped[skip.reason] += 1
                yield EvalSkip(skip.reason, where, str(skip))
                continue
            except MemoryError:
                self.skipped["too_large"] += 1
                yield EvalSkip("too_large", where, "out of memory decoding it")
                continue
            out = (self.preprocess(img), label, caption, self.item_key(item))
            yield out if negs is None else (*out, negs)

    def item_key(self, item) -> str:
        """The key an item carries: the sample's key (`mmcl.evaluation.index` adds the shard URL and the sample's
        url)."""
        return item.key


def eval_collate(items: List[Any]):
    """Collate evaluation items, setting aside the `EvalSkip` / `EvalFailure` ones.

    Returns:
        (images (B,3,H,W) float, a NaFlex patch dict (`mmcl.data.naflex.EvalPatchify`) or None when B == 0,
        labels (B,) int64, captions [B str], keys [B str],
        problems: the `EvalSkip` and `EvalFailure` items in order,
        negatives: [B lists of str], each sample's negative captions, when the dataset reads them; else None).
    """
    good = [it for it in items if not isinstance(it, (EvalSkip, EvalFailure))]
    problems = [it for it in items if isinstance(it, (EvalSkip, EvalFailure))]
    if not good:
        return None, torch.zeros(0, dtype=torch.long), [], [], problems, None
    if isinstance(good[0][0], dict):

        images = stack_patch_dicts([it[0] for it in good])
    else:
        images = torch.stack([it[0] for it in good])
    labels = torch.tensor([int(it[1]) for it in good], dtype=torch.long)
    negatives = [it[4] for it in good] if len(good[0]) > 4 else None
    return images, labels, [it[2] for it in good], [it[3] for it in good], problems, negatives


def build_eval_dataset(path: Any, preprocess: Callable, keys: Optional[SampleKeys] = None,
                       max_member_bytes: int = DataConfig.max_member_bytes, allow_pipe: bool = False,
                       negatives: int = 0):
    """An evaluation dataset from an ImageFolder directory or a shard spec.

    Returns a torch Dataset (ImageFolder) or IterableDataset (shards) yielding
    (image FloatTensor (3,H,W), label int (-1 if none), caption str ("" if none), key str), with
    ``classnames`` (list or None) and ``templates`` (list or None). Finite: each sample exactly once. `keys`
    chooses the image and caption members of shards (all captions of a sample, one per line); `max_member_bytes`
    and `allow_pipe` are ``data.max_member_bytes`` and ``data.allow_pipe``; `negatives` reads each sample's
    negative captions too (see `ShardEvalDataset`).

    Raises `DataError` for a directory that is neither (`folder_problem`) and for an ImageFolder with a class folder
    without images (`scan_image_folder`): the same words from ``mmcl zeroshot`` and from a training run's check
    before step 1.
    """
    folder = os.path.expanduser(path) if isinstance(path, str) else None
    if folder is not None and os.path.isdir(folder):
        problem = folder_problem(folder)
        if problem is not None:
            raise DataError(problem)
        if is_image_folder(folder):
            return ImageFolderDataset(folder, preprocess)
    return ShardEvalDataset(path, preprocess, keys=keys, max_member_bytes=max_member_bytes, allow_pipe=allow_pipe,
                            negatives=negatives)
