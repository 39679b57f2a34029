"""Zero-shot classification, image-text retrieval and linear probes, with results in CLIP_benchmark's JSON shape.

Every task returns ``{"dataset", "model", "task", "metrics": {...}}`` plus a few counts. Metric definitions follow
CLIP_benchmark: features are L2-normalised; ``acc1``/``acc5`` are top-k accuracies (``acc5`` only with at least
5 classes); ``mean_per_class_recall`` is the recall averaged over the classes present in the labels (sklearn's
balanced accuracy); ``image_retrieval_recall@K`` is text->image (the text's own image in its top K) and
``text_retrieval_recall@K`` is image->text (any of the image's captions in its top K).
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import numpy as np
import open_clip
import torch
from tqdm import tqdm

from .. import data as data_mod
from ..config import say
from ..data.eval_data import names_for_folders, read_classnames, read_templates_file
from ..data.limits import MAX_TEMPLATES, MAX_TEXTS_AT_ONCE
from ..errors import DataError, MmclError

# open_clip's prompt-template sets (name -> open_clip's attribute), and the short names that also select them.
TEMPLATE_SETS = {"openai_imagenet_template": "OPENAI_IMAGENET_TEMPLATES",
                 "simple_imagenet_template": "SIMPLE_IMAGENET_TEMPLATES"}
TEMPLATE_ALIASES = {"openai": "openai_imagenet_template", "imagenet": "openai_imagenet_template",
                    "simple": "simple_imagenet_template"}
AUTO_TEMPLATES = "auto"  # the dataset's own templates file, else openai_imagenet_template
# Files looked for next to the data (and one level up, for CLIP_benchmark's DIR/test/*.tar layout).
TEMPLATE_FILES = ("templates.txt", "zeroshot_classification_templates.txt")
CLASSNAME_FILES = ("classnames.txt",)
DEFAULT_CS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)  # inverse L2 strengths swept by the linear probe
_SPLIT_DIRS = ("test", "train", "val", "valid", "validation")


def device_for(name: Optional[str]) -> torch.device:
    """The device a command runs on: `name` (``cuda:1``, ``cpu``), else CUDA where there is one, else the CPU."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_templates(templates) -> List:
    """Prompt templates: a name of open_clip's sets, a file with one template per line, one template, or a list.

    A template holds ``{}`` (or CLIP_benchmark's ``{c}``) where the class name goes; open_clip's sets are callables.
    """

    set_name = TEMPLATE_ALIASES.get(templates, templates) if isinstance(templates, str) else None
    if isinstance(templates, (list, tuple)):
        out = [t.strip().replace("{c}", "{}") if isinstance(t, str) else t for t in templates]
    elif set_name in TEMPLATE_SETS:
        out = list(getattr(open_clip, TEMPLATE_SETS[set_name]))
    elif isinstance(templates, str) and _one_template(templates):
        out = [templates.strip().replace("{c}", "{}")]
    elif isinstance(templates, str) and (os.path.lexists(templates) or os.sep in templates or "." in templates):
        # a file, or meant as one: one line saying why it cannot be read ("is not a regular file (a FIFO)")
        out = [ln.strip().replace("{c}", "{}") for ln in read_templates_file(templates)]
    else:
        raise DataError(f"unknown templates '{templates}' (expected a file, one template holding '{{}}' for the "
                        f"class name, or one of {', '.join(TEMPLATE_SETS)})")
    if not out:
        raise DataError(f"no templates in {templates} (expected at least one line such as 'a photo of a {{}}.')")
    if len(out) > MAX_TEMPLATES:
        where = templates if isinstance(templates, str) else "the list given"
        raise DataError(f"templates {where}: {len(out):,} templates, more than the {MAX_TEMPLATES:,} a zero-shot "
                        f"classifier takes (open_clip's sets have up to 80)")
    bad = [t for t in out if isinstance(t, str) and not _is_template(t)]
    if bad:
        where = templates if isinstance(templates, str) else "the data's templates file"
        raise DataError(f"templates {where}: every template needs '{{}}' for the class name, and no other "
                        f"field in braces (write a brace as '{{{{' or '}}}}') (got {bad[0]!r})")
    return out


