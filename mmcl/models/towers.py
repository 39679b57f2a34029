"""Image and text towers, built with open_clip from a plain model-config dict.

A model config is open_clip's own dict (``embed_dim``, ``vision_cfg``, ``text_cfg``, ...). Named configs are
data: ``mmcl/models/model_configs/*.json`` first, then any architecture open_clip ships (ViT, ResNet, timm
ConvNeXt, ...).
A Hugging Face text tower (``model.text.hf``) is open_clip's adapter built with its width, pooler and projection given
explicitly (`mmcl.models.clip_classes.HFTextTower`), so no open_clip table is written. The model classes, mmcl's
subclasses of open_clip's, live in `mmcl.models.clip_classes`, imported where a model is built (open_clip is slow
to import).

Saving and loading model directories (and the names of their files) and ``init_from`` live in
`mmcl.storage.weights`.

Locking follows LiT (Zhai et al. 2022): a locked tower's parameters get ``requires_grad=False`` (so no optimiser
state), and a tower whose backbone is entirely locked runs that backbone under ``torch.no_grad`` in eval mode:
no activations are kept for backward, dropout is off and normalisation statistics do not move.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import open_clip
import torch
from open_clip.model import CustomTextCLIP
from open_clip.modified_resnet import ModifiedResNet
from open_clip.tokenizer import DEFAULT_CONTEXT_LENGTH, HFTokenizer, SimpleTokenizer
from open_clip.transform import PreprocessCfg, image_transform_v2
from open_clip.transformer import lock_text_tower
from torch import nn

from ..config import ModelConfig
from ..data.limits import BoundedTokenizer, read_regular_text
from ..data.naflex import EvalPatchify
from ..errors import ConfigError
from . import naflex
from .clip_classes import (
    CaptionCoCa,
    HFTextCLIP,
    ShortTextCLIP,
    clip_text_modules,
    hf_custom_code_error,
)
from .flip import SeededPatchDropout

CONFIG_DIR = Path(__file__).parent / "model_configs"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # marks a saved Hugging Face tokenizer (model directories use it)


def is_local_dir(name_or_path: str) -> bool:
    """Whether `name_or_path` (``~`` expanded) is an existing local directory rather than a hub name."""
    return os.path.isdir(os.path.expanduser(name_or_path))


# 'cls' is the [CLS] token's last hidden state; open_clip's 'cls_pooler' would instead use BERT's pooler head
# (dense + tanh trained for next-sentence prediction), an extra layer that many sentence encoders never trained.
_HF_POOLERS = {"mean": "mean_pooler", "cls": "cls_last_hidden_state_pooler", "max": "max_pooler"}


# ------------------------------------------------------------------------------------------------ configs
def available_models() -> List[str]:
    """mmcl model-config names followed by every open_clip architecture name."""

    return sorted(p.stem for p in CONFIG_DIR.glob("*.json")) + list(open_clip.list_models())


def is_arch_file(name: str) -> bool:
    """Whether `model.name` names a model-config file (``/path/arch.json``) rather than a config by name."""
    return name.endswith(".json")


_ARCH_KEYS = ("embed_dim", "vision_cfg", "text_cfg")


def arch_file_config(name: str) -> Dict[str, Any]:
    """The model config in a JSON file, in open_clip's model-config format (``model_configs/*.json``: embed_dim,
    vision_cfg, text_cfg, ...), or an ``open_clip_config.json`` (``model_cfg`` + ``preprocess_cfg``). Its
    ``preprocess_cfg``, if any, is kept under that key (`preprocess_config` reads it; `build` takes it out).
    Anything unreadable is one `ConfigError` line naming the file."""
    path = Path(os.path.expanduser(name))
    try:
        text = read_regular_text(path)
    except OSError as err:
        raise ConfigError(f"model.name: cannot read the model-config file {name} "
                          f"({err.strerror or type(err).__name__})") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.name: {name} is not valid JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("model_cfg"), dict):  # an open_clip_config.json
        data = {**data["model_cfg"], **({"preprocess_cfg": data["preprocess_cfg"]}
                                        if isinstance(data.get("preprocess_cfg"), dict) else {})}
    missing = [k for k in _ARCH_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ConfigError(f"model.name: {name} is not an open_clip model config (no {', '.join(missing)}; expected "
                          f"a JSON object like open_clip's model_configs/ViT-B-32.json)")
    if not isinstance(data["vision_cfg"], dict) or not isinstance(data["text_cfg"], dict):
        raise ConfigError(f"model.name: {name}: vision_cfg and text_cfg must be JSON objects")
    return data


def named_config(name: str) -> Dict[str, Any]:
    """The model-config dict for a name or a model-config file (`arch_file_config`); `ConfigError` naming close
    matches when unknown."""

    if is_arch_file(name):
        return arch_file_config(name)
    path = CONFIG_DIR / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        close = difflib.get_close_matches(name, available_models(), n=4, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see mmcl.models.available_models()"
        raise ConfigError(f"unknown model.name '{name}'{hint}")
    return copy.deepcopy(cfg)


def resolve_model_config(cfg: ModelConfig) -> Dict[str, Any]:
    """Apply the ``model.*`` overrides to the named config; returns a new open_clip model-config dict."""
    model_cfg = named_config(cfg.name)
    model_cfg.setdefault("vision_cfg", {}).update(copy.deepcopy(cfg.vision_cfg))
    text_cfg = model_cfg.setdefault("text_cfg", {})
    if cfg.text.hf:
        # A Hugging Face text tower replaces open_clip's text transformer; open_clip's CustomTextCLIP runs it.
        # The named config's tokenizer settings go too: they belong to the tokenizer being replaced.
        for key in ("width", "heads", "layers", "vocab_size", "mlp_ratio", "ls_init_value", "output_tokens",
                    "pool_type", "proj_type", "proj_bias", "embed_cls", "no_causal_mask", "pad_id", "eos_id",
                    "hf_model_pretrained", "tokenizer_kwargs", "tokenizer_mode"):
            text_cfg.pop(key, None)
        # A local directory is stored absolute so a resumed run or a saved config works from any directory.
        source = os.path.abspath(os.path.expanduser(cfg.text.hf)) if is_local_dir(cfg.text.hf) else cfg.text.hf
        text_cfg.update(
            hf_model_name=source,
            hf_tokenizer_name=source,
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
    """Instantiate an open_clip CLIP / CustomTextCLIP from a model-config dict (fp32, ``output_dict=True``).

    Weights are random except a Hugging Face text tower, which is read from its directory / the local
    Hugging Face cache unless ``text_cfg.hf_model_pretrained`` is False.
    """


    model_cfg = copy.deepcopy(model_cfg)
    model_cfg.pop("preprocess_cfg", None)  # an architecture file's preprocessing (`arch_file_config`)
    text_cfg = model_cfg.get("text_cfg", {})
    hf_name = text_cfg.get("hf_model_name")
    custom_text = model_cfg.pop("custom_text", False) or bool(hf_name)
    if hf_name:
        text_cfg.setdefault("hf_model_pretrained", True)
    model_cls = HFTextCLIP if hf_name else CustomTextCLIP if custom_text else ShortTextCLIP
    flex = naflex.is_naflex(model_cfg)
    if "multimodal_cfg" in model_cfg:  # a captioning decoder: open_clip's CoCa (`CaptionCoCa`)
        check_decoder_towers(model_cfg)
        model_cls = CaptionCoCa
    try:
        model = model_cls(**(naflex.placeholder_config(model_cfg) if flex else model_cfg))
        if flex:  # the NaFlex image tower in the placeholder's place (`mmcl.models.naflex`)
            model.visual = naflex.tower_from_config(model_cfg)
    except TypeError as err:
        raise ConfigError(f"invalid model config: {err}") from None
    except OSError as err:  # transformers cannot find the tower (offline, wrong path)
        raise ConfigError(f"cannot load the Hugging Face text tower '{hf_name}' (not a local directory with "
                          f"config.json and weights, nor in the local Hugging Face cache): "
                          f"{str(err).splitlines()[0]}") from None
    except RuntimeError as err:  # e.g. timm: unknown model name
        raise ConfigError(f"invalid model config: {str(err).splitlines()[0]}") from None
    if hf_name:
        _check_hf_tower(model.text, model_cfg)
    model.output_dict = True
    return model


def check_decoder_towers(model_cfg: Dict[str, Any]) -> None:
    """A captioning decoder (``multimodal_cfg``, open_clip's CoCa) reads the un-pooled tokens of open_clip's ViT
    image tower and open_clip's text transformer; any other tower is one `ConfigError` line."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    other = ("a Hugging Face text tower" if text.get("hf_model_name") else
             "a timm/NaFlex image tower" if vision.get("timm_model_name") else
             "a ResNet image tower" if isinstance(vision.get("layers"), (list, tuple)) else None)
    if other:
        raise ConfigError(f"a captioning decoder (multimodal_cfg) is supported on open_clip's ViT image tower and "
                          f"text transformer only (model.name coca_*), not on {other}")
    if not vision.get("output_tokens") or not text.get("output_tokens"):
        raise ConfigError("a captioning decoder (multimodal_cfg) needs vision_cfg.output_tokens and "
                          "text_cfg.output_tokens true (as open_clip's coca_* configs set them)")
    # The decoder's self-attention reads the text tower's tokens and its cross-attention the image tokens: open_clip's
    # attentional pooler gives them at embed_dim (coca_*), a plain ViT at its own width. Both are the decoder's.
    width = model_cfg["multimodal_cfg"].get("width", 512)
    image = ("embed_dim", model_cfg.get("embed_dim")) if vision.get("attentional_pool") else (
        "vision_cfg.width", vision.get("width", 768))
    widths = dict([image, ("text_cfg.width", text.get("width", 512))])
    wrong = [f"{k} {v}" for k, v in widths.items() if v != width]
    if wrong:
        raise ConfigError(f"a captioning decoder of width {width} (multimodal_cfg.width) needs {' and '.join(widths)} "
                          f"equal to it (got {', '.join(wrong)})")


