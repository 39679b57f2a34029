"""The training loop.

`train` reads top to bottom: the run folder's rule (`decide_folder`), the `Runtime` (processes, batch, steps),
the inputs checked, the accelerator and the run's parts (`mmcl.training.setup`), `resume_or_start`, then per step
`Step` (`mmcl.training.step`: forward, loss, the finite-loss decision, backward, update, weight average) and
`after_step` (the progress, logging, saving, stopping: the host reads the device only where a step is logged or
saved), and `finish_run` (`mmcl.training.end`: model/ saved, then the final evaluation). A `Run` holds what
these share.

Resumable: checkpoints are written into a temporary directory and renamed into place, then a ``latest``
pointer is replaced atomically; starting the same command on the same output directory continues from the
newest complete checkpoint with the same weights, optimiser, RNG and data position; on another number of
processes, with the same global batch and every sample of the epoch once (`mmcl.run.resume`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..config import TrainConfig, is_main_process, to_dict, world
from ..data.sources import redact_values
from ..errors import MmclError, RunStopped, TrainingError, printable
from ..evaluation import in_run as eval_sets
from ..models import flip
from ..run import folder as runfolder
from ..run import records as tracking
from ..run import resume
from ..run.processes import agreed, any_process, lost_peer, timed_out
from ..run.records import MetricsLog
from ..run.signals import StopSignals, exit_code
from ..storage import checkpoints, pretrained
from ..storage.checkpoints import CKPT_PREFIX, latest_checkpoint, save_checkpoint
from ..storage.fsutil import atomic_write_text
from ..storage.layout import CONFIG, RunLayout
from . import optim, phases
from .optim import lr_at
from .plan import Runtime, accelerator_for, refuse_deepspeed
from .setup import Trainee, build_trainee, describe_setup, take_folder
from .step import Step, StepResult


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


def _train(cfg: TrainConfig, held: contextlib.ExitStack) -> Dict[str, Any]:
    """The run from start to end: check the inputs, build, prepare, resume, loop (step, log, save), finish."""
    from .end import finish_run
    from .preflight import check_inputs

    main = is_main_process()
    cfg = pretrained.record_pretrained_architecture(cfg)  # config.yaml records the architecture that is built
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
    rt = _agreed_everywhere(lambda: Runtime.plan(cfg, world().size))
    check_inputs(cfg, rt.processes, (rt.batch_size, rt.accum_steps))
    run = build_run(cfg, rt, held)
    if main:
        console.attach(run.layout.out_log)
        run.console = console
    resume_or_start(run, folder)
    if run.trainee.phases or run.stream.naflex is not None:
        # each batch's phase, or NaFlex length, follows from its place in the run, whatever the saved stream counted
        run.stream.batches = run.progress.step * rt.accum_steps
    describe_setup(cfg, rt, run.accelerator, run.stream.workers)
    data_iter = iter(run.stream)
    # Closed when the run ends by any path, so the data workers are shut down before the interpreter exits
    # (an exception's traceback would otherwise keep them alive until multiprocessing's exit handler).
    held.callback(data_iter.close)
    last: Dict[str, Any] = {}
    run.start_window()
    run.trainee.model.train()
    while run.progress.step < rt.total_steps:
        lr = set_learning_rate(run)
        if run.trainee.patch_dropout:  # FLIP masks at this step's phase rate; none in the last train.unmasked_steps
            flip.begin_step(run.trainee.patch_dropout, run.progress.step,
                            run.progress.step < rt.total_steps - cfg.train.unmasked_steps,
                            phases.patch_dropout_at(run.trainee.phases, run.progress.step, cfg.model.patch_dropout))
        batches = next_batches(run, data_iter)
        result = run.step(batches, run.progress.step + 1, run.logged_at(run.progress.step + 1),
                          lambda: run.stop.requested)
        last = after_step(run, result, lr, last)
    return finish_run(run, last)


def _agreed_everywhere(fn):
    """`fn()`, its MmclError said once (every process finds it alike)."""
    try:
        return fn()
    except MmclError as err:
        err.everywhere = True
        raise


class Run:
    """What one training run holds: its config and `Runtime`, accelerate's accelerator, the `Trainee` (model,
    optimiser, objective), the data stream and the `Step`, the folder's `RunLayout`, the progress, and the counters
    of the current logging window. `build_run` makes it."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, accelerator, stop: StopSignals, held: contextlib.ExitStack):
        self.cfg, self.rt, self.accelerator, self.stop, self.held = cfg, rt, accelerator, stop, held
        self.main = accelerator.is_main_process
        self.layout = RunLayout(cfg.train.output_dir)
        self.progress = TrainProgress()
        self.trainee: Optional[Trainee] = None
        self.stream = None
        self.step: Optional[Step] = None
        self.saved_at = -1  # the step of the last checkpoint this run saved
        self.bar = None  # the progress bar, from the first step on (main process, train.progress)
        self.console: Optional[runfolder.ConsoleLog] = None  # out.log (main process)
        self.metrics: Optional[MetricsLog] = None
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
        return step % self.cfg.train.log_every == 0 or step == self.rt.total_steps or self.evaluated_at(step)

    def evaluated_at(self, step: int) -> bool:
        """Whether a periodic evaluation (a set's or ``eval.val_loss``'s ``every``) runs after optimiser step `step`;
        the last step has the final evaluation instead."""
        return eval_sets.any_due(self.cfg.eval, step, self.rt.total_steps)

    def start_window(self) -> None:
        self.window_start, self.window_samples, self.data_time = time.perf_counter(), 0, 0.0

    def restorable(self) -> resume.Restorable:
        """What a checkpoint restores on this process."""
        t = self.trainee
        return resume.Restorable(self.accelerator, t.raw_model, t.objective, t.ema, self.stream, self.progress,
                                 self.log)

    def save(self) -> Path:
        """A checkpoint of this step: accelerate's state, each process's rank state (its data position, the
        objective's state, the progress and, on the main process, the weight average) and the architecture, with
        the global batch in its COMPLETE marker."""
        t = self.trainee
        state = {"data": self.stream.state_dict(), "objective": t.objective.state_dict(),
                 "progress": self.progress.state_dict()}
        if self.main and t.ema is not None:
            state["ema"] = t.ema.state_dict()  # the same on every process: saved once
        marked = dict(self.progress.state_dict(), **{resume.GLOBAL_BATCH: self.rt.global_batch})
        self.saved_at = self.progress.step
        return save_checkpoint(self.accelerator, self.layout.checkpoints, marked, state,
                               self.cfg.train.keep_checkpoints, agreed, needed=self.ckpt_bytes, model_meta=t.meta())


