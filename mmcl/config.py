"""Typed configuration: a dataclass tree loaded from YAML and overridden by ``dotted.key=value``.

The schema is the dataclasses below; OmegaConf does the YAML parsing, merging and type conversion
(it parses override values by the field's declared type). Unknown keys and bad values become a
`ConfigError` that names the key and the closest valid keys, and every problem is reported at once.

A config returned by `load_config` or `from_dict` is read-only: assigning to any of its fields raises
`dataclasses.FrozenInstanceError`, so nothing changes it during a run. A changed copy is made with
`dataclasses.replace` (or, better, with an override).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import io
import json
import math
import os
import re
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from .errors import ConfigError


class _Section:
    """Base of the config dataclasses: fields can be assigned until `freeze` marks the instance read-only."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to {type(self).__name__}.{name}: the config is read-only once validated "
                f"(make a changed copy with dataclasses.replace, or pass an override)")
        object.__setattr__(self, name, value)


def freeze(cfg: _Section) -> _Section:
    """Make `cfg` and every section under it read-only (in place); returns `cfg`."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, _Section):
            freeze(value)
        elif isinstance(value, list):  # a list of sections (train.phases)
            for item in value:
                if isinstance(item, _Section):
                    freeze(item)
    object.__setattr__(cfg, "_frozen", True)
    return cfg


@dataclass
class TextTowerConfig(_Section):
    """Text tower choice. ``hf`` set means a Hugging Face transformers model (name or local path)."""

    hf: Optional[str] = None  # a Hugging Face model name or local path as the text tower; null: open_clip's
    pooling: str = "mean"  # how a Hugging Face text tower pools its tokens: mean | cls | max
    projection: str = "mlp"  # a Hugging Face text tower's projection to the embedding: mlp | linear | none


@dataclass
class ModelConfig(_Section):
    # an mmcl model config (mmcl/models/model_configs/*.json), any open_clip architecture, or a .json file in
    # open_clip's model-config format (embed_dim, vision_cfg, text_cfg; optionally preprocess_cfg)
    name: str = "tiny"
    embed_dim: Optional[int] = None  # width of the shared embedding; null: the model config's
    image_size: Optional[int] = None  # input resolution of the image tower; null: the model config's
    context_length: Optional[int] = None  # tokens per caption; null: the model config's
    vision_cfg: Dict[str, Any] = field(default_factory=dict)  # raw overrides of open_clip's vision_cfg
    text_cfg: Dict[str, Any] = field(default_factory=dict)  # raw overrides of open_clip's text_cfg
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    # The logit scale's initial logarithm: log(1/0.07), as CLIP (Radford et al. 2021)
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: Optional[float] = None  # set for SigLIP; -10 there (Zhai et al. 2023)
    max_logit_scale: float = 100.0  # the learned logit scale is clamped to at most this after each step (CLIP: 100)
    init_from: Optional[str] = None  # open_clip .pt/.safetensors/local-dir, an mmcl run or export, HF CLIP dir
    # Published weights by name, as open_clip's --pretrained: an open_clip tag of model.name (openai,
    # laion2b_s34b_b79k), hf-hub:ORG/NAME, or a local file/directory (an open_clip_train run included); downloaded
    # into the Hugging Face cache. A source with its own config brings its architecture; not with init_from.
    pretrained: Optional[str] = None
    lock_image: bool = False  # freeze the image tower (LiT; open_clip's --lock-image)
    lock_image_unlocked_groups: int = 0  # last layer groups of a locked image tower left trainable
    lock_image_freeze_bn_stats: bool = False  # also freeze a locked image tower's BatchNorm statistics
    lock_text: bool = False  # freeze the text tower (open_clip's --lock-text)
    lock_text_unlocked_layers: int = 0  # last layers of a locked text tower left trainable
    lock_text_freeze_layer_norm: bool = False  # also freeze a locked text tower's LayerNorms
    grad_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more compute
    # FLIP (Li et al. 2023): fraction of image patches dropped in training (ViT towers; evaluation is unmasked)
    patch_dropout: float = 0.0


@dataclass
class AugConfig(_Section):
    """Training augmentation, open_clip's ``AugmentationCfg`` key for key (its ``--aug-cfg``); evaluation never
    augments. ``ratio``, ``re_prob`` and ``re_count`` act only through timm's transform (``use_timm``)."""

    scale: List[float] = field(default_factory=lambda: [0.9, 1.0])  # random resized crop's area fraction range
    ratio: Optional[List[float]] = None  # the crop's aspect-ratio range (timm only); null: (3/4, 4/3)
    # Colour jitter strength: brightness, contrast, saturation, hue (4 values, applied with color_jitter_prob),
    # or with use_timm one value or 3-4 values as timm takes them
    color_jitter: Optional[List[float]] = None
    color_jitter_prob: Optional[float] = None  # probability of the jitter (SimCLR style; needs 4 color_jitter values)
    gray_scale_prob: Optional[float] = None  # probability of converting to grayscale (3 channels kept)
    re_prob: Optional[float] = None  # random erasing probability (timm only)
    re_count: Optional[int] = None  # random erasing count (timm only)
    use_timm: bool = False  # build the train transform with timm's create_transform, as open_clip does


