"""Export a trained model's image and text encoders into files other tools load.

Formats (``export(model_path, fmt, out_dir)``):

``open_clip``    open_clip's local-dir layout (``open_clip_config.json`` + ``open_clip_model.safetensors``, and the
                 tokenizer files of a Hugging Face text tower); ``open_clip.create_model_and_transforms(
                 "local-dir:DIR")``, ``open_clip.get_tokenizer("local-dir:DIR")``, CLIP_benchmark and `mmcl.load`
                 read it. The export is checked by loading it back with open_clip's own loader.
``safetensors``  the weights and the model config only, the config also embedded in the safetensors header
                 (``mmcl_model_cfg``, ``mmcl_preprocess_cfg``) so the weights file alone describes the model;
                 `mmcl.load` reads the directory without any training code. The one format of a NaFlex image tower.
``hf``           a transformers ``CLIPModel`` directory with its ``CLIPProcessor`` files as transformers 4.x and 5.x
                 read them (``preprocessor_config.json``; open_clip's tokenizer as ``tokenizer.json``, giving
                 open_clip's token ids, see `write_hf_tokenizer`). Only open_clip's ViT + text transformer towers map
                 onto ``CLIPModel``; any other architecture is a `ConfigError` naming the first unsupported feature.
``onnx``         ``image_encoder.onnx`` (``image`` (B,3,H,W) float32 -> ``image_embeds`` (B,D)) and
                 ``text_encoder.onnx`` (``text`` (B,L) int64 token ids -> ``text_embeds`` (B,D)), both with a
                 dynamic batch axis and L2-normalised outputs, plus ``onnx_config.json``, ``preprocess.json`` (the
                 image preprocessing as data, `preprocess_spec`) and ``tokenizer.json``: open_clip's tokenizer for
                 Hugging Face's ``tokenizers`` (`mmcl.storage.clip_tokenizer_file`), or a Hugging Face text tower's own;
                 docs/export.md runs both encoders with onnxruntime and ``tokenizers`` alone, without torch.

Every export is written to a temporary directory beside ``out_dir``, moved into place, and checked there against the
source model (`verify`); a failed export is removed and an earlier export in ``out_dir`` is put back.
``mmcl_export.json`` lists the files the export wrote: exporting again into the same directory replaces only those
and keeps every file the user added (results, notes); a file of the user's with the name of one the new export
writes is refused, named, and left as it is. The directory gets the mode the user's umask gives (an existing one
keeps its mode).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import open_clip
import torch
from open_clip.model import CLIPTextCfg, CLIPVisionCfg
from open_clip.tokenizer import SimpleTokenizer
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel
from transformers.image_utils import PILImageResampling

from .. import models
from ..errors import CheckpointError, ConfigError
from ..models import lora
from . import checkpoints, hf_clip, weights
from .clip_tokenizer_file import EOT_TOKEN, SOT_TOKEN, open_clip_hf_tokenizer_json, write_tokenizer_json
from .fsutil import atomic_dir, atomic_write_text, files_under, os_error_text, output_dir

FORMATS = ("open_clip", "hf", "onnx", "safetensors")
MARKER_FILE = "mmcl_export.json"
ONNX_IMAGE_FILE = "image_encoder.onnx"
ONNX_TEXT_FILE = "text_encoder.onnx"
ONNX_CONFIG_FILE = "onnx_config.json"
ONNX_TOKENIZER_FILE = "tokenizer.json"  # open_clip's tokenizer for `tokenizers` (`mmcl.storage.clip_tokenizer_file`)
ONNX_PREPROCESS_FILE = "preprocess.json"  # the image preprocessing as data (`preprocess_spec`)
ONNX_OPSET = 17  # first opset with a LayerNormalization op; onnxruntime >= 1.14 runs it

# Minimum cosine between an export's normalised embeddings and the source model's on the same inputs. Float32
# re-implementations of the same math (transformers, open_clip) differ by accumulation order only (~1e-6);
# ONNX Runtime fuses attention/LayerNorm kernels, which moves results by ~1e-4 at most.
MIN_COSINE = {"open_clip": 0.9999, "safetensors": 0.9999, "hf": 0.9999, "onnx": 0.999}


def export(model_path, fmt: str, out_dir, verify: bool = True) -> Path:
    """Export the model at `model_path` (a run dir, its ``model/``, or an export) as `fmt` into `out_dir`.

    Args:
        model_path: anything `mmcl.load` accepts.
        fmt: one of ``open_clip``, ``hf``, ``onnx``, ``safetensors``.
        out_dir: target directory; it must not exist, be empty, or hold an earlier mmcl export (replaced).
        verify: load the export back with its own runtime and require its normalised embeddings to match the
            source model's (cosine >= `MIN_COSINE`[fmt]) on a random image batch and a few captions.
    Returns the export directory.
    Raises:
        ConfigError for an unknown format, an architecture the format cannot express, or an unsafe `out_dir`;
        CheckpointError when the model cannot be read or the written export does not reproduce it.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format '{fmt}' (expected one of {', '.join(FORMATS)})")
    model, model_cfg, pp_cfg = weights.load_model_dir(model_path)
    src_dir = weights.find_model_dir(model_path)
    out_dir = output_dir(out_dir)
    previous = _check_out_dir(out_dir)
    models.naflex.check_export_format(model_cfg, fmt)  # before any file is written
    if fmt == "hf":
        check_hf_supported(model_cfg, pp_cfg)
    writer = {"open_clip": _write_open_clip, "safetensors": _write_safetensors, "hf": _write_hf,
              "onnx": _write_onnx}[fmt]
    marker = {"format": fmt, "source": str(src_dir.resolve()), "min_cosine_vs_source": None}

    def check(final_dir: Path) -> None:  # verified in its final place: an export may name its own directory
        if verify:
            marker["min_cosine_vs_source"] = verify_export(model, model_cfg, final_dir, fmt)
            atomic_write_text(final_dir / MARKER_FILE, json.dumps(marker, indent=2) + "\n")

    try:
        final = out_dir.resolve()
        with atomic_dir(out_dir, previous, check=check) as tmp:
            writer(model, model_cfg, pp_cfg, src_dir, tmp, final)
            # The list of mmcl's files is in place before the swap, so even an export killed right after it knows
            # which files a later export may replace.
            marker["files"] = sorted(files_under(tmp) | {MARKER_FILE})
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"cannot write the export to {out_dir}: {os_error_text(err)}") from None
    return out_dir


