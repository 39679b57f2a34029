"""InfoNCE rows and the symmetric CLIP loss (`clip_loss`), dense or tiled."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LossInputError
from .tiling import TiledLogSumExp, _acc_dtype, _as_scale, _check_chunk, _upcast


def logsumexp_rows(
    queries: Tensor, keys: Tensor, logit_scale: Tensor, chunk_size: Optional[int] = None, with_cols: bool = False
):
    """Log-sum-exp over the rows (and columns) of ``L = logit_scale * queries @ keys.T``.

    Args:
        queries: (n, D) float.  keys: (M, D) float, same dtype.  logit_scale: 0-dim tensor.
        chunk_size: None computes L densely; an int uses `TiledLogSumExp` with blocks of that size.
        with_cols: also return the column log-sum-exp.
    Returns:
        row_lse (n,) (float32 for half inputs), and col_lse (M,) when ``with_cols``.
    """
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, queries)
    queries, keys = _upcast(queries, keys)
    if chunk_size is None:
        logits = _dense_logits(queries, keys, logit_scale)
        if with_cols:
            return torch.logsumexp(logits, dim=1), torch.logsumexp(logits, dim=0)
        return torch.logsumexp(logits, dim=1)
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, with_cols)


# ----------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------


def _check_pair(image_features: Tensor, text_features: Tensor) -> None:
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


def _columns(image_features, text_features, all_image_features, all_text_features, offset):
    """Resolve the key sets; returns (all_image, all_text, offset, single) with single=True for one process."""
    if (all_image_features is None) != (all_text_features is None):
        raise LossInputError("pass both all_image_features and all_text_features, or neither")
    if all_image_features is None:
        if offset != 0:
            raise LossInputError(f"offset needs gathered features (got offset={offset} without all_*_features)")
        return image_features, text_features, 0, True
    n, m = image_features.shape[0], all_image_features.shape[0]
    if all_image_features.shape != all_text_features.shape or all_image_features.shape[1] != image_features.shape[1]:
        raise LossInputError(
            f"gathered features must be (M, {image_features.shape[1]}) for both modalities (got "
            f"{tuple(all_image_features.shape)} and {tuple(all_text_features.shape)})"
        )
    if not 0 <= offset <= m - n:
        raise LossInputError(f"offset must be in [0, {m - n}] for {n} local rows of {m} (got {offset})")
    single = offset == 0 and all_image_features is image_features and all_text_features is text_features
    return all_image_features, all_text_features, offset, single


def _positive_logits(queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int) -> Tensor:
    acc = _acc_dtype(queries.dtype)
    positives = keys[offset:offset + queries.shape[0]]
    return logit_scale.to(acc) * torch.linalg.vecdot(queries.to(acc), positives.to(acc))  # (n,)


def _dense_logits(queries: Tensor, keys: Tensor, logit_scale: Tensor) -> Tensor:
    """``s * queries @ keys.T`` built in float32 at least: bf16 logits at scale 100 are off by about 0.4."""
    acc = _acc_dtype(queries.dtype)
    return logit_scale.to(acc) * (queries.to(acc) @ keys.to(acc).T)


# ----------------------------------------------------------------------------------------------------------
# InfoNCE (CLIP)
# ----------------------------------------------------------------------------------------------------------


def infonce_rows(
    queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int = 0, chunk_size: Optional[int] = None
) -> Tensor:
    """Per-row InfoNCE: ``-log softmax(s * queries @ keys.T)[i, offset + i]``.

    Args:
        queries: (n, D) float, this rank's rows.  keys: (M, D) float, all columns (M >= offset + n).
        logit_scale: 0-dim tensor s.  offset: global column of the positive of row 0.
        chunk_size: None for the dense computation, an int for the tiled one.
    Returns:
        (n,) per-row losses (float32 for half inputs).
    """
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, queries)
    queries, keys = _upcast(queries, keys)
    n = queries.shape[0]
    if chunk_size is None:
        logits = _dense_logits(queries, keys, logit_scale)
        target = torch.arange(offset, offset + n, device=queries.device)
        return F.cross_entropy(logits, target, reduction="none")
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, False, offset)


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021): mean of image->text and text->image cross-entropies.

    Args:
        image_features, text_features: (n, D) float, L2-normalised, row i of each is a pair.
        logit_scale: 0-dim tensor s (already exponentiated); logits are ``s * image @ text.T``.
        chunk_size: None is the dense reference; an int computes it in tiles of that many rows with the same
            value and gradients and O((n + M) * D) extra memory plus two tiles.
        all_image_features, all_text_features: (M, D) gathered features of the whole global batch (columns);
            None when this process holds the whole batch.
        offset: global index of local row 0 within the gathered features.
    Returns:
        0-dim tensor, the mean over the local rows of both directions.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, image_features)
    image_features, text_features, all_image_features, all_text_features = _upcast(
        image_features, text_features, all_image_features, all_text_features
    )
    all_img, all_txt, offset, single = _columns(
        image_features, text_features, all_image_features, all_text_features, offset
    )
    if single and chunk_size is None:
        logits = _dense_logits(image_features, text_features, logit_scale)
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    if single:
        # One pass over the blocks gives both directions: the text->image rows are the image->text columns.
        image_to_text, text_to_image = TiledLogSumExp.apply(
            image_features, text_features, logit_scale, chunk_size, True, 0
        )
        return (image_to_text.mean() + text_to_image.mean()) / 2
    image_to_text = infonce_rows(image_features, all_txt, logit_scale, offset, chunk_size)
    text_to_image = infonce_rows(text_features, all_img, logit_scale, offset, chunk_size)
    return (image_to_text.mean() + text_to_image.mean()) / 2


