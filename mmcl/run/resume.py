"""Resuming a run: the newest intact checkpoint, the checks that it fits this run, and loading it, on the number of
processes it was written with or on another.

`resume_from_newest` picks the newest intact checkpoint (damaged ones are set aside and named) and loads it with
`load_checkpoint`: the weights, optimiser, scheduler and RNG through accelerate, then this process's rank state
(data position, the objective's state, the progress and the weight average), every file as plain data. A change of
architecture (`ARCH_KEYS`) is an error (`check_resumable`); whether the folder holds this run at all is the run
folder's rule (`mmcl.run.folder`), applied before anything is built.

On another number of processes: the run's `Runtime` keeps the global batch (`mmcl.training.plan.batch_plan` sets the
per-process ``data.batch_size`` and, when it must, ``train.accum_steps``), so the schedule, ``train.samples`` and the
number of steps stay as they were. `load_resized` loads the checkpoint on the new processes: the weights and optimiser
state (the same on every process), the loss's state (its queues hold features gathered over all processes, so they are
the same on every process) and the data positions of every saved process, from which the stream continues so that every
sample of the epochs under way is read exactly once (`mmcl.data.pipeline.resized_positions`).

The batches: without data workers (one slot per process, before and after) the rest of the epoch is batched
as the saved run would have batched it, so the resumed run ends with the uninterrupted run's weights within
float32 noise; each new process then reads the raw bytes of the whole rest of that epoch. With data workers the
rest is dealt by shard or shared by sample: each sample once, other batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from accelerate.utils import load
from omegaconf import OmegaConf
from safetensors import safe_open

from ..config import is_main_process, to_dict
from ..data.sources import redact_values
from ..errors import CheckpointError, DamagedCheckpointError, MmclError
from ..storage import checkpoints
from . import folder as runfolder
from .processes import agreed, broadcast_from_main

GLOBAL_BATCH = runfolder.GLOBAL_BATCH  # recorded in each checkpoint's COMPLETE marker and the run's record


@dataclasses.dataclass
class Restorable:
    """What a checkpoint restores on this process: accelerate's state (through `accelerator`: the weights of
    `raw_model`, the optimiser, scaler and RNG), the objective's state, the weight average, the data position and
    the progress. `log` says what happened."""

    accelerator: Any
    raw_model: Any
    objective: Any
    ema: Any
    stream: Any
    progress: Any
    log: Callable[[str], None]
    teacher: Any = None  # loss.self_distill / loss.masked: the EMA teacher and its centres (rank 0's state)


def load_resized(run: Restorable, resume: Path, saved_processes: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
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
    load_weights_and_optimizer(run, resume)
    why = run.stream.load_resized([st["data"] for st in states])
    if why is not None:
        run.log(f"warning: {why}; restarting the earliest saved epoch, each sample is not seen exactly once")
    own = states[accelerator.process_index] if accelerator.process_index < saved_processes else states[0]
    check_objective_state(run.objective, own["objective"], resume)
    run.objective.load_state_dict(own["objective"])
    return own, states[0]


# Rank 0's state key of the self-distillation teacher (`mmcl.models.siglip2.Siglip2.state_dict`)
TEACHER = "siglip2_teacher"

# Changing any of these makes a checkpoint unusable; other config differences only warn.
ARCH_KEYS = ("model.name", "model.embed_dim", "model.image_size", "model.context_length", "model.vision_cfg",
             "model.text_cfg", "model.text")


def load_weights_and_optimizer(run: Restorable, resume: Path) -> None:
    """accelerate's state of `resume` (weights, optimiser, scaler, RNG) into the run; weights that do not fit the
    run's model are a CheckpointError naming the keys (`weights_mismatch`), not torch's many-line message."""
    try:
        checkpoints.load_accelerate_state(run.accelerator, resume)
        not_restored = generators_not_restored(resume, run.accelerator.process_index)
    except RuntimeError:
        why = weights_mismatch(run.raw_model, resume / checkpoints.MODEL_WEIGHTS)
        if why is None:
            raise
        raise CheckpointError(f"cannot resume from {resume}: its weights do not fit this run's model (another "
                              f"architecture or loss than the run was started with?): {why}; choose another "
                              f"train.output_dir for a new run, or resume with the settings in its config.yaml"
                              ) from None
    if not_restored:
        run.log(not_restored)


def weights_mismatch(model, weights_file: Path, shown: int = 3) -> Optional[str]:
    """How the weights saved in `weights_file` (safetensors) differ from `model`'s: the missing, unexpected and
    reshaped keys, each with its count and its first few; None when they fit or the file cannot say."""
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 - no such file (a sharded FSDP checkpoint) or a damaged one
        return None
    now = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in now if k not in saved]
    unexpected = [k for k in saved if k not in now]
    reshaped = [f"{k} saved {list(saved[k])}, now {list(now[k])}" for k in now if k in saved and saved[k] != now[k]]

    def few(keys) -> str:
        return ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")

    parts = [f"{len(missing)} missing key(s) ({few(missing)})" if missing else "",
             f"{len(unexpected)} unexpected key(s) ({few(unexpected)})" if unexpected else "",
             f"{len(reshaped)} of another shape ({few(reshaped)})" if reshaped else ""]
    parts = [p for p in parts if p]
    return "; ".join(parts) if parts else None


def check_resumable(saved: Dict[str, Any], current: Dict[str, Any], log) -> None:
    """An architecture change is an error, whatever ``train.resume`` says: the weights would not load. (Other
    differences were judged, and said, by the run folder's rule before anything was built: `runfolder.decide`.)"""
    a, b = runfolder.flat(saved), runfolder.flat(current)
    arch = [k for k in ARCH_KEYS if a.get(k) != b.get(k)]
    if arch:
        raise CheckpointError(
            "cannot resume: the checkpoint's model differs in "
            + ", ".join(f"{k} (saved {a.get(k)!r}, now {b.get(k)!r})" for k in arch)
            + "; choose another train.output_dir for a new run")


def resume_from_newest(accelerator, ckpt_dir: Path, load, log) -> Optional[Path]:
    """Load the newest intact checkpoint with `load(path)` on every process; returns its path or None (none saved).

    Checkpoints whose files do not match their COMPLETE marker are renamed aside (`checkpoints.set_aside`) and
    named in a log line, then the next older one is tried. When checkpoints exist but none is intact, nothing is
    renamed and CheckpointError is raised: a run never starts afresh over the user's checkpoints on its own.
    """
    main = is_main_process()
    while True:
        def choose():
            if not main:
                return None
            damaged, usable = checkpoints.damaged_and_usable(ckpt_dir)
            if damaged and usable is None:
                raise CheckpointError(
                    f"cannot resume: no checkpoint in {ckpt_dir} is intact ("
                    + "; ".join(f"{d.name}: {why}" for d, why in damaged)
                    + "); nothing was changed. Move the checkpoints directory aside to start afresh")
            for d, why in damaged:
                kept = checkpoints.set_aside(d)
                log(f"warning: checkpoint {d.name} is damaged ({why}); kept as {kept}; resuming from {usable.name}")
            return usable

        resume = broadcast_from_main(accelerator, agreed(accelerator, choose))
        if resume is None:
            return None

        def load_it():
            try:
                load(resume)
            except MmclError:
                raise
            except Exception as err:  # noqa: BLE001 - reported as one line below
                first_line = str(err).splitlines()[0] if str(err) else ""
                what = f"cannot resume from {resume}: {type(err).__name__}: {first_line}"
                if "files" in checkpoints.read_marker(resume):
                    raise CheckpointError(what) from err  # intact files that do not load: not damage, a real error
                raise DamagedCheckpointError(what) from err  # written before checksums: treat as damaged

        try:
            agreed(accelerator, load_it)
            return resume
        except DamagedCheckpointError as err:
            if main:
                kept = checkpoints.set_aside(resume)
                log(f"warning: {err}; kept as {kept}")
            if accelerator.num_processes > 1:
                accelerator.wait_for_everyone()


def load_checkpoint(run: Restorable, resume: Path, cfg, layout) -> None:
    """Load `resume` into `run` on this process (weights, optimiser, RNG, progress, data position, objective),
    after checking that the run folder's config.yaml (`layout`, a `RunLayout`) has the architecture of `cfg`."""
    accelerator = run.accelerator
    if layout.config.is_file():

        check_resumable(OmegaConf.to_container(OmegaConf.load(layout.config)),
                        redact_values(to_dict(cfg)), run.log)  # config.yaml holds no credentials
    saved_processes = int(checkpoints.read_marker(resume).get("world_size", accelerator.num_processes))
    if saved_processes != accelerator.num_processes:
        own, first = load_resized(run, resume, saved_processes)
        return restore_progress(run, resume, own, first)
    rank_file = checkpoints.rank_state_file(resume, accelerator.process_index)
    if not rank_file.is_file():
        if checkpoints.read_marker(resume).get("world_size", 0) != accelerator.num_processes:
            raise CheckpointError(f"{resume} was written by a run with a different number of processes "
                                  f"(no {rank_file.name}); resume with the same launch configuration")
        raise DamagedCheckpointError(f"cannot resume from {resume}: {rank_file.name} is missing")
    # Every file as plain data (`checkpoints.load_plain`), on the CPU: a CPU generator state must stay there,
    # and load_state_dict copies the rest onto this process's device.
    rank_state = checkpoints.load_plain(rank_file)
    from_first = run.ema is not None or run.teacher is not None  # saved by rank 0 alone
    first = rank_state if accelerator.process_index == 0 or not from_first else checkpoints.load_plain(
        checkpoints.rank_state_file(resume, 0))
    restore_progress(run, resume, rank_state, first)
    load_weights_and_optimizer(run, resume)
    run.stream.load_state_dict(rank_state["data"])
    check_objective_state(run.objective, rank_state["objective"], resume)
    run.objective.load_state_dict(rank_state["objective"])


def restore_progress(run: Restorable, resume: Path, own: Dict[str, Any], first: Dict[str, Any]) -> None:
    """Set the run's progress from this process's rank state `own` and its EMA from rank 0's (`first`); a
    checkpoint written when both were registered with accelerate has them in ``custom_checkpoint_<i>.pkl``
    files instead, read as plain data (any such file present is read, so one that is not plain data is refused)."""
    legacy = checkpoints.legacy_custom_states(resume)
    progress = own.get("progress", legacy.get(checkpoints.LEGACY_PROGRESS))
    if not isinstance(progress, dict):
        raise CheckpointError(f"cannot resume from {resume}: it records no training progress")
    run.progress.load_state_dict(progress)
    if run.ema is not None:
        ema = first.get("ema", legacy.get(checkpoints.LEGACY_EMA))
        if not isinstance(ema, dict):
            raise CheckpointError(f"cannot resume from {resume}: it holds no weight average (was train.ema_decay "
                                  f"unset when it was written?); unset train.ema_decay or start a new run")
        run.ema.load_state_dict(ema)
    if run.teacher is not None:
        teacher = first.get(TEACHER)
        if not isinstance(teacher, dict):
            raise CheckpointError(f"cannot resume from {resume}: it holds no self-distillation teacher (were "
                                  f"loss.self_distill and loss.masked off when it was written?); set their weights "
                                  f"as then, or start a new run")
        try:
            run.teacher.load_state_dict(teacher)
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"cannot resume from {resume}: {err}") from None


