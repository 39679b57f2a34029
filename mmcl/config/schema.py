"""The schema: the dataclass tree of the config, each key's type, default and description.

A leaf key's description is declared with it (`described`, the ``help`` entry of the field's metadata): it is what
``mmcl train --help`` and docs/reference/config.md print for the key (`mmcl.config.keys.describe_keys`). A
section's keys are read-only once `freeze` has run on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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


def described(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with `default` (or a `factory` making it) whose description, `help`, is in its metadata:
    the one text ``mmcl train --help`` and the reference page give for the key."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class TextTowerConfig(_Section):
    """Text tower choice. ``hf`` set means a Hugging Face transformers model (name or local path)."""

    hf: Optional[str] = described(None, "a Hugging Face model name or local path as the text tower; null: open_clip's")
    pooling: str = described("mean", "how a Hugging Face text tower pools its tokens: mean | cls | max")
    projection: str = described("mlp", "a Hugging Face text tower's projection to the embedding: mlp | linear | none")


@dataclass
class LoraConfig(_Section):
    """LoRA fine-tuning (Hu et al. 2021) with peft: low-rank adapters on the chosen towers' layers; every other
    weight is frozen. ``r`` 0 leaves the model as it is."""

    r: int = described(0, "rank of the LoRA adapters; 0: no LoRA (the model trains as configured)")
    alpha: float = described(16.0, "LoRA's scaling numerator: an adapter's update is scaled by alpha / r")
    dropout: float = described(0.0, "dropout on each adapter's input in training, in [0, 1)")
    target_modules: List[str] = described(
        factory=lambda: ["attn", "c_fc", "c_proj"],
        help="Layers that get adapters, by name or name suffix as peft matches them. The default adapts open_clip's "
             "attention (attn, an nn.MultiheadAttention: its packed q/k/v projection) and MLP (c_fc, c_proj) in "
             "every block")
    towers: List[str] = described(factory=lambda: ["image", "text"], help="towers given adapters: image, text")


@dataclass
class ModelConfig(_Section):
    name: str = described(
        "tiny",
        "an mmcl model config (mmcl/models/model_configs/*.json), any open_clip architecture, or a .json file in "
        "open_clip's model-config format (embed_dim, vision_cfg, text_cfg; optionally preprocess_cfg)")
    embed_dim: Optional[int] = described(None, "width of the shared embedding; null: the model config's")
    image_size: Optional[int] = described(None, "input resolution of the image tower; null: the model config's")
    context_length: Optional[int] = described(
        None,
        "tokens per caption; null: the model config's. Longer than the text positions of the weights that "
        "model.pretrained or model.init_from loads: their table is stretched as Long-CLIP does (the first 20 as "
        "trained, the rest interpolated); a Hugging Face text tower up to its max_position_embeddings. Captions "
        "still longer are cut and counted (data/cut_captions)")
    vision_cfg: Dict[str, Any] = described(factory=dict, help="raw overrides of open_clip's vision_cfg")
    text_cfg: Dict[str, Any] = described(factory=dict, help="raw overrides of open_clip's text_cfg")
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    init_logit_scale: float = described(
        math.log(1 / 0.07), "The logit scale's initial logarithm: log(1/0.07), as CLIP (Radford et al. 2021)")
    init_logit_bias: Optional[float] = described(None, "set for SigLIP; -10 there (Zhai et al. 2023)")
    max_logit_scale: float = described(
        100.0, "the learned logit scale is clamped to at most this after each step (CLIP: 100)")
    init_from: Optional[str] = described(
        None, "open_clip .pt/.safetensors/local-dir, an mmcl run or export, HF CLIP dir")
    pretrained: Optional[str] = described(
        None,
        "Published weights by name, as open_clip's --pretrained: an open_clip tag of model.name (openai, "
        "laion2b_s34b_b79k), hf-hub:ORG/NAME, or a local file/directory (an open_clip_train run included); downloaded "
        "into the Hugging Face cache. A source with its own config brings its architecture; not with init_from.")
    lock_image: bool = described(False, "freeze the image tower (LiT; open_clip's --lock-image)")
    lock_image_unlocked_groups: int = described(0, "last layer groups of a locked image tower left trainable")
    lock_image_freeze_bn_stats: bool = described(False, "also freeze a locked image tower's BatchNorm statistics")
    lock_text: bool = described(False, "freeze the text tower (open_clip's --lock-text)")
    lock_text_unlocked_layers: int = described(0, "last layers of a locked text tower left trainable")
    lock_text_freeze_layer_norm: bool = described(False, "also freeze a locked text tower's LayerNorms")
    grad_checkpointing: bool = described(False, "recompute activations in the backward pass: less memory, more compute")
    patch_dropout: float = described(
        0.0,
        "FLIP (Li et al. 2023): fraction of image patches dropped in training (ViT towers; evaluation is unmasked)")
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class AugConfig(_Section):
    """Training augmentation, open_clip's ``AugmentationCfg`` key for key (its ``--aug-cfg``); evaluation never
    augments. ``ratio``, ``re_prob`` and ``re_count`` act only through timm's transform (``use_timm``)."""

    scale: List[float] = described(factory=lambda: [0.9, 1.0], help="random resized crop's area fraction range")
    ratio: Optional[List[float]] = described(None, "the crop's aspect-ratio range (timm only); null: (3/4, 4/3)")
    color_jitter: Optional[List[float]] = described(
        None,
        "Colour jitter strength: brightness, contrast, saturation, hue (4 values, applied with color_jitter_prob), or "
        "with use_timm one value or 3-4 values as timm takes them")
    color_jitter_prob: Optional[float] = described(
        None, "probability of the jitter (SimCLR style; needs 4 color_jitter values)")
    gray_scale_prob: Optional[float] = described(None, "probability of converting to grayscale (3 channels kept)")
    re_prob: Optional[float] = described(None, "random erasing probability (timm only)")
    re_count: Optional[int] = described(None, "random erasing count (timm only)")
    use_timm: bool = described(False, "build the train transform with timm's create_transform, as open_clip does")


