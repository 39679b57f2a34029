"""The training loop.

`train` reads top to bottom: `build_run` (accelerator, signal handlers, the output directory's lock, model,
objective, optimiser, data stream, ``accelerator.prepare``), `resume_or_start`, then per step `train_step`
(`mmcl.training.step`: forward and loss) and `finish_step` (backward, the update, logging, saving, stopping: one
path, with the host reading the device only where a step is logged or saved), and `finish_run` (model/ saved,
then the final evaluation). A `Run` holds what these share.

Resumable: checkpoints are written into a temporary directory and renamed into place, then a ``latest``
pointer is replaced atomically; starting the same command on the same output directory continues from the
newest complete checkpoint with the same weights, optimiser, RNG and data position; on another number of
processes, with the same global batch and every sample of the epoch once (`mmcl.training.resume`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import data as data_mod
from .. import models
from ..config import PRECISION_OF, PRECISIONS, TrainConfig, is_main_process, to_dict, world
from ..data.decode import SKIP_REASONS
from ..data.pipeline import skip_units
from ..data.sizes import describe_sources
from ..data.skips import SkipLog
from ..data.sources import redact_values
from ..errors import ConfigError, MmclError, RunStopped, TrainingError, printable
from ..evaluation import sets as eval_sets
from ..models import flip
from ..storage import checkpoints, weights
from ..storage.layout import CONFIG, RunLayout
from ..storage.checkpoints import CKPT_PREFIX, latest_checkpoint, save_checkpoint
from ..storage.fsutil import atomic_write_text
from ..models import phases as model_phases
from . import fsdp, optim, phases, resume, runfolder, tracking
from .agree import agreed, any_process, lost_peer, others_wait, timed_out
from .console import step_line
from .ema import WeightEMA, swapped_in
from .optim import build_optimizer, lr_at
from .preempt import StopSignals, exit_code
from .resume import load_checkpoint, resume_from_newest
from .runlock import RunLock
from .step import apply_update, objective_from_config, train_step
from .stepcheck import StepChecks, stop_requested_anywhere
from .tracking import MetricsLog


class TrainProgress:
    """Global progress, saved in every checkpoint's rank states as plain ints (the resumed step is read from
    there, never from a folder name; not registered with accelerate, which would pickle and unpickle it)."""

    def __init__(self):
        self.step = 0
        self.samples = 0
        self.skipped_steps = 0

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step, "samples": self.samples, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


# ------------------------------------------------------------------------------------------------- steps
def global_batch_size(cfg: TrainConfig, processes: int) -> int:
    """Samples per optimiser step over all processes and micro-batches."""
    return cfg.data.batch_size * processes * cfg.train.accum_steps


def run_length(cfg: TrainConfig, processes: int) -> Tuple[int, str]:
    """(the run's optimiser steps, the line that says how they were found). One key decides (`config` refuses
    train.samples with train.epochs): ``train.epochs`` (passes over the data, open_clip's ``--epochs``: the
    steps of one pass, rounded up, times the epochs, rounded up), else ``train.samples`` (the steps that see at
    least that many samples), else ``train.steps``."""
    batch = global_batch_size(cfg, processes)
    if cfg.train.epochs is not None:
        if cfg.data.train_num_samples is not None:
            per_epoch, source = cfg.data.train_num_samples, "data.train_num_samples"
        else:
            from ..data.sizes import shard_samples

            per_epoch, source = shard_samples(cfg.data.train, cfg.data.allow_pipe, cfg.data.require_all_shards)
        if per_epoch <= 0:
            raise ConfigError(f"train.epochs: the data holds no samples ({source})")
        epoch_steps = -(-per_epoch // batch)
        steps = max(1, math.ceil(cfg.train.epochs * epoch_steps))
        return steps, (f"train.epochs={cfg.train.epochs:g} of {per_epoch:,} samples ({source}): {steps} steps of "
                       f"{batch} samples ({epoch_steps} per epoch)")
    if cfg.train.samples is not None:
        steps = -(-cfg.train.samples // batch)
        return steps, f"train.samples={cfg.train.samples}: {steps} steps of {batch} samples"
    return cfg.train.steps, f"train.steps={cfg.train.steps}: {cfg.train.steps} steps of {batch} samples"


def total_steps(cfg: TrainConfig, processes: int) -> int:
    """The run's optimiser steps (`run_length`)."""
    return run_length(cfg, processes)[0]


