"""The resumable training stream: shard plan, block shuffle, decoding in workers, batching.

One stage per function, chained by `role_batches` (see `TrainStream`)::

    expand_sources        spec -> shard URLs per '::'-separated source               (sources.py)
    epoch_shard_plan      (seed, epoch, slot) -> this slot's shards, in this epoch's order
    read_raw_samples      shards -> raw samples (bytes per extension), position after each   (reading.py)
    shuffle_block         blocks of `shuffle_buffer` raw samples -> a permutation from a seeded RNG
    decode_sample         raw sample -> (image tensor, caption, label) or a skip reason      (decode.py)
    collate               samples -> batch dict, captions tokenized

A *slot* is one (rank, worker) pair: ``slot = rank * workers + worker``. Each slot reads a disjoint set
of whole shards per epoch, the same number for every slot; the shards left over (all of them when there are
fewer shards than slots) are read by every slot, each taking the samples whose index is its slot modulo the
number of slots. Each sample is so seen once per epoch across all ranks and workers, and every slot gets an
equal share.

Shuffling permutes fixed blocks rather than sampling from a rolling buffer, so a worker's position is
three numbers: the epoch, where its current block starts (shard ordinal, sample index) and how many
samples of the block it has emitted. Resuming re-reads that one block from its start (tar headers only
for what comes before it) and drops the emitted part before decoding; nothing else is replayed.

Data workers outlive a stop signal sent to the whole process group (`WORKER_STOP_GRACE_S`) and send their
warnings to the training process with their batches, which shows each once.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import os
import signal
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..config import DataConfig, data_weight_problems, data_workers
from ..errors import ConfigError, DataError
from .decode import (SkipSample, TransformOutputError, caption_draw, decode_sample, needed_members, sample_keys,
                     zero_skips)
from .reading import RawSample, read_raw_samples
from .skips import member_of, record as skip_record
from .sources import expand_sources, has_scheme
from .transforms import (ImageSpec, draft_size_of, split_transform, train_draft_size, train_image_stages,
                         training_sample_transform)

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class StreamPhase:
    """How the batches from process batch `start` on are made, until the next phase starts (`train.phases`): the
    image transform of the phase's size (and the JPEG draft size it allows), and the caption length in tokens."""

    start: int  # the first process batch of the phase (its first step times train.accum_steps)
    preprocess: Callable  # PIL image -> what the batch stacks
    draft_size: Optional[Tuple[int, int]]
    context_length: Optional[int] = None  # captions cut to this many tokens (end-of-text kept); None: as tokenized


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to make its batches; built once per iteration by `TrainStream` and copied into
    each data worker (plain values and picklable callables)."""

    sources: List[List[str]]
    seed: int
    rank: int
    world_size: int
    n_roles: int  # workers, or 1 without workers
    resampled: bool
    weights: Optional[List[float]]
    shuffle_buffer: int
    batch_size: int
    max_pixels: int
    draft_size: Optional[Tuple[int, int]]  # of `preprocess`
    preprocess: Callable  # the model's own training transform (phases may replace it, `phase_at`)
    as_uint8: bool
    tokenizer: Callable
    worker_nice: int
    keys: Any  # `sample_keys`: None for the default members
    teacher_view: Any
    stored_teacher: bool
    retries: int
    retry_delay: float
    read_timeout: float
    members: Any  # `needed_members`
    max_member_bytes: int
    phases: Tuple[StreamPhase, ...] = ()  # by start; none: every batch at the model's own size

    def phase_at(self, batch: int) -> StreamPhase:
        """The phase of process batch `batch` (0-based, counted from the start of the run)."""
        current = StreamPhase(0, self.preprocess, self.draft_size)
        for phase in self.phases:
            if phase.start > batch:
                break
            current = phase
        return current


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


def epoch_shard_plan(sources: List[List[str]], epoch: int, seed: int, slot: int, n_slots: int,
                     resampled: bool = False, weights: Optional[Sequence[float]] = None
                     ) -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """The shards slot `slot` of `n_slots` reads in `epoch`, in order, as (url, modulo) pairs.

    Without resampling, all slots permute the full shard list with the same RNG (seed, epoch). Of the first
    n_slots * floor(n_shards / n_slots) shards slot k takes shards k, k + n_slots, ... whole; each of the
    remaining n_shards mod n_slots shards is read by every slot, which takes the samples whose index is k
    modulo n_slots. Every sample is then read once per epoch and, with shards of equal size, every slot gets
    the same number of samples (within one per remaining shard): with a slot holding one whole shard more
    than another, the smaller slot would wrap into its next epoch sooner and its samples would be seen more
    often. With fewer shards than slots all shards are split this way. With resampling, each slot draws
    ceil(n_shards / n_slots) shards with replacement, the source picked by `weights`, from an RNG of
    (seed, slot, epoch).
    """
    urls = [u for src in sources for u in src]
    if resampled:
        rng = np.random.default_rng([seed & 0xFFFFFFFF, slot, epoch, 1])
        p = np.asarray(weights if weights is not None else [len(s) for s in sources], dtype=np.float64)
        p = p / p.sum()
        n_draws = max(1, math.ceil(len(urls) / n_slots))
        plan = []
        for _ in range(n_draws):
            src = sources[int(rng.choice(len(sources), p=p))]
            plan.append((src[int(rng.integers(len(src)))], None))
        return plan
    order = np.random.default_rng([seed & 0xFFFFFFFF, epoch, 0]).permutation(len(urls))
    n_whole = len(urls) // n_slots * n_slots
    return ([(urls[i], None) for i in order[:n_whole][slot::n_slots]]
            + [(urls[i], (slot, n_slots)) for i in order[n_whole:]])

def _shard_split(n_shards: int, n_slots: int, resampled: bool) -> str:
    """How `epoch_shard_plan` deals `n_shards` among `n_slots`, as a saved state records it: "balanced" where the
    shards that do not divide evenly among the slots are split by sample index (states saved before that rule,
    which dealt them whole, lack the key), "whole" where both rules give the same plan."""
    return "whole" if resampled or n_shards < n_slots or n_shards % n_slots == 0 else "balanced"

def _fresh_position() -> Dict[str, Any]:
    return {"epoch": 0, "shard": 0, "sample": 0, "emitted": 0, "skipped": zero_skips(),
            "skipped_before_epoch": zero_skips()}

# Skip reasons that lose a shard (or the rest of one) rather than one sample; their count is of shards.
SHARD_SKIPS = ("shard_open", "truncated_tar")


def skip_units(skipped: Dict[str, int]) -> Dict[str, int]:
    """Skip counts per reason (``TrainStream.skipped``) as ``{"samples": n, "shards": m}``: a shard that cannot be
    opened, or breaks off, counts once as a shard (however many samples it held); every other reason is one
    sample. metrics.jsonl's ``data/skipped_samples`` and ``data/skipped_shards``."""
    shards = sum(int(skipped.get(r, 0)) for r in SHARD_SKIPS)
    samples = sum(int(n) for r, n in skipped.items() if r not in SHARD_SKIPS and r != "total")
    return {"samples": samples, "shards": shards}


