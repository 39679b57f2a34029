"""Zero-shot classification and image-text retrieval, with results in CLIP_benchmark's JSON shape."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import data as data_mod
from .errors import DataError

TEMPLATE_SETS = ("openai_imagenet_template", "simple_imagenet_template")


def load_templates(templates) -> List:
    """Prompt templates: a name of open_clip's sets, a file with one ``{}`` template per line, or a list."""
    import open_clip

    if isinstance(templates, (list, tuple)):
        out = list(templates)
    elif templates in ("openai_imagenet_template", "openai", "imagenet"):
        out = list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    elif templates in ("simple_imagenet_template", "simple"):
        out = list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    elif isinstance(templates, str) and os.path.isfile(templates):
        out = [ln.strip().replace("{c}", "{}") for ln in Path(templates).read_text().splitlines() if ln.strip()]
        bad = [t for t in out if "{}" not in t]
        if bad:
            raise DataError(f"template file {templates}: every line needs '{{}}' for the class name (got {bad[0]!r})")
    else:
        raise DataError(f"unknown templates '{templates}' (expected a file or one of {', '.join(TEMPLATE_SETS)})")
    if not out:
        raise DataError(f"no templates in {templates}")
    return out


def load_classnames(path: str) -> List[str]:
    if not os.path.isfile(path):
        raise DataError(f"classnames file not found: {path}")
    names = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not names:
        raise DataError(f"classnames file {path} is empty")
    return names


def _dataset_name(path: str) -> str:
    p = Path(str(path).split("::")[0].split("{")[0].rstrip("/"))
    return p.name if p.suffix != ".tar" else p.parent.name


def _default_templates(data_path: str) -> Optional[str]:
    """A ``templates.txt`` next to the data (as the demo data ships) is used when no templates are given."""
    candidate = Path(str(data_path)) / "templates.txt"
    return str(candidate) if candidate.is_file() else None


@torch.no_grad()
def encode_images(model, loader, device, progress: bool, desc: str):
    """(features (N, D) normalised float32, labels (N,), captions, keys) over an eval DataLoader."""
    feats, labels, captions, keys = [], [], [], []
    it = loader
    if progress:
        from tqdm import tqdm

        it = tqdm(loader, desc=desc, unit="batch", dynamic_ncols=True)
    for images, lab, cap, key in it:
        f = model.encode_image(images.to(device), normalize=True).float()
        feats.append(f.cpu())
        labels.append(torch.as_tensor(lab))
        captions += list(cap)
        keys += list(key)
    if not feats:
        raise DataError("the evaluation data holds no readable images")
    return torch.cat(feats), torch.cat(labels), captions, keys


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """acc1, acc5 and mean per-class recall for logits (N, C) and integer labels (N,)."""
    n, c = logits.shape
    topk = logits.topk(min(5, c), dim=1).indices
    correct = topk == labels[:, None]
    pred = topk[:, 0]
    recalls = [(pred[labels == k] == k).float().mean().item() for k in range(c) if (labels == k).any()]
    return {"acc1": correct[:, :1].any(1).float().mean().item(), "acc5": correct.any(1).float().mean().item(),
            "mean_per_class_recall": float(sum(recalls) / len(recalls))}


def zeroshot(model, preprocess, tokenizer, data: str, classnames=None, templates=None, batch_size: int = 128,
             workers: int = 0, device="cpu", progress: bool = True, model_name: str = "") -> Dict[str, Any]:
    """Zero-shot classification of an ImageFolder or labelled shards; CLIP_benchmark-shaped result dict."""
    import open_clip

    ds = data_mod.build_eval_dataset(data, preprocess)
    if classnames is None:
        classnames = getattr(ds, "classnames", None)
    elif isinstance(classnames, str):
        classnames = load_classnames(classnames)
    if not classnames:
        raise DataError(f"no class names for {data}: pass --classnames FILE (one name per line, in label order)")
    if templates is None or templates == "auto":
        templates = _default_templates(data) or "openai_imagenet_template"
    template_list = load_templates(templates)
    model = model.to(device).eval()
    classifier = open_clip.build_zero_shot_classifier(model, tokenizer, classnames, template_list,
                                                      num_classes_per_batch=10, device=device, use_tqdm=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    feats, labels, _, _ = encode_images(model, loader, device, progress, "zeroshot")
    if labels.max().item() >= len(classnames) or labels.min().item() < 0:
        raise DataError(f"labels in {data} range over {labels.min().item()}..{labels.max().item()} "
                        f"but there are {len(classnames)} class names")
    logits = feats @ classifier.float().cpu()
    return {"dataset": _dataset_name(data), "model": model_name, "task": "zeroshot_classification",
            "metrics": classification_metrics(logits, labels), "n_samples": int(labels.numel()),
            "n_classes": len(classnames)}


def retrieval_metrics(similarity: torch.Tensor, text_to_image: torch.Tensor, ks: Sequence[int] = (1, 5, 10)):
    """Recall@K for a similarity matrix (n_texts, n_images) where text j belongs to image ``text_to_image[j]``.

    Text->image ("image_retrieval"): a text's own image within its top K. Image->text ("text_retrieval"): any of
    the image's captions within its top K.
    """
    n_texts, n_images = similarity.shape
    out = {}
    for k in ks:
        kk = min(k, n_images)
        top_images = similarity.topk(kk, dim=1).indices  # (T, K)
        out[f"image_retrieval_recall@{k}"] = (top_images == text_to_image[:, None]).any(1).float().mean().item()
        kt = min(k, n_texts)
        top_texts = similarity.t().topk(kt, dim=1).indices  # (I, K)
        hit = text_to_image[top_texts] == torch.arange(n_images)[:, None]
        out[f"text_retrieval_recall@{k}"] = hit.any(1).float().mean().item()
    return out


@torch.no_grad()
def retrieval(model, preprocess, tokenizer, data: str, batch_size: int = 128, workers: int = 0, device="cpu",
              progress: bool = True, model_name: str = "") -> Dict[str, Any]:
    """Image<->text retrieval over shards; several captions per image are read from ``KEY.txt`` lines."""
    ds = data_mod.build_eval_dataset(data, preprocess)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    model = model.to(device).eval()
    img_feats, _, captions, _ = encode_images(model, loader, device, progress, "retrieval")
    texts, owner = [], []
    for i, cap in enumerate(captions):
        for line in [c.strip() for c in cap.splitlines() if c.strip()]:
            texts.append(line)
            owner.append(i)
    if not texts:
        raise DataError(f"no captions in {data}: retrieval needs KEY.txt for each image")
    txt_feats = []
    for start in range(0, len(texts), batch_size):
        tokens = tokenizer(texts[start:start + batch_size]).to(device)
        txt_feats.append(model.encode_text(tokens, normalize=True).float().cpu())
    sim = torch.cat(txt_feats) @ img_feats.t()
    return {"dataset": _dataset_name(data), "model": model_name, "task": "zeroshot_retrieval",
            "metrics": retrieval_metrics(sim, torch.tensor(owner)), "n_images": int(img_feats.shape[0]),
            "n_texts": len(texts)}
