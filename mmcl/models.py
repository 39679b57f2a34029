"""Image and text towers, built with open_clip from a plain model-config dict.

A model config is open_clip's own dict (``embed_dim``, ``vision_cfg``, ``text_cfg``, ...). Named configs are
data: ``mmcl/model_configs/*.json`` first, then any architecture open_clip ships (ViT, ResNet, timm ConvNeXt, ...).
A Hugging Face text tower (``model.text.hf``) goes through open_clip's ``hf_model_name`` support.

A saved model directory is open_clip's local-dir layout (``open_clip_config.json`` + ``open_clip_model.safetensors``),
so open_clip, CLIP_benchmark and `mmcl.load` all read the same files. With a Hugging Face text tower the directory
also holds that tower's ``config.json`` and tokenizer files, so it loads after the source checkpoint is gone.

Locking follows LiT (Zhai et al. 2022): a locked tower's parameters get ``requires_grad=False`` (so no optimiser
state), and a tower whose backbone is entirely locked runs that backbone under ``torch.no_grad`` in eval mode:
no activations are kept for backward, dropout is off and normalisation statistics do not move.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import os
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import hf_clip
from .config import ModelConfig
from .errors import CheckpointError, ConfigError
from .fsutil import atomic_dir, files_under, output_dir

CONFIG_DIR = Path(__file__).parent / "model_configs"
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
HF_CONFIG_FILE = "config.json"  # a Hugging Face tower's own config, kept beside the weights
# 'cls' is the [CLS] token's last hidden state; open_clip's 'cls_pooler' would instead use BERT's pooler head
# (dense + tanh trained for next-sentence prediction), an extra layer that many sentence encoders never trained.
_HF_POOLERS = {"mean": "mean_pooler", "cls": "cls_last_hidden_state_pooler", "max": "max_pooler"}
# Weight files of a local directory, most preferred first (open_clip's names, then transformers').
_DIR_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
                "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


# ------------------------------------------------------------------------------------------------ configs
def available_models() -> List[str]:
    """mmcl model-config names followed by every open_clip architecture name."""
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
        hint = f"; did you mean {', '.join(close)}?" if close else "; see mmcl.models.available_models()"
        raise ConfigError(f"unknown model.name '{name}'{hint}")
    return copy.deepcopy(cfg)


def _is_local(name_or_path: str) -> bool:
    return os.path.isdir(os.path.expanduser(name_or_path))


def resolve_model_config(cfg: ModelConfig) -> Dict[str, Any]:
    """Apply the ``model.*`` overrides to the named config; returns a new open_clip model-config dict."""
    model_cfg = named_config(cfg.name)
    model_cfg.setdefault("vision_cfg", {}).update(copy.deepcopy(cfg.vision_cfg))
    text_cfg = model_cfg.setdefault("text_cfg", {})
    if cfg.text.hf:
        # A Hugging Face text tower replaces open_clip's text transformer; open_clip's CustomTextCLIP runs it.
        for key in ("width", "heads", "layers", "vocab_size", "mlp_ratio", "ls_init_value", "output_tokens",
                    "pool_type", "proj_type", "proj_bias", "embed_cls", "no_causal_mask", "pad_id", "eos_id",
                    "hf_model_pretrained"):
            text_cfg.pop(key, None)
        # A local directory is stored absolute so a resumed run or a saved config works from any directory.
        source = os.path.abspath(os.path.expanduser(cfg.text.hf)) if _is_local(cfg.text.hf) else cfg.text.hf
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


# ------------------------------------------------------------------------------------------------- models
class MaskedMaxPooler(nn.Module):
    """Max over the real (non-padding) tokens of a Hugging Face tower's last hidden state.

    open_clip's ``MaxPooler`` fills the *kept* positions with -inf (and passes an integer mask to ``masked_fill``),
    so it cannot be used; this module has no parameters, so state dicts are unchanged by the swap.
    """

    cls_token_position = 0

    def forward(self, x, attention_mask: torch.Tensor) -> torch.Tensor:
        """x.last_hidden_state (B, L, W) float, attention_mask (B, L) 0/1 -> (B, W)."""
        hidden = x.last_hidden_state
        pad = attention_mask.unsqueeze(-1) == 0  # (B, L, 1)
        return hidden.masked_fill(pad, torch.finfo(hidden.dtype).min).max(dim=1).values


@functools.lru_cache(maxsize=None)
def _clip_class():
    """open_clip's CLIP whose text tower, in training, skips the padding after the longest caption of a batch.

    With a causal attention mask and pooling at the end-of-text token (the highest token id, open_clip's
    ``argmax`` pooling), no position sees the positions after it, so the tokens after the last end-of-text token
    of a batch cannot change any output: running the text transformer on the batch cut there is exact, and
    captions are usually far shorter than the context length. Anything else runs open_clip's code unchanged.
    """
    from open_clip.model import CLIP

    class ShortTextCLIP(CLIP):
        def encode_text(self, text, normalize: bool = False):
            full = self.positional_embedding.shape[0]
            # Only while training: evaluation and exports keep open_clip's exact full-context numbers, and a traced
            # graph (ONNX, TorchScript) must not bake in a data-dependent cut.
            tracing = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
            if (tracing or not self.training or self.attn_mask is None or self.text_pool_type != "argmax"
                    or text.shape[1] != full):
                return super().encode_text(text, normalize=normalize)
            eot = text.argmax(dim=-1)  # (B,)
            n = int(eot.max()) + 1
            if n >= full:
                return super().encode_text(text, normalize=normalize)
            cast_dtype = self.transformer.get_cast_dtype()
            x = self.token_embedding(text[:, :n]).to(cast_dtype) + self.positional_embedding[:n].to(cast_dtype)
            x = self.ln_final(self.transformer(x, attn_mask=self.attn_mask[:n, :n]))
            x = x[torch.arange(x.shape[0], device=x.device), eot]  # (B, width)
            if self.text_projection is not None:
                x = self.text_projection(x) if isinstance(self.text_projection, nn.Linear) else x @ self.text_projection
            return F.normalize(x, dim=-1) if normalize else x

    return ShortTextCLIP


def create(model_cfg: Dict[str, Any]) -> nn.Module:
    """Instantiate an open_clip CLIP / CustomTextCLIP from a model-config dict (fp32, ``output_dict=True``).

    Weights are random except a Hugging Face text tower, which is read from its directory / the local
    Hugging Face cache unless ``text_cfg.hf_model_pretrained`` is False.
    """
    from open_clip.model import CustomTextCLIP

    model_cfg = copy.deepcopy(model_cfg)
    text_cfg = model_cfg.get("text_cfg", {})
    hf_name = text_cfg.get("hf_model_name")
    custom_text = model_cfg.pop("custom_text", False) or bool(hf_name)
    if hf_name:
        text_cfg.setdefault("hf_model_pretrained", True)
    model_cls = CustomTextCLIP if custom_text else _clip_class()
    added = _register_hf_arch(hf_name) if hf_name else None
    try:
        model = model_cls(**model_cfg)
    except TypeError as err:
        raise ConfigError(f"invalid model config: {err}") from None
    except OSError as err:  # transformers cannot find the tower (offline, wrong path)
        raise ConfigError(f"cannot load the Hugging Face text tower '{hf_name}' (not a local directory with "
                          f"config.json and weights, nor in the local Hugging Face cache): "
                          f"{str(err).splitlines()[0]}") from None
    except RuntimeError as err:  # e.g. timm: unknown model name
        raise ConfigError(f"invalid model config: {str(err).splitlines()[0]}") from None
    finally:
        if added is not None:  # open_clip reads the entry only while building the tower
            from open_clip.hf_configs import arch_dict

            arch_dict.pop(added, None)
    if hf_name:
        _check_hf_tower(model.text, model_cfg)
    model.output_dict = True
    return model


def _register_hf_arch(hf_name: str) -> Optional[str]:
    """Let open_clip's HFTextEncoder size the projection of model types its table lacks (e.g. MPNet).

    open_clip reads the tower width from ``arch_dict[model_type]`` while it builds the tower; an entry naming
    the config attribute that holds the width is added for the build, and its key returned so that `create`
    removes it again (open_clip's table is left as it was). Known types are left as open_clip defines them.
    """
    from open_clip.hf_configs import arch_dict
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(hf_name)
    except (OSError, ValueError):
        return None  # create() reports the unreadable tower
    if config.model_type in arch_dict:
        return None
    width = next((a for a in ("hidden_size", "d_model", "dim", "n_embd") if hasattr(config, a)), None)
    if width is None:
        raise ConfigError(f"cannot find the width of Hugging Face model type '{config.model_type}' "
                          f"(expected one of hidden_size, d_model, dim in its config)")
    arch_dict[config.model_type] = {"config_names": {"width": width}, "pooler": "mean_pooler"}
    return config.model_type


def _check_hf_tower(text: nn.Module, model_cfg: Dict[str, Any]) -> None:
    if not hasattr(text, "proj"):
        # open_clip leaves the projection unset when it is 'none' but the widths differ.
        width = getattr(text.config, "hidden_size", "?")
        raise ConfigError(f"model.text.projection=none needs model.embed_dim equal to the text tower's width "
                          f"(got embed_dim {model_cfg['embed_dim']}, expected {width})")
    if model_cfg["text_cfg"].get("hf_pooler_type") == "max_pooler":
        text.pooler = MaskedMaxPooler()
    context_length = model_cfg["text_cfg"].get("context_length", 77)
    max_positions = getattr(text.config, "max_position_embeddings", None)
    if max_positions and context_length > max_positions:
        raise ConfigError(f"model.context_length {context_length} exceeds the text tower's "
                          f"max_position_embeddings (got {context_length}, expected <= {max_positions})")


def preprocess_config(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """open_clip PreprocessCfg fields (size, mean, std, interpolation, resize_mode) for a model config."""
    from open_clip.transform import PreprocessCfg

    size = model_cfg["vision_cfg"].get("image_size", 224)
    pp = dataclasses.asdict(PreprocessCfg(size=size))
    pp.update(model_cfg.get("preprocess_cfg", {}))
    return pp


def build_transforms(preprocess_cfg: Dict[str, Any]):
    """(train transform, eval transform) from open_clip: PIL image -> (3, H, W) float tensor."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    pp = PreprocessCfg(**{k: v for k, v in preprocess_cfg.items() if k in PreprocessCfg.__dataclass_fields__})
    return image_transform_v2(pp, is_train=True), image_transform_v2(pp, is_train=False)


def build_tokenizer(model_cfg: Dict[str, Any], source_dir: Optional[str] = None):
    """open_clip's tokenizer for the text tower: BPE SimpleTokenizer, or the Hugging Face tower's own.

    The returned callable maps a list of B strings to a (B, context_length) long tensor.
    """
    from open_clip.tokenizer import HFTokenizer, SimpleTokenizer

    text_cfg = model_cfg.get("text_cfg", {})
    context_length = text_cfg.get("context_length", 77)
    hf_name = text_cfg.get("hf_tokenizer_name")
    if hf_name:
        if source_dir and (Path(source_dir) / "tokenizer_config.json").is_file():
            hf_name = source_dir
        try:
            return HFTokenizer(hf_name, context_length=context_length)
        except OSError as err:
            raise ConfigError(f"cannot load the tokenizer '{hf_name}' (not a local directory with tokenizer "
                              f"files, nor in the local Hugging Face cache): {str(err).splitlines()[0]}") from None
    return SimpleTokenizer(context_length=context_length)


def build(cfg: ModelConfig):
    """Model, its config dict, preprocess config, train/eval transforms and tokenizer for a `ModelConfig`.

    Returns ``(model, model_cfg, preprocess_cfg, train_transform, eval_transform, tokenizer)``.
    """
    model_cfg = resolve_model_config(cfg)
    model = create(model_cfg)
    pp = preprocess_config(model_cfg)
    train_tf, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model, model_cfg, pp, train_tf, eval_tf, tokenizer


# ------------------------------------------------------------------------------------------------ locking
def _clip_text_modules(model: nn.Module) -> List[nn.Module]:
    # open_clip's CLIP class keeps its text transformer's parts as attributes of the model itself.
    return [model.token_embedding, model.transformer, model.ln_final]


def _clip_text_params(model: nn.Module) -> List[nn.Parameter]:
    params = [p for m in _clip_text_modules(model) for p in m.parameters()] + [model.positional_embedding]
    if isinstance(model.text_projection, nn.Parameter):
        params.append(model.text_projection)
    elif model.text_projection is not None:
        params += list(model.text_projection.parameters())
    return params


def _all_frozen(params) -> bool:
    params = list(params)
    return bool(params) and not any(p.requires_grad for p in params)


def _run_frozen(owner: Any, method: str, modules: Callable[[Any], List[nn.Module]]) -> None:
    """Make ``owner.<method>`` run under ``torch.no_grad`` with ``modules(owner)`` in eval mode.

    An instance attribute wraps the class's method; it is a bound method, so ``copy.deepcopy`` rebinds it to the
    copy, and the state dict is unchanged.
    """
    original = getattr(type(owner), method)

    def frozen(self, *args, **kwargs):
        for module in modules(self):
            module.eval()
        with torch.no_grad():
            return original(self, *args, **kwargs)

    setattr(owner, method, types.MethodType(frozen, owner))


def is_frozen_call(owner: Any, method: str = "forward") -> bool:
    """Whether `apply_locks` made ``owner.<method>`` run without autograd."""
    bound = owner.__dict__.get(method)
    return isinstance(bound, types.MethodType) and bound.__func__.__name__ == "frozen"


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
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.transformer import lock_text_tower

    if cfg.lock_image:
        groups = cfg.lock_image_unlocked_groups
        if groups < 0:
            raise ConfigError(f"model.lock_image_unlocked_groups must be >= 0 (got {groups})")
        if groups and isinstance(model.visual, ModifiedResNet):
            raise ConfigError(f"model.lock_image_unlocked_groups must be 0 for ResNet image towers "
                              f"(got {groups}; open_clip locks them only whole)")
        model.lock_image_tower(groups, cfg.lock_image_freeze_bn_stats)
        if _all_frozen(model.visual.parameters()):
            _run_frozen(model.visual, "forward", lambda v: [v])
        elif _all_frozen(getattr(model.visual, "trunk", nn.Module()).parameters()):
            # A timm tower locks its trunk and keeps the projection head trainable.
            _run_frozen(model.visual.trunk, "forward", lambda t: [t])
    if cfg.lock_text:
        layers = cfg.lock_text_unlocked_layers
        if layers < 0:
            raise ConfigError(f"model.lock_text_unlocked_layers must be >= 0 (got {layers})")
        freeze_ln = cfg.lock_text_freeze_layer_norm
        text = getattr(model, "text", None)
        if text is None:  # open_clip CLIP: text parts live on the model
            lock_text_tower(model, layers)
            if not freeze_ln:
                _unfreeze_layer_norms(_clip_text_modules(model))
            if _all_frozen(_clip_text_params(model)):
                _run_frozen(model, "encode_text", _clip_text_modules)
        elif hasattr(text, "transformer") and hasattr(text, "config"):  # Hugging Face tower
            _lock_hf_backbone(text.transformer, layers, freeze_ln)
            if _all_frozen(text.parameters()):
                _run_frozen(text, "forward", lambda t: [t])
            elif _all_frozen(text.transformer.parameters()):
                # The backbone is locked, the projection head trains: only the backbone runs without autograd.
                _run_frozen(text.transformer, "forward", lambda t: [t])
        else:  # open_clip TextTransformer inside CustomTextCLIP
            lock_text_tower(text, layers)
            if not freeze_ln:
                _unfreeze_layer_norms([text])
            if _all_frozen(text.parameters()):
                _run_frozen(text, "forward", lambda t: [t])


# ------------------------------------------------------------------------------------------- saving/loading
def _state_dict_for_saving(model: nn.Module) -> Dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings of some Hugging Face towers): clone them.
    seen, out = {}, {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        out[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen[ptr] = key
    return out


def _save_hf_text_files(model: nn.Module, text_cfg: Dict[str, Any], dest: Path) -> None:
    """The Hugging Face tower's config.json (from the live model) and its tokenizer files, written into `dest`."""
    from transformers import AutoTokenizer

    model.text.config.to_json_file(str(dest / HF_CONFIG_FILE))
    source = text_cfg.get("hf_tokenizer_name") or text_cfg["hf_model_name"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise CheckpointError(f"cannot save the text tower's tokenizer: '{source}' is not readable "
                              f"({str(err).splitlines()[0]})") from None
    tokenizer.save_pretrained(str(dest))


# Names of the files a saved model or an export may hold besides the config and weights: a Hugging Face text
# tower's config and tokenizer files. Used to tell mmcl's files from the user's in a directory written before
# mmcl recorded the list of its files.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "special_tokens", "merges", "spiece", "sentencepiece",
                           "added_tokens")


def is_model_file_name(name: str) -> bool:
    """Whether a file of this name is one a model directory written by mmcl holds."""
    return name in (CONFIG_FILE, WEIGHTS_FILE, HF_CONFIG_FILE) or name.startswith(TOKENIZER_FILE_PREFIXES)


def previous_files(out_dir: Path, listing_file: str, default: Callable[[str], bool]) -> List[str]:
    """The files mmcl wrote in `out_dir` before: the ``files`` list of the JSON `listing_file` there (its
    ``mmcl`` section or top level), else the top-level files whose name `default` accepts."""
    listing = out_dir / listing_file
    try:
        meta = json.loads(listing.read_text(encoding="utf-8"))
        files = (meta.get("mmcl") or {}).get("files") or meta.get("files")
        if isinstance(files, list) and all(isinstance(f, str) for f in files):
            return list(files) + [listing_file]
    except (OSError, ValueError, AttributeError):
        pass  # no listing (an older or damaged directory): go by the names mmcl writes
    if not out_dir.is_dir():
        return []
    return [n for n in os.listdir(out_dir) if (out_dir / n).is_file() and default(n)]


def write_config_with_record(out: Path, meta: Dict[str, Any], config_name: str = CONFIG_FILE,
                             weights_name: str = WEIGHTS_FILE) -> None:
    """Write the config JSON into the directory `out` with, in its ``mmcl`` section, the size and SHA-256 of the
    weights file (checked by `load_model_dir`) and the list of the files mmcl wrote there (so that a later write
    replaces only those and keeps the user's)."""
    meta = dict(meta)
    extra = dict(meta.get("mmcl") or {})
    extra["weights"] = weights_record(out / weights_name)
    extra["files"] = sorted(files_under(out) | {config_name})
    meta["mmcl"] = extra
    (out / config_name).write_text(json.dumps(meta, indent=2) + "\n")


def save_model_dir(model: nn.Module, model_cfg: Dict[str, Any], preprocess_cfg: Dict[str, Any], out_dir,
                   extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write open_clip's local-dir layout atomically: a temp dir beside `out_dir`, then a rename.

    With a Hugging Face text tower, its ``config.json`` and tokenizer files are written too, and when the tower
    came from a local directory the saved ``hf_model_name`` points at `out_dir` itself, so neither mmcl nor
    open_clip (``local-dir:``) needs the original directory. A hub name is kept as it is. The config records the
    weights' size and SHA-256 and the files written; files the user added to an earlier `out_dir` are kept.
    Raises `CheckpointError` when the directory cannot be written (read-only, disk full), naming the cause.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out_dir = output_dir(out_dir)
    model_cfg = copy.deepcopy(model_cfg)
    text_cfg = model_cfg.get("text_cfg", {})
    meta_extra = dict(extra or {})
    try:
        with atomic_dir(out_dir, previous_files(out_dir, CONFIG_FILE, is_model_file_name)) as tmp:
            save_file(_state_dict_for_saving(model), str(tmp / WEIGHTS_FILE))
            if text_cfg.get("hf_model_name"):
                _save_hf_text_files(model, text_cfg, tmp)
                text_cfg.pop("hf_model_pretrained", None)
                meta_extra.setdefault("text_source", text_cfg["hf_model_name"])
                if _is_local(text_cfg["hf_model_name"]):
                    text_cfg["hf_model_name"] = text_cfg["hf_tokenizer_name"] = str(out_dir.resolve())
            meta = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
            if meta_extra:
                meta["mmcl"] = meta_extra
            write_config_with_record(tmp, meta)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"cannot save the model to {out_dir}: {os_error_text(err)}") from None
    return out_dir


def os_error_text(err: Exception) -> str:
    """'No space left on device (/path)' from an OSError (safetensors' own errors give their message)."""
    strerror, filename = getattr(err, "strerror", None), getattr(err, "filename", None)
    if strerror:
        return f"{strerror} ({filename})" if filename else strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__


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


def weights_record(weights: Path) -> Dict[str, Any]:
    """Size and SHA-256 of a weights file, kept in the config file beside it so that damage is found at load."""
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"file": weights.name, "size": weights.stat().st_size, "sha256": digest.hexdigest()}


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is damaged ({what}); save, export or copy the model again")


def read_json_file(path: Path, error: Callable[[str], Exception] = CheckpointError) -> Any:
    """A JSON file's content; a truncated, non-UTF-8 or unreadable file raises `error` naming it and the cause."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise error(f"{path} is damaged (not valid JSON: {err.msg} at line {err.lineno} column {err.colno})"
                    ) from None
    except UnicodeDecodeError:
        raise error(f"{path} is damaged (not UTF-8 text)") from None
    except OSError as err:
        raise error(f"cannot read {path} ({os_error_text(err)})") from None


def _read_model_meta(model_dir: Path) -> Dict[str, Any]:
    """The parsed ``open_clip_config.json`` of a model directory, checked for the fields loading needs."""
    config = model_dir / CONFIG_FILE
    meta = read_json_file(config)
    if not isinstance(meta, dict):
        raise _damaged(config, f"expected a JSON object, got {type(meta).__name__}")
    model_cfg = meta.get("model_cfg", meta)
    problems = [] if isinstance(model_cfg, dict) else [f"model_cfg is a {type(model_cfg).__name__}"]
    if not problems:
        problems += [f"no {key}" for key in ("embed_dim", "vision_cfg", "text_cfg") if key not in model_cfg]
        problems += [f"{key} is not an object" for key in ("vision_cfg", "text_cfg")
                     if key in model_cfg and not isinstance(model_cfg[key], dict)]
    pp = meta.get("preprocess_cfg")
    if pp is not None and not isinstance(pp, dict):
        problems.append(f"preprocess_cfg is a {type(pp).__name__}")
    if problems:
        raise _damaged(config, f"expected an open_clip model config: {', '.join(problems)}")
    return meta


def _check_weights_record(weights: Path, meta: Dict[str, Any]) -> None:
    """Compare the weights file with the size and SHA-256 recorded when it was written (models saved without a
    record are loaded unchecked)."""
    mmcl_meta = meta.get("mmcl")
    record = mmcl_meta.get("weights") if isinstance(mmcl_meta, dict) else None
    if not isinstance(record, dict) or record.get("file") != weights.name:
        return
    size = weights.stat().st_size
    if record.get("size") is not None and size != record["size"]:
        cut = "truncated" if size < record["size"] else "longer than written"
        raise _damaged(weights, f"{size} bytes, {record['size']} were written: {cut}")
    if record.get("sha256") and weights_record(weights)["sha256"] != record["sha256"]:
        raise _damaged(weights, "its SHA-256 differs from the one recorded when it was written")


def _fit_state(model: nn.Module, state: Dict[str, torch.Tensor], weights: Path, config: Path) -> None:
    """Load `state` strictly; a mismatch is a `CheckpointError` naming missing, unexpected and misshapen keys."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    shapes = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_preview(missing, 3)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_preview(unexpected, 3)})")
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} of another shape (e.g. {k}: {tuple(state[k].shape)} in the file, "
                         f"{tuple(own[k].shape)} by the config)")
        raise CheckpointError(f"weights in {weights} do not fit {config.name}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def load_model_dir(path) -> Tuple[nn.Module, Dict[str, Any], Dict[str, Any]]:
    """Load a saved model directory: (model in eval mode, model_cfg, preprocess_cfg).

    A Hugging Face text tower is rebuilt from the ``config.json`` saved in the directory (no download, no
    reference to where it first came from); the returned model_cfg then names the directory as its source.
    A missing, truncated or altered file (config, weights; checked against the size and SHA-256 recorded when
    mmcl wrote them) and weights that do not fit the config are `CheckpointError` naming the file and the cause.
    """
    model_dir = find_model_dir(path)
    config = model_dir / CONFIG_FILE
    meta = _read_model_meta(model_dir)
    model_cfg = copy.deepcopy(meta.get("model_cfg", meta))
    text_cfg = model_cfg.get("text_cfg", {})
    if text_cfg.get("hf_model_name"):
        if (model_dir / HF_CONFIG_FILE).is_file():
            text_cfg["hf_model_name"] = str(model_dir.resolve())
            if (model_dir / "tokenizer_config.json").is_file():
                text_cfg["hf_tokenizer_name"] = str(model_dir.resolve())
        text_cfg.pop("hf_model_pretrained", None)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{model_dir} has {CONFIG_FILE} but no {WEIGHTS_FILE} (an incomplete copy?)")
    _check_weights_record(weights, meta)
    cfg_for_create = copy.deepcopy(model_cfg)
    if text_cfg.get("hf_model_name"):
        cfg_for_create["text_cfg"]["hf_model_pretrained"] = False  # weights come from our file
    try:
        model = create(cfg_for_create)
        pp = meta.get("preprocess_cfg") or preprocess_config(model_cfg)
    except (ConfigError, TypeError, ValueError, KeyError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot build the model {config} describes: {detail}") from None
    _fit_state(model, _read_weight_file(weights), weights, config)
    model.eval()
    return model, model_cfg, pp


def load(path):
    """``model, preprocess, tokenizer = mmcl.load(path)`` for a run dir, its ``model/``, or an export.

    ``model.encode_image(images (B,3,H,W) float)`` / ``model.encode_text(tokens (B,L) long)`` give (B, D)
    features (pass ``normalize=True`` for unit vectors); ``model.logit_scale`` is log s.
    """
    model, model_cfg, pp = load_model_dir(path)
    _, eval_tf = build_transforms(pp)
    tokenizer = build_tokenizer(model_cfg, source_dir=str(find_model_dir(path)))
    return model, eval_tf, tokenizer


# ------------------------------------------------------------------------------------------------ init_from
def _read_weight_file(path: Path) -> Dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for bad headers
            raise _damaged(path, f"not a readable safetensors file: {str(err).splitlines()[0]}") from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise CheckpointError(f"cannot read {path} as a weights-only torch checkpoint: "
                              f"{str(err).splitlines()[0]}") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "module"):  # open_clip_train, and other trainers' wrappers
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} holds no state dict (expected a dict of tensors, or one under 'state_dict')")
    return obj


