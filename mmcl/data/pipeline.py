"""The resumable training stream's plan: its settings, which shards each slot reads, the block shuffle, positions.

The stream is one stage per function, chained by `mmcl.data.batching.role_batches` in each data worker and
gathered by `mmcl.data.stream.TrainStream` in the training process::

    expand_sources        spec -> shard URLs per '::'-separated source               (sources.py)
    epoch_shard_plan      (seed, epoch, slot) -> this slot's shards, in this epoch's order
    read_raw_samples      shards -> raw samples (bytes per extension), position after each   (reading.py)
    shuffle_block         blocks of `shuffle_buffer` raw samples -> a permutation from a seeded RNG
    decode_sample         raw sample -> (image tensor, caption, label) or a skip reason      (decode.py)
    collate               samples -> batch dict, captions tokenized                          (batching.py)
    patch_batch           NaFlex: images -> patches padded to the batch's length            (naflex.py)

A *slot* is one (rank, worker) pair: ``slot = rank * workers + worker``. Each slot reads a disjoint set
of whole shards per epoch, the same number for every slot; the shards left over (all of them when there are
fewer shards than slots) are read by every slot, each taking the samples whose index is its slot modulo the
number of slots. Each sample is so seen once per epoch across all ranks and workers, and every slot gets an
equal share.

Shuffling permutes fixed blocks rather than sampling from a rolling buffer, so a worker's position is
three numbers: the epoch, where its current block starts (shard ordinal, sample index) and how many
samples of the block it has emitted. Resuming re-reads that one block from its start (tar headers only
for what comes before it) and drops the emitted part before decoding; nothing else is replayed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .decode import zero_skips
from .naflex import SeqResize


@dataclasses.dataclass(frozen=True)
class InputSizes:
    """The input sizes the batches from process batch `start` on are made at, until the next sizes start (a phase
    of `train.phases`): the image transform of that image size (and the JPEG draft size it allows), and the
    caption length in tokens."""

    start: int  # the first process batch (the phase's first step times train.accum_steps)
    preprocess: Callable  # PIL image -> what the batch stacks
    draft_size: Optional[Tuple[int, int]]
    context_length: Optional[int] = None  # captions cut to this many tokens (end-of-text kept); None: as tokenized


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to make its batches; built once per iteration by `mmcl.data.stream.TrainStream`
    and copied into each data worker (plain values and picklable callables)."""

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
    preprocess: Callable  # the model's own training transform (`sizes` may replace it, `sizes_at`)
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
    sizes: Tuple[InputSizes, ...] = ()  # by start; none: every batch at the model's own sizes
    naflex: Any = None  # a `mmcl.data.naflex.NaflexPlan`: each batch's sequence length and pairs; None: fixed size
    negatives: int = 0  # data.negatives: the most negative captions a sample brings to its batch (0: none read)
    device_decode: Any = None  # data.decode=device in effect: the `ImageSpec` whose crop the workers draw
    short_captions: bool = False  # batches carry short_text, each caption's first sentence (loss.short_caption)
    caption_parallel: float = 0.0  # the share of captions the decoder predicts in parallel (loss.caption_parallel)

    def sizes_at(self, batch: int) -> InputSizes:
        """The input sizes of process batch `batch` (0-based, counted from the start of the run)."""
        if self.naflex is not None:  # the images resized to fit the batch's drawn sequence length

            return InputSizes(batch, SeqResize(self.naflex.seq_len_at(batch), self.naflex.patch_size), None)
        current = InputSizes(0, self.preprocess, self.draft_size)
        for sizes in self.sizes:
            if sizes.start > batch:
                break
            current = sizes
        return current


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

def shard_split(n_shards: int, n_slots: int, resampled: bool) -> str:
    """How `epoch_shard_plan` deals `n_shards` among `n_slots`, as a saved state records it: "balanced" where the
    shards that do not divide evenly among the slots are split by sample index (states saved before that rule,
    which dealt them whole, lack the key), "whole" where both rules give the same plan."""
    return "whole" if resampled or n_shards < n_slots or n_shards % n_slots == 0 else "balanced"