# ------------------------------------------------------------------------------------------------- train
def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Train as configured; returns the last logged metrics. Run under ``accelerate launch`` for several processes.

    Raises `MmclError` on bad input (on every process alike, so that the run ends with one line) and `RunStopped`
    after saving a checkpoint on SIGTERM, SIGUSR1 or SIGINT.
    """
    refuse_deepspeed()
    with contextlib.ExitStack() as held:  # the output directory's lock and the signal handlers, for the whole run
        try:
            return _train(cfg, held)
        except RuntimeError as err:  # torch.distributed's DistError (NCCL's DistBackendError) included
            gone = lost_peer(err) if world().size > 1 else None
            if gone is None:
                raise
            if timed_out(gone):
                raise TrainingError(
                    f"another process of this run did not answer in time ({gone}); it may have ended or hung, its "
                    f"own output says which; a longer wait is train.dist_timeout_s; re-run the same command to "
                    f"resume from the newest checkpoint") from None
            raise TrainingError(f"another process of this run ended ({gone}); its own output says why; re-run "
                                f"the same command to resume from the newest checkpoint") from None


def _first_missing(out_dir: Path) -> Optional[Path]:
    """The topmost folder of `out_dir` (itself or a parent) that does not exist yet, which the run will create;
    None when `out_dir` exists or on a process other than the main one (which creates nothing)."""
    if not is_main_process() or out_dir.exists():
        return None
    top = out_dir.absolute()
    while not top.parent.exists():
        top = top.parent
    return top


def _remove_unused(out_dir: Path, made: Optional[Path], locked: bool) -> None:
    """After a run that failed: remove the folders it created (`made` and below, down to `out_dir`) when they hold
    nothing, or nothing but the lock file it holds (`locked`; another run's lock is never removed)."""
    if made is None or not out_dir.is_dir():
        return
    from .runlock import LOCK_NAME

    if any(entry.name != LOCK_NAME or not locked for entry in out_dir.iterdir()):
        return
    with contextlib.suppress(OSError):
        (out_dir / LOCK_NAME).unlink(missing_ok=True)
        folder = out_dir.absolute()
        while True:
            folder.rmdir()  # only an empty folder; stops at the first that is not
            if folder == made:
                break
            folder = folder.parent


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


def dist_timeout(seconds: Optional[float]) -> list:
    """accelerate's kwargs handlers for ``train.dist_timeout_s``: the default process group's collective timeout
    (none set: torch's default)."""
    if seconds is None:
        return []
    import datetime

    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=seconds))]


def ddp_options(ddp) -> list:
    """accelerate's kwargs handlers for ``train.ddp``: the options set (not null) given to torch's DDP."""
    options = {k: v for k, v in to_dict(ddp).items() if v is not None}
    if not options:
        return []
    from accelerate.utils import DistributedDataParallelKwargs

    return [DistributedDataParallelKwargs(**options)]


def set_cudnn_benchmark(device: torch.device) -> None:
    """Let cuDNN pick the fastest convolution algorithms for the shapes it meets (as open_clip_train does): the
    convolutional towers' inputs keep their shapes from step to step. Nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def _train(cfg: TrainConfig, held: contextlib.ExitStack) -> Dict[str, Any]:
    """The run from start to end: check the inputs, build, prepare, resume, loop (step, log, save), finish."""
    from .preflight import check_inputs

    main = is_main_process()
    cfg = weights.record_pretrained_architecture(cfg)  # config.yaml records the architecture that is built
    folder = decide_folder(cfg)  # the run folder's rule, before anything is read or written
    if folder.action == "finished":
        if main:
            print(f"mmcl: {folder.line}", flush=True)
        return folder.last
    console = runfolder.ConsoleLog()
    if main:  # out.log: what this process prints, from here on
        held.push(console.start().stop)
        print(f"mmcl: {folder.line}", flush=True)
    # Every missing path in one error, a table given as shards, a global batch (as a resumed run keeps it) larger
    # than the data: before the model, the data workers or any step.
    processes = world().size
    check_inputs(resume.keep_global_batch(cfg, processes)[0], processes)
    run = build_run(cfg, held)
    if main:
        console.attach(run.layout.out_log)
        run.console = console
    resume_or_start(run, folder)
    if run.phases:  # each batch's phase follows from its place in the run, whatever the saved stream counted
        run.stream.batches = run.progress.step * cfg.train.accum_steps
    describe_setup(run)
    data_iter = iter(run.stream)
    # Closed when the run ends by any path, so the data workers are shut down before the interpreter exits
    # (an exception's traceback would otherwise keep them alive until multiprocessing's exit handler).
    held.callback(data_iter.close)
    last: Dict[str, Any] = {}
    run.start_window()
    run.model.train()
    while run.progress.step < run.total:
        lr = set_learning_rate(run)
        if run.patch_dropout:  # FLIP masks for this step at its phase's rate; none in the last train.unmasked_steps
            flip.begin_step(run.patch_dropout, run.progress.step,
                            run.progress.step < run.total - cfg.train.unmasked_steps,
                            phases.patch_dropout_at(run.phases, run.progress.step, cfg.model.patch_dropout))
        batches = next_batches(run, data_iter)
        with_metrics = run.logged_at(run.progress.step + 1)  # the objective's metrics, on logged steps only
        loss, terms, backward = train_step(run.step_model, run.loss_fn, batches, run.accelerator,
                                           run.stream.finish_images, with_metrics, run.teacher)
        last = finish_step(run, loss, terms, lr, backward, last)
    return finish_run(run, last)


class Run:
    """What one training run holds: its config, accelerate's objects, the model, objective, optimiser and data
    stream, its progress, where it writes, and the counters of the current logging window.

    `build_run` fills it; the loop's helpers below read and advance it.
    """

    def __init__(self, cfg: TrainConfig, accelerator, stop: StopSignals):
        self.cfg = cfg
        self.accelerator = accelerator
        self.stop = stop
        self.main = accelerator.is_main_process
        self.out_dir = Path(cfg.train.output_dir)
        self.layout = RunLayout(self.out_dir)
        self.ckpt_dir = self.layout.checkpoints
        self.total, self.length_line = run_length(cfg, accelerator.num_processes)
        self.global_batch = global_batch_size(cfg, accelerator.num_processes)
        optim.check_schedule(cfg.optim, self.total)
        self.progress = TrainProgress()
        self.saved_at = -1  # the step of the last checkpoint this run saved
        self.bar = None  # the progress bar, from the first step on (main process, train.progress)
        self.console: Optional[runfolder.ConsoleLog] = None  # out.log (main process)
        self.held: Optional[contextlib.ExitStack] = None  # what the run holds until it ends (`train`)
        self.metrics: Optional[MetricsLog] = None
        self.ema: Optional[WeightEMA] = None  # train.ema_decay
        self.teacher = None  # distill.teacher: a frozen `mmcl.training.teacher.Teacher`, never saved
        self.wise_init: Optional[Dict[str, torch.Tensor]] = None  # train.wise_ft: the initial weights (main process)
        # What a step calls: the prepared model and the objective, or their compiled forms (train.compile)
        self.step_model: Optional[torch.nn.Module] = None
        self.loss_fn = None
        self.patch_dropout: List[torch.nn.Module] = []  # model.patch_dropout's masking modules
        self.phases: List[phases.Phase] = []  # train.phases, resolved against the model
        self.param_groups: List[Dict[str, Any]] = []  # the optimiser's groups as param_groups.json describes them
        self.ckpt_bytes = 0
        self.started = (time.perf_counter(), 0)  # when this invocation's training began, and the samples then
        self.window_start, self.window_samples, self.data_time = 0.0, 0, 0.0
        self.skips: Dict[str, int] = {}  # data skipped by reason, all processes, at the last logged step

    def log(self, msg: str) -> None:
        if self.main:
            print(f"mmcl: {printable(msg)}", flush=True)

    def logged_at(self, step: int) -> bool:
        """Whether the metrics of optimiser step `step` (1-based) are written: every ``train.log_every`` steps, the
        last step, and every evaluation step (each set's ``every`` counts on its own, its results go in that
        record)."""
        return step % self.cfg.train.log_every == 0 or step == self.total or self.evaluated_at(step)

    def evaluated_at(self, step: int) -> bool:
        """Whether a periodic evaluation (a set's or ``eval.val_loss``'s ``every``) runs after optimiser step `step`;
        the last step has the final evaluation instead."""
        return eval_sets.any_due(self.cfg.eval, step, self.total)  # each set (and eval.val_loss) on its own every

    def start_window(self) -> None:
        self.window_start, self.window_samples, self.data_time = time.perf_counter(), 0, 0.0

    def marked_progress(self) -> Dict[str, int]:
        """The progress recorded in a checkpoint's COMPLETE marker, with the global batch (`elastic`)."""
        return dict(self.progress.state_dict(), **{resume.GLOBAL_BATCH: self.global_batch})

    def rank_state(self) -> Dict[str, Any]:
        """What each process saves beside accelerate's state, as tensors and plain containers (resume loads it
        with ``weights_only=True``): its data position, the objective's state, the progress, and on the main
        process the weight average (the same on every process, so saved once)."""
        state = {"data": self.stream.state_dict(), "objective": self.objective.state_dict(),
                 "progress": self.progress.state_dict()}
        if self.main and self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def model_meta(self) -> Dict[str, Any]:
        """The architecture and preprocessing each checkpoint records beside its weights (a checkpoint is a model)."""
        return {"model_cfg": self.model_cfg, "preprocess_cfg": self.pp_cfg}


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


