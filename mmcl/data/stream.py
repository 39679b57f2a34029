"""The training stream in the training process: `TrainStream` gathers the batches of its worker roles (in
DataLoader workers, or inline without them), keeps each role's position for a saved state, and resumes from one.

Data workers outlive a stop signal sent to the whole process group (`WORKER_STOP_GRACE_S`) and send their
warnings to the training process with their batches, which shows each once.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torchvision import transforms as T

from ..config import DataConfig, data_weight_problems, data_workers
from ..errors import ConfigError, DataError
from .batching import WorkerOutput, role_batches
from .decode import needed_members, sample_keys
from .device_decode import DeviceFinish, device_decode_problem
from .limits import MAX_NEGATIVES
from .naflex import PatchNormalizer
from .pipeline import (
    InputSizes,
    StreamSpec,
    copy_position,
    fresh_position,
    resized_positions,
    shard_split,
    skip_units,
    summed_caption_counts,
    summed_skips,
)
from .sources import expand_sources, has_scheme
from .transforms import (
    ImageSpec,
    draft_size_of,
    split_transform,
    train_draft_size,
    train_image_stages,
    training_sample_transform,
)

_STATE_VERSION = 1

# How long a data worker goes on serving after a stop signal meant for the whole process group: time for the
# training process to finish its step and save (a scheduler's SIGKILL ends everything later anyway).
WORKER_STOP_GRACE_S = 60.0

# Above this share of a logging window's time spent waiting for the next batch, a run says (once) that its loader is
# what limits it.
WAIT_WARN_SHARE = 0.25


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
        self.first_batch = stream.batches  # the process batch the loader delivers first (input sizes follow it)

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
            for out in role_batches(self.s, role, self.starts[role], first, n_roles):
                new = [w for w in caught if (str(w.message), w.category) not in sent]
                del caught[:]
                if new:
                    sent.update((str(w.message), w.category) for w in new)
                    out = dataclasses.replace(out, warnings=tuple(
                        (str(w.message), _picklable_category(w.category), w.filename, w.lineno) for w in new))
                yield out


def _picklable_category(category: type) -> type:
    """`category`, or UserWarning for a warning class that cannot travel between processes."""

    try:
        pickle.dumps(category)
        return category
    except Exception:  # e.g. a class defined inside a function
        return UserWarning


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class TrainStream:
    """An infinite stream of training batches for one process (see `build_train_stream`).

    Iterating yields dicts ``image`` (B,3,H,W), ``text`` LongTensor (B,L), ``label`` LongTensor (B,) (-1 where
    a sample has no ``.cls``), ``key`` (list of B sample keys) and ``sample_id`` LongTensor (B,) (`pipeline.sample_id`).
    ``image`` is what the transform gives, or, with ``data.uint8_transfer`` and a transform ending in ToTensor
    [+ Normalize], uint8 pixels: `finish_images` turns either into the float model input (call it where the
    model runs). Each new iteration continues after the last batch consumed. `skipped`, `epoch` and `state_dict`
    describe the batches consumed so far, not those prefetched by workers. With ``data.negatives`` = K > 0 a batch
    also holds ``negatives_valid`` (B, K) bool and ``negatives`` (R, L) long, the R negative captions the samples
    brought (`mmcl.data.batching.collate`).
    """

    def __init__(self, cfg: DataConfig, preprocess: Union[ImageSpec, Callable], tokenizer: Callable, *, seed: int,
                 rank: int = 0, world_size: int = 1, pin_memory: bool = False, teacher_view=None,
                 stored_teacher: bool = False, sizes: Sequence[Tuple[int, Optional[int], Optional[int]]] = (),
                 naflex=None, short_captions: bool = False, caption_parallel: float = 0.0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank must be in [0, world_size) (got rank={rank}, world_size={world_size})")
        self.negatives = int(cfg.negatives)  # the most negative captions per sample in a batch (0: none read)
        if not 0 <= self.negatives <= MAX_NEGATIVES:
            raise ConfigError(f"data.negatives must be in [0, {MAX_NEGATIVES}] (got {self.negatives}): each one is "
                              "a caption more through the text tower per sample")
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
        self.sizes = tuple(self._input_sizes(start, size, length) for start, size, length in sizes)
        self.naflex = naflex
        self.short_captions = bool(short_captions)
        self.caption_parallel = float(caption_parallel)
        if naflex is not None:  # uint8 images at each batch's length, patchified in the worker, normalised here
            if not isinstance(preprocess, ImageSpec):
                raise ConfigError("data.naflex needs the stream to take the model's image numbers (an ImageSpec)")

            self.uint8, self.draft_size = True, None
            self.finish_images = PatchNormalizer(preprocess.mean, preprocess.std)
        # data.decode=device: the `ImageSpec` whose crop the workers draw, where it can be in effect (`decode_line`)
        self.device_decode: Optional[ImageSpec] = None
        self.decode_problem = None if cfg.decode != "device" else device_decode_problem(
            preprocess, teacher_view, naflex, sizes, stored_teacher) or (
            None if self.uint8 else "data.uint8_transfer=false finishes the images in the workers") or (
            "data.negatives reads each sample's negative captions in the workers' decode" if self.negatives else None)
        if cfg.decode == "device" and self.decode_problem is None:
            self.device_decode = preprocess
            self.finish_images = DeviceFinish(preprocess)
        self._positions = [fresh_position() for _ in range(self.n_roles)]
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

    @property
    def decode_line(self) -> str:
        """Where this stream's images are decoded, and why, for the start of a run."""
        if self.device_decode is not None:
            return ("images decoded on the training device (data.decode=device): the data workers read, check and "
                    "draw each crop; JPEGs are decoded, cropped and resized where the model runs, other formats in "
                    "the workers")
        if self.cfg.decode == "device":
            return f"images decoded in the data workers: data.decode=device is not in effect ({self.decode_problem})"
        return "images decoded in the data workers (data.decode=worker)"

    def wait_advice(self, share: float, steps: str) -> str:
        """The warning for a run that waited for data `share` of the time of `steps` (words): the knob that helps."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return (f"warning: training waited for data {share:.0%} of the time over {steps} (more than "
                f"{WAIT_WARN_SHARE:.0%}): the loader limits this run; give it more workers (data.workers, now "
                f"{self.workers} per process; this process may use {cpus} CPUs) or more CPUs per process"
                + ("" if self.device_decode is not None or self.cfg.decode == "device" else
                   ", or decode on the device (data.decode=device)"))

    def _stages(self, spec: ImageSpec) -> Tuple[Callable, Optional[Callable], Optional[Tuple[int, int]]]:
        """The training transform of image input `spec`: (the workers' part, the part run where the model runs
        or None, the JPEG draft size)."""
        draft = train_draft_size(spec) if self.cfg.fast_decode and self.teacher_view is None else None
        sample_transform, finish = train_image_stages(spec)
        if not self.cfg.uint8_transfer:

            sample_transform = T.Compose([*sample_transform.transforms, T.ToTensor(), T.Normalize(spec.mean,
                                                                                                  spec.std)])
            finish = None
        return sample_transform, finish, draft

    def _input_sizes(self, start: int, image_size: Optional[int], context_length: Optional[int]) -> InputSizes:
        """The `InputSizes` from process batch `start` on: images at `image_size` (None: the model's own) and
        captions cut to `context_length` tokens (None: as the tokenizer gives them)."""
        if image_size is None:
            return InputSizes(start, self.sample_transform, self.draft_size, context_length)
        if not isinstance(self.preprocess, ImageSpec):
            raise ConfigError("train.phases with an image_size needs the stream to build the training transform "
                              "from the model's image numbers (an ImageSpec), not a transform of its own")
        sample_transform, _, draft = self._stages(dataclasses.replace(self.preprocess, size=int(image_size)))
        return InputSizes(start, sample_transform, draft, context_length)

    def _spec(self) -> StreamSpec:
        return StreamSpec(
            sources=self.sources, seed=self.seed, rank=self.rank, world_size=self.world_size, n_roles=self.n_roles,
            resampled=bool(self.cfg.resampled), weights=None if self.cfg.weights is None else list(self.cfg.weights),
            shuffle_buffer=int(self.cfg.shuffle_buffer), batch_size=int(self.cfg.batch_size),
            max_pixels=int(self.cfg.max_image_pixels), draft_size=self.draft_size, preprocess=self.sample_transform,
            as_uint8=self.uint8, tokenizer=self.tokenizer, worker_nice=self.worker_nice, keys=self.keys,
            teacher_view=self.teacher_view, stored_teacher=self.stored_teacher, retries=int(self.cfg.retries),
            retry_delay=float(self.cfg.retry_delay), read_timeout=float(self.cfg.read_timeout),
            members=needed_members(self.keys, self.stored_teacher, negatives=self.negatives > 0),
            max_member_bytes=int(self.cfg.max_member_bytes), sizes=self.sizes, naflex=self.naflex,
            negatives=self.negatives, device_decode=self.device_decode, short_captions=self.short_captions,
            caption_parallel=self.caption_parallel)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        starts = [copy_position(p) for p in self._positions]
        if self.workers == 0:
            source: Iterable[WorkerOutput] = role_batches(self._spec(), 0, starts[0], self.batches, 1)
            if self.pin_memory:  # what the DataLoader's pinning thread does for batches made in workers
                source = map(WorkerOutput.pin_memory, source)
        else:
            # Workers deliver batches round-robin starting at worker 0; shifting roles by the next expected
            # role makes a new loader continue the exact batch order of the previous one.
            source = torch.utils.data.DataLoader(
                _SlotStreams(self, starts, self._next_role), batch_size=None, num_workers=self.workers,
                pin_memory=self.pin_memory)
        for out in source:
            for message, category, filename, lineno in out.warnings:
                warnings.warn_explicit(message, category, filename, lineno, registry=self._warned)
            for rec in out.skips:
                if self.skip_log is not None:
                    self.skip_log.write(rec)
            if out.error is not None:
                raise DataError(out.error)
            self._positions[out.role] = out.state
            self._next_role = (out.role + 1) % self.n_roles
            self.batches += 1
            yield out.batch

    @property
    def skipped(self) -> Dict[str, int]:
        """Running totals of skipped samples of this process: ``total`` and one count per reason."""
        out = summed_skips(self._positions)
        out["total"] = sum(out.values())
        return out

    @property
    def caption_counts(self) -> Dict[str, int]:
        """This process's batched captions so far, ``captions``, and of them ``cut_captions``: those longer than the
        text context, which the tokenizer cut (`mmcl.data.batching.tokenize_counting_cut`)."""
        return summed_caption_counts(self._positions)

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
                "shard_split": shard_split(len(self.urls), self.world_size * self.n_roles,
                                           bool(self.cfg.resampled))}

    def state_dict(self) -> Dict[str, Any]:
        """The position after the last consumed batch (per worker: epoch, shard, sample, skips); plain types."""
        return {"version": _STATE_VERSION, "layout": self._layout(), "next_role": self._next_role,
                "batches": self.batches, "positions": [copy_position(p) for p in self._positions]}

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
            totals = summed_skips(state["positions"])
            captions = summed_caption_counts(state["positions"])
            self._positions = [fresh_position() for _ in range(self.n_roles)]
            for p in self._positions:
                p["epoch"] = epoch
            self._positions[0]["skipped"] = totals
            self._positions[0]["skipped_before_epoch"] = dict(totals)
            self._positions[0].update(captions)
            self._next_role = 0
        else:
            self._positions = [copy_position(p) for p in state["positions"]]
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
                       != shard_split(len(self.urls), saved_slots, bool(self.cfg.resampled))):
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
                       sizes: Sequence[Tuple[int, Optional[int], Optional[int]]] = (),
                       naflex=None, short_captions: bool = False, caption_parallel: float = 0.0) -> TrainStream:
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
        teacher_view: a `mmcl.evaluation.teacher.TeacherView` (distillation): batches also carry ``teacher_image`` and
            ``teacher_text``, the teacher's view of the un-augmented image and of the same caption.
        stored_teacher: batches carry the teacher embeddings `mmcl reinforce` stored in the shards
            (``teacher_image_features``, ``teacher_text_features``, ``teacher_scale``); samples without them
            are skipped and counted (``no_teacher_features``).
        sizes: the input sizes of the token-reduction phases (``train.phases``), as (first process batch, image
            size or None, context length or None) in order: the batches from each start on are made at that size in the
            workers, captions cut to that many tokens (`InputSizes`). The process batch of a step is step * accum_steps.
        naflex: a `mmcl.data.naflex.NaflexPlan` (``data.naflex``): each batch at its drawn sequence length, as many
            pairs as its token budget holds; the batches carry ``patches`` (uint8), ``patch_coord`` and
            ``patch_valid`` instead of ``image``, and `TrainStream.finish_images` normalises the patch dict.
        short_captions: batches also carry ``short_text`` (B, L), each caption's first sentence
            (`mmcl.data.batching.short_caption`), for Long-CLIP's short-caption term.
        caption_parallel: the share of samples whose batches mark them ``caption_parallel`` (B,) bool, drawn per
            sample and epoch (`mmcl.data.batching.parallel_draw`): the decoder predicts their captions in parallel.
    Raises:
        DataError when the spec matches no shards (and, when iterated, when no valid sample exists).
    """
    return TrainStream(cfg, preprocess, tokenizer, seed=seed, rank=rank, world_size=world_size,
                       pin_memory=pin_memory, teacher_view=teacher_view, stored_teacher=stored_teacher,
                       sizes=sizes, naflex=naflex, short_captions=short_captions,
                       caption_parallel=caption_parallel)
