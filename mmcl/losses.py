"""Contrastive objectives for image-text pretraining.

Every loss is a pure function of L2-normalised features ``(B, D)`` and the already-exponentiated logit
scale ``s`` (a 0-dim tensor that carries gradient to the learned temperature ``t = log s``).

Distributed layout. The functions never read rank or world size. To train on a global batch split over
ranks, a caller gathers the features of all ranks (`gather_features`, which keeps the gradient and sums it
back in backward) and passes them as ``all_image_features`` / ``all_text_features`` together with
``offset``, the global index of this rank's first row. The local features are then the rows (queries), the
gathered ones the columns (keys), and the positive of local row ``i`` is global column ``offset + i``.
Each rank's loss is the mean over its own rows, so the mean over ranks equals the global-batch loss; with
the summing all-gather backward each rank holds ``W`` times the global gradient of its own features and
DDP's averaging of parameter gradients turns that into exactly the global-batch gradient.

Memory. ``chunk_size`` switches the softmax losses (clip, supcon, debiased, hard-negative) to a tiled
computation (`TiledLogSumExp`): tiles of ``chunk_size`` rows (by up to 2^23 / chunk_size columns) of the
logits are formed, reduced into row and column sums and dropped; backward recomputes each tile once. Extra
memory is O((n + M) * D) plus two tiles instead of O(n * M), with the same value and gradients as the dense
computation, which stays in this module as the specification. SigLIP's sum over pairs is tiled the same way
(`TiledSigmoidPairs`, each tile recomputed once in backward), and MoCHi's real negatives and queue too (its
synthetic negatives are n x (s + s') x D).

`ContrastiveObjective` (built by `build_objective` from `mmcl.config.LossConfig`) combines the weighted
terms, gathers across ranks when ``torch.distributed`` is initialised, and holds the only state: the MoCHi
feature queues and the random generator used to synthesise negatives.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import CheckpointError, ConfigError, DataError

__all__ = [
    "TiledLogSumExp",
    "logsumexp_rows",
    "infonce_rows",
    "clip_loss",
    "supcon_loss",
    "siglip_loss",
    "debiased_clip_loss",
    "hard_negative_clip_loss",
    "mochi_loss",
    "align_loss",
    "uniform_loss",
    "gather_features",
    "FeatureQueue",
    "ContrastiveObjective",
    "build_objective",
]

# Logged metrics only need a sample of the batch; pairwise uniformity is quadratic in it.
_METRIC_MAX_ITEMS = 4096
# Tiles of the logit matrix span chunk_size rows and enough columns to hold about this many logits (32 MiB in
# float32): few, large elementwise kernels (each a thread barrier on CPU, a launch on GPU) at bounded memory.
_TILE_ELEMENTS = 1 << 23


def _tile_width(chunk_size: int, n_cols: int) -> int:
    return min(n_cols, max(chunk_size, _TILE_ELEMENTS // chunk_size))


# ----------------------------------------------------------------------------------------------------------
# Tiled log-sum-exp over the logits s * Q K^T
# ----------------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision features still build their logits and accumulate their sums in float32.
    return torch.promote_types(dtype, torch.float32)


def _finite_or_zero(x: Tensor) -> Tensor:
    # A maximum over an empty set (every entry masked so far) is -inf; shifting by it would give inf - inf.
    return torch.where(x == -math.inf, torch.zeros((), dtype=x.dtype, device=x.device), x)


def _exp_(x: Tensor) -> Tensor:
    """exp of a tile in place, with arguments below log(smallest normal float) + 24 raised to that first.

    Such terms (e^-63 in float32) are far below one ulp of any sum they join (every sum here holds a term equal
    to 1), but as subnormals (also after the backward's multiplication by a gradient >= e^-24) they cost ~100x
    per element on x86, in the exp and in the matmuls: at scale 100 with aligned pairs nearly every negative
    sits ~90 below its row's positive, and one N = 2048 fwd+bwd took 39 s instead of well under one."""
    return x.clamp_(min=math.log(torch.finfo(x.dtype).tiny) + 24).exp_()


def _logit_tile(qs: Tensor, k: Tensor, mask_shift: Optional[int]) -> Tensor:
    """L = qs @ k.T for one tile, with the entries j = i + mask_shift set to -inf when mask_shift is not None."""
    logits = qs @ k.T
    if mask_shift is not None:
        rows, cols = _tile_positives(qs.shape[0], k.shape[0], mask_shift, qs.device)
        logits[rows, cols] = -math.inf
    return logits


class TiledLogSumExp(torch.autograd.Function):
    """Row (and optionally column) log-sum-exp of ``L = s * queries @ keys.T`` without materialising L.

    Tiles are ``chunk_size`` rows by ``max(chunk_size, 2^23 / chunk_size)`` columns (at most M), so memory is
    bounded by two tiles plus the (n + M) x D inputs and gradients, whatever the batch size or logit scale.

    Forward keeps a running maximum and a sum rescaled to it for every row (within a row block) and for every
    column (across row blocks), the online softmax of flash attention in both directions: per tile one
    matmul, the tile's row and column maxima, and exp(L - row max) and exp(L - column max). Every sum is thus
    taken relative to its own largest term, which is exactly 1, so nothing underflows that could matter
    whatever the scale and the alignment of the features (a shift shared by all rows underflows whole rows
    of weakly aligned features at logit scale 100).

    Backward recomputes each tile once and forms ``G = g_row * exp(L - lse_row) + g_col * exp(L - lse_col)``
    (the softmax in each direction, each at most 1: no overflow, and a term underflows only when it is below
    the smallest float relative to its own sum).

    ``positive_offset`` set: the outputs are per-row InfoNCE losses ``lse_i - L[i, offset + i]`` (and for
    columns ``col_lse_j - L[j, j]``, which needs offset 0 and n == M); folding the positive logit in here keeps
    its gradient in the same buffers instead of two more (n, D) tensors.
    ``mask_offset`` set: the entries ``L[i, mask_offset + i]`` are left out of every sum (set to -inf inside
    each tile), which gives the log-sum-exp over negatives only without subtracting the positive afterwards
    (that subtraction cancels completely once the positive dominates its row). Columns need offset 0, n == M.
    ``gammas`` set (a tuple of positive floats, without ``positive_offset``): the log-sum-exps of ``gamma * L``
    for every gamma from the same tiles, one matmul per tile for all of them (the hard-negative loss needs
    gamma = 1 + beta and beta); the outputs are then (G, n) [and (G, M)].

    Args (apply): queries (n, D), keys (M, D), logit_scale 0-dim, chunk_size int, with_cols bool,
    positive_offset int or None, mask_offset int or None, gammas tuple or None. Returns (n,) [and (M,)]; float32
    for half inputs, else the input dtype.
    """

    @staticmethod
    def forward(ctx, queries, keys, logit_scale, chunk_size: int, with_cols: bool, positive_offset=None,
                mask_offset=None, gammas=None):
        acc = _acc_dtype(queries.dtype)
        q32, k32, scale = queries.to(acc), keys.to(acc), logit_scale.to(acc)
        n, m = q32.shape[0], k32.shape[0]
        for off in (positive_offset, mask_offset):
            assert off is None or not with_cols or (off == 0 and n == m), "square batch expected"
        multi = gammas is not None
        gammas = (1.0,) if gammas is None else tuple(float(g) for g in gammas)
        assert all(g > 0 for g in gammas) and (positive_offset is None or not multi), "bad gammas"
        n_g = len(gammas)
        minus_inf = torch.tensor(-math.inf, dtype=acc, device=q32.device)
        row_lse = torch.empty(n_g, n, dtype=acc, device=q32.device)
        row_out = torch.empty(n if positive_offset is not None else 0, dtype=acc, device=q32.device)
        m_cols = m if with_cols else 0
        col_max = minus_inf.expand(m_cols).clone()  # of L; the maximum of gamma * L is gamma times it
        col_sum = torch.zeros(n_g, m_cols, dtype=acc, device=q32.device)
        width = _tile_width(chunk_size, m)
        # The positive logits L[i, offset + i], read from the tiles themselves: lse_i - L_ii is then formed from
        # the same rounded number on both sides, exactly 0 + log(sum) when the positive is the row's maximum.
        positive = torch.zeros(n if positive_offset is not None else 0, dtype=acc, device=q32.device)

        def scaled_exp(x, g, last):
            # exp(g * x), reusing x's storage for the last gamma
            if g != 1.0:
                return _exp_(x.mul_(g) if last else torch.mul(x, g))
            return _exp_(x if last else x.clone())

        for i0 in range(0, n, chunk_size):
            qs = q32[i0:i0 + chunk_size] * scale  # (c, D): the scale folded into the smaller operand
            r_max = minus_inf.expand(qs.shape[0]).clone()
            r_sum = torch.zeros(n_g, qs.shape[0], dtype=acc, device=q32.device)
            for j0 in range(0, m, width):
                j1 = min(m, j0 + width)
                logits = _logit_tile(qs, k32[j0:j1], None if mask_offset is None else mask_offset + i0 - j0)
                if positive_offset is not None:
                    rows, cols = _tile_positives(qs.shape[0], j1 - j0, positive_offset + i0 - j0, q32.device)
                    positive[i0 + rows] = logits[rows, cols]
                new_max = torch.maximum(r_max, logits.amax(dim=1))
                shift = _finite_or_zero(new_max)
                d = torch.sub(logits, shift[:, None])
                for gi, g in enumerate(gammas):
                    e = scaled_exp(d, g, gi == n_g - 1)
                    r_sum[gi] = r_sum[gi] * torch.exp(g * (r_max - shift)) + e.sum(dim=1)
                r_max = new_max
                if with_cols:
                    c_max = col_max[j0:j1]
                    new_c = torch.maximum(c_max, logits.amax(dim=0))
                    shift_c = _finite_or_zero(new_c)
                    d = logits.sub_(shift_c)
                    for gi, g in enumerate(gammas):
                        e = scaled_exp(d, g, gi == n_g - 1)
                        col_sum[gi, j0:j1] = col_sum[gi, j0:j1] * torch.exp(g * (c_max - shift_c)) + e.sum(dim=0)
                    col_max[j0:j1] = new_c
                del logits, d, e
            for gi, g in enumerate(gammas):
                row_lse[gi, i0:i0 + chunk_size] = g * r_max + torch.log(r_sum[gi])
                if positive_offset is not None:  # (max - positive) + log(sum): no cancellation of two large terms
                    row_out[i0:i0 + chunk_size] = (r_max - positive[i0:i0 + chunk_size]) + torch.log(r_sum[gi])
        col_lse = torch.stack([g * col_max for g in gammas]) + torch.log(col_sum)
        ctx.chunk_size, ctx.with_cols, ctx.gammas, ctx.multi = chunk_size, with_cols, gammas, multi
        ctx.positive_offset, ctx.mask_offset = positive_offset, mask_offset
        ctx.save_for_backward(queries, keys, logit_scale, row_lse, col_lse)
        if positive_offset is not None:
            row_lse = row_out
            col_lse = (col_max - positive) + torch.log(col_sum[0]) if with_cols else None
        elif not multi:
            row_lse, col_lse = row_lse[0], col_lse[0]
        if with_cols:
            return row_lse, col_lse
        return row_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_row: Optional[Tensor], grad_col: Optional[Tensor] = None, *unused):
        queries, keys, logit_scale, row_lse, col_lse = ctx.saved_tensors
        c, mask_offset, gammas = ctx.chunk_size, ctx.mask_offset, ctx.gammas
        acc = _acc_dtype(queries.dtype)
        q32, k32, scale = queries.to(acc), keys.to(acc), logit_scale.to(acc)
        n, m = q32.shape[0], k32.shape[0]
        grad_q = torch.zeros_like(q32)  # sum_j G_ij k_j
        grad_k = torch.zeros_like(k32)  # sum_i G_ij q_i
        # One term per (gamma, direction) with a gradient: d lse_gamma / dL = gamma * softmax(gamma L), formed as
        # exp(gamma L - lse) times gamma * g. (Folding log(gamma g) into the shift would save a pass but round
        # the shift at the size of lse: a relative error of ~1e-5 on every softmax entry at scale 100, and
        # softmax_ii - 1 would no longer vanish where the positive dominates.)
        terms = []  # (gamma, is_row, lse, coefficient)
        diag = torch.zeros(n if ctx.positive_offset is not None else 0, dtype=acc, device=q32.device)
        for is_row, grad, lse in ((True, grad_row, row_lse), (False, grad_col if ctx.with_cols else None, col_lse)):
            if grad is None:
                continue
            grad = grad.to(acc).reshape(len(gammas), -1)
            if ctx.positive_offset is not None:
                diag += grad[0]  # d(-L[i, off+i]) / dL = -1 at the positive, from rows and from columns
            for gi, g in enumerate(gammas):
                terms.append((g, is_row, _finite_or_zero(lse[gi]), grad[gi] * g))
        width = _tile_width(c, m)
        if terms:
            for i0 in range(0, n, c):
                q_raw = q32[i0:i0 + c]
                qs = q_raw * scale
                for j0 in range(0, m, width):
                    j1 = min(m, j0 + width)
                    k = k32[j0:j1]
                    logits = _logit_tile(qs, k, None if mask_offset is None else mask_offset + i0 - j0)
                    g_tile = None
                    for t, (g, is_row, lse, coef) in enumerate(terms):
                        sh = lse[i0:i0 + c, None] if is_row else lse[None, j0:j1]
                        if t < len(terms) - 1:
                            x = torch.add(-sh, logits, alpha=g)  # g * L - lse in one pass, L kept
                        else:
                            x = (logits if g == 1.0 else logits.mul_(g)).sub_(sh)
                        _exp_(x).mul_(coef[i0:i0 + c, None] if is_row else coef[None, j0:j1])
                        g_tile = x if g_tile is None else g_tile.add_(x)
                    if ctx.positive_offset is not None:
                        # The -1 of the positive inside the tile, so that softmax_ii - 1 is formed before the
                        # matmul (exactly 0 when the positive dominates) instead of cancelling after it.
                        rows, cols = _tile_positives(q_raw.shape[0], j1 - j0, ctx.positive_offset + i0 - j0,
                                                     q32.device)
                        g_tile[rows, cols] -= diag[i0 + rows]
                    grad_q[i0:i0 + c].addmm_(g_tile, k)
                    grad_k[j0:j1].addmm_(g_tile.T, q_raw)
                    del logits, g_tile, x
        # dL/ds = sum_ij G_ij q_i.k_j = sum_i q_i . (G K)_i, which reuses the unscaled query gradient.
        grad_scale = torch.dot(q32.reshape(-1), grad_q.reshape(-1))
        return (
            grad_q.mul_(scale).to(queries.dtype),
            grad_k.mul_(scale).to(keys.dtype),
            grad_scale.to(logit_scale.dtype).reshape(logit_scale.shape),
            None,
            None,
            None,
            None,
            None,
        )


