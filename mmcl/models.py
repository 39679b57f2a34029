"""Image and text towers, built with open_clip from a plain model-config dict.

A model config is open_clip's own dict (``embed_dim``, ``vision_cfg``, ``text_cfg``, ...). Named configs are
data: ``mmcl/model_configs/*.json`` first, then any architecture open_clip ships. A saved model directory is
open_clip's local-dir layout (``open_clip_config.json`` + ``open_clip_model.safetensors``), so open_clip,
CLIP_benchmark and `mmcl.load` all read the same files.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .config import ModelConfig
from .errors import CheckpointError, ConfigError

CONFIG_DIR = Path(__file__).parent / "model_configs"
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
_HF_POOLERS = {"mean": "mean_pooler", "cls": "cls_pooler", "max": "max_pooler"}


def available_models() -> list:
    import open_clip

    return sorted(p.stem for p in CONFIG_DIR.glob("*.json")) + list(open_clip.list_models())


def named_config(name: str) -> Dict[str, Any]:
    """The model-config dict for a name; `ConfigError` naming close matches when unknown."""
    import open_clip

    path = CONFIG_DIR / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        close = difflib.get_close_matches(name, available_models(), n=4, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see open_clip.list_models()"
        raise ConfigError(f"unknown model.name '{name}'{hint}")
    return copy.deepcopy(cfg)


def resolve_model_config(cfg: ModelConfig) -> Dict[str, Any]:
    """Apply the ``model.*`` overrides to the named config; returns a new open_clip model-config dict."""
    model_cfg = named_config(cfg.name)
    model_cfg.setdefault("vision_cfg", {}).update(copy.deepcopy(cfg.vision_cfg))
    text_cfg = model_cfg.setdefault("text_cfg", {})
    if cfg.text.hf:
        # A Hugging Face text tower replaces open_clip's text transformer; open_clip's CustomTextCLIP runs it.
        for key in ("width", "heads", "layers", "vocab_size", "mlp_ratio", "ls_init_value", "output_tokens"):
            text_cfg.pop(key, None)
        text_cfg.update(
            hf_model_name=cfg.text.hf,
            hf_tokenizer_name=cfg.text.hf,
            hf_pooler_type=_HF_POOLERS[cfg.text.pooling],
            hf_proj_type=None if cfg.text.projection == "none" else cfg.text.projection,
        )
    text_cfg.update(copy.deepcopy(cfg.text_cfg))
    if cfg.embed_dim is not None:
        model_cfg["embed_dim"] = cfg.embed_dim
    if cfg.image_size is not None:
        model_cfg["vision_cfg"]["image_size"] = cfg.image_size
    if cfg.context_length is not None:
        text_cfg["context_length"] = cfg.context_length
    model_cfg["init_logit_scale"] = cfg.init_logit_scale
    if cfg.init_logit_bias is not None:
        model_cfg["init_logit_bias"] = cfg.init_logit_bias
    return model_cfg


def create(model_cfg: Dict[str, Any]) -> nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a model-config dict (random init, fp32)."""
    from open_clip.model import CLIP, CustomTextCLIP

    model_cfg = copy.deepcopy(model_cfg)
    custom_text = model_cfg.pop("custom_text", False) or "hf_model_name" in model_cfg.get("text_cfg", {})
    if "hf_model_name" in model_cfg.get("text_cfg", {}):
        # Weights of a Hugging Face tower come from its directory at creation; an mmcl checkpoint overwrites them.
        model_cfg["text_cfg"].setdefault("hf_model_pretrained", True)
    model_cls = CustomTextCLIP if custom_text else CLIP
    try:
        model = model_cls(**model_cfg)
    except TypeError as err:
        raise ConfigError(f"invalid model config: {err}") from None
    model.output_dict = True
    return model