def _is_template(text: str) -> bool:
    """Whether `text` formats with one class name: it has ``{}`` and no other field (``{0}``, ``{name}``)."""

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError:  # a lone brace
        return False
    return bool(fields) and all(f == ("", "", None) for f in fields)


def _one_template(text: str) -> bool:
    """Whether `text`, given where templates go, is one template (it has a slot) rather than a name or a file."""
    return ("{}" in text or "{c}" in text) and not os.path.lexists(text)


def is_template_name_or_text(templates: str) -> bool:
    """Whether ``templates`` names no file: `AUTO_TEMPLATES`, a set of `TEMPLATE_SETS` or an alias, or one template
    such as ``a photo of a {}.``."""
    return (templates == AUTO_TEMPLATES or templates in TEMPLATE_SETS or templates in TEMPLATE_ALIASES
            or _one_template(templates))


def load_classnames(path: str) -> List[str]:
    """Class names, one per line, in label order (`mmcl.data.read_classnames`: a regular file, within its bounds)."""
    names = [ln.strip() for ln in read_classnames(path)]
    if not names:
        raise DataError(f"classnames file {path} is empty (expected one class name per line)")
    return names


def _data_dir(data) -> Path:
    """The folder a data spec lives in: the ImageFolder itself, or the folder of its (first) shard."""
    first = str(data).split("::")[0].strip()
    prefix = re.split(r"[{*?\[]", first)[0]
    if prefix != first:  # a glob or brace range: the folder its pattern starts in
        return Path(prefix) if prefix.endswith(("/", os.sep)) else Path(prefix).parent
    path = Path(first)
    return path if path.is_dir() else path.parent


# A shard file named by its number alone (0.tar, shard-000000.tar) names no dataset: its folder does.
_SHARD_NUMBER = re.compile(r"(shard[-_.]?)?\d+", re.IGNORECASE)


def shown_path(source: str) -> str:
    """The path a source names, as names, records and messages may show it: its credentials hidden
    (`data_mod.redact`), of a ``pipe:`` command the word that names a shard, of a URL its host and path (no user,
    password or query). Dataset names and the file names of shards written from a source derive from it."""
    shown = data_mod.redact(source.strip())
    if shown.startswith("pipe:"):
        shown = next((w for w in shown[5:].split() if w.split("?")[0].endswith(data_mod.SHARD_SUFFIXES)), shown)
    if not data_mod.has_scheme(shown):
        return shown
    url = urlsplit(shown)
    return f"{url.hostname or ''}{url.path}"


def dataset_name(data) -> str:
    """The name results go under: a single file's stem (``coco_val.tar`` -> ``coco_val``), else (a folder, a
    glob or brace range, several files, or a file named by its shard number only) the data's folder, or the
    folder above a split folder (``test/``, ``val/``, ... as in CLIP_benchmark's ``DIR/test/0.tar``). Derived from
    the data as shown (`shown_path`), so that it holds no credential."""
    specs = [shown_path(str(s)) for s in (data if isinstance(data, (list, tuple)) else str(data).split("::"))]
    specs = [s for s in specs if s]
    data = "::".join(specs)
    if len(specs) == 1 and not re.search(r"[{*?\[]", specs[0]) and not os.path.isdir(specs[0]):
        name = Path(specs[0].rstrip("/")).name
        for suffix in data_mod.SHARD_SUFFIXES:
            if name.endswith(suffix):
                name = name[:-len(suffix)]
                break
        if name and not _SHARD_NUMBER.fullmatch(name):
            return name
    folder = _data_dir(data).resolve()
    if folder.name in _SPLIT_DIRS and folder.parent.name:
        return folder.parent.name
    return folder.name or str(data)


