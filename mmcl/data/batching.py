"""A data worker's side of the training stream: raw samples decoded at their input sizes, gathered into batches,
each sent to the training process in a `WorkerOutput` with the worker's position after it.

`role_batches` is one worker role's infinite stream (the stages are listed in pipeline.py); the training process
gathers the roles' outputs in `mmcl.data.stream.TrainStream`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .decode import DEFAULT_KEYS, IMAGE_EXTS, SkipSample, TransformOutputError, caption_draw, decode_sample, zero_skips
from .device_decode import collate_images, encoded_sample
from .naflex import patch_batch
from .pipeline import CAPTION_COUNTS, InputSizes, StreamSpec, epoch_shard_plan, sample_id, shuffle_block
from .reading import RawSample, read_raw_samples
from .skips import member_of
from .skips import record as skip_record
from .sources import redact


@dataclasses.dataclass(frozen=True)
class WorkerOutput:
    """What a worker role sends the training process for each batch: the batch (data keys only) and, beside it,
    what `TrainStream` keeps for itself. A worker-side user error ends the role's stream with an output carrying
    `error` and no batch."""

    batch: Optional[Dict[str, Any]]  # None with `error`
    role: int = 0
    state: Optional[Dict[str, Any]] = None  # the role's position just after `batch` (what a saved state records)
    skips: Tuple[Dict[str, Any], ...] = ()  # the `mmcl.data.skips.record` of each sample skipped since the last batch
    warnings: Tuple[Tuple[str, type, str, int], ...] = ()  # (message, category, filename, lineno) caught in a worker
    error: Optional[str] = None  # a user error's message: `TrainStream` raises it as a DataError

    def pin_memory(self) -> "WorkerOutput":
        """This output with its batch's tensors in page-locked memory. The DataLoader's pinning thread calls it (it
        pins an object by its own ``pin_memory`` method), as `TrainStream` does without workers."""
        return self if self.batch is None else dataclasses.replace(self, batch=_pinned(self.batch))


def _pinned(batch: Dict[str, Any]) -> Dict[str, Any]:
    """`batch` with its tensors in page-locked memory."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def role_batches(s: StreamSpec, role: int, start: Dict[str, Any], first_batch: int = 0,
                 stride: int = 1) -> Iterator[WorkerOutput]:
    """Infinite batches of one worker role, starting at position `start`, each in a `WorkerOutput` with the
    position after it. The role's batches are the process's batches `first_batch`, `first_batch + stride`, ...
    (which decides each one's input sizes, `StreamSpec.sizes_at`). A transform whose output cannot be batched ends
    the stream with one output carrying the error."""
    try:
        yield from _role_batches(s, role, start, first_batch, stride)
    except TransformOutputError as err:
        yield WorkerOutput(None, role, error=str(err))


