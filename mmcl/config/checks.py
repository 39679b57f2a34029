"""Every check of a value beyond its type: `validate` returns each problem of a loaded config, one line each, so
that all of them are reported at once. The checks the data stream repeats with what only the files tell
(`data_weight_problems`), the phases' lengths (`phase_lengths`) and the evaluation sets' entries (`eval_sets`) live
here too, so each rule is spelled once."""

from __future__ import annotations

import difflib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, List, Optional

import timm.optim
import torch

from ..errors import ConfigError
from .keys import get, term_keys
from .schema import (
    PRECISIONS,
    TRACKERS,
    VARIABLE_PAIR_TERMS,
    AugConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    PhaseConfig,
    TrainConfig,
)

_CHOICES = {
    "model.text.pooling": ("mean", "cls", "max"),
    "model.text.projection": ("mlp", "linear", "none"),
    "optim.schedule": ("cosine", "constant", "linear", "const-cooldown", "wsd"),
    "loss.global_contrastive.gamma_schedule": ("constant", "cosine"),
    "optim.cooldown_shape": ("linear", "1-sqrt", "cosine"),
    "train.precision": ("auto", *PRECISIONS),
    "train.nan_policy": ("stop", "skip"),
    "train.resume": ("auto", "force"),
    "data.decode": ("worker", "device"),
}
_POSITIVE = (
    "data.batch_size", "train.steps", "train.samples", "train.log_every", "train.accum_steps", "eval.batch_size",
    "train.dist_timeout_s", "eval.timeout_s", "data.max_member_bytes", "train.epochs", "data.train_num_samples",
    "optim.cooldown_power", "train.ddp.bucket_cap_mb",
)
_NON_NEGATIVE = (
    "data.workers", "data.shuffle_buffer", "data.retries", "data.retry_delay", "data.read_timeout",
    "train.save_every",
    "train.keep_checkpoints", "optim.warmup_steps",
    "optim.lr", "optim.weight_decay", "loss.mochi.queue_size", "eval.every",  # and every term's weight (`term_keys`)
    "optim.image_lr_mult", "optim.text_lr_mult", "train.unmasked_steps", "optim.min_lr",
)