def build_run(cfg: TrainConfig, rt: Runtime, held: contextlib.ExitStack) -> Run:
    """The accelerator, signal handlers, the run folder's lock and the run's parts (`build_trainee`)."""
    from accelerate.utils import set_seed

    accelerator = accelerator_for(cfg)
    run = Run(cfg, rt, accelerator, held.enter_context(StopSignals()), held)
    take_folder(accelerator, run.layout, held)
    if rt.resized_line:  # a checkpoint written by another number of processes: the same global batch
        run.log(rt.resized_line)
    optim.check_schedule(cfg.optim, rt.total_steps)
    set_seed(cfg.train.seed)
    run.trainee, run.stream, run.step = build_trainee(cfg, rt, accelerator, run.layout)
    return run


def decide_folder(cfg: TrainConfig) -> runfolder.Decision:
    """`runfolder.decide` for this launch (every process alike; rank 0 alone says a refusal)."""
    processes = world().size
    return _agreed_everywhere(lambda: runfolder.decide(
        cfg, processes, lambda: Runtime.plan(cfg, processes).total_steps))  # the steps as a resumed run counts them


def resume_or_start(run: Run, folder: runfolder.Decision) -> None:
    """Resume from the newest intact checkpoint if there is one; write config.yaml and the run's record when the
    run starts (or is forced on: `runfolder`), never on a plain resume; open the metrics log and the trackers."""
    resumed = resume.resume_from_newest(run.accelerator, run.layout.checkpoints,
                                        lambda path: resume.load_checkpoint(run.restorable(), path, run.cfg,
                                                                            run.layout), run.log)
    if resumed is not None:
        run.log(f"resuming from {resumed} at step {run.progress.step}" + optim.schedule_change(
            run.trainee.optimizer, run.cfg.optim, run.progress.step, run.rt.total_steps))
    agreed(run.accelerator, lambda: _write_config(run, folder))
    run.ckpt_bytes = checkpoints.state_bytes(run.trainee.raw_model)
    if run.main and run.cfg.train.save_every:
        warning = checkpoints.free_space_warning(run.layout.root, run.ckpt_bytes)
        if warning:
            run.log(warning)
    run.metrics = agreed(run.accelerator, lambda: MetricsLog(run.layout.root, run.progress.step, run.main,
                                                             run.accelerator))
    run.started = (time.perf_counter(), run.progress.samples)

    def start_trackers():
        try:
            tracking.start(run.accelerator, run.cfg.train.log_with, to_dict(run.cfg), run.layout.root,
                           run.progress.step)
        except OSError as err:
            raise (checkpoints.storage_error(err, "trackers", run.layout.root) or err) from None

    agreed(run.accelerator, start_trackers)


