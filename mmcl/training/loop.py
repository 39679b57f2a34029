"""The training loop.

`train` reads top to bottom: the run folder's rule (`decide_folder`), the `Runtime` (processes, batch, steps),
the inputs checked, the run's frozen `Parts` (`mmcl.training.setup`: the accelerator, model, optimiser, objective,
data stream and `Step`), `resume_or_start`, then per step the learning rate, the phase, the batches, the `Step`
(`mmcl.training.step`: forward, loss, the finite-loss decision, backward, update, weight average) and `after_step`
(the progress, logging, saving, stopping: the host reads the device only where a step is logged or saved), and
`finish_run` (`mmcl.training.end`: model/ saved, then the final evaluation).

What changes during a run is one small typed object, `RunState` (the progress, the logging window, the step of the
last checkpoint, the progress bar); the parts are frozen, and the records (metrics.jsonl, out.log) are opened once.

Resumable: checkpoints are written into a temporary directory and renamed into place, then a ``latest``
pointer is replaced atomically; starting the same command on the same output directory continues from the
newest complete checkpoint with the same weights, optimiser, RNG and data position; on another number of
processes, with the same global batch and every sample of the epoch once (`mmcl.run.resume`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from accelerate.utils import gather_object
from omegaconf import OmegaConf

from ..config import TrainConfig, is_main_process, say, to_dict, world
from ..data.sources import redact_values
from ..errors import MmclError, RunStopped, TrainingError
from ..evaluation import in_run as eval_sets
from ..models import flip, siglip2
from ..run import folder as runfolder
from ..run import records as tracking
from ..run import resume
from ..run.console import progress_bar
from ..run.processes import agreed, any_process, lost_peer, timed_out
from ..run.records import MetricsLog, RunRecords
from ..run.signals import exit_code
from ..storage import checkpoints, pretrained
from ..storage.checkpoints import save_checkpoint
from ..storage.fsutil import atomic_write_text
from ..storage.layout import CKPT_PREFIX, CONFIG
from . import optim, phases
from .end import finish_run, log_record
from .optim import lr_at
from .plan import Runtime, check_launch, refuse_deepspeed
from .preflight import check_inputs
from .setup import Parts, describe_setup, setup, speed_basis
from .state import RunState
from .step import StepResult, settle_skipped


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Train as configured; returns the last logged metrics. Run under ``accelerate launch`` for several processes.

    Raises `MmclError` on bad input (on every process alike, so that the run ends with one line) and `RunStopped`
    after saving a checkpoint on SIGTERM, SIGUSR1 or SIGINT.
    """
    refuse_deepspeed()
    check_launch(world().size)  # a GPU launch file on a machine without GPUs; fewer processes than asked for
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