def validate(cfg: TrainConfig) -> List[str]:
    """Semantic checks beyond types; returns all problems (empty list when valid)."""
    problems = []
    for key, choices in _CHOICES.items():
        value = get(cfg, key)
        if value not in choices:
            problems.append(f"{key} must be one of {', '.join(choices)} (got {value!r})")
    for key in _POSITIVE:
        if get(cfg, key) is not None and get(cfg, key) <= 0:
            problems.append(f"{key} must be > 0 (got {get(cfg, key)})")
    weight_keys = list(term_keys().values())
    for key in (*_NON_NEGATIVE, *weight_keys):
        if (get(cfg, key) or 0) < 0:
            problems.append(f"{key} must be >= 0 (got {get(cfg, key)})")
    if cfg.loss.chunk_size is not None and cfg.loss.chunk_size <= 0:
        problems.append(f"loss.chunk_size must be a positive integer or null (got {cfg.loss.chunk_size})")
    if not any(get(cfg, key) > 0 for key in weight_keys):
        problems.append("no loss term is active: set at least one of loss.clip, loss.supcon, loss.siglip, ... > 0")
    loss = cfg.loss
    if (loss.debiased > 0 or loss.hard_negative > 0) and not 0 <= loss.tau_plus < 1:
        problems.append(f"loss.tau_plus must be in [0, 1) (got {loss.tau_plus})")
    if loss.hard_negative > 0 and loss.hn_beta < 0:
        problems.append(f"loss.hn_beta must be >= 0 (got {loss.hn_beta})")
    m = loss.mochi
    if m.weight > 0 and (m.n_hard < 1 or m.s < 0 or m.s_prime < 0 or not 0 < m.mix_max <= 1):
        problems.append(f"loss.mochi needs n_hard >= 1, s >= 0, s_prime >= 0, 0 < mix_max <= 1 (got n_hard={m.n_hard}, "
                        f"s={m.s}, s_prime={m.s_prime}, mix_max={m.mix_max})")
    gc = loss.global_contrastive
    if gc.weight > 0:
        if not 0 < gc.gamma <= 1:
            problems.append(f"loss.global_contrastive.gamma must be in (0, 1] (got {gc.gamma})")
        if gc.gamma_schedule == "cosine" and gc.gamma_decay_steps <= 0:
            problems.append("loss.global_contrastive.gamma_schedule=cosine needs gamma_decay_steps > 0 (got "
                            f"{gc.gamma_decay_steps}; e.g. half of train.steps)")
        if gc.table_size < 1:
            problems.append(f"loss.global_contrastive.table_size must be >= 1 (got {gc.table_size})")
        if gc.eps is not None and not gc.eps >= 0:
            problems.append(f"loss.global_contrastive.eps must be >= 0 or null (got {gc.eps})")
    if not cfg.model.max_logit_scale >= 1:  # the scale's parameter is clamped into [0, log(max_logit_scale)]
        problems.append(f"model.max_logit_scale must be >= 1 (got {cfg.model.max_logit_scale})")
    if loss.siglip > 0 and cfg.model.init_logit_bias is None:
        problems.append("loss.siglip > 0 needs a model with a logit bias (got none; set model.init_logit_bias, "
                        "e.g. -10)")
    if cfg.data.negatives < 0:
        problems.append(f"data.negatives must be >= 0 (got {cfg.data.negatives})")
    elif cfg.data.negatives > 0 and loss.clip <= 0 and loss.siglip <= 0:
        problems.append(f"data.negatives={cfg.data.negatives} brings negative captions that only loss.clip and "
                        "loss.siglip score, and neither is > 0")
    if not 0 <= cfg.data.worker_nice <= 19:
        problems.append(f"data.worker_nice must be in [0, 19] (got {cfg.data.worker_nice})")
    for key in ("optim.image_layer_decay", "optim.text_layer_decay"):
        if not 0.0 < get(cfg, key) <= 1.0:
            problems.append(f"{key} must be in (0, 1] (got {get(cfg, key)})")
    problems += _sample_key_problems(cfg.data)
    problems += optimizer_problems(cfg.optim)
    problems += _length_problems(cfg)
    problems += _phase_problems(cfg)
    unknown = [t for t in cfg.train.log_with if t not in TRACKERS]
    if unknown:
        problems.append(f"train.log_with: unknown tracker(s) {', '.join(map(repr, unknown))} (choose from "
                        f"{', '.join(TRACKERS)})")
    if not 0.0 <= cfg.model.patch_dropout < 1.0:
        problems.append(f"model.patch_dropout must be in [0, 1) (got {cfg.model.patch_dropout})")
    if cfg.train.ema_decay is not None and not 0.0 < cfg.train.ema_decay < 1.0:
        problems.append(f"train.ema_decay must be in (0, 1) or null (got {cfg.train.ema_decay})")
    problems += _distill_problems(cfg)
    problems += teacher_term_problems(cfg)
    if not 0.0 <= cfg.loss.caption_parallel <= 1.0:
        problems.append(f"loss.caption_parallel must be in [0, 1] (got {cfg.loss.caption_parallel})")
    elif cfg.loss.caption_parallel > 0 and cfg.loss.caption <= 0:
        problems.append("loss.caption_parallel is a share of the captioning term's captions; set loss.caption > 0")
    if cfg.loss.short_caption.components < 1:
        problems.append(f"loss.short_caption.components must be >= 1 (got {cfg.loss.short_caption.components})")
    problems += _eval_problems(cfg)
    problems += _lora_problems(cfg.model)
    problems += naflex_problems(cfg)
    if cfg.model.pretrained and cfg.model.init_from:
        problems.append("model.pretrained and model.init_from are both set: model.pretrained names a model (its "
                        "weights, and its architecture where it has one), model.init_from loads weights into "
                        "model.name; set one")
    problems += data_weight_problems(cfg.data)
    problems += aug_problems(cfg.data.aug)
    if cfg.train.wise_ft is not None and (not cfg.train.wise_ft or any(not 0 <= a <= 1 for a in cfg.train.wise_ft)):
        problems.append(f"train.wise_ft must be a list of alphas in [0, 1] (got {list(cfg.train.wise_ft)})")
    return problems


