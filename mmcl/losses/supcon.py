"""Supervised contrastive loss over labels (`supcon_loss`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import LossInputError
from .tiling import TiledLogSumExp, _as_scale, _check_chunk, _upcast
from .clip import DenseLogSumExp, _check_pair, _columns, _dense_logits


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
    logits = _dense_logits(queries, keys, logit_scale)  # (n, M)
    rows = torch.arange(n, device=queries.device)
    positive = (q_labels[:, None] == k_labels[None, :]) & (q_labels[:, None] >= 0)
    positive[rows, rows + offset] = True  # the pair itself, also for unlabelled (-1) pairs
    # mean over positives of -log softmax = lse - mean of the positive logits; the log-sum-exp's backward forms
    # no subnormal (log_softmax's took 67 s instead of 0.3 at N = 2048, scale 100, aligned pairs)
    weights = positive.to(logits.dtype) / positive.sum(dim=1, keepdim=True)
    return DenseLogSumExp.apply(logits, 1) - (logits * weights).sum(dim=1)


def _class_index(q_labels, k_labels):
    """(q_cls (n,), k_cls (M,), counts (C + 1,)): dense class ids, unlabelled keys in a spare bucket C."""
    n = q_labels.shape[0]
    classes, inverse = torch.unique(torch.cat([q_labels, k_labels]), return_inverse=True)
    q_cls, k_cls = inverse[:n], inverse[n:]
    spare = classes.numel()  # bucket collecting unlabelled keys, never read
    k_cls = torch.where(k_labels >= 0, k_cls, spare)
    counts = torch.zeros(spare + 1, dtype=torch.float64, device=k_labels.device).index_add(
        0, k_cls, torch.ones_like(k_cls, dtype=torch.float64))
    return q_cls, k_cls, counts


def _positive_means(keys, q_labels, k_labels, offset):
    """Mean of each query's positive keys, (n, D): its class mean, or its own pair when unlabelled."""
    q_cls, k_cls, counts = _class_index(q_labels, k_labels)
    sums = keys.new_zeros(counts.shape[0], keys.shape[1]).index_add(0, k_cls, keys)
    means = sums[q_cls]
    means.div_(counts.to(keys.dtype)[q_cls].clamp_min(1)[:, None])  # (an unlabelled query's bucket may be empty)
    unlabelled = torch.nonzero(q_labels < 0).squeeze(1)
    return means.index_copy_(0, unlabelled, keys[offset + unlabelled])


class _PositiveMeanLogits(torch.autograd.Function):
    """``s * q_i . mean_{p in P(i)} k_p`` (n,), with the means rebuilt in backward instead of kept.

    The same numbers as `_positive_logits(queries, _positive_means(keys, ...), s, 0)` through autograd, without
    the (n, D) means, their masked copy and their gradients held at the peak: each is as large as a feature
    gradient, and at N = 16384 those buffers were what put the tiled SupCon above 5 % of ClipLoss's memory.
    Args (apply): queries (n, D), keys (M, D), logit_scale 0-dim, q_labels (n,), k_labels (M,), offset int.
    """

    @staticmethod
    def forward(ctx, queries, keys, logit_scale, q_labels, k_labels, offset: int):
        dots = torch.linalg.vecdot(queries, _positive_means(keys, q_labels, k_labels, offset))
        ctx.offset = offset
        ctx.save_for_backward(queries, keys, logit_scale, q_labels, k_labels, dots)
        return logit_scale * dots

    @staticmethod
    @torch.autograd.function.once_differentiable
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
        # (C + 1, n) sparse one-hot of the query classes times the queries: no (n, D) temporary
        onehot = torch.sparse_coo_tensor(torch.stack([q_cls, torch.arange(n, device=q_cls.device)]), per_query,
                                         (counts.shape[0], n), check_invariants=False)  # valid by construction
        class_sum = torch.sparse.mm(onehot, queries)
        class_sum[-1] = 0  # the spare bucket of unlabelled keys is nobody's class
        grad_k = class_sum[k_cls]
        own = torch.where(labelled, 0, weight)
        grad_k[offset:offset + n].addcmul_(queries, own[:, None])
        return grad_q, grad_k, (grad * dots).sum().reshape(logit_scale.shape), None, None, None


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
    pos_i2t = _PositiveMeanLogits.apply(image_features, all_txt, logit_scale, labels, all_labels, offset)
    pos_t2i = _PositiveMeanLogits.apply(text_features, all_img, logit_scale, labels, all_labels, offset)
    return ((lse_i2t - pos_i2t).mean() + (lse_t2i - pos_t2i).mean()) / 2


# ----------------------------------------------------------------------------------------------------------
# SigLIP (Zhai et al. 2023)
# ----------------------------------------------------------------------------------------------------------