def _role_batches(s: StreamSpec, role: int, start: Dict[str, Any], first_batch: int,
                  stride: int) -> Iterator[WorkerOutput]:
    rank, n_roles = s.rank, s.n_roles
    slot, n_slots = rank * n_roles + role, s.world_size * n_roles
    epoch, shard, sample, emitted = start["epoch"], start["shard"], start["sample"], start["emitted"]
    skipped = dict(zero_skips(), **start["skipped"])
    skipped_before_epoch = dict(zero_skips(), **start.get("skipped_before_epoch", start["skipped"]))
    filling = _Filling(s, first_batch, stride, {k: int(start.get(k, 0)) for k in CAPTION_COUNTS})
    records: List[Dict[str, Any]] = []  # the skips since the last batch

    def sent(batch: Optional[Dict[str, Any]], position: Optional[Dict[str, Any]] = None,
             error: Optional[str] = None) -> WorkerOutput:
        out = WorkerOutput(batch, role, position, tuple(records), error=error)
        records.clear()
        return out

    def state(**extra) -> Dict[str, Any]:
        return {"epoch": epoch, "shard": shard, "sample": sample, "emitted": emitted,
                "skipped": dict(skipped), "skipped_before_epoch": dict(skipped_before_epoch), **filling.counts,
                **extra}

    # After a resume on another number of processes or workers: the rest of the saved run's epochs, as tasks
    # (`resized_positions`), before this slot's own epochs begin.
    tasks = copy.deepcopy(list(start.get("leftover", ())))
    while tasks:
        task = tasks[0]
        for item, origin in _leftover_items(s, task):
            if not _in_parts(item, task["parts"]):
                continue
            decoded = _decode_or_count_skip(s, item, origin["slot"], origin["epoch"], skipped, filling.sizes,
                                            records)
            if decoded is not None and filling.add(item.key, decoded, item.url, origin["epoch"]):
                yield sent(filling.take(), state(leftover=copy.deepcopy(tasks)))
        tasks.pop(0)
    empty_epochs = 0
    while True:
        plan = epoch_shard_plan(s.sources, epoch, s.seed, slot, n_slots, s.resampled, s.weights)
        full_epoch = (shard, sample, emitted) == (0, 0, 0)
        raw_seen, good_seen = 0, 0
        for block, perm, (shard, sample) in _shuffled_blocks(s, plan, slot, epoch, (shard, sample)):
            for j in range(emitted, len(block)):
                item = block[perm[j]]
                emitted = j + 1
                raw_seen += item.error is None or bool(item.key)  # a sample skipped as too large was read
                decoded = _decode_or_count_skip(s, item, slot, epoch, skipped, filling.sizes, records)
                if decoded is None:
                    continue
                good_seen += 1
                if filling.add(item.key, decoded, item.url, epoch):
                    yield sent(filling.take(), state())
            emitted = 0
        if full_epoch and good_seen == 0:
            empty_epochs += 1
            problem = _empty_epoch_problem(s, rank, role, n_slots, raw_seen, skipped, plan, empty_epochs)
            if problem is not None:
                yield sent(None, error=problem)
                return
        elif good_seen:
            empty_epochs = 0
        epoch, shard, sample, emitted = epoch + 1, 0, 0, 0
        skipped_before_epoch = dict(skipped)


class _Filling:
    """The decoded samples of the batch being filled: process batch `batch`; the role's next one is `stride`
    batches later."""

    def __init__(self, s: StreamSpec, batch: int = 0, stride: int = 1, counts: Optional[Dict[str, int]] = None):
        self.s, self.batch, self.stride = s, batch, stride
        # The captions batched so far and those cut at the text context (`CAPTION_COUNTS`), carried in the position
        self.counts = dict(counts or dict.fromkeys(CAPTION_COUNTS, 0))
        self.sizes = s.sizes_at(batch)
        self.clear()

    def clear(self) -> None:
        self.images: List[torch.Tensor] = []
        self.captions: List[str] = []
        self.labels: List[int] = []
        self.keys: List[str] = []
        self.ids: List[int] = []  # `sample_id` of each sample
        self.teacher: List[Any] = []  # the teacher's view, or its stored embeddings, of each image; else empty
        self.negatives: List[List[str]] = []  # each sample's negative captions (data.negatives); else empty
        self.parallel: List[bool] = []  # whose caption the decoder predicts in parallel (loss.caption_parallel)

    def add(self, key: str, decoded, url: str = "", epoch: int = 0) -> bool:
        """Add one `decode_sample` result of the sample `key` of shard `url`, read in `epoch`; whether the batch is
        full."""
        tensor, caption, label, *teacher = decoded
        if self.s.caption_parallel > 0:
            self.parallel.append(parallel_draw(self.s.seed, epoch, sample_id(url, key)) < self.s.caption_parallel)
        if self.s.negatives:
            self.negatives.append(teacher.pop())
        self.images.append(tensor)
        self.captions.append(caption)
        self.labels.append(label)
        self.keys.append(key)
        self.ids.append(sample_id(url, key))
        self.teacher += teacher
        return len(self.images) == self.size

    @property
    def size(self) -> int:
        """The pairs of the batch being filled: data.batch_size, or with NaFlex as many as its length fits."""
        return self.s.batch_size if self.s.naflex is None else self.s.naflex.pairs_at(self.batch)

    def take(self) -> Dict[str, Any]:
        """The full batch; empties the filling for the role's next batch (at that batch's input sizes)."""
        flex = self.s.naflex
        device = self.s.device_decode
        batch = collate(self.images if flex is None and device is None else None, self.captions, self.labels,
                        self.keys, self.s.tokenizer, self.s.teacher_view, self.teacher,
                        context_length=self.sizes.context_length,
                        negatives=self.negatives if self.s.negatives else None, max_negatives=self.s.negatives,
                        counts=self.counts, short_captions=self.s.short_captions)
        if device is not None:  # data.decode=device: encoded JPEGs (and the other samples decoded here)
            size = (device.size, device.size) if isinstance(device.size, int) else tuple(device.size)
            batch.update(collate_images(self.images, size))
        if flex is not None:
            batch.update(patch_batch(self.images, flex.seq_len_at(self.batch), flex.patch_size))
        batch["sample_id"] = torch.tensor(self.ids, dtype=torch.long)
        if self.s.caption_parallel > 0:
            batch["caption_parallel"] = torch.tensor(self.parallel, dtype=torch.bool)
        self.clear()
        self.batch += self.stride
        self.sizes = self.s.sizes_at(self.batch)
        return batch


