"""NaFlex image towers: a timm `NaFlexVit` (native resolution, aspect ratio kept; Tschannen et al. 2025) as the image
tower of an open_clip CLIP, beside any text tower mmcl builds.

``model.vision_cfg.timm_model_name`` names a timm NaFlexVit (``naflexvit_base_patch16_siglip``, ...);
``model.vision_cfg.timm_model_kwargs`` (mmcl's key) overrides the fields of its `NaFlexVitCfg` (a tiny tower for
tests and the CPU demo: ``{embed_dim: 32, depth: 2, num_heads: 2, patch_size: 8}``). `NaFlexTower` keeps open_clip's
`TimmModel` layout (``visual.trunk.*``, ``visual.head.proj.weight``) and its ``forward(x) = head(trunk(x))``, with x
the patch dict ``{"patches" (B, N, P*P*3), "patch_coord" (B, N, 2), "patch_valid" (B, N)}``; the trunk masks the
padded patches out of attention and pooling, so a padded image embeds as it does alone.

`is_naflex` is the one test of "this image tower is NaFlex", for a model, a model config or a timm model name.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict

import timm
import torch
from open_clip.timm_model import TimmModel
from timm.models import is_model, model_entrypoint
from timm.models.naflexvit import NaFlexVit
from torch import nn

from ..data.naflex import patch_batch
from ..errors import ConfigError

KWARGS_KEY = "timm_model_kwargs"  # vision_cfg's key for the NaFlexVitCfg fields mmcl passes to timm
_PLACEHOLDER_VISION = {"layers": 1, "width": 64, "head_width": 64, "patch_size": 8, "image_size": 8}


def is_naflex(obj: Any) -> bool:
    """Whether `obj` (a model with ``visual``, an open_clip model config dict, or a timm model name) has, or names, a
    timm NaFlexVit image tower."""
    if isinstance(obj, nn.Module):
        visual = getattr(obj, "visual", obj)

        return isinstance(getattr(visual, "trunk", None), NaFlexVit)
    if isinstance(obj, dict):
        obj = (obj.get("vision_cfg") or {}).get("timm_model_name")
    if not isinstance(obj, str) or not obj:
        return False

    return is_model(obj) and model_entrypoint(obj).__module__ == "timm.models.naflexvit"


class NaFlexTower(nn.Module):
    """open_clip's `TimmModel` layout around a timm NaFlexVit built with mmcl's keyword overrides: ``trunk`` (pooled
    by its own pooling unless ``pool`` names another) and ``head`` (the projection to the shared embedding)."""

    def __init__(self, model_name: str, embed_dim: int, timm_kwargs: Dict[str, Any], pool: str = "",
                 proj: str = "linear", proj_bias: bool = False, drop: float = 0.0, pretrained: bool = False):
        super().__init__()

        self.trunk = timm.create_model(model_name, pretrained=pretrained, num_classes=0, **timm_kwargs)
        if pool:
            self.trunk.reset_classifier(0, global_pool=pool)
        width = self.trunk.num_features
        head = OrderedDict()
        if proj == "linear":
            head["drop"] = nn.Dropout(drop)
            head["proj"] = nn.Linear(width, embed_dim, bias=proj_bias)
        elif proj != "none" or width != embed_dim:
            raise ConfigError(f"model.vision_cfg.timm_proj={proj!r} with a NaFlex tower: use linear, or none with "
                              f"embed_dim equal to the tower's width ({width})")
        self.head = nn.Sequential(head)
        self.image_size = (0, 0)  # any size: the input is patches

    @property
    def patch_size(self) -> int:
        return int(self.trunk.get_patch_size()[0])

    def forward(self, x: Dict[str, torch.Tensor]) -> torch.Tensor:
        if not isinstance(x, dict):
            raise ConfigError("a NaFlex image tower takes a patch dict {patches, patch_coord, patch_valid}, not "
                              "an image tensor; use the model's own preprocess (mmcl.load) or mmcl.data.naflex")
        return self.head(self.trunk(x))

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:

        TimmModel.lock(self, unlocked_groups, freeze_bn_stats)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.trunk.set_grad_checkpointing(enable)


def tower_from_config(model_cfg: Dict[str, Any]) -> NaFlexTower:
    """The `NaFlexTower` of an open_clip model config whose ``vision_cfg.timm_model_name`` is a NaFlexVit."""
    v = model_cfg.get("vision_cfg") or {}
    kwargs = dict(v.get(KWARGS_KEY) or {})
    if "pos_embed_grid_size" in kwargs:
        kwargs["pos_embed_grid_size"] = tuple(kwargs["pos_embed_grid_size"])
    try:
        return NaFlexTower(v["timm_model_name"], int(model_cfg["embed_dim"]), kwargs, pool=v.get("timm_pool") or "",
                           proj=v.get("timm_proj") or "linear", proj_bias=bool(v.get("timm_proj_bias", False)),
                           drop=float(v.get("timm_drop", 0.0)), pretrained=bool(v.get("timm_model_pretrained", False)))
    except TypeError as err:
        raise ConfigError(f"invalid model.vision_cfg.{KWARGS_KEY} for {v['timm_model_name']}: {err}") from None


def placeholder_config(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """`model_cfg` with a tiny open_clip ViT as its image tower, so that the CLIP class is built without the NaFlex
    tower (which `tower_from_config` then builds and puts in its place)."""
    out = copy.deepcopy(model_cfg)
    out["vision_cfg"] = dict(_PLACEHOLDER_VISION)
    return out


def patch_size_of(model: nn.Module) -> int:
    """The patch size of a model's NaFlex tower."""
    return int(getattr(model, "visual", model).trunk.get_patch_size()[0])