@dataclass
class DataConfig(_Section):
    train: Any = None  # brace-expanded spec, '::'-separated specs, a glob, or a list of those
    weights: Optional[List[float]] = None  # per-source sampling weights (resampled mode)
    batch_size: int = 64  # samples per batch on each process
    workers: Optional[int] = None  # dataloader workers per process; null: its share of the CPUs less 1 (1 to 8)
    shuffle_buffer: int = 1000  # samples per shuffled block (a seeded permutation within each)
    resampled: bool = False  # draw shards with replacement for ever (open_clip's --dataset-resampled)
    max_image_pixels: int = 89_478_485  # pillow's decompression-bomb limit
    fast_decode: bool = True  # JPEG draft-mode decoding at reduced size
    # Images travel from the workers as uint8 and are scaled/normalised on the training device (exact, 4x less
    # shared and device memory traffic); used when the transform ends in ToTensor [+ Normalize].
    uint8_transfer: bool = True
    # Niceness the data workers add to their own (0-19). On a CPU-only machine a higher value makes the workers
    # yield to the training threads; measured on 2 cores it helped in some runs and hurt in others (BENCHMARKS.md).
    worker_nice: int = 0
    # What a sample is: the image member (null: the first of jpg, jpeg, png, webp) and the caption source(s), each a
    # member (txt) or a JSON field (json:caption, json:captions holding a list); with several captions one is drawn
    # per epoch from the seed, the sample's key and the epoch. Weights (one per source) choose between sources.
    image_key: Optional[str] = None
    caption_key: Any = "txt"  # the caption source(s): a member (txt), a JSON field (json:caption), or a list
    caption_key_weights: Optional[List[float]] = None  # one weight per caption source; null: equal
    # A remote shard (http(s), pipe:, ...) that cannot be opened or breaks off mid-stream is opened again this
    # many times, after retry_delay seconds doubling each time (1 + 2 + 4 s by default), and read on from the
    # sample that broke; only then is it skipped and counted.
    retries: int = 3
    retry_delay: float = 1.0  # seconds before the first retry of a remote shard (doubling after each)
    # A pipe shard (pipe: command, http(s) through curl) that sends nothing for this many seconds while it is read
    # is killed with its children and treated as broken off (then retried); 0 waits for ever.
    read_timeout: float = 300.0
    # The largest shard member read (bytes): a sample needing a larger one is skipped and counted (too_large) without
    # reading it, so a small .tar.gz holding gigabytes of zeros cannot exhaust memory. 64 MiB holds any real photo
    # (a 50 MP JPEG is about 25 MB) and stored embeddings; members a sample does not use are never read.
    max_member_bytes: int = 64 * 2 ** 20
    # A shard list file (data.train=shards.yaml) comes with the data: its pipe: entries are commands that run on
    # this machine, refused unless allowed here. pipe: commands typed in the config or an override always run.
    allow_pipe: bool = False
    # A source of data.train with some of its shards missing (a LAION download with holes) is trained on the
    # shards that exist, with one warning giving the count missing; true refuses such a run before its first step.
    require_all_shards: bool = False
    # Samples in one pass over data.train (open_clip's --train-num-samples), for train.epochs; null: read from the
    # counts beside the shards (sizes.json, img2dataset's _stats.json, __len__; mmcl/data/sizes.py).
    train_num_samples: Optional[int] = None
    aug: AugConfig = field(default_factory=AugConfig)  # training augmentation: open_clip's AugmentationCfg


