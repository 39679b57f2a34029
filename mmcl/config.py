"""Typed configuration: a dataclass tree loaded from YAML and overridden by ``dotted.key=value``.

The schema is the dataclasses below; OmegaConf does the YAML parsing, merging and type conversion
(it parses override values by the field's declared type). Unknown keys and bad values become a
`ConfigError` that names the key and the closest valid keys, and every problem is reported at once.

A config returned by `load_config` or `from_dict` is read-only: assigning to any of its fields raises
`dataclasses.FrozenInstanceError`, so nothing changes it during a run. A changed copy is made with
`dataclasses.replace` (or, better, with an override).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

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
    object.__setattr__(cfg, "_frozen", True)
    return cfg


@dataclass
class TextTowerConfig(_Section):
    """Text tower choice. ``hf`` set means a Hugging Face transformers model (name or local path)."""

    hf: Optional[str] = None
    pooling: str = "mean"  # mean | cls | max  (Hugging Face towers)
    projection: str = "mlp"  # mlp | linear | none  (Hugging Face towers)


@dataclass
class ModelConfig(_Section):
    name: str = "tiny"  # an mmcl model config (mmcl/models/model_configs/*.json) or any open_clip architecture
    embed_dim: Optional[int] = None
    image_size: Optional[int] = None
    context_length: Optional[int] = None
    vision_cfg: Dict[str, Any] = field(default_factory=dict)  # raw overrides of open_clip's vision_cfg
    text_cfg: Dict[str, Any] = field(default_factory=dict)  # raw overrides of open_clip's text_cfg
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    init_logit_scale: float = math.log(1 / 0.07)  # CLIP (Radford et al. 2021)
    init_logit_bias: Optional[float] = None  # set for SigLIP; -10 there (Zhai et al. 2023)
    init_from: Optional[str] = None  # open_clip .pt/.safetensors/local-dir, an mmcl run or export, HF CLIP dir
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_image_freeze_bn_stats: bool = False
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    lock_text_freeze_layer_norm: bool = False
    grad_checkpointing: bool = False
    # FLIP (Li et al. 2023): fraction of image patches dropped in training (ViT towers; evaluation is unmasked)
    patch_dropout: float = 0.0


@dataclass
class DataConfig(_Section):
    train: Any = None  # brace-expanded spec, '::'-separated specs, a glob, or a list of those
    weights: Optional[List[float]] = None  # per-source sampling weights (resampled mode)
    batch_size: int = 64  # per process
    workers: int = 2  # dataloader workers per process
    shuffle_buffer: int = 1000
    resampled: bool = False
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
    caption_key: Any = "txt"
    caption_key_weights: Optional[List[float]] = None
    # A remote shard (http(s), pipe:, ...) that cannot be opened or breaks off mid-stream is opened again this
    # many times, after retry_delay seconds doubling each time (1 + 2 + 4 s by default), and read on from the
    # sample that broke; only then is it skipped and counted.
    retries: int = 3
    retry_delay: float = 1.0
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


@dataclass
class MochiConfig(_Section):
    weight: float = 0.0
    n_hard: int = 64  # N: hardest negatives considered per query
    s: int = 32  # synthetic negatives mixed from two hard negatives
    s_prime: int = 16  # harder negatives mixed from the query and a hard negative
    mix_max: float = 0.5  # coefficient for query mixing is drawn from (0, mix_max)
    queue_size: int = 0  # past features of the other modality kept as extra negatives


@dataclass
class LossConfig(_Section):
    clip: float = 1.0
    supcon: float = 0.0
    siglip: float = 0.0
    align: float = 0.0
    uniform: float = 0.0
    debiased: float = 0.0
    tau_plus: float = 0.1  # class prior of Chuang et al. 2020
    hard_negative: float = 0.0
    hn_beta: float = 1.0  # concentration of Robinson et al. 2021
    align_alpha: float = 2.0
    uniform_t: float = 2.0
    chunk_size: Optional[int] = None  # tiled (memory-linear) softmax and sigmoid losses when set
    max_logit_scale: float = 100.0
    mochi: MochiConfig = field(default_factory=MochiConfig)
    distill: float = 0.0  # KL from a teacher's contrastive distributions (distill.teacher or distill.from_shards)


@dataclass
class OptimConfig(_Section):
    lr: float = 5e-4
    weight_decay: float = 0.2
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | constant | linear
    min_lr: float = 0.0
    grad_clip: Optional[float] = 1.0
    # Learning-rate multiplier of each tower, and layer-wise decay within it (1.0: off); see mmcl/optim.py
    image_lr_mult: float = 1.0
    text_lr_mult: float = 1.0
    image_layer_decay: float = 1.0
    text_layer_decay: float = 1.0


@dataclass
class TrainSection(_Section):
    steps: int = 150
    samples: Optional[int] = None  # a budget in samples (all processes); when set it gives the number of steps
    output_dir: str = "runs/tiny"
    seed: int = 0
    log_every: int = 10
    save_every: int = 50
    keep_checkpoints: int = 2
    # auto | fp32 | bf16 | fp16; auto: the launcher's mixed precision (`accelerate launch`'s mixed_precision, passed
    # as ACCELERATE_MIXED_PRECISION), fp32 without one. A set value that a launcher contradicts is an error.
    precision: str = "auto"
    tf32: bool = True  # TF32 tensor cores for float32 matmuls and convolutions on CUDA (as open_clip); no-op elsewhere
    accum_steps: int = 1  # micro-batches forming one contrastive batch
    compile: bool = False
    nan_policy: str = "stop"  # stop | skip
    plot: bool = True
    progress: bool = True
    # Exponential moving average of the trainable weights, used by evaluation, model/ and exports (e.g. 0.999)
    ema_decay: Optional[float] = None
    # Trackers through accelerate (tensorboard | wandb | mlflow | aim); metrics.jsonl is always written
    log_with: List[str] = field(default_factory=lambda: ["tensorboard"])
    unmasked_steps: int = 0  # the last K steps run without model.patch_dropout (FLIP's unmasked tuning)
    # Seconds a collective between the processes may wait before the run ends with "another process ... did not
    # answer"; null: torch's default (10 min for NCCL, 30 min for gloo). Evaluations and the final save do not
    # count against it (eval.timeout_s).
    dist_timeout_s: Optional[float] = None


@dataclass
class EvalConfig(_Section):
    every: int = 0  # steps between evaluations during training; 0 evaluates only at the end if data is set
    zeroshot: Optional[str] = None  # ImageFolder or shards with .cls
    classnames: Optional[str] = None
    templates: str = "auto"  # templates.txt beside the data, else open_clip's openai_imagenet_template
    retrieval: Optional[str] = None  # shards
    batch_size: int = 128
    # Seconds the other processes wait for the main process's evaluation (and, at the end, model/ and plots)
    timeout_s: float = 14400.0


@dataclass
class DistillConfig(_Section):
    teacher: Optional[str] = None  # a model mmcl.load reads: an mmcl run or export, open_clip local-dir, HF CLIP dir
    from_shards: bool = False  # the teacher embeddings `mmcl reinforce` stored in the shards instead of a teacher


@dataclass
class TrainConfig(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# train.precision's values and the name accelerate (``mixed_precision``, ACCELERATE_MIXED_PRECISION) gives each.
PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

_CHOICES = {
    "model.text.pooling": ("mean", "cls", "max"),
    "model.text.projection": ("mlp", "linear", "none"),
    "optim.schedule": ("cosine", "constant", "linear"),
    "train.precision": ("auto", *PRECISIONS),
    "train.nan_policy": ("stop", "skip"),
}
_POSITIVE = (
    "data.batch_size", "train.steps", "train.samples", "train.log_every", "train.accum_steps", "eval.batch_size",
    "train.dist_timeout_s", "eval.timeout_s", "data.max_member_bytes",
)
_NON_NEGATIVE = (
    "data.workers", "data.shuffle_buffer", "data.retries", "data.retry_delay", "data.read_timeout",
    "train.save_every",
    "train.keep_checkpoints", "optim.warmup_steps",
    "optim.lr", "optim.weight_decay", "loss.clip", "loss.supcon", "loss.siglip", "loss.align", "loss.uniform",
    "loss.debiased", "loss.hard_negative", "loss.mochi.weight", "loss.mochi.queue_size", "loss.distill", "eval.every",
    "optim.image_lr_mult", "optim.text_lr_mult", "train.unmasked_steps",
)


def valid_keys(schema=TrainConfig, prefix: str = "") -> List[str]:
    """All dotted keys of the schema (leaves and sub-trees)."""
    keys = []
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type in _SUBTREES):
            keys += valid_keys(_SUBTREES[f.type] if isinstance(f.type, str) else f.type, key + ".")
    return keys


_SUBTREES = {
    "TextTowerConfig": TextTowerConfig, "ModelConfig": ModelConfig, "DataConfig": DataConfig,
    "MochiConfig": MochiConfig, "LossConfig": LossConfig, "OptimConfig": OptimConfig,
    "TrainSection": TrainSection, "EvalConfig": EvalConfig, "DistillConfig": DistillConfig,
}


def _nearest(key: str) -> str:
    keys = valid_keys()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:  # match on the last component, e.g. 'batchsize' -> data.batch_size
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.7)][:3]
    return ("; did you mean " + " or ".join(close) + "?") if close else ""


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, ConfigKeyError) or "not in" in str(err):
        return f"unknown config key '{key}'{_nearest(key)}"
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        return f"bad value for '{key}': {msg}"
    return f"'{key}': {str(err).splitlines()[0]}"


def _merge_checked(base, other, errors: List[str], source: str):
    """Merge `other` into `base` key by key so that every bad key is reported, not just the first."""
    flat = _flatten(OmegaConf.to_container(other, resolve=False))
    for key, value in flat:
        try:
            base.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"{source}: {_describe(err)}")
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
        # YAML parsing gives ints, floats, bools, null and lists; the schema then converts by field type.
        value = OmegaConf.from_dotlist([f"v={raw}"]).v
        pairs.append((key.strip(), value))
    return pairs


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
        try:
            raw = OmegaConf.load(path)
        except Exception as err:  # YAML syntax errors come in many types
            raise ConfigError(f"cannot parse {path}: {str(err).splitlines()[0]}") from None
        if not isinstance(raw, type(OmegaConf.create({}))):
            raise ConfigError(f"{path} must hold a mapping of config sections, got a list")
        _merge_checked(cfg, raw, errors, path)
    for key, value in parse_overrides(overrides or []):
        try:
            cfg.merge_with(_nested(key, value))
        except OmegaConfBaseException as err:
            errors.append(f"override {key}: {_describe(err)}")
    if not errors:
        obj: TrainConfig = OmegaConf.to_object(cfg)
        errors += validate(obj)
    if errors:
        raise ConfigError("; ".join(errors) if len(errors) > 1 else errors[0])
    return freeze(obj)


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
    for key in _NON_NEGATIVE:
        if get(cfg, key) < 0:
            problems.append(f"{key} must be >= 0 (got {get(cfg, key)})")
    if cfg.loss.chunk_size is not None and cfg.loss.chunk_size <= 0:
        problems.append(f"loss.chunk_size must be a positive integer or null (got {cfg.loss.chunk_size})")
    terms = ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative", "distill")
    if not any(getattr(cfg.loss, t) > 0 for t in terms) and cfg.loss.mochi.weight <= 0:
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
    if not loss.max_logit_scale >= 1:  # the scale's parameter is clamped into [0, log(max_logit_scale)]
        problems.append(f"loss.max_logit_scale must be >= 1 (got {loss.max_logit_scale})")
    if loss.siglip > 0 and cfg.model.init_logit_bias is None:
        problems.append("loss.siglip > 0 needs a model with a logit bias (got none; set model.init_logit_bias, "
                        "e.g. -10)")
    if not 0 <= cfg.data.worker_nice <= 19:
        problems.append(f"data.worker_nice must be in [0, 19] (got {cfg.data.worker_nice})")
    for key in ("optim.image_layer_decay", "optim.text_layer_decay"):
        if not 0.0 < get(cfg, key) <= 1.0:
            problems.append(f"{key} must be in (0, 1] (got {get(cfg, key)})")
    problems += _sample_key_problems(cfg.data)
    unknown = [t for t in cfg.train.log_with if t not in ("tensorboard", "wandb", "mlflow", "aim")]
    if unknown:
        problems.append(f"train.log_with: unknown tracker(s) {', '.join(map(repr, unknown))} (choose from "
                        f"tensorboard, wandb, mlflow, aim)")
    if not 0.0 <= cfg.model.patch_dropout < 1.0:
        problems.append(f"model.patch_dropout must be in [0, 1) (got {cfg.model.patch_dropout})")
    if cfg.train.ema_decay is not None and not 0.0 < cfg.train.ema_decay < 1.0:
        problems.append(f"train.ema_decay must be in (0, 1) or null (got {cfg.train.ema_decay})")
    problems += _distill_problems(cfg)
    if cfg.data.weights is not None and any(w < 0 for w in cfg.data.weights):
        problems.append("data.weights must be non-negative")
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
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: Dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved by `to_yaml`/`to_dict` (e.g. a run's config.yaml)."""
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(data))
    return freeze(OmegaConf.to_object(cfg))