def _decode_or_count_skip(s: StreamSpec, item: RawSample, slot: int, epoch: int, skipped: Dict[str, int],
                          sizes: InputSizes, records: List[Dict[str, Any]]):
    """`_decode_seeded` of `item`, or None when it is unreadable or skipped: counted in `skipped`, and its
    `mmcl.data.skips.record` added to `records` (which travel with the next output to the skip log)."""
    reason, detail = item.error, ""
    if reason is None:
        try:
            return _decode_seeded(s, item, slot, epoch, sizes)
        except SkipSample as skip:
            reason, detail = skip.reason, str(skip).partition(": ")[2]
        except MemoryError:  # a sample too large to decode or transform here; the stream goes on
            reason = "too_large"
    skipped[reason] += 1
    records.append(skip_record(reason, item.url, item.key, member_of(reason, item.key, item.files), detail))
    return None


def _decode_seeded(s: StreamSpec, item: RawSample, slot: int, epoch: int, sizes: InputSizes):
    """`decode_sample` of a raw item drawn by `slot` in `epoch`, at `sizes` (its augmentation and caption draw
    follow from them and the item's place, whichever process reads it; so does the draw of its negatives). With
    ``data.decode=device`` a JPEG the device can decode comes back encoded with its crop box (drawn from the run's
    seed, the epoch and the sample's id alone: the same on any number of processes), the rest decoded here."""
    drawn = s.keys is not None or s.negatives > 0
    draw = caption_draw(s.seed, epoch, item.key) if drawn else 0
    if s.device_decode is not None:
        encoded = encoded_sample(item.files, s.device_decode, s.max_pixels,
                                 _mix(s.seed, epoch, sample_id(item.url, item.key)), s.keys, draw)
        if encoded is not None:
            return encoded
    return decode_sample(item.files, sizes.preprocess, s.max_pixels, sizes.draft_size,
                         aug_seed=_mix(s.seed, slot, epoch, item.shard, item.index), as_uint8=s.as_uint8,
                         keys=s.keys, caption_draw=draw, teacher_view=s.teacher_view, stored_teacher=s.stored_teacher,
                         negatives=s.negatives)


def _shuffled_blocks(s: StreamSpec, plan, slot: int, epoch: int,
                     start: Tuple[int, int]) -> Iterator[Tuple[List[RawSample], np.ndarray, Tuple[int, int]]]:
    """The raw items of `plan` from position `start`, in blocks of ``shuffle_buffer`` items: each block with the
    order it is emitted in (`shuffle_block`) and the position it starts at (which a saved state records)."""
    reader = read_raw_samples(plan, start, retries=s.retries, retry_delay=s.retry_delay,
                              read_timeout=s.read_timeout, members=s.members,
                              max_member_bytes=s.max_member_bytes)
    block_size = max(1, s.shuffle_buffer)
    while True:
        block = list(itertools.islice(reader, block_size))
        if not block:
            return
        yield block, shuffle_block(len(block), s.seed, slot, epoch, start), start
        start = block[-1].pos