def preprocess_config(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """open_clip PreprocessCfg fields (size, mean, std, interpolation, resize_mode) for a model config."""
    from open_clip.transform import PreprocessCfg

    size = model_cfg["vision_cfg"].get("image_size", 224)
    pp = dataclasses.asdict(PreprocessCfg(size=size))
    pp.update(model_cfg.get("preprocess_cfg", {}))
    return pp


def build_transforms(preprocess_cfg: Dict[str, Any]):
    """(train transform, eval transform) from open_clip."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    pp = PreprocessCfg(**{k: v for k, v in preprocess_cfg.items() if k in PreprocessCfg.__dataclass_fields__})
    return image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False)


def build_tokenizer(model_cfg: Dict[str, Any], source_dir: Optional[str] = None):
    """open_clip's tokenizer for the text tower: BPE SimpleTokenizer, or the Hugging Face tower's own."""
    from open_clip.tokenizer import HFTokenizer, SimpleTokenizer

    text_cfg = model_cfg.get("text_cfg", {})
    context_length = text_cfg.get("context_length", 77)
    hf_name = text_cfg.get("hf_tokenizer_name")
    if hf_name:
        if source_dir and (Path(source_dir) / "tokenizer_config.json").is_file():
            hf_name = source_dir
        return HFTokenizer(hf_name, context_length=context_length)
    return SimpleTokenizer(context_length=context_length)


def build(cfg: ModelConfig):
    """Model, its config dict, train/eval transforms and tokenizer for a `ModelConfig`."""
    model_cfg = resolve_model_config(cfg)
    model = create(model_cfg)
    pp = preprocess_config(model_cfg)
    train_tf, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model, model_cfg, pp, train_tf, eval_tf, tokenizer


def apply_locks(model: nn.Module, cfg: ModelConfig) -> None:
    """Freeze towers as configured (open_clip's lock methods set requires_grad=False)."""
    if cfg.lock_image:
        model.lock_image_tower(cfg.lock_image_unlocked_groups, cfg.lock_image_freeze_bn_stats)
    if cfg.lock_text:
        model.lock_text_tower(cfg.lock_text_unlocked_layers, cfg.lock_text_freeze_layer_norm)


def _state_dict_for_saving(model: nn.Module) -> Dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings of some Hugging Face towers): clone them.
    seen, out = {}, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        out[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen[ptr] = key
    return out


def save_model_dir(model: nn.Module, model_cfg: Dict[str, Any], preprocess_cfg: Dict[str, Any], out_dir,
                   extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write open_clip's local-dir layout atomically: a temp dir beside `out_dir`, then a rename."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(_state_dict_for_saving(model), str(tmp / WEIGHTS_FILE))
        meta = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
        if extra:
            meta["mmcl"] = extra
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        hf_name = model_cfg.get("text_cfg", {}).get("hf_tokenizer_name")
        if hf_name and os.path.isdir(hf_name):
            # Keep the tokenizer files with the weights so the directory is self-contained.
            for name in os.listdir(hf_name):
                if name.startswith(("tokenizer", "vocab", "special_tokens", "merges")):
                    shutil.copy2(os.path.join(hf_name, name), tmp / name)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def find_model_dir(path) -> Path:
    """Resolve a run directory, its ``model/``, or an export directory to the directory holding the weights."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model path not found: {path}")
    for candidate in (path, path / "model", path / "open_clip"):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    raise CheckpointError(
        f"no model in {path} (expected {CONFIG_FILE} there or in {path}/model; train or export one first)")


def load_model_dir(path) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """Load a saved model directory: (model in eval mode, model_cfg, preprocess_cfg)."""
    from safetensors.torch import load_file

    model_dir = find_model_dir(path)
    meta = json.loads((model_dir / CONFIG_FILE).read_text())
    model_cfg = meta["model_cfg"]
    cfg_for_create = copy.deepcopy(model_cfg)
    if "hf_model_name" in cfg_for_create.get("text_cfg", {}):
        cfg_for_create["text_cfg"]["hf_model_pretrained"] = False  # weights come from our file
    model = create(cfg_for_create)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{model_dir} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    state = load_file(str(weights))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"weights in {weights} do not fit the saved config: {str(err).splitlines()[0]}") from None
    model.eval()
    return model, model_cfg, meta.get("preprocess_cfg") or preprocess_config(model_cfg)


def load(path):
    """``model, preprocess, tokenizer = mmcl.load(path)`` for a run dir, its ``model/``, or an export.

    ``model.encode_image(images (B,3,H,W) float)`` / ``model.encode_text(tokens (B,L) long)`` give (B, D)
    features (pass ``normalize=True`` for unit vectors); ``model.logit_scale`` is log s.
    """
    model, model_cfg, pp = load_model_dir(path)
    _, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg, source_dir=str(find_model_dir(path)))
    return model, eval_tf, tokenizer