def _check_hf_tower(text: nn.Module, model_cfg: Dict[str, Any]) -> None:
    if not hasattr(text, "proj"):
        # open_clip leaves the projection unset when it is 'none' but the widths differ.
        width = getattr(text.config, "hidden_size", "?")
        raise ConfigError(f"model.text.projection=none needs model.embed_dim equal to the text tower's width "
                          f"(got embed_dim {model_cfg['embed_dim']}, expected {width})")
    context_length = model_cfg["text_cfg"].get("context_length", 77)
    max_positions = getattr(text.config, "max_position_embeddings", None)
    if max_positions and context_length > max_positions:
        raise ConfigError(f"model.context_length {context_length} exceeds the text tower's "
                          f"max_position_embeddings (got {context_length}, expected <= {max_positions})")


def preprocess_config(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """open_clip PreprocessCfg fields (size, mean, std, interpolation, resize_mode) for a model config."""

    size = model_cfg["vision_cfg"].get("image_size", 224)
    pp = dataclasses.asdict(PreprocessCfg(size=size))
    pp.update(model_cfg.get("preprocess_cfg", {}))
    if naflex.is_naflex(model_cfg):  # the evaluation transform's sequence length (a run sets its own) and patch
        pp.setdefault("naflex_seq_len", naflex.DEFAULT_EVAL_SEQ_LEN)
        pp.setdefault("patch_size", naflex.config_patch_size(model_cfg))
    return pp


def build_transforms(preprocess_cfg: Dict[str, Any]):
    """(train transform, eval transform) from open_clip: PIL image -> (3, H, W) float tensor; for a NaFlex tower
    (``naflex_seq_len`` in `preprocess_cfg`) both are `mmcl.data.naflex.EvalPatchify`: PIL image -> patch dict."""

    if preprocess_cfg.get("naflex_seq_len"):

        tf = EvalPatchify(preprocess_cfg["naflex_seq_len"], preprocess_cfg["patch_size"], preprocess_cfg["mean"],
                          preprocess_cfg["std"], preprocess_cfg.get("interpolation", "bicubic"))
        return tf, tf

    pp = PreprocessCfg(**{k: v for k, v in preprocess_cfg.items() if k in PreprocessCfg.__dataclass_fields__})
    return image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False)