@dataclass
class NaflexConfig(_Section):
    """Native-resolution batches for a NaFlex image tower (SigLIP 2; mmcl/data/naflex.py, docs/naflex.md)."""

    seq_lens: List[int] = described(
        factory=list,
        help="Patch-sequence lengths, one drawn per batch from the seed and the batch's number (e.g. [128, 256, 576, "
             "784]); each image is resized, aspect ratio kept, to the most patches that fit and padded to the length. "
             "Empty: NaFlex off")
    seq_len_probs: Optional[List[float]] = described(None, "weights of seq_lens (one each); null: equal")
    max_tokens_per_batch: int = described(
        8192, "patch tokens per batch on each process: a batch holds max_tokens_per_batch // L pairs")
    patch_size: Optional[int] = described(None, "the tower's patch size; null: read from the tower")


@dataclass
class DataConfig(_Section):
    train: Any = described(None, "brace-expanded spec, '::'-separated specs, a glob, or a list of those")
    weights: Optional[List[float]] = described(None, "per-source sampling weights (resampled mode)")
    batch_size: int = described(64, "samples per batch on each process")
    workers: Optional[int] = described(
        None, "dataloader workers per process; null: its share of the CPUs less 1 (at least 1, no upper cap)")
    shuffle_buffer: int = described(1000, "samples per shuffled block (a seeded permutation within each)")
    resampled: bool = described(False, "draw shards with replacement for ever (open_clip's --dataset-resampled)")
    max_image_pixels: int = described(89_478_485, "pillow's decompression-bomb limit")
    fast_decode: bool = described(True, "JPEG draft-mode decoding at reduced size")
    uint8_transfer: bool = described(
        True,
        "Images travel from the workers as uint8 and are scaled/normalised on the training device (exact, 4x less "
        "shared and device memory traffic); used when the transform ends in ToTensor [+ Normalize].")
    decode: str = described(
        "worker",
        "Where training images are decoded: worker (Pillow in the data workers) or device (the workers send the "
        "encoded JPEGs with their crop boxes; the training device decodes, crops, resizes and normalises them with "
        "torchvision.io.decode_jpeg: nvJPEG on CUDA). Other formats, and runs whose augmentation needs PIL, decode in "
        "the workers; the start line says which path a run takes and why.")
    worker_nice: int = described(
        0,
        "Niceness the data workers add to their own (0-19). On a CPU-only machine a higher value makes the workers "
        "yield to the training threads; measured on 2 cores it helped in some runs and hurt in others "
        "(BENCHMARKS.md).")
    image_key: Optional[str] = described(
        None,
        "What a sample is: the image member (null: the first of jpg, jpeg, png, webp) and the caption source(s), each "
        "a member (txt) or a JSON field (json:caption, json:captions holding a list); with several captions one is "
        "drawn per epoch from the seed, the sample's key and the epoch. Weights (one per source) choose between "
        "sources.")
    caption_key: Any = described("txt", "the caption source(s): a member (txt), a JSON field (json:caption), or a list")
    caption_key_weights: Optional[List[float]] = described(None, "one weight per caption source; null: equal")
    retries: int = described(
        3,
        "A remote shard (http(s), pipe:, ...) that cannot be opened or breaks off mid-stream is opened again this "
        "many times, after retry_delay seconds doubling each time (1 + 2 + 4 s by default), and read on from the "
        "sample that broke; only then is it skipped and counted.")
    retry_delay: float = described(1.0, "seconds before the first retry of a remote shard (doubling after each)")
    read_timeout: float = described(
        300.0,
        "A pipe shard (pipe: command, http(s) through curl) that sends nothing for this many seconds while it is read "
        "is killed with its children and treated as broken off (then retried); 0 waits for ever.")
    max_member_bytes: int = described(
        64 * 2 ** 20,
        "The largest shard member read (bytes): a sample needing a larger one is skipped and counted (too_large) "
        "without reading it, so a small .tar.gz holding gigabytes of zeros cannot exhaust memory. 64 MiB holds any "
        "real photo (a 50 MP JPEG is about 25 MB) and stored embeddings; members a sample does not use are never "
        "read.")
    allow_pipe: bool = described(
        False,
        "A shard list file (data.train=shards.yaml) comes with the data: its pipe: entries are commands that run on "
        "this machine, refused unless allowed here. pipe: commands typed in the config or an override always run.")
    require_all_shards: bool = described(
        False,
        "A source of data.train with some of its shards missing (a LAION download with holes) is trained on the "
        "shards that exist, with one warning giving the count missing; true refuses such a run before its first step.")
    train_num_samples: Optional[int] = described(
        None,
        "Samples in one pass over data.train (open_clip's --train-num-samples), for train.epochs; null: read from the "
        "counts beside the shards (sizes.json, img2dataset's _stats.json, __len__; mmcl/data/sizes.py).")
    negatives: int = described(
        0,
        "Negative captions from the data (NegCLIP): each sample brings up to this many (the lines of its neg.txt "
        "member, then its JSON member's negatives list; drawn per epoch when it has more, at most 64), and each adds "
        "a column to its own image's row of the image-to-text logits of loss.clip and loss.siglip; eval.val_loss "
        "reads as many of its held-out samples' (val/negatives/...). 0: none read.")
    aug: AugConfig = field(default_factory=AugConfig)  # training augmentation: open_clip's AugmentationCfg
    naflex: NaflexConfig = field(default_factory=NaflexConfig)  # native-resolution batches (NaFlex towers)


