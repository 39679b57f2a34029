"""Resuming a run on another number of processes than the one its checkpoint was written with.

Before the data stream is built, `keep_global_batch` sets ``data.batch_size`` (and, when it must, ``train.accum_steps``)
so that the global batch stays what it was: the schedule, ``train.samples`` and the number of steps then stay as
they were. `load_resized` loads the checkpoint on the new processes: the weights and optimiser state (the same
on every process), the loss's state (its queues hold features gathered over all processes, so they are the same
on every process) and the data positions of every saved process, from which the stream continues so that every
sample of the epochs under way is read exactly once (`mmcl.data.pipeline.resized_positions`).

The batches: without data workers (one slot per process, before and after) the rest of the epoch is batched
as the saved run would have batched it, so the resumed run ends with the uninterrupted run's weights within
float32 noise; each new process then reads the raw bytes of the whole rest of that epoch. With data workers the
rest is dealt by shard or shared by sample: each sample once, other batches.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

from . import checkpoints
from .config import freeze
from .errors import CheckpointError, ConfigError

GLOBAL_BATCH = "global_batch"  # recorded in each checkpoint's COMPLETE marker


def _saved_global_batch(out_dir: Path, marker: Dict[str, Any]) -> Optional[int]:
    if marker.get(GLOBAL_BATCH):
        return int(marker[GLOBAL_BATCH])
    saved = out_dir / "config.yaml"  # checkpoints written before the marker recorded it
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(OmegaConf.load(saved))
    return int(c["data"]["batch_size"]) * int(marker["world_size"]) * int(c["train"].get("accum_steps", 1))


def keep_global_batch(cfg, processes: int) -> Tuple[Any, Optional[str]]:
    """When the newest checkpoint under ``cfg.train.output_dir`` was written by another number of processes:
    (a copy of `cfg` whose per-process batch keeps the global batch, the one line that says what was adjusted);
    else (`cfg`, None). ConfigError when no per-process batch gives that global batch."""
    out_dir = Path(cfg.train.output_dir)
    ckpt = checkpoints.latest_checkpoint(out_dir / checkpoints.CHECKPOINTS_DIR)
    if ckpt is None:
        return cfg, None
    try:
        marker = checkpoints.read_marker(ckpt)
    except (ValueError, OSError):
        return cfg, None  # resume sets it aside as damaged, or refuses, with its own line
    saved = int(marker.get("world_size", processes))
    if saved == processes:
        return cfg, None
    total = _saved_global_batch(out_dir, marker)
    if total is None:
        return cfg, None
    accum = cfg.train.accum_steps
    before = (cfg.data.batch_size, accum)
    if total % (processes * accum) != 0:
        accum = 1
    if total % processes != 0:
        raise ConfigError(f"cannot resume {ckpt} on {processes} processes: its global batch of {total} samples "
                          f"does not divide among them (it was written by {saved}); use a number of processes "
                          f"that divides {total}")
    cfg = freeze(replace(cfg, data=replace(cfg.data, batch_size=total // (processes * accum)),
                         train=replace(cfg.train, accum_steps=accum)))
    what = f"data.batch_size {before[0]} -> {cfg.data.batch_size} per process"
    if accum != before[1]:
        what += f", train.accum_steps {before[1]} -> {accum}"
    return cfg, (f"resuming on {processes} process(es) a checkpoint written by {saved}: {what}, keeping the global "
            f"batch of {total}")


def load_resized(run, resume: Path, saved_processes: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Load `resume`, written by `saved_processes` processes, into `run` on this process (another count).

    Returns (the rank state this process continues from, rank 0's), for the progress and EMA they hold. Every
    rank state is read as plain data onto the CPU (`checkpoints.load_plain`): they were written on other
    processes' devices, which this process must not touch (or may not have)."""
    accelerator = run.accelerator
    files = [checkpoints.rank_state_file(resume, i) for i in range(saved_processes)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"cannot resume from {resume}: {', '.join(missing)} missing")
    # Weights, optimiser and progress are the same on every process; the RNG states of processes beyond the
    # saved ones do not exist and are left as seeded.
    states = [checkpoints.load_plain(f, "cpu") for f in files]
    checkpoints.load_accelerate_state(accelerator, resume)
    why = run.stream.load_resized([st["data"] for st in states])
    if why is not None:
        run.log(f"warning: {why}; restarting the earliest saved epoch, each sample is not seen exactly once")
    own = states[accelerator.process_index] if accelerator.process_index < saved_processes else states[0]
    run.objective.load_state_dict(own["objective"])
    return own, states[0]


def processes_from_environment() -> int:
    """The number of processes of this launch, known before accelerate starts (``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