def _latest_train_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest training checkpoint of `run_dir` whose weights file matches its recorded size and checksum."""
    from .checkpoints import newest_verified_checkpoint

    return newest_verified_checkpoint(run_dir / "checkpoints", only=("model.safetensors",))


def read_checkpoint(path) -> Tuple[Dict[str, torch.Tensor], str]:
    """Weights from any supported source, in open_clip key layout; returns (state_dict, description).

    Sources: a file (.pt/.pth/.bin torch checkpoint, open_clip_train's ``{'state_dict': ...}`` included, or
    .safetensors); an open_clip local-dir / mmcl export / mmcl run (its ``model/``, else its latest training
    checkpoint); a transformers CLIP directory (``config.json`` with model_type clip).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"init_from path not found: {path}")
    if path.is_file():
        state, what = _read_weight_file(path), f"{path.suffix.lstrip('.')} file"
    else:
        weights_dir, what = None, ""
        for candidate, label in ((path, "open_clip/mmcl model dir"), (path / "model", "mmcl run"),
                                 (path / "open_clip", "mmcl export")):
            if (candidate / CONFIG_FILE).is_file():
                weights_dir, what = candidate, label
                break
        hf_config = path / HF_CONFIG_FILE
        if weights_dir is None and hf_config.is_file():
            hf_meta = read_json_file(hf_config)
            model_type = hf_meta.get("model_type") if isinstance(hf_meta, dict) else None
            if model_type != "clip":
                raise CheckpointError(f"{path} is a Hugging Face '{model_type}' model, not CLIP (expected "
                                      f"model_type 'clip', or an open_clip/mmcl model directory)")
            weights_dir, what = path, "transformers CLIP dir"
        if weights_dir is None and (ckpt := _latest_train_checkpoint(path)) is not None:
            weights_dir, what = ckpt, "mmcl training checkpoint"
        if weights_dir is None:
            raise CheckpointError(f"no weights found in {path} (expected {CONFIG_FILE}, a model/ subdirectory, "
                                  f"checkpoints/latest, or a transformers CLIP config.json)")
        files = [weights_dir / name for name in _DIR_WEIGHTS if (weights_dir / name).is_file()]
        if not files:
            raise CheckpointError(f"{weights_dir} has no weights file (expected one of {', '.join(_DIR_WEIGHTS)})")
        state = _read_weight_file(files[0])
        what = f"{what}, {files[0].name}"
    for prefix in ("module.", "_orig_mod."):  # DDP and torch.compile wrappers
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    if any(k.startswith(("vision_model.", "text_model.")) for k in state):
        state, what = hf_clip.from_hf(state), f"{what}, transformers CLIP layout mapped to open_clip"
    return state, what