def _find_beside(data, names: Sequence[str]) -> Optional[str]:
    """The first of `names` in the data's folder or its parent (CLIP_benchmark keeps them above test/)."""
    folder = _data_dir(data)
    for candidate_dir in (folder, folder.parent):
        for name in names:
            candidate = candidate_dir / name
            if candidate.is_file():
                return str(candidate)
    return None


def _progress(iterable, progress: bool, desc: str, total: Optional[int] = None):
    if not progress:
        return iterable

    return tqdm(iterable, desc=desc, unit="batch", total=total, dynamic_ncols=True)


def input_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def eval_loader(data, preprocess, batch_size: int, workers: int, keys=None, reading: Optional[Dict[str, Any]] = None,
                negatives: int = 0):
    """DataLoader over `data_mod.build_eval_dataset`: batches as `data_mod.eval_collate` makes them
    (images, labels, captions, keys, problems, negatives). `reading` holds the training run's
    ``data.max_member_bytes`` and ``data.allow_pipe`` (`reading_options`); the defaults otherwise. `negatives`:
    read up to that many negative captions per sample (a run's ``data.negatives``; 0: none, negatives is None)."""
    if batch_size <= 0:
        raise DataError(f"batch size must be > 0 (got {batch_size})")
    if workers < 0:
        raise DataError(f"workers must be >= 0 (got {workers})")
    # keys: a data.SampleKeys (image/caption members)
    ds = data_mod.build_eval_dataset(data, preprocess, keys=keys, negatives=negatives, **(reading or {}))
    return ds, torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                           collate_fn=data_mod.eval_collate)


def reading_options(cfg) -> Dict[str, Any]:
    """The shard-reading limits of a DataConfig that evaluation sets follow too: the member size limit and whether
    a shard list file may name ``pipe:`` commands."""
    return {"max_member_bytes": cfg.max_member_bytes, "allow_pipe": cfg.allow_pipe}


def _unwrap_worker_error(err: MmclError) -> MmclError:
    """A user error re-raised by a DataLoader worker carries the worker's whole traceback in its message
    ("Caught DataError in DataLoader worker process 0. Original Traceback ..."); keep only the original message."""
    text = str(err)
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return err
    prefix = f"{type(err).__module__}.{type(err).__name__}: "
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(prefix):
            return type(err)(" ".join([lines[i][len(prefix):]] + [ln.strip() for ln in lines[i + 1:]]).strip())
    return type(err)(lines[-1].strip())


def eval_batches(loader):
    """The loader's batches; a user error from a worker comes out as itself. When iteration stops early (an
    error, or `close()`), the DataLoader's workers are stopped at once: left to garbage collection they are
    joined with a 5 s timeout each, which delayed the exit of a failed evaluation by 10 s with 2 workers."""
    iterator = iter(loader)
    done = False
    try:
        while True:
            failure = None
            try:
                batch = next(iterator)
            except StopIteration:
                done = True
                return
            except MmclError as err:
                failure = _unwrap_worker_error(err)
            if failure is not None:
                raise failure.with_traceback(None)  # outside the except block: no chained worker traceback
            yield batch
    finally:
        stop = getattr(iterator, "_shutdown_workers", None)  # torch's own clean-up of a multi-worker iterator
        if not done and stop is not None:
            stop()