@dataclass
class MochiConfig(_Section):
    weight: float = described(0.0, "weight of MoCHi (Kalantidis et al. 2020): InfoNCE with synthesised hard negatives")
    n_hard: int = described(64, "N: hardest negatives considered per query")
    s: int = described(32, "synthetic negatives mixed from two hard negatives")
    s_prime: int = described(16, "harder negatives mixed from the query and a hard negative")
    mix_max: float = described(0.5, "coefficient for query mixing is drawn from (0, mix_max)")
    queue_size: int = described(0, "past features of the other modality kept as extra negatives")


@dataclass
class GlobalContrastiveConfig(_Section):
    weight: float = described(
        0.0,
        "weight of the global contrastive loss (SogCLR, Yuan et al. 2022; FastCLIP, Wei et al. 2024): InfoNCE whose "
        "softmax normalisers are per-sample moving estimates over many batches, for small batches")
    gamma: float = described(0.9, "inner rate of the moving estimates, in (0, 1]; 1 uses the batch's own (= loss.clip)")
    gamma_schedule: str = described(
        "constant", "constant | cosine (FastCLIP: from 1 down to gamma over gamma_decay_steps)")
    gamma_decay_steps: int = described(0, "optimiser steps of the cosine decay of gamma")
    eps: Optional[float] = described(
        None,
        "constant inside log(eps + u); null: 1 / (global batch - 1), InfoNCE's weight of the positive; 1 / (samples - "
        "1) approaches the whole data set's InfoNCE")
    table_size: int = described(
        2 ** 20,
        "slots of the per-sample estimates, 8 bytes each (saved in every process's checkpoint state); samples are "
        "hashed into them, so a few times the data set's samples keeps shared slots rare")