def _write_config(run: Run, folder: runfolder.Decision) -> None:
    """The run's record, config.yaml and param_groups.json, on the main process of a run that starts here."""
    if not run.main:
        return
    try:
        if folder.write_config or runfolder.read_record(run.layout.root) is None:  # the folder is this run's
            runfolder.write_record(run.layout.root, run.accelerator.num_processes, run.rt.global_batch)
        if folder.write_config:
            # Credentials in a pipe: command or URL never reach the run folder (a colleague's copy of it).
            from omegaconf import OmegaConf

            atomic_write_text(run.layout.config, OmegaConf.to_yaml(OmegaConf.create(redact_values(to_dict(run.cfg)))))
            optim.write_groups(run.trainee.param_groups, run.layout.root)
    except OSError as err:
        raise (checkpoints.storage_error(err, CONFIG, run.layout.root) or err) from None


def set_learning_rate(run: Run) -> float:
    """Set the scheduled learning rate of the coming optimiser step on every parameter group; returns it (the
    base rate; each group's is scaled by its ``lr_scale``)."""
    lr = lr_at(run.progress.step, run.cfg.optim, run.rt.total_steps)
    optim.set_lr(run.trainee.optimizer, lr)  # times each group's lr_scale (per-tower and layer-wise rates)
    return lr


def next_batches(run: Run, data_iter) -> List[Dict[str, Any]]:
    """The coming step's ``train.accum_steps`` micro-batches; the wait counts towards ``data_time_frac``."""
    t0 = time.perf_counter()
    batches = [next(data_iter) for _ in range(run.rt.accum_steps)]
    run.data_time += time.perf_counter() - t0
    return batches


