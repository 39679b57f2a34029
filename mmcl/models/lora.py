"""LoRA fine-tuning (Hu et al. 2021, ``model.lora``) with peft, the LoRA implementation transformers users load
adapters with.

`apply_lora` injects peft's LoRA layers into the chosen towers of an open_clip model in place
(``peft.inject_adapter_in_model``): the model keeps its class and forward, and every weight but the adapters (and the
learned logit scale and bias) is frozen. The default targets are open_clip's attention, an ``nn.MultiheadAttention``
whose packed q/k/v projection is a raw parameter that peft's ``MultiheadAttention`` layer adapts (its ``out_proj``
adapter is held at zero: peft 0.21 applies that one twice), and the MLP's ``c_fc`` and ``c_proj``. The wrapped
model's state dict holds the base weights under peft's ``base_layer`` names and the adapters beside them: that is what
training checkpoints hold, so a resume is exact.

`merged` gives the plain model (adapters folded into the weights, peft's wrappers gone, the state dict keys of a
model that never had adapters): what ``model/`` holds and the final evaluation runs. `merge_state` does the same on a
checkpoint's state dict without peft, so a checkpoint reads as a model. `adapter_state` and `save_adapters` give the
adapters alone in peft's own format (``adapter_model.safetensors`` and ``adapter_config.json``).
"""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import ConfigError

ADAPTER = "default"  # peft's adapter name: the only one mmcl trains
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names (`PeftModel.save_pretrained`)
ADAPTER_CONFIG = "adapter_config.json"
_KEPT_TRAINABLE = ("logit_scale", "logit_bias")  # the temperature and SigLIP's bias train beside the adapters
_STASH = "_mmcl_lora_weights"


def settings(lora_cfg) -> Dict[str, Any]:
    """``model.lora`` as plain data: what a checkpoint's ``model_config.json`` records under ``lora``."""
    return {"r": int(lora_cfg.r), "alpha": float(lora_cfg.alpha), "dropout": float(lora_cfg.dropout),
            "target_modules": list(lora_cfg.target_modules), "towers": list(lora_cfg.towers)}


def _as_cfg(lora_cfg):
    return types.SimpleNamespace(**lora_cfg) if isinstance(lora_cfg, Mapping) else lora_cfg


def towers(model: nn.Module) -> Dict[str, Tuple[str, nn.Module]]:
    """Each tower's (name prefix in the model, module): the image tower is ``visual``; the text tower is ``text``
    (CustomTextCLIP) or, where open_clip's CLIP keeps its text parts on the model, its ``transformer``."""
    text = ("text", model.text) if isinstance(getattr(model, "text", None), nn.Module) else (
        "transformer", getattr(model, "transformer", None))
    return {"image": ("visual", getattr(model, "visual", None)), "text": text}


