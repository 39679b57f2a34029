"""The one embedding pass over data that `mmcl reinforce`, `mmcl index` and `mmcl curate` share.

Two shapes of data are embedded:

- raw shard samples, image and captions together (`embed_samples`): what `mmcl reinforce` stores beside every
  sample and what `mmcl curate` scores. The model sees its own evaluation view of the un-augmented image (its size,
  resize and crop, as uint8, then its ToTensor + Normalize on the batch) and its own tokens, so the embeddings equal
  those a teacher computes online in the training loop;
- an evaluation set's images, ImageFolder or shards (`embed_image_set`): what `mmcl index` indexes and what
  `mmcl curate --decontaminate` compares the training images against.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import data as data_mod
from ..data import ShardEvalDataset, has_scheme, redact
from ..data.decode import SampleKeys, SkipSample, candidate_captions, decode_image, image_bytes, pil_to_uint8
from ..data.limits import load_json
from ..data.transforms import split_transform
from ..errors import ConfigError, DataError, MmclError
from ..models import is_naflex
from ..storage.weights import load
from . import evaluate

MAX_PIXELS = 1 << 26  # the largest decoded image (pixels) the pass accepts: a decompression bomb is skipped


@dataclass
class SampleEmbedding:
    """One sample's L2-normalised float32 embeddings: image (D,), text (K, D), one row per caption of
    `mmcl.data.decode.candidate_captions` (in its order), and those captions."""

    image: np.ndarray
    text: np.ndarray
    captions: List[str]


class ClipEncoder:
    """A frozen CLIP model with its evaluation view split where `embed_samples` needs it: the PIL stage and the
    tokenizer (run per sample) and the ToTensor + Normalize finish (run on the batch, where the model is)."""

    def __init__(self, model: torch.nn.Module, preprocess: Callable, tokenizer: Callable, name: str):
        self.model, self.preprocess, self.tokenizer, self.name = model, preprocess, tokenizer, name
        self.pil_stage, self.finish = split_transform(preprocess)

    @classmethod
    def load(cls, path: str, device: Any = "cpu", what: str = "--model") -> "ClipEncoder":
        """The model at `path` (anything `mmcl.load` reads) on `device`; `ConfigError` naming `what` otherwise."""

        try:
            model, eval_tf, tokenizer = load(path)
        except MmclError as err:
            raise ConfigError(f"{what}: cannot load {path}: {err}") from None
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"{what}: cannot load {path}: {detail}") from None
        if is_naflex(model):
            raise ConfigError(f"{what}: {path} has a NaFlex image tower, which this command does not take (it batches "
                              f"fixed-size images); zero-shot and retrieval evaluate it")
        if split_transform(eval_tf)[1] is None:
            raise ConfigError(f"{what}: the image transform of {path} does not end in ToTensor [+ Normalize]")
        if not hasattr(model, "encode_image") or not hasattr(model, "encode_text"):
            raise ConfigError(f"{what}: {path} is not a CLIP model (no encode_image / encode_text)")
        return cls(model.to(device).eval().requires_grad_(False), eval_tf, tokenizer, str(path))

    def image(self, pil_rgb: Any) -> torch.Tensor:
        return pil_to_uint8(self.pil_stage(pil_rgb))

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        return torch.as_tensor(self.tokenizer(list(captions))).long()

    @torch.no_grad()
    def embed(self, images_uint8: torch.Tensor, tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(image (B, D), text (T, D)) float32, L2-normalised in float32."""
        device = self.model.logit_scale.device
        image = F.normalize(self.model.encode_image(self.finish(images_uint8.to(device))).float(), dim=-1)
        text = F.normalize(self.model.encode_text(tokens.to(device)).float(), dim=-1)
        return image, text


