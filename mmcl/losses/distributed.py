"""Gathering features across ranks with a gradient-carrying all-gather (`gather_features`), and the global batch
as the losses take it (`gather_batch`, a `Gathered`, with the mask of the real rows of padded batches)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.nn.functional import all_gather

try:
    from torch.distributed._functional_collectives import all_gather_single, wait_tensor
except ImportError:  # an older torch: the autograd all_gather below
    all_gather_single = wait_tensor = None

from .inputs import Gathered, check_labels, check_on_device, check_pair
from .variable_pairs import check_valid


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate `x` (n, ...) of every rank along dim 0, differentiably (backward: summing reduce-scatter).

    torch's functional collective `all_gather_single` where this torch has it, else the older
    `torch.distributed.nn.functional.all_gather`, which torch 2.14 deprecates.
    """
    if all_gather_single is None:

        return torch.cat(all_gather(x.contiguous()), dim=0)
    return wait_tensor(all_gather_single(x.contiguous(), 0, dist.group.WORLD))


def _check_equal_sizes(n: int, world: int, device: torch.device) -> None:
    """Every rank must hold n pairs (the gathers below need equal sizes), checked without reading a device value
    on the host: the sizes are gathered on the device (a fill, not a host-to-device copy) and compared by a
    device-side assertion. On CPU processes a mismatch raises `LossInputError` at once; on a GPU it stops the run
    at the assertion a little later, instead of waiting for the GPU on every step."""
    parts = [torch.empty(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((1,), n, dtype=torch.long, device=device))
    sizes = torch.cat(parts)
    check_on_device((sizes == n).all(), f"every rank must hold the same number of pairs (this rank holds {n}; "
                                         "drop the last partial batch)")


def gather_features(
    image_features: Tensor, text_features: Tensor, labels: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Optional[Tensor], int]:
    """All-gather features over the default process group, keeping the gradient.

    Backward sums the gradients of every rank's copy into the owner's features (the all-gather's backward is a
    summing reduce-scatter), which is what the local-rows / global-columns losses need.

    Args:
        image_features, text_features: (n, D) this rank's features; n must be equal on all ranks.
        labels: optional (n,) long; gathered without gradient.
    Returns:
        (all_image (W*n, D), all_text (W*n, D), all_labels (W*n,) or None, offset = rank * n).
        Without an initialised process group of more than one rank, the inputs unchanged and offset 0.
    """
    if not _distributed():
        return image_features, text_features, labels, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    n = image_features.shape[0]
    _check_equal_sizes(n, world, image_features.device)
    all_image = _all_gather_with_grad(image_features)
    all_text = _all_gather_with_grad(text_features)
    all_labels = None
    if labels is not None:
        gathered = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(gathered, labels.contiguous())
        all_labels = torch.cat(gathered, dim=0)
    return all_image, all_text, all_labels, rank * n


def _all_gather_plain(x: Tensor) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def gather_batch(image_features: Tensor, text_features: Tensor, labels: Optional[Tensor] = None,
                 teacher=None, valid: Optional[Tensor] = None, short_text: Optional[Tensor] = None
                 ) -> Optional[Gathered]:
    """`gather_features` for the objective: a `Gathered` when ``torch.distributed`` runs several ranks, else None
    (one process: the local batch is the global one). ``teacher`` (a `TeacherFeatures`) is gathered too, without
    gradient. ``valid`` ((n,) bool, the real rows of a padded batch from `pad_pairs`; every rank holds the same
    capacity n) is gathered into ``all_valid`` ((W * n,) bool, no gradient). ``short_text`` ((n, D), the short
    captions' features of the short-caption term) is gathered with its gradient into ``all_short_text``. Call it on
    every rank alike."""
    if not _distributed():
        return None
    check_pair(image_features, text_features)  # before any collective, so that no rank waits on a bad one
    if short_text is not None:
        check_pair(image_features, short_text)
    n, device = image_features.shape[0], image_features.device
    if labels is not None:
        labels = check_labels(labels.to(device), n, device)
    if valid is not None:
        valid = check_valid(valid, n, device)
    all_image, all_text, all_labels, offset = gather_features(image_features, text_features, labels)
    extra = {}
    if teacher is not None:
        extra = dict(all_teacher_image=_all_gather_plain(teacher.image.detach()),
                     all_teacher_text=_all_gather_plain(teacher.text.detach()))
    if short_text is not None:
        extra["all_short_text"] = _all_gather_with_grad(short_text)
    if valid is not None:  # as bytes: not every backend reduces bool tensors
        extra["all_valid"] = _all_gather_plain(valid.to(torch.uint8)).bool()
    return Gathered(all_image, all_text, all_labels, offset, dist.get_world_size(), **extra)