def _check_chunk(chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ConfigError(f"chunk_size must be a positive integer or None (got {chunk_size!r})")


def _as_scale(logit_scale, like: Tensor) -> Tensor:
    # In float32 at least, like the features after `_upcast`.
    if not torch.is_tensor(logit_scale):
        return torch.tensor(float(logit_scale), dtype=_acc_dtype(like.dtype), device=like.device)
    if logit_scale.numel() != 1:
        raise ConfigError(f"logit_scale must be a scalar (got shape {tuple(logit_scale.shape)}, expected ())")
    return logit_scale.reshape(()).to(_acc_dtype(logit_scale.dtype))


def _upcast(*features: Optional[Tensor]):
    """Half-precision features as float32 (others unchanged): logits, log-sum-exps and every sum are then
    float32, and the gradients of a feature's several uses (as a row and as a column, in the positive) add up
    in float32 behind the one cast, rounded to the input dtype once."""
    return tuple(None if x is None else x.to(_acc_dtype(x.dtype)) for x in features)


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
        raise DataError(
            f"features must be 2-D (B, D) (got image {tuple(image_features.shape)}, "
            f"text {tuple(text_features.shape)})"
        )
    if image_features.shape != text_features.shape:
        raise DataError(
            f"image and text features must have the same shape (got {tuple(image_features.shape)} and "
            f"{tuple(text_features.shape)}, expected equal (B, D))"
        )
    if image_features.shape[0] == 0:
        raise DataError("empty batch (got 0 pairs, expected at least 1)")


def _columns(image_features, text_features, all_image_features, all_text_features, offset):
    """Resolve the key sets; returns (all_image, all_text, offset, single) with single=True for one process."""
    if (all_image_features is None) != (all_text_features is None):
        raise ConfigError("pass both all_image_features and all_text_features, or neither")
    if all_image_features is None:
        if offset != 0:
            raise ConfigError(f"offset needs gathered features (got offset={offset} without all_*_features)")
        return image_features, text_features, 0, True
    n, m = image_features.shape[0], all_image_features.shape[0]
    if all_image_features.shape != all_text_features.shape or all_image_features.shape[1] != image_features.shape[1]:
        raise DataError(
            f"gathered features must be (M, {image_features.shape[1]}) for both modalities (got "
            f"{tuple(all_image_features.shape)} and {tuple(all_text_features.shape)})"
        )
    if not 0 <= offset <= m - n:
        raise ConfigError(f"offset must be in [0, {m - n}] for {n} local rows of {m} (got {offset})")
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


def _check_labels(labels: Optional[Tensor], n: int, device) -> Tensor:
    if labels is None:
        return torch.full((n,), -1, dtype=torch.long, device=device)
    if labels.shape != (n,) or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise DataError(
            f"labels must be an integer tensor of shape ({n},) (got {labels.dtype} {tuple(labels.shape)}); "
            "use -1 for pairs without a label"
        )
    return labels.long()


def _supcon_rows_dense(queries, keys, logit_scale, q_labels, k_labels, offset):
    n = queries.shape[0]
    log_prob = torch.log_softmax(_dense_logits(queries, keys, logit_scale), dim=1)  # (n, M)
    rows = torch.arange(n, device=queries.device)
    positive = (q_labels[:, None] == k_labels[None, :]) & (q_labels[:, None] >= 0)
    positive[rows, rows + offset] = True  # the pair itself, also for unlabelled (-1) pairs
    return -(log_prob * positive).sum(dim=1) / positive.sum(dim=1)


def _positive_means(keys, q_labels, k_labels, offset):
    """Mean of each query's positive keys, (n, D): its class mean, or its own pair when unlabelled."""
    n, d = q_labels.shape[0], keys.shape[1]
    classes, inverse = torch.unique(torch.cat([q_labels, k_labels]), return_inverse=True)
    q_cls, k_cls = inverse[:n], inverse[n:]
    spare = classes.numel()  # bucket collecting unlabelled keys, never read
    k_cls = torch.where(k_labels >= 0, k_cls, spare)
    sums = keys.new_zeros(spare + 1, d).index_add(0, k_cls, keys)
    counts = torch.zeros(spare + 1, dtype=keys.dtype, device=keys.device).index_add(
        0, k_cls, torch.ones_like(k_cls, dtype=keys.dtype)
    )
    own = keys[offset:offset + n]
    means = sums[q_cls] / counts[q_cls][:, None]
    return torch.where((q_labels >= 0)[:, None], means, own)


def supcon_loss(
    image_features: Tensor,
    text_features: Tensor,
    labels: Optional[Tensor],
    logit_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    all_labels: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Cross-modal supervised contrastive loss (Khosla et al. 2020, the L_out form).

    The positives of an image are all texts with the same label (and its own caption); per anchor the loss is
    the mean over its positives of ``-log softmax``; anchors are averaged and both directions averaged. A label
    of -1 means "no label": that pair's only positive is its own caption, so with all labels distinct or -1
    this equals `clip_loss`.

    Where this differs from the authors' SupContrast code: there the anchors and the contrasted set are the
    2N augmented views of one modality, the anchor itself is left out of the denominator and of its
    positives, and unlabelled samples do not exist. Here the anchors are one modality and the contrasted set
    the other (the denominator runs over all M keys, like CLIP's), and the own caption is always a positive.

    Args:
        image_features, text_features: (n, D) float, L2-normalised.  labels: (n,) integer or None (all -1).
        logit_scale: 0-dim tensor s.  chunk_size: None (dense) or block size of the tiled log-sum-exp; the
            positive term is linear in the keys, so the tiled path needs O((n + M + classes) * D) memory.
        all_image_features, all_text_features, all_labels, offset: the gathered global batch (see `clip_loss`).
    Returns:
        0-dim tensor.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, image_features)
    image_features, text_features, all_image_features, all_text_features = _upcast(
        image_features, text_features, all_image_features, all_text_features
    )
    n = image_features.shape[0]
    labels = _check_labels(labels, n, image_features.device)
    all_img, all_txt, offset, single = _columns(
        image_features, text_features, all_image_features, all_text_features, offset
    )
    if single:
        all_labels = labels
    else:
        all_labels = _check_labels(all_labels, all_img.shape[0], image_features.device)
        if not torch.equal(all_labels[offset:offset + n], labels):
            raise DataError(f"all_labels[{offset}:{offset + n}] must equal this rank's labels")
    if chunk_size is None:
        i2t = _supcon_rows_dense(image_features, all_txt, logit_scale, labels, all_labels, offset)
        t2i = _supcon_rows_dense(text_features, all_img, logit_scale, labels, all_labels, offset)
        return (i2t.mean() + t2i.mean()) / 2
    if single:
        lse_i2t, lse_t2i = TiledLogSumExp.apply(image_features, text_features, logit_scale, chunk_size, True)
    else:
        lse_i2t = TiledLogSumExp.apply(image_features, all_txt, logit_scale, chunk_size, False)
        lse_t2i = TiledLogSumExp.apply(text_features, all_img, logit_scale, chunk_size, False)
    # mean_{p in P(i)} -log softmax_ip = lse_i - s * q_i . mean_{p in P(i)} k_p
    acc = _acc_dtype(image_features.dtype)
    pos_i2t = _positive_logits(image_features, _positive_means(all_txt.to(acc), labels, all_labels, offset),
                               logit_scale, 0)
    pos_t2i = _positive_logits(text_features, _positive_means(all_img.to(acc), labels, all_labels, offset),
                               logit_scale, 0)
    return ((lse_i2t - pos_i2t).mean() + (lse_t2i - pos_t2i).mean()) / 2


# ----------------------------------------------------------------------------------------------------------
# SigLIP (Zhai et al. 2023)
# ----------------------------------------------------------------------------------------------------------


def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    *,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Pairwise sigmoid loss ``-1/n sum_ij log sigmoid(z_ij (s x_i.y_j + b))``, z = +1 on the diagonal, else -1.

    Args:
        image_features, text_features: (n, D) float.  logit_scale, logit_bias: 0-dim tensors (s, b).
        all_text_features: (M, D) gathered texts of the global batch; then the rows are this rank's images
            against every text and the positive of row i is column ``offset + i``. The sum over all pairs
            divided by the global batch size is the mean of the per-rank values.
        chunk_size: None computes the (n, M) logits at once; an int sums tiles of ``chunk_size`` rows (by up to
            2^23 / chunk_size columns) with `TiledSigmoidPairs`, each recomputed in the backward pass instead of
            stored, so memory stays a few tiles whatever the batch. The sum is separable over pairs, so tiling
            changes only the order of the additions.
    Returns:
        0-dim tensor.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    logit_scale = _as_scale(logit_scale, image_features)
    logit_bias = _as_scale(logit_bias, image_features)
    image_features, text_features, all_text_features = _upcast(image_features, text_features, all_text_features)
    keys = text_features if all_text_features is None else all_text_features
    n, m = image_features.shape[0], keys.shape[0]
    if all_text_features is None and offset != 0:
        raise ConfigError(f"offset needs gathered features (got offset={offset} without all_text_features)")
    if not 0 <= offset <= m - n:
        raise ConfigError(f"offset must be in [0, {m - n}] for {n} local rows of {m} (got {offset})")
    if chunk_size is None:
        return -_siglip_dense(image_features, keys, logit_scale, logit_bias, offset) / n
    return -TiledSigmoidPairs.apply(image_features, keys, logit_scale, logit_bias, chunk_size, offset) / n


def _tile_positives(n_rows: int, n_cols: int, shift: int, device) -> Tuple[Tensor, Tensor]:
    """(rows, cols) of the positives j = i + shift that fall inside an (n_rows, n_cols) tile."""
    rows = torch.arange(n_rows, device=device)
    rows = rows[(rows + shift >= 0) & (rows + shift < n_cols)]
    return rows, rows + shift


def _signed_logit_tile(q: Tensor, k: Tensor, scale: Tensor, bias: Tensor, shift: int) -> Tensor:
    """x_ij = z_ij (s q_i.k_j + b) for one tile, z = +1 where j = i + shift, else -1 (a new (c, w) tensor)."""
    x = torch.mm(q, k.T).mul_(scale).add_(bias).neg_()
    rows, cols = _tile_positives(q.shape[0], k.shape[0], shift, q.device)
    x[rows, cols] = -x[rows, cols]
    return x


class TiledSigmoidPairs(torch.autograd.Function):
    """``sum_ij log sigmoid(z_ij (s q_i.k_j + b))`` over all pairs, in tiles, with a hand-written backward.

    Forward keeps no tile: per tile of ``chunk_size`` rows by up to ``2^23 / chunk_size`` columns it forms
    x = z (s q.k + b) and adds ``min(x, 0) - log1p(exp(-|x|))`` (log sigmoid without overflow). Backward
    recomputes each tile once: ``d/dl log sigmoid(z l) = z sigmoid(-z l)`` gives the tile's logit gradient G,
    then dq = s G k, dk = s G^T q, ds = sum_i q_i . (G k)_i and db = sum G. Sums accumulate in float32 at least.

    Args (apply): queries (n, D), keys (m, D), logit_scale and logit_bias 0-dim, chunk_size int, offset int
    (row i's positive is column ``offset + i``). Returns a 0-dim tensor, float32 for half inputs.
    """

    @staticmethod
    def forward(ctx, queries, keys, logit_scale, logit_bias, chunk_size: int, offset: int):
        acc = _acc_dtype(queries.dtype)
        q, k = queries.to(acc), keys.to(acc)
        scale, bias = logit_scale.to(acc), logit_bias.to(acc)
        n, m = q.shape[0], k.shape[0]
        width = _tile_width(chunk_size, m)
        total = torch.zeros((), dtype=acc, device=q.device)
        for i0 in range(0, n, chunk_size):
            qi = q[i0:i0 + chunk_size]
            for j0 in range(0, m, width):
                x = _signed_logit_tile(qi, k[j0:j0 + width], scale, bias, offset + i0 - j0)
                soft = x.abs().neg_().exp_().log1p_()
                total += x.clamp_(max=0).sub_(soft).sum()
        ctx.save_for_backward(queries, keys, logit_scale, logit_bias)
        ctx.chunk_size, ctx.offset = chunk_size, offset
        # The float32 accumulator itself: the sum over n * M pairs overflows fp16 (inf at n = 256, scale 100) and
        # loses ~2 significant digits in bf16 before the division by n.
        return total

    @staticmethod
    def backward(ctx, grad_out):
        queries, keys, logit_scale, logit_bias = ctx.saved_tensors
        acc = _acc_dtype(queries.dtype)
        q, k = queries.to(acc), keys.to(acc)
        scale, bias = logit_scale.to(acc), logit_bias.to(acc)
        g = grad_out.to(acc)
        n, m = q.shape[0], k.shape[0]
        width = _tile_width(ctx.chunk_size, m)
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
                rows, cols = _tile_positives(qi.shape[0], kj.shape[0], shift, q.device)
                grad[rows, cols] = -grad[rows, cols]
                grad.mul_(g)
                gk = grad @ kj
                dq[i0:i0 + ctx.chunk_size] += gk * scale
                dk[j0:j0 + width] += (grad.T @ qi) * scale
                ds += (qi * gk).sum()
                db += grad.sum()
        return (dq.to(queries.dtype), dk.to(keys.dtype), ds.to(logit_scale.dtype).reshape(logit_scale.shape),
                db.to(logit_bias.dtype).reshape(logit_bias.shape), None, None)


def _siglip_dense(queries: Tensor, keys: Tensor, logit_scale: Tensor, logit_bias: Tensor, offset: int) -> Tensor:
    """sum_ij log sigmoid(z_ij (s q_i.k_j + b)) from the whole (n, M) logits; row i's positive is column i + offset."""
    logits = _dense_logits(queries, keys, logit_scale) + logit_bias.to(_acc_dtype(queries.dtype))
    rows, cols = _tile_positives(queries.shape[0], keys.shape[0], offset, logits.device)
    positive = logits[rows, cols]
    # Positives are taken out of the all-negative sum by -log sigmoid(-(-inf)) = 0 instead of being
    # subtracted, which would cancel catastrophically for large logits. (F.softplus is avoided: it turns
    # linear above its threshold of 20, an error of e^-20 per pair.)
    minus_inf = torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device)
    negatives = logits.index_put((rows, cols), minus_inf)
    return F.logsigmoid(-negatives).sum() + F.logsigmoid(positive).sum()


# ----------------------------------------------------------------------------------------------------------
# Debiased (Chuang et al. 2020) and hard-negative (Robinson et al. 2021) InfoNCE
# ----------------------------------------------------------------------------------------------------------


def _negative_lse(image_features, text_features, all_img, all_txt, logit_scale, gammas, offset, chunk_size,
                  single):
    """Per gamma, the (n,) image->text and (n,) text->image log sums over the negatives j != offset+i of
    exp(gamma * s * q_i.k_j): a list of (i2t, t2i) pairs, one per gamma.

    The positive is excluded inside the sum (masked to -inf), never subtracted from the full log-sum-exp:
    log(e^lse - e^p) cancels completely once the positive dominates its row (a trained model at scale 100).
    All gammas come from one logit matrix (one pass over the tiles), and with the whole batch in this process
    both directions too.
    """
    if chunk_size is None:
        def masked(q, k):
            logits = _dense_logits(q, k, logit_scale)
            rows = torch.arange(q.shape[0], device=q.device)
            minus_inf = torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device)
            return logits.index_put((rows, rows + offset), minus_inf)

        if single:
            logits = masked(image_features, text_features)
            return [(torch.logsumexp(g * logits, dim=1), torch.logsumexp(g * logits, dim=0)) for g in gammas]
        i2t, t2i = masked(image_features, all_txt), masked(text_features, all_img)
        return [(torch.logsumexp(g * i2t, dim=1), torch.logsumexp(g * t2i, dim=1)) for g in gammas]
    if single:
        rows, cols = TiledLogSumExp.apply(image_features, text_features, logit_scale, chunk_size, True, None, 0,
                                          gammas)
        return list(zip(rows.unbind(0), cols.unbind(0)))
    i2t = TiledLogSumExp.apply(image_features, all_txt, logit_scale, chunk_size, False, None, offset, gammas)
    t2i = TiledLogSumExp.apply(text_features, all_img, logit_scale, chunk_size, False, None, offset, gammas)
    return list(zip(i2t.unbind(0), t2i.unbind(0)))