def _summed_skips(positions: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """The skip counts of `positions` summed per reason (every reason present, zero where none)."""
    totals = zero_skips()
    for p in positions:
        for reason, n in p["skipped"].items():
            totals[reason] = totals.get(reason, 0) + n
    return totals

def _copy_position(p: Dict[str, Any]) -> Dict[str, Any]:
    before = p.get("skipped_before_epoch", p["skipped"])
    out = dict(p, skipped=dict(p["skipped"]), skipped_before_epoch=dict(before))
    if "leftover" in p:
        out["leftover"] = copy.deepcopy(p["leftover"])
    return out

# How long a data worker goes on serving after a stop signal meant for the whole process group: time for the
# training process to finish its step and save (a scheduler's SIGKILL ends everything later anyway).
WORKER_STOP_GRACE_S = 60.0

def _worker_stop_signal(signum, frame) -> None:
    """SIGTERM in a data worker: the first one (a scheduler's, sent to the whole group) is outlived for
    `WORKER_STOP_GRACE_S`; a second one (the loader's own shutdown) ends the worker at once."""
    if getattr(_worker_stop_signal, "seen", False):
        os._exit(0)
    _worker_stop_signal.seen = True
    timer = threading.Timer(WORKER_STOP_GRACE_S, os._exit, (0,))
    timer.daemon = True
    timer.start()

class _SlotStreams(torch.utils.data.IterableDataset):
    """The per-worker batch generator; one instance is copied into each DataLoader worker."""

    def __init__(self, stream: "TrainStream", starts: List[Dict[str, Any]], role_offset: int):
        super().__init__()
        self.s = stream._spec()
        self.starts = starts
        self.role_offset = role_offset
        self.first_batch = stream.batches  # the process batch the loader delivers first (phases follow it)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        n_roles = self.s.n_roles
        role = (worker + self.role_offset) % n_roles
        # The loader takes one batch from each worker in turn, worker 0 first: this role's batches are the
        # process's batches first, first + n_roles, ...
        first = self.first_batch + (role - self.role_offset) % n_roles
        if info is not None and self.s.worker_nice:
            os.nice(self.s.worker_nice)
        if info is not None:
            # A scheduler's stop signal often goes to the whole process group (SLURM at a time limit, `kill --
            # -PGID`): the training process stops at a step boundary and saves; its workers must not die first.
            # They end with the training process (the DataLoader shuts them down, or they see it gone).
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, _worker_stop_signal)
        if info is None:
            yield from role_batches(self.s, role, self.starts[role], first, n_roles)
            return
        # A worker's warnings travel with its next batch to the training process, which shows them there once
        # (`TrainStream.__iter__`): printed here, every worker would repeat them, in its own format.
        sent = set()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the training process's filters decide what is shown
            for batch in role_batches(self.s, role, self.starts[role], first, n_roles):
                new = [w for w in caught if (str(w.message), w.category) not in sent]
                del caught[:]
                if new:
                    sent.update((str(w.message), w.category) for w in new)
                    batch["__warnings__"] = [(str(w.message), _picklable_category(w.category), w.filename,
                                              w.lineno) for w in new]
                yield batch

