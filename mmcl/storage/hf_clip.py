"""The one table between open_clip's CLIP state dict and transformers' ``CLIPModel`` layout.

Both directions are derived from it: `to_hf` (used by ``mmcl export --format hf``) and `from_hf` (used when
weights are read from a transformers CLIP checkpoint, ``init_from``/``mmcl.load``). A fact about the layout
(a renamed norm, a transposed projection, the packed attention projection) is written here once.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from ..errors import CheckpointError

# (open_clip name, transformers name, transposed): open_clip projects with x @ proj (width, embed); nn.Linear
# computes x @ W.T, so W = proj.T.
TOP_LEVEL: Tuple[Tuple[str, str, bool], ...] = (
    ("logit_scale", "logit_scale", False),
    ("token_embedding.weight", "text_model.embeddings.token_embedding.weight", False),
    ("positional_embedding", "text_model.embeddings.position_embedding.weight", False),
    ("ln_final.weight", "text_model.final_layer_norm.weight", False),
    ("ln_final.bias", "text_model.final_layer_norm.bias", False),
    ("text_projection", "text_projection.weight", True),
    ("visual.class_embedding", "vision_model.embeddings.class_embedding", False),
    ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight", False),
    ("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight", False),
    ("visual.ln_pre.weight", "vision_model.pre_layrnorm.weight", False),  # sic: transformers' spelling
    ("visual.ln_pre.bias", "vision_model.pre_layrnorm.bias", False),
    ("visual.ln_post.weight", "vision_model.post_layernorm.weight", False),
    ("visual.ln_post.bias", "vision_model.post_layernorm.bias", False),
    ("visual.proj", "visual_projection.weight", True),
)

# One open_clip ResidualAttentionBlock <-> one transformers CLIPEncoderLayer (each with .weight and .bias).
BLOCK: Tuple[Tuple[str, str], ...] = (
    ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("attn.out_proj", "self_attn.out_proj"),
    ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"),
)
# nn.MultiheadAttention packs q, k, v row-wise into one projection (attn.in_proj_*); CLIPAttention keeps three.
PACKED_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# (open_clip block prefix, transformers layer prefix) of each tower
TOWERS = {"vision": ("visual.transformer.resblocks.", "vision_model.encoder.layers."),
          "text": ("transformer.resblocks.", "text_model.encoder.layers.")}

# open_clip buffers that are not parameters of either layout
_NOT_WEIGHTS = {"attn_mask"}


def _maybe_t(value: torch.Tensor, transposed: bool) -> torch.Tensor:
    return value.t().contiguous() if transposed else value


def to_hf(sd: Dict[str, torch.Tensor], n_vision_layers: int, n_text_layers: int
          ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """An open_clip CLIP state dict in transformers ``CLIPModel``'s layout.

    Returns (state dict, names of the open_clip entries the table does not place, sorted): the caller decides
    whether those are an error. Raises KeyError when an entry the table needs is missing.
    """
    out: Dict[str, torch.Tensor] = {}
    used = set(_NOT_WEIGHTS)
    for oc, hf, transposed in TOP_LEVEL:
        out[hf] = _maybe_t(sd[oc], transposed)
        used.add(oc)
    for tower, n in (("vision", n_vision_layers), ("text", n_text_layers)):
        oc_prefix, hf_prefix = TOWERS[tower]
        for i in range(n):
            src, dst = f"{oc_prefix}{i}.", f"{hf_prefix}{i}."
            for oc, hf in BLOCK:
                for kind in ("weight", "bias"):
                    out[f"{dst}{hf}.{kind}"] = sd[f"{src}{oc}.{kind}"]
                    used.add(f"{src}{oc}.{kind}")
            for kind in ("weight", "bias"):
                packed = sd[f"{src}attn.in_proj_{kind}"]
                used.add(f"{src}attn.in_proj_{kind}")
                for name, part in zip(PACKED_QKV, packed.chunk(3, dim=0)):
                    out[f"{dst}{name}.{kind}"] = part.clone()
    return out, sorted(set(sd) - used)


_LAYER_RE = re.compile(r"^(text|vision)_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def from_hf(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A transformers ``CLIPModel`` state dict in open_clip's layout.

    Entries the table does not know are passed through under their own names (so loading reports them as
    unexpected); ``position_ids`` buffers are dropped. Raises `CheckpointError` when a layer has only some of
    its q, k and v projections.
    """
    top = {hf: (oc, transposed) for oc, hf, transposed in TOP_LEVEL}
    block = {hf: oc for oc, hf in BLOCK}
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key in top:
            oc, transposed = top[key]
            out[oc] = _maybe_t(value, transposed)
        elif (m := _LAYER_RE.match(key)) is not None:
            tower, idx, name, kind = m.groups()
            prefix = f"{TOWERS[tower][0]}{idx}."
            if name in PACKED_QKV:
                qkv.setdefault(f"{prefix}attn.in_proj_{kind}", {})[name] = value
            elif name in block:
                out[f"{prefix}{block[name]}.{kind}"] = value
            else:
                out[key] = value
        elif not key.endswith("position_ids"):
            out[key] = value
    for key, parts in qkv.items():
        if set(parts) != set(PACKED_QKV):
            got = sorted(name[len("self_attn.")] for name in parts)
            raise CheckpointError(f"Hugging Face CLIP checkpoint lacks part of {key} (got {got}, "
                                  f"expected q, k and v)")
        out[key] = torch.cat([parts[name] for name in PACKED_QKV], dim=0)
    return out