def export_adapters(model_path, out_dir) -> Path:
    """The LoRA adapters of a run trained with ``model.lora`` (its newest intact checkpoint's, or the checkpoint
    `model_path`'s) written into `out_dir` in peft's format (`mmcl.models.lora.save_adapters`) as `export` writes."""

    path = Path(model_path)
    run = path.parent if path.name == "model" and path.parent.is_dir() else path
    ckpt = path if checkpoints.is_checkpoint(path) else checkpoints.newest_run_weights(run)
    if ckpt is None:
        raise ConfigError(f"--adapters-only reads a LoRA run's checkpoints: {path} is not a run folder with an "
                          f"intact checkpoint, nor a checkpoint (a run's model/ holds the merged weights only)")
    state, meta = checkpoints.model_of_checkpoint(ckpt, merge_lora=False)
    if not (isinstance(meta, dict) and meta.get("lora")):
        raise ConfigError(f"--adapters-only: {ckpt} was not trained with LoRA (its {checkpoints.MODEL_CONFIG} "
                          f"records no lora settings; set model.lora.r to train adapters)")
    arch = meta["model_cfg"]  # a Hugging Face text tower's weights come from the checkpoint
    model = models.create(dict(arch, text_cfg=dict(arch["text_cfg"], hf_model_pretrained=False)))
    lora.apply_lora(model, meta["lora"])
    model.load_state_dict(state)
    out_dir = output_dir(out_dir)
    previous = _check_out_dir(out_dir)
    marker = {"format": "peft-lora", "source": str(ckpt.resolve()), "lora": meta["lora"]}
    try:
        with atomic_dir(out_dir, previous) as tmp:
            marker["files"] = sorted(set(lora.save_adapters(model, tmp)) | {MARKER_FILE})
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    except (OSError, SafetensorError) as err:
        raise ConfigError(f"cannot write the export to {out_dir}: {os_error_text(err)}") from None
    return out_dir