def _reweighted_rows(positive, log_neg, logit_scale, n_neg, tau_plus):
    """Per-row loss of Robinson et al. (2021) from the positive logit and the log of the reweighted negative sum."""
    shift = torch.maximum(positive, log_neg).detach()
    pos_e = torch.exp(positive - shift)
    neg_g = (torch.exp(log_neg - shift) - tau_plus * n_neg * pos_e) / (1 - tau_plus)
    # The estimator is floored at its theoretical minimum N e^{-s} (all negatives at cosine -1); the floor is
    # a safeguard, not something the temperature should be trained against, hence detached.
    floor = (n_neg * torch.exp(-logit_scale.detach().to(shift.dtype) - shift)).detach()
    neg_g = torch.maximum(neg_g, floor)
    return torch.log(pos_e + neg_g) + shift - positive


def _check_tau_beta(tau_plus: float, beta: float = 0.0) -> None:
    if not 0 <= tau_plus < 1:
        raise ConfigError(f"tau_plus must be in [0, 1) (got {tau_plus})")
    if beta < 0:
        raise ConfigError(f"hard-negative beta must be >= 0 (got {beta})")


def hard_negative_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    tau_plus: float,
    beta: float,
    chunk_size: Optional[int] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Hard-negative reweighted debiased InfoNCE (Robinson et al. 2021), symmetric over both directions.

    Per query with positive logit p and the N = M - 1 other keys as negatives (logits L_j = s q.k_j):
    ``Ng = max((N * sum_j e^{(1+beta) L_j} / sum_j e^{beta L_j} - tau_plus N e^p) / (1 - tau_plus), N e^{-s})``
    and ``loss = -log(e^p / (e^p + Ng))``; beta = 0 is the debiased loss of Chuang et al. (2020), and
    beta = tau_plus = 0 is InfoNCE.

    Where this differs from the authors' code (DCL, HCL): there the negatives of an anchor are the 2B - 2 other
    views of a two-view batch of one modality (N = 2B - 2); here they are the M - 1 other items of the other
    modality (N = M - 1). Their floor ``N e^{-1/t}`` is a constant of the fixed temperature; with the learned
    scale here the floor ``N e^{-s}`` is detached, so it never trains the temperature. The negatives-only sums
    leave the positive out inside the sum (dense and tiled alike), never by subtraction, so they stay exact
    when the positive dominates its row.

    Args:
        image_features, text_features: (n, D) float, L2-normalised.  logit_scale: 0-dim tensor s.
        tau_plus: class prior in [0, 1).  beta: concentration >= 0.
        chunk_size, all_image_features, all_text_features, offset: as in `clip_loss`.
    Returns:
        0-dim tensor.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    _check_tau_beta(tau_plus, beta)
    logit_scale = _as_scale(logit_scale, image_features)
    image_features, text_features, all_image_features, all_text_features = _upcast(
        image_features, text_features, all_image_features, all_text_features
    )
    all_img, all_txt, offset, single = _columns(
        image_features, text_features, all_image_features, all_text_features, offset
    )
    if all_img.shape[0] < 2:
        raise DataError(f"debiased / hard-negative losses need at least 2 pairs in the batch (got {all_img.shape[0]})")
    n_neg = all_img.shape[0] - 1
    # Importance weights exp(beta * L) normalised by their mean: the reweighted negative sum is
    # N * sum exp((1+beta) L) / sum exp(beta L), whose log is a difference of two log-sum-exps.
    gammas = (1.0 + beta, beta) if beta != 0 else (1.0,)
    lse = _negative_lse(image_features, text_features, all_img, all_txt, logit_scale, gammas, offset, chunk_size,
                        single)
    log_neg = lse[0] if beta == 0 else tuple(a - b + math.log(n_neg) for a, b in zip(lse[0], lse[1]))
    i2t = _reweighted_rows(_positive_logits(image_features, all_txt, logit_scale, offset), log_neg[0], logit_scale,
                           n_neg, tau_plus)
    t2i = _reweighted_rows(_positive_logits(text_features, all_img, logit_scale, offset), log_neg[1], logit_scale,
                           n_neg, tau_plus)
    return (i2t.mean() + t2i.mean()) / 2


