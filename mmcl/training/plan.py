"""What a training run is run on, settled once before anything is built: the processes, the batch, the run's length
and the precision (`Runtime`, frozen), and the accelerator made for it.

The per-process batch is the config's unless a checkpoint of this run was written by another number of processes:
then `batch_plan` keeps the run's global batch (``data.batch_size`` and, where it must, ``train.accum_steps``
change, and one line says so). The config itself is never rewritten; everything that needs the batch reads it here.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, is_initialized
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

from ..config import PRECISION_OF, PRECISIONS, DataConfig, TrainSection, to_dict, world
from ..data.sizes import shard_samples
from ..errors import ConfigError
from ..run import folder as runfolder
from ..run import records as tracking
from ..storage import checkpoints


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The per-process batch and micro-batches a run trains with, and the line that says why they differ from the
    config's (None when they do not)."""

    batch_size: int
    accum_steps: int
    line: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The world a run trains in, derived once (`Runtime.plan`) and never changed."""

    processes: int
    batch_size: int  # per process and micro-batch
    accum_steps: int
    total_steps: int
    length_line: str  # how the steps were found
    resized_line: Optional[str] = None  # a resumed run's batch kept on another number of processes

    @property
    def global_batch(self) -> int:
        """Samples per optimiser step over all processes and micro-batches."""
        return self.batch_size * self.processes * self.accum_steps

    @classmethod
    def plan(cls, data: DataConfig, train: TrainSection, processes: int) -> "Runtime":
        """The runtime of the ``data`` and ``train`` sections on `processes` processes, with the batch a resumed run
        keeps (`batch_plan`)."""
        batch = batch_plan(data, train, processes)
        steps, line = run_length(data, train, processes, batch)
        return cls(processes, batch.batch_size, batch.accum_steps, steps, line, batch.line)


def global_batch_size(data: DataConfig, train: TrainSection, processes: int) -> int:
    """Samples per optimiser step over all processes and micro-batches, as the config sets them."""
    return data.batch_size * processes * train.accum_steps


def run_length(data: DataConfig, train: TrainSection, processes: int,
               batch: Optional[BatchPlan] = None) -> Tuple[int, str]:
    """(the run's optimiser steps, the line that says how they were found), with the config's batch or `batch`.
    One key decides (`config` refuses train.samples with train.epochs): ``train.epochs`` (passes over the data,
    open_clip's ``--epochs``: the steps of one pass, rounded up, times the epochs, rounded up), else
    ``train.samples`` (the steps that see at least that many samples), else ``train.steps``."""
    per_step = (global_batch_size(data, train, processes) if batch is None
                else batch.batch_size * processes * batch.accum_steps)
    if train.epochs is not None:
        if data.train_num_samples is not None:
            per_epoch, source = data.train_num_samples, "data.train_num_samples"
        else:

            per_epoch, source = shard_samples(data.train, data.allow_pipe, data.require_all_shards)
        if per_epoch <= 0:
            raise ConfigError(f"train.epochs: the data holds no samples ({source})")
        epoch_steps = -(-per_epoch // per_step)
        steps = max(1, math.ceil(train.epochs * epoch_steps))
        return steps, (f"train.epochs={train.epochs:g} of {per_epoch:,} samples ({source}): {steps} steps of "
                       f"{per_step} samples ({epoch_steps} per epoch)")
    if train.samples is not None:
        steps = -(-train.samples // per_step)
        return steps, f"train.samples={train.samples}: {steps} steps of {per_step} samples"
    if data.naflex.seq_lens:  # the token budget sets each batch's pairs, not data.batch_size (the NaFlex line)
        return train.steps, (f"train.steps={train.steps}: {train.steps} steps of NaFlex batches (each one's pairs "
                             f"set by data.naflex.max_tokens_per_batch)")
    return train.steps, f"train.steps={train.steps}: {train.steps} steps of {per_step} samples"


def total_steps(data: DataConfig, train: TrainSection, processes: int) -> int:
    """The run's optimiser steps (`run_length`)."""
    return run_length(data, train, processes)[0]


def batch_plan(data: DataConfig, train: TrainSection, processes: int) -> BatchPlan:
    """The config's per-process batch, unless the run under ``train.output_dir`` is resumed with the per-process
    values it started with (``data.batch_size``, ``train.accum_steps`` as in its config.yaml) on another number of
    processes: then the batch that keeps the run's global batch, with the line that says what was adjusted. Other
    per-process values are the run folder's rule's to judge (`runfolder.decide`). ConfigError when no per-process
    batch gives that global batch."""
    same = BatchPlan(data.batch_size, train.accum_steps)
    out_dir = Path(train.output_dir)
    ckpt = checkpoints.latest_checkpoint(out_dir / checkpoints.CHECKPOINTS_DIR)
    if ckpt is None:
        return same
    try:
        marker = checkpoints.read_marker(ckpt)
    except (ValueError, OSError):
        return same  # resume sets it aside as damaged, or refuses, with its own line
    saved = int(marker.get("world_size", processes))
    run_cfg = runfolder.saved_config(out_dir)
    total = runfolder.saved_global_batch(out_dir, run_cfg, runfolder.read_record(out_dir))
    if total is None or total == global_batch_size(data, train, processes):
        return same
    if run_cfg is not None:
        started = (run_cfg.get("data", {}).get("batch_size"), run_cfg.get("train", {}).get("accum_steps", 1))
        if started != (data.batch_size, train.accum_steps):
            return same  # asked for another batch: refused by the rule, or kept under train.resume=force
    accum = train.accum_steps if total % (processes * train.accum_steps) == 0 else 1
    if total % processes != 0:
        raise ConfigError(f"cannot resume {ckpt} on {processes} processes: its global batch of {total} samples "
                          f"does not divide among them (it was written by {saved}); use a number of processes "
                          f"that divides {total}")
    batch_size = total // (processes * accum)
    what = f"data.batch_size {data.batch_size} -> {batch_size} per process"
    if accum != train.accum_steps:
        what += f", train.accum_steps {train.accum_steps} -> {accum}"
    return BatchPlan(batch_size, accum, f"resuming on {processes} process(es) a checkpoint written by {saved}: "
                                        f"{what}, keeping the global batch of {total}")


# ------------------------------------------------------------------------------------------ the accelerator
LAUNCHER_PRECISION = "ACCELERATE_MIXED_PRECISION"  # what `accelerate launch` sets from its mixed_precision


def choose_precision(configured: str = "auto") -> Tuple[str, str]:
    """The precision a run trains in and where it comes from, from ``train.precision`` and the launcher.

    The launcher's ``mixed_precision`` (a launch file, ``--mixed_precision``) reaches the processes as
    ACCELERATE_MIXED_PRECISION. ``train.precision=auto`` (the default) takes it, and fp32 without a launcher; a set
    ``train.precision`` is used as it is where no launcher set one or where the launcher agrees. A launcher that
    says otherwise is a ConfigError naming both: two settings that disagree would train in one of them silently.
    Returns (fp32 | bf16 | fp16, a few words on where it came from).
    """
    from_launcher = os.environ.get(LAUNCHER_PRECISION, "").strip().lower() or None
    launched = PRECISION_OF.get(from_launcher)
    said = f"the launcher ({LAUNCHER_PRECISION}={from_launcher})"
    problem = None
    if from_launcher is not None and launched is None:
        problem = (f"the launcher asks for mixed precision {from_launcher} ({LAUNCHER_PRECISION}), which mmcl does "
                   f"not train in; launch with mixed_precision one of "
                   f"{', '.join(repr(v) for v in PRECISIONS.values())}")
    elif configured == "auto":
        return (launched, said) if launched else ("fp32", "the default (train.precision=auto, no launcher setting)")
    elif launched is None:
        return configured, "train.precision"
    elif launched != configured:
        problem = (f"train.precision={configured} disagrees with the launcher's mixed precision {launched} "
                   f"({LAUNCHER_PRECISION}={from_launcher}): drop train.precision (or set it to auto) to train in "
                   f"{launched}, or launch with mixed_precision {PRECISIONS[configured]!r} (--mixed_precision "
                   f"{PRECISIONS[configured]}) to train in {configured}")
    if problem is not None:
        err = ConfigError(problem)
        err.everywhere = True  # every process finds it; rank 0 says it
        raise err
    return configured, f"train.precision and {said}"


def tf32_setting(enabled: bool, device: torch.device) -> str:
    """How `set_tf32` leaves float32 matmuls on `device`, in words for the startup line."""
    if device.type != "cuda":
        return f"TF32 n/a on {device.type}"
    return f"TF32 for float32 matmuls {'on' if enabled else 'off'} (train.tf32)"


def set_tf32(enabled: bool, device: torch.device) -> None:
    """Allow TF32 tensor cores for float32 matmuls and convolutions on a CUDA device (``train.tf32``: several times
    the float32 matmul rate on Ampere and later, 10-bit mantissa products accumulated in float32, as open_clip
    trains), or keep them IEEE float32. Set either way, since the flags are process-wide; nothing changes on other
    devices."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def set_cudnn_benchmark(device: torch.device) -> None:
    """Let cuDNN pick the fastest convolution algorithms for the shapes it meets (as open_clip_train does): the
    convolutional towers' inputs keep their shapes from step to step. Nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def dist_timeout(seconds: Optional[float]) -> list:
    """accelerate's kwargs handlers for ``train.dist_timeout_s``: the default process group's collective timeout
    (none set: torch's default)."""
    if seconds is None:
        return []


    return [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=seconds))]