def teacher_term_problems(cfg: TrainConfig) -> List[str]:
    """``loss.self_distill`` and ``loss.masked`` (SigLIP 2's second stage, `mmcl.models.siglip2`): their numbers,
    and what they do not run with."""
    problems: List[str] = []
    sd, mk = cfg.loss.self_distill, cfg.loss.masked
    on = [key for key, section in (("loss.self_distill", sd), ("loss.masked", mk)) if section.weight > 0]
    for key, section in (("loss.self_distill", sd), ("loss.masked", mk)):
        if section.weight < 0:
            problems.append(f"{key}.weight must be >= 0 (got {section.weight})")
        if not 0.0 <= section.start_fraction < 1.0:
            problems.append(f"{key}.start_fraction must be in [0, 1) (got {section.start_fraction})")
        if section.prototypes < 1:
            problems.append(f"{key}.prototypes must be >= 1 (got {section.prototypes})")
        if section.student_temp <= 0 or section.teacher_temp <= 0:
            problems.append(f"{key}.student_temp and teacher_temp must be > 0 (got {section.student_temp}, "
                            f"{section.teacher_temp})")
        if not 0.0 <= section.center_momentum < 1.0:
            problems.append(f"{key}.center_momentum must be in [0, 1) (got {section.center_momentum})")
    if sd.head_hidden < 1 or sd.head_bottleneck < 1:
        problems.append(f"loss.self_distill.head_hidden and head_bottleneck must be >= 1 (got {sd.head_hidden}, "
                        f"{sd.head_bottleneck})")
    if sd.local_crops < 1 or sd.local_size < 0:
        problems.append(f"loss.self_distill needs local_crops >= 1 and local_size >= 0 (got {sd.local_crops}, "
                        f"{sd.local_size})")
    scale = list(sd.local_scale)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        problems.append(f"loss.self_distill.local_scale must be two area fractions 0 < lo <= hi <= 1 (got {scale})")
    if not 0.0 < sd.teacher_ema_decay < 1.0:
        problems.append(f"loss.self_distill.teacher_ema_decay must be in (0, 1) (got {sd.teacher_ema_decay})")
    if not 0.0 < mk.mask_ratio < 1.0:
        problems.append(f"loss.masked.mask_ratio must be in (0, 1) (got {mk.mask_ratio})")
    if on and cfg.data.naflex.seq_lens:
        problems.append(f"{' and '.join(on)} need an open_clip ViT image tower at a fixed size; NaFlex batches are "
                        "not supported: set their weights to 0")
    if on and cfg.model.lock_image:
        problems.append(f"{' and '.join(on)} train the image tower; model.lock_image freezes it: unset one")
    return problems


def _lora_problems(model: ModelConfig) -> List[str]:
    """``model.lora``'s values; a tower both locked and given adapters (a locked tower runs without autograd, so
    its adapters would never learn)."""
    lora, problems = model.lora, []
    if lora.r < 0:
        problems.append(f"model.lora.r must be >= 0 (got {lora.r}; 0: no LoRA)")
    if not lora.r:
        return problems
    if not lora.alpha > 0:
        problems.append(f"model.lora.alpha must be > 0 (got {lora.alpha})")
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"model.lora.dropout must be in [0, 1) (got {lora.dropout})")
    if not lora.target_modules or not all(isinstance(t, str) and t for t in lora.target_modules):
        problems.append(f"model.lora.target_modules must name at least one layer (got {list(lora.target_modules)})")
    towers = list(lora.towers)
    if not towers or any(t not in ("image", "text") for t in towers) or len(set(towers)) < len(towers):
        problems.append(f"model.lora.towers must list image and/or text, once each (got {towers})")
    for tower, lock in (("image", model.lock_image), ("text", model.lock_text)):
        if lock and tower in towers:
            problems.append(f"model.lora.towers includes {tower} but model.lock_{tower} freezes that tower (its "
                            f"adapters would get no gradient): drop {tower} from model.lora.towers or unset "
                            f"model.lock_{tower}")
    return problems


