"""Supervised contrastive loss over labels (`supcon_loss`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .clip import DenseLogSumExp, dense_logits
from .inputs import Gathered, check_chunk, check_labels, check_on_device, check_pair, gathered_columns
from .precision import float32_math
from .tiling import TiledLogSumExp, as_scale, upcast

# Entries of a per-class table: its (M + 1) buckets (one per possible class) are built a block of feature columns
# at a time, so the table stays at most 1/8 of a feature matrix (or 4 MiB) where a whole (M + 1, D) one would weigh
# as much as a feature gradient; at most 8 blocks, so a few dozen ops per step.
_TABLE_ELEMENTS = 1 << 20


def _feature_blocks(buckets: int, width: int):
    """Slices of the feature columns, each holding at most max(`_TABLE_ELEMENTS`, buckets * width / 8) entries of a
    `buckets`-row table."""
    step = max(1, min(width, max(_TABLE_ELEMENTS, buckets * width // 8) // max(buckets, 1)))
    return [slice(c0, min(width, c0 + step)) for c0 in range(0, width, step)]


def _supcon_rows_dense(queries, keys, logit_scale, q_labels, k_labels, offset):
    n = queries.shape[0]
    logits = dense_logits(queries, keys, logit_scale)  # (n, M)
    rows = torch.arange(n, device=queries.device)
    positive = (q_labels[:, None] == k_labels[None, :]) & (q_labels[:, None] >= 0)
    positive[rows, rows + offset] = True  # the pair itself, also for unlabelled (-1) pairs
    # mean over positives of -log softmax = lse - mean of the positive logits; the log-sum-exp's backward forms
    # no subnormal (log_softmax's took 67 s instead of 0.3 at N = 2048, scale 100, aligned pairs)
    weights = positive.to(logits.dtype) / positive.sum(dim=1, keepdim=True)
    return DenseLogSumExp.apply(logits, 1) - (logits * weights).sum(dim=1)


def _class_index(q_labels, k_labels):
    """(q_cls (n,), k_cls (M,), counts (M + 1,)): class ids in [0, M) (a label's first position among the sorted key
    labels), unlabelled keys and queries in a spare bucket M.

    The number of classes is data, so the buckets are sized by M, the largest it can be: every shape here follows
    from the inputs' shapes, and nothing (no `unique`, no `nonzero`) reads a device value on the host. A query's
    label is among the keys' (its own pair is one of them)."""
    m = k_labels.shape[0]
    sorted_labels = torch.sort(k_labels).values
    k_cls = torch.where(k_labels >= 0, torch.searchsorted(sorted_labels, k_labels), m)
    q_cls = torch.where(q_labels >= 0, torch.searchsorted(sorted_labels, q_labels), m)
    counts = torch.zeros(m + 1, dtype=torch.float64, device=k_labels.device).index_add(
        0, k_cls, torch.ones_like(k_cls, dtype=torch.float64))
    return q_cls, k_cls, counts


def _positive_means(keys, q_labels, k_labels, offset):
    """Mean of each query's positive keys, (n, D): its class mean, or its own pair when unlabelled."""
    q_cls, k_cls, counts = _class_index(q_labels, k_labels)
    means = keys.new_empty(q_labels.shape[0], keys.shape[1])
    for cols in _feature_blocks(counts.shape[0], keys.shape[1]):
        table = keys.new_zeros(counts.shape[0], cols.stop - cols.start).index_add_(0, k_cls, keys[:, cols])
        means[:, cols] = table[q_cls]
    means.div_(counts.to(keys.dtype)[q_cls].clamp_min(1)[:, None])
    # The own pair's key for unlabelled queries: mean * 1 + own * 0 and mean * 0 + own * 1 are exact.
    unlabelled = (q_labels < 0).to(keys.dtype)[:, None]
    own = keys[offset:offset + q_labels.shape[0]]
    return means.mul_(1 - unlabelled).addcmul_(own, unlabelled)