def _picklable_category(category: type) -> type:
    """`category`, or UserWarning for a warning class that cannot travel between processes."""
    import pickle

    try:
        pickle.dumps(category)
        return category
    except Exception:  # e.g. a class defined inside a function
        return UserWarning

def shuffle_block(n: int, seed: int, slot: int, epoch: int, start: Tuple[int, int]) -> np.ndarray:
    """The order (int64 (n,), a permutation) in which a block of n raw samples is emitted.

    Seeded by the block's identity (seed, slot, epoch, start position), so a resumed stream that re-reads
    the block from `start` emits it in the same order.
    """
    return np.random.default_rng([seed & 0xFFFFFFFF, slot, epoch, start[0], start[1], 2]).permutation(n)

class _Filling:
    """The decoded samples of the batch being filled: process batch `batch`; the role's next one is `stride`
    batches later."""

    def __init__(self, s: StreamSpec, batch: int = 0, stride: int = 1):
        self.s, self.batch, self.stride = s, batch, stride
        self.phase = s.phase_at(batch)
        self.clear()

    def clear(self) -> None:
        self.images: List[torch.Tensor] = []
        self.captions: List[str] = []
        self.labels: List[int] = []
        self.keys: List[str] = []
        self.ids: List[int] = []  # `sample_id` of each sample
        self.teacher: List[Any] = []  # the teacher's view, or its stored embeddings, of each image; else empty

    def add(self, key: str, decoded, url: str = "") -> bool:
        """Add one `decode_sample` result of the sample `key` of shard `url`; whether the batch is full."""
        tensor, caption, label, *teacher = decoded
        self.images.append(tensor)
        self.captions.append(caption)
        self.labels.append(label)
        self.keys.append(key)
        self.ids.append(sample_id(url, key))
        self.teacher += teacher
        return len(self.images) == self.s.batch_size

    def take(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The full batch, carrying `state` (the position just after it) as ``__state__``; empties the filling."""
        batch = collate(self.images, self.captions, self.labels, self.keys, self.s.tokenizer,
                        self.s.teacher_view, self.teacher, context_length=self.phase.context_length)
        batch["sample_id"] = torch.tensor(self.ids, dtype=torch.long)
        batch["__state__"] = state
        self.clear()
        self.batch += self.stride
        self.phase = self.s.phase_at(self.batch)
        return batch


def _decode_or_count_skip(s: StreamSpec, item: RawSample, slot: int, epoch: int, skipped: Dict[str, int],
                          phase: StreamPhase, records: List[Dict[str, Any]]):
    """`_decode_seeded` of `item`, or None when it is unreadable or skipped: counted in `skipped`, and its
    `mmcl.data.skips.record` added to `records` (which travel with the next batch to the skip log)."""
    reason, detail = item.error, ""
    if reason is None:
        try:
            return _decode_seeded(s, item, slot, epoch, phase)
        except SkipSample as skip:
            reason, detail = skip.reason, str(skip).partition(": ")[2]
        except MemoryError:  # a sample too large to decode or transform here; the stream goes on
            reason = "too_large"
    skipped[reason] += 1
    records.append(skip_record(reason, item.url, item.key, member_of(reason, item.key, item.files), detail))
    return None


def role_batches(s: StreamSpec, role: int, start: Dict[str, Any], first_batch: int = 0,
                 stride: int = 1) -> Iterator[Dict[str, Any]]:
    """Infinite batches of one worker role, starting at position `start`; each carries ``__state__``. The role's
    batches are the process's batches `first_batch`, `first_batch + stride`, ... (which decides each one's phase,
    `StreamSpec.phase_at`). A transform whose output cannot be batched ends the stream with one
    ``{"__error__": message}``."""
    try:
        yield from _role_batches(s, role, start, first_batch, stride)
    except TransformOutputError as err:
        yield {"__error__": str(err)}


def _role_batches(s: StreamSpec, role: int, start: Dict[str, Any], first_batch: int,
                  stride: int) -> Iterator[Dict[str, Any]]:
    rank, n_roles = s.rank, s.n_roles
    slot, n_slots = rank * n_roles + role, s.world_size * n_roles
    epoch, shard, sample, emitted = start["epoch"], start["shard"], start["sample"], start["emitted"]
    skipped = dict(zero_skips(), **start["skipped"])
    skipped_before_epoch = dict(zero_skips(), **start.get("skipped_before_epoch", start["skipped"]))
    filling = _Filling(s, first_batch, stride)
    records: List[Dict[str, Any]] = []  # the skips since the last batch

    def sent(batch: Dict[str, Any]) -> Dict[str, Any]:
        if records:
            batch["__skips__"] = list(records)
            records.clear()
        return batch

    def state(**extra) -> Dict[str, Any]:
        return {"role": role, "epoch": epoch, "shard": shard, "sample": sample, "emitted": emitted,
                "skipped": dict(skipped), "skipped_before_epoch": dict(skipped_before_epoch), **extra}

    # After a resume on another number of processes or workers: the rest of the saved run's epochs, as tasks
    # (`resized_positions`), before this slot's own epochs begin.
    tasks = copy.deepcopy(list(start.get("leftover", ())))
    while tasks:
        task = tasks[0]
        for item, origin in _leftover_items(s, task):
            if not _in_parts(item, task["parts"]):
                continue
            decoded = _decode_or_count_skip(s, item, origin["slot"], origin["epoch"], skipped, filling.phase,
                                            records)
            if decoded is not None and filling.add(item.key, decoded, item.url):
                yield sent(filling.take(state(leftover=copy.deepcopy(tasks))))
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
                decoded = _decode_or_count_skip(s, item, slot, epoch, skipped, filling.phase, records)
                if decoded is None:
                    continue
                good_seen += 1
                if filling.add(item.key, decoded, item.url):
                    yield sent(filling.take(state()))
            emitted = 0
        if full_epoch and good_seen == 0:
            empty_epochs += 1
            problem = _empty_epoch_problem(s, rank, role, n_slots, raw_seen, skipped, plan, empty_epochs)
            if problem is not None:
                yield sent({"__error__": problem})
                return
        elif good_seen:
            empty_epochs = 0
        epoch, shard, sample, emitted = epoch + 1, 0, 0, 0
        skipped_before_epoch = dict(skipped)


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


def _decode_seeded(s: StreamSpec, item: RawSample, slot: int, epoch: int, phase: StreamPhase):
    """`decode_sample` of a raw item drawn by `slot` in `epoch`, at `phase`'s size (its augmentation and caption
    draw follow from them and the item's place, whichever process reads it)."""
    return decode_sample(item.files, phase.preprocess, s.max_pixels, phase.draft_size,
                         aug_seed=_mix(s.seed, slot, epoch, item.shard, item.index), as_uint8=s.as_uint8,
                         keys=s.keys,
                         caption_draw=caption_draw(s.seed, epoch, item.key) if s.keys is not None else 0,
                         teacher_view=s.teacher_view, stored_teacher=s.stored_teacher)


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