def _train(cfg: TrainConfig, held: contextlib.ExitStack) -> Dict[str, Any]:
    """The run from start to end: check the inputs, set up, resume, loop (step, log, save), finish."""
    # config.yaml records the architecture that is built
    cfg = dataclasses.replace(cfg, model=pretrained.record_pretrained_architecture(cfg.model))
    folder = decide_folder(cfg)  # the run folder's rule, before anything is read or written
    if folder.action == "finished":
        say(folder.line)
        return folder.last
    console = runfolder.ConsoleLog()
    if is_main_process():  # out.log: what this process prints, from here on
        held.push(console.start().stop)
    say(folder.line)
    # Every missing path in one error, a table given as shards, a global batch (as a resumed run keeps it) larger
    # than the data: before the model, the data workers or any step.
    rt = _agreed_everywhere(lambda: Runtime.plan(cfg.data, cfg.train, world().size))
    check_inputs(cfg.data, cfg.eval, cfg.model, cfg.distill, rt.processes, (rt.batch_size, rt.accum_steps))
    parts = setup(cfg, rt, held)
    if is_main_process():
        console.attach(parts.layout.out_log)
    state = RunState()
    records = resume_or_start(cfg, parts, state, folder, console if is_main_process() else None)
    if parts.phases or parts.stream.naflex is not None:
        # each batch's phase, or NaFlex length, follows from its place in the run, whatever the saved stream counted
        parts.stream.batches = state.progress.step * rt.accum_steps
    describe_setup(cfg, rt, parts.accelerator, parts.stream.workers)
    state.flops, state.peak, line = speed_basis(parts, cfg.train.precision, cfg.train.tf32)
    say(line)
    say(parts.stream.decode_line)
    data_iter = iter(parts.stream)
    # Closed when the run ends by any path, so the data workers are shut down before the interpreter exits
    # (an exception's traceback would otherwise keep them alive until multiprocessing's exit handler).
    held.callback(data_iter.close)
    last: Dict[str, Any] = {}
    state.start_window()
    parts.model.train()
    while state.progress.step < rt.total_steps:
        step = state.progress.step  # optimiser steps done; this one is step + 1
        lr = set_learning_rate(cfg, parts, step)
        if parts.patch_dropout:  # FLIP masks at this step's phase rate; none in the last train.unmasked_steps
            flip.begin_step(parts.patch_dropout, step, step < rt.total_steps - cfg.train.unmasked_steps,
                            phases.patch_dropout_at(parts.phases, step, cfg.model.patch_dropout))
        if parts.siglip2 is not None:  # SigLIP 2's second stage: its terms from their start fractions on
            parts.siglip2.begin_step(step, parts.accelerator.device)
        with parts.stop.waiting_for_data():  # a stop signal is never held back by a read that does not return
            batches = next_batches(parts, state, data_iter)
        result = parts.step(batches, step + 1, logged_at(cfg, rt, step + 1), lambda: parts.stop.requested)
        last = after_step(cfg, parts, state, records, result, lr, last)
    if parts.siglip2 is not None:  # model/ and exports are the student's CLIP: the heads are training parts
        parts.siglip2.detach()
        if parts.ema is not None:
            parts.ema.drop(siglip2.HEADS + ".")
    return finish_run(parts, state, records, last)


def _agreed_everywhere(fn):
    """`fn()`, its MmclError said once (every process finds it alike)."""
    try:
        return fn()
    except MmclError as err:
        err.everywhere = True
        raise


def logged_at(cfg: TrainConfig, rt: Runtime, step: int) -> bool:
    """Whether the metrics of optimiser step `step` (1-based) are written: every ``train.log_every`` steps, the last
    step, and every evaluation step (each set's ``every`` counts on its own, its results go in that record)."""
    return step % cfg.train.log_every == 0 or step == rt.total_steps or eval_sets.any_due(cfg.eval, step,
                                                                                          rt.total_steps)


def decide_folder(cfg: TrainConfig) -> runfolder.Decision:
    """`runfolder.decide` for this launch (every process alike; rank 0 alone says a refusal)."""
    processes = world().size
    steps = lambda: Runtime.plan(cfg.data, cfg.train, processes).total_steps  # noqa: E731 - as a resumed run counts
    return _agreed_everywhere(lambda: runfolder.decide(to_dict(cfg), processes, steps))


def restorable(parts: Parts, state: RunState) -> resume.Restorable:
    """What a checkpoint restores on this process."""
    return resume.Restorable(parts.accelerator, parts.raw_model, parts.objective, parts.ema, parts.stream,
                             state.progress, say, parts.siglip2)


def resume_or_start(cfg: TrainConfig, parts: Parts, state: RunState, folder: runfolder.Decision,
                    console: Optional[runfolder.ConsoleLog]) -> RunRecords:
    """Resume from the newest intact checkpoint if there is one; write config.yaml and the run's record when the
    run starts (or is forced on: `runfolder`), never on a plain resume; open the metrics log and the trackers."""
    accelerator, layout, config = parts.accelerator, parts.layout, to_dict(cfg)
    resumed = resume.resume_from_newest(accelerator, layout.checkpoints, lambda path: resume.load_checkpoint(
        restorable(parts, state), path, config, layout), say)
    if resumed is not None:
        say(f"resuming from {resumed} at step {state.progress.step}" + optim.schedule_change(
            parts.optimizer, cfg.optim, state.progress.step, parts.rt.total_steps))
    agreed(accelerator, lambda: _write_config(parts, config, folder))
    if cfg.train.save_every and is_main_process():
        warning = checkpoints.free_space_warning(layout.root, parts.ckpt_bytes)
        if warning:
            say(warning)
    metrics = agreed(accelerator, lambda: MetricsLog(layout.root, state.progress.step, is_main_process(),
                                                     accelerator))
    state.started = (time.perf_counter(), state.progress.samples)

    def start_trackers():
        try:
            tracking.start(accelerator, cfg.train.log_with, config, layout.root, state.progress.step)
        except OSError as err:
            raise (checkpoints.storage_error(err, "trackers", layout.root) or err) from None

    agreed(accelerator, start_trackers)
    return RunRecords(metrics, console)