@dataclass
class SelfDistillConfig(_Section):
    """SILC's self-distillation (Naeem et al. 2023), SigLIP 2's form: an EMA teacher of the image tower scores the
    whole image, the student each of its local crops, through DINO's projection head to K prototypes; the student's
    distributions must match the teacher's centred and sharpened ones (mmcl/losses/self_distill.py,
    mmcl/models/siglip2.py). The teacher and the heads are shared with loss.masked."""

    # Passed to the objective under these names (the rest are the model side's, `mmcl.models.siglip2`)
    OBJECTIVE_KEYS = {"student_temp": "self_distill_student_temp"}

    weight: float = described(
        0.0, "weight of SILC's local-to-global self-distillation (SigLIP 2's second stage; open_clip ViT towers)")
    start_fraction: float = described(
        0.8, "the term starts at this fraction of the run's steps (SigLIP 2: the last 20 %); before it, nothing runs")
    prototypes: int = described(8192, "K: the projection head's prototypes (its output scores)")
    head_hidden: int = described(2048, "the projection head's hidden width (DINO: three layers, GELU)")
    head_bottleneck: int = described(256, "the projection head's L2-normalised bottleneck before the prototypes")
    student_temp: float = described(0.1, "the student's softmax temperature (SILC, DINO: 0.1)")
    teacher_temp: float = described(0.04, "the teacher's softmax temperature, low to sharpen (DINO: 0.04-0.07)")
    center_momentum: float = described(0.9, "momentum of the running centre of the teacher's scores (DINO: 0.9)")
    local_crops: int = described(8, "local crops per image seen by the student (SigLIP 2: 8)")
    local_size: int = described(
        0, "side of a local crop in pixels (a multiple of the patch size); 0: half the model's image size")
    local_scale: List[float] = described(
        factory=lambda: [0.05, 0.4], help="area fraction range of a local crop (DINO: 0.05-0.4)")
    teacher_ema_decay: float = described(
        0.996, "the teacher's EMA decay per applied step (DINO: 0.996); shared with loss.masked")