def make_accelerator(precision: str = "auto", **tracking_kwargs):
    """An `Accelerator` for ``train.precision`` (auto | fp32 | bf16 | fp16), as `choose_precision` settles it
    with the launcher.

    accelerate keeps its state, mixed precision included, for the life of the Python process and offers no public
    call to start it afresh. A second run in one process (a notebook) with another precision therefore ends with
    a ConfigError naming both, rather than with accelerate's ValueError or with a private reset; tests start each
    test with fresh state (tests/conftest.py).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, is_initialized

    precision, _ = choose_precision(precision)
    mixed_precision = PRECISIONS[precision]
    if is_initialized() and AcceleratorState().mixed_precision != mixed_precision:
        held = PRECISION_OF.get(AcceleratorState().mixed_precision, AcceleratorState().mixed_precision)
        raise ConfigError(f"train.precision={precision}, but this Python process already ran accelerate with "
                          f"train.precision={held}, which accelerate keeps for the life of the process (expected "
                          f"{held}; run the other precision in a new process, e.g. restart the notebook kernel)")
    return Accelerator(mixed_precision=mixed_precision, cpu=_cpu_processes(), **tracking_kwargs)


def build_run(cfg: TrainConfig, held: contextlib.ExitStack) -> Run:
    """Accelerator, signal handlers, the output directory's lock, model, objective, optimiser and data stream,
    prepared by accelerate. User errors end every process alike (`agreed`)."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(cfg.train.precision,  # log_with and project_dir: train.log_with's trackers
                                   **tracking.accelerator_kwargs(cfg.train.log_with, Path(cfg.train.output_dir)),
                                   kwargs_handlers=dist_timeout(cfg.train.dist_timeout_s) + ddp_options(cfg.train.ddp))
    set_tf32(cfg.train.tf32, accelerator.device)
    set_cudnn_benchmark(accelerator.device)
    run = Run(cfg, accelerator, held.enter_context(StopSignals()))
    run.held = held

    def take_directory():
        if run.main:
            made, lock = _first_missing(run.out_dir), RunLock(run.out_dir)
            held.callback(lock.release)
            # Unwound before the release: a run that fails before it writes anything (a full disk, a wrong
            # model.name) leaves no folder behind; one refused by the lock removes nothing of the holder's.
            held.push(lambda *exc: _remove_unused(run.out_dir, made, lock.held) if exc[0] is not None else None)
            checkpoints.check_output_dir(run.out_dir, run.ckpt_dir)
            warning = lock.acquire()
            if warning:
                run.log(warning)

    agreed(accelerator, take_directory)
    cfg, resized = agreed(accelerator, lambda: resume.keep_global_batch(cfg, accelerator.num_processes))
    if resized:  # a checkpoint written by another number of processes: the same global batch
        run.cfg = cfg
        run.log(resized)
        (run.total, run.length_line), run.global_batch = (run_length(cfg, accelerator.num_processes),
                                                          global_batch_size(cfg, accelerator.num_processes))
    set_seed(cfg.train.seed)
    if cfg.model.pretrained:  # by name: architecture (where the source has one), preprocessing and weights
        model, run.model_cfg, run.pp_cfg, run.tokenizer, report = agreed(
            accelerator, lambda: weights.build_pretrained(cfg.model))
        run.log(report)
    else:
        model, run.model_cfg, run.pp_cfg, _, _, run.tokenizer = models.build(cfg.model)
    if cfg.model.init_from:
        from ..storage.weights import init_from  # pretrained weights (open_clip, mmcl or Hugging Face CLIP)

        run.log(init_from(model, cfg.model.init_from))
    models.apply_locks(model, cfg.model)
    if cfg.train.wise_ft and accelerator.is_main_process:  # WiSE-FT's start point, on the CPU until the end
        run.wise_init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if fsdp.in_effect(accelerator):  # fully_shard takes no 0-dim parameter: before the optimiser sees them
        if cfg.train.ema_decay is not None:
            raise ConfigError("train.ema_decay is not supported with FSDP (the average would need the full "
                              "weights on every step); unset it or launch without FSDP")
        fsdp.vector_scalars(model)
        fsdp.shard_with_precision(accelerator, model)  # bf16/fp16: float32 reduction, temperature and bias
    if cfg.model.patch_dropout or phases.uses_patch_dropout(cfg):
        run.patch_dropout = models.set_patch_dropout(model, cfg.model.patch_dropout, cfg.train.seed,
                                                     accelerator.process_index, accelerator.num_processes,
                                                     cfg.train.accum_steps)
    run.phases = agreed(accelerator, lambda: phases.plan(cfg, model, run.model_cfg, run.total))
    model_size, _, model_length = model_phases.full_sizes(run.model_cfg)
    for p in run.phases:
        run.log(f"phase {p.describe(model_size, model_length)}")
    run.objective = objective_from_config(cfg.loss)
    run.objective.reseed(cfg.train.seed)  # MoCHi's mixing draws; identical on every process
    groups = optim.param_groups(model, cfg.optim)
    optimizer = build_optimizer(model, cfg.optim, groups, device=accelerator.device)
    if run.main:
        run.param_groups = optim.describe(model, groups, cfg.optim)  # printed once; param_groups.json at the start
        optim.log_groups(run.param_groups, run.log)
    if cfg.distill.teacher:  # frozen, on the device; not prepared, not optimised, never saved
        from .teacher import Teacher

        run.teacher = agreed(accelerator, lambda: Teacher.load(cfg.distill.teacher, accelerator.device))
        run.log(f"distilling from {cfg.distill.teacher} (logit scale {float(run.teacher.scale):.2f})")
    # data builds the training transform from the model's preprocessing and data.aug (open_clip's aug_cfg)
    image_spec = data_mod.train_image_input(run.pp_cfg, cfg.data.aug)
    run.stream = agreed(accelerator, lambda: data_mod.build_train_stream(
        cfg.data, image_spec, models.training_tokenizer(model, run.tokenizer), seed=cfg.train.seed,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
        pin_memory=accelerator.device.type == "cuda",
        teacher_view=None if run.teacher is None else run.teacher.view, stored_teacher=cfg.distill.from_shards,
        phases=phases.stream_phases(run.phases, model_size, cfg.train.accum_steps)))
    # Each batch a data worker sends is a shared-memory segment: a container's small /dev/shm fails mid-run.
    from .preflight import check_shared_memory

    check_shared_memory(cfg, getattr(image_spec, "size", None) or run.pp_cfg["size"], run.stream.uint8,
                        world().local_size)
    run.stream.skip_log = SkipLog(run.layout.skipped)  # appended to by every process
    run.model, run.optimizer = accelerator.prepare(model, optimizer)
    run.raw_model = accelerator.unwrap_model(run.model)
    run.step_model, run.loss_fn = run.model, run.objective
    if cfg.train.compile:
        # After prepare: dynamo then compiles the DDP-wrapped model in pieces cut at DDP's gradient buckets, so each
        # bucket's all-reduce overlaps the rest of the backward (compiled before wrapping, one graph would finish
        # its backward before any all-reduce starts). The objective (tiled losses included) is compiled too;
        # checkpoints, the EMA and evaluation keep using the modules themselves (`model`, `objective`).
        run.step_model = torch.compile(run.model)
        run.loss_fn = torch.compile(run.objective)
    run.checks = StepChecks(accelerator, run.optimizer)
    if not run.checks.on_device:  # one line: what the run does instead, and why
        run.log(optim.host_check_line(run.optimizer, getattr(accelerator, "scaler", None))
                or "a step with a non-finite loss is detected on the host (one device sync per step)")
    run.objective.to(accelerator.device)
    # The progress and the EMA are saved in the rank states (`Run.rank_state`), not registered with accelerate.
    if cfg.train.ema_decay:  # after the locks: locked parameters get no average
        run.ema = WeightEMA(run.raw_model, cfg.train.ema_decay)
    return run