def ddp_options(ddp) -> list:
    """accelerate's kwargs handlers for ``train.ddp``: the options set (not null) given to torch's DDP."""
    options = {k: v for k, v in to_dict(ddp).items() if v is not None}
    if not options:
        return []

    return [DistributedDataParallelKwargs(**options)]


def refuse_deepspeed() -> None:
    """A DeepSpeed launch (``distributed_type: DEEPSPEED``) is refused in one line before anything starts.

    mmcl's step does not fit DeepSpeed's engine: accelerate's DeepSpeed path needs a prepared DataLoader for the
    micro-batch size, the engine steps on its own accumulation count (not GradCache's micro-batches), keeps a
    bf16 copy of the logit scale beyond the clamp and clips by its own config. FSDP2 is the sharded path.
    """
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        return
    err = ConfigError("DeepSpeed is not supported by mmcl train; for sharded training use "
                      "`accelerate launch --config_file launch/fsdp.yaml` (FSDP2 is the sharded path)")
    err.everywhere = True  # every process refuses alike; one line
    raise err


def _has_device() -> bool:
    """Whether this machine has an accelerator device (CUDA or another torch.accelerator)."""
    has_device = getattr(torch, "accelerator", None)
    return has_device.is_available() if has_device is not None else torch.cuda.is_available()


