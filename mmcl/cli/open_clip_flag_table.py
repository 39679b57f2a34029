"""open_clip_train's command-line flags and what each is in mmcl: the data that mmcl/cli/open_clip_flags.py reads
(`mmcl train`'s hint, `mmcl from-open-clip`) and docs/migration.md shows.

The table covers the flags of open_clip_train 3.3 and of open_clip's main branch (4.2.0.dev0, June 2026). A flag's
`Flag.version` says where it comes from when that is not both: ``main`` (added after 3.3) or ``3.3`` (removed on
main).

Each flag's `Flag.to` is what mmcl takes instead: overrides such as ``data.batch_size={}``, where

- ``{}`` is the flag's value (several: a list), ``{[]}`` its values as a list; ``{,}``, ``{::}`` and ``{;}`` the
  value split at ',', '::' or ';' as a list; ``{;json:}`` the ';' items each prefixed with ``json:``; ``{k}={v}``
  one override per KEY=VALUE item;
  ``{re}`` the flag's glob patterns as one regular expression matching a whole name; ``{*}`` what a dict key's
  ``*`` matched (``timm/*``);

or a command (``mmcl ...``, ``accelerate launch ...``), '' when nothing needs setting, None when there is no automatic
mapping (the note gives the reason and the way around); or a dict from the flag's value to one of those, its keys
values or glob patterns (``*`` any other value), tried exact first, then in order. `Flag.unless` names a flag that,
when also given, makes this one's mapping moot (it sets the same keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Union


@dataclass(frozen=True)
class Flag:
    to: Union[None, str, Dict[str, Optional[str]]]
    note: str = ""
    nargs: Union[int, str] = 1  # 0: a switch; 1: one value; '+' / '*': several values
    version: str = ""  # '': open_clip_train 3.3 and main; 'main': added after 3.3; '3.3': removed on main
    unless: str = ""  # a flag that, given too, sets the same keys: this one then sets nothing


MAIN = "main"
VERSIONS = {"": "3.3 and main", MAIN: "main (4.2.0.dev0)", "3.3": "3.3 (removed on main)"}

_STEPS = "mmcl counts in optimiser steps, not epochs: an epoch is samples per epoch / global batch steps"
_TABLES = ("mmcl reads WebDataset shards: make them from the table first with mmcl shards --input TABLE --out DIR "
           "(--sep, --image-col, --caption-col as open_clip's --csv-*)")
_LAUNCH = "processes are started by accelerate launch (or mmcl launch) with its launch file or options"
_PREPROCESS = ("give model.name a .json model config in open_clip's format with a preprocess_cfg (mean, std, "
               "interpolation, resize_mode)")
_EXACT = ("nothing to set: mmcl's losses are always exact across processes (each process scores its rows against "
          "every process's features, gradients flowing through the gather)")
_TEACHER = ("distill.teacher=DIR with loss.distill=1.0: the teacher is a local model (an open_clip_train run, an "
            "mmcl run or export, a Hugging Face CLIP directory); an architecture and tag are not downloaded for it")
_SYNC = "not supported: copy train.output_dir with your own tool (e.g. aws s3 sync in the job script)"
_PRECISION = ("mmcl trains in mixed precision over float32 weights: amp is fp16, amp_bf16 bf16; pure bf16/fp16 "
              "weights are not supported (closest: train.precision=bf16); open_clip main's default is amp_bf16, "
              "3.3's amp")
_AUDIO = "not supported: mmcl trains image-text models; train audio (CLAP) models with open_clip_train"
_TIMM_KWARGS = ("with --opt timm/NAME or nadamw it goes to optim.kwargs (betas, eps), as open_clip_train passes it to "
                "that optimiser; mmcl's optim.beta1/beta2/eps are AdamW's alone")
_CAPTIONS = ("mmcl draws one per sample and epoch among the sources the sample has (weights: "
             "data.caption_key_weights), where open_clip takes the first present")
_NAFLEX_TOWER = ("the image tower must be a timm NaFlexVit: model.vision_cfg.timm_model_name=naflexvit_..., e.g. "
                 "naflexvit_base_patch16_siglip")
_BUCKETING = ("not supported: mmcl keeps the shuffled order and already runs each batch's text at its longest "
              "caption (rounded up to 8 tokens)")
_FSDP_FILE = "FSDP2 from launch/fsdp.yaml; or set it in your launch file's fsdp_config"
_COMPILE = "mmcl compiles with torch.compile's defaults (inductor, mode default): set neither"

# open_clip main's default NaFlex sequence lengths (naflex_data.NaFlexBatchScheduler), which --use-naflex turns on.
NAFLEX_SEQ_LENS = (128, 256, 576, 784, 1024)

FLAGS: Dict[str, Flag] = {
    "--train-data": Flag("data.train={}", "'::'-separated sources as open_clip's; a CSV/TSV table: " + _TABLES),
    "--train-data-upsampling-factors": Flag("data.weights={::}", "with data.resampled=true, as open_clip's"),
    "--val-data": Flag("eval.val_loss={} eval.retrieval={}", "held-out shards scored with the run's loss terms and for "
                       "retrieval (recall@1/5/10 both ways), as open_clip reports the loss and retrieval metrics"),
    "--train-num-samples": Flag("data.train_num_samples={}", "an epoch's size for train.epochs; null: the "
                                "shards' counts (sizes.json, _stats.json)"),
    "--val-num-samples": Flag("", "nothing to set: eval.val_loss's shards are read to their end"),
    "--dataset-type": Flag({"webdataset": "", "auto": "", "csv": None, "synthetic": None, "webdataset-audio": None,
                            "synthetic-audio": None},
                           "webdataset: nothing to set; csv: " + _TABLES + "; synthetic: mmcl demo-data --out DIR; "
                           "webdataset-audio, synthetic-audio (main): " + _AUDIO),
    "--audio-ext": Flag(None, _AUDIO, version=MAIN),
    "--pretrained-audio": Flag(None, _AUDIO, version=MAIN),
    "--audio-fill": Flag(None, _AUDIO, version=MAIN),
    "--audio-trunc": Flag(None, _AUDIO, version=MAIN),
    "--audio-fusion": Flag(None, _AUDIO, nargs=0, version=MAIN),
    "--audio-int16-normalize": Flag(None, _AUDIO, nargs=0, version=MAIN),
    "--audio-zeroshot-dataset": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-split": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-audio-key": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-target-key": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-class-key": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-template": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-workers": Flag(None, _AUDIO, version=MAIN),
    "--audio-zeroshot-multiprocessing-context": Flag(None, _AUDIO, version=MAIN),
    "--audio-multiprocessing-context": Flag(None, _AUDIO, version=MAIN),
    "--dataset-resampled": Flag("data.resampled=true", nargs=0),
    "--csv-separator": Flag("mmcl shards --sep {}", _TABLES),
    "--csv-img-key": Flag("mmcl shards --image-col {}", _TABLES),
    "--csv-caption-key": Flag("mmcl shards --caption-col {}", _TABLES),
    "--image-key": Flag({"jpg;png;jpeg;webp": "", "*;*": None, "*": "data.image_key={}"},
                        "one image member; open_clip's default alternatives (jpg;png;jpeg;webp) are mmcl's default "
                        "(data.image_key=null); other ';'-alternatives are not supported: give the one member your "
                        "shards hold", version=MAIN),
    "--max-image-pixels": Flag({"0": None, "*": "data.max_image_pixels={}"},
                               "images over it are skipped and counted, checked from the header as open_clip's; "
                               "0 (no limit) is not supported: give a large number; open_clip main's default is "
                               "25,000,000, mmcl's 89,478,485 (pillow's)", version=MAIN),
    "--text-key": Flag({"txt": "", "*": "data.caption_key={;}"}, "several (';'-separated): " + _CAPTIONS, version=MAIN,
                       unless="--json-text-key"),
    "--json-text-key": Flag("data.caption_key={;json:}", "fields of the sample's .json member; several: " + _CAPTIONS +
                            " (the same draw as open_clip's with --json-text-key-probs)", version=MAIN),
    "--json-text-key-probs": Flag("data.caption_key_weights={[]}",
                                  "one per --json-text-key key, missing trailing ones 0; a 0 key is never drawn in "
                                  "mmcl (open_clip's falls back to it when no other is present)", nargs="+",
                                  version=MAIN),
    "--imagenet-val": Flag("eval.zeroshot={}", "an ImageFolder; evaluated every eval.every steps (0: at the end)"),
    "--imagenet-v2": Flag(None, "list it as a second set: eval.zeroshot=[{name: imagenet, data: VAL}, {name: "
                                "imagenet-v2, data: V2, classnames: FILE}] (its class folders are numbers)"),
    "--cache-dir": Flag(None, "weights go to the Hugging Face cache: set HF_HOME in the environment"),
    "--logs": Flag("train.output_dir={}", "the run folder itself: --logs L --name N is train.output_dir=L/N"),
    "--log-local": Flag(None, "not supported: the main process writes the run's logs", nargs=0),
    "--name": Flag("train.output_dir={logs}/{}", "the run folder (trackers name the run after it)"),
    "--workers": Flag("data.workers={}", "per process"),
    "--batch-size": Flag("data.batch_size={}", "per process (and per micro-batch with train.accum_steps); with "
                                               "NaFlex the token budget sets it, as on open_clip main"),
    "--epochs": Flag("train.epochs={}", "passes over data.train; with NaFlex (pairs per batch vary) give "
                                        "train.steps instead"),
    "--epochs-cooldown": Flag("optim.cooldown_fraction={}",
                              "the value divided by --epochs (32 when not given): the cooldown's share of the run"),
    "--lr": Flag("optim.lr={}"),
    "--beta1": Flag("optim.beta1={}", _TIMM_KWARGS),
    "--beta2": Flag("optim.beta2={}", "open_clip's default is 0.98 for ViT models, else 0.999; mmcl's 0.98; "
                                      + _TIMM_KWARGS),
    "--eps": Flag("optim.eps={}", "open_clip's default is 1e-6 for ViT models, else 1e-8; mmcl's 1e-6; "
                                  + _TIMM_KWARGS),
    "--wd": Flag("optim.weight_decay={}", "not on gains, biases and the logit scale, as open_clip's; open_clip main "
                                          "also spares the positional embeddings: add "
                                          "optim.no_decay_pattern=positional_embedding for that"),
    "--momentum": Flag("optim.kwargs.momentum={}", "with --opt timm/NAME only: open_clip_train ignores it with adamw "
                                                   "and nadamw, and so nothing is set then"),
    "--warmup": Flag("optim.warmup_steps={}"),
    "--opt": Flag({"adamw": "", "nadamw": "optim.name=nadam optim.kwargs.decoupled_weight_decay=true",
                   "timm/*": "optim.name={*}"},
                  "adamw: nothing to set (mmcl's default); nadamw (main): torch's NAdam with decoupled weight decay, "
                  "as open_clip main's; timm/NAME: timm's optimiser NAME, over mmcl's parameter groups"),
    "--opt-kwargs": Flag("optim.kwargs.{k}={v}", "the optimiser's constructor arguments, key for key", nargs="*",
                         version=MAIN),
    "--opt-fallback-list": Flag(None, "not supported: mmcl's Muon family leaves every tower's embeddings, projection "
                                      "heads and 1-d parameters to the AdamW fallback by its own rule",
                                nargs="*", version=MAIN),
    "--text-layer-decay": Flag("optim.text_layer_decay={}", "the head at the full rate, each layer below times the "
                                                            "decay, as open_clip's", version=MAIN),
    "--image-layer-decay": Flag("optim.image_layer_decay={}", "the head at the full rate, each layer below times the "
                                                              "decay, as open_clip's", version=MAIN),
    "--visual-layer-decay": Flag("optim.image_layer_decay={}", "open_clip's other name of --image-layer-decay",
                                 version=MAIN),
    "--audio-layer-decay": Flag(None, _AUDIO, version=MAIN),
    "--wd-exclude": Flag("optim.no_decay_pattern={re}", "whole parameter names, as open_clip's fnmatch (mmcl's "
                                                        "names are open_clip's: the run's param_groups.json lists "
                                                        "them)", nargs="*", version=MAIN),
    "--text-pooler-own-group": Flag(None, "not supported: mmcl's text head (final norm, pooler, projection) is one "
                                          "layer group at the full rate, open_clip's default", nargs=0, version=MAIN),
    "--use-bn-sync": Flag(None, "not supported: BatchNorm statistics stay per process (ViT towers have none)",
                          nargs=0),
    "--skip-scheduler": Flag("optim.schedule=constant optim.warmup_steps=0", "a constant rate, no warm-up",
                             nargs=0),
    "--lr-scheduler": Flag({"cosine": "optim.schedule=cosine", "const": "optim.schedule=constant",
                            "const-cooldown": "optim.schedule=const-cooldown"}),
    "--lr-cooldown-end": Flag("optim.min_lr={}", "with --lr-scheduler const-cooldown only: open_clip's cosine "
                                                 "and const schedules ignore it, and nothing is set then"),
    "--lr-cooldown-power": Flag("optim.cooldown_power={}"),
    "--save-frequency": Flag(None, "train.save_every=STEPS (a checkpoint is also saved at the end); " + _STEPS),
    "--save-most-recent": Flag("", "nothing to set: the newest checkpoint is always kept (train.keep_checkpoints)",
                               nargs=0),
    "--zeroshot-frequency": Flag(None, "eval.every=STEPS; " + _STEPS),
    "--val-frequency": Flag(None, "eval.val_loss_every=STEPS; " + _STEPS),
    "--val-retrieval-chunk-size": Flag("", "nothing to set: mmcl scores retrieval exactly, in blocks of 4096 rows",
                                       version=MAIN),
    "--val-retrieval-precision": Flag({"fp32": "", "model": None}, "fp32: nothing to set, mmcl scores retrieval in "
                                                                   "float32; model: not supported", version=MAIN),
    "--resume": Flag({"latest": "", "*": "model.init_from={}"},
                     "latest: nothing to set, mmcl resumes the run in train.output_dir itself (train.resume=auto); "
                     "an open_clip_train checkpoint: its weights only, as model.init_from (optimiser and schedule "
                     "start anew)"),
    "--precision": Flag({"amp": "train.precision=fp16", "amp_bf16": "train.precision=bf16",
                         "amp_bfloat16": "train.precision=bf16", "fp32": "train.precision=fp32", "bf16": None,
                         "fp16": None, "pure_bf16": None, "pure_fp16": None}, _PRECISION),
    "--model": Flag("model.name={}", "open_clip's architectures by name (coca_*: with loss.caption=2.0, open_clip's "
                                     "default caption weight)"),
    "--pretrained": Flag("model.pretrained={}", "an open_clip tag, hf-hub:ORG/NAME or a local file"),
    "--pretrained-image": Flag("model.vision_cfg.timm_model_pretrained=true", "a timm image tower's weights",
                               nargs=0),
    "--lock-image": Flag("model.lock_image=true", nargs=0),
    "--lock-image-unlocked-groups": Flag("model.lock_image_unlocked_groups={}"),
    "--lock-image-freeze-bn-stats": Flag("model.lock_image_freeze_bn_stats=true", nargs=0),
    "--image-mean": Flag(None, _PREPROCESS, nargs="+"),
    "--image-std": Flag(None, _PREPROCESS, nargs="+"),
    "--image-interpolation": Flag(None, _PREPROCESS),
    "--image-resize-mode": Flag(None, _PREPROCESS),
    "--aug-cfg": Flag("data.aug.{k}={v}", "open_clip's AugmentationCfg, key for key", nargs="*"),
    "--grad-checkpointing": Flag("model.grad_checkpointing=true", nargs=0),
    "--local-loss": Flag("", _EXACT, nargs=0),
    "--gather-with-grad": Flag("", _EXACT, nargs=0),
    "--force-context-length": Flag("model.context_length={}"),
    "--force-image-size": Flag("model.image_size={}", "one (square) size", nargs="+"),
    "--force-quick-gelu": Flag(None, "name a -quickgelu architecture (model.name=ViT-B-32-quickgelu) or a .json "
                                     "model config with quick_gelu: true", nargs=0),
    "--force-patch-dropout": Flag("model.patch_dropout={}", "unmasked steps at the end: train.unmasked_steps"),
    "--force-custom-text": Flag(None, "not supported: mmcl builds the class its towers need (a Hugging Face text "
                                      "tower: model.text.hf)", nargs=0),
    "--torchscript": Flag(None, "not supported: train eager or with train.compile=true; deploy with mmcl export",
                          nargs=0, version="3.3"),
    "--torchcompile": Flag("train.compile=true", nargs=0),
    "--torchcompile-strategy": Flag({"task": "", "model": None, "step": None},
                                    "task: nothing to set, mmcl compiles the prepared model and the loss; model, "
                                    "step: not supported", version=MAIN),
    "--torchcompile-backend": Flag(None, _COMPILE, version=MAIN),
    "--torchcompile-mode": Flag(None, _COMPILE, version=MAIN),
    "--trace": Flag(None, "not supported (inference only): mmcl export --format onnx", nargs=0, version="3.3"),
    "--accum-freq": Flag("train.accum_steps={}", "micro-batches forming one contrastive batch, as open_clip's"),
    "--device": Flag(None, "each process's device comes from accelerate (CUDA when present; accelerate launch "
                           "--cpu for the CPU)"),
    "--dist-url": Flag(None, _LAUNCH + " (--main_process_ip, --main_process_port)"),
    "--dist-backend": Flag(None, _LAUNCH + " (NCCL on GPUs, gloo on CPUs)"),
    "--report-to": Flag("train.log_with={,}", "metrics.jsonl is always written; trackio (main) is not one of "
                                              "mmcl's trackers (tensorboard, wandb, mlflow, aim)"),
    "--wandb-notes": Flag("track.notes={}"),
    "--wandb-project-name": Flag("track.project={}"),
    "--debug": Flag(None, "not supported: metrics.jsonl holds every logged step", nargs=0),
    "--copy-codebase": Flag(None, "not supported: the run folder's config.yaml records the run; pin mmcl's "
                                  "version", nargs=0),
    "--horovod": Flag(None, "not supported: " + _LAUNCH, nargs=0, version="3.3"),
    "--ddp-static-graph": Flag("train.ddp.static_graph=true", nargs=0),
    "--fsdp": Flag("accelerate launch --config_file launch/fsdp.yaml", "FSDP2, as open_clip main's", nargs=0,
                   version=MAIN),
    "--fsdp-no-reshard-after-forward": Flag("accelerate launch --fsdp_reshard_after_forward false", _FSDP_FILE,
                                            nargs=0, version=MAIN),
    "--fsdp-offload-cpu": Flag("accelerate launch --fsdp_offload_params true", _FSDP_FILE, nargs=0, version=MAIN),
    "--fsdp-checkpoint": Flag({"full": "accelerate launch --fsdp_state_dict_type FULL_STATE_DICT",
                               "sharded": "accelerate launch --fsdp_state_dict_type SHARDED_STATE_DICT"},
                              "the checkpoints' form (launch/fsdp.yaml: sharded); model/ always holds the full "
                              "model", version=MAIN),
    "--no-set-device-rank": Flag(None, "nothing like it: accelerate gives each process its device", nargs=0),
    "--seed": Flag("train.seed={}"),
    "--grad-clip-norm": Flag("optim.grad_clip={}", "open_clip clips nothing by default, mmcl at 1.0"),
    "--lock-text": Flag("model.lock_text=true", nargs=0),
    "--lock-text-unlocked-layers": Flag("model.lock_text_unlocked_layers={}"),
    "--lock-text-freeze-layer-norm": Flag("model.lock_text_freeze_layer_norm=true", nargs=0),
    "--log-every-n-steps": Flag("train.log_every={}", "on main the console's interval: mmcl logs the console, "
                                "metrics.jsonl and the trackers together", unless="--log-metric-every-n-steps"),
    "--log-metric-every-n-steps": Flag("train.log_every={}", "metrics.jsonl, the trackers and the console line",
                                       version=MAIN),
    "--train-loss-ema-samples": Flag(None, "not supported: metrics.jsonl holds each logged step's loss; smooth it "
                                           "when plotting", version=MAIN),
    "--coca-caption-loss-weight": Flag("loss.caption={}", "CoCa's captioning term (a --model coca_*); open_clip's "
                                                          "default 2.0 is set from --model coca_* when not given"),
    "--coca-contrastive-loss-weight": Flag("loss.clip={}", "CoCa's contrastive term: InfoNCE's weight"),
    "--remote-sync": Flag(None, _SYNC),
    "--remote-sync-frequency": Flag(None, _SYNC),
    "--remote-sync-protocol": Flag(None, _SYNC),
    "--delete-previous-checkpoint": Flag("train.keep_checkpoints=1", nargs=0),
    "--distill-model": Flag(None, _TEACHER),
    "--distill-pretrained": Flag(None, _TEACHER),
    "--use-bnb-linear": Flag(None, "not supported: bitsandbytes int8 linear layers"),
    "--siglip": Flag("loss.siglip=1.0 loss.clip=0.0 model.init_logit_scale=2.302585092994046 "
                     "model.init_logit_bias=-10.0", "as open_clip: logit scale log(10), bias -10", nargs=0),
    "--loss-dist-impl": Flag("", _EXACT),
    "--use-naflex": Flag("data.naflex.seq_lens=[" + ",".join(map(str, NAFLEX_SEQ_LENS)) + "]",
                         "open_clip main's default lengths; " + _NAFLEX_TOWER, nargs=0, version=MAIN,
                         unless="--naflex-seq-lens"),
    "--force-naflex-vision": Flag(None, "not supported: mmcl does not convert a ViT; " + _NAFLEX_TOWER, nargs=0,
                                  version=MAIN),
    "--naflex-num-train-image-tokens": Flag(None, "train.steps=TOKENS / (data.naflex.max_tokens_per_batch x "
                                                  "processes): mmcl's NaFlex runs are counted in steps",
                                            version=MAIN),
    "--naflex-patch-sizes": Flag("data.naflex.patch_size={}", "one size, the tower's; several drawn per batch are "
                                                              "not supported", nargs="+", version=MAIN),
    "--naflex-patch-size-probs": Flag(None, "not supported: mmcl patchifies at the tower's one patch size",
                                      nargs="+", version=MAIN),
    "--naflex-seq-lens": Flag("data.naflex.seq_lens={[]}", "one drawn per batch; evaluation at the largest "
                                                         "(eval.naflex_seq_len), as open_clip's", nargs="+",
                              version=MAIN),
    "--naflex-seq-len-probs": Flag("data.naflex.seq_len_probs={[]}", "per batch, one per length", nargs="+",
                                   version=MAIN),
    "--naflex-max-tokens-per-batch": Flag("data.naflex.max_tokens_per_batch={}", "per process; open_clip main's "
                                          "default is 16384, mmcl's 8192", version=MAIN),
    "--naflex-max-text-tokens": Flag(None, "not supported: for GenLIP, a generative model mmcl does not train",
                                     version=MAIN),
    "--naflex-batch-divisor": Flag(None, "not supported: an mmcl batch holds max_tokens_per_batch // L pairs and the "
                                         "loss pads to a fixed capacity; pick max_tokens_per_batch for the sizes",
                                   version=MAIN),
    "--naflex-loss-scale": Flag({"none": "", "linear": None, "sqrt": None},
                                "none: nothing to set; linear, sqrt: not supported, mmcl's loss is the mean over "
                                "the batch's real pairs", version=MAIN),
    "--length-bucketing": Flag(None, _BUCKETING, nargs=0, version=MAIN),
    "--bucket-pool": Flag(None, _BUCKETING, version=MAIN),
    "--bucket-chunk": Flag(None, _BUCKETING, version=MAIN),
    "--bucket-prefetch-pools": Flag(None, _BUCKETING, version=MAIN),
    "--naflex-pad-multiple": Flag(None, _AUDIO, version=MAIN),
    "--text-pad-multiple": Flag("", "nothing to set: mmcl runs each batch's text at its longest caption rounded up "
                                    "to a multiple of 8 tokens (exact)", version=MAIN),
}

# open_clip_train's defaults that differ from mmcl's: `write_config` writes them for a flag not given.
DEFAULTS = {"--epochs": "32", "--warmup": "10000", "--workers": "4", "--model": "RN50",
            "--log-every-n-steps": "100", "--grad-clip-norm": "null"}
# ... and with --use-naflex (open_clip main): its token budget.
NAFLEX_DEFAULTS = {"--naflex-max-tokens-per-batch": "16384"}

# open_clip main's features that mmcl does not have, and why (docs/migration.md lists them).
NOT_SUPPORTED_FROM_MAIN = (
    ("Audio towers and data (CLAP, NaFlex spectrogram towers, --audio-*, --dataset-type webdataset-audio)",
     "mmcl trains image-text models; train audio models with open_clip_train"),
    ("GenLIP / GenLAP (generative models; --naflex-max-text-tokens)", "mmcl trains two-tower contrastive models"),
    ("Converting a ViT or EVA tower to NaFlex (--force-naflex-vision)",
     "mmcl's NaFlex runs need a timm NaFlexVit tower (model.vision_cfg.timm_model_name=naflexvit_...)"),
    ("Several patch sizes per run (--naflex-patch-sizes with more than one, --naflex-patch-size-probs)",
     "mmcl patchifies at the tower's one patch size"),
    ("NaFlex batch-size rounding and loss scaling (--naflex-batch-divisor, --naflex-loss-scale linear|sqrt)",
     "an mmcl NaFlex batch holds max_tokens_per_batch // L pairs and its loss is the mean over them"),
    ("Length bucketing (--length-bucketing, --bucket-*)",
     "mmcl runs each batch's text at its longest caption already, without reordering samples"),
    ("A parameter list for Muon's AdamW fallback (--opt-fallback-list)",
     "mmcl chooses the fallback itself: embeddings, projection heads and 1-d parameters"),
    ("A separate text-pooler layer group (--text-pooler-own-group)",
     "mmcl's text head is one group: final norm, pooler and projection"),
    ("torch.compile backend, mode and strategy (--torchcompile-backend, -mode, -strategy model|step)",
     "train.compile=true compiles the model and the loss with torch's defaults"),
    ("A console loss EMA (--train-loss-ema-samples) and trackio logging (--report-to trackio)",
     "metrics.jsonl holds every logged step; trackers are tensorboard, wandb, mlflow and aim"),
)