# Names the exporters write, for telling mmcl's files from the user's in an export made before mmcl listed its
# files in the marker: the model directory's files, transformers' (config, weights, processor, tokenizer), ONNX.
_EXPORT_FILE_PREFIXES = ("model.safetensors", "model-0", "pytorch_model", "preprocessor_config", "processor_config",
                         "generation_config", "chat_template", "special_tokens_map", "vocab.json", "merges.txt")


def _is_export_file_name(name: str) -> bool:
    return (weights.is_model_file_name(name) or name.startswith(_EXPORT_FILE_PREFIXES)
            or name in (MARKER_FILE, ONNX_IMAGE_FILE, ONNX_TEXT_FILE, ONNX_CONFIG_FILE, ONNX_PREPROCESS_FILE))


def _check_out_dir(out_dir: Path) -> List[str]:
    """The files an earlier mmcl export wrote in `out_dir` (replaced by the new export; every other file is the
    user's and is kept). `ConfigError` for a file, or a non-empty directory that holds no mmcl export."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"export target {out_dir} is a file (expected a new or empty directory)")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return []
    if not (out_dir / MARKER_FILE).is_file():
        names = sorted(files_under(out_dir))
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise ConfigError(f"export target {out_dir} is not empty and holds no earlier mmcl export (got {shown}; "
                          f"expected a new or empty directory; choose another --out)")
    return weights.previous_files(out_dir, MARKER_FILE, _is_export_file_name)


# ------------------------------------------------------------------------------------------------------------
# open_clip and safetensors


def _portable_model_cfg(model_cfg: Dict[str, Any], final: Path) -> Dict[str, Any]:
    """The model config as the export stores it: a Hugging Face text tower is read from the export itself.

    The export holds the tower's ``config.json`` and tokenizer files (`_write_text_tower_files`), so
    ``hf_model_name`` names the export's absolute path and open_clip's ``local-dir:`` loader needs nothing else.
    A tower known only by a hub id without local files keeps that id.
    """
    cfg = copy.deepcopy(model_cfg)
    text_cfg = cfg.get("text_cfg", {})
    text_cfg.pop("hf_model_pretrained", None)
    if text_cfg.get("hf_model_name"):
        text_cfg["hf_model_name"] = str(final)
        if text_cfg.get("hf_tokenizer_name"):
            text_cfg["hf_tokenizer_name"] = str(final)
    return cfg


def _write_text_tower_files(model, model_cfg: Dict[str, Any], src_dir: Path, out: Path,
                            config: bool = True) -> None:
    """A Hugging Face text tower's files (`weights.write_text_tower_files`): its tokenizer files are copied from
    the source model directory, else from the tower's own local folder, else saved from the Hugging Face cache."""
    text_cfg = model_cfg.get("text_cfg", {})
    if not text_cfg.get("hf_model_name"):
        return
    hf_name = text_cfg.get("hf_tokenizer_name") or text_cfg["hf_model_name"]
    folders = [src_dir] + ([Path(hf_name)] if os.path.isdir(hf_name) else [])
    weights.write_text_tower_files(model, text_cfg, out, copy_from=folders, config=config)


def _write_weights_and_config(model, model_cfg, pp_cfg, out: Path, metadata: Optional[Dict[str, str]] = None
                              ) -> None:
    """The weights, then the config with their size and SHA-256 and the list of files (written last)."""

    state = weights.state_dict_for_safetensors(model)
    save_file(state, str(out / weights.WEIGHTS_FILE), metadata=metadata)
    weights.write_config_with_record(out, {"model_cfg": model_cfg, "preprocess_cfg": pp_cfg})


def _write_open_clip(model, model_cfg, pp_cfg, src_dir: Path, out: Path, final: Path) -> None:
    _write_text_tower_files(model, model_cfg, src_dir, out)
    _write_weights_and_config(model, _portable_model_cfg(model_cfg, final), pp_cfg, out)


def _write_safetensors(model, model_cfg, pp_cfg, src_dir: Path, out: Path, final: Path) -> None:
    cfg = _portable_model_cfg(model_cfg, final)
    # safetensors metadata is str -> str; JSON keeps the nested config readable by any safetensors reader.
    metadata = {"format": "pt", "mmcl_model_cfg": json.dumps(cfg), "mmcl_preprocess_cfg": json.dumps(pp_cfg)}
    _write_text_tower_files(model, model_cfg, src_dir, out)
    _write_weights_and_config(model, cfg, pp_cfg, out, metadata)


