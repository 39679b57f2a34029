"""A run's reports and its end: the metrics record of a logged step with its periodic evaluation (`log_record`),
the evaluations due (`run_eval`), and `finish_run` (model/ saved, then the final evaluation, WiSE-FT, the plots and
the summary)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .. import data as data_mod
from .. import models
from ..config import TrainConfig
from ..data.decode import SKIP_REASONS
from ..data.pipeline import skip_units
from ..errors import MmclError, TrainingError
from ..evaluation import in_run as eval_sets
from ..models import lora
from ..run import folder as runfolder
from ..run.console import step_line
from ..run.processes import others_wait
from ..storage import weights
from ..storage.fsutil import atomic_write_text
from . import fsdp, phases
from .ema import swapped_in
from .step import StepResult, objective_from_config

if TYPE_CHECKING:
    from .loop import Run


def _skipped_everywhere(run: Run) -> Dict[str, int]:
    """Data skipped by reason, summed over the processes."""
    mine = run.stream.skipped
    counts = [float(mine.get(r, 0)) for r in SKIP_REASONS]
    if run.rt.processes > 1:
        counts = run.accelerator.reduce(torch.tensor(counts, device=run.accelerator.device), reduction="sum").tolist()
    return {r: int(n) for r, n in zip(SKIP_REASONS, counts)}


def log_record(run: Run, result: StepResult, lr: float) -> Dict[str, Any]:
    """The step's metrics record (with an evaluation when ``eval.every`` falls on it); written now except on the
    last step, whose record waits for the final evaluation. Starts the next timing window."""
    progress, raw_model = run.progress, run.trainee.raw_model
    elapsed = time.perf_counter() - run.window_start
    run.skips = _skipped_everywhere(run)
    units = skip_units(run.skips)  # samples and shards apart
    record = {"step": progress.step, "samples": progress.samples, "loss": float(result.loss.detach()),
              **{k: float(v) for k, v in result.terms.items()}, "lr": lr,
              "logit_scale": float(fsdp.full(raw_model.logit_scale.detach()).exp()),
              "samples_per_s": run.window_samples / max(elapsed, 1e-9),
              "data_time_frac": run.data_time / max(elapsed, 1e-9),
              "data/skipped_samples": units["samples"], "data/skipped_shards": units["shards"]}
    if getattr(raw_model, "logit_bias", None) is not None:
        record["logit_bias"] = float(fsdp.full(raw_model.logit_bias.detach()))
    if result.grad_norm is not None:
        record["grad_norm"] = float(fsdp.full(result.grad_norm))
    if run.evaluated_at(progress.step):
        record.update(_periodic_eval(run))
    if progress.step < run.rt.total_steps:  # the last record waits for the final evaluation, after model/ is saved
        run.metrics.write(record)
    if run.bar is not None:  # the step's line in out.log; on the console the bar shows the progress
        run.bar.set_postfix(loss=f"{record['loss']:.3f}", sps=f"{record['samples_per_s']:.0f}")
        run.console.line(f"mmcl: {step_line(record, run.rt.total_steps)}")
    else:
        run.log(step_line(record, run.rt.total_steps))
    run.start_window()
    return record


def _periodic_eval(run: Run) -> Dict[str, float]:
    """The evaluations due at this step, on the main process (the EMA weights where there are): a failure is a
    warning, and training goes on with nothing lost (the final evaluation's failure still ends the run)."""
    accelerator, t, out = run.accelerator, run.trainee, {}
    eval_model = t.raw_model
    if fsdp.in_effect(accelerator):  # every process joins the gathering of the weights
        eval_model = fsdp.full_model(accelerator, t.model, t.model_cfg)
        if run.main:
            eval_model = fsdp.for_evaluation(accelerator, eval_model)
    # The others wait outside the default group: its timeout (NCCL's 10 min) need not cover an evaluation.
    with others_wait(accelerator, run.cfg.eval.timeout_s):
        if run.main:
            try:
                with swapped_in(t.ema, eval_model):
                    out = run_eval(run.cfg, eval_model, t.tokenizer, t.pp_cfg, accelerator, run.progress.step,
                                   run.rt.global_batch)
            except MmclError as err:
                run.log(f"warning: evaluation at step {run.progress.step} failed, training goes on: {err}")
    del eval_model  # the gathered FSDP replica, before the next step allocates
    return out


def finish_run(run: Run, last: Dict[str, Any]) -> Dict[str, Any]:
    """Save model/ (main process), then run the final evaluation and write the last record, draw the plots and
    end accelerate's run. Returns the last record; an evaluation that fails raises TrainingError naming where the
    model is, after everything else is done."""
    accelerator, t = run.accelerator, run.trainee
    if run.bar is not None:
        run.bar.close()
    accelerator.wait_for_everyone()
    eval_failure = None
    final_model = t.raw_model
    if fsdp.in_effect(accelerator):  # the full weights, gathered from every process's shards
        final_model = fsdp.full_model(accelerator, t.model, t.model_cfg)
    # model/, the final evaluation and the plots are the main process's: the others wait outside the default
    # group, whose timeout (NCCL's 10 min) need not cover them.
    with others_wait(accelerator, run.cfg.eval.timeout_s):
        if run.main:
            with swapped_in(t.ema, final_model):  # model/ and the final evaluation use the EMA weights
                last, eval_failure = _final_model_and_eval(run, final_model, last)
        del final_model  # the gathered FSDP replica
        run.metrics.close()
        if run.main and run.cfg.train.plot:
            _plots(run)
    run.stream.skip_log.close()
    if run.main:  # the summary, also the end of out.log
        progress = run.progress
        for line in runfolder.summary_lines(progress.step, progress.samples, time.perf_counter() - run.started[0],
                                            progress.samples - run.started[1],
                                            int(last.get("data/skipped_samples", 0)), progress.skipped_steps, last,
                                            run.layout.model, int(last.get("data/skipped_shards", 0)), run.skips):
            run.log(line)
    accelerator.end_training()
    if eval_failure is not None:
        raise TrainingError(eval_failure)
    return last


def _final_model_and_eval(run: Run, final_model, last: Dict[str, Any]):
    """model/ at the last phase's size, then the final evaluation (after model/ is written, so a failing evaluation
    never loses the model) and WiSE-FT's blends. Returns (the last record, the evaluation's failure or None)."""
    t, progress, accelerator, cfg = run.trainee, run.progress, run.accelerator, run.cfg
    if t.lora:  # model/ holds plain weights, the adapters merged in; the final evaluation runs them
        final_model = lora.merged(final_model)
    # At the last phase's size (a copy at that size when it is not the model's own): saved and evaluated.
    final_model, t.model_cfg, t.pp_cfg, t.tokenizer = phases.final_model(t.phases, final_model, t.model_cfg,
                                                                         t.pp_cfg, t.tokenizer)
    weights.save_model_dir(final_model, t.model_cfg, t.pp_cfg, run.layout.model,
                           extra={"steps": progress.step, "samples": progress.samples})
    run.log(f"model saved to {run.layout.model}")
    unwritten = last.get("step") == progress.step  # the final step's record, held back by log_record
    final = last if unwritten else {"step": progress.step, "samples": progress.samples}
    evaluate = lambda m, results=None: run_eval(cfg, m, t.tokenizer, t.pp_cfg, accelerator, None,  # noqa: E731
                                                run.rt.global_batch, results)
    failure = None
    try:
        if fsdp.in_effect(accelerator):  # saved from the CPU, evaluated on the device
            final_model = fsdp.for_evaluation(accelerator, final_model)
        results: Dict[str, Any] = {}
        final.update(evaluate(final_model, results))
        if results:  # every set's whole result by name, as `mmcl zeroshot --out` writes one
            atomic_write_text(run.layout.eval_results, json.dumps(dict(results, step=progress.step), indent=2) + "\n")
    except MmclError as err:
        failure = (f"final evaluation failed: {err}; the trained model is saved in {run.layout.model} (evaluate it "
                   f"with mmcl zeroshot/retrieval --model {run.layout.root})")
    if unwritten or len(final) > 2:
        run.metrics.write(final)
        last = final
    if t.wise_init is not None and failure is None:  # train.wise_ft, each alpha evaluated as above
        from ..evaluation.wise_ft import wise_ft_of_run
        from ..storage.interpolate import run_start

        for line in wise_ft_of_run(t.wise_init, run_start(cfg.model), final_model, t.model_cfg, t.pp_cfg,
                                   cfg.train.wise_ft, run.layout.root, evaluate):
            run.log(line)
    return last, failure


def _plots(run: Run) -> None:
    try:
        from ..evaluation.plot import plot_run

        for p in plot_run(run.layout.root):
            run.log(f"plot written: {p}")
    except ImportError as err:  # matplotlib is optional
        run.log(f"plots skipped: {err}")


def naflex_views(cfg: TrainConfig, pp_cfg, sets) -> List[Tuple[list, Any]]:
    """With several ``eval.naflex_seq_len``: each length's (sets named ``<name>@<length>``, transform at that
    length); else nothing (the sets at the model's own transform)."""
    lengths = list(cfg.eval.naflex_seq_len)
    if len(lengths) < 2 or not pp_cfg.get("naflex_seq_len"):
        return []
    return [([dataclasses.replace(s, name=f"{s.name}@{n}") for s in sets],
             models.build_transforms(dict(pp_cfg, naflex_seq_len=int(n)))[1]) for n in lengths]


def run_eval(cfg: TrainConfig, model, tokenizer, pp_cfg, accelerator, step: Optional[int] = None,
             global_batch: Optional[int] = None, results: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """The evaluations due after optimiser step `step` (None: the final one, every set), on the main process:
    returns their ``eval/<task>/<name>/<metric>`` and ``val/...`` entries, and puts each whole result into
    `results` by kind and name (`mmcl.evaluation.in_run`). The validation loss scores batches of `global_batch`
    (the run's) with a fresh objective from ``loss.*`` in eval mode, so the training objective's state is untouched."""
    out: Dict[str, float] = {}
    if not accelerator.is_main_process or not eval_sets.has_evaluation(cfg.eval):
        return out
    from ..evaluation import evaluate

    sets, val_due = eval_sets.due(cfg.eval, step)
    if not sets and not val_due:
        return out
    _, eval_tf = models.build_transforms(pp_cfg)
    views = naflex_views(cfg, pp_cfg, sets) or [(sets, eval_tf)]
    keys = data_mod.sample_keys(cfg.data)  # the training data's image and caption members
    reading = evaluate.reading_options(cfg.data)  # and its member size limit and pipe rule
    was_training = model.training
    model.eval()
    try:
        with accelerator.autocast():  # the run's mixed precision, as the validation loss and open_clip evaluate
            for view_sets, view_tf in views:
                out.update(eval_sets.run_sets(view_sets, model, view_tf, tokenizer, cfg.eval, accelerator.device,
                                              keys=keys, reading=reading, results=results,
                                              model_name=str(cfg.train.output_dir)))
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