def after_step(run: Run, result: StepResult, lr: float, last: Dict[str, Any]) -> Dict[str, Any]:
    """The progress after a step, then the log record, the checkpoint and a stop, each where it falls. Returns the
    last logged record.

    A step the host decided to skip (`Step`) is counted here; the steps the device skipped are found where the host
    reads their flags, on logged and saved steps (and the last, or a stop), and taken off the progress then. One
    process reads its own stop flag every step; several agree on logged and saved steps (and with each host
    decision)."""
    rt, checks = run.rt, run.step.checks
    if result.applied:
        count_step(run, result.pairs)
    else:
        non_finite_step(run, run.progress.step + 1, result.loss.item())  # raises under train.nan_policy=stop
        run.progress.skipped_steps += 1
        run.progress.step += 1
    step, save_every = run.progress.step, run.cfg.train.save_every
    read = run.logged_at(step) or step == rt.total_steps or bool(save_every and step % save_every == 0)
    stopping = result.stop
    if stopping is None:  # one process reads its own flag; several agree where the host reads the device anyway
        stopping = run.stop.requested if rt.processes == 1 else read and any_process(run.accelerator,
                                                                                    run.stop.requested)
    skipped_now = not result.applied
    if checks.on_device and (read or stopping):
        for bad_step, value in checks.resolve():
            non_finite_step(run, bad_step, value)  # raises under train.nan_policy=stop, before any save
            run.progress.skipped_steps += 1
            n = step_samples(run, bad_step)
            run.progress.samples -= n
            run.window_samples -= n
            skipped_now = skipped_now or bad_step == step
    if run.logged_at(step) and not skipped_now:  # a skipped step is not logged
        from .end import log_record

        last = log_record(run, result, lr)
    stopping = maybe_save(run) or stopping
    if stopping and step < rt.total_steps:  # on the last step the run simply finishes
        stop_run(run)
    return last


def non_finite_step(run: Run, step: int, value: float) -> None:
    """Step `step` (1-based) had a loss that is not finite on some process (`value` here): raise TrainingError
    (``train.nan_policy=stop``), or say that it was skipped (``skip``)."""
    where = f"{value}" if run.rt.processes == 1 else f"not finite on some process ({value} here)"
    if run.cfg.train.nan_policy == "stop":
        good = latest_checkpoint(run.layout.checkpoints)
        err = TrainingError(f"loss is {where} at step {step}; last good checkpoint: "
                            f"{good if good else 'none'} (set train.nan_policy=skip to skip such steps)")
        err.everywhere = True  # all processes stop alike; one line
        raise err
    run.log(f"skipped step {step}: loss is {where}")


def step_samples(run: Run, step: int) -> int:
    """The samples of optimiser step `step` (1-based) over all processes: the global batch, or with NaFlex the pairs
    its micro-batches' drawn lengths fit (the same on every process)."""
    plan, rt = run.stream.naflex, run.rt
    if plan is None:
        return rt.global_batch
    first = (step - 1) * rt.accum_steps
    return sum(plan.pairs_at(b) for b in range(first, first + rt.accum_steps)) * rt.processes


def count_step(run: Run, pairs: Optional[int] = None) -> None:
    """Advance the progress (and the progress bar) by one applied optimiser step of `pairs` samples over all
    processes (None: the run's global batch; NaFlex steps vary)."""
    n = run.rt.global_batch if pairs is None else pairs
    run.progress.step += 1
    run.progress.samples += n
    run.window_samples += n
    if run.main and run.cfg.train.progress and run.bar is None:
        # Created after the first step, so a data or config error is not preceded by an empty bar. Lines printed
        # while it is shown (warnings, log lines) are written through it, each on its own line.
        from ..run.console import progress_bar

        run.bar = progress_bar(run.rt.total_steps, run.progress.step - 1, run.held, desc="train", unit="step",
                               dynamic_ncols=True)
    if run.bar is not None:
        run.bar.update(1)


def maybe_save(run: Run) -> bool:
    """Save a checkpoint when ``train.save_every`` falls on this step or on the last one. Returns whether a stop
    signal came to some process meanwhile: such a run then stops now rather than after one more step (one
    all-reduce per save, none per step)."""
    every, step = run.cfg.train.save_every, run.progress.step
    if not every or (step % every != 0 and step != run.rt.total_steps):
        return False
    run.save()
    return any_process(run.accelerator, run.stop.requested)


def stop_run(run: Run) -> None:
    """After a step on which some process got a stop signal: save a checkpoint (unless this step's was just
    saved) and raise RunStopped on every process."""
    accelerator, progress = run.accelerator, run.progress
    saved = run.layout.checkpoints / f"{CKPT_PREFIX}{progress.step:08d}"
    if run.saved_at != progress.step:
        saved = run.save()
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
