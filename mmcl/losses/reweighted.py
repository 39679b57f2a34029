"""Reweighted negatives: hard-negative and debiased CLIP losses."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .clip import DenseLogSumExp, dense_logits, positive_logits
from .errors import LossInputError
from .inputs import Gathered, check_chunk, check_pair, gathered_columns
from .precision import float32_math
from .tiling import TiledLogSumExp, as_scale, upcast


def negative_lse(image_features, text_features, all_img, all_txt, logit_scale, gammas, offset, chunk_size,
                  single):
    """The positive logits and, per gamma, the log sums over the negatives j != offset+i of exp(gamma * s * q_i.k_j).

    Returns ((p_i2t, p_t2i), [(i2t, t2i) per gamma]), all (n,). The positive is excluded inside the sum (masked to
    -inf), never subtracted from the full log-sum-exp: log(e^lse - e^p) cancels completely once the positive
    dominates its row (a trained model at scale 100). All gammas come from one logit matrix (one pass over the
    tiles), and with the whole batch in this process both directions too; the tiled path also reads the
    positives from its tiles, so their gradient shares its buffers.
    """
    if chunk_size is None:
        def masked(q, k):
            logits = dense_logits(q, k, logit_scale)
            rows = torch.arange(q.shape[0], device=q.device)
            minus_inf = torch.full((), -math.inf, dtype=logits.dtype, device=logits.device)
            return logits.index_put((rows, rows + offset), minus_inf)

        positives = (positive_logits(image_features, all_txt, logit_scale, offset),
                     positive_logits(text_features, all_img, logit_scale, offset))
        if single:
            logits = masked(image_features, text_features)
            return positives, [(DenseLogSumExp.apply(g * logits, 1), DenseLogSumExp.apply(g * logits, 0))
                               for g in gammas]
        i2t, t2i = masked(image_features, all_txt), masked(text_features, all_img)
        return positives, [(DenseLogSumExp.apply(g * i2t, 1), DenseLogSumExp.apply(g * t2i, 1)) for g in gammas]
    if single:
        rows, cols, positive = TiledLogSumExp.apply(image_features, text_features, logit_scale, chunk_size, True,
                                                    None, 0, gammas, True)
        return (positive, positive), list(zip(rows.unbind(0), cols.unbind(0)))
    i2t, p_i2t = TiledLogSumExp.apply(image_features, all_txt, logit_scale, chunk_size, False, None, offset, gammas,
                                      True)
    t2i, p_t2i = TiledLogSumExp.apply(text_features, all_img, logit_scale, chunk_size, False, None, offset, gammas,
                                      True)
    return (p_i2t, p_t2i), list(zip(i2t.unbind(0), t2i.unbind(0)))


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
        raise LossInputError(f"tau_plus must be in [0, 1) (got {tau_plus})")
    if beta < 0:
        raise LossInputError(f"hard-negative beta must be >= 0 (got {beta})")


@float32_math
def hard_negative_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    tau_plus: float,
    beta: float,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
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
        chunk_size, gathered: as in `clip_loss`.
    Returns:
        0-dim tensor.
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    _check_tau_beta(tau_plus, beta)
    logit_scale = as_scale(logit_scale, image_features)
    image_features, text_features = upcast(image_features, text_features)
    all_img, all_txt, offset, single = gathered_columns(image_features, text_features, gathered)
    if all_img.shape[0] < 2:
        raise LossInputError(
            f"debiased / hard-negative losses need at least 2 pairs in the batch (got {all_img.shape[0]})")
    n_neg = all_img.shape[0] - 1
    # Importance weights exp(beta * L) normalised by their mean: the reweighted negative sum is
    # N * sum exp((1+beta) L) / sum exp(beta L), whose log is a difference of two log-sum-exps.
    gammas = (1.0 + beta, beta) if beta != 0 else (1.0,)
    positives, lse = negative_lse(image_features, text_features, all_img, all_txt, logit_scale, gammas, offset,
                                   chunk_size, single)
    log_neg = lse[0] if beta == 0 else tuple(a - b + math.log(n_neg) for a, b in zip(lse[0], lse[1]))
    i2t = _reweighted_rows(positives[0], log_neg[0], logit_scale, n_neg, tau_plus)
    t2i = _reweighted_rows(positives[1], log_neg[1], logit_scale, n_neg, tau_plus)
    return (i2t.mean() + t2i.mean()) / 2


@float32_math
def debiased_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    tau_plus: float,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
) -> Tensor:
    """Debiased contrastive loss (Chuang et al. 2020), symmetric; `hard_negative_clip_loss` with beta = 0."""
    return hard_negative_clip_loss(
        image_features, text_features, logit_scale, tau_plus, 0.0, chunk_size, gathered=gathered)


# ----------------------------------------------------------------------------------------------------------
# MoCHi (Kalantidis et al. 2020)
# ----------------------------------------------------------------------------------------------------------