def decide_folder(cfg: TrainConfig) -> runfolder.Decision:
    """`runfolder.decide` for this launch (every process alike; rank 0 alone says a refusal)."""
    processes = world().size
    try:
        sized, _ = resume.keep_global_batch(cfg, processes)  # the steps as the resumed run will count them
        return runfolder.decide(cfg, processes, lambda: total_steps(sized, processes))
    except MmclError as err:
        err.everywhere = True
        raise


def resume_or_start(run: Run, folder: runfolder.Decision) -> None:
    """Resume from the newest intact checkpoint if there is one; write config.yaml and the run's record when the
    run starts (or is forced on: `runfolder`), never on a plain resume; open the metrics log."""
    resumed = resume_from_newest(run.accelerator, run.ckpt_dir, lambda path: load_checkpoint(run, path), run.log)
    if resumed is not None:
        run.log(f"resuming from {resumed} at step {run.progress.step}")

    def write_config():
        if not run.main:
            return
        try:
            if folder.write_config or runfolder.read_record(run.out_dir) is None:  # the folder is this run's
                runfolder.write_record(run.out_dir, run.accelerator.num_processes, run.global_batch)
            if folder.write_config:
                # Credentials in a pipe: command or URL never reach the run folder (a colleague's copy of it).
                from omegaconf import OmegaConf

                atomic_write_text(run.layout.config,
                                  OmegaConf.to_yaml(OmegaConf.create(redact_values(to_dict(run.cfg)))))
                optim.write_groups(run.param_groups, run.out_dir)
        except OSError as err:
            raise (checkpoints.storage_error(err, CONFIG, run.out_dir) or err) from None

    agreed(run.accelerator, write_config)
    run.ckpt_bytes = checkpoints.state_bytes(run.raw_model)
    if run.main and run.cfg.train.save_every:
        warning = checkpoints.free_space_warning(run.out_dir, run.ckpt_bytes)
        if warning:
            run.log(warning)
    run.metrics = agreed(run.accelerator, lambda: MetricsLog(run.out_dir, run.progress.step, run.main, run.accelerator))
    run.started = (time.perf_counter(), run.progress.samples)

    def start_trackers():
        try:
            tracking.start(run.accelerator, run.cfg.train.log_with, to_dict(run.cfg), run.out_dir, run.progress.step)
        except OSError as err:
            raise (checkpoints.storage_error(err, "trackers", run.out_dir) or err) from None

    agreed(run.accelerator, start_trackers)