def embed_samples(items: Sequence[Any], image_view: Callable[[Any], torch.Tensor],
                  tokenize: Callable[[List[str]], torch.Tensor],
                  embed: Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
                  batch_size: int, keys: Optional[SampleKeys] = None) -> List[Optional[SampleEmbedding]]:
    """Embed raw shard samples (`mmcl.data.reading.RawSample`: ``.files``), `batch_size` at a time.

    Args:
        image_view: an RGB PIL image -> uint8 (3, H, W) in the model's view; tokenize: captions -> tokens;
        embed: (uint8 images, tokens) -> (image (B, D), text (T, D)) L2-normalised features. (A
            `ClipEncoder`'s methods, or a training teacher's.)
    Returns:
        Per item, its `SampleEmbedding`, or None for one whose image or captions cannot be read. The batches are
        cut from `items` in order, so the result does not depend on what else is embedded in the same process.
    """
    views, captions, owners = [], [], []
    for n, item in enumerate(items):
        try:
            raw = keys.image(item.files) if keys else image_bytes(item.files)
            image = decode_image(raw or b"", MAX_PIXELS)
            caps = candidate_captions(item.files, keys)
        except SkipSample:
            continue
        if not caps:
            continue
        views.append(image_view(image))
        captions.append(caps)
        owners.append(n)
    out: List[Optional[SampleEmbedding]] = [None] * len(items)
    for start in range(0, len(views), batch_size):
        part = slice(start, start + batch_size)
        flat = [c for caps in captions[part] for c in caps]
        image, text = embed(torch.stack(views[part]), tokenize(flat))
        image, text = image.cpu().numpy(), text.cpu().numpy()
        row = 0
        for i, (n, caps) in enumerate(zip(owners[part], captions[part])):
            out[n] = SampleEmbedding(image[i], text[row:row + len(caps)], caps)
            row += len(caps)
    return out


def embed_image_set(model, preprocess, data, batch_size: int, workers: int, device: Any, progress: bool,
                    desc: str, loader_fn: Optional[Callable] = None) -> Dict[str, Any]:
    """Embed every image of an evaluation set (ImageFolder or shards), skipping and counting unreadable ones.

    Args:
        loader_fn: (data, preprocess, batch_size, workers) -> (dataset, DataLoader); by default
            `mmcl.evaluation.evaluate.eval_loader`'s shape (``mmcl index`` passes its own, whose keys say where each
            image came from).
    Returns:
        ``{"dataset", "features" (N, D) float32 tensor, "labels", "captions", "keys", "skips"}`` in data order.
    """

    ds, loader = (loader_fn or sourced_loader)(data, preprocess, batch_size, workers)
    feats, labels, captions, keys, skips = evaluate.encode_images(model, loader, device, progress, desc, data)
    return {"dataset": ds, "features": feats, "labels": labels, "captions": captions, "keys": keys, "skips": skips}


class SourcedShards(ShardEvalDataset):
    """Shards for indexing: each item's key is a JSON object with the key, ``__url__`` and the sample's url."""

    def item_key(self, item) -> str:
        source = {"key": item.key, "__url__": _local_url(item.url)}
        url = _sample_url(item.files)
        if url is not None:
            source["url"] = url
        return json.dumps(source)


def sourced_loader(data, preprocess, batch_size: int, workers: int):
    """(dataset, DataLoader) like `evaluate.eval_loader`'s, whose keys also say where each image came from."""

    if batch_size <= 0:
        raise DataError(f"batch size must be > 0 (got {batch_size})")
    if workers < 0:
        raise DataError(f"workers must be >= 0 (got {workers})")
    if isinstance(data, str) and data_mod.is_image_folder(data):
        ds = data_mod.ImageFolderDataset(data, preprocess)
    else:
        ds = SourcedShards(data, preprocess)
    return ds, torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                           collate_fn=data_mod.eval_collate)


def _local_url(url: str) -> str:
    """A shard URL as the index keeps it: local paths absolute (the index may move), other URLs with their
    credentials hidden (`mmcl.data.redact`: the index is a file others read)."""
    return redact(url) if has_scheme(url) else os.path.abspath(url)


def _sample_url(files: Optional[Dict[str, bytes]]) -> Optional[str]:
    """The ``url`` field of a sample's ``.json`` (img2dataset's source URL), when it has one."""
    raw = (files or {}).get("json")
    if raw is None:
        return None
    try:
        meta = load_json(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    url = meta.get("url") if isinstance(meta, dict) else None
    return url if isinstance(url, str) else None