@dataclass
class MochiConfig(_Section):
    weight: float = 0.0  # weight of MoCHi (Kalantidis et al. 2020): InfoNCE with synthesised hard negatives
    n_hard: int = 64  # N: hardest negatives considered per query
    s: int = 32  # synthetic negatives mixed from two hard negatives
    s_prime: int = 16  # harder negatives mixed from the query and a hard negative
    mix_max: float = 0.5  # coefficient for query mixing is drawn from (0, mix_max)
    queue_size: int = 0  # past features of the other modality kept as extra negatives


@dataclass
class GlobalContrastiveConfig(_Section):
    # weight of the global contrastive loss (SogCLR, Yuan et al. 2022; FastCLIP, Wei et al. 2024): InfoNCE whose
    # softmax normalisers are per-sample moving estimates over many batches, for small batches
    weight: float = 0.0
    gamma: float = 0.9  # inner rate of the moving estimates, in (0, 1]; 1 uses the batch's own (= loss.clip)
    gamma_schedule: str = "constant"  # constant | cosine (FastCLIP: from 1 down to gamma over gamma_decay_steps)
    gamma_decay_steps: int = 0  # optimiser steps of the cosine decay of gamma
    # constant inside log(eps + u); null: 1 / (global batch - 1), InfoNCE's weight of the positive;
    # 1 / (samples - 1) approaches the whole data set's InfoNCE
    eps: Optional[float] = None
    # slots of the per-sample estimates, 8 bytes each (saved in every process's checkpoint state); samples are
    # hashed into them, so a few times the data set's samples keeps shared slots rare
    table_size: int = 2 ** 20


@dataclass
class LossConfig(_Section):
    clip: float = 1.0  # weight of InfoNCE, CLIP's symmetric cross-entropy
    supcon: float = 0.0  # weight of supervised contrastive (Khosla et al. 2020; pairs sharing a label or caption)
    siglip: float = 0.0  # weight of SigLIP's sigmoid loss (Zhai et al. 2023; needs model.init_logit_bias)
    align: float = 0.0  # weight of alignment (Wang & Isola 2020); always reported as a metric
    uniform: float = 0.0  # weight of uniformity (Wang & Isola 2020); always reported as a metric
    debiased: float = 0.0  # weight of debiased InfoNCE (Chuang et al. 2020)
    tau_plus: float = 0.1  # class prior of Chuang et al. 2020
    hard_negative: float = 0.0  # weight of hard-negative reweighted InfoNCE (Robinson et al. 2021)
    hn_beta: float = 1.0  # concentration of Robinson et al. 2021
    align_alpha: float = 2.0  # exponent of the distance in the alignment term
    uniform_t: float = 2.0  # temperature of the uniformity term's Gaussian kernel
    chunk_size: Optional[int] = None  # tiled (memory-linear) softmax and sigmoid losses when set
    mochi: MochiConfig = field(default_factory=MochiConfig)
    global_contrastive: GlobalContrastiveConfig = field(default_factory=GlobalContrastiveConfig)
    distill: float = 0.0  # KL from a teacher's contrastive distributions (distill.teacher or distill.from_shards)


@dataclass
class OptimConfig(_Section):
    lr: float = 5e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.2  # AdamW's decoupled weight decay (not on gains, biases and the logit scale)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.98  # AdamW's second-moment decay
    eps: float = 1e-6  # AdamW's epsilon
    warmup_steps: int = 10  # steps of linear warm-up from 0 to optim.lr
    # cosine | linear | constant | const-cooldown | wsd. const-cooldown (open_clip's) and wsd (warmup-stable-decay, as
    # transformers' get_wsd_schedule) are one schedule: warmup, the peak rate, then a decay to min_lr over the last
    # cooldown_steps steps (or cooldown_fraction of the run).
    schedule: str = "cosine"
    min_lr: float = 0.0  # where cosine/linear and the cooldown end (open_clip's --lr-cooldown-end)
    cooldown_steps: Optional[int] = None  # steps of the final decay (const-cooldown, wsd); null: cooldown_fraction
    cooldown_fraction: float = 0.1  # the cooldown's share of the run when cooldown_steps is null
    # The cooldown's shape over its progress p in [0, 1]: linear (1 - p) ** cooldown_power (open_clip's
    # --lr-cooldown-power; 1 is linear), 1-sqrt (1 - sqrt(p), Hägele et al. 2024), cosine (0.5 (1 + cos(pi p)))
    cooldown_shape: str = "linear"
    cooldown_power: float = 1.0  # exponent of the linear cooldown shape (1: linear)
    # Parameters whose names match this regular expression (re.search) are not decayed, in addition to gains,
    # biases and the logit scale/bias; e.g. 'positional_embedding|class_embedding|token_embedding'
    no_decay_pattern: Optional[str] = None
    grad_clip: Optional[float] = 1.0  # clip the global gradient norm to this; null: no clipping
    # Learning-rate multiplier of each tower, and layer-wise decay within it (1.0: off); see mmcl/training/optim.py
    image_lr_mult: float = 1.0
    text_lr_mult: float = 1.0  # learning-rate multiplier of the text tower
    image_layer_decay: float = 1.0  # layer-wise learning-rate decay within the image tower
    text_layer_decay: float = 1.0  # layer-wise learning-rate decay within the text tower