class _PositiveMeanLogits(torch.autograd.Function):
    """``s * q_i . mean_{p in P(i)} k_p`` (n,), with the means rebuilt in backward instead of kept.

    The same numbers as `positive_logits(queries, _positive_means(keys, ...), s, 0)` through autograd, without
    the (n, D) means, their masked copy and their gradients held at the peak: each is as large as a feature
    gradient, and at N = 16384 those buffers were what put the tiled SupCon above 5 % of ClipLoss's memory.
    Args (apply): queries (n, D), keys (M, D), logit_scale 0-dim, q_labels (n,), k_labels (M,), offset int.
    """

    @staticmethod
    @float32_math
    def forward(ctx, queries, keys, logit_scale, q_labels, k_labels, offset: int):
        dots = torch.linalg.vecdot(queries, _positive_means(keys, q_labels, k_labels, offset))
        ctx.offset = offset
        ctx.save_for_backward(queries, keys, logit_scale, q_labels, k_labels, dots)
        return logit_scale * dots

    @staticmethod
    @torch.autograd.function.once_differentiable
    @float32_math
    def backward(ctx, grad):
        queries, keys, logit_scale, q_labels, k_labels, dots = ctx.saved_tensors
        n, offset = queries.shape[0], ctx.offset
        weight = grad * logit_scale  # d/d(q_i . mean_i)
        grad_q = _positive_means(keys, q_labels, k_labels, offset).mul_(weight[:, None])
        # Every key of class c receives sum over the queries i of class c of weight_i q_i / count_c; an
        # unlabelled query's own key receives weight_i q_i.
        q_cls, k_cls, counts = _class_index(q_labels, k_labels)
        labelled = q_labels >= 0
        per_query = torch.where(labelled, weight / counts.to(weight.dtype)[q_cls], 0)
        # Per class, the sum of its queries' weighted rows, then read back by every key of the class; a block of
        # feature columns at a time (a sparse one-hot matmul would coalesce its indices: a count read on the host).
        grad_k = keys.new_empty(keys.shape)
        for cols in _feature_blocks(counts.shape[0], queries.shape[1]):
            class_sum = queries.new_zeros(counts.shape[0], cols.stop - cols.start).index_add_(
                0, q_cls, queries[:, cols] * per_query[:, None])
            class_sum[-1] = 0  # the spare bucket of unlabelled keys is nobody's class
            grad_k[:, cols] = class_sum[k_cls]
        own = torch.where(labelled, 0, weight)
        grad_k[offset:offset + n].addcmul_(queries, own[:, None])
        return grad_q, grad_k, (grad * dots).sum().reshape(logit_scale.shape), None, None, None


@float32_math
def supcon_loss(
    image_features: Tensor,
    text_features: Tensor,
    labels: Optional[Tensor],
    logit_scale: Tensor,
    chunk_size: Optional[int] = None,
    *,
    gathered: Optional[Gathered] = None,
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
        gathered: the global batch's columns and their labels (``all_labels``, None for all -1), see `clip_loss`.
    Returns:
        0-dim tensor.
    """
    check_pair(image_features, text_features)
    check_chunk(chunk_size)
    logit_scale = as_scale(logit_scale, image_features)
    image_features, text_features = upcast(image_features, text_features)
    n = image_features.shape[0]
    labels = check_labels(labels, n, image_features.device)
    all_img, all_txt, offset, single = gathered_columns(image_features, text_features, gathered)
    if single:
        all_labels = labels
    else:
        all_labels = check_labels(gathered.all_labels, all_img.shape[0], image_features.device)
        check_on_device((all_labels[offset:offset + n] == labels).all(),
                         f"all_labels[{offset}:{offset + n}] must equal this rank's labels")
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
    pos_i2t = _PositiveMeanLogits.apply(image_features, all_txt, logit_scale, labels, all_labels, offset)
    pos_t2i = _PositiveMeanLogits.apply(text_features, all_img, logit_scale, labels, all_labels, offset)
    return ((lse_i2t - pos_i2t).mean() + (lse_t2i - pos_t2i).mean()) / 2


# ----------------------------------------------------------------------------------------------------------
# SigLIP (Zhai et al. 2023)
# ----------------------------------------------------------------------------------------------------------