# ------------------------------------------------------------------------------------------------------------
# Hugging Face CLIPModel


def _non_default(section: Dict[str, Any], defaults: Any, handled: Tuple[str, ...]) -> List[str]:
    """Keys of an open_clip tower config that are not mapped and differ from open_clip's default."""
    fields = {f.name: f for f in dataclasses.fields(defaults)}
    out = []
    for key, value in section.items():
        if key in handled:
            continue
        if key not in fields:
            out.append(f"{key}={value!r}")
            continue
        f = fields[key]
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default and not (value in (None, {}, "default") and default in (None, {})):
            out.append(f"{key}={value!r}")
    return out


# Config keys the CLIPModel mapping reproduces; everything else must keep open_clip's default value.
_HF_VISION_KEYS = ("layers", "width", "head_width", "mlp_ratio", "patch_size", "image_size", "patch_dropout",
                   "output_tokens")
_HF_TEXT_KEYS = ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "output_tokens",
                 "eos_id", "tokenizer_kwargs", "hf_model_pretrained")


def check_hf_supported(model_cfg: Dict[str, Any], pp_cfg: Dict[str, Any]) -> None:
    """Raise `ConfigError` unless the model maps exactly onto transformers' ``CLIPModel`` and ``CLIPProcessor``."""

    text_cfg, vision_cfg = model_cfg.get("text_cfg", {}), model_cfg.get("vision_cfg", {})
    if text_cfg.get("hf_model_name"):
        raise ConfigError(
            f"hf export needs open_clip's own text transformer (got the Hugging Face text tower "
            f"'{text_cfg['hf_model_name']}', which CLIPModel cannot hold and whose pooling/projection "
            f"VisionTextDualEncoderModel does not reproduce); export it as open_clip, safetensors or onnx")
    if vision_cfg.get("timm_model_name") or isinstance(vision_cfg.get("layers"), (list, tuple)):
        raise ConfigError("hf export needs a ViT image tower (got a timm or ResNet tower); "
                          "export it as open_clip, safetensors or onnx")
    problems = [f"vision_cfg.{p}" for p in _non_default(vision_cfg, CLIPVisionCfg, _HF_VISION_KEYS)]
    problems += [f"text_cfg.{p}" for p in _non_default(text_cfg, CLIPTextCfg, _HF_TEXT_KEYS)]
    for key in ("image_size", "patch_size"):
        if isinstance(vision_cfg.get(key), (list, tuple)) and len(set(vision_cfg[key])) > 1:
            problems.append(f"vision_cfg.{key}={vision_cfg[key]!r} (CLIPModel is square only)")
    if text_cfg.get("vocab_size", 49408) != 49408:
        problems.append(f"text_cfg.vocab_size={text_cfg['vocab_size']} (the CLIP BPE tokenizer has 49408 tokens)")
    extra_top = set(model_cfg) - {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "cast_dtype",
                                  "init_logit_scale", "init_logit_bias", "custom_text"}
    problems += sorted(extra_top)
    if pp_cfg.get("resize_mode", "shortest") not in ("shortest", "squash"):
        problems.append(f"preprocess resize_mode={pp_cfg['resize_mode']!r} (CLIPImageProcessor resizes the "
                        f"shortest side and crops, or squashes)")
    if problems:
        raise ConfigError(f"hf export cannot express this model: {', '.join(problems)} (CLIPModel holds a plain "
                          f"ViT and text transformer); export it as open_clip, safetensors or onnx")