def aug_problems(aug: AugConfig) -> List[str]:
    """What open_clip's train transform would assert on, or silently ignore, in ``data.aug``: each is an error here."""
    problems = []
    scale = list(aug.scale)
    if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
        problems.append(f"data.aug.scale must be two area fractions 0 < lo <= hi <= 1 (got {scale})")
    for key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        value = getattr(aug, key)
        if value is not None and not 0 <= value <= 1:
            problems.append(f"data.aug.{key} must be a probability in [0, 1] (got {value})")
    if aug.use_timm:
        for key in ("color_jitter_prob", "gray_scale_prob"):
            if getattr(aug, key):  # timm's transform has neither: open_clip drops them without a word
                problems.append(f"data.aug.{key} is not used by timm's transform (data.aug.use_timm=true); unset it")
        return problems
    for key in ("ratio", "re_prob", "re_count"):
        if getattr(aug, key) is not None:  # open_clip's own train transform ignores them with a warning
            problems.append(f"data.aug.{key} needs data.aug.use_timm=true (open_clip's own train transform has no "
                            f"{key}; timm's has)")
    if aug.color_jitter is not None and (len(aug.color_jitter) != 4 or not aug.color_jitter_prob):
        problems.append(f"data.aug.color_jitter needs 4 values (brightness, contrast, saturation, hue) and "
                        f"data.aug.color_jitter_prob > 0 (got {list(aug.color_jitter)} with prob "
                        f"{aug.color_jitter_prob}), or data.aug.use_timm=true")
    elif aug.color_jitter_prob and aug.color_jitter is None:
        problems.append("data.aug.color_jitter_prob needs data.aug.color_jitter (4 values: brightness, contrast, "
                        "saturation, hue)")
    return problems


def data_weight_problems(data: DataConfig, n_sources: Optional[int] = None) -> List[str]:
    """The rule for ``data.weights``, in one place: `validate` checks what the config alone decides; the data
    stream calls it again with the number of sources ``data.train`` expanded to (a shard list file counts as its
    entries, so the count needs the files)."""
    w = data.weights
    if w is None:
        return []
    problems = []
    if not data.resampled:
        problems.append("data.weights needs data.resampled=true (got weights with resampled=false)")
    if any(x < 0 for x in w):
        problems.append(f"data.weights must be non-negative (got {list(w)})")
    elif sum(w) <= 0:
        problems.append(f"data.weights must not all be zero (got {list(w)})")
    if n_sources is not None and len(w) != n_sources:
        problems.append(f"data.weights needs one weight per '::'-separated source (got {len(w)} weights for "
                        f"{n_sources} sources)")
    return problems


def _phase_problems(cfg: TrainConfig) -> List[str]:
    """``train.phases``: lengths and sizes that can be trained at; the lengths against train.steps when it is the
    run's length (else where the run's steps are known; the model's limits where it is built:
    `mmcl.training.phases.plan`)."""
    problems = []
    for i, p in enumerate(cfg.train.phases):
        if p.steps is not None and p.fraction is not None:
            problems.append(f"train.phases[{i}] has both steps and fraction: give one")
        elif p.steps is not None and p.steps < 1:
            problems.append(f"train.phases[{i}].steps must be >= 1 (got {p.steps})")
        elif p.fraction is not None and not 0 < p.fraction <= 1:
            problems.append(f"train.phases[{i}].fraction must be in (0, 1] (got {p.fraction})")
        if p.image_size is not None and p.image_size < 1:
            problems.append(f"train.phases[{i}].image_size must be >= 1 or left out (got {p.image_size})")
        if p.context_length is not None and p.context_length < 2:
            problems.append(f"train.phases[{i}].context_length must be >= 2 or left out (got {p.context_length})")
        if p.patch_dropout is not None and not 0.0 <= p.patch_dropout < 1.0:
            problems.append(f"train.phases[{i}].patch_dropout must be in [0, 1) or left out (got {p.patch_dropout})")
    if not problems and cfg.train.phases and cfg.train.samples is None and cfg.train.epochs is None:
        try:
            phase_lengths(cfg.train.phases, cfg.train.steps)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def phase_lengths(phases: List[PhaseConfig], total: int) -> List[int]:
    """Each phase's steps in a run of `total` steps: its ``steps``, or its ``fraction`` of `total` rounded down, or
    for a last phase with neither the steps left. Raises ConfigError unless every phase gets a step and together
    they make the run."""
    lengths = [p.steps if p.steps is not None else None if p.fraction is None
               else math.floor(p.fraction * total + 1e-9) for p in phases]
    if None in lengths[:-1]:
        raise ConfigError(f"train.phases[{lengths.index(None)}] has neither steps nor fraction: only the last phase "
                          f"may leave both out (it takes the rest of the run)")
    if lengths[-1] is None:
        lengths[-1] = total - sum(lengths[:-1])
    if min(lengths) < 1 or sum(lengths) != total:
        way = ("a longer run" if all(p.steps is None for p in phases) else "give the last phase no steps and no "
               "fraction to take the rest, the others as fractions of the run (e.g. fraction: 0.9)")
        raise ConfigError(f"train.phases' steps are {' + '.join(map(str, lengths))} = {sum(lengths)}, not the run's "
                          f"{total} with at least one step each: {way}")
    return lengths