def describe_setup(run: Run) -> None:
    """Log the processes, distribution, device, precision and global batch, and launch settings not in effect."""
    cfg, accelerator = run.cfg, run.accelerator
    dist_type = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    precision, source = choose_precision(cfg.train.precision)
    run.log(f"{accelerator.num_processes} process(es), {dist_type} on {accelerator.device.type}, "
            f"{precision}; global batch {run.global_batch}; {run.stream.workers} data workers per process")
    run.log(f"precision {precision} from {source}; {tf32_setting(cfg.train.tf32, accelerator.device)}")
    for mode, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")):
        if os.environ.get(var, "").lower() in ("1", "true") and dist_type != mode:
            run.log(f"warning: the launch config asks for {mode} but it is not in effect here ({dist_type}); "
                    f"the model is replicated on every process")
    run.log(run.length_line)
    if run.main:  # what each source of data.train resolved to: its shards and, where known, their samples
        for line in describe_sources(cfg.data.train, cfg.data.allow_pipe, cfg.data.require_all_shards,
                                     cfg.data.train_num_samples):
            run.log(line)


def set_learning_rate(run: Run) -> float:
    """Set the scheduled learning rate of the coming optimiser step on every parameter group; returns it (the
    base rate; each group's is scaled by its ``lr_scale``)."""
    lr = lr_at(run.progress.step, run.cfg.optim, run.total)
    optim.set_lr(run.optimizer, lr)  # times each group's lr_scale (per-tower and layer-wise rates)
    return lr


def next_batches(run: Run, data_iter) -> List[Dict[str, Any]]:
    """The coming step's ``train.accum_steps`` micro-batches; the wait counts towards ``data_time_frac``."""
    t0 = time.perf_counter()
    batches = [next(data_iter) for _ in range(run.cfg.train.accum_steps)]
    run.data_time += time.perf_counter() - t0
    return batches


def agree_on_step(run: Run, loss: torch.Tensor):
    """Returns (the loss is finite on every process, a stop signal came to some process), from one all-reduce.

    All processes must take the same branch: one skipping backward while the others run it would pair their
    gradient all-reduces with the wrong steps (and end in a hang); and all must stop after the same step,
    whichever of them got the signal.
    """
    accelerator = run.accelerator
    flags = torch.stack([torch.isfinite(loss.detach()).reshape(()).float(),
                         torch.tensor(float(run.stop.requested), device=loss.device)])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    finite_count, stop_count = flags.tolist()
    return finite_count >= accelerator.num_processes, stop_count > 0