@torch.no_grad()
def encode_images(model, loader, device, progress: bool, desc: str, data: Any = None):
    """Encode an eval DataLoader's images (from `eval_loader`), skipping and counting unreadable ones.

    A user error raised while reading (also in a DataLoader worker) is re-raised as it was raised. Skipped
    images are reported in one line on stderr (reason counts and the first one).

    Returns:
        features (N, D) float32 L2-normalised on the CPU, labels (N,) int64 (-1 where a sample has none),
        captions (list of N str), keys (list of N str), in loader order, and the skips:
        ``{"n_skipped": int, "skipped": {reason: count}}``.
    """
    feats, labels, captions, keys = [], [], [], []
    skips: List[Any] = []
    dtype = input_dtype(model)
    try:
        total = len(loader)
    except TypeError:  # an IterableDataset (shards) has no length
        total = None
    batches = eval_batches(loader)
    try:
        for images, lab, cap, key, problems, _ in _progress(batches, progress, desc, total=total):
            for problem in problems:
                if isinstance(problem, data_mod.EvalFailure):
                    raise problem.error
                skips.append(problem)
            if images is None:
                continue
            f = model.encode_image(data_mod.naflex.to_device(images, device, dtype), normalize=True).float()
            feats.append(f.cpu())
            labels.append(torch.as_tensor(lab, dtype=torch.long).reshape(-1))
            captions += list(cap)
            keys += list(key)
    finally:
        batches.close()
    counts: Dict[str, int] = {}
    for skip in skips:
        counts[skip.reason] = counts.get(skip.reason, 0) + 1
    where = f" of {data}" if data is not None else ""
    if not feats:
        detail = f" (skipped {len(skips)}: {_counts_text(counts)}; first {_skip_text(skips[0])})" if skips else ""
        raise DataError(f"the evaluation data{where} holds no readable images{detail}")
    if skips:
        n_read = sum(f.shape[0] for f in feats) + len(skips)
        say(f"{desc}: skipped {len(skips)} of {n_read} images{where} ({_counts_text(counts)}; first "
            f"{_skip_text(skips[0])})", warning=True)
    return torch.cat(feats), torch.cat(labels), captions, keys, {"n_skipped": len(skips), "skipped": counts}


def _counts_text(counts: Dict[str, int]) -> str:
    return ", ".join(f"{reason}={n}" for reason, n in sorted(counts.items()))