def check_objective_state(objective, state: Dict[str, Any], resume: Path) -> None:
    """A checkpoint's MoCHi queues must fit the configured ``loss.mochi.queue_size``, and its global contrastive
    estimates ``loss.global_contrastive``; CheckpointError if not."""
    for name in ("image_queue", "text_queue"):
        saved = state.get(f"{name}.features")
        size = getattr(objective, name).size
        if saved is not None and (saved.dim() != 2 or saved.shape[0] not in (0, size)):
            raise CheckpointError(
                f"cannot resume from {resume}: its MoCHi queue has shape {tuple(saved.shape)}, expected "
                f"({size}, D) (loss.mochi.queue_size changed?)")
    # The global contrastive term's per-sample estimates: present exactly when the term is, at the table's size.
    saved = state.get("global_estimates.log_u_image")
    estimates = getattr(objective, "global_estimates", None)
    if (saved is None) != (estimates is None):
        now, then = ("on", "off") if saved is None else ("off", "on")
        raise CheckpointError(
            f"cannot resume from {resume}: the global contrastive term is {now} (loss.global_contrastive.weight) but "
            f"was {then} when the checkpoint was written; set it back, or start a new run")
    if saved is not None and tuple(saved.shape) != (estimates.table_size,):
        raise CheckpointError(
            f"cannot resume from {resume}: its global contrastive estimates have {saved.shape[0]} slots, expected "
            f"{estimates.table_size} (loss.global_contrastive.table_size changed?)")


