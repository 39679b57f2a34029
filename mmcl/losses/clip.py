"""InfoNCE rows and the symmetric CLIP loss (`clip_loss`), dense or tiled."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .data_negatives import DataNegatives, check_negatives, negative_gaps, with_negative_columns
from .inputs import Gathered, check_chunk, check_pair, gathered_columns
from .precision import float32_math, scaled_products
from .tiling import (
    TiledLogSumExp,
    acc_dtype,
    as_scale,
    coefficient_floor,
    coefficient_unit,
    exp_,
    finite_or_zero,
    upcast,
)
from .variable_pairs import pair_mask, zero_padded


@float32_math
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
    check_chunk(chunk_size)
    logit_scale = as_scale(logit_scale, queries)
    queries, keys = upcast(queries, keys)
    if chunk_size is None:
        logits = dense_logits(queries, keys, logit_scale)
        if with_cols:
            return DenseLogSumExp.apply(logits, 1), DenseLogSumExp.apply(logits, 0)
        return DenseLogSumExp.apply(logits, 1)
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, with_cols)


def positive_logits(queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int) -> Tensor:
    acc = acc_dtype(queries.dtype)
    positives = keys[offset:offset + queries.shape[0]]
    return logit_scale.to(acc) * torch.linalg.vecdot(queries.to(acc), positives.to(acc))  # (n,)


def dense_logits(queries: Tensor, keys: Tensor, logit_scale: Tensor) -> Tensor:
    """``s * queries @ keys.T`` built in float32 at least: bf16 logits at scale 100 are off by about 0.4."""
    acc = acc_dtype(queries.dtype)
    return scaled_products(queries.to(acc), keys.to(acc), logit_scale.to(acc))


# ----------------------------------------------------------------------------------------------------------
# InfoNCE (CLIP)
# ----------------------------------------------------------------------------------------------------------


def _logsumexp(logits: Tensor, dim: int) -> Tensor:
    """torch.logsumexp with the exp floored as in the tiles (`exp_`): no subnormal is formed."""
    top = finite_or_zero(logits.amax(dim=dim, keepdim=True))
    return (top + torch.log(exp_(logits - top).sum(dim=dim, keepdim=True))).squeeze(dim)


class DenseLogSumExp(torch.autograd.Function):
    """``torch.logsumexp(x, dim)`` whose backward forms no subnormal float (as `DenseInfoNCE`'s).

    Args (apply): x (..., M) float with dim 1 or 0 of a 2-D tensor. Returns the reduced tensor.
    """

    @staticmethod
    @float32_math
    def forward(ctx, x, dim: int):
        lse = _logsumexp(x, dim)
        ctx.dim = dim
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        dim = ctx.dim
        grad = grad.to(x.dtype)
        unit = coefficient_unit([grad], x)
        coef, floor = coefficient_floor(grad, unit, x.shape[dim])
        coef, floor, lse = coef.unsqueeze(dim), floor.unsqueeze(dim), finite_or_zero(lse).unsqueeze(dim)
        out = torch.sub(x, lse)
        return torch.maximum(out, floor, out=out).exp_().mul_(coef).mul_(unit), None


class DenseInfoNCE(torch.autograd.Function):
    """Per-row (and per-column) InfoNCE losses ``lse - L[i, offset + i]`` of a materialised logit matrix L.

    The same numbers as ``F.cross_entropy`` on L (and L.T), with a backward that never forms a subnormal float
    (`coefficient_floor`): at logit scale 100 with aligned pairs (a trained model, or fine-tuning one) nearly
    every softmax entry lies in float32's subnormal range, where x86 runs ~100x slower per element; the dense
    fwd+bwd of `clip_loss` at N = 2048 took 27 s there against 0.3 s at scale 14.3. It also saves only L and
    the log-sum-exps, not a log-softmax per direction.

    Args (apply): logits (n, M) float, offset int, with_cols bool (square L, offset 0). Returns (n,) [and (M,)].
    """

    @staticmethod
    @float32_math
    def forward(ctx, logits, offset: int, with_cols: bool):
        n, m = logits.shape
        rows = torch.arange(n, device=logits.device)
        positive = logits[rows, rows + offset]
        row_lse = _logsumexp(logits, 1)
        col_lse = _logsumexp(logits, 0) if with_cols else logits.new_zeros(0)
        ctx.offset, ctx.with_cols = offset, with_cols
        ctx.save_for_backward(logits, row_lse, col_lse)
        if with_cols:
            return row_lse - positive, col_lse - positive
        return row_lse - positive

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad_row, grad_col=None):
        logits, row_lse, col_lse = ctx.saved_tensors
        n, m = logits.shape
        parts = [(grad_row, row_lse[:, None], 1, m)]
        if ctx.with_cols and grad_col is not None:
            parts.append((grad_col, col_lse[None, :], 0, n))
        parts = [(g.to(logits.dtype), *rest) for g, *rest in parts if g is not None]
        unit = coefficient_unit([g for g, *_ in parts], logits)
        grad, diag = None, torch.zeros(n, dtype=logits.dtype, device=logits.device)
        for g, lse, dim, width in parts:
            coef, floor = coefficient_floor(g, unit, width)
            coef, floor = (coef[:, None], floor[:, None]) if dim == 1 else (coef[None, :], floor[None, :])
            x = torch.sub(logits, lse)
            x = torch.maximum(x, floor, out=x).exp_().mul_(coef)
            grad = x if grad is None else grad.add_(x)
            diag += coef.reshape(-1)[:n]
        if grad is None:
            return None, None, None
        rows = torch.arange(n, device=logits.device)
        grad[rows, rows + ctx.offset] -= diag  # softmax_ii - 1 formed before the scale-up, exactly 0 when dominant
        return grad.mul_(unit), None, None


@float32_math
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
    check_chunk(chunk_size)
    logit_scale = as_scale(logit_scale, queries)
    queries, keys = upcast(queries, keys)
    if chunk_size is None:
        return DenseInfoNCE.apply(dense_logits(queries, keys, logit_scale), offset, False)
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, False, offset)


@float32_math
def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
    valid: Optional[Tensor] = None,
    negatives: Optional[DataNegatives] = None,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021): mean of image->text and text->image cross-entropies.

    Args:
        image_features, text_features: (n, D) float, L2-normalised, row i of each is a pair.
        logit_scale: 0-dim tensor s (already exponentiated); logits are ``s * image @ text.T``.
        chunk_size: None is the dense reference; an int computes it in tiles of that many rows with the same
            value and gradients and O((n + M) * D) extra memory plus two tiles.
        gathered: the whole global batch's features (the columns, (M, D) each) and the global index of local
            row 0 in them; None when this process holds the whole batch.
        valid: (n,) bool, the real rows of a padded batch (`pad_pairs`), with ``gathered.all_valid`` the real
            columns: the loss is then over the real pairs alone (`_masked_clip`).
        negatives: the negative captions that came with this process's rows (`DataNegatives`, NegCLIP): each
            real one adds a column to its own image's row of the image-to-text direction only
            (`mmcl.losses.data_negatives`); the text-to-image direction is unchanged.
    Returns:
        0-dim tensor, the mean over the local rows of both directions (with ``valid``: the sum over the real local
        rows times W / N, N the global number of real pairs).
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    logit_scale = as_scale(logit_scale, image_features)
    image_features, text_features = upcast(image_features, text_features)
    if negatives is not None:
        negatives = check_negatives(negatives, image_features)
    if valid is not None:
        return _masked_clip(image_features, text_features, logit_scale, chunk_size, gathered, valid, negatives)
    all_img, all_txt, offset, single = gathered_columns(image_features, text_features, gathered)
    if single and chunk_size is None:
        image_to_text, text_to_image = DenseInfoNCE.apply(dense_logits(image_features, text_features, logit_scale),
                                                          0, True)
    elif single:
        # One pass over the blocks gives both directions: the text->image rows are the image->text columns.
        image_to_text, text_to_image = TiledLogSumExp.apply(
            image_features, text_features, logit_scale, chunk_size, True, 0
        )
    else:
        image_to_text = infonce_rows(image_features, all_txt, logit_scale, offset, chunk_size)
        text_to_image = infonce_rows(text_features, all_img, logit_scale, offset, chunk_size)
    if negatives is not None:
        image_to_text = with_negative_columns(
            image_to_text, negative_gaps(image_features, text_features, negatives, logit_scale))
    return (image_to_text.mean() + text_to_image.mean()) / 2


def _masked_clip(image: Tensor, text: Tensor, logit_scale: Tensor, chunk_size: Optional[int],
                 gathered: Optional[Gathered], valid: Tensor, negatives: Optional[DataNegatives] = None) -> Tensor:
    """`clip_loss` over the real pairs of padded batches: padded columns enter no log-sum-exp (their logits are
    -inf), padded rows add nothing, and the sum over the real local rows is weighted by W / N (`PairMask`)."""
    all_img, all_txt, offset, _ = gathered_columns(image, text, gathered)
    mask = pair_mask(valid, image.shape[0], image.device, gathered, all_img.shape[0])
    image, text = zero_padded(image, mask.rows), zero_padded(text, mask.rows)
    all_img, all_txt = zero_padded(all_img, mask.cols), zero_padded(all_txt, mask.cols)
    bias = mask.column_bias(image.dtype)
    image_to_text = _biased_infonce_rows(image, all_txt, logit_scale, offset, chunk_size, bias)
    text_to_image = _biased_infonce_rows(text, all_img, logit_scale, offset, chunk_size, bias)
    if negatives is not None:  # a padded row's +inf set to 0 first, so that its log-sum-exp stays finite
        image_to_text = with_negative_columns(torch.where(mask.rows, image_to_text, 0),
                                              negative_gaps(image, text, negatives, logit_scale, mask.rows))
    # A padded row's loss is +inf (its positive column is -inf): `where` drops it, and its gradient with it.
    per_row = torch.where(mask.rows, image_to_text + text_to_image, 0)
    return per_row.sum() * mask.weight(per_row.dtype) / 2


def _biased_infonce_rows(queries: Tensor, keys: Tensor, logit_scale: Tensor, offset: int,
                         chunk_size: Optional[int], bias: Tensor) -> Tensor:
    """`infonce_rows` of the logits plus a (M,) column bias (0 or -inf), dense or tiled."""
    if chunk_size is None:
        return DenseInfoNCE.apply(dense_logits(queries, keys, logit_scale) + bias, offset, False)
    return TiledLogSumExp.apply(queries, keys, logit_scale, chunk_size, False, offset, None, None, False, 0, None,
                                bias)