def _task_items(s: StreamSpec, task: Dict[str, Any]) -> Iterator[Tuple[RawSample, Tuple[int, int, int]]]:
    """The raw items a saved slot (``task["slot"]`` of ``task["n_slots"]``) emits in ``task["epoch"]`` from its
    saved position to the end of that epoch, in its order (same plan, same block shuffle), each with the
    position (block start shard, block start sample, emitted) just after it."""
    slot, n_slots, epoch = task["slot"], task["n_slots"], task["epoch"]
    plan = epoch_shard_plan(s.sources, epoch, s.seed, slot, n_slots, s.resampled, s.weights)
    emitted = task["emitted"]
    for block, perm, (shard, sample) in _shuffled_blocks(s, plan, slot, epoch, (task["shard"], task["sample"])):
        for j in range(emitted, len(block)):
            yield block[perm[j]], (shard, sample, j + 1)
        emitted = 0


def _leftover_items(s: StreamSpec, task: Dict[str, Any]) -> Iterator[Tuple[RawSample, Dict[str, Any]]]:
    """The raw items of a leftover task with the saved slot each comes from; `task` is kept up to date (its
    position after the item), so that a copy of it taken at a batch resumes right after that batch.

    A plain task is one saved slot's rest of an epoch. An ``interleave`` task regroups the rest of the epoch of
    every saved process (one slot each) as the saved run would have batched it: chunk after chunk, ``per_slot``
    items from each saved slot in rank order, of which this process takes positions ``[lo, hi)`` of each chunk.
    A saved slot whose epoch has ended leaves its positions of the following chunks empty."""
    if task.get("kind") != "interleave":
        for item, pos in _task_items(s, task):
            task["shard"], task["sample"], task["emitted"] = pos
            yield item, task
        return
    streams, per_slot = task["streams"], task["per_slot"]
    chunk = per_slot * len(streams)
    readers = [_task_items(s, st) for st in streams]
    exhausted = [False] * len(streams)
    while not all(exhausted):
        p = task["p"]
        k = p // per_slot
        nxt = None if exhausted[k] else next(readers[k], None)
        if nxt is None:
            exhausted[k] = True
            task["p"] = ((k + 1) * per_slot) % chunk
            continue
        item, pos = nxt
        streams[k]["shard"], streams[k]["sample"], streams[k]["emitted"] = pos
        task["p"] = (p + 1) % chunk
        if task["lo"] <= p < task["hi"]:
            yield item, streams[k]


def _in_parts(item: RawSample, parts: Sequence[Sequence[int]]) -> bool:
    """Whether `item` belongs to the share (i of m, at each level of splitting) a slot takes of a saved slot's
    remaining samples. Decided by the sample's place in its shard, so every taker decides alike."""
    for i, m, level in parts:
        if m > 1 and _mix(item.shard, item.index, level) % m != i:
            return False
    return True


_PARALLEL_SALT = 0x4C6F6343  # the parallel-prediction draw's own stream among the per-sample draws


def parallel_draw(seed: int, epoch: int, sid: int) -> float:
    """A uniform number in [0, 1) for sample `sid` (`sample_id`) in `epoch` of a run seeded `seed`: a sample's caption
    is predicted in parallel (``loss.caption_parallel``) when it is below the share. A function of those three
    alone, so one process or several, any micro-batching and a resumed run choose the same samples, and a sample is
    drawn afresh each epoch."""
    return _mix(seed, epoch, sid, _PARALLEL_SALT) / 2.0 ** 63


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (order matters), for per-sample RNGs: splitmix64 (Steele et al. 2014)
    folded over the values; a few integer operations, so it costs nothing next to decoding."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & mask)) + 0x9E3779B97F4A7C15 & mask
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & mask
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & mask
        h ^= h >> 31
    return h >> 1


_MAX_EMPTY_EPOCHS = 50  # a slot that drew only bad shards this often, while good ones exist, stops the run


def _first_valid_sample(s: StreamSpec) -> Optional[str]:
    """The key of the first sample that decodes, over all shards in order; None when no shard has one."""
    urls = [(u, None) for src in s.sources for u in src]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slots' own reading already warned about these shards
        for item in read_raw_samples(urls, members=s.members, max_member_bytes=s.max_member_bytes):
            if item.error is None:
                try:
                    decode_sample(item.files, s.preprocess, s.max_pixels, s.draft_size,
                                  as_uint8=s.as_uint8)
                    return item.key
                except SkipSample:
                    continue
    return None


