"""Towers at other input sizes than they are built for, through resized position embeddings: the model's side of
token-reduction phases (CLIPA, Li et al. 2023), towers that train at a smaller image size and a shorter text, and a
model at another size from the same weights.

The parameters stay at the model's full size for the whole run. A phase's position embeddings are derived from them
in each forward: the image tower's patch grid is resized (bicubic, antialiased, the class token kept: open_clip's
`resize_pos_embed` and CLIPA's), the text tower takes the first ``L`` rows (CLIPA's truncation; open_clip's text
towers already read ``positional_embedding[:L]`` for a shorter batch). So no parameter changes shape between phases:
the optimiser's state, DDP's buckets, FSDP's shards, the EMA and checkpoints are those of an ordinary run, and exact
resume and 2 processes = 1 carry over from them unchanged. Gradients reach the full-size embedding through the
resize, so every phase trains the same parameters; the last phase at full size trains them directly.

The image size is read from the input (`follow_input_size`), not set by the loop, so a forward at any size that the
patch size divides works, in training and in evaluation alike, and nothing in the forward depends on a step
counter. `at_size` builds the model a run ends with when its last phase is smaller than the model.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer, _expand_token
from torch import nn

from ..errors import ConfigError
from .towers import create


def resize_grid_embedding(pos: torch.Tensor, grid: Tuple[int, int], prefix: int = 1) -> torch.Tensor:
    """`pos` ((prefix + g*g, D), the class token first) with its square patch grid resized to `grid` (gh, gw):
    bicubic with antialiasing and ``align_corners=False``, as open_clip's `resize_pos_embed`. Differentiable."""
    tok, img = pos[:prefix], pos[prefix:]
    side = int(round(img.shape[0] ** 0.5))
    if side * side != img.shape[0]:
        raise ValueError(f"position embedding of {img.shape[0]} patches is not a square grid")
    if (side, side) == tuple(grid):
        return pos
    img = img.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    img = F.interpolate(img, size=tuple(grid), mode="bicubic", antialias=True, align_corners=False)
    img = img.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)
    return torch.cat([tok, img.to(tok.dtype)], dim=0)


# Long-CLIP (Zhang et al. 2024) keeps the first 20 trained text positions as they are: captions' first words sit
# there, and short captions stay as the model read them.
LONG_CLIP_KEEP = 20


def stretch_text_positions(pos: torch.Tensor, length: int, keep: int = LONG_CLIP_KEEP) -> torch.Tensor:
    """A text tower's (L, D) position table stretched to (`length`, D), length > L, as Long-CLIP does: the first
    `keep` rows (at most L - 2) as trained, and the rest, rows keep..L-1, spread over length - keep rows by
    linear interpolation: new row keep + t reads the trained table at keep + t (L - keep) / (length - keep), so
    with 77 -> 248 every fourth new row is a trained row, and the rows after the last trained one continue along
    the last two. Differentiable; the dtype is kept."""
    n, width = pos.shape
    if length <= n:
        raise ValueError(f"stretching needs a longer table (got {n} rows -> {length})")
    keep = max(0, min(keep, n - 2))
    tail = pos[keep:].to(torch.promote_types(pos.dtype, torch.float32))
    x = torch.arange(length - keep, dtype=tail.dtype, device=pos.device) * ((n - keep) / (length - keep))
    lo = x.floor().long().clamp(max=n - keep - 2)
    w = (x - lo.to(x.dtype)).unsqueeze(1)
    stretched = tail[lo] * (1 - w) + tail[lo + 1] * w
    return torch.cat([pos[:keep], stretched.to(pos.dtype)], dim=0)


def vit_tower(model: nn.Module) -> Optional[nn.Module]:
    """`model`'s image tower when it is an open_clip ViT with a class token and a learned position embedding."""
    visual = getattr(model, "visual", None)
    ok = (visual is not None and hasattr(visual, "conv1") and isinstance(getattr(visual, "positional_embedding",
                                                                                 None), nn.Parameter)
          and getattr(visual, "class_embedding", None) is not None)
    return visual if ok else None


