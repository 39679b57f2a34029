"""Building a run's parts, once, in the order they depend on each other (`setup`, which returns the frozen
`Parts`): the accelerator and stop signals, the run folder taken (`take_folder`), the model with its locks,
sharding, patch dropout and phases (`build_model`), the objective and optimiser, the teacher, the data stream
(`build_stream`), then accelerate's ``prepare``, the compiled forms and the `Step`. With the loop, the one reader of
the whole training config: each builder it calls gets its own section. User errors end every process alike
(`agreed`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from accelerate.utils import set_seed

from .. import data as data_mod
from .. import models
from ..config import TrainConfig, is_main_process, say, world
from ..data.sizes import describe_sources
from ..data.skips import SkipLog
from ..errors import ConfigError
from ..evaluation import evaluate
from ..evaluation.in_run import RunEvaluation
from ..evaluation.teacher import Teacher
from ..models import flops, lora, siglip2
from ..models import naflex as naflex_model
from ..models import resize as model_phases
from ..run.lock import RunLock
from ..run.processes import agreed
from ..run.signals import StopSignals
from ..storage import checkpoints, pretrained, weights
from ..storage.fsutil import holding, open_inside
from ..storage.interpolate import run_start
from ..storage.layout import LOCK, RunLayout
from . import fsdp, optim, phases
from .ema import WeightEMA
from .plan import Runtime, accelerator_for, choose_precision, tf32_setting
from .preflight import check_shared_memory
from .step import Step, objective_from_config


@dataclasses.dataclass(frozen=True)
class WiseFT:
    """``train.wise_ft`` at the end of the run: the initial weights (main process, on the CPU), what they were
    (``model.pretrained``, ``model.init_from``) and the alphas."""

    init_state: Dict[str, torch.Tensor]
    start: str
    alphas: Tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Parts:
    """A run's parts, built once by `setup` and never replaced: the accelerator and the run's `Runtime`, folder,
    stop signals and exit stack; the model (prepared, and unwrapped: `raw_model`), optimiser and objective (the
    forms the `Step` calls, compiled under ``train.compile``), the architecture, preprocessing and tokenizer, the
    weight average, the teacher, the masking modules, the phases, the parameter groups as param_groups.json describes
    them, the LoRA settings; the data stream and the `Step`; how the run evaluates (`RunEvaluation`), whether it
    plots, WiSE-FT's start, and the bytes a checkpoint takes."""

    accelerator: Any
    rt: Runtime
    layout: RunLayout
    stop: StopSignals
    held: contextlib.ExitStack
    model: torch.nn.Module
    raw_model: torch.nn.Module
    optimizer: Any
    objective: Any
    model_cfg: Dict[str, Any]
    pp_cfg: Dict[str, Any]
    tokenizer: Any
    stream: Any
    step: Step
    evaluation: RunEvaluation
    ema: Optional[WeightEMA] = None
    teacher: Any = None  # distill.teacher: a frozen `mmcl.evaluation.teacher.Teacher`, never saved
    patch_dropout: Tuple[torch.nn.Module, ...] = ()
    phases: Tuple[phases.Phase, ...] = ()
    param_groups: Tuple[Dict[str, Any], ...] = ()
    lora: Optional[Dict[str, Any]] = None  # model.lora's settings when adapters train (`mmcl.models.lora.settings`)
    wise_ft: Optional[WiseFT] = None
    siglip2: Any = None  # loss.self_distill / loss.masked: the heads, teacher and views (`mmcl.models.siglip2`)
    plot: bool = False
    ckpt_bytes: int = 0

    def meta(self) -> Dict[str, Any]:
        """The architecture and preprocessing each checkpoint records beside its weights (a checkpoint is a model),
        and the LoRA settings its adapters were made with, by which a loader merges them."""
        meta = {"model_cfg": self.model_cfg, "preprocess_cfg": self.pp_cfg}
        return {**meta, "lora": self.lora} if self.lora else meta


# ------------------------------------------------------------------------------------------------ the folder
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
    if any(entry.name != LOCK or not locked for entry in out_dir.iterdir()):
        return
    with contextlib.suppress(OSError):
        (out_dir / LOCK).unlink(missing_ok=True)
        folder = out_dir.absolute()
        while True:
            folder.rmdir()  # only an empty folder; stops at the first that is not
            if folder == made:
                break
            folder = folder.parent