def resized_positions(states: Sequence[Dict[str, Any]], n_slots: int, n_roles: int = 1,
                      batch_size: Optional[int] = None) -> List[Dict[str, Any]]:
    """Positions for the `n_slots` new slots (rank * workers + worker) that continue the saved slots of
    `states` (the data states of every process of the saved run) so that every sample of the epochs under way is
    read exactly once.

    Each saved slot's remaining work (the rest of its epoch, and whole epochs where it is behind the furthest
    slot) becomes a task. With at least as many tasks as new slots, tasks are dealt whole; with fewer, each task
    is shared by ``n_slots // tasks`` new slots, each taking the samples of its share (`_in_parts`): every such
    slot reads the task's raw bytes and decodes its share only. After its tasks, each new slot starts the epoch
    after the furthest saved one in the new layout. Skip counts carry over (summed into slot 0).

    When the saved and the new processes read without data workers (one slot each), every saved slot is in the
    same epoch and the global batch stays (`batch_size` new x `n_slots` = saved batch x saved processes), the
    rest of the epoch is instead batched as the saved run would have batched it (an ``interleave`` task per new
    process, `_leftover_items`): each new process reads the raw bytes of every saved slot's rest of the epoch
    and decodes its own share, and the steps see the samples the uninterrupted run's steps would have seen (as
    long as no sample is skipped as undecodable).
    """
    saved = []  # (old slot, old n_slots, position)
    for st in states:
        lay = st["layout"]
        for role, pos in enumerate(st["positions"]):
            saved.append((lay["rank"] * lay["workers"] + role, lay["world_size"] * lay["workers"], pos))
    def started(pos):  # the last epoch of which this slot has read something
        return pos["epoch"] - ((pos["shard"], pos["sample"], pos["emitted"]) == (0, 0, 0))

    last_epoch = max(started(pos) for _, _, pos in saved)
    tasks: List[Dict[str, Any]] = []
    for slot, n_old, pos in sorted(saved, key=lambda t: t[0]):
        tasks.extend(copy.deepcopy(pos.get("leftover", [])))
        for epoch in range(pos["epoch"], last_epoch + 1):
            first = epoch == pos["epoch"]
            tasks.append({"slot": slot, "n_slots": n_old, "epoch": epoch, "shard": pos["shard"] if first else 0,
                          "sample": pos["sample"] if first else 0, "emitted": pos["emitted"] if first else 0,
                          "parts": []})
    old_batch = states[0]["layout"]["batch_size"]
    exact = (n_roles == 1 and batch_size is not None and all(st["layout"]["workers"] == 1 for st in states)
             and not any(pos.get("leftover") for _, _, pos in saved)
             and len({(pos["epoch"], started(pos)) for _, _, pos in saved}) == 1
             and all(st["layout"]["batch_size"] == old_batch for st in states)
             and old_batch * len(saved) == batch_size * n_slots and tasks)
    totals = _summed_skips(pos for _, _, pos in saved)
    out = []
    for _ in range(n_slots):
        p = _fresh_position()
        p["epoch"] = last_epoch + 1
        p["leftover"] = []
        out.append(p)
    out[0]["skipped"], out[0]["skipped_before_epoch"] = dict(totals), dict(totals)
    if exact:
        for j, p in enumerate(out):
            p["leftover"] = [{"kind": "interleave", "streams": copy.deepcopy(tasks), "per_slot": old_batch,
                              "lo": j * batch_size, "hi": (j + 1) * batch_size, "p": 0, "parts": []}]
    elif not tasks:
        pass
    elif len(tasks) >= n_slots:
        for q, task in enumerate(tasks):
            out[q % n_slots]["leftover"].append(task)
    else:
        m = n_slots // len(tasks)
        for q, task in enumerate(tasks):
            level = len(task["parts"])
            for i in range(m):
                out[q * m + i]["leftover"].append(dict(task, parts=task["parts"] + [[i, m, level]]))
    return out


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
        return f"no valid sample in any of the {n_urls} shards (skipped so far: {counts})"
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


