"""`mmcl curate`: score, filter and deduplicate image-text shards with a CLIP model (DataComp-style), streaming,
resumable shard by shard, in one or several processes.

Three passes over the input shards, which are only ever read:

1. embed: per input shard, every sample's image embedding, its caption's embedding, their cosine (the CLIP score)
   and its caption's length, stored in ``embeddings/NAME.npz``. Samples of shards written by ``mmcl reinforce``
   with the same model are read from their stored embeddings instead of being computed (`mmcl.evaluation.embed`
   is the pass both commands share). With ``--decontaminate`` the evaluation set's images are embedded first
   (``decontaminate.npz``, the pass `mmcl index` uses);
2. decide: the rules (`mmcl.curation.rules`) over the whole set at once, so that ``--clip-score-top`` is an exact
   fraction and deduplication sees every pair (each process holds every image embedding in memory for it, 4 D
   bytes a sample: 2 GB per million 512-d samples); the report (``report.json``, ``report.png``) and the list of
   dropped samples with their reasons (``dropped.jsonl``) are written;
3. write: per input shard, an output shard of the same name holding the kept samples, every member of each
   unchanged (same names, same bytes, in the input's order).

Each file is written under a temporary name and renamed when complete, so a killed run resumes where it stopped:
finished embedding files and output shards are kept, the rest is redone. ``curate.json`` (an
`mmcl.storage.manifest.OutputManifest`) records the model, the inputs and the rules; an output directory made
with other rules, another model or other inputs is refused in one line, and files in it that mmcl did not write
are never replaced or deleted.

Under ``accelerate launch`` (or any launcher setting ``WORLD_SIZE``/``RANK``) process r embeds and writes the
shards i with i mod P = r; every sample's embedding is computed in batches cut from its own shard alone and the
decision is taken over all of them in shard order, so the output is the same byte for byte whatever P is.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config import world
from ..data.decode import (
    TEACHER_IMAGE,
    TEACHER_META,
    SampleKeys,
    SkipSample,
    candidate_captions,
    decode_image,
    image_bytes,
    stored_teacher_features,
)
from ..data.limits import load_json
from ..data.reading import read_raw_samples
from ..data.sizes import SIZES_FILE
from ..data.skips import SkipLog
from ..data.skips import record as skip_record
from ..data.sources import expand_urls, has_scheme, redact
from ..errors import ConfigError, DataError, MmclError
from ..evaluation.embed import MAX_PIXELS, ClipEncoder, embed_image_set, embed_samples
from ..evaluation.evaluate import shown_path
from ..shards.writer import add_tar_member, write_sizes
from ..storage.fsutil import make_folder, new_file, open_inside, os_error_text, replace_inside, unlink_inside
from ..storage.layout import SKIP_LOG
from ..storage.manifest import OutputManifest
from .report import DROPPED_FILE, PLOT_FILE, REPORT_FILE, write_report
from .rules import KEPT, REASONS, Decision, Rules, caption_languages, decide

MANIFEST = "curate.json"
EMBED_DIR = "embeddings"
DECONTAMINATE_FILE = "decontaminate.npz"
_TEMP = ".curate-partial"
_WINDOW = 256  # samples read ahead of the model per shard


# ------------------------------------------------------------------------------------------------- processes
class _Group:
    """This process's place among the curating processes, and the one collective the command needs."""

    def __init__(self):
        self.world, self.rank = world().size, world().rank
        self._dist = None
        if self.world > 1:

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self._dist = dist

    def agree(self, error: Optional[MmclError]) -> None:
        """Wait for every process; raise the first process's error everywhere (said by rank 0), if any."""
        if self._dist is None:
            if error is not None:
                raise error
            return
        texts: List[Any] = [None] * self.world
        self._dist.all_gather_object(texts, None if error is None else (type(error).__name__, str(error)))
        found = next((t for t in texts if t is not None), None)
        if found is not None:
            err = ConfigError(found[1]) if found[0] == "ConfigError" else DataError(found[1])
            err.everywhere = True
            raise err

    def mine(self, i: int) -> bool:
        return i % self.world == self.rank


def _guarded(group: _Group, fn, *args, **kwargs):
    """Run `fn` and agree on its outcome: every process returns, or every process raises the same one line."""
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except MmclError as err:
        error = err
    group.agree(error)
    return result