def debiased_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    tau_plus: float,
    chunk_size: Optional[int] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
) -> Tensor:
    """Debiased contrastive loss (Chuang et al. 2020), symmetric; `hard_negative_clip_loss` with beta = 0."""
    return hard_negative_clip_loss(
        image_features, text_features, logit_scale, tau_plus, 0.0, chunk_size,
        all_image_features=all_image_features, all_text_features=all_text_features, offset=offset,
    )


# ----------------------------------------------------------------------------------------------------------
# MoCHi (Kalantidis et al. 2020)
# ----------------------------------------------------------------------------------------------------------


def _mochi_rows(queries, keys, queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                chunk_size=None):
    """Per-row InfoNCE over [positive, real negatives, synthetic hard negatives] for one direction.

    With `chunk_size` the (n, M + Q) logits are never formed: the hardest negatives are ranked in row blocks
    without autograd, the log-sum-exp over real negatives and queue is tiled (`logsumexp_rows`), and it is
    combined with the synthetic negatives' log-sum-exp; the same value and gradients as the dense form.
    """
    n, m = queries.shape[0], keys.shape[0]
    acc = _acc_dtype(queries.dtype)  # hard-negative ranking, synthetic features and logits in float32 at least
    n_queue = 0 if queue is None else queue.shape[0]
    k = min(n_hard, m - 1 + n_queue)
    rows = torch.arange(n, device=queries.device)
    # Draws are made for all M queries of the global batch and sliced at this rank's offset, so every rank
    # (sharing one seed) synthesises exactly what a single process holding the global batch would.
    pairs = torch.randint(0, max(k, 1), (m, s, 2), generator=generator)[offset:offset + n].to(queries.device)
    alpha = torch.rand(m, s, 1, generator=generator)[offset:offset + n].to(queries.device, acc)
    picks = torch.randint(0, max(k, 1), (m, s_prime), generator=generator)[offset:offset + n].to(queries.device)
    beta = (torch.rand(m, s_prime, 1, generator=generator) * mix_max)[offset:offset + n].to(
        queries.device, acc
    )
    if queue is not None and n_queue > 0:
        queue = queue.detach().to(acc)
    else:
        queue = None

    synthetic_logits = None
    if k > 0 and s + s_prime > 0:
        with torch.no_grad():
            q = queries.detach().to(acc)
            candidates = keys.detach().to(acc)
            candidates = candidates if queue is None else torch.cat([candidates, queue])  # (M+Q, D)
            block = n if chunk_size is None else chunk_size
            hard = []
            for i0 in range(0, n, block):
                here = rows[i0:i0 + block]
                sims = q[i0:i0 + block] @ candidates.T
                sims[here - i0, here + offset] = -math.inf  # the positive is not a negative
                hard.append(sims.topk(k, dim=1).indices)  # hardest first
            hard = torch.cat(hard)  # (n, k)
        draws = (pairs, alpha, picks, beta)
        if chunk_size is None:
            synthetic_logits = _synthetic_logits(queries, candidates, hard, draws, logit_scale)
        else:
            # Each block's synthetic features (c, s + s', D) are rebuilt in backward instead of kept.
            from torch.utils.checkpoint import checkpoint

            synthetic_logits = torch.cat([
                checkpoint(_synthetic_logits, queries[i0:i0 + chunk_size], candidates, hard[i0:i0 + chunk_size],
                           tuple(d[i0:i0 + chunk_size] for d in draws), logit_scale, use_reentrant=False)
                for i0 in range(0, n, chunk_size)])

    if chunk_size is not None:
        real = keys if queue is None else torch.cat([keys.to(acc), queue])
        lse = logsumexp_rows(queries, real, logit_scale, chunk_size)
        if synthetic_logits is not None:
            lse = torch.logaddexp(lse, torch.logsumexp(synthetic_logits.to(lse.dtype), dim=1))
        return lse - _positive_logits(queries, keys, logit_scale, offset)

    parts = [_dense_logits(queries, keys, logit_scale)]  # (n, M)
    if queue is not None:
        parts.append(_dense_logits(queries, queue, logit_scale))  # (n, Q)
    if synthetic_logits is not None:
        parts.append(synthetic_logits)
    all_logits = torch.cat(parts, dim=1)
    return F.cross_entropy(all_logits, rows + offset, reduction="none")