def build_tokenizer(model_cfg: Dict[str, Any], source_dir: Optional[str] = None):
    """open_clip's tokenizer for the text tower: BPE SimpleTokenizer, or the Hugging Face tower's own.

    Built as ``open_clip.get_tokenizer`` builds it for the same config: ``text_cfg.tokenizer_kwargs`` (SigLIP's
    ``clean="canonicalize"``, BERT towers' ``strip_sep_token``) and ``text_cfg.tokenizer_mode`` reach the
    tokenizer, so a published model's captions become the token ids it was trained on. The returned callable
    maps a list of B strings to a (B, context_length) long tensor, each string cut first by
    `mmcl.data.limits.bound_text` (so that no text from a file costs more than its bound to tokenize).
    """

    text_cfg = model_cfg.get("text_cfg", {})
    context_length = text_cfg.get("context_length", DEFAULT_CONTEXT_LENGTH)
    kwargs = dict(text_cfg.get("tokenizer_kwargs") or {})
    hf_name = text_cfg.get("hf_tokenizer_name")
    try:
        if not hf_name:
            return BoundedTokenizer(SimpleTokenizer(context_length=context_length, **kwargs))
        if source_dir and (Path(source_dir) / TOKENIZER_CONFIG_FILE).is_file():
            hf_name = source_dir
        # Remote code is never run, whatever the kwargs say.
        kwargs["trust_remote_code"] = False
        return BoundedTokenizer(HFTokenizer(hf_name, context_length=context_length,
                                            tokenizer_mode=text_cfg.get("tokenizer_mode"), **kwargs))
    except (TypeError, AssertionError) as err:
        # open_clip asserts on an unknown `clean`; an unknown key is a TypeError from a constructor.
        if not text_cfg.get("tokenizer_kwargs"):
            raise
        raise ConfigError(f"model text_cfg.tokenizer_kwargs {text_cfg.get('tokenizer_kwargs')!r} are not accepted "
                          f"by the tokenizer: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except ValueError as err:
        raise (hf_custom_code_error(err, hf_name) or err) from None
    except OSError as err:
        raise ConfigError(f"cannot load the tokenizer '{hf_name}' (not a local directory with tokenizer "
                          f"files, nor in the local Hugging Face cache): {str(err).splitlines()[0]}") from None


class TrimmedTokenizer:
    """A tokenizer whose batches end after the last column holding a token of any caption.

    For a text tower that reads nothing after the end-of-text token (`ShortTextCLIP`: causal mask, ``argmax``
    pooling) the cut changes no output, and made here, in the data loader's workers, it spares the training
    loop a device read of the longest caption per step (the tower pads a cut batch back where it needs the full
    context). Picklable, so that worker processes can use it.
    """

    def __init__(self, tokenizer: Callable[[List[str]], torch.Tensor], pad_id: int = 0):
        self.tokenizer, self.pad_id = tokenizer, pad_id

    def __call__(self, texts, *args, **kwargs) -> torch.Tensor:
        tokens = torch.as_tensor(self.tokenizer(texts, *args, **kwargs))
        used = (tokens != self.pad_id).any(dim=0).nonzero()
        return tokens[:, : int(used.max()) + 1 if used.numel() else 1]

    def __getattr__(self, name):  # context_length and the like, from the wrapped tokenizer
        if name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def training_tokenizer(model: nn.Module, tokenizer: Callable[[List[str]], torch.Tensor]):
    """The tokenizer the training data loader uses: cut batches (`TrimmedTokenizer`) for the towers that take
    them exactly (open_clip's own text transformer with a causal mask and ``argmax`` pooling), else unchanged."""
    if (isinstance(model, ShortTextCLIP) and getattr(model, "attn_mask", None) is not None
            and getattr(model, "text_pool_type", None) == "argmax"):
        return TrimmedTokenizer(tokenizer)
    return tokenizer


def build(cfg: ModelConfig):
    """Model, its config dict, preprocess config, train/eval transforms and tokenizer for a `ModelConfig`.

    Returns ``(model, model_cfg, preprocess_cfg, train_transform, eval_transform, tokenizer)``.
    """
    model_cfg = resolve_model_config(cfg)
    model = create(model_cfg)
    pp = preprocess_config(model_cfg)
    model_cfg.pop("preprocess_cfg", None)  # recorded beside the model config, as open_clip_config.json has it
    train_tf, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model, model_cfg, pp, train_tf, eval_tf, tokenizer


def set_patch_dropout(model: nn.Module, prob: float, seed: int = 0, rank: int = 0, world_size: int = 1,
                      accum_steps: int = 1) -> List[nn.Module]:
    """FLIP patch dropout in `model`'s image tower (training only; `mmcl.models.flip`). Returns the masking modules, for
    `mmcl.models.flip.begin_step`. Raises ConfigError for an image tower without patch tokens (a ResNet, a timm
    trunk)."""

    visual = getattr(model, "visual", None)
    if visual is None or not hasattr(visual, "patch_dropout") or not hasattr(visual, "class_embedding"):
        raise ConfigError(f"model.patch_dropout={prob} needs an open_clip ViT image tower (patch tokens); this "
                          f"model's image tower is {type(visual).__name__}: set model.patch_dropout=0")
    visual.patch_dropout = SeededPatchDropout(prob, seed=seed, rank=rank, world_size=world_size,
                                              accum_steps=accum_steps)
    return [visual.patch_dropout]


def _clip_text_params(model: nn.Module) -> List[nn.Parameter]:
    params = [p for m in clip_text_modules(model) for p in m.parameters()] + [model.positional_embedding]
    if isinstance(model.text_projection, nn.Parameter):
        params.append(model.text_projection)
    elif model.text_projection is not None:
        params += list(model.text_projection.parameters())
    return params


def _all_frozen(params) -> bool:
    params = list(params)
    return bool(params) and not any(p.requires_grad for p in params)


FROZEN_ATTR = "mmcl_frozen"  # set on a module whose forward runs without autograd (see `_run_frozen`)


class _NoGradForward:
    """Forward hooks that run a module's forward under ``torch.no_grad`` in eval mode.

    The pre-hook puts the module in eval mode and turns autograd off; the forward hook (``always_call``, so also
    when the forward raises) restores the caller's grad mode. The hooks act on the module they are called with,
    so a ``copy.deepcopy`` of the model (EMA) runs its own weights the same way; the state dict is unchanged.
    """

    def __init__(self):
        self.grad_modes: List[bool] = []

    def enter(self, module: nn.Module, args) -> None:
        module.eval()
        self.grad_modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def leave(self, module: nn.Module, args, output) -> None:
        torch.set_grad_enabled(self.grad_modes.pop())


def _run_frozen(module: nn.Module) -> None:
    """Make `module`'s forward run under ``torch.no_grad`` with the module in eval mode (`_NoGradForward`)."""
    if getattr(module, FROZEN_ATTR, False):
        return
    hooks = _NoGradForward()
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.leave, always_call=True)
    setattr(module, FROZEN_ATTR, True)