def gpu_launch_problem(processes: int, env=None, device: Optional[bool] = None) -> Optional[str]:
    """The line for a launch that asked for GPUs on a machine without any accelerator device, else None.

    accelerate's launcher says what its launch file asked for in the processes' environment: ``ACCELERATE_USE_CPU``
    False with GPU mixed precision (``ACCELERATE_MIXED_PRECISION`` bf16 or fp16: every GPU file of launch/) or FSDP
    is a launch for GPUs; on the CPU it would train its processes in bf16 autocast on the CPU cores, silently.
    `processes`: the launch's; `env`, `device`: the environment and whether a device exists (default: this
    process's).
    """
    env = os.environ if env is None else env
    device = _has_device() if device is None else device
    if device or env.get("ACCELERATE_USE_CPU", "").lower() not in ("false", "0"):
        return None
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    fsdp = env.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1")
    if precision not in ("bf16", "fp16") and not fsdp:
        return None
    asked = ", ".join([f"{processes} process(es)", f"{precision} mixed precision",
                       *(["FSDP"] if fsdp else []), "use_cpu false"])
    return (f"the launcher asked for GPUs ({asked}: a GPU launch file such as launch/gpu-8.yaml) and this machine "
            f"has none; on the CPU launch with --config_file launch/cpu-2proc.yaml (or cpu-1proc.yaml), or set "
            f"use_cpu: true in your launch file")