def sample_id(url: str, key: str) -> int:
    """A sample's stable id: 63 bits of a BLAKE2b hash of its shard's URL (as ``data.train`` names it) and its key.

    The same sample gets the same id in every epoch, on any number of processes and workers, and after a resume;
    the global contrastive term keys its per-sample estimates by it (`mmcl.losses.GlobalEstimates`)."""
    digest = hashlib.blake2b(f"{url}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def collate(images: List[torch.Tensor], captions: List[str], labels: List[int], keys: List[str],
            tokenizer: Callable[[List[str]], torch.Tensor], teacher_view=None,
            teacher_images: Optional[List[torch.Tensor]] = None, context_length: Optional[int] = None
            ) -> Dict[str, Any]:
    """Stack decoded samples into a batch: image (B,3,H,W) float, text (B,L) long, label (B,) long, key list;
    with `teacher_view` (distillation) also teacher_image (B,3,Ht,Wt) uint8 and teacher_text (B,Lt) long, the
    same captions in the teacher's tokens; with stored teacher embeddings in `teacher_images` (no view),
    teacher_image_features and teacher_text_features (B, Dt) float32 and teacher_scale (B,)."""
    text = tokenizer(captions)
    if not isinstance(text, torch.Tensor):
        text = torch.as_tensor(text)
    text = cut_tokens(text, context_length)
    out = None
    if torch.utils.data.get_worker_info() is not None:
        # Stacking straight into shared memory saves the copy the DataLoader's queue would make to send it.
        out = torch.empty((len(images),) + tuple(images[0].shape), dtype=images[0].dtype).share_memory_()
    # Every tensor of a batch contiguous: a cut token batch (`TrimmedTokenizer`, `cut_tokens`) is a view with the
    # full context's row stride, which pinning and the copy to the device would otherwise carry as strided memory.
    batch = {"image": torch.stack(images, out=out), "text": text.long().contiguous(),
             "label": torch.tensor(labels, dtype=torch.long), "key": list(keys)}
    if teacher_view is not None:
        batch["teacher_image"] = torch.stack(teacher_images)
        batch["teacher_text"] = torch.as_tensor(teacher_view.tokenize(captions)).contiguous()
    elif teacher_images:  # stored (image, text, scale) per sample: distill.from_shards
        batch["teacher_image_features"] = torch.from_numpy(np.stack([t[0] for t in teacher_images]))
        batch["teacher_text_features"] = torch.from_numpy(np.stack([t[1] for t in teacher_images]))
        batch["teacher_scale"] = torch.tensor([t[2] for t in teacher_images], dtype=torch.float32)
    return batch