def non_finite_step(run: Run, step: int, value: float) -> None:
    """Step `step` (1-based) had a loss that is not finite on some process (`value` here): raise TrainingError
    (``train.nan_policy=stop``), or say that it was skipped (``skip``)."""
    where = f"{value}" if run.accelerator.num_processes == 1 else f"not finite on some process ({value} here)"
    if run.cfg.train.nan_policy == "stop":
        good = latest_checkpoint(run.ckpt_dir)
        err = TrainingError(f"loss is {where} at step {step}; last good checkpoint: "
                            f"{good if good else 'none'} (set train.nan_policy=skip to skip such steps)")
        err.everywhere = True  # all processes stop alike; one line
        raise err
    run.log(f"skipped step {step}: loss is {where}")


def skip_step(run: Run, loss: torch.Tensor) -> None:
    """A step whose loss is not finite on some process: raise TrainingError (``train.nan_policy=stop``), or count
    it as skipped without an update (``skip``)."""
    non_finite_step(run, run.progress.step + 1, loss.item())
    run.optimizer.zero_grad(set_to_none=True)
    run.progress.skipped_steps += 1
    run.progress.step += 1


def finish_step(run: Run, loss: torch.Tensor, terms, lr: float, backward, last: Dict[str, Any]) -> Dict[str, Any]:
    """The rest of a step after its forward: backward and the update, the progress, the weight average, then the
    log record, the checkpoint and a stop, each where it falls. Returns the last logged record.

    Whether a step whose loss is not finite on some process is applied is decided in one of two ways, and every
    process decides alike:

    * on the device (`stepcheck.StepChecks`, a fused optimiser that takes ``found_inf``): the update always runs
      and the optimiser itself leaves everything as it was where the flag is set. The host reads the flags only
      on logged and saved steps (and the last), where skipped steps are counted and reported; a stop signal is
      agreed on there too (one process reads its own flag every step);
    * on the host (`agree_on_step`, any other optimiser or a loss scaler): one all-reduce each step decides both
      whether to skip the update and whether to stop.
    """
    on_device = run.checks.on_device
    if on_device:
        run.checks.arm(loss, run.progress.step + 1)
        applied, stopping = True, None
    else:
        applied, stopping = agree_on_step(run, loss)
    grad_norm = None
    if applied:
        backward()
        grad_norm = apply_update(run.accelerator, run.model, run.raw_model, run.optimizer, run.cfg.optim.grad_clip,
                                 run.cfg.model.max_logit_scale)
        count_step(run)
        if run.ema is not None:  # not moved on a step the optimiser skipped (the device's flag is not read)
            run.ema.update(run.raw_model, skipped=run.checks.pending[-1][1] if on_device else None)
    else:
        skip_step(run, loss)  # raises under train.nan_policy=stop
    step, save_every = run.progress.step, run.cfg.train.save_every
    read = run.logged_at(step) or step == run.total or bool(save_every and step % save_every == 0)
    if stopping is None:
        stopping = (stop_requested_anywhere(run.accelerator, run.stop.requested)
                    if read or run.accelerator.num_processes == 1 else False)
    skipped_now = not applied
    if on_device and (read or stopping):
        for bad_step, value in run.checks.resolve():
            non_finite_step(run, bad_step, value)  # raises under train.nan_policy=stop, before any save
            run.progress.skipped_steps += 1
            run.progress.samples -= run.global_batch
            run.window_samples -= run.global_batch
            skipped_now = skipped_now or bad_step == step
    if run.logged_at(step) and not skipped_now:  # a skipped step is not logged
        last = log_record(run, loss, terms, lr, grad_norm)
    stopping = maybe_save(run) or stopping
    if stopping and step < run.total:  # on the last step the run simply finishes
        stop_run(run)
    return last


def count_step(run: Run) -> None:
    """Advance the progress (and the progress bar) by one applied optimiser step."""
    run.progress.step += 1
    run.progress.samples += run.global_batch
    run.window_samples += run.global_batch
    if run.main and run.cfg.train.progress and run.bar is None:
        # Created after the first step, so a data or config error is not preceded by an empty bar. Lines printed
        # while it is shown (warnings, log lines) are written through it, each on its own line.
        from .console import progress_bar

        run.bar = progress_bar(run.total, run.progress.step - 1, run.held, desc="train", unit="step",
                               dynamic_ncols=True)
    if run.bar is not None:
        run.bar.update(1)


