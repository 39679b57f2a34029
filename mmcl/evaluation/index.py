"""An image-embedding index for text-to-image and image-to-image search, built with faiss.

An index directory holds::

    index.faiss    faiss inner-product index over L2-normalised image embeddings (inner product = cosine)
    items.jsonl    one line per indexed image, in index order: key, caption, ``__url__`` (the shard it came from,
                   absolute for a local file; for an ImageFolder the image file), ``url`` (the sample's own, from
                   its ``.json``, e.g. img2dataset's source URL) and label, each when the data has it
    index.json     the model that built it, to embed queries: its path relative to the index folder
                   (``model_relative``, tried first, so the index and the model can move together) and absolute
                   (``model``); its weights' SHA-256, size and mtime; the data spec, the index kind and its
                   search parameters

Up to ``exact_max`` images (100,000 by default) the index is exact (``IndexFlatIP``, brute force: about
0.5 ms per query per 100k 512-d vectors on one core). Above that it is an inverted-file index (``IndexIVFFlat``,
``nlist = 4 sqrt(N)`` k-means cells trained on a sample of at most 256 points per cell, ``nprobe = nlist / 8``
cells visited per query): approximate, with recall@10 typically above 0.95 at a fraction of the cost. It still
keeps every vector in memory (4 D bytes each); past ~100M vectors a compressed index (IVF-PQ) would be the next
step, which this module does not build.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..data import open_rgb, redact
from ..data.limits import MAX_EMBED_DIM, open_regular
from ..errors import CheckpointError, DataError, file_problem
from ..storage import checkpoints, weights
from ..storage.fsutil import atomic_dir, os_error_text, output_dir
from .embed import SourcedShards, embed_image_set, sourced_loader

INDEX_FILE = "index.faiss"
ITEMS_FILE = "items.jsonl"
META_FILE = "index.json"
EXACT_MAX = 100_000
_MIN_POINTS_PER_CELL = 39  # faiss warns below 39 training points per k-means centroid
_TRAIN_POINTS_PER_CELL = 256  # faiss's own default cap on k-means training points per centroid


def make_index(features: np.ndarray, exact_max: int = EXACT_MAX, nlist: Optional[int] = None, seed: int = 0):
    """A faiss inner-product index holding `features` (N, D) float32 (rows L2-normalised by the caller).

    Returns:
        (index, params): ``params`` is ``{"kind": "flat"}`` or ``{"kind": "ivf", "nlist", "nprobe"}``.
    """
    import faiss

    features = np.ascontiguousarray(features, dtype=np.float32)
    n, dim = features.shape
    if n <= exact_max:
        index = faiss.IndexFlatIP(dim)
        index.add(features)
        return index, {"kind": "flat"}
    if nlist is None:
        nlist = int(4 * math.sqrt(n))
    nlist = max(1, min(nlist, n // _MIN_POINTS_PER_CELL))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    n_train = min(n, nlist * _TRAIN_POINTS_PER_CELL)
    rng = np.random.default_rng(seed)
    sample = features[np.sort(rng.choice(n, size=n_train, replace=False))] if n_train < n else features
    index.cp.seed = seed
    index.train(sample)
    index.add(features)
    index.nprobe = max(1, nlist // 8)
    return index, {"kind": "ivf", "nlist": nlist, "nprobe": int(index.nprobe)}


def _weights_stamp(model_dir: Path) -> Dict[str, Any]:
    """Size and modification time of the weights of a model directory or a training checkpoint ({} when neither)."""
    for name in (weights.WEIGHTS_FILE, checkpoints.MODEL_WEIGHTS):
        if (model_dir / name).is_file():
            st = (model_dir / name).stat()
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {}


def _recorded_sha256(model_dir: Path) -> Optional[str]:
    """The weights' SHA-256 that the model's config records (written with the weights), or None (no record, or a
    config that cannot be read: loading the model reports that)."""
    try:
        meta = weights.read_json_file(model_dir / weights.CONFIG_FILE)
    except CheckpointError:
        return None
    record = weights.recorded_weights(meta)
    return record.get("sha256") if record else None


def _item(key: str, caption: str, label: int, data, sourced: bool) -> Dict[str, Any]:
    if sourced:  # SourcedShards' key: a JSON object
        source = json.loads(key)
        item = {"key": source["key"], "caption": caption, "__url__": source["__url__"]}
        if "url" in source:
            item["url"] = source["url"]
    else:  # an ImageFolder's image, by its path under the folder
        item = {"key": key, "caption": caption, "__url__": os.path.abspath(os.path.join(str(data), key))}
    if label >= 0:
        item["label"] = label
    return item


def build_index(model_path, data, out_dir, batch_size: int = 128, workers: int = 0, device="cpu",
                exact_max: int = EXACT_MAX, progress: bool = True) -> Path:
    """Embed every image of `data` with the model at `model_path` and write an index directory to `out_dir`.

    Args:
        model_path: anything `mmcl.load` accepts; its resolved absolute path is stored for `search`.
        data: shard spec or ImageFolder (see `data.build_eval_dataset`); keys and captions are kept.
        exact_max: largest image count indexed exactly (IndexFlatIP); larger sets get an IVF index.
    Returns:
        The index directory (written to a temporary directory first, then moved into place).
    """

    model_dir = weights.find_model_dir(model_path).resolve()
    model, preprocess, _ = weights.load(model_dir)
    found = embed_image_set(model.to(device).eval(), preprocess, data, batch_size, workers, device, progress,
                            "index", sourced_loader)
    ds, feats, labels, captions, keys, skips = (found[k] for k in ("dataset", "features", "labels", "captions",
                                                                   "keys", "skips"))
    index, params = make_index(feats.numpy(), exact_max=exact_max)
    out_dir = output_dir(out_dir)
    meta = {"model": str(model_dir), "model_relative": os.path.relpath(model_dir, Path(out_dir).resolve()),
            "weights": {**_weights_stamp(model_dir), "sha256": _recorded_sha256(model_dir)}, "data": redact(str(data)),
            "n": int(feats.shape[0]), "dim": int(feats.shape[1]), "metric": "inner_product",
            "normalized": True, "n_skipped": skips["n_skipped"], "skipped": skips["skipped"], **params}
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise DataError(f"index target {out_dir} is not empty and holds no mmcl index (expected a new or empty "
                        f"directory; choose another --out)")
    try:
        import faiss

        # Only the index's own files are replaced; anything the user added to the directory is kept.
        with atomic_dir(out_dir, [INDEX_FILE, ITEMS_FILE, META_FILE]) as tmp:
            faiss.write_index(index, str(tmp / INDEX_FILE))
            with open(tmp / ITEMS_FILE, "w") as f:
                for key, caption, label in zip(keys, captions, labels.tolist()):
                    f.write(json.dumps(_item(key, caption, label, data, isinstance(ds, SourcedShards))) + "\n")
            meta["files"] = [INDEX_FILE, ITEMS_FILE, META_FILE]
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as err:
        raise DataError(f"cannot write the index to {out_dir}: {os_error_text(err)}") from None
    return out_dir


def load_index(index_dir) -> Tuple[Any, List[Dict[str, Any]], Dict[str, Any]]:
    """(faiss index, items, meta) of an index directory written by `build_index`."""
    import faiss

    index_dir = Path(index_dir)
    missing = [n for n in (INDEX_FILE, ITEMS_FILE, META_FILE) if not (index_dir / n).is_file()]
    if missing:
        raise DataError(f"{index_dir} is not an mmcl index (missing {', '.join(missing)}; build one with "
                        f"`mmcl index --model M --data SHARDS --out DIR`)")
    meta = weights.read_json_file(index_dir / META_FILE, DataError)
    if not isinstance(meta, dict) or "model" not in meta:
        raise DataError(f"{index_dir / META_FILE} is damaged (expected a JSON object naming the model; rebuild "
                        f"the index)")
    _check_index_header(index_dir / INDEX_FILE)
    try:
        index = faiss.read_index(str(index_dir / INDEX_FILE))
    except RuntimeError as err:  # faiss reports a cut-off or foreign file as a RuntimeError
        raise DataError(f"{index_dir / INDEX_FILE} is damaged (faiss cannot read it: "
                        f"{_last_line(str(err))}); rebuild the index") from None
    if meta.get("kind") == "ivf":
        index.nprobe = int(meta["nprobe"])
    items = []
    with open_regular(index_dir / ITEMS_FILE, "r", encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{index_dir / ITEMS_FILE} is damaged (line {line_no}: {err.msg}); rebuild "
                                    f"the index") from None
    if len(items) != index.ntotal:
        raise DataError(f"{index_dir} is inconsistent: {index.ntotal} vectors but {len(items)} items")
    return index, items, meta


# faiss's header of every index: fourcc, vector length d (int32), vectors ntotal (int64), two int64, is_trained, metric
_FAISS_HEADER = struct.Struct("<4siqqqBi")


def _check_index_header(path: Path) -> None:
    """DataError unless `path` is a regular file whose faiss header declares what its size can hold: a vector length
    from 1 to `MAX_EMBED_DIM` and no more vectors than its bytes store (4 bytes a number). Checked before faiss
    reads it, since faiss allocates what the header declares."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_FAISS_HEADER.size)
    except OSError as err:
        raise DataError(f"cannot read {path}: {os_error_text(err)}") from None
    if len(head) < _FAISS_HEADER.size:
        raise DataError(f"{path} is damaged (cut off: {size} bytes); rebuild the index")
    _, dim, ntotal = _FAISS_HEADER.unpack(head)[:3]
    if not 1 <= dim <= MAX_EMBED_DIM or ntotal < 0 or dim * ntotal * 4 > size:
        raise DataError(f"{path} is damaged: its header declares {ntotal:,} vectors of length {dim:,}, more than its "
                        f"{size:,} bytes hold (or a length over {MAX_EMBED_DIM:,}); rebuild the index")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


