"""mmcl's subclasses of open_clip's model classes: the CLIP that `mmcl.models.towers.create` builds
(`ShortTextCLIP`), the CLIP with a Hugging Face text tower (`HFTextCLIP`, `HFTextTower`), open_clip's CoCa with a
captioning decoder (`CaptionCoCa`), and the ViT image tower that follows its input's size
(`GridFollowingVisionTransformer`, made by `mmcl.models.resize.follow_input_size`).

Each keeps open_clip's parameters, attribute names and state-dict keys, so checkpoints, exports and open_clip's own
code read them as open_clip's classes. This module imports open_clip (seconds), so the rest of `mmcl.models` imports
it only where a model is built or changed.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from open_clip import hf_model
from open_clip.coca_model import CoCa
from open_clip.hf_configs import arch_dict
from open_clip.hf_model import HFTextEncoder
from open_clip.model import CLIP, CLIPTextCfg, CustomTextCLIP, _build_vision_tower
from open_clip.transformer import text_global_pool
from torch import nn
from transformers import AutoConfig, AutoModel

from ..errors import ConfigError


# ------------------------------------------------------------------------------------------ open_clip's text
class ShortTextCLIP(CLIP):
    """open_clip's CLIP whose text tower, in training, skips the padding after the longest caption of a batch.

    With a causal attention mask and pooling at the end-of-text token (the highest token id, open_clip's
    ``argmax`` pooling), no position sees the positions after it, so the tokens after the last end-of-text token
    of a batch cannot change any output: running the text transformer on the batch cut there is exact, and
    captions are usually far shorter than the context length. Evaluation, exports and every other text tower run
    open_clip's own ``CLIP.encode_text``; the cut batch runs `_encode_cut_text`, the same computation on the first
    positions of the position table and the causal mask.
    """

    text_frozen = False  # set by apply_locks when every text parameter is locked

    def encode_text(self, text, normalize: bool = False):
        if not self.text_frozen:
            return self._encode_text(text, normalize)
        for module in clip_text_modules(self):  # a locked tower: eval mode, no autograd state
            module.eval()
        with torch.no_grad():
            return self._encode_text(text, normalize)

    def _encode_text(self, text, normalize: bool):
        full = self.positional_embedding.shape[0]
        # Only while training: evaluation and exports keep open_clip's exact full-context numbers, and a traced
        # graph (ONNX, TorchScript) must not bake in a data-dependent cut.
        tracing = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
        cut_safe = self.attn_mask is not None and self.text_pool_type == "argmax"
        if text.shape[1] < full and (tracing or not self.training or not cut_safe):
            # Tokens already cut after the batch's last end-of-text (`TrimmedTokenizer`): padded back.
            text = F.pad(text, (0, full - text.shape[1]))
        if tracing or not self.training or not cut_safe or text.shape[1] > full:
            return super().encode_text(text, normalize=normalize)
        n = text.shape[1]  # cut by the data loader, on the host (`TrimmedTokenizer`): no device read here
        if n >= full:
            # A caption fills the context, or the tokens were not cut: the full context, with no read of the
            # longest caption from the device (it would stall the host on every such batch).
            return super().encode_text(text, normalize=normalize)
        # The width rounded up to a multiple of 8 (`TEXT_WIDTH_STEP`): a compiled tower then meets a few widths,
        # not one per batch, and matmuls keep an aligned shape; the added padding columns come after every
        # end-of-text token, where the causal mask keeps them from changing any output.
        n = min(full, -(-n // TEXT_WIDTH_STEP) * TEXT_WIDTH_STEP)
        if n > text.shape[1]:
            text = F.pad(text, (0, n - text.shape[1]))
        return self._encode_cut_text(text, normalize)

    def _encode_cut_text(self, text, normalize: bool):
        """open_clip's ``CLIP.encode_text`` for a batch of width n below the context length, with the position table
        and the causal mask cut to their first n positions (views: the gradient reaches the model's table). Only
        with ``argmax`` pooling (`_encode_text`), which open_clip's releases pool alike;
        tests/models/test_clip_classes.py checks the features against open_clip's own on the full context."""
        n = text.shape[1]
        cast_dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(text).to(cast_dtype)  # (B, n, width)
        x = x + self.positional_embedding[:n].to(cast_dtype)
        x = self.transformer(x, attn_mask=self.attn_mask[:n, :n])
        x = self.ln_final(x)
        x = text_global_pool(x, text, self.text_pool_type)
        if self.text_projection is not None:
            if isinstance(self.text_projection, nn.Linear):
                x = self.text_projection(x)
            else:
                x = x @ self.text_projection
        return F.normalize(x, dim=-1) if normalize else x


# ------------------------------------------------------------------------------------------ Hugging Face text
def _hf_width(config) -> int:
    """The hidden width of a Hugging Face model config: ``hidden_size``, which transformers' ``attribute_map`` maps to
    a model type's own name (``d_model`` for MT5 and M2M-100: the attribute open_clip reads for the types it knows),
    else the first of the other usual attribute names."""
    names = ["hidden_size", "d_model", "dim", "n_embd"]
    attr = next((a for a in names if hasattr(config, a)), None)
    if attr is None:
        raise ConfigError(f"cannot find the width of Hugging Face model type '{config.model_type}' "
                          f"(expected one of hidden_size, d_model, dim in its config)")
    return int(getattr(config, attr))


def _hf_pooler(pooler_type: Optional[str], model_type: str) -> nn.Module:
    """The pooler named in the model config (open_clip's names), with mmcl's padding-aware max pooling."""
    if pooler_type is None:  # open_clip's default for the model type (its table; tests/test_dependency_names.py)

        pooler_type = arch_dict.get(model_type, {}).get("pooler", "mean_pooler")
    poolers = {"mean_pooler": hf_model.MeanPooler, "max_pooler": MaskedMaxPooler, "cls_pooler": hf_model.ClsPooler,
               "cls_last_hidden_state_pooler": hf_model.ClsLastHiddenStatePooler}
    if pooler_type not in poolers:
        raise ConfigError(f"unknown Hugging Face pooler '{pooler_type}' (expected one of {', '.join(poolers)})")
    return poolers[pooler_type]()


class HFTextTower(HFTextEncoder):
    """open_clip's Hugging Face text adapter (its forward, pooling and projection layout), constructed with the
    width and pooler given explicitly.

    open_clip's own constructor is not run: it looks the width and pooler up in its module-level table of model
    types, which would have to be written for a type it lacks (e.g. MPNet), and loads without
    ``trust_remote_code=False``. This one sets what that constructor sets, no more and no less
    (tests/test_dependency_names.py), in the same order of construction calls.
    """

    def __init__(self, source: str, output_dim: int, pooler_type: Optional[str] = None,
                 proj_type: Optional[str] = None, pretrained: bool = True, output_tokens: bool = False):
        nn.Module.__init__(self)  # not HFTextEncoder.__init__ (see the class docstring)

        self.output_tokens = output_tokens
        self.output_dim = output_dim
        try:  # trust_remote_code=False: a config's auto_map is an error, never a prompt or an import
            self.config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        except ValueError as err:
            raise (hf_custom_code_error(err, source) or err) from None
        # The same construction calls, in the same order, as open_clip's adapter: the random projection's
        # initial weights then equal those of a tower built by open_clip for the same seed.
        pooler = _hf_pooler(pooler_type, self.config.model_type)
        load = (lambda: AutoModel.from_pretrained(source, **extra)) if pretrained else (
            lambda: AutoModel.from_config(self.config, **extra))
        if getattr(self.config, "is_encoder_decoder", False):
            extra = {"trust_remote_code": False}
            self.transformer = load().encoder
        else:
            extra = {"add_pooling_layer": pooler_type == "cls_pooler", "trust_remote_code": False}
            self.transformer = load()
        self.vocab_size = getattr(self.config, "vocab_size", 0)
        self.context_length = getattr(self.config, "max_position_embeddings", 0)
        self.pooler = pooler
        width = _hf_width(self.config)
        if width == output_dim and proj_type is None:
            self.proj = nn.Identity()
        elif proj_type == "linear":
            self.proj = nn.Linear(width, output_dim, bias=False)
        elif proj_type == "mlp":
            hidden = (width + output_dim) // 2
            self.proj = nn.Sequential(nn.Linear(width, hidden, bias=False), nn.GELU(),
                                      nn.Linear(hidden, output_dim, bias=False))
        # else no projection: `mmcl.models.towers.create` reports the width mismatch (`_check_hf_tower`)


class HFTextCLIP(CustomTextCLIP):
    """open_clip's CustomTextCLIP with an `HFTextTower` text tower: the image tower, the text tower, then the logit
    scale and bias, in open_clip's order (so the same seed gives the same initial weights).

    CustomTextCLIP's constructor is not run: it would build open_clip's own Hugging Face adapter. This one sets
    what that constructor sets (tests/test_dependency_names.py); every method is CustomTextCLIP's.
    """

    def __init__(self, embed_dim: int, vision_cfg, text_cfg, quick_gelu: bool = False,
                 init_logit_scale: float = math.log(1 / 0.07), init_logit_bias: Optional[float] = None,
                 nonscalar_logit_scale: bool = False, cast_dtype: Optional[torch.dtype] = None,
                 output_dict: bool = False):
        nn.Module.__init__(self)  # not CustomTextCLIP.__init__ (see the class docstring)
        text_cfg = CLIPTextCfg(**text_cfg) if isinstance(text_cfg, dict) else text_cfg
        self.output_dict = output_dict
        self.visual = _build_vision_tower(embed_dim, vision_cfg, quick_gelu, cast_dtype)
        self.text = HFTextTower(text_cfg.hf_model_name, output_dim=embed_dim, pooler_type=text_cfg.hf_pooler_type,
                                proj_type=text_cfg.hf_proj_type, pretrained=text_cfg.hf_model_pretrained,
                                output_tokens=text_cfg.output_tokens)
        self.context_length = self.text.context_length
        self.vocab_size = self.text.vocab_size
        shape = [1] if nonscalar_logit_scale else []
        self.logit_scale = nn.Parameter(torch.ones(shape) * init_logit_scale)
        self.logit_bias = None if init_logit_bias is None else nn.Parameter(torch.ones(shape) * init_logit_bias)


# ------------------------------------------------------------------------------------------- captioning
class CaptionCoCa(CoCa):
    """open_clip's CoCa (Yu et al. 2022): image and text towers for the contrastive terms and a text decoder that
    cross-attends to the image tower's tokens and predicts the caption (``logits`` and ``labels`` in the forward's
    dict, the captioning term's inputs, `mmcl.losses.caption`).

    Its parameters, names and state-dict keys are CoCa's, so open_clip loads what mmcl saves. Three differences:
    the decoder is initialised (open_clip 3.3's CoCa never initialises it: ``MultimodalTransformer.init_parameters``
    reads attributes the class lacks and is not called, so its ``text_projection`` is ``torch.empty``, whatever
    memory held, and a model trained from scratch starts from losses of 1e33 or NaN); a forward given more captions
    than images (``data.negatives``: a batch's negative captions follow its captions) encodes every caption but
    decodes only the first ones, the images' own (open_clip's would fail on the mismatch, and a negative caption
    has no image to be predicted from); and the image tower locks as open_clip's CLIP's does (``model.lock_image``),
    which CoCa itself lacks.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        init_decoder(self.text_decoder)
        # Whether a forward given captions runs the decoder: a run whose loss reads no caption logits turns it off
        # (`stop_decoding`), and the forward then gives the features, scale and bias alone.
        self.decodes = True

    def forward(self, image, text: Optional[torch.Tensor] = None, image_latent: Optional[torch.Tensor] = None,
                image_embs: Optional[torch.Tensor] = None, output_labels: bool = True,
                caption_parallel: Optional[torch.Tensor] = None):
        """open_clip's CoCa forward, with `caption_parallel` ((n,) bool on the device, ``loss.caption_parallel``):
        the images' captions marked True are predicted in parallel (`parallel_decode`)."""
        if text is not None and not self.decodes:
            if image_latent is None or image_embs is None:
                image_latent, _ = self._encode_image(image)
            out = {"image_features": image_latent, "text_features": self._encode_text(text)[0],
                   "logit_scale": self.logit_scale.exp()}
            if self.logit_bias is not None:
                out["logit_bias"] = self.logit_bias
            return out
        plain = (text is None or image_latent is not None or image_embs is not None
                 or text.shape[0] == image.shape[0])
        if plain and caption_parallel is None:
            return super().forward(image, text, image_latent, image_embs, output_labels)
        if image_latent is None or image_embs is None:
            image_latent, image_embs = self._encode_image(image)
        if text is None:
            return {"image_features": image_latent, "image_embs": image_embs}
        n = image_embs.shape[0]  # the pairs; rows after them are other texts (negative or short captions)
        text_latent, token_embs = self._encode_text(text)
        labels = text[:n, 1:] if output_labels else None
        token_embs = token_embs[:n, :-1] if output_labels else token_embs[:n]
        logits = (self.text_decoder(image_embs, token_embs) if caption_parallel is None
                  else parallel_decode(self, image_embs, token_embs, caption_parallel, text.shape[1]))
        out = {"image_features": image_latent, "text_features": text_latent,
               "logits": logits, "logit_scale": self.logit_scale.exp()}
        if labels is not None:
            out["labels"] = labels
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out

    def lock_image_tower(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False):
        self.visual.lock(unlocked_groups=unlocked_groups, freeze_bn_stats=freeze_bn_stats)


@torch.no_grad()
def init_decoder(decoder: nn.Module) -> None:
    """The initialisation open_clip's ``MultimodalTransformer.init_parameters`` means (CLIP's text transformer's,
    for its self- and cross-attention blocks): attention weights N(0, width^-1/2), the residual projections
    scaled down by (2 layers)^-1/2, the output projection N(0, width^-1/2)."""
    width, layers = decoder.width, decoder.layers
    proj_std, attn_std, fc_std = width ** -0.5 * (2 * layers) ** -0.5, width ** -0.5, (2 * width) ** -0.5
    for block in [*decoder.resblocks, *decoder.cross_attn]:
        nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
        nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
        nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
        nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
    if decoder.text_projection is not None:
        nn.init.normal_(decoder.text_projection, std=width ** -0.5)


def mask_queries(model: "CaptionCoCa", width: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """(1, length, W): the decoder's inputs for a caption predicted in parallel, the text tower's token outputs of a
    row of `width` padding tokens (id 0, open_clip's pad; the captions' width), cut like a caption's. They carry
    positions and no word of any caption; reusing a token keeps the state dict open_clip's (CapPa adds a mask token
    to the vocabulary)."""
    pad = torch.zeros(1, width, dtype=torch.long, device=like.device)
    return model._encode_text(pad)[1][:, :length].to(like.dtype)


def parallel_decode(model: "CaptionCoCa", image_embs: torch.Tensor, token_embs: torch.Tensor,
                    parallel: torch.Tensor, width: int) -> torch.Tensor:
    """The decoder's logits (n, L, V) where each row marked in `parallel` ((n,) bool) is predicted in parallel
    (CapPa's parallel prediction, used by LocCa): its inputs are the mask queries (`mask_queries`) and its
    self-attention is not causal, so every token is predicted from the image alone; the other rows are open_clip's
    teacher-forced, causal decoding, unchanged. One pass over the batch, the causal mask per row: no host read.
    `width`: the captions' tokens per row."""
    decoder = model.text_decoder
    n, length = token_embs.shape[0], token_embs.shape[1]
    par = parallel.to(device=token_embs.device, dtype=torch.bool).reshape(n, 1, 1)
    x = torch.where(par, mask_queries(model, width, length, token_embs), token_embs)
    causal = decoder.attn_mask[:length, :length].to(device=x.device)
    heads = decoder.resblocks[0].attn.num_heads
    mask = torch.where(par, torch.zeros_like(causal), causal).repeat_interleave(heads, dim=0)  # (n * heads, L, L)
    batch_first = getattr(decoder, "batch_first", True)
    if not batch_first:
        image_embs, x = image_embs.permute(1, 0, 2), x.permute(1, 0, 2)
    for block, cross in zip(decoder.resblocks, decoder.cross_attn):
        x = block(x, attn_mask=mask)
        x = cross(x, k_x=image_embs, v_x=image_embs)
    if not batch_first:
        x = x.permute(1, 0, 2)
    out = decoder.ln_final(x)
    return out if decoder.text_projection is None else out @ decoder.text_projection


def stop_decoding(model: nn.Module) -> int:
    """A `CaptionCoCa` whose decoder no loss term reads (``loss.caption`` 0): its forward no longer runs the decoder,
    and the decoder's parameters are frozen (no gradient, no optimiser state; saved as they are). Returns the
    parameters frozen (0 for a model without a decoder)."""
    if not isinstance(model, CaptionCoCa):
        return 0
    model.decodes = False
    frozen = 0
    for p in model.text_decoder.parameters():
        frozen += p.numel() if p.requires_grad else 0
        p.requires_grad_(False)
    return frozen


def has_decoder(model: nn.Module) -> bool:
    """Whether `model` (unwrapped) has a captioning decoder (`CaptionCoCa`, or open_clip's CoCa)."""
    return isinstance(model, CoCa)


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


TEXT_WIDTH_STEP = 8  # a cut token batch runs at its width rounded up to a multiple of this (`ShortTextCLIP`)


def hf_custom_code_error(err: ValueError, source: str) -> Optional[ConfigError]:
    """The one-line error for transformers' refusal of a model, config or tokenizer whose ``auto_map`` points to
    Python code shipped with it (every load passes ``trust_remote_code=False``: such code is never run, and the
    user is never asked), or None when `err` is another ValueError."""
    if "custom code" not in str(err):
        return None
    return ConfigError(f"refusing the Hugging Face model '{source}': its files map to custom Python code "
                       f"(auto_map), which mmcl never runs; use a model that transformers implements")


def clip_text_modules(model: nn.Module) -> List[nn.Module]:
    # open_clip's CLIP class keeps its text transformer's parts as attributes of the model itself.
    return [model.token_embedding, model.transformer, model.ln_final]


# SigLIP 2's second stage (`mmcl.models.siglip2`) attaches training-only heads to a model under this attribute; their
# state-dict keys start with "siglip2_heads.". Spelled here, with the rule that leaves them out, so that reading a
# checkpoint as a model needs none of the training side (`mmcl.storage.checkpoints`).
HEADS = "siglip2_heads"


def without_heads(state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` (a model's state dict) without the training-only heads' tensors."""
    return {k: v for k, v in state.items() if not k.startswith(HEADS + ".")}
