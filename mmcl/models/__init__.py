"""The towers: open_clip architectures and Hugging Face text towers (`towers`, with mmcl's subclasses of open_clip's
model classes in `clip_classes`), FLIP's patch dropout (`flip`), towers that follow their input's size (`resize`), and
NaFlex image towers (`naflex`: timm's NaFlexVit, `is_naflex`); a model's FLOPs per pair and MFU (`flops`).

The names below are the package's interface (``from mmcl import models; models.build(cfg)``)."""

from .clip_classes import TEXT_WIDTH_STEP, MaskedMaxPooler, has_decoder, hf_custom_code_error, stop_decoding
from .naflex import is_naflex
from .towers import (
    CONFIG_DIR,
    FROZEN_ATTR,
    TrimmedTokenizer,
    apply_locks,
    available_models,
    build,
    build_tokenizer,
    build_transforms,
    clamp_logit_scale,
    create,
    is_frozen_call,
    is_local_dir,
    named_config,
    preprocess_config,
    resolve_model_config,
    set_patch_dropout,
    training_tokenizer,
)

__all__ = ["CONFIG_DIR", "FROZEN_ATTR", "TEXT_WIDTH_STEP", "MaskedMaxPooler", "TrimmedTokenizer", "apply_locks",
           "available_models", "build", "build_tokenizer", "build_transforms", "clamp_logit_scale", "create",
           "has_decoder", "stop_decoding", "hf_custom_code_error", "is_frozen_call", "is_naflex", "is_local_dir",
           "named_config", "preprocess_config", "resolve_model_config", "set_patch_dropout", "training_tokenizer"]