def _synthetic_logits(queries: Tensor, candidates: Tensor, hard: Tensor, draws, logit_scale: Tensor) -> Tensor:
    """Logits (n, s + s') of the queries against their MoCHi synthetic negatives (Kalantidis et al. 2020).

    ``s`` mixes ``a h_i + (1 - a) h_j`` of two hard negatives and ``s'`` mixes ``b q + (1 - b) h_k`` with the
    query, each normalised; `hard` (n, k) indexes `candidates`, `draws` = (pairs (n, s, 2), a (n, s, 1),
    picks (n, s'), b (n, s', 1)). The synthetic features carry no gradient; their logits still push the query
    away from them.
    """
    pairs, alpha, picks, beta = draws
    acc = _acc_dtype(queries.dtype)
    with torch.no_grad():
        q = queries.detach().to(acc)
        synthetic = []
        if pairs.shape[1] > 0:
            first = candidates[hard.gather(1, pairs[..., 0])]  # (n, s, D)
            second = candidates[hard.gather(1, pairs[..., 1])]
            synthetic.append(F.normalize(alpha * first + (1 - alpha) * second, dim=-1))
        if picks.shape[1] > 0:
            negative = candidates[hard.gather(1, picks)]  # (n, s', D)
            synthetic.append(F.normalize(beta * q[:, None, :] + (1 - beta) * negative, dim=-1))
        synthetic = torch.cat(synthetic, dim=1)  # (n, s + s', D)
    return logit_scale.to(acc) * torch.einsum("nd,nkd->nk", queries.to(acc), synthetic)