@dataclass
class MaskedConfig(_Section):
    """TIPS' masked prediction (Maninis et al. 2025), SigLIP 2's form: the student sees the image with patches
    replaced by a mask token and its patch head predicts the teacher's patch distributions at the masked positions
    (mmcl/losses/masked.py). The teacher, its EMA decay and the head sizes are loss.self_distill's."""

    OBJECTIVE_KEYS = {"student_temp": "masked_student_temp"}

    weight: float = described(
        0.0, "weight of TIPS' masked patch prediction (SigLIP 2's second stage; open_clip ViT towers)")
    start_fraction: float = described(
        0.8, "the term starts at this fraction of the run's steps (SigLIP 2: the last 20 %); before it, nothing runs")
    mask_ratio: float = described(0.5, "share of the patches masked in the student's view (SigLIP 2: 50 %)")
    prototypes: int = described(8192, "K: the patch head's prototypes")
    student_temp: float = described(0.1, "the student's softmax temperature (iBOT: 0.1)")
    teacher_temp: float = described(0.04, "the teacher's softmax temperature (iBOT: 0.04-0.07)")
    center_momentum: float = described(0.9, "momentum of the running centre of the teacher's patch scores")


@dataclass
class ShortCaptionConfig(_Section):
    """Long-CLIP's short-caption term (Zhang et al. 2024; mmcl/losses/short_caption.py): beside the caption a run
    trains on, each image's short caption (the caption's first sentence) is scored against the image's features
    rebuilt from the global batch's top principal directions, so that fine-tuning on long captions keeps short ones
    (zero-shot prompts) matched. docs/finetuning.md."""

    OBJECTIVE_KEYS = {"components": "short_caption_components"}

    weight: float = described(
        0.0, "weight of Long-CLIP's short-caption term (its first sentence against the image's principal components)")
    components: int = described(32, "principal directions of the global batch's image features kept (Long-CLIP: 32)")


# The loss terms by name, in the objective's table order (`mmcl.losses.TERMS`, which imports torch; the config and
# everything that loads a model read these instead, and tests/losses/test_objective.py holds the two equal): each has
# its weight in `LossConfig`, ``loss.<term>`` or ``loss.<term>.weight`` (`mmcl.config.term_keys`). The terms that
# score a varying number of pairs per process (NaFlex) are `mmcl.losses.VARIABLE_PAIR_TERMS`' names, and the sample
# terms (scored sample by sample from the model's outputs, `mmcl.losses.SAMPLE_TERMS`) take one too.
LOSS_TERMS = ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative", "mochi", "distill",
              "global_contrastive", "short_caption", "caption", "self_distill", "masked")
VARIABLE_PAIR_TERMS = ("clip", "siglip")
SAMPLE_TERMS = ("caption", "self_distill", "masked")
# The sample terms whose teacher is an EMA of the image tower (`mmcl.models.siglip2`): an open_clip ViT, no NaFlex
TEACHER_TERMS = ("self_distill", "masked")

@dataclass
class LossConfig(_Section):
    clip: float = described(1.0, "weight of InfoNCE, CLIP's symmetric cross-entropy")
    supcon: float = described(
        0.0, "weight of supervised contrastive (Khosla et al. 2020; pairs sharing a label or caption)")
    siglip: float = described(0.0, "weight of SigLIP's sigmoid loss (Zhai et al. 2023; needs model.init_logit_bias)")
    align: float = described(0.0, "weight of alignment (Wang & Isola 2020); always reported as a metric")
    uniform: float = described(0.0, "weight of uniformity (Wang & Isola 2020); always reported as a metric")
    debiased: float = described(0.0, "weight of debiased InfoNCE (Chuang et al. 2020)")
    tau_plus: float = described(0.1, "class prior of Chuang et al. 2020")
    hard_negative: float = described(0.0, "weight of hard-negative reweighted InfoNCE (Robinson et al. 2021)")
    hn_beta: float = described(1.0, "concentration of Robinson et al. 2021")
    align_alpha: float = described(2.0, "exponent of the distance in the alignment term")
    uniform_t: float = described(2.0, "temperature of the uniformity term's Gaussian kernel")
    chunk_size: Optional[int] = described(None, "tiled (memory-linear) softmax and sigmoid losses when set")
    mochi: MochiConfig = field(default_factory=MochiConfig)
    global_contrastive: GlobalContrastiveConfig = field(default_factory=GlobalContrastiveConfig)
    distill: float = described(
        0.0, "KL from a teacher's contrastive distributions (distill.teacher or distill.from_shards)")
    short_caption: ShortCaptionConfig = field(default_factory=ShortCaptionConfig)
    caption: float = described(
        0.0, "weight of the captioning term (CoCa, Yu et al. 2022; SigLIP 2's decoder): a text decoder reads the image "
             "tower's tokens and predicts the caption, next-token cross-entropy over the batch's caption tokens; "
             "needs a model with a decoder (model.name coca_*)")
    caption_parallel: float = described(
        0.0, "share of the captions the decoder predicts in parallel (CapPa, Tschannen et al. 2023; LocCa): from the "
             "image alone, every token at once, its inputs mask queries and its self-attention not causal; drawn per "
             "sample and epoch; CapPa: 0.75")
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    masked: MaskedConfig = field(default_factory=MaskedConfig)