def _adapt_to_model(state: Dict[str, torch.Tensor], model: nn.Module) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """open_clip's layout fixes: CLIP -> CustomTextCLIP text keys, scalar vs 1-d scale, resized position grids."""
    from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed

    notes = []
    state = dict(state)
    if "positional_embedding" in state and not hasattr(model, "positional_embedding"):
        state = convert_to_custom_text_state_dict(state)
    for key in ("logit_scale", "logit_bias"):
        target = getattr(model, key, None)
        if key in state and target is not None and state[key].numel() == target.numel():
            state[key] = state[key].reshape(target.shape)
    own = model.state_dict()
    for key, label, resize in (("visual.positional_embedding", "image position grid", resize_pos_embed),
                               ("positional_embedding", "text positions", resize_text_pos_embed),
                               ("text.positional_embedding", "text positions", resize_text_pos_embed)):
        if key in state and key in own and state[key].shape != own[key].shape \
                and state[key].shape[-1] == own[key].shape[-1]:
            before = tuple(state[key].shape)
            resize(state, model)
            notes.append(f"resized {label} {before} -> {tuple(state[key].shape)}")
    return state, notes


def _hf_activation_note(path: Path, model: nn.Module) -> Optional[str]:
    from open_clip.transformer import QuickGELU

    cfg_file = path / HF_CONFIG_FILE if path.is_dir() else None
    if cfg_file is None or not cfg_file.is_file():
        return None
    hf_meta = read_json_file(cfg_file)
    vision = (hf_meta.get("vision_config") if isinstance(hf_meta, dict) else None) or {}
    quick = vision.get("hidden_act") == "quick_gelu"
    has_quick = any(isinstance(m, QuickGELU) for m in model.modules())
    if quick != has_quick:
        want = "a -quickgelu architecture" if quick else "an architecture without quick_gelu"
        return f"WARNING: the checkpoint uses {vision.get('hidden_act')}, the model does not match (pick {want})"
    return None