def mochi_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    n_hard: int,
    s: int,
    s_prime: int,
    mix_max: float,
    generator: torch.Generator,
    image_queue: Optional[Tensor] = None,
    text_queue: Optional[Tensor] = None,
    *,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """InfoNCE with MoCHi synthetic hard negatives (Kalantidis et al. 2020), both directions averaged.

    For each query (image->text against all texts and ``text_queue``; text->image against all images and
    ``image_queue``), its negatives are ranked by similarity and the ``n_hard`` hardest kept; ``s`` synthetic
    negatives are normalised mixes ``a h_i + (1 - a) h_j`` of two random hard ones (a ~ U(0, 1)) and
    ``s_prime`` harder ones are normalised mixes ``b q + (1 - b) h_k`` with the query (b ~ U(0, mix_max)).
    Synthetic features are detached. Random draws come from ``generator`` on the CPU, in this order for
    image->text then text->image: pair indices (M, s, 2), a (M, s, 1), indices (M, s'), b (M, s', 1), where
    M is the global batch size; rank-local rows use the slice at ``offset``.

    Args:
        image_features, text_features: (n, D) float, L2-normalised.  logit_scale: 0-dim tensor s.
        n_hard, s, s_prime: counts (n_hard >= 1, s, s_prime >= 0).  mix_max: in (0, 1].
        generator: CPU torch.Generator.  image_queue, text_queue: (Q, D) past features or None.
        all_image_features, all_text_features, offset: as in `clip_loss`.
        chunk_size: None for the dense (n, M + Q) logits; an int ranks and sums them in blocks of that many rows
            (memory linear in M + Q; the synthetic negatives are still n x (s + s') x D).
    Returns:
        0-dim tensor.
    """
    _check_pair(image_features, text_features)
    _check_chunk(chunk_size)
    if n_hard < 1 or s < 0 or s_prime < 0:
        raise ConfigError(
            f"MoCHi needs n_hard >= 1 and s, s_prime >= 0 (got n_hard={n_hard}, s={s}, s_prime={s_prime})"
        )
    if not 0 < mix_max <= 1:
        raise ConfigError(f"MoCHi mix_max must be in (0, 1] (got {mix_max}; the paper uses 0.5)")
    logit_scale = _as_scale(logit_scale, image_features)
    image_features, text_features, all_image_features, all_text_features = _upcast(
        image_features, text_features, all_image_features, all_text_features
    )
    all_img, all_txt, offset, _ = _columns(image_features, text_features, all_image_features, all_text_features, offset)
    i2t = _mochi_rows(image_features, all_txt, text_queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                      chunk_size)
    t2i = _mochi_rows(text_features, all_img, image_queue, logit_scale, offset, n_hard, s, s_prime, mix_max, generator,
                      chunk_size)
    return (i2t.mean() + t2i.mean()) / 2