# optim.kwargs that mmcl sets from its own keys: for every optimiser, and for AdamW besides
_OWN_KWARGS = {"params": "the parameter groups", "lr": "optim.lr", "weight_decay": "optim.weight_decay"}
_ADAMW_KWARGS = {"betas": "optim.beta1 and optim.beta2", "eps": "optim.eps",
                 "fused": "mmcl, which fuses where the device has the kernel"}


def optimizer_problems(optim: OptimConfig) -> List[str]:
    """``optim.name``: adamw or a name of timm's optimiser factory (with the close ones where it is neither);
    ``optim.kwargs``: keyword arguments of that optimiser's constructor that no mmcl key sets. timm is imported
    only for a name other than adamw (it takes about a second), torch only where kwargs are given."""
    if not isinstance(optim.kwargs, dict) or not all(isinstance(k, str) for k in optim.kwargs):
        return [f"optim.kwargs must be a mapping of keyword arguments, e.g. {{momentum: 0.9}} (got {optim.kwargs!r})"]
    own = dict(_OWN_KWARGS, **(_ADAMW_KWARGS if optim.name == "adamw" else {}))
    problems = [f"optim.kwargs: {k} is set by {own[k]}; leave it out of optim.kwargs"
                for k in optim.kwargs if k in own]
    if optim.name == "adamw":
        if not optim.kwargs:
            return problems

        cls = torch.optim.AdamW
    else:

        names = timm.optim.list_optimizers()
        if optim.name not in names:
            close = difflib.get_close_matches(optim.name, ["adamw", *names], n=4, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            return [f"optim.name: unknown optimiser {optim.name!r} (adamw, or one of "
                    f"timm.optim.list_optimizers()){hint}"]
        try:
            cls = timm.optim.get_optimizer_class(optim.name, bind_defaults=False)
        except Exception as err:  # a name whose package is not installed (apex's fused*, bitsandbytes' bnb*)
            why = (str(err).splitlines() or [type(err).__name__])[0]
            return [f"optim.name={optim.name} cannot be built here: {why}"]
    takes = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return problems
    known = [n for n, p in takes.items() if n not in ("self", *own) and p.kind is not p.VAR_POSITIONAL]
    for k in optim.kwargs:
        if k not in own and k not in known:
            problems.append(f"optim.kwargs: {cls.__name__} (optim.name={optim.name}) takes no {k!r}; it takes "
                            f"{', '.join(known)}")
    return problems


def _length_problems(cfg: TrainConfig) -> List[str]:
    """The run's length and the schedule's keys (the step counts themselves are checked at the start of a run,
    where the number of processes is known: `mmcl.training.loop.run_length`)."""
    problems, o = [], cfg.optim
    if cfg.train.samples is not None and cfg.train.epochs is not None:
        problems.append(f"train.samples ({cfg.train.samples}) and train.epochs ({cfg.train.epochs}) both set the "
                        f"run's length: set one of them (or neither, and train.steps)")
    if cfg.data.train_num_samples is not None and cfg.train.epochs is None:
        problems.append("data.train_num_samples is set but train.epochs is not: it gives an epoch's size for "
                        "train.epochs (set train.epochs, or train.samples for a budget in samples)")
    if o.cooldown_steps is not None and o.cooldown_steps < 0:
        problems.append(f"optim.cooldown_steps must be >= 0 or null (got {o.cooldown_steps})")
    if not 0.0 <= o.cooldown_fraction <= 1.0:
        problems.append(f"optim.cooldown_fraction must be in [0, 1] (got {o.cooldown_fraction})")
    if o.min_lr > o.lr:
        problems.append(f"optim.min_lr ({o.min_lr}) must not exceed optim.lr ({o.lr})")
    if o.no_decay_pattern is not None:
        try:
            re.compile(o.no_decay_pattern)
        except re.error as err:
            problems.append(f"optim.no_decay_pattern is not a regular expression ({err}): {o.no_decay_pattern!r}")
    return problems


def _eval_problems(cfg: TrainConfig) -> List[str]:
    """The evaluation sets' entries (`eval_sets`) and the validation loss's keys."""
    ev = cfg.eval
    problems = eval_sets(ev)[1]
    if ev.val_loss is not None and not _is_spec(ev.val_loss):
        problems.append(f"eval.val_loss must be held-out shards: a shard spec or a list of them (got {ev.val_loss!r})")
    if ev.val_loss_every is not None and ev.val_loss_every < 0:
        problems.append(f"eval.val_loss_every must be >= 0 or null (got {ev.val_loss_every})")
    if ev.val_loss is not None and (cfg.loss.distill > 0 or cfg.distill.teacher or cfg.distill.from_shards):
        problems.append("eval.val_loss does not score the distillation term (its teacher views are made for training "
                        "batches only); unset eval.val_loss or train without loss.distill")
    return problems


def naflex_problems(cfg: TrainConfig) -> List[str]:
    """``data.naflex``'s values, and what does not work with batches of a varying number of pairs (each one line)."""

    nf, problems = cfg.data.naflex, []
    if not nf.seq_lens:
        if cfg.eval.naflex_seq_len:
            problems.append("eval.naflex_seq_len is set but data.naflex.seq_lens is empty (NaFlex off)")
        return problems
    if any(n <= 0 for n in nf.seq_lens):
        problems.append(f"data.naflex.seq_lens must be positive (got {list(nf.seq_lens)})")
    probs = nf.seq_len_probs
    if probs is not None and (len(probs) != len(nf.seq_lens) or any(p < 0 for p in probs) or not sum(probs) > 0):
        problems.append(f"data.naflex.seq_len_probs needs one weight >= 0 per length of data.naflex.seq_lens, not "
                        f"all 0 (got {list(probs)} for {len(nf.seq_lens)} lengths)")
    if nf.max_tokens_per_batch < max(nf.seq_lens):
        problems.append(f"data.naflex.max_tokens_per_batch ({nf.max_tokens_per_batch}) must hold at least one "
                        f"sequence of the longest length ({max(nf.seq_lens)})")
    if nf.patch_size is not None and nf.patch_size <= 0:
        problems.append(f"data.naflex.patch_size must be > 0 or null (got {nf.patch_size})")
    if any(n <= 0 for n in cfg.eval.naflex_seq_len):
        problems.append(f"eval.naflex_seq_len must be positive (got {list(cfg.eval.naflex_seq_len)})")
    # the sample terms would take a varying number of pairs too, but their model sides do not take NaFlex towers
    taken = VARIABLE_PAIR_TERMS
    others = [key for name, key in term_keys().items() if get(cfg, key) > 0 and name not in taken]
    refused = [(bool(others), f"loss terms {', '.join(others)} (NaFlex takes {', '.join(taken)})"),
               (bool(cfg.train.phases), "train.phases"), (cfg.model.patch_dropout > 0, "model.patch_dropout"),
               (bool(cfg.distill.teacher or cfg.distill.from_shards), "distillation"),
               (cfg.train.samples is not None or cfg.train.epochs is not None,
                "train.samples / train.epochs (the pairs per batch vary: give train.steps)"),
               (cfg.eval.val_loss is not None, "eval.val_loss")]
    for bad, what in refused:
        if bad:
            problems.append(f"data.naflex does not work with {what}")
    return problems


def _distill_problems(cfg: TrainConfig) -> List[str]:
    d, weight = cfg.distill, cfg.loss.distill
    sources = bool(d.teacher) + bool(d.from_shards)
    if weight > 0 and sources != 1:
        return [f"loss.distill > 0 needs a teacher: distill.teacher=PATH (an mmcl run or export, an open_clip "
                f"local-dir or a Hugging Face CLIP directory) or distill.from_shards=true (embeddings stored by "
                f"mmcl reinforce), one of them (got {'both' if sources else 'neither'})"]
    if weight == 0 and sources:
        # A teacher that would be run on every batch (or shards read for it), then weigh nothing, is a mistake.
        return ["distill.teacher / distill.from_shards is set but loss.distill is 0: give the term a weight "
                "(e.g. loss.distill=1.0) or unset the teacher"]
    return []


def _sample_key_problems(data: DataConfig) -> List[str]:
    keys = [data.caption_key] if isinstance(data.caption_key, str) else data.caption_key
    if not isinstance(keys, (list, tuple)) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
        return [f"data.caption_key must be a member name such as txt or json:caption, or a list of them "
                f"(got {data.caption_key!r})"]
    if data.caption_key_weights is not None:
        w = data.caption_key_weights
        if len(w) != len(keys) or any(x < 0 for x in w) or sum(w) <= 0:
            return [f"data.caption_key_weights needs one non-negative weight per caption key, not all zero (got "
                    f"{list(w)} for {list(keys)})"]
    if data.image_key is not None and not data.image_key.strip():
        return ["data.image_key must be a member name such as jpg, or null"]
    return []


# The keys of one named set in an eval.zeroshot / eval.retrieval list
EVAL_SET_KEYS = {"zeroshot": ("name", "data", "every", "classnames", "templates"),
                 "retrieval": ("name", "data", "every")}


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set of ``eval.zeroshot`` or ``eval.retrieval``, as `eval_sets` reads it from the config."""

    task: str  # zeroshot | retrieval
    name: Optional[str]  # None: named after its data by the evaluation (a file's stem, else its folder)
    data: Any  # an ImageFolder, a shard spec, or a list of shard specs
    every: int  # steps between its evaluations during training; 0: at the end only
    classnames: Optional[str] = None
    templates: str = "auto"
    where: str = ""  # the config key it came from: eval.zeroshot, or eval.zeroshot[1] in a list


def _is_spec(value: Any) -> bool:
    """A path or shard spec, or a non-empty list of them."""
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def eval_sets(ev: "EvalConfig") -> tuple:
    """The evaluation sets of ``eval.zeroshot`` then ``eval.retrieval``, in the order given, and the problems of
    their entries (one line each, keyed ``eval.<task>[i]``).

    A single path is one set with ``eval.every``, ``eval.classnames`` and ``eval.templates``, as is a bare path in a
    list; a mapping names its set and may give its own ``every`` (and, for zero-shot, ``classnames`` and
    ``templates``), as big_vision's evaluators each have their own frequency. Explicit names are unique per task
    and hold no '/' (they are a path component of the metric keys); the evaluation checks the names it derives.
    Returns (list of `EvalSet`, list of problems).
    """
    sets, problems = [], []
    for task, keys in EVAL_SET_KEYS.items():
        value = getattr(ev, task)
        if value is None or value == "" or value == []:
            continue
        entries = value if isinstance(value, list) else [value]
        for i, entry in enumerate(entries):
            where = f"eval.{task}[{i}]" if isinstance(value, list) else f"eval.{task}"
            if _is_spec(entry):
                entry = {"data": entry}
            if not isinstance(entry, dict):
                problems.append(f"{where} must be a path or a mapping of {', '.join(keys)} (got {entry!r})")
                continue
            unknown = sorted(str(k) for k in entry if k not in keys)
            if unknown:
                problems.append(f"{where}: unknown key(s) {', '.join(unknown)} (a {task} set has "
                                f"{', '.join(keys)})")
                continue
            name, every = entry.get("name"), entry.get("every", ev.every)
            if not _is_spec(entry.get("data")):
                problems.append(f"{where}: data is not set (expected an ImageFolder or shards, e.g. "
                                f"{{name: val, data: /data/val}})")
            elif name is not None and (not isinstance(name, str) or not name.strip() or "/" in name):
                problems.append(f"{where}: name must be a non-empty word without '/' (got {name!r})")
            elif not isinstance(every, int) or isinstance(every, bool) or every < 0:
                problems.append(f"{where}: every must be an integer >= 0 (got {every!r})")
            else:
                zeroshot = task == "zeroshot"  # class names and templates are a zero-shot set's only
                sets.append(EvalSet(task, name, entry["data"], every,
                                    entry.get("classnames", ev.classnames) if zeroshot else None,
                                    entry.get("templates", ev.templates) if zeroshot else "auto", where))
    problems += duplicate_set_names([s for s in sets if s.name is not None])
    return sets, problems


def duplicate_set_names(sets: List[EvalSet]) -> List[str]:
    """One problem per name given to two sets of the same task (their results would share the metric keys)."""
    seen, problems = {}, []
    for s in sets:
        key = (s.task, s.name)
        if key in seen and seen[key] != s.data:
            problems.append(f"eval.{s.task}: two sets are named {s.name!r} ({seen[key]} and {s.data}); give each a "
                            f"different name: [{{name: a, data: ...}}, {{name: b, data: ...}}]")
        elif key in seen:
            problems.append(f"eval.{s.task}: the set {s.name!r} ({s.data}) is listed twice")
        seen.setdefault(key, s.data)
    return problems

