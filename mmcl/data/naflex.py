"""Native-resolution batches for NaFlex image towers (SigLIP 2's recipe, Tschannen et al. 2025): images keep their
aspect ratio, are cut into patches at a sequence length drawn per batch, and a batch holds as many pairs as fit a
token budget.

`NaflexPlan` is the schedule (``data.naflex``): process batch b gets the sequence length `NaflexPlan.seq_len_at`
(b), drawn from the seed and b alone (every process draws the same length, so the processes stay balanced, and a
resumed run draws what the uninterrupted run drew), and holds ``max_tokens_per_batch // L`` pairs. A data worker
resizes each image to the largest size of whole patches whose patch count fits L (`SeqResize`, timm's
`ResizeToSequence`) and ships it as uint8; `patch_batch` cuts the images into patches (timm's `patchify_image`)
and pads each to L with ``patch_valid`` False. `PatchNormalizer` scales and normalises the patches where the model
runs; `EvalPatchify` is the whole evaluation transform of one image at one length. `padding_waste` is the share of
patch slots that are padding (logged as ``data/naflex_padding_waste``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from timm.data.naflex_transforms import ResizeToSequence, patchify_image

from .decode import pil_to_uint8

PATCH_KEYS = ("patches", "patch_coord", "patch_valid")  # the model input of a NaFlex tower, a dict of these


@dataclasses.dataclass(frozen=True)
class NaflexPlan:
    """The sequence length and the number of pairs of every process batch (``data.naflex``)."""

    seq_lens: Tuple[int, ...]
    probs: Tuple[float, ...]  # normalised; equal when ``seq_len_probs`` is not given
    max_tokens: int  # the token budget of one process batch
    patch_size: int
    seed: int = 0

    @classmethod
    def build(cls, seq_lens: Sequence[int], probs: Optional[Sequence[float]], max_tokens: int, patch_size: int,
              seed: int = 0) -> "NaflexPlan":
        p = np.asarray(probs if probs else [1.0] * len(seq_lens), dtype=np.float64)
        return cls(tuple(int(n) for n in seq_lens), tuple(float(x) for x in p / p.sum()), int(max_tokens),
                   int(patch_size), int(seed))

    def seq_len_at(self, batch: int) -> int:
        """The sequence length of process batch `batch` (0-based from the start of the run): a function of the seed
        and `batch`, the same on every process and after a resume."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, int(batch), 0x4E46])
        return self.seq_lens[int(rng.choice(len(self.seq_lens), p=np.asarray(self.probs)))]

    def pairs_at(self, batch: int) -> int:
        """The pairs of process batch `batch`: as many sequences of its length as fit the token budget."""
        return self.max_tokens // self.seq_len_at(batch)

    @property
    def capacity(self) -> int:
        """The most pairs a process batch can hold (at the shortest length): the loss pads every batch to it."""
        return self.max_tokens // min(self.seq_lens)


class SeqResize:
    """PIL image -> RGB PIL image resized, aspect ratio kept, to the largest size of whole `patch_size` patches
    whose patch count is at most `seq_len` (timm's `ResizeToSequence`). Picklable (data workers)."""

    def __init__(self, seq_len: int, patch_size: int, interpolation: str = "bicubic"):
        self.seq_len, self.patch_size, self.interpolation = int(seq_len), int(patch_size), interpolation
        self._resize = None

    def __getstate__(self):
        return {"seq_len": self.seq_len, "patch_size": self.patch_size, "interpolation": self.interpolation,
                "_resize": None}

    def __call__(self, img):
        if self._resize is None:

            self._resize = ResizeToSequence(self.patch_size, self.seq_len, interpolation=self.interpolation)
        return self._resize(img.convert("RGB"))


def patch_batch(images: Sequence[torch.Tensor], seq_len: int, patch_size: int) -> Dict[str, torch.Tensor]:
    """Patchify (3, H, W) images (H, W multiples of `patch_size`, at most `seq_len` patches each) and pad each to
    `seq_len` patches: ``patches`` (B, L, P*P*3) of the images' dtype (channels last within a patch, timm's
    layout), ``patch_coord`` (B, L, 2) int64 (row, column), ``patch_valid`` (B, L) bool."""

    b, dim = len(images), patch_size * patch_size * 3
    dtype = images[0].dtype if images else torch.uint8
    out = {"patches": torch.zeros((b, seq_len, dim), dtype=dtype),
           "patch_coord": torch.zeros((b, seq_len, 2), dtype=torch.long),
           "patch_valid": torch.zeros((b, seq_len), dtype=torch.bool)}
    for i, img in enumerate(images):
        patches, coord, valid = patchify_image(img, (patch_size, patch_size))
        n = patches.shape[0]
        if n > seq_len:
            raise ValueError(f"an image of {n} patches does not fit the sequence length {seq_len}")
        out["patches"][i, :n] = patches
        out["patch_coord"][i, :n] = coord
        out["patch_valid"][i, :n] = valid
    return out


def padding_waste(patch_valid: torch.Tensor) -> float:
    """The share of patch slots of a batch that are padding: padded slots / all slots (0 for an empty batch)."""
    return float((~patch_valid).sum()) / max(1, patch_valid.numel())


class PatchNormalizer:
    """A batch's patches (uint8, ``patch_batch``) -> float patches scaled to [0, 1] and normalised per channel,
    padding zero; on the device the model runs on. What `mmcl.data.TrainStream.finish_images` is for NaFlex."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)

    def __call__(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        patches = batch["patches"]
        x = patches.float().unflatten(-1, (-1, 3)) if patches.dtype == torch.uint8 else patches.unflatten(-1, (-1, 3))
        if patches.dtype == torch.uint8:
            x = x / 255.0
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device)
        x = ((x - mean) / std).flatten(-2) * batch["patch_valid"].unsqueeze(-1).to(x.dtype)
        return dict(batch, patches=x)


class EvalPatchify:
    """The evaluation transform of a NaFlex tower: PIL image -> {patches (L, P*P*3) float normalised, patch_coord
    (L, 2), patch_valid (L,)}, the image resized keeping its aspect ratio to fit `seq_len` patches and padded to
    `seq_len` (batches of them stack key by key, `mmcl.data.eval_collate`)."""

    def __init__(self, seq_len: int, patch_size: int, mean: Sequence[float], std: Sequence[float],
                 interpolation: str = "bicubic"):
        self.seq_len, self.patch_size = int(seq_len), int(patch_size)
        self.resize = SeqResize(seq_len, patch_size, interpolation)
        self.normalize = PatchNormalizer(mean, std)

    def __call__(self, img) -> Dict[str, torch.Tensor]:

        one = patch_batch([pil_to_uint8(self.resize(img))], self.seq_len, self.patch_size)
        return {k: v[0] for k, v in self.normalize(one).items()}


def stack_patch_dicts(items: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Per-image patch dicts (`EvalPatchify`) as one batch dict."""
    return {k: torch.stack([it[k] for it in items]) for k in PATCH_KEYS}


def to_device(images: Any, device, dtype: Optional[torch.dtype] = None) -> Any:
    """A batch of images, a tensor or a patch dict, on `device`; the float parts (images, patches) in `dtype`."""
    if isinstance(images, dict):
        return {k: v.to(device=device, dtype=dtype if k == "patches" and dtype is not None else None,
                        non_blocking=True) for k, v in images.items()}
    return images.to(device=device, dtype=dtype) if dtype is not None else images.to(device)