def log_record(run: Run, loss: torch.Tensor, terms: Dict[str, torch.Tensor], lr: float, grad_norm) -> Dict[str, Any]:
    """The step's metrics record (with an evaluation when ``eval.every`` falls on it); written now except on the
    last step, whose record waits for the final evaluation. Starts the next timing window."""
    cfg, accelerator, progress, raw_model = run.cfg, run.accelerator, run.progress, run.raw_model
    elapsed = time.perf_counter() - run.window_start
    mine = run.stream.skipped  # by reason; summed over the processes, then by unit (samples and shards apart)
    counts = [float(mine.get(r, 0)) for r in SKIP_REASONS]
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(torch.tensor(counts, device=accelerator.device), reduction="sum").tolist()
    run.skips = {r: int(n) for r, n in zip(SKIP_REASONS, counts)}
    units = skip_units(run.skips)
    skipped = [units["samples"], units["shards"]]
    record = {"step": progress.step, "samples": progress.samples, "loss": float(loss.detach()),
              **{k: float(v) for k, v in terms.items()}, "lr": lr,
              "logit_scale": float(fsdp.full(raw_model.logit_scale.detach()).exp()),
              "samples_per_s": run.window_samples / max(elapsed, 1e-9),
              "data_time_frac": run.data_time / max(elapsed, 1e-9),
              "data/skipped_samples": skipped[0], "data/skipped_shards": skipped[1]}
    if getattr(raw_model, "logit_bias", None) is not None:
        record["logit_bias"] = float(fsdp.full(raw_model.logit_bias.detach()))
    if grad_norm is not None:
        record["grad_norm"] = float(fsdp.full(grad_norm))
    if run.evaluated_at(progress.step):
        eval_model = raw_model
        if fsdp.in_effect(accelerator):  # every process joins the gathering of the weights
            eval_model = fsdp.full_model(accelerator, run.model, run.model_cfg)
            if run.main:
                eval_model = fsdp.for_evaluation(accelerator, eval_model)
        # The others wait outside the default group: its timeout (NCCL's 10 min) need not cover an evaluation.
        with others_wait(accelerator, cfg.eval.timeout_s):
            if run.main:
                try:
                    with swapped_in(run.ema, eval_model):
                        record.update(run_eval(cfg, eval_model, run.tokenizer, run.pp_cfg, accelerator,
                                               progress.step, run.global_batch))
                except MmclError as err:
                    # Training goes on, with nothing lost. The final evaluation's failure still ends the run
                    # (after model/ is saved).
                    run.log(f"warning: evaluation at step {progress.step} failed, training goes on: {err}")
        del eval_model  # the gathered FSDP replica, before the next step allocates
    if progress.step < run.total:  # the last record waits for the final evaluation, after model/ is saved
        run.metrics.write(record)
    if run.bar is not None:  # the step's line in out.log; on the console the bar shows the progress
        run.bar.set_postfix(loss=f"{record['loss']:.3f}", sps=f"{record['samples_per_s']:.0f}")
        run.console.line(f"mmcl: {step_line(record, run.total)}")
    else:
        run.log(step_line(record, run.total))
    run.start_window()
    return record


def maybe_save(run: Run) -> bool:
    """Save a checkpoint when ``train.save_every`` falls on this step or on the last one. Returns whether a stop
    signal came to some process meanwhile: such a run then stops now rather than after one more step (one
    all-reduce per save, none per step)."""
    cfg, step = run.cfg, run.progress.step
    if not cfg.train.save_every or (step % cfg.train.save_every != 0 and step != run.total):
        return False
    save_checkpoint(run.accelerator, run.ckpt_dir, run.marked_progress(), run.rank_state(),
                    cfg.train.keep_checkpoints, agreed, needed=run.ckpt_bytes, model_meta=run.model_meta())
    run.saved_at = step
    return any_process(run.accelerator, run.stop.requested)


def stop_run(run: Run) -> None:
    """After a step on which some process got a stop signal: save a checkpoint (unless this step's was just
    saved) and raise RunStopped on every process."""
    accelerator, progress = run.accelerator, run.progress
    saved = run.ckpt_dir / f"{CKPT_PREFIX}{progress.step:08d}"
    if run.saved_at != progress.step:
        saved = save_checkpoint(accelerator, run.ckpt_dir, run.marked_progress(), run.rank_state(),
                                run.cfg.train.keep_checkpoints, agreed, needed=run.ckpt_bytes,
                                model_meta=run.model_meta())
    if run.bar is not None:
        run.bar.close()
    run.metrics.close()
    for problem in tracking.finish(accelerator, stopped=True):  # what the trackers buffer reaches their files
        run.log(problem)
    received = run.stop.received
    if accelerator.num_processes > 1:  # the signal may have reached some processes only (once per run)
        from accelerate.utils import gather_object

        received = next(name for name in gather_object([run.stop.received]) if name)
    how = "interrupted" if received == "SIGINT" else "preempted"
    err = RunStopped(f"{how} ({received}) at step {progress.step}; checkpoint saved to {saved}; "
                     f"re-run the same command to resume", exit_code(received))
    err.everywhere = True
    raise err


