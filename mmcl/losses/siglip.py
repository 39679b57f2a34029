"""SigLIP's pairwise sigmoid loss, dense and tiled (`TiledSigmoidPairs`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .clip import dense_logits
from .data_negatives import DataNegatives, check_negatives, negative_pairs_logsigmoid
from .errors import LossInputError
from .inputs import Gathered, check_chunk, check_offset, check_pair
from .precision import float32_math
from .tiling import acc_dtype, as_scale, tile_positives, tile_width, upcast
from .variable_pairs import PairMask, pair_mask, zero_padded


@float32_math
def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    *,
    gathered: Optional[Gathered] = None,
    chunk_size: Optional[int] = None,
    valid: Optional[Tensor] = None,
    negatives: Optional[DataNegatives] = None,
) -> Tensor:
    """Pairwise sigmoid loss ``-1/n sum_ij log sigmoid(z_ij (s x_i.y_j + b))``, z = +1 on the diagonal, else -1.

    Args:
        image_features, text_features: (n, D) float.  logit_scale, logit_bias: 0-dim tensors (s, b).
        gathered: the global batch (see `clip_loss`), of which only the texts (``all_text_features``, (M, D))
            are read: the rows are this rank's images against every text and the positive of row i is column
            ``offset + i``. The sum over all pairs divided by the global batch size is the mean of the per-rank
            values.
        chunk_size: None computes the (n, M) logits at once; an int sums tiles of ``chunk_size`` rows (by up to
            `tile_elements` / chunk_size columns) with `TiledSigmoidPairs`, each recomputed in the backward pass
            instead of stored, so memory stays a few tiles whatever the batch. The sum is separable over pairs,
            so tiling changes only the order of the additions.
        valid: (n,) bool, the real rows of a padded batch (`pad_pairs`), with ``gathered.all_valid`` the real
            columns: the sum is then over real rows x real columns only, times W / N instead of 1 / n (N the global
            number of real pairs, W the ranks: the mean over ranks is the sum over all real pairs / N).
        negatives: the negative captions that came with this process's rows (`DataNegatives`, NegCLIP): each real
            one is one more negative pair of its own image, ``log sigmoid(-(s x_i . n_ik + b))`` in the sum (the
            divisor stays the number of images).
    Returns:
        0-dim tensor.
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    logit_scale = as_scale(logit_scale, image_features)
    logit_bias = as_scale(logit_bias, image_features)
    image_features, text_features = upcast(image_features, text_features)
    keys, offset = text_features, 0
    if gathered is not None:
        if gathered.all_text_features is None:
            raise LossInputError("the siglip loss needs the gathered texts (got gathered.all_text_features=None)")
        (keys,), offset = upcast(gathered.all_text_features), gathered.offset
        if keys.dim() != 2 or keys.shape[1] != image_features.shape[1]:
            raise LossInputError(f"gathered texts must be (M, {image_features.shape[1]}) (got {tuple(keys.shape)})")
    n, m = image_features.shape[0], keys.shape[0]
    check_offset(offset, n, m)
    if valid is not None:
        mask = pair_mask(valid, n, image_features.device, gathered, m)
        image_features, keys = zero_padded(image_features, mask.rows), zero_padded(keys, mask.cols)
        scale = -mask.weight(image_features.dtype)
    else:
        mask, scale = None, -1.0 / n
    if chunk_size is None:
        total = _siglip_dense(image_features, keys, logit_scale, logit_bias, offset, mask)
    else:
        masks = (None, None) if mask is None else (mask.rows, mask.cols)
        total = TiledSigmoidPairs.apply(image_features, keys, logit_scale, logit_bias, chunk_size, offset, *masks)
    if negatives is not None:
        negatives = check_negatives(negatives, image_features)
        total = total + negative_pairs_logsigmoid(image_features, negatives, logit_scale, logit_bias,
                                                  None if mask is None else mask.rows)
    return total * scale


def _signed_logit_tile(q: Tensor, k: Tensor, scale: Tensor, bias: Tensor, shift: int) -> Tensor:
    """x_ij = z_ij (s q_i.k_j + b) for one tile, z = +1 where j = i + shift, else -1 (a new (c, w) tensor)."""
    x = torch.mm(q, k.T).mul_(scale).add_(bias).neg_()
    tile_positives(x, shift)[0].neg_()
    return x