def take_folder(accelerator, layout: RunLayout, held: contextlib.ExitStack) -> None:
    """The main process locks the run folder for the run's life (`RunLock`), and every process holds it
    (`mmcl.storage.fsutil.holding`). A run that fails before it writes
    anything (a full disk, a wrong model.name) leaves no folder behind; one refused by the lock removes nothing of
    the holder's."""
    def take():
        if not is_main_process():
            return
        made, lock = _first_missing(layout.root), RunLock(layout.root)
        held.callback(lock.release)
        held.push(lambda *exc: _remove_unused(layout.root, made, lock.held) if exc[0] is not None else None)
        checkpoints.check_output_dir(layout.root, layout.checkpoints)
        warning = lock.acquire()
        if warning:
            say(warning)

    agreed(accelerator, take)
    # Every process holds the folder from now to the end of the run: what it writes there (checkpoints, model/,
    # WiSE-FT, plots, records) goes relative to this descriptor, so a folder swapped for a link later is refused.
    held.enter_context(holding(layout.root))


# ------------------------------------------------------------------------------------------------- the model
def build_model(cfg: TrainConfig, rt: Runtime, accelerator):
    """The model as configured (pretrained or built, ``model.init_from``'s weights, the locks, FSDP's sharding),
    with its architecture, preprocessing, tokenizer, the masking modules and the run's phases. Returns
    (model, model_cfg, pp_cfg, tokenizer, patch_dropout, phases, wise_init)."""
    log = say
    if cfg.model.pretrained:  # by name: architecture (where the source has one), preprocessing and weights
        built = agreed(accelerator, lambda: pretrained.build_pretrained(cfg.model))
        model, model_cfg, pp_cfg, tokenizer, report = built
        log(report)
    else:
        model, model_cfg, pp_cfg, _, _, tokenizer = models.build(cfg.model)
    pp_cfg = naflex_preprocess(cfg, model, pp_cfg)
    if cfg.loss.caption > 0 and not models.has_decoder(model):
        raise ConfigError(f"loss.caption needs a model with a captioning decoder (model.name coca_*, e.g. coca_tiny "
                          f"or coca_ViT-B-32); model.name {cfg.model.name} has none")
    if cfg.loss.caption > 0 and cfg.model.lora.r:
        raise ConfigError("model.lora adapts the image and text towers and freezes the rest, so loss.caption would "
                          "train no decoder weight; set model.lora.r=0, or loss.caption=0 to tune a CoCa's towers")
    if cfg.model.init_from:  # pretrained weights (open_clip, mmcl or Hugging Face CLIP)
        log(weights.init_from(model, cfg.model.init_from))
    models.apply_locks(model, cfg.model)
    if cfg.loss.caption <= 0:  # no term reads a decoder's logits: it neither runs nor trains
        frozen = models.stop_decoding(model)
        if frozen:
            log(f"loss.caption is 0: the captioning decoder ({frozen:,} parameters) does not run and is not trained; "
                "its weights are saved as they are")
    wise_init = None
    if cfg.train.wise_ft and is_main_process():  # WiSE-FT's start point, on the CPU until the end
        wise_init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if cfg.model.lora.r:  # after WiSE-FT's start point, which is the plain model's
        log(lora.apply_lora(model, cfg.model.lora))
        attention = lora.adapted_attention(model) if cfg.train.compile else []
        if attention:
            raise ConfigError(f"train.compile cannot trace LoRA on attention layers ({attention[0]}, ...: peft swaps "
                              "their weights in each forward); set train.compile=false, or adapt linear layers only, "
                              "e.g. model.lora.target_modules=[c_fc,c_proj]")
    if fsdp.in_effect(accelerator):  # fully_shard takes no 0-dim parameter: before the optimiser sees them
        if cfg.model.lora.r:
            raise ConfigError("model.lora is not supported with FSDP (peft's attention layer swaps its weights in "
                              "each forward); set model.lora.r=0 or launch without FSDP")
        if cfg.train.ema_decay is not None:
            raise ConfigError("train.ema_decay is not supported with FSDP (the average would need the full "
                              "weights on every step); unset it or launch without FSDP")
        fsdp.vector_scalars(model)
        fsdp.shard_with_precision(accelerator, model)  # bf16/fp16: float32 reduction, temperature and bias
    masking = []
    if cfg.model.patch_dropout or phases.uses_patch_dropout(cfg.train):
        masking = models.set_patch_dropout(model, cfg.model.patch_dropout, cfg.train.seed, accelerator.process_index,
                                           accelerator.num_processes, rt.accum_steps)
    planned = agreed(accelerator, lambda: phases.plan(cfg.train, model, model_cfg, rt.total_steps))
    model_size, _, model_length = model_phases.full_sizes(model_cfg)
    for p in planned:
        log(f"phase {p.describe(model_size, model_length)}")
    return model, model_cfg, pp_cfg, tokenizer, masking, planned, wise_init