def finish_run(run: Run, last: Dict[str, Any]) -> Dict[str, Any]:
    """Save model/ (main process), then run the final evaluation and write the last record, draw the plots and
    end accelerate's run. Returns the last record; an evaluation that fails raises TrainingError naming where the
    model is, after everything else is done."""
    cfg, accelerator, progress, out_dir = run.cfg, run.accelerator, run.progress, run.out_dir
    if run.bar is not None:
        run.bar.close()
    accelerator.wait_for_everyone()
    eval_failure = None
    averaged = contextlib.ExitStack()  # model/ and the final evaluation use the EMA weights when train.ema_decay
    final_model = run.raw_model
    if fsdp.in_effect(accelerator):  # the full weights, gathered from every process's shards
        final_model = fsdp.full_model(accelerator, run.model, run.model_cfg)
    # model/, the final evaluation and the plots are the main process's: the others wait outside the default
    # group, whose timeout (NCCL's 10 min) need not cover them.
    with others_wait(accelerator, cfg.eval.timeout_s):
        if run.main:
            averaged.enter_context(swapped_in(run.ema, final_model))
            # At the last phase's size (a copy at that size when it is not the model's own): saved and evaluated.
            final_model, run.model_cfg, run.pp_cfg, run.tokenizer = phases.final_model(
                run.phases, final_model, run.model_cfg, run.pp_cfg, run.tokenizer)
            weights.save_model_dir(final_model, run.model_cfg, run.pp_cfg, run.layout.model,
                                   extra={"steps": progress.step, "samples": progress.samples})
            run.log(f"model saved to {run.layout.model}")
            # The final evaluation runs after model/ is written, so a failing evaluation never loses the model;
            # the run then ends with an error naming where the model is (exit code 2 from the command line).
            unwritten = last.get("step") == progress.step  # the final step's record, held back by log_record
            final = last if unwritten else {"step": progress.step, "samples": progress.samples}
            try:
                if fsdp.in_effect(accelerator):  # saved from the CPU, evaluated on the device
                    final_model = fsdp.for_evaluation(accelerator, final_model)
                results: Dict[str, Any] = {}
                final.update(run_eval(cfg, final_model, run.tokenizer, run.pp_cfg, accelerator, None,
                                      run.global_batch, results))
                if results:  # every set's whole result by name, as `mmcl zeroshot --out` writes one
                    atomic_write_text(run.layout.eval_results, json.dumps(dict(results, step=progress.step),
                                                                         indent=2) + "\n")
            except MmclError as err:
                eval_failure = (f"final evaluation failed: {err}; the trained model is saved in "
                                f"{run.layout.model} (evaluate it with mmcl zeroshot/retrieval --model {out_dir})")
            if unwritten or len(final) > 2:
                run.metrics.write(final)
                last = final
            if run.wise_init is not None and eval_failure is None:  # train.wise_ft, each alpha evaluated as above
                from ..storage.interpolate import run_start
                from .wise_ft import wise_ft_of_run

                for line in wise_ft_of_run(run.wise_init, run_start(cfg.model), final_model, run.model_cfg,
                                           run.pp_cfg, cfg.train.wise_ft, out_dir,
                                           lambda m: run_eval(cfg, m, run.tokenizer, run.pp_cfg, accelerator,
                                                              None, run.global_batch)):
                    run.log(line)
        averaged.close()
        del final_model  # the gathered FSDP replica
        run.metrics.close()
        if run.main and cfg.train.plot:
            try:
                from ..evaluation.plot import plot_run

                for p in plot_run(out_dir):
                    run.log(f"plot written: {p}")
            except ImportError as err:  # matplotlib is optional
                run.log(f"plots skipped: {err}")
    run.stream.skip_log.close()
    if run.main:  # the summary, also the end of out.log
        for line in runfolder.summary_lines(progress.step, progress.samples, time.perf_counter() - run.started[0],
                                            progress.samples - run.started[1],
                                            int(last.get("data/skipped_samples", 0)), progress.skipped_steps, last,
                                            run.layout.model, int(last.get("data/skipped_shards", 0)), run.skips):
            run.log(line)
    accelerator.end_training()
    if eval_failure is not None:
        raise TrainingError(eval_failure)
    return last


def _cpu_processes() -> bool:
    """True for several launched processes on a machine without an accelerator device.

    accelerate only treats processes as a CPU group (gloo) when asked to; otherwise each of them would run as a
    lone single process on its own data, silently training W separate models.
    """
    if world().size <= 1:
        return False
    has_device = getattr(torch, "accelerator", None)
    return not (has_device.is_available() if has_device is not None else torch.cuda.is_available())


def run_eval(cfg: TrainConfig, model, tokenizer, pp_cfg, accelerator, step: Optional[int] = None,
             global_batch: Optional[int] = None, results: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """The evaluations due after optimiser step `step` (None: the final one, every set), on the main process:
    returns their ``eval/<task>/<name>/<metric>`` and ``val/...`` entries, and puts each whole result into
    `results` by kind and name (`mmcl.evaluation.sets`). The validation loss scores batches of `global_batch`
    (the run's) with a fresh objective from ``loss.*`` in eval mode, so the training objective's state is untouched."""
    out: Dict[str, float] = {}
    if not accelerator.is_main_process or not eval_sets.has_evaluation(cfg.eval):
        return out
    from ..evaluation import evaluate

    sets, val_due = eval_sets.due(cfg.eval, step)
    if not sets and not val_due:
        return out
    _, eval_tf = models.build_transforms(pp_cfg)
    keys = data_mod.sample_keys(cfg.data)  # the training data's image and caption members
    reading = evaluate.reading_options(cfg.data)  # and its member size limit and pipe rule
    was_training = model.training
    model.eval()
    try:
        with accelerator.autocast():  # the run's mixed precision, as the validation loss and open_clip evaluate
            out.update(eval_sets.run_sets(sets, model, eval_tf, tokenizer, cfg.eval, accelerator.device, keys=keys,
                                          reading=reading, results=results))
        if val_due:
            objective = objective_from_config(cfg.loss)
            objective.reseed(cfg.train.seed)  # MoCHi's mixing draws: the same at every evaluation
            objective.to(accelerator.device).eval()
            res = eval_sets.validation_loss(model, objective, cfg.eval.val_loss, eval_tf, tokenizer,
                                            global_batch or cfg.data.batch_size, accelerator.device,
                                            chunk=cfg.eval.batch_size, keys=keys, reading=reading,
                                            autocast=accelerator.autocast)
            out.update(eval_sets.val_entries(res))
            if results is not None:
                results["val_loss"] = res
    finally:
        model.train(was_training)
    return out