@dataclass
class DdpConfig(_Section):
    """Options given to torch's DistributedDataParallel (accelerate's `DistributedDataParallelKwargs`); null keeps
    torch's default. open_clip_train's --ddp-static-graph is ``static_graph: true``."""

    gradient_as_bucket_view: Optional[bool] = None  # gradients as views into the all-reduce buckets (less memory)
    static_graph: Optional[bool] = None  # the same parameters get gradients every step (faster all-reduce)
    bucket_cap_mb: Optional[float] = None  # all-reduce bucket size (torch: 25 MB)


@dataclass
class PhaseConfig(_Section):
    """One phase of ``train.phases``: its length, and the sizes its steps train at (None: the model's). The length
    is ``steps``, or ``fraction`` of the run's steps (rounded down), or neither for the last phase: the rest of the
    run (`phase_lengths`)."""

    steps: Optional[int] = None
    fraction: Optional[float] = None
    image_size: Optional[int] = None
    context_length: Optional[int] = None
    patch_dropout: Optional[float] = None


@dataclass
class TrainSection(_Section):
    steps: int = 150  # optimiser steps of the run
    # The run's length: train.steps, unless train.samples (a budget in samples, all processes) or train.epochs (passes
    # over the data, open_clip's --epochs; data.train_num_samples or the shards' counts) is set; not both of these.
    samples: Optional[int] = None
    epochs: Optional[float] = None  # the run's length in passes over data.train (open_clip's --epochs)
    output_dir: str = "runs/tiny"  # the run folder: config.yaml, metrics.jsonl, checkpoints/, model/
    # auto: a new or empty output_dir starts a run, the same run resumes, another run is refused
    # (docs/reliability.md, "A run folder holds one run"); force: resume the run there despite config differences
    # (config.yaml then records this config)
    resume: str = "auto"
    seed: int = 0  # seeds the model's initialisation, the data order and the dropout
    log_every: int = 10  # steps between lines of metrics.jsonl (and the trackers)
    save_every: int = 50  # steps between resumable checkpoints, and one at the end (0: none)
    keep_checkpoints: int = 2  # the newest checkpoints kept; older ones are deleted
    # auto | fp32 | bf16 | fp16; auto: the launcher's mixed precision (`accelerate launch`'s mixed_precision, passed
    # as ACCELERATE_MIXED_PRECISION), fp32 without one. A set value that a launcher contradicts is an error.
    precision: str = "auto"
    tf32: bool = True  # TF32 tensor cores for float32 matmuls and convolutions on CUDA (as open_clip); no-op elsewhere
    accum_steps: int = 1  # micro-batches forming one contrastive batch
    compile: bool = False  # torch.compile the model
    nan_policy: str = "stop"  # stop | skip
    plot: bool = True  # write the run's plots (mmcl plot) at the end
    progress: bool = True  # show a progress bar
    # Exponential moving average of the trainable weights, used by evaluation, model/ and exports (e.g. 0.999)
    ema_decay: Optional[float] = None
    # Trackers through accelerate (tensorboard | wandb | mlflow | aim); metrics.jsonl is always written
    log_with: List[str] = field(default_factory=lambda: ["tensorboard"])
    unmasked_steps: int = 0  # the last K steps run without model.patch_dropout (FLIP's unmasked tuning)
    # Seconds a collective between the processes may wait before the run ends with "another process ... did not
    # answer"; null: torch's default (10 min for NCCL, 30 min for gloo). Evaluations and the final save do not
    # count against it (eval.timeout_s).
    dist_timeout_s: Optional[float] = None
    ddp: DdpConfig = field(default_factory=DdpConfig)  # torch DDP's options (multi-process, not FSDP)
    # WiSE-FT (Wortsman et al. 2022): after training, the weights (1 - a) * initial + a * final for each alpha a,
    # each written as a model under output_dir/wise_ft/alpha_<a>/ and evaluated as the final model is (mmcl interpolate)
    wise_ft: Optional[List[float]] = None
    # Token-reduction phases (CLIPA, Li et al. 2023), in order: a list of {steps or fraction, image_size,
    # context_length, patch_dropout}; a size left out keeps the model's own value; a phase's length is its steps or
    # its fraction of the run's steps, and a last phase with neither takes the rest. Empty: every step at the
    # model's own size (mmcl/training/phases.py)
    phases: List[PhaseConfig] = field(default_factory=list)