def find_query_model(meta: Dict[str, Any], index_dir) -> Path:
    """The model directory an index names: relative to the index folder first (both moved together), then the
    absolute path it was built with (the index moved alone). `CheckpointError` naming both when neither holds it."""
    tried = []
    if meta.get("model_relative"):
        tried.append(Path(index_dir).resolve() / meta["model_relative"])
    tried.append(Path(meta["model"]))
    for model_dir in tried:
        if (model_dir / weights.CONFIG_FILE).is_file():
            return model_dir
    shown = " nor ".join(str(p) for p in tried)
    raise CheckpointError(f"the model that built {index_dir} is gone (got {shown}, expected the model directory "
                          f"there; rebuild the index or restore the model)")


def _load_query_model(meta: Dict[str, Any], index_dir):
    model_dir = find_query_model(meta, index_dir)
    recorded = (meta.get("weights") or {}).get("sha256")
    if recorded and _recorded_sha256(model_dir):
        # the SHA-256 the model's config records (checked against the weights when they load) survives a copy
        changed = _recorded_sha256(model_dir) != recorded
    else:
        stamp = {k: v for k, v in (meta.get("weights") or {}).items() if k in ("size", "mtime_ns")}
        changed = bool(stamp) and _weights_stamp(model_dir) != stamp
    if changed:
        warnings.warn(f"the model at {model_dir} changed since {index_dir} was built; query embeddings may not "
                      f"match the indexed ones (rebuild the index)")
    return weights.load(model_dir)