def _as_int(value) -> int:
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def hf_clip_config(model_cfg: Dict[str, Any]):
    """transformers ``CLIPConfig`` with the shapes of an open_clip ViT + text transformer config."""

    v = dataclasses.asdict(CLIPVisionCfg())
    v.update(model_cfg["vision_cfg"])
    t = dataclasses.asdict(CLIPTextCfg())
    t.update(model_cfg["text_cfg"])
    # open_clip's GELU is the exact erf form ("gelu" in transformers) unless the model uses QuickGELU.
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    vision_config = dict(
        hidden_size=v["width"], intermediate_size=int(v["width"] * v["mlp_ratio"]), num_hidden_layers=v["layers"],
        num_attention_heads=v["width"] // v["head_width"], image_size=_as_int(v["image_size"]),
        patch_size=_as_int(v["patch_size"]), hidden_act=act, layer_norm_eps=1e-5, num_channels=3)
    text_config = dict(
        vocab_size=t["vocab_size"], hidden_size=t["width"], intermediate_size=int(t["width"] * t["mlp_ratio"]),
        num_hidden_layers=t["layers"], num_attention_heads=t["heads"], max_position_embeddings=t["context_length"],
        hidden_act=act, layer_norm_eps=1e-5, bos_token_id=49406, eos_token_id=49407, pad_token_id=0)
    return CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=model_cfg["embed_dim"],
                      logit_scale_init_value=float(model_cfg.get("init_logit_scale", 2.6592)))


def hf_clip_state_dict(sd: Dict[str, torch.Tensor], n_vision_layers: int, n_text_layers: int
                       ) -> Dict[str, torch.Tensor]:
    """An open_clip CLIP state dict in transformers ``CLIPModel``'s layout (the table of `mmcl.storage.hf_clip`).

    Raises `ConfigError` naming any open_clip parameter the table does not place (an unsupported feature).
    """
    out, left = hf_clip.to_hf(sd, n_vision_layers, n_text_layers)
    if left:
        raise ConfigError(f"hf export cannot place {len(left)} parameters of this model in CLIPModel (e.g. "
                          f"{', '.join(left[:3])}); export it as open_clip, safetensors or onnx")
    return out


def write_hf_tokenizer(context_length: int, out: Path) -> None:
    """open_clip's tokenizer as transformers 4.x and 5.x load it (``AutoTokenizer``, ``CLIPProcessor``): the
    ``tokenizer.json`` of `mmcl.storage.clip_tokenizer_file` (the same pipeline as the ONNX export's), declared as a
    plain fast tokenizer so that both generations run that file as it is (transformers 5's ``CLIPTokenizer`` rebuilds
    its own pipeline, which leaves ``&amp;`` undecoded), plus ``vocab.json`` and ``merges.txt``.

    The ids equal ``open_clip.get_tokenizer`` from the start token through the end token, truncation included, HTML
    entities and a literal ``<|endoftext|>`` (ordinary text) included, except for the few inputs that
    `mmcl.storage.clip_tokenizer_file` lists. Padding after the end token follows the transformers CLIP convention (the
    end token, 49407, with attention mask 0) where open_clip writes 0: id 0 is the vocabulary's "!", and registering it
    as the padding token would make transformers split every "!" of the text out as a special token. Neither model reads
    past the first end token (causal attention, pooling at that token), so the embeddings are the same.
    """


    write_tokenizer_json(out / "tokenizer.json", context_length)
    special = {"bos_token": SOT_TOKEN, "eos_token": EOT_TOKEN, "pad_token": EOT_TOKEN, "unk_token": EOT_TOKEN}
    # model_input_names: a plain fast tokenizer would also return token_type_ids, which CLIPModel.forward rejects
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "CLIPProcessor",
              "model_max_length": context_length, "clean_up_tokenization_spaces": False,
              "model_input_names": ["input_ids", "attention_mask"], **special}
    (out / weights.TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    oc = SimpleTokenizer(context_length=context_length)
    merges = [" ".join(pair) for pair, _ in sorted(oc.bpe_ranks.items(), key=lambda item: item[1])]
    (out / "vocab.json").write_text(json.dumps(oc.encoder, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def hf_image_processor(pp_cfg: Dict[str, Any]):
    """transformers ``CLIPImageProcessor`` reproducing open_clip's eval transform for `pp_cfg`."""

    size = pp_cfg.get("size", 224)
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    resample = {"bicubic": PILImageResampling.BICUBIC, "bilinear": PILImageResampling.BILINEAR,
                "nearest": PILImageResampling.NEAREST}[pp_cfg.get("interpolation", "bicubic")]
    common = dict(image_mean=list(pp_cfg["mean"]), image_std=list(pp_cfg["std"]), resample=resample,
                  do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    if pp_cfg.get("resize_mode", "shortest") == "squash":
        return CLIPImageProcessor(do_resize=True, size={"height": h, "width": w}, do_center_crop=False, **common)
    if h != w:
        raise ConfigError(f"hf export needs a square image size for shortest-side resizing (got {size})")
    return CLIPImageProcessor(do_resize=True, size={"shortest_edge": h}, do_center_crop=True,
                              crop_size={"height": h, "width": w}, **common)


def _write_hf(model, model_cfg, pp_cfg, src_dir: Path, out: Path, final: Path) -> None:

    config = hf_clip_config(model_cfg)
    state = hf_clip_state_dict(model.state_dict(), config.vision_config.num_hidden_layers,
                               config.text_config.num_hidden_layers)
    hf_model = CLIPModel(config)
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]  # a non-persistent index buffer
    if missing or unexpected:
        raise CheckpointError(f"CLIPModel layout mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if model_cfg.get("init_logit_bias") is not None:
        warnings.warn("CLIPModel has no logit bias: the exported model gives the same embeddings, but its "
                      "logits_per_image lack the learned SigLIP bias")
    hf_model.eval().save_pretrained(str(out))
    context_length = model_cfg["text_cfg"].get("context_length", 77)
    # Both transformers generations read the image processor from preprocessor_config.json. transformers 5 writes
    # it nested in processor_config.json, which 4.x passes on as a second image_processor argument ("got multiple
    # values for argument 'image_processor'"), so processor_config.json names the processor class only.
    hf_image_processor(pp_cfg).to_json_file(str(out / "preprocessor_config.json"))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "CLIPProcessor"}, indent=2) + "\n")
    # bench/check_transformers4.py loads this directory under transformers 4.46 and runs its zero-shot pipeline
    write_hf_tokenizer(context_length, out)


# ------------------------------------------------------------------------------------------------------------
# ONNX


class _ImageEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, D)
        return self.model.encode_image(image, normalize=True)