@dataclass
class OptimConfig(_Section):
    name: str = described(
        "adamw",
        "The optimiser: adamw (torch's AdamW, fused where the device has the kernel), or any name of timm's "
        "optimiser factory (timm.optim.list_optimizers(): lamb, lion, adafactor, muon, adamuon, sgd, ...), over the "
        "same parameter groups (weight-decay split, per-tower and layer-wise rates); docs/training.md, Optimizers")
    lr: float = described(5e-4, "peak learning rate")
    weight_decay: float = described(
        0.2, "weight decay, not on gains, biases and the logit scale (AdamW's is decoupled; each of timm's optimisers "
             "applies it its own way)")
    beta1: float = described(0.9, "AdamW's first-moment decay (optim.name=adamw only; others: optim.kwargs)")
    beta2: float = described(0.98, "AdamW's second-moment decay (optim.name=adamw only; others: optim.kwargs)")
    eps: float = described(1e-6, "AdamW's epsilon (optim.name=adamw only; others: optim.kwargs)")
    kwargs: Dict[str, Any] = described(
        factory=dict,
        help="Further keyword arguments of the optimiser's constructor, e.g. {momentum: 0.9} for sgd, {betas: [0.9, "
             "0.99]} for lion. optim.beta1/beta2/eps are adamw's alone: they mean other things elsewhere (Lion's "
             "betas, Adafactor's eps of 1e-30, Muon's eps of Newton-Schulz and its AdamW fallback), so any other "
             "optimiser keeps its own defaults unless set here. lr and weight_decay are mmcl's keys (per group); "
             "with adamw, so are betas, eps and fused")
    warmup_steps: int = described(10, "steps of linear warm-up from 0 to optim.lr")
    schedule: str = described(
        "cosine",
        "cosine | linear | constant | const-cooldown | wsd. const-cooldown (open_clip's) and wsd "
        "(warmup-stable-decay, as transformers' get_wsd_schedule) are one schedule: warmup, the peak rate, then a "
        "decay to min_lr over the last cooldown_steps steps (or cooldown_fraction of the run).")
    min_lr: float = described(0.0, "where cosine/linear and the cooldown end (open_clip's --lr-cooldown-end)")
    cooldown_steps: Optional[int] = described(
        None, "steps of the final decay (const-cooldown, wsd); null: cooldown_fraction")
    cooldown_fraction: float = described(0.1, "the cooldown's share of the run when cooldown_steps is null")
    cooldown_shape: str = described(
        "linear",
        "The cooldown's shape over its progress p in [0, 1]: linear (1 - p) ** cooldown_power (open_clip's "
        "--lr-cooldown-power; 1 is linear), 1-sqrt (1 - sqrt(p), Hägele et al. 2024), cosine (0.5 (1 + cos(pi p)))")
    cooldown_power: float = described(1.0, "exponent of the linear cooldown shape (1: linear)")
    no_decay_pattern: Optional[str] = described(
        None,
        "Parameters whose names match this regular expression (re.search) are not decayed, in addition to gains, "
        "biases and the logit scale/bias; e.g. 'positional_embedding|class_embedding|token_embedding'")
    grad_clip: Optional[float] = described(1.0, "clip the global gradient norm to this; null: no clipping")
    image_lr_mult: float = described(
        1.0,
        "Learning-rate multiplier of each tower, and layer-wise decay within it (1.0: off); see "
        "mmcl/training/optim.py")
    text_lr_mult: float = described(1.0, "learning-rate multiplier of the text tower")
    image_layer_decay: float = described(1.0, "layer-wise learning-rate decay within the image tower")
    text_layer_decay: float = described(1.0, "layer-wise learning-rate decay within the text tower")