# --------------------------------------------------------------------------------------------- output folder
def _names(urls: List[str]) -> List[str]:
    names = [os.path.basename(shown_path(u)) for u in urls]  # pipe:aws s3 cp s3://b/x.tar - -> x.tar
    if len(set(names)) != len(names):
        raise DataError("several input shards share a file name; curate them into separate output directories")
    return names


def _embed_name(name: str) -> str:
    return f"{EMBED_DIR}/{name}.npz"


def _claim(out: Path, identity: Dict[str, Any], names: List[str], inputs: List[str]) -> OutputManifest:
    """The output folder's manifest, with every file this run may write recorded before anything is written."""
    for url in inputs:
        if not has_scheme(url) and Path(url).resolve().parent == out.resolve():
            raise ConfigError(f"--out {out} is the folder of the input shards; curate into another folder "
                              f"(the input is never changed)")
    manifest = OutputManifest.claim(out, "curate", name=MANIFEST)
    if not manifest.data:
        manifest.data = {"identity": identity, "done": []}
        manifest.save()
    recorded = manifest.data.get("identity")
    if recorded != identity:
        what = [k for k in ("rules", "model", "inputs", "keys") if (recorded or {}).get(k) != identity.get(k)]
        shown = json.dumps((recorded or {}).get("rules"), sort_keys=True)
        raise ConfigError(f"--out {out} was curated with other {' and '.join(what) or 'settings'} (rules {shown}); "
                          f"nothing was changed: use another --out for these rules")
    files = [REPORT_FILE, PLOT_FILE, DROPPED_FILE, DECONTAMINATE_FILE, SKIP_LOG, SIZES_FILE]
    for name in names:
        files += [name, _embed_name(name)]
    manifest.will_write(files + [f + _TEMP for f in files])
    make_folder(out / EMBED_DIR)  # relative to the held --out: a link there is refused
    # An interrupted earlier run's partial files: only those it recorded (a file of the user's is never deleted).
    manifest.remove([f for f in sorted(manifest.files) if f.endswith(_TEMP)])
    manifest.files |= {f + _TEMP for f in files}
    manifest.save()
    return manifest


def _save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.name + _TEMP)
    try:
        with new_file(path.parent, tmp.name) as f:
            np.savez(f, **arrays)
        replace_inside(path.parent, tmp.name, path.name)
    except OSError as err:
        unlink_inside(path.parent, tmp.name, quiet=True)
        raise DataError(f"cannot write {path}: {os_error_text(err)}") from None


def _load_npz(path: Path) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is damaged ({type(err).__name__}: {err}); delete it and run again") from None


# ------------------------------------------------------------------------------------------------ pass 1: embed
def _stored(files: Dict[str, bytes], keys: Optional[SampleKeys], model_id: str):
    """(image, text, caption) from a sample's `mmcl reinforce` members when the same model wrote them, else None."""
    if TEACHER_IMAGE not in files or TEACHER_META not in files:
        return None
    try:
        if load_json(files[TEACHER_META].decode("utf-8")).get("teacher") != model_id:
            return None
        caption = candidate_captions(files, keys)[0]
        image, text, _ = stored_teacher_features(files, caption, keys)
    except (SkipSample, ValueError, UnicodeDecodeError, AttributeError, IndexError):
        return None
    return image, text, caption


def _skip_reason(files: Dict[str, bytes], keys: Optional[SampleKeys]) -> str:
    """Why `embed_samples` gives no embedding for a sample: a `mmcl.data.skips` reason."""
    try:
        raw = keys.image(files) if keys else image_bytes(files)
        if raw is None:
            return "missing_image"
        decode_image(raw, MAX_PIXELS)
        return "decode" if candidate_captions(files, keys) else "missing_caption"
    except SkipSample as skip:
        return skip.reason