def naflex_preprocess(cfg: TrainConfig, model, pp_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The preprocessing recorded with the model: for a NaFlex tower, evaluation at the first of
    ``eval.naflex_seq_len`` (else the longest training length) with the tower's patch size. A NaFlex tower without
    ``data.naflex.seq_lens``, or the reverse, or a patch size other than the tower's, is a `ConfigError`."""
    flex, nf = models.is_naflex(model), cfg.data.naflex
    if flex != bool(nf.seq_lens):
        raise ConfigError("data.naflex.seq_lens (e.g. [128, 256, 576, 784]) is needed with a NaFlex image tower"
                          if flex else "data.naflex.seq_lens is set but the image tower is not a NaFlex one "
                          "(model.vision_cfg.timm_model_name: naflexvit_...)")
    if not flex:
        return pp_cfg
    patch = naflex_model.patch_size_of(model)
    if nf.patch_size is not None and nf.patch_size != patch:
        raise ConfigError(f"data.naflex.patch_size is {nf.patch_size} but the tower's patches are {patch} pixels; "
                          f"unset it or set {patch}")
    lengths = list(cfg.eval.naflex_seq_len) or [max(nf.seq_lens)]
    return dict(pp_cfg, naflex_seq_len=int(lengths[0]), patch_size=patch)


def naflex_plan(cfg: TrainConfig, pp_cfg: Dict[str, Any]):
    """The run's `mmcl.data.NaflexPlan` (``data.naflex``), or None when NaFlex is off."""
    nf = cfg.data.naflex
    if not nf.seq_lens:
        return None
    return data_mod.NaflexPlan.build(nf.seq_lens, nf.seq_len_probs, nf.max_tokens_per_batch, pp_cfg["patch_size"],
                                     cfg.train.seed)


def build_stream(cfg: TrainConfig, rt: Runtime, accelerator, model, tokenizer, pp_cfg: Dict[str, Any],
                 model_cfg: Dict[str, Any], teacher, planned, layout: RunLayout):
    """The training stream at the run's per-process batch (`Runtime`), the training transform from the model's
    preprocessing and ``data.aug``, the teacher's view and the phases' input sizes; /dev/shm checked for its
    batches; skipped samples named in skipped.jsonl by every process."""
    image_spec = data_mod.train_image_input(pp_cfg, cfg.data.aug)
    model_size = model_phases.full_sizes(model_cfg)[0]
    data_cfg = dataclasses.replace(cfg.data, batch_size=rt.batch_size)  # the run's batch (`Runtime`)
    plan = naflex_plan(cfg, pp_cfg)
    stream = agreed(accelerator, lambda: data_mod.build_train_stream(
        data_cfg, image_spec, models.training_tokenizer(model, tokenizer), seed=cfg.train.seed,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
        pin_memory=accelerator.device.type == "cuda",
        teacher_view=None if teacher is None else teacher.view, stored_teacher=cfg.distill.from_shards,
        sizes=phases.input_sizes(planned, model_size, rt.accum_steps),
        naflex=plan, short_captions=cfg.loss.short_caption.weight > 0,
        caption_parallel=cfg.loss.caption_parallel if cfg.loss.caption > 0 else 0.0))
    # Each batch a data worker sends is a shared-memory segment: a container's small /dev/shm fails mid-run.
    size = getattr(image_spec, "size", None) or pp_cfg["size"]
    if plan is not None:  # the largest NaFlex batch: capacity images of the shortest length's patches
        data_cfg = dataclasses.replace(data_cfg, batch_size=plan.capacity)
        size = plan.patch_size * math.ceil(math.sqrt(min(plan.seq_lens)))
        say(f"NaFlex: sequence lengths {list(plan.seq_lens)} (weights {[round(p, 3) for p in plan.probs]}), "
            f"{plan.max_tokens} patch tokens per process batch: {plan.max_tokens // max(plan.seq_lens)}-"
            f"{plan.capacity} pairs, padded to {plan.capacity} in the loss (data.batch_size is not used)")
    check_shared_memory(data_cfg, size, stream.uint8, world().local_size)
    stream.skip_log = SkipLog(layout.skipped, warn=True, open_fn=open_inside)  # every process; a warning per reason
    return stream


def teacher_terms(cfg: TrainConfig, rt: Runtime, accelerator, model):
    """The heads, EMA teacher and views of ``loss.self_distill`` and ``loss.masked`` on `model`
    (`mmcl.models.siglip2.Siglip2`; the teacher averaged by `WeightEMA`'s rule), or None when neither is on."""
    if cfg.loss.self_distill.weight <= 0 and cfg.loss.masked.weight <= 0:
        return None
    if fsdp.in_effect(accelerator):
        raise ConfigError("loss.self_distill and loss.masked are not supported with FSDP (their teacher averages "
                          "the full image tower); launch without FSDP")
    return siglip2.attach(model, cfg.loss.self_distill, cfg.loss.masked, rt.total_steps, cfg.train.seed,
                          accelerator.process_index, accelerator.num_processes, rt.accum_steps, make_ema=WeightEMA)


def evaluation_for(cfg: TrainConfig) -> RunEvaluation:
    """How the run evaluates (`mmcl.evaluation.in_run.RunEvaluation`): its ``eval`` section, the training data's
    members and reading limits, the validation loss's objective from ``loss.*``."""
    return RunEvaluation(cfg.eval, data_mod.sample_keys(cfg.data), evaluate.reading_options(cfg.data),
                         lambda: objective_from_config(cfg.loss, validation=True), cfg.train.seed, cfg.data.batch_size,
                         str(cfg.train.output_dir), cfg.data.negatives)


def setup(cfg: TrainConfig, rt: Runtime, held: contextlib.ExitStack) -> Parts:
    """The run's parts, in the order they depend on each other: the accelerator and the stop signals, the run folder
    taken, the model, objective, optimiser, teacher and data stream, prepared by accelerate, and the `Step` that
    trains them."""
    accelerator = accelerator_for(cfg.train)
    stop = held.enter_context(StopSignals())
    layout = RunLayout(cfg.train.output_dir)
    take_folder(accelerator, layout, held)
    if rt.resized_line:  # a checkpoint written by another number of processes: the same global batch
        say(rt.resized_line)
    optim.check_schedule(cfg.optim, rt.total_steps)
    set_seed(cfg.train.seed)
    model, model_cfg, pp_cfg, tokenizer, masking, planned, wise_init = build_model(cfg, rt, accelerator)
    objective = objective_from_config(cfg.loss)
    objective.reseed(cfg.train.seed)  # MoCHi's mixing draws; identical on every process
    # SigLIP 2's second stage: the heads join the model before the optimiser sees its parameters
    second = agreed(accelerator, lambda: teacher_terms(cfg, rt, accelerator, model))
    groups = optim.param_groups(model, cfg.optim)
    optimizer = optim.build_optimizer(model, cfg.optim, groups, device=accelerator.device)
    described = []
    if is_main_process():
        described = optim.describe(model, groups, cfg.optim)  # printed once; param_groups.json at the start
        optim.log_groups(described, say)
    teacher = None
    if cfg.distill.teacher:  # frozen, on the device; not prepared, not optimised, never saved
        teacher = agreed(accelerator, lambda: Teacher.load(cfg.distill.teacher, accelerator.device))
        say(f"distilling from {cfg.distill.teacher} (logit scale {float(teacher.scale):.2f})")
    stream = build_stream(cfg, rt, accelerator, model, tokenizer, pp_cfg, model_cfg, teacher, planned, layout)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    raw_model = accelerator.unwrap_model(prepared)
    step_model, loss_fn = prepared, objective
    if cfg.train.compile:
        # After prepare: dynamo then compiles the DDP-wrapped model in pieces cut at DDP's gradient buckets, so each
        # bucket's all-reduce overlaps the rest of the backward (compiled before wrapping, one graph would finish
        # its backward before any all-reduce starts). The objective (tiled losses included) is compiled too;
        # checkpoints, the EMA and evaluation keep using the modules themselves.
        step_model, loss_fn = torch.compile(prepared), torch.compile(objective)
    objective.to(accelerator.device)
    ema = WeightEMA(raw_model, cfg.train.ema_decay) if cfg.train.ema_decay else None  # after the locks
    step = Step(accelerator, step_model, raw_model, optimizer, loss_fn, grad_clip=cfg.optim.grad_clip,
                max_logit_scale=cfg.model.max_logit_scale, ema=ema, teacher=teacher, siglip2=second,
                finish_images=stream.finish_images,
                capacity=None if stream.naflex is None else stream.naflex.capacity)
    if not step.checks.on_device:  # one line: what the run does instead, and why
        say(optim.host_check_line(optimizer, getattr(accelerator, "scaler", None))
            or "a step with a non-finite loss is detected on the host (one device sync per step)")
    evaluation = evaluation_for(cfg)
    wise = None if wise_init is None else WiseFT(wise_init, run_start(cfg.model), tuple(cfg.train.wise_ft))
    return Parts(accelerator, rt, layout, stop, held, prepared, raw_model, optimizer, objective, model_cfg, pp_cfg,
                 tokenizer, stream, step, evaluation, ema=ema, teacher=teacher, patch_dropout=tuple(masking),
                 phases=tuple(planned), param_groups=tuple(described),
                 lora=lora.settings(cfg.model.lora) if cfg.model.lora.r else None, wise_ft=wise, siglip2=second,
                 plot=bool(cfg.train.plot), ckpt_bytes=checkpoints.state_bytes(raw_model))


def describe_setup(cfg: TrainConfig, rt: Runtime, accelerator, workers: int) -> None:
    """Log the processes, distribution, device, precision and global batch, and launch settings not in effect."""
    log = say
    dist_type = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    precision, source = choose_precision(cfg.train.precision)
    batch = (f"global batch {rt.global_batch}" if not cfg.data.naflex.seq_lens else
             "NaFlex batches of varying pairs (below)")
    log(f"{accelerator.num_processes} process(es), {dist_type} on {accelerator.device.type}, "
        f"{precision}; {batch}; {workers} data workers per process")
    log(f"precision {precision} from {source}; {tf32_setting(cfg.train.tf32, accelerator.device)}")
    for mode, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED")):
        if os.environ.get(var, "").lower() in ("1", "true") and dist_type != mode:
            log(f"warning: the launch config asks for {mode} but it is not in effect here ({dist_type}); "
                f"the model is replicated on every process")
    log(rt.length_line)
    warmup = optim.warmup_line(cfg.optim, rt.total_steps)
    if warmup:
        log(warmup)
    if is_main_process():  # what each source of data.train resolved to: its shards and, where known, counts
        for line in describe_sources(cfg.data.train, cfg.data.allow_pipe, cfg.data.require_all_shards,
                                     cfg.data.train_num_samples):
            log(line)


def speed_basis(parts: Parts, precision: str, tf32: bool) -> Tuple[Optional[float], Optional[float], str]:
    """The FLOPs of one pair forward and backward (`mmcl.models.flops`, counted once, at the model's image size and
    text length) and the device's peak in TFLOP/s in the run's precision (``train.precision``, ``train.tf32``), each
    None where not known, and the start line that says both (or why MFU is n/a)."""
    device = parts.accelerator.device
    peak = flops.device_peak(device, choose_precision(precision)[0], tf32)
    size = parts.pp_cfg.get("size", 224)
    text_len = parts.model_cfg.get("text_cfg", {}).get("context_length", 77)
    per_pair, why = None, ""
    if parts.stream.naflex is not None or parts.phases:
        why = "the image size changes from batch to batch (NaFlex) or phase to phase"
    elif fsdp.in_effect(parts.accelerator):  # running the sharded model's hooks on meta copies would break them
        why = "FSDP shards the model (count it without FSDP: the same model gives the same FLOPs)"
    else:
        try:
            per_pair = flops.sample_flops(parts.raw_model, size, text_len)
        except Exception as err:  # noqa: BLE001 - a tower that cannot run on meta tensors: MFU n/a, training goes on
            why = f"not countable on meta tensors ({type(err).__name__})"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    where = f"the peak of {name} is {peak:g} TFLOP/s" if peak else f"no known peak for {name}: MFU n/a"
    if per_pair is None:
        return None, peak, f"FLOPs per pair not counted: {why}; MFU n/a"
    size_text = size if isinstance(size, int) else "x".join(str(v) for v in size)
    return per_pair, peak, (f"{per_pair / 1e9:.2f} GFLOPs per pair, forward and backward at {size_text} px and "
                            f"{text_len} tokens; {where}")