@dataclass
class EvalConfig(_Section):
    every: int = 0  # steps between evaluations during training; 0 evaluates only at the end if data is set
    # Zero-shot classification sets: an ImageFolder or shards with .cls, or a list of named sets, each a path (named
    # after it) or {name, data, every, classnames, templates} (every, classnames, templates default to eval.*);
    # results go under eval/zeroshot_classification/<name>/<metric>
    zeroshot: Any = None
    classnames: Optional[str] = None  # file with one class name per line in label order; null: beside the data
    templates: str = "auto"  # templates.txt beside the data, else open_clip's openai_imagenet_template
    # Retrieval sets: shards with captions, or a list of named sets, each a path or {name, data, every}
    retrieval: Any = None
    # Held-out shards scored with the run's own loss terms (open_clip's --val-data), without gradient, in batches
    # of the run's global batch; logged as val/loss and val/<term>
    val_loss: Any = None
    val_loss_every: Optional[int] = None  # steps between validation losses; null: eval.every
    batch_size: int = 128  # images (or captions) per evaluation batch
    # Seconds the other processes wait for the main process's evaluation (and, at the end, model/ and plots)
    timeout_s: float = 14400.0


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


@dataclass
class DistillConfig(_Section):
    teacher: Optional[str] = None  # a model mmcl.load reads: an mmcl run or export, open_clip local-dir, HF CLIP dir
    from_shards: bool = False  # the teacher embeddings `mmcl reinforce` stored in the shards instead of a teacher


@dataclass
class TrackConfig(_Section):
    """How the ``train.log_with`` trackers name the run (mmcl/training/tracking.py). A key left null takes the
    tracker's own environment variable (W&B's WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, WANDB_NOTES, WANDB_TAGS;
    MLflow's MLFLOW_EXPERIMENT_NAME, MLFLOW_TAGS), else mmcl's default."""

    project: Optional[str] = None  # W&B project, MLflow experiment, aim experiment; null: the environment, else mmcl
    entity: Optional[str] = None  # W&B team or user; null: WANDB_ENTITY, else the account's default
    run_name: Optional[str] = None  # the run's name in W&B and MLflow; null: WANDB_NAME, else the output folder's name
    notes: Optional[str] = None  # W&B notes, MLflow description; null: WANDB_NOTES
    tags: Optional[List[str]] = None  # W&B tags, MLflow tags (each with the value "true"); null: WANDB_TAGS