def _embed_shard(url: str, encoder: ClipEncoder, batch_size: int, keys: Optional[SampleKeys],
                 model_id: str) -> Dict[str, np.ndarray]:
    """Every sample of one shard: index in the shard, key, caption, readable, caption length, CLIP score, image
    embedding (float16, zero rows for unreadable samples), whether it came from stored embeddings, a digest of its
    image's bytes and why it is unreadable; and the skip reasons of the shard itself (a shard that breaks off)."""
    rows: List[Dict[str, Any]] = []
    errors: List[str] = []
    pending: List[Tuple[Dict[str, Any], Any]] = []  # (its row, the raw sample) waiting for the model

    def flush():
        computed = embed_samples([item for _, item in pending], encoder.image, encoder.tokenize, encoder.embed,
                                 batch_size, keys)
        for (row, item), emb in zip(pending, computed):
            if emb is None:
                row["skip"] = _skip_reason(item.files, keys)
            else:
                row.update(caption=emb.captions[0], readable=True, image=emb.image,
                           score=float(np.dot(emb.image.astype(np.float64), emb.text[0].astype(np.float64))))
        pending.clear()

    for item in read_raw_samples([(url, None)]):
        if item.files is None and not item.key:
            errors.append(item.error)  # a shard-level problem: the rest of the shard cannot be read
            continue
        row = {"index": item.index, "key": item.key, "caption": "", "readable": False, "score": float("nan"),
               "image": None, "stored": False, "sha": "", "skip": item.error or ""}
        rows.append(row)
        if item.files is None:  # a member over the size limit
            continue
        raw = keys.image(item.files) if keys else image_bytes(item.files)
        row["sha"] = hashlib.sha256(raw).hexdigest()[:32] if raw is not None else ""
        found = _stored(item.files, keys, model_id)
        if found is not None:
            image, text, caption = found
            row.update(caption=caption, readable=True, image=image, stored=True,
                       score=float(np.dot(image.astype(np.float64), text.astype(np.float64))))
            continue
        pending.append((row, item))
        if len(pending) >= _WINDOW:
            flush()
    flush()
    dim = next((r["image"].shape[0] for r in rows if r["image"] is not None), 0)
    zero = np.zeros(dim, dtype=np.float32)
    return {"index": np.array([r["index"] for r in rows], dtype=np.int64),
            "key": np.array([r["key"] for r in rows], dtype=str),
            "caption": np.array([r["caption"] for r in rows], dtype=str),
            "readable": np.array([r["readable"] for r in rows], dtype=bool),
            "caption_len": np.array([len(r["caption"]) for r in rows], dtype=np.int64),
            "score": np.array([r["score"] for r in rows], dtype=np.float32),
            "image": (np.stack([zero if r["image"] is None else r["image"] for r in rows]) if rows
                      else np.zeros((0, dim))).astype(np.float16),
            "stored": np.array([r["stored"] for r in rows], dtype=bool),
            "sha": np.array([r["sha"] for r in rows], dtype=str),
            "skip": np.array([r["skip"] for r in rows], dtype=str),
            "shard_errors": np.array(len(errors), dtype=np.int64),
            "shard_skips": np.array(errors, dtype=str)}


def _embed_decontamination_set(encoder: ClipEncoder, data: str, batch_size: int, device, progress: bool
                               ) -> Dict[str, np.ndarray]:
    found = embed_image_set(encoder.model, encoder.preprocess, data, batch_size, 0, device, progress,
                            "decontaminate")
    keys = [json.loads(k)["key"] if k.startswith("{") else k for k in found["keys"]]
    return {"image": found["features"].numpy().astype(np.float16), "key": np.array(keys, dtype=str)}


def _write_skip_log(out: Path, urls: List[str], tables: List[Dict[str, np.ndarray]]) -> None:
    """skipped.jsonl: the unreadable samples and the shards that broke off, with their reasons (`mmcl.data.skips`)."""
    unlink_inside(out, SKIP_LOG)  # the manifest lists it
    log = SkipLog(out / SKIP_LOG, fresh=True, open_fn=open_inside)
    for url, table in zip(urls, tables):
        for reason in table.get("shard_skips", np.zeros(0, dtype=str)).tolist():
            log.write(skip_record(reason, url))
        for key, reason in zip(table["key"].tolist(), table.get("skip", np.zeros(0, dtype=str)).tolist()):
            if reason:
                log.write(skip_record(reason, url, key))
    log.close()


# ------------------------------------------------------------------------------------------------ pass 3: write
def _write_shard(url: str, dest: Path, table: Dict[str, np.ndarray], keep: np.ndarray) -> int:
    """The kept samples of one input shard, members unchanged, into `dest` (via a temporary file)."""
    wanted = {int(i): str(k) for i, k, ok in zip(table["index"], table["key"], keep) if ok}
    tmp = dest.with_name(dest.name + _TEMP)
    written = 0
    f = new_file(dest.parent, tmp.name)  # before the try: a link there is refused, and not removed
    try:
        with f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for item in read_raw_samples([(url, None)]):
                if item.files is None or item.index not in wanted:
                    continue
                if item.key != wanted[item.index]:
                    raise DataError(f"{url} changed since it was embedded (sample {item.index} is now "
                                    f"{item.key!r}, was {wanted[item.index]!r}); curate into a new --out")
                for ext, data in item.files.items():
                    add_tar_member(tar, f"{item.key}.{ext}", data)
                written += 1
        if written != len(wanted):
            raise DataError(f"{url} changed since it was embedded (expected {len(wanted)} kept samples, found "
                            f"{written}); curate into a new --out")
        replace_inside(dest.parent, tmp.name, dest.name)
    except OSError as err:
        unlink_inside(dest.parent, tmp.name, quiet=True)
        raise DataError(f"cannot write {dest}: {os_error_text(err)}") from None
    except BaseException:
        unlink_inside(dest.parent, tmp.name, quiet=True)
        raise
    return written