def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _pinned(batch: Dict[str, Any]) -> Dict[str, Any]:
    """`batch` with its tensors in page-locked memory."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

class TrainStream:
    """An infinite stream of training batches for one process (see `build_train_stream`).

    Iterating yields dicts ``image`` (B,3,H,W), ``text`` LongTensor (B,L), ``label`` LongTensor (B,) (-1 where
    a sample has no ``.cls``), ``key`` (list of B sample keys) and ``sample_id`` LongTensor (B,) (`sample_id`).
    ``image`` is what the transform gives, or, with ``data.uint8_transfer`` and a transform ending in ToTensor
    [+ Normalize], uint8 pixels: `finish_images` turns either into the float model input (call it where the
    model runs). Each new iteration continues after the last batch consumed. `skipped`, `epoch` and `state_dict`
    describe the batches consumed so far, not those prefetched by workers.
    """

    def __init__(self, cfg: DataConfig, preprocess: Union[ImageSpec, Callable], tokenizer: Callable, *, seed: int,
                 rank: int = 0, world_size: int = 1, pin_memory: bool = False, teacher_view=None,
                 stored_teacher: bool = False, phases: Sequence[Tuple[int, Optional[int], Optional[int]]] = ()):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank must be in [0, world_size) (got rank={rank}, world_size={world_size})")
        self.sources = expand_sources(cfg.train, allow_pipe=bool(cfg.allow_pipe),
                                      require_all=bool(cfg.require_all_shards))
        self.urls = [u for src in self.sources for u in src]
        weight_problems = data_weight_problems(cfg, len(self.sources))
        if weight_problems:
            raise ConfigError("; ".join(weight_problems))
        self.cfg, self.preprocess, self.tokenizer = cfg, preprocess, tokenizer
        self.keys = sample_keys(cfg)  # None for the default (first image extension, txt)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.workers = data_workers(cfg.workers)
        self.n_roles = max(1, self.workers)
        self.pin_memory = pin_memory
        self.worker_nice = int(cfg.worker_nice)
        self.teacher_view, self.stored_teacher = teacher_view, bool(stored_teacher)
        if isinstance(preprocess, ImageSpec):  # built here from the model's numbers
            self.sample_transform, finish, self.draft_size = self._stages(preprocess)
        else:  # a transform of the caller's: split where its shape allows
            self.draft_size = draft_size_of(preprocess) if cfg.fast_decode else None
            sample_transform = training_sample_transform(preprocess)
            self.sample_transform, finish = (split_transform(sample_transform) if cfg.uint8_transfer
                                             else (sample_transform, None))
        if teacher_view is not None:
            # The teacher's view comes from the same decoded image, at its own size: no reduced JPEG draft.
            self.draft_size = None
        self.uint8 = finish is not None
        self.finish_images: Callable[[torch.Tensor], torch.Tensor] = finish if finish is not None else _identity
        self.phases = tuple(self._phase(start, size, length) for start, size, length in phases)
        self._positions = [_fresh_position() for _ in range(self.n_roles)]
        self._next_role = 0
        self.batches = 0
        self._warned: Dict[Any, Any] = {}  # the workers' warnings already shown (a `warnings` registry)
        self.skip_log = None  # a `mmcl.data.skips.SkipLog`: each skip of the batches consumed is written there
        slots = self.world_size * self.n_roles
        leftover = len(self.urls) % slots if not cfg.resampled else 0
        if leftover and rank == 0 and any(has_scheme(u) for u in self.urls):
            # Local shards are skipped through by seeking; remote ones are downloaded in full by every slot.
            warnings.warn(f"{leftover} of {len(self.urls)} shards do not divide among the {slots} rank x worker "
                          f"slots and are read by every slot (each keeping 1/{slots} of their samples); with "
                          f"remote shards use a multiple of {slots} shards or data.resampled=true")

    def _stages(self, spec: ImageSpec) -> Tuple[Callable, Optional[Callable], Optional[Tuple[int, int]]]:
        """The training transform of image input `spec`: (the workers' part, the part run where the model runs
        or None, the JPEG draft size)."""
        draft = train_draft_size(spec) if self.cfg.fast_decode and self.teacher_view is None else None
        sample_transform, finish = train_image_stages(spec)
        if not self.cfg.uint8_transfer:
            from torchvision import transforms as T

            sample_transform = T.Compose([*sample_transform.transforms, T.ToTensor(), T.Normalize(spec.mean,
                                                                                                  spec.std)])
            finish = None
        return sample_transform, finish, draft

    def _phase(self, start: int, image_size: Optional[int], context_length: Optional[int]) -> StreamPhase:
        """The `StreamPhase` from process batch `start` on: images at `image_size` (None: the model's own) and
        captions cut to `context_length` tokens (None: as the tokenizer gives them)."""
        if image_size is None:
            return StreamPhase(start, self.sample_transform, self.draft_size, context_length)
        if not isinstance(self.preprocess, ImageSpec):
            raise ConfigError("train.phases with an image_size needs the stream to build the training transform "
                              "from the model's image numbers (an ImageSpec), not a transform of its own")
        sample_transform, _, draft = self._stages(dataclasses.replace(self.preprocess, size=int(image_size)))
        return StreamPhase(start, sample_transform, draft, context_length)

    def _spec(self) -> StreamSpec:
        return StreamSpec(
            sources=self.sources, seed=self.seed, rank=self.rank, world_size=self.world_size, n_roles=self.n_roles,
            resampled=bool(self.cfg.resampled), weights=None if self.cfg.weights is None else list(self.cfg.weights),
            shuffle_buffer=int(self.cfg.shuffle_buffer), batch_size=int(self.cfg.batch_size),
            max_pixels=int(self.cfg.max_image_pixels), draft_size=self.draft_size, preprocess=self.sample_transform,
            as_uint8=self.uint8, tokenizer=self.tokenizer, worker_nice=self.worker_nice, keys=self.keys,
            teacher_view=self.teacher_view, stored_teacher=self.stored_teacher, retries=int(self.cfg.retries),
            retry_delay=float(self.cfg.retry_delay), read_timeout=float(self.cfg.read_timeout),
            members=needed_members(self.keys, self.stored_teacher), max_member_bytes=int(self.cfg.max_member_bytes),
            phases=self.phases)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        starts = [_copy_position(p) for p in self._positions]
        if self.workers == 0:
            source: Iterable = role_batches(self._spec(), 0, starts[0], self.batches, 1)
            if self.pin_memory:  # what the DataLoader's pinning thread does for batches made in workers
                source = map(_pinned, source)
        else:
            # Workers deliver batches round-robin starting at worker 0; shifting roles by the next expected
            # role makes a new loader continue the exact batch order of the previous one.
            source = torch.utils.data.DataLoader(
                _SlotStreams(self, starts, self._next_role), batch_size=None, num_workers=self.workers,
                pin_memory=self.pin_memory)
        for batch in source:
            for message, category, filename, lineno in batch.pop("__warnings__", ()):
                warnings.warn_explicit(message, category, filename, lineno, registry=self._warned)
            for rec in batch.pop("__skips__", ()):
                if self.skip_log is not None:
                    self.skip_log.write(rec)
            if "__error__" in batch:
                raise DataError(batch["__error__"])
            state = batch.pop("__state__")
            role = state.pop("role")
            self._positions[role] = state
            self._next_role = (role + 1) % self.n_roles
            self.batches += 1
            yield batch

    @property
    def skipped(self) -> Dict[str, int]:
        """Running totals of skipped samples of this process: ``total`` and one count per reason."""
        out = _summed_skips(self._positions)
        out["total"] = sum(out.values())
        return out

    @property
    def skipped_units(self) -> Dict[str, int]:
        """This process's skips by unit (`skip_units`): ``samples`` and ``shards``."""
        return skip_units(self.skipped)

    @property
    def epoch(self) -> int:
        """The lowest epoch any worker of this process is in (data passes completed by all workers)."""
        return min(p["epoch"] for p in self._positions)

    def _layout(self) -> Dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "workers": self.n_roles, "seed": self.seed,
                "n_shards": len(self.urls), "batch_size": int(self.cfg.batch_size),
                "shuffle_buffer": int(self.cfg.shuffle_buffer), "resampled": bool(self.cfg.resampled),
                "shard_split": _shard_split(len(self.urls), self.world_size * self.n_roles,
                                           bool(self.cfg.resampled))}

    def state_dict(self) -> Dict[str, Any]:
        """The position after the last consumed batch (per worker: epoch, shard, sample, skips); plain types."""
        return {"version": _STATE_VERSION, "layout": self._layout(), "next_role": self._next_role,
                "batches": self.batches, "positions": [_copy_position(p) for p in self._positions]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state`. With the same data, seed and layout the next batches equal those an
        uninterrupted stream would yield; after a layout change (workers, ranks, batch size, shards) the
        stream restarts the earliest saved epoch and warns, since exact continuation is then impossible.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise DataError(f"unrecognised data stream state (got version {got}, expected {_STATE_VERSION})")
        layout = self._layout()
        saved = dict({"shard_split": "whole"}, **state["layout"])
        if saved != layout:
            changed = sorted(k for k in layout if saved.get(k) != layout[k])
            warnings.warn("data stream layout changed since the checkpoint (" + ", ".join(
                f"{k}: {saved.get(k)} -> {layout[k]}" for k in changed) +
                "); restarting the earliest saved epoch, exact data order is not preserved")
            epoch = min(p["epoch"] for p in state["positions"])
            totals = _summed_skips(state["positions"])
            self._positions = [_fresh_position() for _ in range(self.n_roles)]
            for p in self._positions:
                p["epoch"] = epoch
            self._positions[0]["skipped"] = totals
            self._positions[0]["skipped_before_epoch"] = dict(totals)
            self._next_role = 0
        else:
            self._positions = [_copy_position(p) for p in state["positions"]]
            self._next_role = int(state["next_role"])
        self.batches = int(state.get("batches", 0))

    def load_resized(self, states: Sequence[Dict[str, Any]]) -> Optional[str]:
        """Continue from the data states of every process of a run saved with another number of processes or
        workers (`resized_positions`): every sample of the epochs under way is read exactly once. Returns None,
        or why only a restart of the earliest saved epoch is possible (the shards, seed or shuffle differ)."""
        for st in states:
            if not isinstance(st, dict) or st.get("version") != _STATE_VERSION:
                raise DataError(f"unrecognised data stream state (expected version {_STATE_VERSION})")
        ranks = sorted(st["layout"]["rank"] for st in states)
        if ranks != list(range(states[0]["layout"]["world_size"])):
            raise DataError(f"the data states of ranks {ranks} do not make a whole run")
        fixed = ("seed", "n_shards", "shuffle_buffer", "resampled")
        layout = self._layout()
        changed = [k for k in fixed if states[0]["layout"].get(k) != layout[k]]
        saved_slots = states[0]["layout"]["world_size"] * states[0]["layout"]["workers"]
        if changed or (states[0]["layout"].get("shard_split", "whole")
                       != _shard_split(len(self.urls), saved_slots, bool(self.cfg.resampled))):
            # Not the same shard plan: exact continuation is impossible; restart the earliest saved epoch.
            self.load_state_dict(dict(states[0], layout=dict(states[0]["layout"], **{
                k: None for k in changed or ["world_size"]})))
            return "data differ from the checkpoint's (" + ", ".join(changed or ["shard split"]) + ")"
        positions = resized_positions(states, self.world_size * self.n_roles, self.n_roles, int(self.cfg.batch_size))
        self._positions = positions[self.rank * self.n_roles:(self.rank + 1) * self.n_roles]
        self._next_role = 0
        self.batches = 0
        return None


def build_train_stream(cfg: DataConfig, preprocess: Union[ImageSpec, Callable], tokenizer: Callable, *, seed: int,
                       rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                       teacher_view=None, stored_teacher: bool = False,
                       phases: Sequence[Tuple[int, Optional[int], Optional[int]]] = ()) -> TrainStream:
    """Build this process's infinite training stream from ``cfg.train``.

    Args:
        cfg: data config (train spec, batch_size per process, workers, shuffle_buffer, resampled, weights,
            max_image_pixels, fast_decode).
        preprocess: an `ImageSpec` (the model's image numbers; the stream builds the training transform,
            `train_image_stages`), or any PIL.Image -> FloatTensor (3, H, W) transform (with
            ``cfg.uint8_transfer`` the ToTensor/Normalize tail of a torchvision Compose runs in
            `TrainStream.finish_images` instead).
        tokenizer: list[str] (B) -> LongTensor (B, L).
        seed: base seed; shard order, shuffling and augmentation derive from (seed, rank, worker, epoch).
        rank, world_size: this process's place among data-parallel processes.
        pin_memory: page-locked batches (for a GPU).
        teacher_view: a `mmcl.training.teacher.TeacherView` (distillation): batches also carry ``teacher_image`` and
            ``teacher_text``, the teacher's view of the un-augmented image and of the same caption.
        stored_teacher: batches carry the teacher embeddings `mmcl reinforce` stored in the shards
            (``teacher_image_features``, ``teacher_text_features``, ``teacher_scale``); samples without them
            are skipped and counted (``no_teacher_features``).
        phases: token-reduction phases (``train.phases``), as (first process batch, image size or None,
            context length or None) in order: the batches from each start on are made at that size in the workers,
            captions cut to that many tokens (`StreamPhase`). The process batch of a step is step * accum_steps.
    Raises:
        DataError when the spec matches no shards (and, when iterated, when no valid sample exists).
    """
    return TrainStream(cfg, preprocess, tokenizer, seed=seed, rank=rank, world_size=world_size,
                       pin_memory=pin_memory, teacher_view=teacher_view, stored_teacher=stored_teacher,
                       phases=phases)