def _write_config(parts: Parts, config: Dict[str, Any], folder: runfolder.Decision) -> None:
    """The run's record, config.yaml and param_groups.json, on the main process of a run that starts here."""
    if not is_main_process():
        return
    layout = parts.layout
    try:
        if folder.stale_skips:  # an earlier attempt's skips are not this run's
            runfolder.clear_stale_skips(layout.root)
        if folder.write_config or runfolder.read_record(layout.root) is None:  # the folder is this run's
            runfolder.write_record(layout.root, parts.accelerator.num_processes, parts.rt.global_batch)
        if folder.write_config:
            # Credentials in a pipe: command or URL never reach the run folder (a colleague's copy of it).
            atomic_write_text(layout.config, OmegaConf.to_yaml(OmegaConf.create(redact_values(config))))
            optim.write_groups(parts.param_groups, layout.root)
    except OSError as err:
        raise (checkpoints.storage_error(err, CONFIG, layout.root) or err) from None


def set_learning_rate(cfg: TrainConfig, parts: Parts, step: int) -> float:
    """Set the scheduled learning rate of the coming optimiser step (after `step` done) on every parameter group;
    returns it (the base rate; each group's is scaled by its ``lr_scale``)."""
    lr = lr_at(step, cfg.optim, parts.rt.total_steps)
    optim.set_lr(parts.optimizer, lr)  # times each group's lr_scale (per-tower and layer-wise rates)
    return lr


def next_batches(parts: Parts, state: RunState, data_iter) -> List[Dict[str, Any]]:
    """The coming step's ``train.accum_steps`` micro-batches; the wait counts towards ``data_time_frac``."""
    t0 = time.perf_counter()
    batches = [next(data_iter) for _ in range(parts.rt.accum_steps)]
    state.data_time += time.perf_counter() - t0
    return batches


def after_step(cfg: TrainConfig, parts: Parts, state: RunState, records: RunRecords, result: StepResult, lr: float,
               last: Dict[str, Any]) -> Dict[str, Any]:
    """The progress after a step, then the log record, the checkpoint and a stop, each where it falls. Returns the
    last logged record.

    A step the host decided to skip (`Step`) is counted here; the steps the device skipped are found where the host
    reads their flags, on logged and saved steps (and the last, or a stop), and taken off the progress then. One
    process reads its own stop flag every step; several agree on logged and saved steps (and with each host
    decision)."""
    rt, progress = parts.rt, state.progress
    if result.applied:
        count_step(parts, state, result.pairs, cfg.train.progress)
    step, save_every = progress.step + (not result.applied), cfg.train.save_every
    logged = logged_at(cfg, rt, step)
    read = logged or step == rt.total_steps or bool(save_every and step % save_every == 0)
    stopping = result.stop
    if stopping is None:  # one process reads its own flag; several agree where the host reads the device anyway
        stopping = parts.stop.requested if rt.processes == 1 else read and any_process(parts.accelerator,
                                                                                      parts.stop.requested)
    skipped_now = settle_skipped(parts.step.checks, state, result.applied, result.loss, read or stopping,
                                 lambda s: step_samples(parts, s), rt.processes, cfg.train.nan_policy,
                                 parts.layout.checkpoints)
    if logged and not skipped_now:  # a skipped step is not logged
        last = log_record(parts, state, records, result, lr, eval_sets.any_due(cfg.eval, step, rt.total_steps))
    stopping = maybe_save(cfg, parts, state) or stopping
    if stopping and step < rt.total_steps:  # on the last step the run simply finishes
        stop_run(cfg, parts, state, records)
    return last