# ------------------------------------------------------------------------------------------------- the command
def _bar(progress: bool, total: int, desc: str):
    if not progress:
        return None

    return tqdm(total=total, desc=desc, unit="shard", dynamic_ncols=True)


def curate(model: str, data: str, out_dir: str, rules: Rules, batch_size: int = 64, device: Optional[str] = None,
           keys: Optional[SampleKeys] = None, progress: bool = True) -> Dict[str, Any]:
    """Curate the shards of `data` into `out_dir` (see the module docstring); returns the summary: shards, samples,
    kept, dropped per reason, samples read from stored embeddings, seconds."""
    start = time.perf_counter()
    group = _Group()
    progress = progress and group.rank == 0
    checked, urls, names = _guarded(group, _prepare, data, rules, batch_size)
    model_id = model if has_scheme(model) else str(Path(model).resolve())
    inputs = [redact(u) if has_scheme(u) else os.path.abspath(u) for u in urls]  # the same from any working directory
    identity = {"model": model_id, "inputs": inputs, "rules": checked.record(),
                "keys": None if keys is None else repr(keys)}
    out = Path(out_dir)
    manifest = _guarded(group, _claim, out, identity, names, urls) if group.rank == 0 else None
    if group.rank != 0:
        group.agree(None)
    if device is None:  # each process on its own GPU under a launcher
        device = f"cuda:{world().local_rank}" if torch.cuda.is_available() else "cpu"
    encoder = _guarded(group, ClipEncoder.load, model, device)

    # pass 1: embeddings (the evaluation set's first, by rank 0)
    _guarded(group, _embed_eval_set, group, out, checked, encoder, batch_size, device, progress)
    _guarded(group, _embed_all, group, out, urls, names, encoder, batch_size, keys, model_id, progress)

    # pass 2: the decision, over every sample in shard order
    tables, cat, eval_set, decision = _guarded(group, _decide_all, out, names, checked)
    if group.rank == 0:
        shard_of = np.concatenate([np.full(len(t["key"]), i) for i, t in enumerate(tables)]) if tables else \
            np.zeros(0, dtype=np.int64)
        _guarded(group, write_report, out, identity, names, tables, cat, shard_of, decision,
                 None if eval_set is None else eval_set["key"], _TEMP)
        _write_skip_log(out, urls, tables)
    else:
        group.agree(None)

    # pass 3: the filtered shards
    _guarded(group, _write_all, group, out, urls, names, tables, decision, progress)
    if group.rank == 0 and manifest is not None:  # the kept samples per shard, for train.epochs on the output
        _write_kept_sizes(out, names, tables, decision)
    summary = {"out_dir": str(out), "shards": len(urls), "samples": int(len(cat["key"])),
               "kept": int((decision.reason == KEPT).sum()), "dropped": _dropped_counts(decision),
               "from_stored_embeddings": int(cat["stored"].sum()), "processes": group.world,
               "seconds": round(time.perf_counter() - start, 1)}
    if group.rank == 0 and manifest is not None:
        manifest.data["done"] = names
        manifest.data["summary"] = {k: v for k, v in summary.items() if k not in ("seconds", "processes")}
        manifest.save()
    return summary


def _prepare(data: str, rules: Rules, batch_size: int) -> Tuple[Rules, List[str], List[str]]:
    """The checked rules, the input shards' URLs and their output names; `DataError` for a bad batch size or no
    shards."""
    if batch_size <= 0:
        raise DataError(f"--batch-size must be > 0 (got {batch_size})")
    checked = rules.check()
    urls = expand_urls(data)
    if not urls:
        raise DataError(f"no shards match {data}")
    return checked, urls, _names(urls)


