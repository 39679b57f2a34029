"""A teacher in the training loop (distillation): a frozen CLIP model with its own preprocessing and tokenizer.

`Teacher.load(path, device)` reads anything `mmcl.load` reads (an mmcl run directory or its ``model/``, an mmcl
export, an open_clip local-dir export, a Hugging Face CLIP directory). The teacher runs in eval mode without
gradients, is never handed to accelerate or the optimiser, and is never saved with the student.

Augmentation rule: the teacher always sees its own evaluation view of the un-augmented decoded image (its image
size, resize and crop) and the same drawn caption as the student, tokenised by its own tokenizer. Its targets
therefore do not depend on the student's augmentation or random state, and embeddings stored in the shards
(`mmcl reinforce`) equal the ones computed online.
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch
import torch.nn.functional as F

from ..data.decode import pil_to_uint8
from ..data.transforms import ImageFinish, split_transform
from ..errors import ConfigError, MmclError
from ..losses import TeacherFeatures
from ..models import is_naflex
from ..storage.weights import load


class TeacherView:
    """What the data loader's workers apply for the teacher: its PIL-stage eval transform to uint8 pixels and its
    tokenizer. Picklable; the float conversion and normalisation run where the teacher runs (`Teacher.embed`)."""

    def __init__(self, pil_stage: Callable, tokenizer: Callable[[List[str]], torch.Tensor]):
        self.pil_stage, self.tokenizer = pil_stage, tokenizer

    def image(self, pil_rgb: Any) -> torch.Tensor:
        """An RGB PIL image -> uint8 (3, H, W) at the teacher's size."""
        return pil_to_uint8(self.pil_stage(pil_rgb))

    def tokenize(self, captions: List[str]) -> torch.Tensor:
        return torch.as_tensor(self.tokenizer(list(captions))).long()


class Teacher:
    """A frozen model that scores the student's batch with its own features and logit scale."""

    def __init__(self, model: torch.nn.Module, view: TeacherView, finish: ImageFinish, name: str):
        self.model, self.view, self.finish, self.name = model, view, finish, name

    @classmethod
    def load(cls, path: str, device: Any = "cpu") -> "Teacher":
        """The teacher at `path`, on `device`. Anything unreadable is a `ConfigError` naming the path."""

        try:
            model, eval_tf, tokenizer = load(path)
        except MmclError as err:
            raise ConfigError(f"distill.teacher: cannot load {path}: {err}") from None
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"distill.teacher: cannot load {path}: {detail}") from None
        if is_naflex(model):
            raise ConfigError(f"distill.teacher: {path} has a NaFlex image tower; a teacher takes fixed-size images")
        pil_stage, finish = split_transform(eval_tf)
        if finish is None:
            raise ConfigError(f"distill.teacher: the image transform of {path} does not end in ToTensor "
                              f"[+ Normalize], so its pixels cannot be prepared in the data loader")
        if not hasattr(model, "encode_image") or not hasattr(model, "encode_text"):
            raise ConfigError(f"distill.teacher: {path} is not a CLIP model (no encode_image / encode_text)")
        model = model.to(device).eval().requires_grad_(False)
        return cls(model, TeacherView(pil_stage, tokenizer), finish, str(path))

    @property
    def scale(self) -> torch.Tensor:
        """The teacher's logit scale s = exp(t), 0-dim float32."""
        return self.model.logit_scale.detach().float().exp().reshape(())

    @torch.no_grad()
    def embed(self, images_uint8: torch.Tensor, tokens: torch.Tensor) -> TeacherFeatures:
        """L2-normalised float32 features of a batch already in the teacher's view (uint8 (B,3,H,W) and tokens
        (B,L)), with its scale. The towers run in the caller's autocast (the training loop calls this under the
        student's mixed precision: a float32 teacher beside a bf16 student would cost more than the student's own
        forward); the features come back in float32 whatever it is."""
        device = self.model.logit_scale.device
        images = self.finish(images_uint8.to(device, non_blocking=True))
        # Normalised in float32 (under autocast a bf16 unit vector is off unit length by ~1e-3).
        image = F.normalize(self.model.encode_image(images).float(), dim=-1)
        text = F.normalize(self.model.encode_text(tokens.to(device, non_blocking=True)).float(), dim=-1)
        return TeacherFeatures(image, text, self.scale)
