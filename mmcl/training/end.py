"""A run's reports and its end: the metrics record of a logged step with its periodic evaluation (`log_record`) and
`finish_run` (model/ saved, then the final evaluation, WiSE-FT, the plots and the summary). Takes the frozen `Parts`,
the `RunState` and the `RunRecords`; what is evaluated and how is the parts' `RunEvaluation`
(`mmcl.evaluation.in_run`)."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Tuple

import torch

from ..config import is_main_process, say
from ..data.decode import SKIP_REASONS
from ..data.pipeline import CAPTION_COUNTS, skip_units
from ..data.stream import WAIT_WARN_SHARE
from ..errors import MmclError, TrainingError
from ..evaluation.in_run import run_eval
from ..evaluation.plot import plot_run
from ..evaluation.wise_ft import wise_ft_of_run
from ..models import flops, lora
from ..run import folder as runfolder
from ..run.console import mfu_text, step_line
from ..run.processes import others_wait
from ..run.records import RunRecords
from ..storage import weights
from ..storage.fsutil import atomic_write_text
from . import fsdp, phases
from .ema import swapped_in
from .setup import Parts
from .state import RunState
from .step import StepResult


def _skipped_everywhere(parts: Parts) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Data skipped by reason, and the captions batched and cut at the text context (`CAPTION_COUNTS`), summed
    over the processes (one reduction)."""
    mine, captions, accelerator = parts.stream.skipped, parts.stream.caption_counts, parts.accelerator
    counts = [float(mine.get(r, 0)) for r in SKIP_REASONS] + [float(captions[k]) for k in CAPTION_COUNTS]
    if parts.rt.processes > 1:
        counts = accelerator.reduce(torch.tensor(counts, device=accelerator.device), reduction="sum").tolist()
    n = len(SKIP_REASONS)
    return ({r: int(c) for r, c in zip(SKIP_REASONS, counts)},
            {k: int(c) for k, c in zip(CAPTION_COUNTS, counts[n:])})


def log_record(parts: Parts, state: RunState, records: RunRecords, result: StepResult, lr: float,
               evaluate: bool) -> Dict[str, Any]:
    """The step's metrics record (with the periodic evaluation, with `evaluate`); written now except on the last
    step, whose record waits for the final evaluation. Starts the next timing window."""
    progress, raw_model, total = state.progress, parts.raw_model, parts.rt.total_steps
    elapsed = time.perf_counter() - state.window_start
    state.skips, captions = _skipped_everywhere(parts)
    units = skip_units(state.skips)  # samples and shards apart
    record = {"step": progress.step, "samples": progress.samples, "loss": float(result.loss.detach()),
              **{k: float(v) for k, v in result.terms.items()}, "lr": lr,
              "logit_scale": float(fsdp.full(raw_model.logit_scale.detach()).exp()),
              "samples_per_s": state.window_samples / max(elapsed, 1e-9),
              "data_time_frac": state.data_time / max(elapsed, 1e-9),
              "data/skipped_samples": units["samples"], "data/skipped_shards": units["shards"],
              # captions longer than the text context, cut by the tokenizer, and their share of those batched
              "data/cut_captions": captions["cut_captions"],
              "data/cut_captions_share": captions["cut_captions"] / max(1, captions["captions"])}
    if parts.accelerator.device.type == "cuda":  # the allocator's peak so far (a host read, no device sync)
        record["mem/peak_gib"] = torch.cuda.max_memory_allocated(parts.accelerator.device) / 2 ** 30
    share = flops.mfu(record["samples_per_s"] / parts.rt.processes, state.flops, state.peak)  # per device
    if share is not None:
        record["mfu"] = share
    if record["data_time_frac"] > WAIT_WARN_SHARE and state.windows > 1 and not state.said_wait:
        state.said_wait = True  # not the first window (the workers start in it); once per run
        say(parts.stream.wait_advice(record["data_time_frac"], f"steps {state.window_step + 1}-{progress.step}"))
    if getattr(raw_model, "logit_bias", None) is not None:
        record["logit_bias"] = float(fsdp.full(raw_model.logit_bias.detach()))
    if result.grad_norm is not None:
        record["grad_norm"] = float(fsdp.full(result.grad_norm))
    if evaluate:
        record.update(_periodic_eval(parts, progress.step))
    if progress.step < total:  # the last record waits for the final evaluation, after model/ is saved
        records.metrics.write(record)
    if state.bar is not None:  # the step's line in out.log; on the console the bar shows the progress
        state.bar.set_postfix(loss=f"{record['loss']:.3f}", sps=f"{record['samples_per_s']:.0f}")
        records.console.line(f"mmcl: {step_line(record, total)}")
    else:
        say(step_line(record, total))
    state.start_window()
    return record


def _periodic_eval(parts: Parts, step: int) -> Dict[str, float]:
    """The evaluations due after step `step`, on the main process (the EMA weights where there are): a failure is a
    warning, and training goes on with nothing lost (the final evaluation's failure still ends the run)."""
    accelerator, out = parts.accelerator, {}
    eval_model = parts.raw_model
    if fsdp.in_effect(accelerator):  # every process joins the gathering of the weights
        eval_model = fsdp.full_model(accelerator, parts.model, parts.model_cfg)
        if is_main_process():
            eval_model = fsdp.for_evaluation(accelerator, eval_model)
    # The others wait outside the default group: its timeout (NCCL's 10 min) need not cover an evaluation.
    with others_wait(accelerator, parts.evaluation.ev.timeout_s):
        if is_main_process():
            try:
                with swapped_in(parts.ema, eval_model):
                    out = run_eval(parts.evaluation, eval_model, parts.tokenizer, parts.pp_cfg, accelerator, step,
                                   parts.rt.global_batch)
            except MmclError as err:
                say(f"warning: evaluation at step {step} failed, training goes on: {err}")
    del eval_model  # the gathered FSDP replica, before the next step allocates
    return out


