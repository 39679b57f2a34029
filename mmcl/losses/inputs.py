"""What every loss takes besides its own parameters, in one place: the gathered global batch (`Gathered`), the key
sets it resolves to (`gathered_columns`), and the argument checks the losses share."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .errors import LossInputError
from .tiling import upcast


class Gathered(NamedTuple):
    """The global batch as one rank sees it: the columns (keys) of the losses, against which this rank's own
    features are the rows (queries), and the global index of this rank's first row.

    `gather_batch` builds one on every rank of a distributed run; a caller that splits a batch itself (tests, a
    benchmark of one rank's share) builds it by hand. Every loss function and the objective take it as
    ``gathered=``; None means that this process holds the whole batch. The positive of local row ``i`` is global
    column ``offset + i``. With padded batches (a variable number of pairs per process, `pad_pairs`),
    ``all_valid`` marks the real rows among the M.
    """

    all_image_features: Optional[Tensor]  # (M, D), carries the gradient back to each owner
    all_text_features: Optional[Tensor]  # (M, D); the only columns SigLIP reads
    all_labels: Optional[Tensor] = None  # (M,) long, or None: the supervised term's labels of the columns
    offset: int = 0  # global index of this rank's row 0
    world_size: int = 1  # ranks that hold the M rows (the objective's reductions of its logged numbers)
    all_teacher_image: Optional[Tensor] = None  # (M, Dt), no gradient: the distill term's teacher columns
    all_teacher_text: Optional[Tensor] = None
    all_valid: Optional[Tensor] = None  # (M,) bool, or None: the real rows of padded batches (`pad_pairs`)
    all_short_text: Optional[Tensor] = None  # (M, D), carries the gradient back: the short-caption term's captions


def gathered_columns(image_features: Tensor, text_features: Tensor,
             gathered: Optional[Gathered]) -> Tuple[Tensor, Tensor, int, bool]:
    """The key sets of a two-modality loss: (all_image, all_text, offset, single), single=True when this process
    holds the whole batch (no gathered columns, or columns that are the rows themselves). Call it with the rows
    already upcast (`upcast`); gathered columns come back upcast the same way."""
    if gathered is None:
        return image_features, text_features, 0, True
    all_img, all_txt, offset = gathered.all_image_features, gathered.all_text_features, gathered.offset
    if all_img is None or all_txt is None:
        raise LossInputError("gathered features need both all_image_features and all_text_features")
    n, m = image_features.shape[0], all_img.shape[0]
    if all_img.shape != all_txt.shape or all_img.dim() != 2 or all_img.shape[1] != image_features.shape[1]:
        raise LossInputError(
            f"gathered features must be (M, {image_features.shape[1]}) for both modalities (got "
            f"{tuple(all_img.shape)} and {tuple(all_txt.shape)})"
        )
    check_offset(offset, n, m)
    single = offset == 0 and all_img is image_features and all_txt is text_features
    all_img, all_txt = upcast(all_img, all_txt)
    return all_img, all_txt, offset, single


def check_offset(offset: int, n: int, m: int) -> None:
    if not 0 <= offset <= m - n:
        raise LossInputError(f"offset must be in [0, {m - n}] for {n} local rows of {m} (got {offset})")


def check_pair(image_features: Tensor, text_features: Tensor) -> None:
    if image_features.dim() != 2 or text_features.dim() != 2:
        raise LossInputError(
            f"features must be 2-D (B, D) (got image {tuple(image_features.shape)}, "
            f"text {tuple(text_features.shape)})"
        )
    if image_features.shape != text_features.shape:
        raise LossInputError(
            f"image and text features must have the same shape (got {tuple(image_features.shape)} and "
            f"{tuple(text_features.shape)}, expected equal (B, D))"
        )
    if image_features.shape[0] == 0:
        raise LossInputError("empty batch (got 0 pairs, expected at least 1)")


def check_chunk(chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise LossInputError(f"chunk_size must be a positive integer or None (got {chunk_size!r})")


def check_labels(labels: Optional[Tensor], n: int, device) -> Tensor:
    """(n,) long labels, -1 for "no label" (all -1 when `labels` is None)."""
    if labels is None:
        return torch.full((n,), -1, dtype=torch.long, device=device)
    if labels.shape != (n,) or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise LossInputError(
            f"labels must be an integer tensor of shape ({n},) (got {labels.dtype} {tuple(labels.shape)}); "
            "use -1 for pairs without a label"
        )
    return labels.long()


def check_on_device(condition: Tensor, message: str) -> None:
    """Require a 0-dim bool `condition` without reading it on the host: a device-side assertion on a GPU (no
    wait; a failure stops the run there), `LossInputError` at once on the CPU."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError as e:
        raise LossInputError(message) from e
