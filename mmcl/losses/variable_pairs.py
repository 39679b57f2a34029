"""A variable number of pairs per process: batches filled to a token budget (native-resolution image towers, NaFlex)
give each process n <= C pairs, C a capacity fixed when the run is built.

Each process pads its n pairs to C rows (`pad_pairs`, which also returns ``valid``, the (C,) mask of the real
rows), so the equal-size all-gather works unchanged (`gather_batch(..., valid=valid)` adds ``all_valid``, the mask
of the W * C gathered rows). The terms in `VARIABLE_PAIR_TERMS` then score exactly the global set of real pairs,
as if no padding were there: padded columns are kept out of every log-sum-exp (their logits are -inf), padded rows
and padded pairs contribute nothing (and get no gradient), and each rank's loss is its sum over its real rows
times ``W / N``, N the global number of real pairs counted on the device from ``all_valid`` (no host read). The
mean over ranks is then the loss of one process holding the N pairs, and after DDP's gradient averaging so are
the gradients; with every rank full this is the equal-size convention (a mean over the rank's rows).

`PairMask` carries the masks and the count to the losses; `masked_geometry` gives the logged align / uniform
metrics over the real rows only.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .geometry import sq_dists
from .inputs import Gathered
from .tiling import acc_dtype

# The objective's terms that take `valid`: the others refuse it (their sums are not written over a mask).
VARIABLE_PAIR_TERMS = ("clip", "siglip")


def pad_pairs(image_features: Tensor, text_features: Tensor, capacity: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Pad this process's (n, D) features with zero rows to (capacity, D).

    Args:
        image_features, text_features: (n, D), 0 <= n <= capacity; the padding keeps their gradient.
        capacity: C, the most pairs a process can hold (the same on every rank).
    Returns:
        (image (C, D), text (C, D), valid (C,) bool, True for the first n rows). n comes from the shape: no
        device value is read on the host.
    """
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise LossInputError(f"capacity must be a positive integer (got {capacity!r})")
    if image_features.dim() != 2 or image_features.shape != text_features.shape:
        raise LossInputError(f"image and text features must be equal (n, D) (got {tuple(image_features.shape)} "
                             f"and {tuple(text_features.shape)})")
    n = image_features.shape[0]
    if n > capacity:
        raise LossInputError(f"this process holds {n} pairs, more than the capacity of {capacity} pairs per process")
    pad = (0, 0, 0, capacity - n)
    valid = torch.arange(capacity, device=image_features.device) < n
    return F.pad(image_features, pad), F.pad(text_features, pad), valid


def check_valid(valid: Tensor, n: int, device: torch.device, name: str = "valid") -> Tensor:
    """`valid` as a (n,) bool tensor on `device`, or a `LossInputError` naming it `name`."""
    if not torch.is_tensor(valid) or valid.dtype != torch.bool or valid.shape != (n,):
        got = f"{valid.dtype} {tuple(valid.shape)}" if torch.is_tensor(valid) else type(valid).__name__
        raise LossInputError(f"{name} must be a bool tensor of shape ({n},), one entry per row (got {got}); "
                             "pad_pairs returns it")
    return valid.to(device)


class PairMask(NamedTuple):
    """The real rows and columns of one rank's loss, and the number of ranks."""

    rows: Tensor  # (n,) bool: this rank's real rows
    cols: Tensor  # (M,) bool: the real rows of the gathered batch (the columns); `rows` in one process
    world: int

    def weight(self, dtype: torch.dtype) -> Tensor:
        """``W / N``, N the global number of real pairs (at least 1), a 0-dim device tensor of `dtype`."""
        return self.world / self.cols.sum().to(dtype).clamp_min(1)

    def column_bias(self, dtype: torch.dtype) -> Tensor:
        """(M,) 0 for a real column, -inf for a padded one: added to the logits, it keeps padding out of sums."""
        return torch.zeros(self.cols.shape, dtype=dtype, device=self.cols.device).masked_fill_(~self.cols, -math.inf)


def pair_mask(valid: Tensor, n: int, device: torch.device, gathered: Optional[Gathered], m: int) -> PairMask:
    """The `PairMask` of a loss over n local rows and m columns: the columns' mask is ``gathered.all_valid``
    (`gather_batch(..., valid=...)`) or, in one process, `valid` itself."""
    rows = check_valid(valid, n, device)
    if gathered is None:
        return PairMask(rows, rows, 1)
    if gathered.all_valid is None:
        raise LossInputError("with valid and gathered features the gathered mask is needed too "
                             "(gathered.all_valid: gather_batch(..., valid=valid))")
    return PairMask(rows, check_valid(gathered.all_valid, m, device, "gathered.all_valid"), gathered.world_size)


def zero_padded(x: Tensor, real: Tensor) -> Tensor:
    """`x` with the rows where `real` is False set to 0 (and their gradient cut): whatever a caller padded with,
    a padded row then adds exactly nothing to any product."""
    return torch.where(real[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.no_grad()
def masked_geometry(image: Tensor, text: Tensor, mask: PairMask, alpha: float, t: float) -> Dict[str, Tensor]:
    """The align / uniform metrics over this rank's real rows, weighted for the objective's mean over ranks.

    ``align`` is this rank's sum over its real pairs times ``W / N``: the mean over ranks is the global mean.
    ``uniform_<modality>`` is uniformity over this rank's real rows, weighted by its share of the real rows of the
    ranks that have at least 2 (nan when none has). The mask's columns hold W blocks of ``len(rows)`` rows."""
    acc = acc_dtype(image.dtype)
    image, text, real = image.to(acc), text.to(acc), mask.rows
    counts = mask.cols.reshape(mask.world, -1)[:, :real.shape[0]].sum(1).to(acc)  # real rows per rank
    local = real.sum().to(acc)
    gaps = (image - text).pow(2).sum(1) if alpha == 2 else (image - text).norm(dim=1).pow(alpha)
    out = {"align": torch.where(real, gaps, 0).sum() * mask.world / counts.sum().clamp_min(1)}
    spread = (counts * (counts >= 2)).sum()
    share = torch.where(spread > 0, mask.world * local * (local >= 2) / spread.clamp_min(1), math.nan)
    pairs = torch.triu(real[:, None] & real[None, :], diagonal=1)
    log_pairs = torch.log((local * (local - 1) / 2).clamp_min(1))
    for name, x in (("uniform_image", image), ("uniform_text", text)):
        d = sq_dists(x, x).masked_fill_(~pairs, math.inf)
        value = torch.logsumexp((-t * d).flatten(), dim=0) - log_pairs
        out[name] = torch.where(local >= 2, value, 0) * share
    return out