class _TextEncoder(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, text: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, D)
        return self.model.encode_text(text, normalize=True)


def _example_inputs(model_cfg: Dict[str, Any], batch: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random images (B,3,H,W) float32 (a NaFlex tower's: a patch dict) and token ids (B,L) int64 like a tokenizer's."""
    if models.is_naflex(model_cfg):
        return models.naflex.example_patches(model_cfg, batch, seed), _example_tokens(model_cfg, batch)
    size = model_cfg["vision_cfg"].get("image_size", 224)
    h, w = (size, size) if isinstance(size, int) else size
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, h, w, generator=gen)
    return images, _example_tokens(model_cfg, batch)


def _example_tokens(model_cfg: Dict[str, Any], batch: int) -> torch.Tensor:
    tokenizer = models.build_tokenizer(model_cfg)
    captions = ["a photo of a red circle", "A BLUE square on a white background!", "two green triangles",
                "a very long caption " + "with many repeated words " * 20]
    return tokenizer([captions[i % len(captions)] for i in range(batch)])


def _write_onnx(model, model_cfg, pp_cfg, src_dir: Path, out: Path, final: Path) -> None:
    images, tokens = _example_inputs(model_cfg, batch=2)
    with warnings.catch_warnings():
        # The TorchScript-based exporter is used on purpose: torch's dynamo exporter needs onnxscript, an extra
        # dependency, and gives the same graph for these plain transformer towers.
        warnings.simplefilter("ignore")
        torch.onnx.export(_ImageEncoder(model).eval(), (images,), str(out / ONNX_IMAGE_FILE), dynamo=False,
                          input_names=["image"], output_names=["image_embeds"], opset_version=ONNX_OPSET,
                          dynamic_axes={"image": {0: "batch"}, "image_embeds": {0: "batch"}})
        torch.onnx.export(_TextEncoder(model).eval(), (tokens.long(),), str(out / ONNX_TEXT_FILE), dynamo=False,
                          input_names=["text"], output_names=["text_embeds"], opset_version=ONNX_OPSET,
                          dynamic_axes={"text": {0: "batch"}, "text_embeds": {0: "batch"}})
    text_cfg = model_cfg.get("text_cfg", {})
    context_length = text_cfg.get("context_length", 77)
    if text_cfg.get("hf_tokenizer_name"):
        tokenizer = _write_onnx_hf_tokenizer(model, text_cfg, src_dir, out, context_length)
    else:

        write_tokenizer_json(out / ONNX_TOKENIZER_FILE, context_length)
        tokenizer = {"file": ONNX_TOKENIZER_FILE, "kind": "open_clip SimpleTokenizer (CLIP BPE)",
                     "truncation": context_length, "padding": context_length, "pad_id": 0}
    (out / ONNX_PREPROCESS_FILE).write_text(json.dumps(preprocess_spec(pp_cfg), indent=2) + "\n")
    meta = {"image_encoder": ONNX_IMAGE_FILE, "text_encoder": ONNX_TEXT_FILE, "embed_dim": model_cfg["embed_dim"],
            "context_length": context_length, "tokenizer": tokenizer, "preprocess": ONNX_PREPROCESS_FILE,
            "preprocess_cfg": pp_cfg, "model_cfg": _portable_model_cfg(model_cfg, final),
            "outputs": "L2-normalised"}
    (out / ONNX_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _write_onnx_hf_tokenizer(model, text_cfg: Dict[str, Any], src_dir: Path, out: Path, context_length: int
                             ) -> Dict[str, Any]:
    """The Hugging Face tokenizer of a model (a Hugging Face text tower's, or one named by ``hf_tokenizer_name``
    beside open_clip's text tower, as SigLIP's), its files written to `out` and its ``tokenizer.json`` made to give
    open_clip's ``HFTokenizer`` ids: the model's ``tokenizer_kwargs`` (``clean``, ``strip_sep_token``), truncation and
    padding are in the file (`clip_tokenizer_file.open_clip_hf_tokenizer_json`). Returns onnx_config's entry."""

    hf_name = text_cfg["hf_tokenizer_name"]
    folders = [src_dir] + ([Path(hf_name)] if os.path.isdir(hf_name) else [])
    weights.write_text_tower_files(model, text_cfg, out, copy_from=folders, config=False)
    kwargs = dict(text_cfg.get("tokenizer_kwargs") or {})
    entry: Dict[str, Any] = {"file": None, "kind": "the Hugging Face tokenizer, with open_clip's cleaning",
                             "name": hf_name, "tokenizer_kwargs": kwargs,
                             "tokenizer_mode": text_cfg.get("tokenizer_mode"), "truncation": context_length,
                             "padding": context_length}
    path = out / ONNX_TOKENIZER_FILE
    if not path.is_file():  # a slow-only tokenizer: its files are there, tokenizer.json is not
        return entry

    hf = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    text, not_expressed = open_clip_hf_tokenizer_json(
        path.read_text(encoding="utf-8"), context_length, clean=kwargs.get("clean", "whitespace"),
        strip_sep_token=bool(kwargs.get("strip_sep_token")), sep_token=hf.sep_token,
        pad_id=hf.pad_token_id if hf.pad_token_id is not None else 0)
    if text_cfg.get("tokenizer_mode"):  # open_clip's 'clips' mode frames the ids itself
        not_expressed.append(f"tokenizer_mode={text_cfg['tokenizer_mode']}")
    path.write_text(text, encoding="utf-8")
    entry.update(file=ONNX_TOKENIZER_FILE, not_expressed=not_expressed)
    return entry


def preprocess_spec(pp_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """open_clip's eval transform for `pp_cfg` as data: what a runtime without torch does to an image before
    ``image_encoder.onnx`` (the onnxruntime example of docs/export.md follows it).

    Steps, in order: convert to RGB; resize (``shortest``: the shorter side to ``size`` and the longer to
    ``int(size * long / short)``; ``squash``: to ``crop_size`` exactly; ``longest``: the longer side to ``size``,
    keeping the ratio) with ``interpolation`` (PIL's antialiased filter); centre crop to ``crop_size`` (offsets
    ``round((H - h) / 2)``, ``round((W - w) / 2)``; ``longest`` pads with ``fill_color`` where the image is smaller);
    scale to [0, 1]; subtract ``mean`` and divide by ``std`` per channel; lay out as (3, H, W) float32.
    """
    size = pp_cfg.get("size", 224)
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    mode = pp_cfg.get("resize_mode", "shortest")
    return {"size": h if h == w else [h, w], "crop_size": [h, w], "resize_mode": mode,
            "interpolation": pp_cfg.get("interpolation", "bicubic"), "rescale_factor": 1 / 255,
            "mean": [float(x) for x in pp_cfg["mean"]], "std": [float(x) for x in pp_cfg["std"]],
            "fill_color": pp_cfg.get("fill_color", 0), "color_mode": "RGB", "layout": "NCHW", "dtype": "float32",
            "steps": ["convert_rgb", f"resize_{mode}", "center_crop" if mode != "longest" else "center_crop_or_pad",
                      "rescale", "normalize"]}


# ------------------------------------------------------------------------------------------------------------
# Loading an export back with its own runtime


def export_encoders(out: Path, fmt: str) -> Tuple[Callable, Callable]:
    """(encode_image, encode_text) of an export, run by the format's own runtime, giving normalised (B, D).

    ``encode_image`` takes (B,3,H,W) float32 pixels already preprocessed; ``encode_text`` takes open_clip token
    ids (B,L) int64; for ``hf`` they go to ``CLIPModel`` with the attention mask transformers' tokenizer would
    give (the exported tokenizer yields the same ids, see `write_hf_tokenizer`).
    """
    out = Path(out)
    if fmt == "open_clip":

        oc_model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
        oc_model.eval()
        return (lambda x: oc_model.encode_image(x, normalize=True),
                lambda t: oc_model.encode_text(t, normalize=True))
    if fmt == "safetensors":
        loaded, _, _ = weights.load(out)
        return (lambda x: loaded.encode_image(x, normalize=True), lambda t: loaded.encode_text(t, normalize=True))
    if fmt == "hf":

        hf_model = CLIPModel.from_pretrained(str(out)).eval()

        def hf_image(x):
            return torch.nn.functional.normalize(_features(hf_model.get_image_features(pixel_values=x)), dim=-1)

        def hf_text(t):
            mask = _hf_attention_mask(t)
            feats = hf_model.get_text_features(input_ids=t, attention_mask=mask)
            return torch.nn.functional.normalize(_features(feats), dim=-1)

        return hf_image, hf_text
    if fmt == "onnx":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, torch.get_num_threads())
        img = ort.InferenceSession(str(out / ONNX_IMAGE_FILE), opts, providers=["CPUExecutionProvider"])
        txt = ort.InferenceSession(str(out / ONNX_TEXT_FILE), opts, providers=["CPUExecutionProvider"])
        return (lambda x: torch.from_numpy(img.run(None, {"image": x.numpy()})[0]),
                lambda t: torch.from_numpy(txt.run(None, {"text": t.long().numpy()})[0]))
    raise ConfigError(f"unknown export format '{fmt}' (expected one of {', '.join(FORMATS)})")


def _features(output) -> torch.Tensor:
    # transformers 5 returns a model output whose pooler_output holds the projected features; 4.x a tensor.
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _hf_attention_mask(tokens: torch.Tensor) -> torch.Tensor:
    """1 up to and including the first end-of-text token (49407), 0 on the padding after it."""
    eot = (tokens == 49407).int()
    after = (eot.cumsum(dim=1) - eot) > 0
    return (~after).long()


@torch.no_grad()
def verify_export(model: nn.Module, model_cfg: Dict[str, Any], out: Path, fmt: str, batch: int = 3) -> float:
    """Smallest cosine between the export's and the source model's normalised embeddings on random inputs.

    Raises `CheckpointError` when it is below `MIN_COSINE`[fmt].
    """
    images, tokens = _example_inputs(model_cfg, batch, seed=1)
    model = model.eval()
    ref_img = model.encode_image(images, normalize=True).float()
    ref_txt = model.encode_text(tokens, normalize=True).float()
    enc_img, enc_txt = export_encoders(out, fmt)
    cos_img = (enc_img(images).float() * ref_img).sum(-1).min().item()
    cos_txt = (enc_txt(tokens).float() * ref_txt).sum(-1).min().item()
    worst = min(cos_img, cos_txt)
    if not worst >= MIN_COSINE[fmt]:
        raise CheckpointError(f"{fmt} export does not reproduce the model (embedding cosine image {cos_img:.6f}, "
                              f"text {cos_txt:.6f}; expected >= {MIN_COSINE[fmt]})")
    return worst