class TiledSigmoidPairs(torch.autograd.Function):
    """``sum_ij log sigmoid(z_ij (s q_i.k_j + b))`` over all pairs, in tiles, with a hand-written backward.

    Forward keeps no tile: per tile of ``chunk_size`` rows by up to ``tile_elements / chunk_size`` columns it forms
    x = z (s q.k + b) and adds ``min(x, 0) - log1p(exp(-|x|))`` (log sigmoid without overflow). Backward
    recomputes each tile once: ``d/dl log sigmoid(z l) = z sigmoid(-z l)`` gives the tile's logit gradient G,
    then dq = s G k, dk = s G^T q, ds = sum_i q_i . (G k)_i and db = sum G. Sums accumulate in float32 at least.

    Args (apply): queries (n, D), keys (m, D), logit_scale and logit_bias 0-dim, chunk_size int, offset int
    (row i's positive is column ``offset + i``), and optionally row_valid (n,) and col_valid (m,) bool: only the pairs
    of a real row and a real column are summed. Returns a 0-dim tensor, float32 for half inputs.
    """

    @staticmethod
    @float32_math
    def forward(ctx, queries, keys, logit_scale, logit_bias, chunk_size: int, offset: int, row_valid=None,
                col_valid=None):
        acc = acc_dtype(queries.dtype)
        q, k = queries.to(acc), keys.to(acc)
        scale, bias = logit_scale.to(acc), logit_bias.to(acc)
        n, m = q.shape[0], k.shape[0]
        width = tile_width(chunk_size, m, q.device)
        total = torch.zeros((), dtype=acc, device=q.device)
        for i0 in range(0, n, chunk_size):
            qi = q[i0:i0 + chunk_size]
            for j0 in range(0, m, width):
                x = _signed_logit_tile(qi, k[j0:j0 + width], scale, bias, offset + i0 - j0)
                soft = x.abs().neg_().exp_().log1p_()
                terms = x.clamp_(max=0).sub_(soft)
                total += _pair_mask_(terms, row_valid, col_valid, i0, j0).sum()
        ctx.save_for_backward(queries, keys, logit_scale, logit_bias, row_valid, col_valid)
        ctx.chunk_size, ctx.offset = chunk_size, offset
        # The float32 accumulator itself: the sum over n * M pairs overflows fp16 (inf at n = 256, scale 100) and
        # loses ~2 significant digits in bf16 before the division by n.
        return total

    @staticmethod
    @float32_math
    def backward(ctx, grad_out):
        queries, keys, logit_scale, logit_bias, row_valid, col_valid = ctx.saved_tensors
        acc = acc_dtype(queries.dtype)
        q, k = queries.to(acc), keys.to(acc)
        scale, bias = logit_scale.to(acc), logit_bias.to(acc)
        g = grad_out.to(acc)
        n, m = q.shape[0], k.shape[0]
        width = tile_width(ctx.chunk_size, m, q.device)
        dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        ds = torch.zeros((), dtype=acc, device=q.device)
        db = torch.zeros((), dtype=acc, device=q.device)
        for i0 in range(0, n, ctx.chunk_size):
            qi = q[i0:i0 + ctx.chunk_size]
            for j0 in range(0, m, width):
                kj = k[j0:j0 + width]
                shift = ctx.offset + i0 - j0
                x = _signed_logit_tile(qi, kj, scale, bias, shift)
                # G = g z sigmoid(-x): sigmoid(-x) with the sign of z (-1 off the positives).
                grad = x.neg_().sigmoid_().neg_()
                tile_positives(grad, shift)[0].neg_()
                _pair_mask_(grad, row_valid, col_valid, i0, j0).mul_(g)
                gk = grad @ kj
                dq[i0:i0 + ctx.chunk_size] += gk * scale
                dk[j0:j0 + width] += (grad.T @ qi) * scale
                ds += (qi * gk).sum()
                db += grad.sum()
        return (dq.to(queries.dtype), dk.to(keys.dtype), ds.to(logit_scale.dtype).reshape(logit_scale.shape),
                db.to(logit_bias.dtype).reshape(logit_bias.shape), None, None, None, None)


def _pair_mask_(tile: Tensor, row_valid: Optional[Tensor], col_valid: Optional[Tensor], i0: int, j0: int) -> Tensor:
    """`tile` (rows from i0, columns from j0) with the pairs of a padded row or column set to 0, in place (every
    entry is finite, so this drops them exactly); unchanged without masks."""
    if row_valid is None:
        return tile
    rows, cols = row_valid[i0:i0 + tile.shape[0]], col_valid[j0:j0 + tile.shape[1]]
    return tile.masked_fill_(~(rows[:, None] & cols[None, :]), 0)


def _siglip_dense(queries: Tensor, keys: Tensor, logit_scale: Tensor, logit_bias: Tensor, offset: int,
                  mask: Optional[PairMask] = None) -> Tensor:
    """sum_ij log sigmoid(z_ij (s q_i.k_j + b)) from the whole (n, M) logits; row i's positive is column i + offset.
    With `mask`, over the real rows and columns only."""
    logits = dense_logits(queries, keys, logit_scale) + logit_bias.to(acc_dtype(queries.dtype))
    positive = logits.diagonal(offset)
    # Positives are taken out of the all-negative sum by -log sigmoid(-(-inf)) = 0 instead of being
    # subtracted, which would cancel catastrophically for large logits. (F.softplus is avoided: it turns
    # linear above its threshold of 20, an error of e^-20 per pair.)
    negatives = torch.diagonal_scatter(logits, torch.full_like(positive, -math.inf), offset)
    if mask is None:
        return F.logsigmoid(-negatives).sum() + F.logsigmoid(positive).sum()
    pairs = mask.rows[:, None] & mask.cols[None, :]
    return (F.logsigmoid(-negatives).masked_fill(~pairs, 0).sum()
            + F.logsigmoid(positive).masked_fill(~mask.rows, 0).sum())


# ----------------------------------------------------------------------------------------------------------
# Debiased (Chuang et al. 2020) and hard-negative (Robinson et al. 2021) InfoNCE
# ----------------------------------------------------------------------------------------------------------


