"""open_clip_train's command-line flags (3.3) and what each is in mmcl: the one table that ``mmcl train`` (which
answers such flags with their mmcl keys), ``mmcl from-open-clip`` (which writes them as a config file) and
docs/migration.md read.

Each flag's `Flag.to` is what mmcl takes instead: overrides such as ``data.batch_size={}`` (``{}`` is the flag's
value, ``{,}``/``{::}`` the value split at ',' or '::' as a list, ``{k}={v}`` one per KEY=VALUE item), an
``mmcl ...`` command, '' when nothing needs setting, None when there is no automatic mapping (the note gives the
reason and the way around); or a dict from the flag's value to one of those ('*' for any other value).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from ..errors import ConfigError


@dataclass(frozen=True)
class Flag:
    to: Union[None, str, Dict[str, Optional[str]]]
    note: str = ""
    nargs: Union[int, str] = 1  # 0: a switch; 1: one value; '+' / '*': several values


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
              "weights are not supported (closest: train.precision=bf16)")

FLAGS: Dict[str, Flag] = {
    "--train-data": Flag("data.train={}", "'::'-separated sources as open_clip's; a CSV/TSV table: " + _TABLES),
    "--train-data-upsampling-factors": Flag("data.weights={::}", "with data.resampled=true, as open_clip's"),
    "--val-data": Flag("eval.val_loss={}", "held-out shards scored with the run's loss terms"),
    "--train-num-samples": Flag("data.train_num_samples={}", "an epoch's size for train.epochs; null: the "
                                "shards' counts (sizes.json, _stats.json)"),
    "--val-num-samples": Flag("", "nothing to set: eval.val_loss's shards are read to their end"),
    "--dataset-type": Flag({"webdataset": "", "auto": "", "csv": None, "synthetic": None},
                           "webdataset: nothing to set; csv: " + _TABLES + "; synthetic: mmcl demo-data --out DIR"),
    "--dataset-resampled": Flag("data.resampled=true", nargs=0),
    "--csv-separator": Flag("mmcl shards --sep {}", _TABLES),
    "--csv-img-key": Flag("mmcl shards --image-col {}", _TABLES),
    "--csv-caption-key": Flag("mmcl shards --caption-col {}", _TABLES),
    "--imagenet-val": Flag("eval.zeroshot={}", "an ImageFolder; evaluated every eval.every steps (0: at the end)"),
    "--imagenet-v2": Flag(None, "list it as a second set: eval.zeroshot=[{name: imagenet, data: VAL}, {name: "
                                "imagenet-v2, data: V2, classnames: FILE}] (its class folders are numbers)"),
    "--cache-dir": Flag(None, "weights go to the Hugging Face cache: set HF_HOME in the environment"),
    "--logs": Flag("train.output_dir={}", "the run folder itself: --logs L --name N is train.output_dir=L/N"),
    "--log-local": Flag(None, "not supported: the main process writes the run's logs", nargs=0),
    "--name": Flag("train.output_dir={logs}/{}", "the run folder (trackers name the run after it)"),
    "--workers": Flag("data.workers={}", "per process"),
    "--batch-size": Flag("data.batch_size={}", "per process (and per micro-batch with train.accum_steps)"),
    "--epochs": Flag("train.epochs={}", "passes over data.train"),
    "--epochs-cooldown": Flag(None, "optim.cooldown_fraction=COOLDOWN_EPOCHS/EPOCHS (or optim.cooldown_steps); "
                                    + _STEPS),
    "--lr": Flag("optim.lr={}"),
    "--beta1": Flag("optim.beta1={}"),
    "--beta2": Flag("optim.beta2={}", "open_clip's default is 0.98 for ViT models, else 0.999; mmcl's 0.98"),
    "--eps": Flag("optim.eps={}", "open_clip's default is 1e-6 for ViT models, else 1e-8; mmcl's 1e-6"),
    "--wd": Flag("optim.weight_decay={}", "not on gains, biases and the logit scale, as open_clip's"),
    "--momentum": Flag(None, "not supported: for timm optimisers; mmcl trains with AdamW"),
    "--warmup": Flag("optim.warmup_steps={}"),
    "--opt": Flag({"adamw": ""}, "adamw: nothing to set; timm optimisers are not supported (mmcl trains with "
                                 "AdamW)"),
    "--use-bn-sync": Flag(None, "not supported: BatchNorm statistics stay per process (ViT towers have none)",
                          nargs=0),
    "--skip-scheduler": Flag("optim.schedule=constant optim.warmup_steps=0", "a constant rate, no warm-up",
                             nargs=0),
    "--lr-scheduler": Flag({"cosine": "optim.schedule=cosine", "const": "optim.schedule=constant",
                            "const-cooldown": "optim.schedule=const-cooldown"}),
    "--lr-cooldown-end": Flag("optim.min_lr={}", "mmcl's min_lr also ends cosine and linear, open_clip's only "
                                                 "const-cooldown"),
    "--lr-cooldown-power": Flag("optim.cooldown_power={}"),
    "--save-frequency": Flag(None, "train.save_every=STEPS (a checkpoint is also saved at the end); " + _STEPS),
    "--save-most-recent": Flag("", "nothing to set: the newest checkpoint is always kept (train.keep_checkpoints)",
                               nargs=0),
    "--zeroshot-frequency": Flag(None, "eval.every=STEPS; " + _STEPS),
    "--val-frequency": Flag(None, "eval.val_loss_every=STEPS; " + _STEPS),
    "--resume": Flag({"latest": "", "*": "model.init_from={}"},
                     "latest: nothing to set, mmcl resumes the run in train.output_dir itself (train.resume=auto); "
                     "an open_clip_train checkpoint: its weights only, as model.init_from (optimiser and schedule "
                     "start anew)"),
    "--precision": Flag({"amp": "train.precision=fp16", "amp_bf16": "train.precision=bf16",
                         "amp_bfloat16": "train.precision=bf16", "fp32": "train.precision=fp32", "bf16": None,
                         "fp16": None, "pure_bf16": None, "pure_fp16": None}, _PRECISION),
    "--model": Flag("model.name={}", "open_clip's architectures by name"),
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
                          nargs=0),
    "--torchcompile": Flag("train.compile=true", nargs=0),
    "--trace": Flag(None, "not supported (inference only): mmcl export --format onnx", nargs=0),
    "--accum-freq": Flag("train.accum_steps={}", "micro-batches forming one contrastive batch, as open_clip's"),
    "--device": Flag(None, "each process's device comes from accelerate (CUDA when present; accelerate launch "
                           "--cpu for the CPU)"),
    "--dist-url": Flag(None, _LAUNCH + " (--main_process_ip, --main_process_port)"),
    "--dist-backend": Flag(None, _LAUNCH + " (NCCL on GPUs, gloo on CPUs)"),
    "--report-to": Flag("train.log_with={,}", "metrics.jsonl is always written"),
    "--wandb-notes": Flag("track.notes={}"),
    "--wandb-project-name": Flag("track.project={}"),
    "--debug": Flag(None, "not supported: metrics.jsonl holds every logged step", nargs=0),
    "--copy-codebase": Flag(None, "not supported: the run folder's config.yaml records the run; pin mmcl's "
                                  "version", nargs=0),
    "--horovod": Flag(None, "not supported: " + _LAUNCH, nargs=0),
    "--ddp-static-graph": Flag("train.ddp.static_graph=true", nargs=0),
    "--no-set-device-rank": Flag(None, "nothing like it: accelerate gives each process its device", nargs=0),
    "--seed": Flag("train.seed={}"),
    "--grad-clip-norm": Flag("optim.grad_clip={}", "open_clip clips nothing by default, mmcl at 1.0"),
    "--lock-text": Flag("model.lock_text=true", nargs=0),
    "--lock-text-unlocked-layers": Flag("model.lock_text_unlocked_layers={}"),
    "--lock-text-freeze-layer-norm": Flag("model.lock_text_freeze_layer_norm=true", nargs=0),
    "--log-every-n-steps": Flag("train.log_every={}"),
    "--coca-caption-loss-weight": Flag(None, "not supported: CoCa's captioning loss (mmcl trains two towers)"),
    "--coca-contrastive-loss-weight": Flag(None, "not supported: CoCa (loss.clip weighs InfoNCE)"),
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
}

# open_clip_train's defaults that differ from mmcl's: `write_config` writes them for a flag not given.
DEFAULTS = {"--epochs": "32", "--warmup": "10000", "--workers": "4", "--model": "RN50",
            "--log-every-n-steps": "100", "--grad-clip-norm": "null"}


def _yaml_list(items: List[str]) -> str:
    return "[" + ", ".join(items) + "]"


def overrides_for(flag: str, value) -> Optional[List[str]]:
    """What `flag` given `value` (a string, a list for several values, True for a switch) is in mmcl: overrides,
    or one ``mmcl ...`` command; [] for nothing to set; None for no mapping (the flag's note says why)."""
    to = FLAGS[flag].to
    if isinstance(to, dict):
        to = to.get(value, to.get("*"))
    if to is None:
        return None
    if "{k}" in to:
        if not all("=" in v for v in value):
            raise ConfigError(f"open_clip_train's {flag} takes KEY=VALUE items (got {' '.join(value)})")
        return [to.format(k=k, v=json.dumps(_literal(v))) for k, v in (v.split("=", 1) for v in value)]
    if isinstance(value, list):
        value = value[0] if len(value) == 1 else _yaml_list(value)
    value = str(value)
    parts = [to] if to.startswith("mmcl ") else to.split()
    return [t.replace("{,}", _yaml_list([v for v in value.split(",") if v]))
             .replace("{::}", _yaml_list(value.split("::"))).replace("{}", value) for t in parts]


def _literal(text: str):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # as open_clip's --aug-cfg: a string
    return list(value) if isinstance(value, tuple) else value


def parse(argv: List[str]) -> Tuple[List[Tuple[str, object]], List[str]]:
    """(open_clip flags given, each with its value) and the other arguments, from a command line. ``--flag=value``
    and ``--flag value`` are both read, as argparse reads them."""
    given, rest, i = [], [], 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        flag = FLAGS.get(name) if name.startswith("--") else None
        i += 1
        if flag is None:
            rest.append(argv[i - 1])
            continue
        if flag.nargs == 0:
            given.append((name, True))
            continue
        values = [inline] if eq else []
        while i < len(argv) and (flag.nargs != 1 or not values) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        if not values and flag.nargs != "*":
            raise ConfigError(f"open_clip_train's {name} needs a value")
        given.append((name, values if flag.nargs in ("+", "*") else values[0]))
    return given, rest


def _shown(flag: str, value) -> str:
    return flag if value is True else f"{flag} {' '.join(value) if isinstance(value, list) else value}"


def translate(given: List[Tuple[str, object]]) -> Tuple[List[str], List[str]]:
    """(mmcl overrides, one line per flag that maps to none: a command to run, or a note) for flags `parse` read."""
    names = dict(given)
    logs = str(names.get("--logs", "./logs")).rstrip("/")
    overrides, left = [], []
    for flag, value in given:
        to = overrides_for(flag, value)
        if flag == "--logs" and "--name" in names:
            continue  # --name's run folder holds it
        if to is None or to[:1] and to[0].startswith("mmcl "):
            left.append(f"{_shown(flag, value)}: {to[0] if to else FLAGS[flag].note}")
        else:
            overrides += [t.replace("{logs}", logs) for t in to]
    return overrides, left


def explain(argv: List[str]) -> Optional[str]:
    """One line naming the mmcl key each open_clip_train flag of `argv` maps to; None when `argv` has none."""
    given, _ = parse(argv)
    if not given:
        return None
    parts = []
    for flag, value in given:
        to = overrides_for(flag, value)
        hint = (f" (a table: make shards first with mmcl shards --input {value} --out DIR, then data.train=DIR)"
                if flag == "--train-data" and is_table(str(value)) else "")
        what = FLAGS[flag].note if to is None else " ".join(to).replace("{logs}", "LOGS") or "nothing to set"
        parts.append(f"{_shown(flag, value)} -> {what}{hint}")
    return ("open_clip_train flags: " + ", ".join(parts) + "; give mmcl keys as key=value, or write a config "
            "with mmcl from-open-clip --out config.yaml -- FLAGS")


def is_table(path: str) -> bool:
    """Whether `path` names a table that `mmcl shards` reads (CSV, TSV, JSONL, parquet), not shards."""
    from ..data.shard_inputs import _TABLE_EXTS

    return path.lower().endswith(_TABLE_EXTS)


def with_defaults(given: List[Tuple[str, object]]) -> List[Tuple[str, object]]:
    """`given` with open_clip_train's defaults (`DEFAULTS`, and its AdamW betas for a model without 'vit' in its
    name) for the flags not given, first, so that the run trains as open_clip_train's would."""
    names = dict(given)
    added = [(f, v) for f, v in DEFAULTS.items() if f not in names]
    model = str(names.get("--model", DEFAULTS["--model"])).lower()
    if "vit" not in model and "timm" not in str(names.get("--opt", "")):
        added += [(f, v) for f, v in (("--beta2", "0.999"), ("--eps", "1e-8")) if f not in names]
    return added + list(given)


def write_config(argv: List[str], out: str) -> Tuple[List[str], List[str], List[str]]:
    """Write the mmcl config file `out` (a new file) for an open_clip_train command line, checked as `load_config`
    checks a config first. Returns (overrides written, one line per flag that maps to no config key, open_clip_train's
    defaults written for flags not given)."""
    import yaml
    from omegaconf import OmegaConf

    from ..config import load_config, parse_overrides

    given, unknown = parse(argv)
    if unknown:
        raise ConfigError(f"not open_clip_train flags: {' '.join(unknown)} (open_clip_train 3.3's flags are listed "
                          f"in docs/migration.md)")
    full = with_defaults(given)
    overrides, left = translate(full)
    load_config(None, overrides)
    tree = OmegaConf.create({})
    for key, value in parse_overrides(overrides):
        OmegaConf.update(tree, key, value, force_add=True)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(yaml.safe_dump(OmegaConf.to_container(tree), sort_keys=False))
    except FileExistsError:
        raise ConfigError(f"{out} already exists: choose another --out (it is not overwritten)") from None
    except OSError as err:
        raise ConfigError(f"cannot write {out}: {err.strerror or err}") from None
    return overrides, left, [_shown(f, v) for f, v in full[:len(full) - len(given)]]