def _adaptable(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return module._qkv_same_embed_dim  # peft adapts only a packed q/k/v projection (not a cross-attention pooler)
    return isinstance(module, nn.Linear)


def _matches(name: str, targets: List[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)  # peft's rule for a list of names


def target_names(model: nn.Module, lora_cfg) -> List[str]:
    """The full names of the layers that get adapters: each tower's ``nn.Linear`` and ``nn.MultiheadAttention``
    layers whose name or name suffix is in ``target_modules``. A tower where none matches, or a target that is an
    attention's ``out_proj`` (its forward is never called, so peft's adapter there would never act), is one
    `ConfigError`."""
    lora_cfg = _as_cfg(lora_cfg)
    targets, found = list(lora_cfg.target_modules), []
    for tower in lora_cfg.towers:
        prefix, module = towers(model)[tower]
        if module is None:
            raise ConfigError(f"model.lora.towers names the {tower} tower, which this model does not have")
        mine = []
        for name, sub in module.named_modules():
            if name and _matches(name, targets) and _adaptable(sub):
                parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
                if isinstance(parent, nn.MultiheadAttention):
                    raise ConfigError(f"model.lora.target_modules: {prefix}.{name} is the out_proj of an "
                                      f"nn.MultiheadAttention, whose forward never calls it: target the attention "
                                      f"itself ({name.rpartition('.')[0].rpartition('.')[2]}), which adapts its "
                                      f"in_proj and out_proj together")
                mine.append(f"{prefix}.{name}")
        if not mine:
            names = sorted({n.rpartition(".")[2] for n, m in module.named_modules() if n and _adaptable(m)})
            raise ConfigError(f"model.lora.target_modules ({', '.join(targets)}) match no layer of the {tower} tower "
                              f"({type(module).__name__}); its linear and attention layers are named "
                              f"{', '.join(names[:8]) or 'nothing adaptable'}")
        found += mine
    return found


def peft_config(lora_cfg, targets: List[str]):
    """peft's ``LoraConfig`` for `lora_cfg` on the layers `targets` (full names), given as one regular expression
    that peft matches against whole names: a list would match by suffix, and the text tower's
    ``transformer.resblocks.0.attn`` is also a suffix of the image tower's."""
    import peft

    lora_cfg = _as_cfg(lora_cfg)
    return peft.LoraConfig(r=int(lora_cfg.r), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                           target_modules="|".join(re.escape(t) for t in targets), bias="none")


def _stash_weights(layer: nn.Module, args) -> None:
    """Before peft's attention layer folds its adapter into the base weights for a forward, keep the base weights."""
    base = layer.get_base_layer()
    setattr(layer, _STASH, (base.in_proj_weight, base.out_proj.get_base_layer().weight))


def _restore_weights(layer: nn.Module, args, output) -> None:
    """After the forward, put the kept base weights back. peft takes the adapter's update out again by subtraction,
    and (w + d) - d is not w in floating point: without this the frozen weights would drift a little each forward."""
    kept = layer.__dict__.pop(_STASH, None)
    if kept is None:
        return
    base = layer.get_base_layer()
    for owner, name, weight in ((base, "in_proj_weight", kept[0]), (base.out_proj.get_base_layer(), "weight", kept[1])):
        delattr(owner, name)
        owner.register_parameter(name, weight)


def apply_lora(model: nn.Module, lora_cfg) -> str:
    """Give `model`'s chosen towers peft's LoRA adapters (in place) and freeze every other weight, keeping the logit
    scale and bias trainable where they were. Returns one line: the adapted layers and the trainable parameters."""
    try:
        import peft
        from peft.tuners.lora.layer import MultiheadAttention as LoraAttention
    except ImportError as err:
        raise ConfigError(f"model.lora needs peft (pip install 'peft>=0.21,<0.22', or mmcl's lora extra): {err}") \
            from None

    lora_cfg = _as_cfg(lora_cfg)
    targets = target_names(model, lora_cfg)
    kept = [p for n, p in model.named_parameters() if n.split(".")[0] in _KEPT_TRAINABLE and p.requires_grad]
    model.requires_grad_(False)
    peft.inject_adapter_in_model(peft_config(lora_cfg, targets), model, adapter_name=ADAPTER)
    for p in kept:
        p.requires_grad_(True)
    for module in model.modules():
        if isinstance(module, LoraAttention):
            # peft 0.21 adds the out_proj adapter's update twice in the forward and the merge, but once in the
            # gradient (huggingface/peft#3774): that adapter stays at zero, frozen, and the attention's adapter
            # acts on the packed q/k/v projection.
            module.base_layer.out_proj.requires_grad_(False)
            module.register_forward_pre_hook(_stash_weights)
            module.register_forward_hook(_restore_weights, always_call=True)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return (f"LoRA r={lora_cfg.r} alpha={lora_cfg.alpha:g} on the {' and '.join(lora_cfg.towers)} "
            f"tower{'s' if len(lora_cfg.towers) > 1 else ''}: {len(targets)} layers adapted; {trainable:,} of "
            f"{total:,} parameters train ({100 * trainable / max(total, 1):.2f}%)")


def adapted_attention(model: nn.Module) -> List[str]:
    """The names of `model`'s attention layers (``nn.MultiheadAttention``) that carry adapters: peft swaps their
    weights inside each forward (and `apply_lora`'s hooks put the base weights back), which neither torch.compile
    nor FSDP can trace or shard."""
    from peft.tuners.lora.layer import MultiheadAttention as LoraAttention

    return [n for n, m in model.named_modules() if isinstance(m, LoraAttention)]


def is_wrapped(model: nn.Module) -> bool:
    """Whether `model` holds peft layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with each adapter folded into its base weights and peft's layers replaced by the layers they
    wrap (the state dict keys of a model that never had adapters); `model` itself is unchanged. A model without
    adapters is returned as it is."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not is_wrapped(model):
        return model
    plain = copy.deepcopy(model)
    layers = [n for n, m in plain.named_modules() if isinstance(m, BaseTunerLayer)]
    outer = [n for n in layers if not any(n.startswith(o + ".") for o in layers)]  # out_proj inside an attention
    for name in outer:
        layer = plain.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        if hasattr(layer, "unload_and_optionally_merge_module"):  # peft's attention: in_proj and out_proj
            base = layer.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
        else:
            layer.merge()
            base = layer.get_base_layer()
        setattr(plain.get_submodule(parent_name), child, base)
    plain.__dict__.pop("peft_config", None)
    return plain


def merge_state(state: Dict[str, torch.Tensor], lora_settings: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """A wrapped model's state dict (a training checkpoint's) as the merged model's, without peft: each base weight
    plus its adapter's ``B @ A * alpha / r`` (peft's merge, the same operations), peft's ``base_layer`` names
    dropped and the adapters left out."""
    scaling = float(lora_settings["alpha"]) / int(lora_settings["r"])
    out = dict(state)
    a_suffix = f".lora_A.{ADAPTER}.weight"
    for key in [k for k in state if k.endswith(a_suffix)]:
        prefix = key[:-len(a_suffix)]
        delta = (state[f"{prefix}.lora_B.{ADAPTER}.weight"] @ state[key]) * scaling
        base = next(k for k in (f"{prefix}.base_layer.weight", f"{prefix}.base_layer.in_proj_weight") if k in state)
        out[base] = state[base] + delta.to(state[base].dtype)
    return {k.replace(".base_layer", ""): v for k, v in out.items() if ".lora_" not in k}


def adapter_state(model: nn.Module) -> Tuple[Dict[str, torch.Tensor], Any]:
    """The adapters of a wrapped model in peft's format: (``get_peft_model_state_dict``'s tensors, the peft
    ``LoraConfig`` they were made with)."""
    from peft import get_peft_model_state_dict

    config = model.peft_config[ADAPTER]
    return get_peft_model_state_dict(model, adapter_name=ADAPTER), config


def save_adapters(model: nn.Module, out: Path) -> List[str]:
    """Write the adapters of `model` into the folder `out` as peft writes them (``adapter_model.safetensors``,
    ``adapter_config.json``); returns the file names."""

    state, config = adapter_state(model)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config.save_pretrained(str(out))  # adapter_config.json
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