def _skip_text(skip) -> str:
    text = f"{skip.where}: {skip.detail or skip.reason}"
    return " ".join(text.split())[:300]


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], batch_size: int, device, progress: bool = False
                 ) -> torch.Tensor:
    """Encode captions in batches: (T, D) float32 L2-normalised on the CPU."""
    out = []
    starts = range(0, len(texts), batch_size)
    for start in _progress(starts, progress, "texts", total=len(starts)):
        tokens = tokenizer(list(texts[start:start + batch_size])).to(device)
        out.append(model.encode_text(tokens, normalize=True).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


def _fraction(hits: torch.Tensor) -> float:
    """Share of True in a bool tensor, as an exact ratio of counts (a float32 mean would round it)."""
    return hits.sum().item() / hits.numel()


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """acc1, acc5 (only for >= 5 classes, as CLIP_benchmark) and mean per-class recall.

    Args:
        logits: (N, C) float scores; labels: (N,) int64 in [0, C).
    """
    n, c = logits.shape
    topk = logits.topk(min(5, c), dim=1).indices  # (N, min(5, C))
    correct = topk == labels[:, None]
    pred = topk[:, 0]
    recalls = [_fraction(pred[labels == k] == k) for k in range(c) if (labels == k).any()]
    out = {"acc1": _fraction(correct[:, 0])}
    if c >= 5:
        out["acc5"] = _fraction(correct.any(1))
    out["mean_per_class_recall"] = float(sum(recalls) / len(recalls))
    return out


def resolve_classnames(data, ds, classnames) -> List[str]:
    if isinstance(classnames, (list, tuple)):
        names = [str(c) for c in classnames]
    elif isinstance(classnames, str):
        names = load_classnames(classnames)
    else:
        names = list(getattr(ds, "classnames", None) or [])
        if not names:
            found = _find_beside(data, CLASSNAME_FILES)
            names = load_classnames(found) if found else []
    if not names:
        raise DataError(f"no class names for {data} (expected classnames.txt next to the data, or "
                        f"--classnames FILE with one name per line in label order)")
    folders = list(getattr(ds, "folders", None) or [])
    if classnames is not None and folders and len(names) != len(folders):
        raise DataError(f"{len(names)} class names given for the {len(folders)} class folders of {data} (expected "
                        f"one name per folder, in sorted folder order)")
    if classnames is not None and folders:  # labels follow the sorted folders
        names = names_for_folders(names, folders, "--classnames" if isinstance(classnames, (list, tuple))
                                  else classnames)
    return names


def _check_labels(labels: torch.Tensor, n_classes: int, data, what: str) -> None:
    if (labels < 0).any():
        raise DataError(f"{int((labels < 0).sum())} of {labels.numel()} samples in {data} have no label "
                        f"(expected a .cls file or an ImageFolder class for every sample of a {what})")
    if labels.max().item() >= n_classes:
        raise DataError(f"labels in {data} go up to {labels.max().item()} but there are {n_classes} class names "
                        f"(expected labels in 0..{n_classes - 1})")


def zeroshot(model, preprocess, tokenizer, data: str, classnames=None, templates=None, batch_size: int = 128,
             workers: int = 0, device="cpu", progress: bool = True, model_name: str = "", keys=None,
             reading: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Zero-shot classification of an ImageFolder or labelled shards.

    Args:
        model: open_clip-style model with ``encode_image``/``encode_text(..., normalize=True)``.
        preprocess: PIL image -> (3, H, W) float tensor.
        tokenizer: list of str -> (B, L) int64 token ids.
        data: ImageFolder directory or shard spec whose samples carry ``.cls`` labels.
        classnames: list, file, or None for the dataset's own names (an ImageFolder's ``classnames.txt``, or
            ImageNet-1k's names for WordNet-id folders, or its folder names; ``classnames.txt`` beside shards).
            Names given for an ImageFolder must be one per class folder.
        templates: list, file, open_clip set name, or None / ``"auto"``: the dataset's own (``templates.txt`` or
            CLIP_benchmark's ``zeroshot_classification_templates.txt`` beside the data or one folder up), else
            ``openai_imagenet_template``.
    Returns:
        ``{"dataset", "model", "task": "zeroshot_classification", "metrics": {acc1, [acc5], mean_per_class_recall},
        "n_samples", "n_classes", "classnames", "templates", "n_skipped", "skipped": {reason: count}}``: the
        class names and templates (as text, ``{}`` for the name) that were scored; unreadable images are skipped
        and counted, see `encode_images`.
    """

    ds, loader = eval_loader(data, preprocess, batch_size, workers, keys, reading)
    names = resolve_classnames(data, ds, classnames)
    if templates is None or templates == AUTO_TEMPLATES:
        templates = (getattr(ds, "templates", None) or _find_beside(data, TEMPLATE_FILES)
                     or "openai_imagenet_template")
    template_list = load_templates(templates)
    model = model.to(device).eval()
    # open_clip's classifier, 10 class names at a time under a bar of our own (its bar has no label); each class's
    # column depends on its own name only, so the columns are those of one call.
    chunks = [names[i:i + 10] for i in range(0, len(names), 10)]
    classifier = torch.cat([zero_shot_classifier(model, tokenizer, chunk, template_list, device)
                            for chunk in _progress(chunks, progress, "class names", total=len(chunks))], dim=1)
    feats, labels, _, _, skips = encode_images(model, loader, device, progress, "zeroshot", data)
    _check_labels(labels, len(names), data, "zero-shot classification")
    logits = feats @ classifier.float().cpu()  # (N, C)
    return {"dataset": dataset_name(data), "model": model_name, "task": "zeroshot_classification",
            "metrics": classification_metrics(logits, labels), "n_samples": int(labels.numel()),
            "n_classes": len(names), "classnames": names, "templates": template_texts(template_list), **skips}


@torch.no_grad()
def zero_shot_classifier(model, tokenizer, names: Sequence[str], templates: Sequence, device) -> torch.Tensor:
    """(D, C) float32: open_clip's ``build_zero_shot_classifier`` (each class the normalised mean of its templates'
    normalised text features), with the texts encoded `MAX_TEXTS_AT_ONCE` at a time, so that memory follows that
    bound, not the number of templates times class names."""
    texts = [(c, t(name) if callable(t) else t.format(name)) for c, name in enumerate(names) for t in templates]
    sums = None
    for start in range(0, len(texts), MAX_TEXTS_AT_ONCE):
        part = texts[start:start + MAX_TEXTS_AT_ONCE]
        feats = model.encode_text(tokenizer([text for _, text in part]).to(device), normalize=True).float()
        sums = torch.zeros(len(names), feats.shape[1], device=feats.device) if sums is None else sums
        sums.index_add_(0, torch.tensor([c for c, _ in part], device=feats.device), feats)
    means = sums / len(templates)
    return (means / means.norm(dim=1, keepdim=True)).T


def template_texts(templates: Sequence) -> List[str]:
    """Templates as text with ``{}`` for the class name (open_clip's sets are callables)."""
    return [t("{}") if callable(t) else str(t) for t in templates]


def retrieval_metrics(similarity: torch.Tensor, text_to_image: torch.Tensor, ks: Sequence[int] = (1, 5, 10)
                      ) -> Dict[str, float]:
    """Recall@K for a similarity matrix (n_texts, n_images) where text j belongs to image ``text_to_image[j]``.

    Text->image ("image_retrieval"): the text's own image within its top K, averaged over texts. Image->text
    ("text_retrieval"): any of the image's captions within its top K, averaged over the images that have at
    least one caption (captionless images still compete as text->image candidates).
    """
    n_texts, n_images = similarity.shape
    has_text = torch.zeros(n_images, dtype=torch.bool)
    has_text[text_to_image] = True
    out = {}
    for k in ks:
        top_images = similarity.topk(min(k, n_images), dim=1).indices  # (T, K)
        out[f"image_retrieval_recall@{k}"] = _fraction((top_images == text_to_image[:, None]).any(1))
    sim_t = similarity.t()[has_text]  # (I', T)
    image_ids = torch.arange(n_images)[has_text]
    for k in ks:
        top_texts = sim_t.topk(min(k, n_texts), dim=1).indices  # (I', K)
        hit = text_to_image[top_texts] == image_ids[:, None]
        out[f"text_retrieval_recall@{k}"] = _fraction(hit.any(1))
    return out


def retrieval_recalls(text_features: torch.Tensor, image_features: torch.Tensor, text_to_image: torch.Tensor,
                      ks: Sequence[int] = (1, 5, 10), chunk: int = 4096) -> Dict[str, float]:
    """`retrieval_metrics` of ``text_features @ image_features.T`` computed in row blocks.

    Each block of texts (or images) is scored against all candidates, so results equal the full-matrix version
    while memory stays at ``chunk x max(T, I)`` floats.

    Args:
        text_features: (T, D) float; image_features: (I, D) float; text_to_image: (T,) int64 owner image per text.
    """
    n_texts, n_images = text_features.shape[0], image_features.shape[0]
    kmax_i, kmax_t = min(max(ks), n_images), min(max(ks), n_texts)
    img_hits = {k: 0 for k in ks}
    for s in range(0, n_texts, chunk):
        top = (text_features[s:s + chunk] @ image_features.t()).topk(kmax_i, dim=1).indices  # (c, Kmax)
        match = top == text_to_image[s:s + chunk, None]
        for k in ks:
            img_hits[k] += match[:, :min(k, n_images)].any(1).sum().item()
    has_text = torch.zeros(n_images, dtype=torch.bool)
    has_text[text_to_image] = True
    image_ids = torch.arange(n_images)[has_text]
    txt_hits = {k: 0 for k in ks}
    for s in range(0, image_ids.numel(), chunk):
        ids = image_ids[s:s + chunk]
        top = (image_features[ids] @ text_features.t()).topk(kmax_t, dim=1).indices  # (c, Kmax)
        match = text_to_image[top] == ids[:, None]
        for k in ks:
            txt_hits[k] += match[:, :min(k, n_texts)].any(1).sum().item()
    out = {f"image_retrieval_recall@{k}": img_hits[k] / n_texts for k in ks}
    out.update({f"text_retrieval_recall@{k}": txt_hits[k] / image_ids.numel() for k in ks})
    return out


def split_captions(captions: Sequence[str]) -> Tuple[List[str], torch.Tensor]:
    """One text per non-empty caption line: (texts, owner image index per text (T,) int64)."""
    texts, owner = [], []
    for i, cap in enumerate(captions):
        for line in cap.splitlines():
            if line.strip():
                texts.append(line.strip())
                owner.append(i)
    return texts, torch.tensor(owner, dtype=torch.long)


@torch.no_grad()
def retrieval(model, preprocess, tokenizer, data: str, batch_size: int = 128, workers: int = 0, device="cpu",
              progress: bool = True, model_name: str = "", ks: Sequence[int] = (1, 5, 10), keys=None,
              reading: Optional[Dict[str, Any]] = None
              ) -> Dict[str, Any]:
    """Image<->text retrieval over shards; each line of ``KEY.txt`` is one caption of the image, or with `keys`
    (a `mmcl.data.SampleKeys`: ``data.image_key``/``data.caption_key``) every caption of those members: all are
    scored, as CLIP_benchmark does (a text finds its image; an image finds any of its captions).

    Returns:
        ``{"dataset", "model", "task": "zeroshot_retrieval", "metrics": {image_retrieval_recall@K,
        text_retrieval_recall@K for K in ks}, "n_images", "n_texts", "n_distinct_texts", "n_skipped",
        "skipped": {reason: count}}``; fewer than 90 % distinct captions (class labels as captions) is warned of.
    """
    _, loader = eval_loader(data, preprocess, batch_size, workers, keys, reading)
    model = model.to(device).eval()
    img_feats, _, captions, _, skips = encode_images(model, loader, device, progress, "retrieval images", data)
    texts, owner = split_captions(captions)
    if not texts:
        raise DataError(f"no captions in {data} (retrieval needs a KEY.txt caption, one per line, for the images)")
    distinct = len(set(texts))
    if distinct < 0.9 * len(texts):  # class labels as captions: the recalls are low whatever the model
        say(f"retrieval of {data}: {len(texts):,} captions, {distinct:,} of them distinct; a caption several images "
            f"share cannot tell them apart, so the recalls stay low whatever the model (for labelled classes, mmcl "
            f"zeroshot scores the model)", warning=True)
    txt_feats = encode_texts(model, tokenizer, texts, batch_size, device, progress)
    return {"dataset": dataset_name(data), "model": model_name, "task": "zeroshot_retrieval",
            "metrics": retrieval_recalls(txt_feats, img_feats, owner, ks), "n_images": int(img_feats.shape[0]),
            "n_texts": len(texts), "n_distinct_texts": distinct, **skips}


def fit_linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                     n_classes: int, Cs: Sequence[float] = DEFAULT_CS, val_fraction: float = 0.2, seed: int = 0,
                     max_iter: int = 1000) -> Dict[str, Any]:
    """Logistic regression on fixed features, C chosen on a held-out part of the training set.

    The training features are split (stratified when every class has two samples) into fit/validation parts;
    each C is fitted on the first and scored by validation accuracy (ties go to the smaller C, the stronger
    regulariser); the chosen C is refitted on the whole training set and scored on the test set.

    Args:
        train_x: (N, D) float; train_y: (N,) int64 in [0, n_classes); test_x: (M, D); test_y: (M,).
    Returns:
        {"metrics": classification metrics on the test set, "C": chosen C, "val_acc1": {C: accuracy}}.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    x, y = train_x.double().numpy(), train_y.numpy()
    if len(np.unique(y)) < 2:
        raise DataError(f"the linear probe needs at least 2 classes in the training data (got {len(np.unique(y))})")
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be in (0, 1) (got {val_fraction})")
    present = len(np.unique(y))
    n_val = max(1, int(round(len(y) * val_fraction)))
    if len(y) - n_val < 2:
        raise DataError(f"the linear probe needs at least 3 training samples (got {len(y)})")
    counts = np.bincount(y)
    # sklearn can stratify only when every class has 2 samples and each part can hold one of every class.
    can_stratify = counts[counts > 0].min() >= 2 and min(n_val, len(y) - n_val) >= present
    stratify = y if can_stratify else None
    fit_x, val_x, fit_y, val_y = train_test_split(x, y, test_size=n_val, random_state=seed, stratify=stratify)
    val_acc: Dict[float, float] = {}
    best_c, best_acc = None, -1.0
    if len(np.unique(fit_y)) < 2:
        raise DataError("the linear probe's fitting split holds a single class (expected more training data)")
    for c in sorted(Cs):
        clf = LogisticRegression(C=c, max_iter=max_iter, random_state=seed).fit(fit_x, fit_y)
        acc = float((clf.predict(val_x) == val_y).mean())
        val_acc[float(c)] = acc
        if acc > best_acc:
            best_c, best_acc = float(c), acc
    clf = LogisticRegression(C=best_c, max_iter=max_iter, random_state=seed).fit(x, y)
    proba = clf.predict_proba(test_x.double().numpy())  # (M, classes seen in training)
    # Classes absent from the training data can never be predicted: they score below every seen class.
    logits = torch.full((proba.shape[0], n_classes), -1.0, dtype=torch.float64)
    logits[:, torch.as_tensor(clf.classes_)] = torch.from_numpy(proba)
    return {"metrics": classification_metrics(logits, test_y), "C": best_c, "val_acc1": val_acc}


def linear_probe(model, preprocess, train: str, test: str, batch_size: int = 128, workers: int = 0, device="cpu",
                 model_name: str = "", Cs: Sequence[float] = DEFAULT_CS, val_fraction: float = 0.2, seed: int = 0,
                 progress: bool = True) -> Dict[str, Any]:
    """Linear probe: frozen L2-normalised image features + scikit-learn logistic regression (see `fit_linear_probe`).

    Args:
        train, test: ImageFolders or labelled shard specs with the same classes.
    Returns:
        ``{"dataset", "model", "task": "linear_probe", "metrics": {acc1, [acc5], mean_per_class_recall}, "C",
        "val_acc1", "n_train", "n_test", "n_classes", "n_skipped_train", "n_skipped_test", "skipped_train",
        "skipped_test"}``.
    """
    train_ds, train_loader = eval_loader(train, preprocess, batch_size, workers)
    test_ds, test_loader = eval_loader(test, preprocess, batch_size, workers)
    model = model.to(device).eval()
    train_x, train_y, _, _, train_skips = encode_images(model, train_loader, device, progress, "linear-probe train",
                                                        train)
    test_x, test_y, _, _, test_skips = encode_images(model, test_loader, device, progress, "linear-probe test",
                                                     test)
    train_names = getattr(train_ds, "classnames", None)
    test_names = getattr(test_ds, "classnames", None)
    if train_names and test_names and list(train_names) != list(test_names):
        raise DataError(f"train and test data name their classes differently (got {list(train_names)[:5]} vs "
                        f"{list(test_names)[:5]}; expected the same classes in the same order)")
    n_classes = max(len(train_names or test_names or []), int(train_y.max()) + 1, int(test_y.max()) + 1)
    _check_labels(train_y, n_classes, train, "linear probe")
    _check_labels(test_y, n_classes, test, "linear probe")
    fit = fit_linear_probe(train_x, train_y, test_x, test_y, n_classes, Cs=Cs, val_fraction=val_fraction,
                           seed=seed)
    return {"dataset": dataset_name(test), "model": model_name, "task": "linear_probe", "metrics": fit["metrics"],
            "C": fit["C"], "val_acc1": {str(k): v for k, v in fit["val_acc1"].items()},
            "n_train": int(train_y.numel()), "n_test": int(test_y.numel()), "n_classes": n_classes,
            "n_skipped_train": train_skips["n_skipped"], "n_skipped_test": test_skips["n_skipped"],
            "skipped_train": train_skips["skipped"], "skipped_test": test_skips["skipped"]}