# The captions a slot has batched, and of them those longer than the text context (cut by the tokenizer): counters
# of a position, like its skips (states saved before them lack them: 0).
CAPTION_COUNTS = ("captions", "cut_captions")


def summed_caption_counts(positions: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """`CAPTION_COUNTS` summed over `positions`."""
    return {k: sum(int(p.get(k, 0)) for p in positions) for k in CAPTION_COUNTS}


def fresh_position() -> Dict[str, Any]:
    """A slot's position at the start of the stream: epoch 0, nothing read, nothing skipped."""
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


def summed_skips(positions: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """The skip counts of `positions` summed per reason (every reason present, zero where none)."""
    totals = zero_skips()
    for p in positions:
        for reason, n in p["skipped"].items():
            totals[reason] = totals.get(reason, 0) + n
    return totals

def copy_position(p: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of position `p` that shares nothing with it (a state saved before ``skipped_before_epoch`` existed
    gets it, equal to ``skipped``)."""
    before = p.get("skipped_before_epoch", p["skipped"])
    out = dict(p, skipped=dict(p["skipped"]), skipped_before_epoch=dict(before))
    if "leftover" in p:
        out["leftover"] = copy.deepcopy(p["leftover"])
    return out


def shuffle_block(n: int, seed: int, slot: int, epoch: int, start: Tuple[int, int]) -> np.ndarray:
    """The order (int64 (n,), a permutation) in which a block of n raw samples is emitted.

    Seeded by the block's identity (seed, slot, epoch, start position), so a resumed stream that re-reads
    the block from `start` emits it in the same order.
    """
    return np.random.default_rng([seed & 0xFFFFFFFF, slot, epoch, start[0], start[1], 2]).permutation(n)


def resized_positions(states: Sequence[Dict[str, Any]], n_slots: int, n_roles: int = 1,
                      batch_size: Optional[int] = None) -> List[Dict[str, Any]]:
    """Positions for the `n_slots` new slots (rank * workers + worker) that continue the saved slots of
    `states` (the data states of every process of the saved run) so that every sample of the epochs under way is
    read exactly once.

    Each saved slot's remaining work (the rest of its epoch, and whole epochs where it is behind the furthest
    slot) becomes a task. With at least as many tasks as new slots, tasks are dealt whole; with fewer, each task
    is shared by ``n_slots // tasks`` new slots, each taking the samples of its share (batching.py's `_in_parts`):
    every such slot reads the task's raw bytes and decodes its share only. After its tasks, each new slot starts
    the epoch after the furthest saved one in the new layout. Skip counts carry over (summed into slot 0).

    When the saved and the new processes read without data workers (one slot each), every saved slot is in the
    same epoch and the global batch stays (`batch_size` new x `n_slots` = saved batch x saved processes), the
    rest of the epoch is instead batched as the saved run would have batched it (an ``interleave`` task per new
    process, batching.py's `_leftover_items`): each new process reads the raw bytes of every saved slot's rest of
    the epoch and decodes its own share, and the steps see the samples the uninterrupted run's steps would have
    seen (as long as no sample is skipped as undecodable).
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
    totals = summed_skips(pos for _, _, pos in saved)
    captions = summed_caption_counts(pos for _, _, pos in saved)
    out = []
    for _ in range(n_slots):
        p = fresh_position()
        p["epoch"] = last_epoch + 1
        p["leftover"] = []
        out.append(p)
    out[0]["skipped"], out[0]["skipped_before_epoch"] = dict(totals), dict(totals)
    out[0].update(captions)
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



def sample_id(url: str, key: str) -> int:
    """A sample's stable id: 63 bits of a BLAKE2b hash of its shard's URL (as ``data.train`` names it) and its key.

    The same sample gets the same id in every epoch, on any number of processes and workers, and after a resume;
    the global contrastive term keys its per-sample estimates by it (`mmcl.losses.GlobalEstimates`)."""
    digest = hashlib.blake2b(f"{url}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