def _members_held(s: StreamSpec) -> str:
    """What the first sample of the shards holds against what the run reads (``data.image_key``,
    ``data.caption_key``), as the end of a no-valid-sample line: the members named wrongly show there."""
    urls = [(u, None) for src in s.sources for u in src]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = next((item for item in read_raw_samples(urls, max_member_bytes=s.max_member_bytes)
                      if item.error is None), None)
    if first is None:
        return ""
    keys = s.keys or DEFAULT_KEYS
    image = keys.image_key or "the first of " + "/".join(IMAGE_EXTS)
    return (f"; the first sample ({first.key} in {redact(first.url)}) holds members "
            f"{', '.join(sorted(first.files)) or 'none'}, where this run reads its image from {image} "
            f"(data.image_key) and its caption from {', '.join(keys.caption_keys)} (data.caption_key)")


def _empty_epoch_problem(s: StreamSpec, rank: int, role: int, n_slots: int, raw_seen: int,
                         skipped: Dict[str, int], plan: Sequence, empty_epochs: int) -> Optional[str]:
    """Why a slot's epoch without a valid sample must stop the stream, or None to go on to the next epoch.

    Going on is right when other shards hold valid samples and the next epoch's shard draw may reach them;
    stopping is right when no shard holds one, or when the split gives this slot the same samples every
    epoch (fewer shards than slots), since it would otherwise spin forever without a batch.
    """
    n_urls = sum(len(src) for src in s.sources)
    counts = ", ".join(f"{k}={v}" for k, v in skipped.items() if v) or "none"
    if _first_valid_sample(s) is None:
        return f"no valid sample in any of the {n_urls} shards (skipped so far: {counts}){_members_held(s)}"
    within_shards = all(modulo is not None for _, modulo in plan)  # the same samples in every epoch
    if within_shards and raw_seen == 0:
        return (f"no samples reach rank {rank} worker {role}: {n_urls} shards for {n_slots} rank x worker slots "
                f"and too few samples to split within shards; use fewer workers or more data")
    if within_shards:
        return (f"no valid sample reaches rank {rank} worker {role} ({raw_seen} read, all skipped: {counts}); "
                f"with {n_urls} shards for {n_slots} rank x worker slots each slot always gets the same samples")
    if empty_epochs >= _MAX_EMPTY_EPOCHS:
        return (f"rank {rank} worker {role} found no valid sample in {empty_epochs} consecutive passes over its "
                f"shards (skipped so far: {counts}); most shards are unreadable")
    return None


def collate(images: Optional[List[torch.Tensor]], captions: List[str], labels: List[int], keys: List[str],
            tokenizer: Callable[[List[str]], torch.Tensor], teacher_view=None,
            teacher_images: Optional[List[torch.Tensor]] = None, context_length: Optional[int] = None,
            negatives: Optional[List[List[str]]] = None, max_negatives: int = 0,
            counts: Optional[Dict[str, int]] = None, short_captions: bool = False) -> Dict[str, Any]:
    """Stack decoded samples into a batch: image (B,3,H,W) float, text (B,L) long, label (B,) long, key list;
    with `teacher_view` (distillation) also teacher_image (B,3,Ht,Wt) uint8 and teacher_text (B,Lt) long, the
    same captions in the teacher's tokens; with stored teacher embeddings in `teacher_images` (no view),
    teacher_image_features and teacher_text_features (B, Dt) float32 and teacher_scale (B,). `images` None: no
    image key (NaFlex batches carry patches instead, `mmcl.data.naflex.patch_batch`). With `negatives` (each
    sample's negative captions, at most `max_negatives` = K each): negatives_valid (B, K) bool, the slots that
    hold one, and negatives (R, L) long, the R real ones in the order of those slots (row-major), tokenized with
    the captions (the same width L). `counts` (a dict of `CAPTION_COUNTS`), when given, counts the captions and
    those the tokenizer cut at its context (`tokenize_counting_cut`). With `short_captions` (Long-CLIP's
    short-caption term, ``loss.short_caption``): short_text (B, L) long, each caption's `short_caption`, tokenized
    with the captions (not counted)."""
    negatives = negatives or []
    flat = [neg for negs in negatives for neg in negs]
    shorts = [short_caption(c) for c in captions] if short_captions else []
    tokens, cut = tokenize_counting_cut(tokenizer, captions + flat + shorts, len(captions))
    if counts is not None:
        counts["captions"] += len(captions)
        counts["cut_captions"] += cut
    tokens = cut_tokens(tokens, context_length)
    text = tokens[:len(captions)]
    out = None
    if images is not None and torch.utils.data.get_worker_info() is not None:
        # Stacking straight into shared memory saves the copy the DataLoader's queue would make to send it.
        out = torch.empty((len(images),) + tuple(images[0].shape), dtype=images[0].dtype).share_memory_()
    # Every tensor of a batch contiguous: a cut token batch (`TrimmedTokenizer`, `cut_tokens`) is a view with the
    # full context's row stride, which pinning and the copy to the device would otherwise carry as strided memory.
    batch = {"text": text.long().contiguous(), "label": torch.tensor(labels, dtype=torch.long), "key": list(keys)}
    if max_negatives:
        counts = torch.tensor([len(negs) for negs in negatives] or [0] * len(captions), dtype=torch.long)
        batch["negatives_valid"] = torch.arange(max_negatives)[None, :] < counts[:, None]
        batch["negatives"] = tokens[len(captions):len(captions) + len(flat)].long().contiguous()
    if short_captions:
        batch["short_text"] = tokens[len(captions) + len(flat):].long().contiguous()
    if images is not None:
        batch["image"] = torch.stack(images, out=out)
    if teacher_view is not None:
        batch["teacher_image"] = torch.stack(teacher_images)
        batch["teacher_text"] = torch.as_tensor(teacher_view.tokenize(captions)).contiguous()
    elif teacher_images:  # stored (image, text, scale) per sample: distill.from_shards
        batch["teacher_image_features"] = torch.from_numpy(np.stack([t[0] for t in teacher_images]))
        batch["teacher_text_features"] = torch.from_numpy(np.stack([t[1] for t in teacher_images]))
        batch["teacher_scale"] = torch.tensor([t[2] for t in teacher_images], dtype=torch.float32)
    return batch