DEFAULT_EVAL_SEQ_LEN = 256  # a model's evaluation transform, unless the run that made it chose another


def config_patch_size(model_cfg: Dict[str, Any]) -> int:
    """The patch size a model config's NaFlex tower takes (its ``timm_model_kwargs`` or the named config's)."""
    kwargs = (model_cfg.get("vision_cfg") or {}).get(KWARGS_KEY) or {}
    if "patch_size" in kwargs:
        return int(kwargs["patch_size"])

    with torch.device("meta"):  # the architecture only: no weights are made
        trunk = timm.create_model(model_cfg["vision_cfg"]["timm_model_name"], num_classes=0, **kwargs)
    return int(trunk.get_patch_size()[0])


# transformers' Siglip2 NaFlex vision model has its own layout (a linear patch embedding over (C, P, P)-ordered
# patches, a position table resized per image from ``spatial_shapes``, ``pixel_attention_mask``) and open_clip's
# and ONNX's image encoders take an image tensor: only mmcl's own safetensors directory carries a NaFlex tower.
EXPORT_FORMATS = ("safetensors",)


def check_export_format(model_cfg: Dict[str, Any], fmt: str) -> None:
    """Raise `ConfigError` (one line) when `fmt` cannot carry the model's NaFlex tower; nothing for other towers."""
    if fmt not in EXPORT_FORMATS and is_naflex(model_cfg):
        raise ConfigError(f"mmcl export --format {fmt} cannot carry a NaFlex image tower (its encoder takes a patch "
                          f"dict); use --format {' or '.join(EXPORT_FORMATS)}, which mmcl.load reads")


def example_patches(model_cfg: Dict[str, Any], batch: int, seed: int = 0, seq_len: int = 16) -> Dict[str, torch.Tensor]:
    """A random patch dict of `batch` images of different shapes padded to `seq_len` patches (export checks)."""

    p, gen = config_patch_size(model_cfg), torch.Generator().manual_seed(seed)
    images = [torch.randn(3, p * (1 + i % 3), p * (1 + (i + 1) % 4), generator=gen) for i in range(batch)]
    return patch_batch(images, max(seq_len, 12), p)
