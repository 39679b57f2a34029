"""Supervised contrastive loss over labels (`supcon_loss`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import LossInputError
from .tiling import TiledLogSumExp, _acc_dtype, _as_scale, _check_chunk, _upcast
from .clip import _check_pair, _columns, _dense_logits, _positive_logits


def _check_labels(labels: Optional[Tensor], n: int, device) -> Tensor:
    if labels is None:
        return torch.full((n,), -1, dtype=torch.long, device=device)
    if labels.shape != (n,) or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise LossInputError(
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
            raise LossInputError(f"all_labels[{offset}:{offset + n}] must equal this rank's labels")
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


