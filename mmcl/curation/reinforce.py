"""`mmcl reinforce`: shards with a teacher's embeddings stored beside every sample ("reinforced" data, as in
MobileCLIP), so that distillation (``distill.from_shards``) costs no teacher forward at training time.

For each input shard one output shard of the same name is written: every original member unchanged (same names,
same bytes), plus per sample ``KEY.teacher_image.npy`` (float16 (D,), L2-normalised), ``KEY.teacher_text.npy``
(float16 (K, D), one row per candidate caption in `mmcl.data.decode.candidate_captions` order) and
``KEY.teacher.json`` (``{"scale", "teacher", "dim"}``). The teacher sees what it sees in the loop
(`mmcl.evaluation.teacher`): its evaluation view of the un-augmented image and its own tokens. A sample whose image or
captions cannot be read is copied unchanged, without teacher members (training skips it and counts it as
``no_teacher_features``, as it would have skipped it as damaged), and counted here.

Resumable shard by shard: each shard is written under a temporary name and renamed when complete, and
``reinforce.json`` in the output directory (an `mmcl.storage.manifest.OutputManifest`) records the teacher, the finished
shards and every file written; a rerun skips those and redoes the rest. A non-empty output directory that is not
a reinforce output is refused, and files in it that mmcl did not write are never replaced or deleted.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from ..config import say
from ..data.decode import TEACHER_IMAGE, TEACHER_META, TEACHER_TEXT, SampleKeys
from ..data.reading import read_raw_samples
from ..data.sizes import SIZES_FILE
from ..data.sources import expand_urls, has_scheme, redact
from ..errors import DataError
from ..evaluation.embed import embed_samples
from ..evaluation.evaluate import shown_path
from ..evaluation.teacher import Teacher
from ..shards.writer import add_tar_member, write_sizes
from ..storage.fsutil import new_file, os_error_text, replace_inside, unlink_inside
from ..storage.manifest import OutputManifest

MANIFEST = "reinforce.json"
_TEMP_SUFFIX = ".reinforce-partial"


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _claim(out_dir: Path, teacher_id: str, scale: float) -> OutputManifest:
    """The output directory's manifest: its record (``data``) holds the teacher and the finished shards."""
    def legacy(meta: Dict[str, Any]):  # written before the manifest listed files: the shards it records
        shards = meta.get("shards")
        return [*shards, MANIFEST] if "teacher" in meta and isinstance(shards, dict) else None

    manifest = OutputManifest.claim(out_dir, "reinforce", name=MANIFEST, legacy=legacy)
    if not manifest.data:
        manifest.data = {"teacher": teacher_id, "scale": scale, "shards": {}}
        manifest.save()
    if manifest.data.get("teacher") != teacher_id:
        raise DataError(f"{out_dir} holds shards reinforced by another teacher ({manifest.data.get('teacher')}); "
                        f"use another --out for {teacher_id}")
    return manifest


class _Embedder:
    """Batches samples for the teacher and writes each shard's members in the input's order."""

    def __init__(self, teacher, batch_size: int, keys: Optional[SampleKeys], teacher_id: str):
        self.teacher, self.batch_size, self.keys = teacher, batch_size, keys
        self.meta = {"scale": float(teacher.scale), "teacher": teacher_id}

    def embed(self, items: List[Any]) -> List[Optional[Dict[str, bytes]]]:
        """The teacher members of each raw sample, or None for one the teacher cannot read."""
        def features(images, tokens):
            feats = self.teacher.embed(images, tokens)
            return feats.image, feats.text

        out: List[Optional[Dict[str, bytes]]] = []
        for found in embed_samples(items, self.teacher.view.image, self.teacher.view.tokenize, features,
                                   self.batch_size, self.keys):
            if found is None:
                out.append(None)
                continue
            meta = dict(self.meta, dim=int(found.image.shape[0]))
            out.append({TEACHER_IMAGE: _npy(found.image.astype(np.float16)),
                        TEACHER_TEXT: _npy(found.text.astype(np.float16)), TEACHER_META: json.dumps(meta).encode()})
        return out