@dataclass
class DdpConfig(_Section):
    """Options given to torch's DistributedDataParallel (accelerate's `DistributedDataParallelKwargs`); null keeps
    torch's default. open_clip_train's --ddp-static-graph is ``static_graph: true``."""

    gradient_as_bucket_view: Optional[bool] = described(
        None, "gradients as views into the all-reduce buckets (less memory)")
    static_graph: Optional[bool] = described(None, "the same parameters get gradients every step (faster all-reduce)")
    bucket_cap_mb: Optional[float] = described(None, "all-reduce bucket size (torch: 25 MB)")


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
    steps: int = described(150, "optimiser steps of the run")
    samples: Optional[int] = described(
        None,
        "The run's length: train.steps, unless train.samples (a budget in samples, all processes) or train.epochs "
        "(passes over the data, open_clip's --epochs; data.train_num_samples or the shards' counts) is set; not both "
        "of these.")
    epochs: Optional[float] = described(None, "the run's length in passes over data.train (open_clip's --epochs)")
    output_dir: str = described("runs/tiny", "the run folder: config.yaml, metrics.jsonl, checkpoints/, model/")
    resume: str = described(
        "auto",
        "auto: a new or empty output_dir starts a run, the same run resumes, another run is refused "
        '(docs/reliability.md, "A run folder holds one run"); force: resume the run there despite config differences '
        "(config.yaml then records this config)")
    seed: int = described(0, "seeds the model's initialisation, the data order and the dropout")
    log_every: int = described(10, "steps between lines of metrics.jsonl (and the trackers)")
    save_every: int = described(50, "steps between resumable checkpoints, and one at the end (0: none)")
    keep_checkpoints: int = described(2, "the newest checkpoints kept; older ones are deleted")
    precision: str = described(
        "auto",
        "auto | fp32 | bf16 | fp16; auto: the launcher's mixed precision (`accelerate launch`'s mixed_precision, "
        "passed as ACCELERATE_MIXED_PRECISION), fp32 without one. A set value that a launcher contradicts is an "
        "error.")
    tf32: bool = described(
        True, "TF32 tensor cores for float32 matmuls and convolutions on CUDA (as open_clip); no-op elsewhere")
    accum_steps: int = described(1, "micro-batches forming one contrastive batch")
    compile: bool = described(False, "torch.compile the model")
    nan_policy: str = described("stop", "stop | skip")
    plot: bool = described(True, "write the run's plots (mmcl plot) at the end")
    progress: bool = described(True, "show a progress bar")
    ema_decay: Optional[float] = described(
        None,
        "Exponential moving average of the trainable weights, used by evaluation, model/ and exports (e.g. 0.999)")
    log_with: List[str] = described(
        factory=lambda: ["tensorboard"],
        help="Trackers through accelerate (tensorboard | wandb | mlflow | aim); metrics.jsonl is always written")
    unmasked_steps: int = described(0, "the last K steps run without model.patch_dropout (FLIP's unmasked tuning)")
    dist_timeout_s: Optional[float] = described(
        None,
        "Seconds a collective between the processes may wait before the run ends with "
        '"another process ... did not answer"; '
        "null: torch's default (10 min for NCCL, 30 min for gloo). Evaluations and the final save do not count "
        "against it (eval.timeout_s).")
    ddp: DdpConfig = field(default_factory=DdpConfig)  # torch DDP's options (multi-process, not FSDP)
    wise_ft: Optional[List[float]] = described(
        None,
        "WiSE-FT (Wortsman et al. 2022): after training, the weights (1 - a) * initial + a * final for each alpha a, "
        "each written as a model under output_dir/wise_ft/alpha_<a>/ and evaluated as the final model is (mmcl "
        "interpolate)")
    phases: List[PhaseConfig] = described(
        factory=list,
        help="Token-reduction phases (CLIPA, Li et al. 2023), in order: a list of {steps or fraction, image_size, "
             "context_length, patch_dropout}; a size left out keeps the model's own value; a phase's length is its "
             "steps or its fraction of the run's steps, and a last phase with neither takes the rest. Empty: every "
             "step at the model's own size (mmcl/training/phases.py)")