def is_frozen_call(owner: Any, method: str = "forward") -> bool:
    """Whether `apply_locks` made ``owner.<method>`` run without autograd: a module's ``forward``, or the
    ``encode_text`` of open_clip's CLIP class (whose text parts live on the model,
    `mmcl.models.clip_classes.ShortTextCLIP`)."""
    if method == "encode_text":
        return bool(getattr(owner, "text_frozen", False))
    return method == "forward" and bool(getattr(owner, FROZEN_ATTR, False))


def _unfreeze_layer_norms(modules: List[nn.Module]) -> None:
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.LayerNorm):
                for p in sub.parameters():
                    p.requires_grad = True


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def _hf_layers(backbone: nn.Module) -> Tuple[nn.Module, nn.ModuleList]:
    """(embeddings, layer list) of a Hugging Face encoder: BERT/RoBERTa/MiniLM, DistilBERT, T5, BART-style."""
    for emb_path, layers_path in (("embeddings", "encoder.layer"), ("embeddings", "transformer.layer"),
                                  ("embed_tokens", "block"), ("embed_tokens", "layers"),
                                  ("embeddings", "encoder.layers")):
        try:
            embeddings, layers = backbone.get_submodule(emb_path), backbone.get_submodule(layers_path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return embeddings, layers
    raise ConfigError(f"model.lock_text_unlocked_layers > 0 is not supported for {type(backbone).__name__} "
                      f"(its layer list was not found; lock the whole tower with lock_text_unlocked_layers=0)")


def _lock_hf_backbone(backbone: nn.Module, unlocked_layers: int, freeze_layer_norm: bool) -> None:
    """Freeze a Hugging Face backbone except its last `unlocked_layers` layers (open_clip's HF semantics:
    the embeddings count as the first layer; with ``freeze_layer_norm=False`` norms in frozen layers train)."""
    if unlocked_layers:
        embeddings, layers = _hf_layers(backbone)
        frozen = [embeddings, *layers][:-unlocked_layers]
    else:
        frozen = [backbone]
    for module in frozen:
        for p in module.parameters():
            p.requires_grad = False
        if not freeze_layer_norm:
            for sub in module.modules():
                if _is_norm(sub):
                    for p in sub.parameters():
                        p.requires_grad = True


def apply_locks(model: nn.Module, cfg: ModelConfig) -> None:
    """Freeze towers as configured (``model.lock_image*``, ``model.lock_text*``).

    Locked parameters get ``requires_grad=False``; a tower (or a Hugging Face / timm backbone) left with no
    trainable parameter runs under ``torch.no_grad`` in eval mode. ``lock_text_freeze_layer_norm=False`` keeps the
    text tower's LayerNorm gains and biases trainable, as open_clip does for Hugging Face towers.
    """

    if cfg.lock_image:
        groups = cfg.lock_image_unlocked_groups
        if groups < 0:
            raise ConfigError(f"model.lock_image_unlocked_groups must be >= 0 (got {groups})")
        if groups and isinstance(model.visual, ModifiedResNet):
            raise ConfigError(f"model.lock_image_unlocked_groups must be 0 for ResNet image towers "
                              f"(got {groups}; open_clip locks them only whole)")
        model.lock_image_tower(groups, cfg.lock_image_freeze_bn_stats)
        if _all_frozen(model.visual.parameters()):
            _run_frozen(model.visual)
        elif _all_frozen(getattr(model.visual, "trunk", nn.Module()).parameters()):
            # A timm tower locks its trunk and keeps the projection head trainable.
            _run_frozen(model.visual.trunk)
    if cfg.lock_text:
        layers = cfg.lock_text_unlocked_layers
        if layers < 0:
            raise ConfigError(f"model.lock_text_unlocked_layers must be >= 0 (got {layers})")
        freeze_ln = cfg.lock_text_freeze_layer_norm
        text = getattr(model, "text", None)
        if text is None:  # open_clip CLIP: text parts live on the model
            lock_text_tower(model, layers)
            if not freeze_ln:
                _unfreeze_layer_norms(clip_text_modules(model))
            if _all_frozen(_clip_text_params(model)):
                if isinstance(model, ShortTextCLIP):
                    model.text_frozen = True  # read by its encode_text
                else:  # another CLIP instance: each part of the text tower runs without autograd
                    for module in clip_text_modules(model):
                        _run_frozen(module)
        elif hasattr(text, "transformer") and hasattr(text, "config"):  # Hugging Face tower
            _lock_hf_backbone(text.transformer, layers, freeze_ln)
            if _all_frozen(text.parameters()):
                _run_frozen(text)
            elif _all_frozen(text.transformer.parameters()):
                # The backbone is locked, the projection head trains: only the backbone runs without autograd.
                _run_frozen(text.transformer)
        else:  # open_clip TextTransformer inside CustomTextCLIP
            lock_text_tower(text, layers)
            if not freeze_ln:
                _unfreeze_layer_norms([text])
            if _all_frozen(text.parameters()):
                _run_frozen(text)


def clamp_logit_scale(model: nn.Module, max_logit_scale: float) -> None:
    """Keep the learned temperature within ``1 <= exp(logit_scale) <= max_logit_scale``, in place on the model's
    log parameter (``model.logit_scale``, the unwrapped model). The one place the limit is applied: after each
    optimiser step, so every forward returns a scale within it and the loss uses that scale as given."""
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(max_logit_scale))