@dataclass
class TrainConfig(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    track: TrackConfig = field(default_factory=TrackConfig)


# train.precision's values and the name accelerate (``mixed_precision``, ACCELERATE_MIXED_PRECISION) gives each.
PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
PRECISION_OF = {v: k for k, v in PRECISIONS.items()}  # accelerate's name -> train.precision's
# train.log_with's values: accelerate's tracker names, each also the name of the package it needs.
TRACKERS = ("tensorboard", "wandb", "mlflow", "aim")


class World(NamedTuple):
    rank: int
    local_rank: int
    size: int  # processes in the run
    local_size: int  # processes on this machine


def world() -> World:
    """This process's place in its launch, as the launcher (accelerate launch, torchrun) sets it in the environment:
    read here alone, as it is known before accelerate's state exists (and where it never does). No launcher: one
    process."""
    env = os.environ
    return World(int(env.get("RANK") or 0), int(env.get("LOCAL_RANK") or 0), int(env.get("WORLD_SIZE") or 1),
                 int(env.get("LOCAL_WORLD_SIZE") or 1))


def is_main_process() -> bool:
    """Whether this is the launch's main process (rank 0), the one that says what every process finds alike."""
    return world().rank == 0

def data_workers(configured: Optional[int]) -> int:
    """``data.workers``: a set value as it is; null: the CPUs this process may run on, shared by the processes on
    its machine (LOCAL_WORLD_SIZE), less one for the training thread, at least 1 and at most 8."""
    if configured is not None:
        return int(configured)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // world().local_size - 1))


_CHOICES = {
    "model.text.pooling": ("mean", "cls", "max"),
    "model.text.projection": ("mlp", "linear", "none"),
    "optim.schedule": ("cosine", "constant", "linear", "const-cooldown", "wsd"),
    "loss.global_contrastive.gamma_schedule": ("constant", "cosine"),
    "optim.cooldown_shape": ("linear", "1-sqrt", "cosine"),
    "train.precision": ("auto", *PRECISIONS),
    "train.nan_policy": ("stop", "skip"),
    "train.resume": ("auto", "force"),
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


@functools.lru_cache(maxsize=None)
def _subsections(schema) -> Dict[str, type]:
    """Field name -> section class for the fields of `schema` that are sections. The annotations are text here
    (``from __future__ import annotations``); typing resolves them, so the tree is read from the dataclasses."""
    return {name: hint for name, hint in get_type_hints(schema).items() if dataclasses.is_dataclass(hint)}


def valid_keys(schema=TrainConfig, prefix: str = "") -> List[str]:
    """All dotted keys of the schema (leaves and sub-trees)."""
    keys = []
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        keys.append(key)
        if f.name in _subsections(schema):
            keys += valid_keys(_subsections(schema)[f.name], key + ".")
    return keys


@dataclass(frozen=True)
class KeyInfo:
    """One config key as ``mmcl train --help`` lists it."""

    key: str  # dotted, e.g. data.batch_size
    type: str  # as a user writes it: int, float, str, bool, 'int or null', 'list of float', mapping, any
    default: str  # as YAML would spell it
    description: str  # the field's comment in this file (the line(s) above it and the one after it, joined)


def _type_name(node: ast.expr) -> str:
    text = ast.unparse(node)
    if isinstance(node, ast.Subscript):
        outer, inner = ast.unparse(node.value), node.slice
        if outer == "Optional":
            return f"{_type_name(inner)} or null"
        if outer == "List":
            return f"list of {_type_name(inner)}"
        if outer == "Dict":
            return "mapping"
    return {"Any": "any"}.get(text, text)


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return value if isinstance(value, str) else json.dumps(value)


@functools.lru_cache(maxsize=None)
def _comments_by_field() -> Dict[tuple, tuple]:
    """(class name, field) -> (type, description), read from this file's source: a field's description is its
    comment, so the code and ``--help`` cannot drift apart."""
    source = Path(__file__).read_text(encoding="utf-8")
    comments, alone = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                alone.add(tok.start[0])
    out = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, line = [], node.lineno - 1
            while line in alone:
                above.insert(0, comments[line])
                line -= 1
            after = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            out[(cls.name, node.target.id)] = (_type_name(node.annotation), " ".join(above + after))
    return out


def describe_keys(schema=TrainConfig, prefix: str = "") -> List[KeyInfo]:
    """Every leaf key of the schema with its type, default and description, in the schema's order."""
    infos = []
    comments = _comments_by_field()
    for f in dataclasses.fields(schema):
        sub = _subsections(schema).get(f.name)
        if sub is not None:
            infos += describe_keys(sub, prefix + f.name + ".")
            continue
        type_name, text = comments.get((schema.__name__, f.name), ("any", ""))
        infos.append(KeyInfo(prefix + f.name, type_name, _default_text(f), text))
    return infos


@functools.lru_cache(maxsize=None)
def _fields() -> Dict[str, KeyInfo]:
    return {info.key: info for info in describe_keys()}


def _section_keys() -> List[str]:
    return [k for k in valid_keys() if k not in _fields()]


def keys_help(width: int = 100) -> str:
    """The config keys as ``mmcl train --help`` prints them: key (type, default), then the description."""
    lines = ["config keys (in the --config file, or as key=value after it; --print-config shows the resolved "
             "values):"]
    section = None
    for info in describe_keys():
        top = info.key.split(".")[0]
        if top != section:
            section = top
            lines.append("")
        lines.append(f"  {info.key} ({info.type}, default: {info.default})")
        lines += textwrap.wrap(info.description, width=max(width, 40), initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def _nearest(key: str) -> str:
    keys = valid_keys()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:  # match on the last component, e.g. 'batchsize' -> data.batch_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.7)][:3]
    return ("; did you mean " + " or ".join(close) + "?") if close else ""


# Keys that moved to where they act: the old key is an error naming the new one in what the user writes, and is
# carried to its new place in what mmcl wrote itself (a run's config.yaml, a model's config), by `moved_keys_carried`.
MOVED_KEYS = {"loss.max_logit_scale": "model.max_logit_scale"}


def moved_keys_carried(saved: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a saved config dict with each key of `MOVED_KEYS` at its new place (a value already at the new
    place wins). A run folder written before a key moved is then the same run as before."""
    out = json.loads(json.dumps(saved, default=str)) if isinstance(saved, dict) else saved
    if not isinstance(out, dict):
        return out
    for old, new in MOVED_KEYS.items():
        (osec, okey), (nsec, nkey) = old.split(".", 1), new.split(".", 1)
        section = out.get(osec)
        if isinstance(section, dict) and okey in section:
            value = section.pop(okey)
            target = out.setdefault(nsec, {})
            if isinstance(target, dict):
                target.setdefault(nkey, value)
    return out


def _describe(err: OmegaConfBaseException, key: str, value: Any) -> str:
    """One line for a failed merge of ``key=value``, in the schema's words (OmegaConf's own text names its
    internals, e.g. "Merge error: int is not a subclass of OptimConfig")."""
    if key in MOVED_KEYS:
        return f"'{key}' is now '{MOVED_KEYS[key]}': rename the key ({MOVED_KEYS[key]}={value})"
    fields = _fields()
    if key in _section_keys():
        leaves = [k for k in fields if k.startswith(key + ".")]
        return (f"'{key}' is a section, not a value: set its keys, e.g. {leaves[0]}=... "
                f"(`mmcl train --help` lists them)")
    if key in fields:
        return f"bad value for '{key}': expected {fields[key].type}, got {value!r}"
    full = getattr(err, "full_key", None) or key
    if isinstance(err, ConfigKeyError) or "not in" in str(err) or full not in fields:
        return f"unknown config key '{full}'{_nearest(full)}"
    return f"bad value for '{full}': expected {fields[full].type}, got {value!r}"


def _merge_checked(base, other, errors: List[str], source: str):
    """Merge `other` into `base` key by key so that every bad key is reported, not just the first."""
    flat = _flatten(OmegaConf.to_container(other, resolve=False))
    for key, value in flat:
        try:
            base.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"{source}: {_describe(err, key, value)}")
    return base


def _flatten(node, prefix: str = ""):
    """Yield (dotted key, value); dict-typed leaves of the schema (vision_cfg, text_cfg) stay whole."""
    out = []
    if isinstance(node, dict) and prefix.rstrip(".") not in ("model.vision_cfg", "model.text_cfg"):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v and key not in ("model.vision_cfg", "model.text_cfg"):
                out += _flatten(v, key + ".")
            else:
                out.append((key, v))
    else:
        out.append((prefix.rstrip("."), node))
    return out


def _nested(key: str, value):
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def parse_overrides(overrides: List[str]) -> List[tuple]:
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. data.batch_size=32)")
        key, raw = item.split("=", 1)
        # YAML parsing gives ints, floats, bools, null and lists; the schema then converts by field type. A pipe:
        # command is a string as typed (its "Authorization: ..." is no mapping, its " #" no comment).
        try:
            value = raw.strip() if raw.lstrip().startswith("pipe:") else OmegaConf.from_dotlist([f"v={raw}"]).v
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override '{item}': the value is not valid YAML ({problem})") from None
        pairs.append((key.strip(), value))
    return pairs


_MAX_CONFIG_NODES = 100_000  # far beyond any config; YAML aliases that expand past it are refused, not expanded


def _check_size(path: str) -> None:
    """Refuse a config file whose YAML aliases expand to more than `_MAX_CONFIG_NODES` values, or that nests deeper
    than the parser goes: counted on PyYAML's objects, where an alias is one shared object, before OmegaConf copies
    each alias out (a few lines of YAML can otherwise ask for 10^9 copies)."""
    sizes: Dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        if id(node) not in sizes:
            sizes[id(node)] = 1  # a node that holds itself counts once
            items = list(node.values()) if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(size(item) for item in items)
        return sizes[id(node)]

    try:
        with open(path, "rb") as f:
            count = size(yaml.safe_load(f))
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except (yaml.YAMLError, ValueError):  # not YAML: OmegaConf.load says where
        return
    if count > _MAX_CONFIG_NODES:
        raise ConfigError(f"{path}: its YAML aliases expand to {count:,} values (at most {_MAX_CONFIG_NODES:,} in a "
                          f"config); write the values out instead of repeating aliases")


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> TrainConfig:
    """Load a YAML file (optional) and apply ``dotted.key=value`` overrides; validate; return the dataclass tree,
    read-only.

    Raises `ConfigError` listing every problem found.
    """
    errors: List[str] = []
    cfg = OmegaConf.structured(TrainConfig)
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        _check_size(path)
        try:
            raw = OmegaConf.load(path)
        except yaml.MarkedYAMLError as err:  # file:line:column, as compilers and YAML linters print it
            mark = err.problem_mark or err.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
            raise ConfigError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
        except Exception as err:  # other YAML errors (e.g. a bad encoding) carry no position
            raise ConfigError(f"cannot parse {path}: {str(err).splitlines()[0]}") from None
        if not isinstance(raw, type(OmegaConf.create({}))):
            raise ConfigError(f"{path} must hold a mapping of config sections, got a list")
        _merge_checked(cfg, raw, errors, path)
    for item in overrides or []:
        try:
            [(key, value)] = parse_overrides([item])
        except ConfigError as err:
            errors.append(str(err))
            continue
        try:
            cfg.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"override {key}: {_describe(err, key, value)}")
    # A failed merge leaves its key at the value before it, so the values that did merge are still checked: bad
    # values are reported together with unknown keys.
    try:
        obj: TrainConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        obj = None
        errors += [] if errors else [f"invalid config: {str(err).splitlines()[0]}"]
    if obj is not None:
        errors += validate(obj)
    if errors:
        raise ConfigError(f"{len(errors)} problems: " + "; ".join(errors) if len(errors) > 1 else errors[0])
    return freeze(obj)


def term_keys() -> Dict[str, str]:
    """Each loss term of `mmcl.losses.TERMS` -> the key of its weight: ``loss.<term>``, or ``loss.<term>.weight``
    for a term with its own section of parameters (``loss.mochi``)."""
    from .losses import TERMS  # here, not above: the losses bring torch, which a model directory's config does not

    sections = _subsections(LossConfig)
    return {name: f"loss.{name}.weight" if name in sections else f"loss.{name}" for name in TERMS}


def get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


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
    if not 0 <= cfg.data.worker_nice <= 19:
        problems.append(f"data.worker_nice must be in [0, 19] (got {cfg.data.worker_nice})")
    for key in ("optim.image_layer_decay", "optim.text_layer_decay"):
        if not 0.0 < get(cfg, key) <= 1.0:
            problems.append(f"{key} must be in (0, 1] (got {get(cfg, key)})")
    problems += _sample_key_problems(cfg.data)
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
    problems += _eval_problems(cfg)
    if cfg.model.pretrained and cfg.model.init_from:
        problems.append("model.pretrained and model.init_from are both set: model.pretrained names a model (its "
                        "weights, and its architecture where it has one), model.init_from loads weights into "
                        "model.name; set one")
    problems += data_weight_problems(cfg.data)
    problems += aug_problems(cfg.data.aug)
    if cfg.train.wise_ft is not None and (not cfg.train.wise_ft or any(not 0 <= a <= 1 for a in cfg.train.wise_ft)):
        problems.append(f"train.wise_ft must be a list of alphas in [0, 1] (got {list(cfg.train.wise_ft)})")
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


def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML, every credential a data source carries hidden (`mmcl.errors.redact_values`)."""
    from .errors import redact_values

    return OmegaConf.to_yaml(OmegaConf.create(redact_values(to_dict(cfg))))


def to_dict(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: Dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved by `to_yaml`/`to_dict` (e.g. a run's config.yaml), moved keys carried over."""
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(moved_keys_carried(data)))
    return freeze(OmegaConf.to_object(cfg))