@dataclass
class EvalConfig(_Section):
    every: int = described(0, "steps between evaluations during training; 0 evaluates only at the end if data is set")
    zeroshot: Any = described(
        None,
        "Zero-shot classification sets: an ImageFolder or shards with .cls, or a list of named sets, each a path "
        "(named after it) or {name, data, every, classnames, templates} (every, classnames, templates default to "
        "eval.*); results go under eval/zeroshot_classification/<name>/<metric>")
    classnames: Optional[str] = described(
        None, "file with one class name per line in label order; null: beside the data")
    templates: str = described("auto", "a file with one template per line, one template such as 'a photo of a {}.', "
                                       "or a set of open_clip's; auto: templates.txt beside the data, else "
                                       "open_clip's openai_imagenet_template")
    retrieval: Any = described(
        None, "Retrieval sets: shards with captions, or a list of named sets, each a path or {name, data, every}")
    val_loss: Any = described(
        None,
        "Held-out shards scored with the run's own loss terms (open_clip's --val-data), without gradient, in batches "
        "of the run's global batch; logged as val/loss and val/<term>. With data.negatives, the held-out samples' "
        "negative captions are scored apart: val/negatives/loss (and /loss/<term>: the objective with them, as the "
        "run trains) and val/negatives/accuracy (the share their image scores below its own caption)")
    val_loss_every: Optional[int] = described(None, "steps between validation losses; null: eval.every")
    batch_size: int = described(128, "images (or captions) per evaluation batch")
    naflex_seq_len: List[int] = described(
        factory=list,
        help="NaFlex towers: the patch-sequence length(s) evaluation runs at; several evaluate each set at each "
             "(results named <set>@<length>); empty: the largest of data.naflex.seq_lens")
    timeout_s: float = described(
        14400.0,
        "Seconds the other processes wait for the main process's evaluation (and, at the end, model/ and plots)")


@dataclass
class DistillConfig(_Section):
    teacher: Optional[str] = described(
        None, "a model mmcl.load reads: an mmcl run or export, open_clip local-dir, HF CLIP dir")
    from_shards: bool = described(
        False, "the teacher embeddings `mmcl reinforce` stored in the shards instead of a teacher")


@dataclass
class TrackConfig(_Section):
    """How the ``train.log_with`` trackers name the run (mmcl/run/records.py). A key left null takes the
    tracker's own environment variable (W&B's WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME, WANDB_NOTES, WANDB_TAGS;
    MLflow's MLFLOW_EXPERIMENT_NAME, MLFLOW_TAGS), else mmcl's default."""

    project: Optional[str] = described(
        None, "W&B project, MLflow experiment, aim experiment; null: the environment, else mmcl")
    entity: Optional[str] = described(None, "W&B team or user; null: WANDB_ENTITY, else the account's default")
    run_name: Optional[str] = described(
        None, "the run's name in W&B and MLflow; null: WANDB_NAME, else the output folder's name")
    notes: Optional[str] = described(None, "W&B notes, MLflow description; null: WANDB_NOTES")
    tags: Optional[List[str]] = described(None, 'W&B tags, MLflow tags (each with the value "true"); null: WANDB_TAGS')


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