def _reinforce_shard(url: str, dest: Path, embedder: _Embedder, window: int) -> Dict[str, int]:
    """Write one output shard; returns its counts. The temporary file is removed on any failure."""
    tmp = dest.with_name(dest.name + _TEMP_SUFFIX)
    counts = {"samples": 0, "without_teacher": 0, "errors": 0}
    f = new_file(dest.parent, tmp.name)  # before the try: a link there is refused, and not removed
    try:
        with f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            pending: List[Any] = []

            def flush():
                for item, members in zip(pending, embedder.embed(pending)):
                    for ext, data in item.files.items():
                        add_tar_member(tar, f"{item.key}.{ext}", data)
                    if members is None:
                        counts["without_teacher"] += 1
                    else:
                        for ext, data in members.items():
                            add_tar_member(tar, f"{item.key}.{ext}", data)
                    counts["samples"] += 1
                pending.clear()

            for item in read_raw_samples([(url, None)]):
                if item.error is not None:
                    counts["errors"] += 1
                    continue
                pending.append(item)
                if len(pending) >= window:
                    flush()
            flush()
        replace_inside(dest.parent, tmp.name, dest.name)
    except BaseException:
        unlink_inside(dest.parent, tmp.name, quiet=True)
        raise
    return counts


def reinforce(teacher_path: str, data: str, out_dir: str, batch_size: int = 64, device: Optional[str] = None,
              keys: Optional[SampleKeys] = None, progress: bool = True) -> Dict[str, Any]:
    """Write reinforced copies of the shards of `data` into `out_dir` (see the module docstring); returns the
    summary (shards written and already done, samples, samples without teacher members, seconds)."""


    if batch_size <= 0:
        raise DataError(f"--batch-size must be > 0 (got {batch_size})")
    urls = expand_urls(data)
    if not urls:
        raise DataError(f"no shards match {data}")
    names = [os.path.basename(shown_path(u)) for u in urls]  # pipe:aws s3 cp s3://b/x.tar - -> x.tar
    if len(set(names)) != len(names):
        raise DataError("several input shards share a file name; reinforce them into separate output directories")
    teacher = Teacher.load(teacher_path, device or ("cuda" if torch.cuda.is_available() else "cpu"))
    teacher_id = teacher_path if has_scheme(teacher_path) else str(Path(teacher_path).resolve())
    out = Path(out_dir)
    owned = _claim(out, teacher_id, float(teacher.scale))
    manifest = owned.data
    # An interrupted earlier run's partial shards: only those it recorded (a file of the user's is never deleted).
    owned.remove([n for n in sorted(owned.files) if n.endswith(_TEMP_SUFFIX)])
    embedder = _Embedder(teacher, batch_size, keys, teacher_id)
    start, done_before, totals = time.perf_counter(), 0, {"samples": 0, "without_teacher": 0, "errors": 0}
    bar = None
    if progress:

        bar = tqdm(total=len(urls), desc="reinforce", unit="shard", dynamic_ncols=True)
    try:
        for url, name in zip(urls, names):
            dest = out / name
            record = manifest["shards"].get(name)
            if record is not None and dest.is_file() and dest.stat().st_size == record.get("bytes"):
                done_before += 1
                if bar is not None:
                    bar.update(1)
                continue
            owned.will_write([name, name + _TEMP_SUFFIX, SIZES_FILE, SIZES_FILE + ".tmp"])  # refuses a user's file
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    counts = _reinforce_shard(url, dest, embedder, window=max(batch_size, 256))
                except OSError as err:
                    raise DataError(f"cannot write {dest}: {os_error_text(err)}") from None
            for w in caught[:1]:
                say(str(w.message), warning=True)
            for k in totals:
                totals[k] += counts[k]
            manifest["shards"][name] = {"source": redact(url), "bytes": dest.stat().st_size, **counts}
            write_sizes(out, {name: counts["samples"]})  # for train.epochs on the output
            owned.files.discard(name + _TEMP_SUFFIX)  # renamed into `name`
            owned.save()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(samples=totals["samples"])
    finally:
        if bar is not None:
            bar.close()
    return {"out_dir": str(out), "teacher": teacher_id, "shards": len(urls), "already_done": done_before,
            "samples": totals["samples"], "without_teacher": totals["without_teacher"],
            "shard_errors": totals["errors"], "seconds": round(time.perf_counter() - start, 1)}