def finish_run(parts: Parts, state: RunState, records: RunRecords, last: Dict[str, Any]) -> Dict[str, Any]:
    """Save model/ (main process), then run the final evaluation and write the last record, draw the plots and
    end accelerate's run. Returns the last record; an evaluation that fails raises TrainingError naming where the
    model is, after everything else is done."""
    accelerator = parts.accelerator
    if state.bar is not None:
        state.bar.close()
    accelerator.wait_for_everyone()
    eval_failure = None
    final_model = parts.raw_model
    if fsdp.in_effect(accelerator):  # the full weights, gathered from every process's shards
        final_model = fsdp.full_model(accelerator, parts.model, parts.model_cfg)
    # model/, the final evaluation and the plots are the main process's: the others wait outside the default
    # group, whose timeout (NCCL's 10 min) need not cover them.
    with others_wait(accelerator, parts.evaluation.ev.timeout_s):
        if is_main_process():
            with swapped_in(parts.ema, final_model):  # model/ and the final evaluation use the EMA weights
                last, eval_failure = _final_model_and_eval(parts, state, records, final_model, last)
        del final_model  # the gathered FSDP replica
        records.metrics.close()
        if is_main_process() and parts.plot:
            _plots(parts)
    parts.stream.skip_log.close()
    progress = state.progress
    for line in runfolder.summary_lines(progress.step, progress.samples, time.perf_counter() - state.started[0],
                                        progress.samples - state.started[1],
                                        int(last.get("data/skipped_samples", 0)), progress.skipped_steps, last,
                                        parts.layout.model, int(last.get("data/skipped_shards", 0)), state.skips):
        say(line)  # the summary, also the end of out.log
    if last.get("data/cut_captions"):  # never silent: the captions the text context cut
        say(f"captions cut at the text context: {int(last['data/cut_captions'])} "
            f"({last['data/cut_captions_share']:.1%} of those trained on; model.context_length sets it)")
    if state.window_total > 0:  # over the logged steps' windows: the step, the loader and MFU together
        rate = (progress.samples - state.started[1]) / state.window_total
        share = flops.mfu(rate / parts.rt.processes, state.flops, state.peak)
        say(f"speed: {rate:.1f} samples/s over the steps, waiting for data "
            f"{state.data_total / state.window_total:.0%} of the time; MFU {mfu_text(share)}")
    accelerator.end_training()
    if eval_failure is not None:
        raise TrainingError(eval_failure)
    return last


def _final_model_and_eval(parts: Parts, state: RunState, records: RunRecords, final_model, last: Dict[str, Any]):
    """model/ at the last phase's size, then the final evaluation (after model/ is written, so a failing evaluation
    never loses the model) and WiSE-FT's blends. Returns (the last record, the evaluation's failure or None)."""
    progress, accelerator, layout = state.progress, parts.accelerator, parts.layout
    if parts.lora:  # model/ holds plain weights, the adapters merged in; the final evaluation runs them
        final_model = lora.merged(final_model)
    # At the last phase's size (a copy at that size when it is not the model's own): saved and evaluated.
    final_model, model_cfg, pp_cfg, tokenizer = phases.final_model(parts.phases, final_model, parts.model_cfg,
                                                                   parts.pp_cfg, parts.tokenizer)
    weights.save_model_dir(final_model, model_cfg, pp_cfg, layout.model,
                           extra={"steps": progress.step, "samples": progress.samples})
    say(f"model saved to {layout.model}")
    unwritten = last.get("step") == progress.step  # the final step's record, held back by log_record
    final = last if unwritten else {"step": progress.step, "samples": progress.samples}
    evaluate = lambda m, results=None: run_eval(parts.evaluation, m, tokenizer, pp_cfg, accelerator,  # noqa: E731
                                                None, parts.rt.global_batch, results)
    failure = None
    try:
        if fsdp.in_effect(accelerator):  # saved from the CPU, evaluated on the device
            final_model = fsdp.for_evaluation(accelerator, final_model)
        results: Dict[str, Any] = {}
        final.update(evaluate(final_model, results))
        if results:  # every set's whole result by name, as `mmcl zeroshot --out` writes one
            atomic_write_text(layout.eval_results, json.dumps(dict(results, step=progress.step), indent=2) + "\n")
    except MmclError as err:
        failure = (f"final evaluation failed: {err}; the trained model is saved in {layout.model} (evaluate it "
                   f"with mmcl zeroshot/retrieval --model {layout.root})")
    if unwritten or len(final) > 2:
        records.metrics.write(final)
        last = final
    wise = parts.wise_ft
    if wise is not None and failure is None:  # train.wise_ft, each alpha evaluated as above
        for line in wise_ft_of_run(wise.init_state, wise.start, final_model, model_cfg, pp_cfg, wise.alphas,
                                   layout.root, evaluate):
            say(line)
    return last, failure


def _plots(parts: Parts) -> None:
    try:
        for p in plot_run(parts.layout.root):
            say(f"plot written: {p}")
    except ImportError as err:  # matplotlib is optional
        say(f"plots skipped: {err}")