class FeatureQueue(nn.Module):
    """First-in-first-out store of past (detached) features, kept in buffers so checkpoints carry it.

    The feature width is taken from the first `enqueue` (or from a loaded state dict), so the queue can be
    built from the loss config alone.
    """

    def __init__(self, size: int):
        super().__init__()
        if size < 0:
            raise ConfigError(f"queue size must be >= 0 (got {size})")
        self.size = int(size)
        self.register_buffer("features", torch.zeros(0, 0))  # (size, D) float32 once used
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        return int(self.count)

    @torch.no_grad()
    def enqueue(self, x: Tensor) -> None:
        """Append (B, D) features, overwriting the oldest once full."""
        if self.size == 0:
            return
        if self.features.shape != (self.size, x.shape[1]):
            if int(self.count) > 0:
                raise DataError(f"queue holds width {self.features.shape[1]} features, got {x.shape[1]}")
            self.features = torch.zeros(self.size, x.shape[1], dtype=torch.float32, device=x.device)
        x = x.detach()[-self.size:].to(self.features)
        idx = (int(self.ptr) + torch.arange(x.shape[0], device=x.device)) % self.size
        # A new buffer, not a write into the old one: the tensor `get` returned for this step's loss is still
        # in the autograd graph (the queries' gradient needs it), and an in-place write would invalidate the
        # backward that follows. The copy costs one pass over the queue per step.
        self.features = self.features.index_copy(0, idx, x)
        self.ptr.fill_((int(self.ptr) + x.shape[0]) % self.size)
        self.count.fill_(min(int(self.count) + x.shape[0], self.size))

    def get(self) -> Optional[Tensor]:
        """The stored (count, D) float32 features, or None when empty."""
        count = int(self.count)
        return self.features[:count] if count > 0 else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "features")
        if saved is not None and saved.shape != self.features.shape:
            if saved.dim() != 2 or saved.shape[0] not in (0, self.size):
                raise CheckpointError(
                    f"saved queue has shape {tuple(saved.shape)}, expected ({self.size}, D) "
                    "(loss.mochi.queue_size changed?)"
                )
            self.features = torch.zeros(saved.shape, dtype=torch.float32, device=self.features.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Alignment and uniformity (Wang & Isola 2020)
# ----------------------------------------------------------------------------------------------------------


def align_loss(x: Tensor, y: Tensor, alpha: float = 2.0) -> Tensor:
    """Alignment ``mean_i ||x_i - y_i||_2^alpha`` over positive pairs.

    Args: x, y: (B, D) float, row i of each a positive pair.  alpha: exponent > 0.
    Returns: 0-dim tensor.
    """
    if x.shape != y.shape:
        raise DataError(f"align_loss needs equal shapes (got {tuple(x.shape)} and {tuple(y.shape)})")
    acc = _acc_dtype(x.dtype)
    x, y = x.to(acc), y.to(acc)  # half-precision differences of near-equal features lose most of their bits
    if alpha == 2:
        # The squared norm avoids the sqrt, whose gradient is undefined at x_i == y_i.
        return (x - y).pow(2).sum(dim=1).mean()
    return (x - y).norm(p=2, dim=1).pow(alpha).mean()


def _sq_dists(a: Tensor, b: Tensor) -> Tensor:
    # |a|^2 + |b|^2 - 2 a.b: one matmul and a smooth gradient everywhere (cdist's is undefined at 0). Built
    # in float32 at least: in bf16 the three terms of size ~1 cancel to distances with an error of ~1e-2.
    acc = _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    d = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None, :] - 2 * (a @ b.T)
    return d.clamp_min(0)


def uniform_loss(x: Tensor, t: float = 2.0) -> Tensor:
    """Uniformity ``log mean_{i<j} exp(-t ||x_i - x_j||^2)`` over distinct pairs of one batch.

    Args: x: (B, D) float with B >= 2.  t: temperature > 0.
    Returns: 0-dim tensor (computed as a log-sum-exp, so it is finite for any spread).
    """
    b = x.shape[0]
    if b < 2:
        raise DataError(f"uniform_loss needs at least 2 items (got {b})")
    x = x.to(_acc_dtype(x.dtype))  # one cast, so both uses of x add their gradients in float32
    i, j = torch.triu_indices(b, b, offset=1, device=x.device)
    d = _sq_dists(x, x)[i, j]
    return torch.logsumexp(-t * d, dim=0) - math.log(d.numel())


def _uniform_log_partial(x: Tensor, all_x: Tensor, offset: int, t: float) -> Tensor:
    """``log sum_{i local, j != offset+i} exp(-t ||x_i - all_x_j||^2)`` (ordered pairs), a 0-dim tensor."""
    d = _sq_dists(x, all_x)
    rows = torch.arange(x.shape[0], device=x.device)
    d = d.index_put((rows, rows + offset), torch.tensor(math.inf, dtype=d.dtype, device=d.device))
    return torch.logsumexp((-t * d).flatten(), dim=0)


# ----------------------------------------------------------------------------------------------------------
# Gathering across ranks
# ----------------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather_with_grad(x: Tensor) -> Tensor:
    """Concatenate `x` (n, ...) of every rank along dim 0, differentiably (backward: summing reduce-scatter).

    torch's functional collective `all_gather_single` where this torch has it, else the older
    `torch.distributed.nn.functional.all_gather`, which torch 2.14 deprecates.
    """
    try:
        from torch.distributed._functional_collectives import all_gather_single, wait_tensor
    except ImportError:
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(x.contiguous()), dim=0)
    return wait_tensor(all_gather_single(x.contiguous(), 0, dist.group.WORLD))


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
    sizes = [torch.zeros(1, dtype=torch.long, device=image_features.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.long, device=image_features.device))
    sizes = [int(s.item()) for s in sizes]
    if len(set(sizes)) != 1:
        raise DataError(
            f"every rank must hold the same number of pairs (got per-rank batch sizes {sizes}; "
            "drop the last partial batch)"
        )
    all_image = _all_gather_with_grad(image_features)
    all_text = _all_gather_with_grad(text_features)
    all_labels = None
    if labels is not None:
        gathered = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(gathered, labels.contiguous())
        all_labels = torch.cat(gathered, dim=0)
    return all_image, all_text, all_labels, rank * n


# ----------------------------------------------------------------------------------------------------------
# The combined objective
# ----------------------------------------------------------------------------------------------------------