def short_caption(caption: str) -> str:
    """A caption's short form for Long-CLIP's short-caption term: its first sentence, the text before the first
    ". " (Long-CLIP's rule; a caption without one is its own short form), without its final full stop."""
    first = caption.split(". ", 1)[0].strip()
    return first[:-1] if first.endswith(".") else first


def tokenize_counting_cut(tokenizer: Callable, texts: List[str], first: int) -> Tuple[torch.Tensor, int]:
    """``tokenizer(texts)`` as a tensor, and how many of the first `first` texts were longer than the tokenizer's
    context (``tokenizer.context_length``) and so were cut by it.

    A text can only have been cut when its tokens reach the last column of a full-width batch (its last token is
    not padding); those texts alone are tokenized again with one more position, and the ones holding a token
    there were longer. No extra work for batches of short captions; a tokenizer without an integer
    ``context_length`` (or without the ``context_length`` keyword) counts none."""
    tokens = tokenizer(texts)
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    context = getattr(tokenizer, "context_length", None)
    if not isinstance(context, int) or isinstance(context, bool) or tokens.shape[1] != context or not first:
        return tokens, 0
    pad = getattr(getattr(tokenizer, "tokenizer", None), "pad_token_id", None) or 0
    full = (tokens[:first, -1] != pad).nonzero().flatten().tolist()
    if not full:
        return tokens, 0
    try:
        wide = torch.as_tensor(tokenizer([texts[i] for i in full], context_length=context + 1))
    except TypeError:  # a tokenizer of the caller's without the keyword
        return tokens, 0
    return tokens, int((wide[:, context:] != pad).any(dim=1).sum()) if wide.shape[1] > context else 0


def cut_tokens(tokens: torch.Tensor, context_length: Optional[int]) -> torch.Tensor:
    """`tokens` (B, L) cut to `context_length` columns, as open_clip's tokenizers truncate: a caption that did not
    fit ends with its end-of-text token (its last non-padding token, padding being 0) in the last column."""
    if context_length is None or tokens.shape[1] <= context_length:
        return tokens
    out = tokens[:, :context_length].clone()
    longer = (tokens[:, context_length:] != 0).any(dim=1)
    if bool(longer.any()):
        last = (tokens != 0).long().cumsum(dim=1).argmax(dim=1)  # the first column at the final count: the last token
        out[longer, -1] = tokens[longer, last[longer]]
    return out