def _preview(keys: List[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f", ... (+{len(keys) - n})" if len(keys) > n else "")


def init_from(model: nn.Module, path) -> str:
    """Load pretrained weights into `model` in place; returns a one-paragraph report.

    `path`: an open_clip checkpoint (.pt/.pth/.bin/.safetensors, or an open_clip_train ``epoch_N.pt``), an open_clip
    local-dir, an mmcl run directory or export, or a transformers CLIP directory. Keys the model lacks are
    reported as unexpected, model keys the checkpoint lacks keep their current values and are reported as
    missing. A tensor whose shape differs from the model's raises `CheckpointError` (position grids are resized
    as open_clip does).
    """
    state, what = read_checkpoint(path)
    state, notes = _adapt_to_model(state, model)
    own = model.state_dict()
    mismatched = [k for k in state if k in own and state[k].shape != own[k].shape]
    if mismatched:
        k = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError(f"init_from {path}: {k} has shape {tuple(state[k].shape)} in the checkpoint, "
                              f"expected {tuple(own[k].shape)} by the model{more}; check model.name and the "
                              f"model.* overrides")
    matched = {k: v for k, v in state.items() if k in own}
    if not matched:
        raise CheckpointError(f"init_from {path}: none of its {len(state)} tensors matches a model key "
                              f"(got e.g. {_preview(sorted(state), 3)}; expected e.g. {_preview(sorted(own), 3)})")
    model.load_state_dict(matched, strict=False)
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    parts = [f"init_from {path} ({what}): loaded {len(matched)}/{len(own)} tensors"]
    parts.append(f"missing {len(missing)}" + (f": {_preview(missing)}" if missing else ""))
    parts.append(f"unexpected {len(unexpected)}" + (f": {_preview(unexpected)}" if unexpected else ""))
    parts += notes
    note = _hf_activation_note(Path(path), model)
    if note:
        parts.append(note)
    return "; ".join(parts)