def step_samples(parts: Parts, step: int) -> int:
    """The samples of optimiser step `step` (1-based) over all processes: the global batch, or with NaFlex the pairs
    its micro-batches' drawn lengths fit (the same on every process)."""
    plan, rt = parts.stream.naflex, parts.rt
    if plan is None:
        return rt.global_batch
    first = (step - 1) * rt.accum_steps
    return sum(plan.pairs_at(b) for b in range(first, first + rt.accum_steps)) * rt.processes


def count_step(parts: Parts, state: RunState, pairs: Optional[int] = None, show_bar: bool = False) -> None:
    """Advance the progress (and the progress bar, with `show_bar`) by one applied optimiser step of `pairs` samples
    over all processes (None: the run's global batch; NaFlex steps vary)."""
    n = parts.rt.global_batch if pairs is None else pairs
    state.progress.step += 1
    state.progress.samples += n
    state.window_samples += n
    if show_bar and is_main_process() and state.bar is None:
        # Created after the first step, so a data or config error is not preceded by an empty bar. Lines printed
        # while it is shown (warnings, log lines) are written through it, each on its own line.
        state.bar = progress_bar(parts.rt.total_steps, state.progress.step - 1, parts.held, desc="train",
                                 unit="step", dynamic_ncols=True)
    if state.bar is not None:
        state.bar.update(1)


def save(cfg: TrainConfig, parts: Parts, state: RunState) -> Path:
    """A checkpoint of this step: accelerate's state, each process's rank state (its data position, the objective's
    state, the progress and, on the main process, the weight average) and the architecture, with the global batch
    in its COMPLETE marker."""
    progress = state.progress
    rank_state = {"data": parts.stream.state_dict(), "objective": parts.objective.state_dict(),
                  "progress": progress.state_dict()}
    if is_main_process() and parts.ema is not None:
        rank_state["ema"] = parts.ema.state_dict()  # the same on every process: saved once
    if is_main_process() and parts.siglip2 is not None:
        rank_state[resume.TEACHER] = parts.siglip2.state_dict()  # the EMA teacher and its centres, likewise
    marked = dict(progress.state_dict(), **{resume.GLOBAL_BATCH: parts.rt.global_batch})
    state.saved_at = progress.step
    return save_checkpoint(parts.accelerator, parts.layout.checkpoints, marked, rank_state,
                           cfg.train.keep_checkpoints, agreed, needed=parts.ckpt_bytes, model_meta=parts.meta())


def maybe_save(cfg: TrainConfig, parts: Parts, state: RunState) -> bool:
    """Save a checkpoint when ``train.save_every`` falls on this step or on the last one. Returns whether a stop
    signal came to some process meanwhile: such a run then stops now rather than after one more step (one
    all-reduce per save, none per step)."""
    every, step = cfg.train.save_every, state.progress.step
    if not every or (step % every != 0 and step != parts.rt.total_steps):
        return False
    save(cfg, parts, state)
    return any_process(parts.accelerator, parts.stop.requested)


def stop_run(cfg: TrainConfig, parts: Parts, state: RunState, records: RunRecords) -> None:
    """After a step on which some process got a stop signal: save a checkpoint (unless this step's was just
    saved) and raise RunStopped on every process."""
    accelerator, progress = parts.accelerator, state.progress
    saved = parts.layout.checkpoints / f"{CKPT_PREFIX}{progress.step:08d}"
    if state.saved_at != progress.step:
        saved = save(cfg, parts, state)
    if state.bar is not None:
        state.bar.close()
    records.metrics.close()
    for problem in tracking.finish(accelerator, stopped=True):  # what the trackers buffer reaches their files
        say(problem)
    received = parts.stop.received
    if accelerator.num_processes > 1:  # the signal may have reached some processes only (once per run)
        received = next(name for name in gather_object([parts.stop.received]) if name)
    how = "interrupted" if received == "SIGINT" else "preempted"
    err = RunStopped(f"{how} ({received}) at step {progress.step}; checkpoint saved to {saved}; "
                     f"re-run the same command to resume", exit_code(received))
    err.everywhere = True
    raise err