def _embed_eval_set(group: _Group, out: Path, checked: Rules, encoder: ClipEncoder, batch_size: int, device,
                    progress: bool) -> None:
    """With ``--decontaminate``, the evaluation set's embeddings (rank 0, unless an earlier run stored them)."""
    path = out / DECONTAMINATE_FILE
    if checked.decontaminate is not None and group.rank == 0 and not path.is_file():
        _save_npz(path, **_embed_decontamination_set(encoder, checked.decontaminate, batch_size, device, progress))


def _embed_all(group: _Group, out: Path, urls: List[str], names: List[str], encoder: ClipEncoder, batch_size: int,
               keys: Optional[SampleKeys], model_id: str, progress: bool) -> None:
    """Pass 1: the embedding file of each of this process's shards that an earlier run did not finish."""
    bar = _bar(progress, sum(group.mine(i) for i in range(len(urls))), "curate: embed")
    try:
        for i, (url, name) in enumerate(zip(urls, names)):
            path = out / _embed_name(name)
            if group.mine(i) and not path.is_file():
                _save_npz(path, **_embed_shard(url, encoder, batch_size, keys, model_id))
            if group.mine(i) and bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _decide_all(out: Path, names: List[str], checked: Rules):
    """Pass 2: every shard's embedding table, their columns end to end (``cat``), the evaluation set's embeddings
    (None without ``--decontaminate``) and the decision over every sample in shard order."""
    tables = [_load_npz(out / _embed_name(name)) for name in names]
    for t in tables:  # embedding files written before digests were stored: no byte-identical match
        t.setdefault("sha", np.full(len(t["key"]), "", dtype=str))
    cat = {k: np.concatenate([t[k] for t in tables]) if tables else np.zeros(0)
           for k in ("key", "caption", "readable", "caption_len", "score", "stored", "sha")}
    dims = {t["image"].shape[1] for t in tables if len(t["image"])}
    if len(dims) > 1:
        raise DataError(f"the embedding files in {out / EMBED_DIR} disagree in width ({sorted(dims)}); "
                        f"curate into a new --out")
    images = np.concatenate([t["image"] for t in tables if len(t["image"])]).astype(np.float32) if dims \
        else np.zeros((0, 0), dtype=np.float32)
    eval_set = _load_npz(out / DECONTAMINATE_FILE) if checked.decontaminate is not None else None
    if eval_set is not None and dims and eval_set["image"].shape[1] not in dims:
        raise DataError(f"{checked.decontaminate} embeds to width {eval_set['image'].shape[1]}, the data to "
                        f"{sorted(dims)}")
    languages = caption_languages(cat["caption"].tolist()) if checked.language is not None else None
    if languages is not None:
        cat["language"] = languages
    decision = decide(checked, cat["readable"], cat["caption_len"], cat["score"], images,
                      None if eval_set is None else eval_set["image"].astype(np.float32), languages, cat["sha"])
    return tables, cat, eval_set, decision


def _write_all(group: _Group, out: Path, urls: List[str], names: List[str], tables: List[Dict[str, np.ndarray]],
               decision: Decision, progress: bool) -> None:
    """Pass 3: the output shard of each of this process's inputs that an earlier run did not finish."""
    bar = _bar(progress, sum(group.mine(i) for i in range(len(urls))), "curate: write")
    offset = 0
    try:
        for i, (url, name, table) in enumerate(zip(urls, names, tables)):
            keep = decision.reason[offset:offset + len(table["key"])] == KEPT
            offset += len(table["key"])
            if group.mine(i) and not (out / name).is_file():
                _write_shard(url, out / name, table, keep)
            if group.mine(i) and bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _dropped_counts(decision: Decision) -> Dict[str, int]:
    """The samples dropped per reason, the reasons that dropped none left out."""
    dropped = {r: int((decision.reason == REASONS.index(r)).sum()) for r in REASONS}
    return {k: v for k, v in dropped.items() if v}


def _write_kept_sizes(out: Path, names: List[str], tables: List[Dict[str, np.ndarray]], decision: Decision) -> None:
    """sizes.json of the output shards: each one's kept samples."""
    bounds = np.cumsum([0] + [len(t["key"]) for t in tables])
    write_sizes(out, {name: int((decision.reason[a:b] == KEPT).sum()) for name, a, b
                      in zip(names, bounds[:-1], bounds[1:])})


def dropped_reasons(decision: Decision) -> List[Optional[str]]:
    """Per sample, the reason it was dropped, or None when kept."""
    return [None if r == KEPT else REASONS[r] for r in decision.reason.tolist()]