def follow_input_size(model: nn.Module) -> None:
    """Make `model`'s image tower take images of any size its patch size divides (in place; idempotent): the tower
    becomes a `mmcl.models.clip_classes.GridFollowingVisionTransformer`, with the same parameters and state dict.
    Raises ConfigError for an image tower without patch tokens (a ResNet, a timm trunk)."""


    visual = vit_tower(model)
    if isinstance(visual, GridFollowingVisionTransformer):
        return
    if visual is None or type(visual) is not VisionTransformer:
        raise ConfigError(f"train.phases with an image_size needs an open_clip ViT image tower (patch tokens and a "
                          f"learned position embedding); this model's image tower is "
                          f"{type(getattr(model, 'visual', None)).__name__}: leave image_size out of the phases")
    visual.__class__ = GridFollowingVisionTransformer


def full_sizes(model_cfg: Dict[str, Any]) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(image size, patch size, context length) of a model config (None where it has none)."""
    vision, text = model_cfg.get("vision_cfg", {}) or {}, model_cfg.get("text_cfg", {}) or {}
    size = vision.get("image_size")
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = vision.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return size, patch, text.get("context_length")


def at_size(model: nn.Module, model_cfg: Dict[str, Any], image_size: Optional[int],
            context_length: Optional[int]) -> Tuple[nn.Module, Dict[str, Any]]:
    """A model built for `image_size` and `context_length` (None: the model's own) with `model`'s weights, the
    position embeddings resized as in training (`resize_grid_embedding`, text truncated), and its config."""

    size, _, length = full_sizes(model_cfg)
    if (image_size in (None, size)) and (context_length in (None, length)):
        return model, model_cfg
    cfg = copy.deepcopy(model_cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if image_size not in (None, size):
        cfg["vision_cfg"]["image_size"] = int(image_size)
        patch = full_sizes(cfg)[1]
        grid = int(image_size) // int(patch)
        state["visual.positional_embedding"] = resize_grid_embedding(state["visual.positional_embedding"],
                                                                     (grid, grid))
    if context_length not in (None, length):
        cfg["text_cfg"]["context_length"] = int(context_length)
        for key in ("positional_embedding", "text.positional_embedding"):
            if key in state:
                state[key] = state[key][: int(context_length)].clone()
    resized = create(cfg)
    resized.load_state_dict(state)
    return resized.to(next(model.parameters()).device), cfg


# ------------------------------------------------------------------------------------------ image size
class GridFollowingVisionTransformer(VisionTransformer):
    """open_clip's ViT image tower whose position embedding follows the patch grid of its input: the parameter
    resized to that grid (`resize_grid_embedding`) where the grid has another number of patches, the parameter
    itself otherwise. Every parameter, the state dict and every other method are the tower's own.

    Never built directly: `mmcl.models.resize.follow_input_size` turns a built ``VisionTransformer`` into one, in
    place (same class layout, only `_embeds` differs), so a run keeps its model, optimiser and EMA.
    """

    def grid_embedding(self, grid: Tuple[int, int]) -> torch.Tensor:
        """The position embedding for a patch grid of `grid` (rows, columns), the class token first."""
        pos = self.positional_embedding
        if grid[0] * grid[1] + 1 != pos.shape[0]:
            return resize_grid_embedding(pos, grid)
        return pos

    def _embeds(self, x: torch.Tensor) -> torch.Tensor:
        # open_clip's VisionTransformer._embeds, with the position embedding of the input's grid.
        x = self.conv1(x)  # (B, width, rows, columns)
        grid = (x.shape[-2], x.shape[-1])
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # (B, rows * columns, width)
        x = torch.cat([_expand_token(self.class_embedding, x.shape[0]).to(x.dtype), x], dim=1)
        x = x + self.grid_embedding(grid).to(x.dtype)
        x = self.patch_dropout(x)
        return self.ln_pre(x)