def generators_not_restored(ckpt: Path, process_index: int) -> Optional[str]:
    """One warning line naming the generators whose state `ckpt` holds for this process but that do not now hold
    it (None: all restored). Asked right after `load_accelerate_state`: accelerate's load skips the random states on any
    error with a log line at INFO only: a dropout tower would then draw other masks."""

    name = f"random_states_{process_index}.pkl"
    try:
        saved = load(Path(ckpt) / name, map_location="cpu")
    except Exception as err:  # absent or unreadable: accelerate could not have restored it either
        return f"warning: {ckpt}: the random generators were not restored ({name}: {type(err).__name__}); " \
               f"dropout and other random draws continue from the seed, not from the checkpoint"
    current = {"torch_manual_seed": lambda: torch.get_rng_state()}
    if torch.cuda.is_available():
        current["torch_cuda_manual_seed"] = lambda: torch.cuda.get_rng_state_all()
    wrong = [key for key, now in current.items()
             if key in saved and not _same_states(now(), saved[key])]
    if not wrong:
        return None
    names = {"torch_manual_seed": "the CPU generator", "torch_cuda_manual_seed": "the CUDA generators"}
    return (f"warning: {ckpt}: {' and '.join(names[k] for k in wrong)} not restored from {name}; dropout and "
            f"other random draws continue from the seed, not from the checkpoint")


def _same_states(now: Any, saved: Any) -> bool:
    now, saved = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (now, saved))
    return len(now) == len(saved) and all(a.cpu().equal(b.cpu()) for a, b in zip(now, saved))
