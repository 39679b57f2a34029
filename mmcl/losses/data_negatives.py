"""Negative captions that come with the data (NegCLIP, Yuksekgonul et al. 2023): a sample may carry captions that
do not describe its image (attributes, objects or word order swapped), and each adds a column to its own image's
row of the image-to-text logits, never to another image's row and never a row of its own.

A batch carries them as one `DataNegatives`: the (n, K, D) features of up to K negatives per row and the (n, K)
mask of the real ones (a sample with fewer than K is padded; the mask keeps the padding out of every sum, so the
number per sample varies with no host read). Because a negative is scored against its own image only, its
features never leave the process that holds that image: with the global batch split over ranks, row i's loss is
its gathered columns plus its own negatives, exactly as in one process holding the whole batch, and nothing more
is gathered. The image-to-text loss of row i is then

    -log( exp(L_ii) / (sum_j exp(L_ij) + sum_k exp(s x_i . n_ik)) ),

formed here from the per-row InfoNCE loss ``r_i = lse_i - L_ii`` that the dense or tiled pass gives and the
negatives' gaps ``g_ik = s x_i . (n_ik - y_i)``: ``log(exp(r_i) + sum_k exp(g_ik))``, an (n, K + 1) log-sum-exp
whose every entry is finite or -inf (a padded negative), never a ratio of large numbers. SigLIP scores each real
negative as one more negative pair: ``log sigmoid(-(s x_i . n_ik + b))`` joins the sum over pairs.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .tiling import acc_dtype

# The objective's terms that score data negatives; the others score the pairs as before.
DATA_NEGATIVE_TERMS = ("clip", "siglip")


class DataNegatives(NamedTuple):
    """The negative captions of this process's rows."""

    features: Tensor  # (n, K, D) float: row i's negatives' text features (L2-normalised like the texts)
    valid: Tensor  # (n, K) bool: the real negatives (False: padding of a sample with fewer than K)


def check_negatives(negatives: DataNegatives, image: Tensor) -> DataNegatives:
    """`negatives` for the (n, D) rows `image`, the features in the rows' float dtype (float32 at least); a
    `LossInputError` naming what is wrong otherwise."""
    if not isinstance(negatives, DataNegatives):
        raise LossInputError(f"negatives must be a DataNegatives (got {type(negatives).__name__})")
    feats, valid = negatives
    n, d = image.shape
    if not torch.is_tensor(feats) or feats.dim() != 3 or feats.shape[0] != n or feats.shape[2] != d:
        got = tuple(feats.shape) if torch.is_tensor(feats) else type(feats).__name__
        raise LossInputError(f"negative features must be (n, K, D) = ({n}, K, {d}), one row per image (got {got})")
    if not torch.is_tensor(valid) or valid.dtype != torch.bool or valid.shape != feats.shape[:2]:
        got = f"{valid.dtype} {tuple(valid.shape)}" if torch.is_tensor(valid) else type(valid).__name__
        raise LossInputError(f"the negatives' mask must be a bool tensor of shape {tuple(feats.shape[:2])} (got {got})")
    return DataNegatives(feats.to(image.device, acc_dtype(image.dtype)), valid.to(image.device))


def negative_gaps(image: Tensor, text: Tensor, negatives: DataNegatives, logit_scale: Tensor,
                  rows: Optional[Tensor] = None) -> Tensor:
    """(n, K) ``s x_i . (n_ik - y_i)``: each negative's logit less its row's positive one, -inf where the negative
    is padding (or its row is, `rows` False). `image`, `text` are this process's (n, D) pairs, float32 at least."""
    feats, valid = negatives
    if rows is not None:
        valid = valid & rows[:, None]
    # Elementwise products and a sum, not a matmul: autograd's backward of a matmul would run under the autocast
    # of the backward's caller (bf16), the products keep their dtype (`mmcl.losses.precision`).
    gaps = (image[:, None, :] * (feats - text[:, None, :])).sum(dim=2) * logit_scale
    return gaps.masked_fill(~valid, -math.inf)


def with_negative_columns(per_row: Tensor, gaps: Tensor) -> Tensor:
    """Per-row InfoNCE losses ``r_i = lse_i - L_ii`` with the negatives' columns added to their rows:
    ``log(exp(r_i) + sum_k exp(g_ik))`` for the (n, K) gaps of `negative_gaps` (a row without negatives keeps r_i:
    the log-sum-exp of one finite entry and -infs is that entry, exactly)."""
    return torch.logsumexp(torch.cat([per_row[:, None], gaps.to(per_row.dtype)], dim=1), dim=1)


def negative_pairs_logsigmoid(image: Tensor, negatives: DataNegatives, logit_scale: Tensor, logit_bias: Tensor,
                              rows: Optional[Tensor] = None) -> Tensor:
    """0-dim ``sum_ik log sigmoid(-(s x_i . n_ik + b))`` over the real negatives (of the real rows, `rows`): SigLIP's
    terms of the negatives as negative pairs."""
    feats, valid = negatives
    if rows is not None:
        valid = valid & rows[:, None]
    logits = (image[:, None, :] * feats).sum(dim=2) * logit_scale + logit_bias  # no matmul: see `negative_gaps`
    return F.logsigmoid(-logits).masked_fill(~valid, 0).sum()