class ContrastiveObjective(nn.Module):
    """Weighted sum of the configured terms; holds the MoCHi queues and generator.

    ``forward(image_features, text_features, logit_scale, logit_bias=None, labels=None)`` returns
    ``(total_loss, terms)``. ``total_loss`` is this rank's 0-dim loss to backpropagate: when
    ``torch.distributed`` is initialised with several ranks, features are gathered with gradient and each
    rank's rows are scored against the global columns, so after DDP averages parameter gradients they equal
    a single process's on the global batch (see the module docstring). ``terms`` holds floats, averaged over
    ranks so they describe the global batch: ``loss`` (weighted total), ``loss/<name>`` for every active
    term, and the metrics ``align``, ``uniform_image``, ``uniform_text`` (no gradient; each rank's first
    4096 items, then averaged over ranks).

    ``labels`` (B,) integer, -1 for "no label", feed the supervised term; without labels every pair is its
    own class. In training mode, each call appends the global batch to the MoCHi queues after the loss.
    ``state_dict`` holds the queues and the generator state.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weights: Dict[str, float] = {
            name: float(getattr(cfg, name))
            for name in ("clip", "supcon", "siglip", "align", "uniform", "debiased", "hard_negative")
        }
        self.weights["mochi"] = float(cfg.mochi.weight)
        problems = [f"loss.{name} must be >= 0 (got {w})" for name, w in self.weights.items() if w < 0]
        if not any(w > 0 for w in self.weights.values()):
            problems.append("no loss term is active (got all weights 0, expected at least one > 0)")
        if cfg.chunk_size is not None and cfg.chunk_size <= 0:
            problems.append(f"loss.chunk_size must be a positive integer or null (got {cfg.chunk_size})")
        if (self.weights["debiased"] > 0 or self.weights["hard_negative"] > 0) and not 0 <= cfg.tau_plus < 1:
            problems.append(f"loss.tau_plus must be in [0, 1) (got {cfg.tau_plus})")
        if self.weights["hard_negative"] > 0 and cfg.hn_beta < 0:
            problems.append(f"loss.hn_beta must be >= 0 (got {cfg.hn_beta})")
        m = cfg.mochi
        if self.weights["mochi"] > 0 and (m.n_hard < 1 or m.s < 0 or m.s_prime < 0 or not 0 < m.mix_max <= 1):
            problems.append(
                f"loss.mochi needs n_hard >= 1, s >= 0, s_prime >= 0, 0 < mix_max <= 1 (got n_hard={m.n_hard}, "
                f"s={m.s}, s_prime={m.s_prime}, mix_max={m.mix_max})"
            )
        if m.queue_size < 0:
            problems.append(f"loss.mochi.queue_size must be >= 0 (got {m.queue_size})")
        if problems:
            raise ConfigError("; ".join(problems))
        size = m.queue_size if self.weights["mochi"] > 0 else 0
        self.image_queue = FeatureQueue(size)
        self.text_queue = FeatureQueue(size)
        self.generator = torch.Generator()
        self.generator.manual_seed(0)
        # The align/uniform metrics cost a pairwise pass over the batch; a trainer may turn them off on steps it
        # does not log (same value on every rank, since the logged numbers are reduced together).
        self.report_metrics = True

    def reseed(self, seed: int) -> None:
        """Seed the generator that draws MoCHi's mixing indices and coefficients (same seed on every rank)."""
        self.generator.manual_seed(int(seed))

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])

    def active_terms(self):
        """Names of the terms with a positive weight."""
        return [name for name, w in self.weights.items() if w > 0]

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        logit_bias: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
    ):
        _check_pair(image_features, text_features)
        cfg, w = self.cfg, self.weights
        logit_scale = _as_scale(logit_scale, image_features).clamp(max=cfg.max_logit_scale)
        if labels is not None:
            labels = _check_labels(labels.to(image_features.device), image_features.shape[0], image_features.device)
        distributed = _distributed()
        if distributed:
            all_img, all_txt, all_labels, offset = gather_features(image_features, text_features, labels)
            cols = dict(all_image_features=all_img, all_text_features=all_txt, offset=offset)
        else:
            all_img, all_txt, all_labels, offset = image_features, text_features, labels, 0
            cols = {}
        chunk = cfg.chunk_size

        values: Dict[str, Tensor] = {}
        if w["clip"] > 0:
            values["clip"] = clip_loss(image_features, text_features, logit_scale, chunk, **cols)
        if w["supcon"] > 0:
            values["supcon"] = supcon_loss(
                image_features, text_features, labels, logit_scale, chunk, **cols,
                **({"all_labels": all_labels} if distributed else {}),
            )
        if w["siglip"] > 0:
            if logit_bias is None:
                raise ConfigError(
                    "loss.siglip > 0 needs a model with a logit bias (got none; set model.init_logit_bias, e.g. -10)"
                )
            values["siglip"] = siglip_loss(
                image_features, text_features, logit_scale, logit_bias,
                **({"all_text_features": all_txt, "offset": offset} if distributed else {}),
                chunk_size=cfg.chunk_size,
            )
        if w["debiased"] > 0:
            values["debiased"] = debiased_clip_loss(
                image_features, text_features, logit_scale, cfg.tau_plus, chunk, **cols
            )
        if w["hard_negative"] > 0:
            values["hard_negative"] = hard_negative_clip_loss(
                image_features, text_features, logit_scale, cfg.tau_plus, cfg.hn_beta, chunk, **cols
            )
        if w["mochi"] > 0:
            m = cfg.mochi
            values["mochi"] = mochi_loss(
                image_features, text_features, logit_scale, m.n_hard, m.s, m.s_prime, m.mix_max, self.generator,
                self.image_queue.get(), self.text_queue.get(), **cols, chunk_size=chunk,
            )
        if w["align"] > 0:
            values["align"] = align_loss(image_features, text_features, cfg.align_alpha)
        if w["uniform"] > 0:
            values["uniform"] = (
                self._uniform(image_features, all_img, offset, distributed)
                + self._uniform(text_features, all_txt, offset, distributed)
            ) / 2

        total = sum(w[name] * value for name, value in values.items())
        with torch.no_grad():
            # float64 keeps the logged numbers exact for float64 inputs; MPS has no float64.
            log_dtype = torch.float32 if image_features.device.type == "mps" else torch.float64
            logged = {f"loss/{name}": value.detach().to(log_dtype) for name, value in values.items()}
            if self.report_metrics:
                logged.update(self._metrics(image_features, text_features))
            names = list(logged)
            stacked = torch.stack([logged[k].reshape(()).to(log_dtype) for k in names])
            if distributed:
                dist.all_reduce(stacked)
                stacked /= dist.get_world_size()
            numbers = stacked.tolist()
        terms = dict(zip(names, numbers))
        terms["loss"] = sum(w[name] * terms[f"loss/{name}"] for name in values)
        if self.training and w["mochi"] > 0:
            self.image_queue.enqueue(all_img)
            self.text_queue.enqueue(all_txt)
        return total, terms

    def _uniform(self, x: Tensor, all_x: Tensor, offset: int, distributed: bool) -> Tensor:
        t = self.cfg.uniform_t
        if not distributed:
            return uniform_loss(x, t)
        # Global uniformity is log(Z / P) with Z = sum_r Z_r summed over ranks' rows. Each rank returns the
        # global value plus a zero-valued term whose gradient is W * dZ_r / Z, so that DDP's average over
        # ranks gives d log Z exactly.
        world = dist.get_world_size()
        n_all = all_x.shape[0]
        if n_all < 2:
            raise DataError(f"uniform_loss needs at least 2 items (got {n_all})")
        log_part = _uniform_log_partial(x, all_x, offset, t)  # log Z_r, 0-dim
        parts = [torch.zeros(1, dtype=log_part.dtype, device=log_part.device) for _ in range(world)]
        dist.all_gather(parts, log_part.detach().reshape(1))
        log_total = torch.logsumexp(torch.cat(parts), dim=0)
        value = log_total - math.log(n_all * (n_all - 1))
        return value + world * (torch.exp(log_part - log_total) - torch.exp(log_part.detach() - log_total))

    @torch.no_grad()
    def _metrics(self, image_features: Tensor, text_features: Tensor) -> Dict[str, Tensor]:
        acc = _acc_dtype(image_features.dtype)
        img = image_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        txt = text_features[:_METRIC_MAX_ITEMS].detach().to(acc)
        out = {"align": align_loss(img, txt, self.cfg.align_alpha)}
        if img.shape[0] >= 2:
            out["uniform_image"] = uniform_loss(img, self.cfg.uniform_t)
            out["uniform_text"] = uniform_loss(txt, self.cfg.uniform_t)
        else:
            nan = torch.tensor(math.nan, device=img.device)
            out["uniform_image"] = out["uniform_text"] = nan
        return out


def build_objective(cfg) -> ContrastiveObjective:
    """Build the training objective from a `mmcl.config.LossConfig`."""
    return ContrastiveObjective(cfg)