def launcher_processes_asked(cmdline: List[str]) -> Optional[int]:
    """The ``--num_processes`` (or ``--num-processes``) an ``accelerate launch`` / ``mmcl launch`` command line
    asked for, between ``launch`` and its training script (None when not given)."""
    start = next((i + 1 for i, word in enumerate(cmdline) if word.endswith("launch")), None)
    if start is None:
        return None
    words = cmdline[start:]
    words = words[:words.index("-m")] if "-m" in words else words
    try:
        for i, word in enumerate(words):
            name, eq, value = word.partition("=")
            if name in ("--num_processes", "--num-processes"):
                return int(value if eq else words[i + 1])
    except (ValueError, IndexError):
        return None
    return None


def processes_problem(processes: int) -> Optional[str]:
    """The line for a launch that started fewer processes than its command asked for: ``accelerate launch
    --num_processes N`` without a launch file starts one process on a machine without several GPUs. Read from the
    launcher's own command line (the parent process, on Linux); None when it cannot be read or agrees."""
    if "ACCELERATE_USE_CPU" not in os.environ:  # not started by accelerate's launcher
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            cmdline = [w.decode("utf-8", "replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return None
    asked = launcher_processes_asked(cmdline)
    if asked is None or asked <= processes:
        return None
    return (f"the launcher was asked for {asked} processes (--num_processes {asked}) and started {processes}: "
            f"without a launch file accelerate starts several processes only on several GPUs; on the CPU use "
            f"`mmcl launch --num_processes {asked} -m mmcl train ...` or --config_file launch/cpu-2proc.yaml")


def check_launch(processes: int) -> None:
    """Refuse a launch for GPUs on a machine without them (`gpu_launch_problem`) in one line; warn when fewer
    processes started than were asked for (`processes_problem`)."""
    problem = gpu_launch_problem(processes)
    if problem:
        err = ConfigError(problem)
        err.everywhere = True
        raise err
    fewer = processes_problem(processes)
    if fewer:
        warnings.warn(fewer)


def _cpu_processes() -> bool:
    """True for several launched processes on a machine without an accelerator device.

    accelerate only treats processes as a CPU group (gloo) when asked to; otherwise each of them would run as a
    lone single process on its own data, silently training W separate models.
    """
    if world().size <= 1:
        return False
    return not _has_device()


def make_accelerator(precision: str = "auto", **tracking_kwargs):
    """An `Accelerator` for ``train.precision`` (auto | fp32 | bf16 | fp16), as `choose_precision` settles it
    with the launcher.

    accelerate keeps its state, mixed precision included, for the life of the Python process and offers no public
    call to start it afresh. A second run in one process (a notebook) with another precision therefore ends with
    a ConfigError naming both, rather than with accelerate's ValueError or with a private reset; tests start each
    test with fresh state (tests/conftest.py).
    """

    precision, _ = choose_precision(precision)
    mixed_precision = PRECISIONS[precision]
    if is_initialized() and AcceleratorState().mixed_precision != mixed_precision:
        held = PRECISION_OF.get(AcceleratorState().mixed_precision, AcceleratorState().mixed_precision)
        raise ConfigError(f"train.precision={precision}, but this Python process already ran accelerate with "
                          f"train.precision={held}, which accelerate keeps for the life of the process (expected "
                          f"{held}; run the other precision in a new process, e.g. restart the notebook kernel)")
    return Accelerator(mixed_precision=mixed_precision, cpu=_cpu_processes(), **tracking_kwargs)


def accelerator_for(train: TrainSection):
    """The run's accelerator: its precision, trackers (``train.log_with``), collective timeout and DDP options, with
    TF32 and cuDNN's autotuner set for its device."""

    accelerator = make_accelerator(train.precision,
                                   **tracking.accelerator_kwargs(train.log_with, Path(train.output_dir)),
                                   kwargs_handlers=dist_timeout(train.dist_timeout_s) + ddp_options(train.ddp))
    set_tf32(train.tf32, accelerator.device)
    set_cudnn_benchmark(accelerator.device)
    return accelerator