@torch.no_grad()
def embed_query(model, preprocess, tokenizer, query: Optional[str] = None, image: Optional[str] = None
                ) -> np.ndarray:
    """A (1, D) float32 L2-normalised query embedding from a text or an image file."""
    if image is not None:

        problem = file_problem(image)
        if problem is not None:
            raise DataError(f"query image {problem}: {image}")
        one = preprocess(open_rgb(image))  # the same pixel conversion as the indexed images
        pixels = {k: v[None] for k, v in one.items()} if isinstance(one, dict) else one[None]  # NaFlex: patches
        feats = model.encode_image(pixels, normalize=True)
    else:
        feats = model.encode_text(tokenizer([query]), normalize=True)
    return np.ascontiguousarray(feats.float().numpy(), dtype=np.float32)


def search(index_dir, query: Optional[str] = None, image: Optional[str] = None, k: int = 10
           ) -> List[Dict[str, Any]]:
    """Top-k indexed images for a text `query` or an `image` file (exactly one of them).

    Returns:
        Up to k dicts, best first: ``{"rank", "key", "caption", "__url__", "score"}`` (+ ``"url"`` and ``"label"``
        when indexed), where score is the cosine similarity between the query and the image embedding.
    """
    if (query is None) == (image is None):
        raise DataError("search needs exactly one query (got " + ("both a text and --image" if query is not None
                        else "neither a text nor --image") + "; e.g. mmcl search --index DIR \"a red circle\")")
    if query is not None and not query.strip():
        raise DataError("the text query is empty (expected words to search for)")
    if k < 1:
        raise DataError(f"k must be >= 1 (got {k})")
    index, items, meta = load_index(index_dir)
    model, preprocess, tokenizer = _load_query_model(meta, index_dir)
    q = embed_query(model, preprocess, tokenizer, query=query, image=image)
    if q.shape[1] != index.d:
        raise DataError(f"query embedding has {q.shape[1]} dims but {index_dir} holds {index.d}-dim vectors "
                        f"(the model at {find_query_model(meta, index_dir)} is not the one that built it)")
    scores, ids = index.search(q, min(k, index.ntotal))
    hits = []
    for rank, (i, s) in enumerate((int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0):
        hits.append({"rank": rank + 1, **items[i], "score": s})
    return hits
